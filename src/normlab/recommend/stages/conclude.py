"""The conclusion: the evidence per candidate (`evidence_rows`: screen verdict, runs, ranked by `rank.rank`),
checked against the recipes' verdicts (`agreement`), the leader's gated speedup (`speedup_gate`), the answer sized
to its evidence (`answer`), the winner's settings in five code bases (`frameworks`), and the recommendation
written: recommendation.md, recommendation.json, report.html (the words `explain`'s, the files written by
`page.write_recommendation`). Written before the verify stage and again with its verdict.

`conclude` is one pass that reads each of those modules in one stretch: what the context holds first (`_facts`),
then the ranking, the checks, the speedup, the words about the evidence, the sizing, the settings, the record and
its files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from normlab.recommend.evidence import agreement, answer
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.evidence.rows import ranking, seeds_that_ran
from normlab.recommend.frameworks.snippets import settings_for
from normlab.recommend.planning import derived
from normlab.recommend.planning.plan_record import Plan
from normlab.recommend.report import explain, page
from normlab.recommend.stages.context import Context
from normlab.recommend.stages.records import (
    Confidence,
    FinalRecord,
    PlanRecord,
    Recommendation,
    StageRecord,
    StressRecord,
)
from normlab.recommend.stages.speedup_gate import gated_speedup


@dataclass(frozen=True)
class Facts:
    """What the conclusion reads from the context and the folder, read once at its start."""

    model: str
    calls: int
    call_minutes: list[float]
    minutes: float
    plan: Plan
    final: FinalRecord  # the final round's record
    rounds: list[StageRecord]  # this call's stages
    stress: StressRecord
    plan_record: PlanRecord  # recommendation.json's "plan": what the plan was and what the rounds ran
    files: dict[str, str]


class Sized(NamedTuple):
    """The answer sized to its evidence (`_sized`): the Recommendation's fields of the same names."""

    effect: dict[str, Any]
    confidence: Confidence
    changed_from: dict[str, Any] | None
    recipe: dict[str, Any]
    domain: dict[str, Any]


def _facts(ctx: Context) -> Facts:
    p, found, folder = ctx.plan, ctx.found, ctx.folder
    assert found.final is not None and found.screen is not None
    calls, minutes, model = ctx.calls, ctx.clock.used_minutes(), ctx.user.describe()
    final, rounds = found.final, list(ctx.rounds)
    stress = StressRecord(p.depth, ctx.cfg.depth is not None, list(found.order), p.stress_lr)
    plan_record = PlanRecord(
        found.screen.width, p.depth, stress, final, list(p.cut), dict(p.predicted), list(p.screened), list(p.order),
        p.ladder,
    )  # fmt: skip
    files = {
        "grid": folder.grid_files(),
        "screen": folder.screen_file.name,
        "plan": folder.plan_file.name,
        "json": folder.json_file.name,
    }
    return Facts(
        model, len(calls), [*calls[:-1], minutes], minutes, p, final, rounds, stress, plan_record, files,
    )  # fmt: skip


def conclude(ctx: Context, verify: dict[str, Any] | None = None) -> Recommendation:
    """The recommendation from what the stages found, written to the folder (module doc)."""
    found, p = ctx.found, ctx.plan
    assert found.final is not None and found.runs is not None and found.screen is not None
    facts = _facts(ctx)
    ranked, winner, ranks = ranking(ctx)
    checks = agreement.check(ranks, ctx.precision, agreement.cells(found.runs))
    speed, decision = gated_speedup(ctx, ranked)
    record = explain.transfer_record()
    limits = explain.limits(ctx.user, ctx.precision, facts.stress, found.screen, ctx.extra, ranked)
    movement = explain.movement(ranked, facts.plan, facts.final, facts.rounds)
    sized = _sized(ctx, facts, ranked, winner, speed, record)
    named = (winner.short, winner.label) if winner and winner.short else None  # a change to the user's placement
    settings = (
        settings_for(winner.layout, ctx.user.config, ctx.user.layout, ctx.user.unmodelled, named) if winner else {}
    )  # the winner's settings in the code bases, a change named by its short name and words
    result = Recommendation(
        model=facts.model,
        notes=list(ctx.user.notes),
        precision=ctx.precision,
        current=ctx.current,
        winner=winner.layout if winner else None,
        ranking=list(map(Evidence.to_dict, ranked)),
        recipe_checks=checks,
        settings=settings,
        limits=limits,
        optimizer=p.optimizer,
        verify=verify or {"status": "not asked"},
        transfer_record=record,
        plan=facts.plan_record,
        rounds=facts.rounds,
        movement=movement,
        minutes=facts.minutes,
        budget_minutes=ctx.clock.budget_s / 60,
        call_minutes=facts.call_minutes,
        files=facts.files,
        dropped=derived.dropped(ctx.current, winner.layout) if winner else [],
        labels=dict(ctx.labels),
        verdict=decision,
        effect=sized.effect,
        confidence=sized.confidence,
        changed_from=sized.changed_from,
        recipe=sized.recipe,
        domain=sized.domain,
    )
    result = replace(result, text=explain.markdown(result, ranked))
    page.write_recommendation(ctx.folder, result, ranked)
    return result


def _sized(
    ctx: Context,
    facts: Facts,
    ranked: list[Evidence],
    winner: Evidence | None,
    speed: dict[str, Any] | None,
    record: dict[str, Any],
) -> Sized:
    """The answer sized to its evidence (`normlab.recommend.evidence.answer`): the effect (with the gated speedup), the
    confidence (its seeds those that ran: `seeds_that_ran`), what changed since the last call (kept in plan.json's
    "answers"), the recipe and the domain; the fields of the Recommendation they fill."""
    found, p = ctx.found, ctx.plan
    assert found.final is not None and found.runs is not None
    name = winner.layout if winner else None
    answers = ctx.saved.setdefault("answers", [])
    eff = answer.effect(found.runs, ranked, ctx.current, len(found.final.lrs))
    eff["speedup"] = speed
    # every call's rounds (a resumed call's own are in ctx.rounds; earlier calls' cuts are in plan.json)
    confidence = answer.confidence(ranked, facts.rounds, facts.plan, eff)
    changed = answer.changed_from(answers, name)
    recipe = answer.recipe(winner, optimizer=p.optimizer, record=record, width=ctx.user.config.d_model)
    domain = answer.domain(ctx.user, ctx.precision, p.optimizer, p.depth, record, ctx.cfg.tokens, name)
    conf = seeds_that_ran(confidence, found.runs, winner)
    entry = {"call": facts.calls, "winner": name, "confidence": conf.level, "runs": sum(conf.runs.values())}
    if not answers or answers[-1] != entry:
        answers.append(entry)
    return Sized(eff, conf, changed, recipe, domain)


class Conclude:
    """The last stage: the ranking, the checks, the settings and the recommendation's files."""

    name = "conclude"

    def cost(self, ctx: Context) -> float:
        return ctx.plan.predicted["reserves"]

    def done(self, ctx: Context) -> bool:
        """Written in this call with the verify record as it stands."""
        return ctx.found.result is not None and ctx.found.concluded is ctx.found.verified

    def run(self, ctx: Context) -> None:
        ctx.found.result = conclude(ctx, ctx.found.verified)
        ctx.found.concluded = ctx.found.verified
        ctx.mark()
