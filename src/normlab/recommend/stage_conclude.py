"""The conclusion: the evidence per candidate (screen verdict, runs, ranked by `rank.rank`), checked
against the recipes' verdicts (`agreement`), the winner's settings in five code bases (`frameworks`), and
the recommendation written: recommendation.md, recommendation.json, report.html (`explain`). Written
before the verify stage and again with its verdict.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd

from normlab.io import atomic_write_bytes, atomic_write_json
from normlab.layout import as_layout
from normlab.model.params import analytic_params
from normlab.recommend import agreement, answer, derived, explain, gate, ladder, speedup, tax
from normlab.recommend.context import Context
from normlab.recommend.frameworks import settings_for
from normlab.recommend.rank import (
    Evidence,
    baseline_of,
    evidence_from_grid,
    rank,
    screen_reason,
    unranked_if_unfinished,
)
from normlab.recommend.records import FinalRecord, Recommendation
from normlab.recommend.shape import PROXY_WIDTH
from normlab.recommend.signals import with_signals
from normlab.runs.outcome import FINISHED


def _unscreened(ctx: Context, name: str) -> Evidence:
    why = f"not tried in this budget (the cheap screen put it after the {len(ctx.plan.screened)} chosen)"
    return Evidence(layout=name, screen="not screened", screen_detail="", status="not trained", why=why)


def evidence(ctx: Context) -> list[Evidence]:
    """Each candidate's evidence row, ranked: the final round's ranked, then those the final round did not
    take (and a baseline finalist) in the stress round's order, then those ruled out or not trained."""
    found, order = ctx.found, ctx.found.order
    final, runs = found.final, found.runs
    assert final is not None and runs is not None
    finalists = final.finalists or order
    per_final = len(final.lrs) * len(final.seeds)
    extended = final.extended or {}
    planned = {
        n: (per_final + (len(final.seeds) if n in extended else 0)) if n in final.finalists else 1 for n in order
    }
    grid = evidence_from_grid(runs[runs.layout.isin(finalists)], {n: planned[n] for n in finalists})
    # the user's placement runs in the final round as the baseline even where the stress round did not put it
    # among the best; then it is ranked as those it displaced are, by its stress run, its final runs shown
    baseline = baseline_of(ctx.current, final.finalists, order)
    rows = []
    skipped = bool(found.screen.get("skipped"))  # --quick: no screen
    for n in ctx.candidates:
        if n not in found.screen["results"] and not (skipped and n in order):
            rows.append(_unscreened(ctx, n))
            continue
        if skipped:
            row = Evidence(layout=n, screen="not screened", screen_detail="")
        else:
            s = found.screen["results"][n]
            detail = f"{s['wellposedness']}; forward {s['forward']}; backward {s['backward']}"
            row = Evidence(layout=n, screen=s["verdict"], screen_detail=detail, screen_why=screen_reason(s))
        row.label, row.short = ctx.labels.get(n, ""), ctx.short.get(n, "")
        if n in found.out_by_screen:
            row.status, row.why = "ruled out", f"by the screen: {found.out_by_screen[n]}"
        elif n not in finalists:
            one = evidence_from_grid(runs[runs.layout == n], {n: 1})[n]
            for k, v in one.items():
                setattr(row, k, v)
            row.status = "stress round only"
            status = runs[runs.layout == n].status
            row.why = f"{status.iloc[0] if len(status) else 'not run'} at lr {ctx.plan.stress_lr:g}"
        else:
            for k, v in grid[n].items():
                setattr(row, k, v)
            if n == baseline:
                row.status = "baseline"
                row.why = (
                    f"ranked by its stress run, #{order.index(n) + 1} of {len(order)} there; in the final "
                    "round as your current placement"
                )
        rows.append(unranked_if_unfinished(row))
    ranked = rank(rows, prefer=ctx.current)
    # the candidates the final round did not take (and a baseline finalist) follow, in the stress round's order
    tail = sorted(
        (r for r in ranked if r.status in ("stress round only", "baseline")), key=lambda r: order.index(r.layout)
    )
    head = [r for r in ranked if r.status == "ranked"]
    for i, r in enumerate(tail, len(head) + 1):
        r.rank = i
    return head + tail + [r for r in ranked if r.status in ("ruled out", "not trained")]


def named(settings: dict[str, dict[str, Any]], winner: Evidence) -> dict[str, dict[str, Any]]:
    """The code bases' settings with the code headers naming a change to the user's placement by its name and
    words (`# normlab layout yours+emb (your model (gemma3) + embedding norm): "attn=..."`), not its string
    form alone."""
    if not winner.short:
        return settings
    old = f'# normlab layout "{winner.layout}"'
    new = f'# normlab layout {winner.short} ({winner.label}): "{winner.layout}"'
    return {
        fw: {k: v.replace(old, new) if isinstance(v, str) else v for k, v in entry.items()}
        for fw, entry in settings.items()
    }


def seeds_that_ran(conf: dict[str, Any], runs: pd.DataFrame, winner: Evidence | None) -> dict[str, Any]:
    """`answer.confidence` with its seeds those the winner's finished runs trained with, where fewer ran than the
    plan holds (the budget stopped the rest): "2 seed(s)" is never said of one; one seed is a reason it is
    provisional."""
    if winner is None or not len(runs) or not isinstance(conf.get("seeds"), int):
        return conf
    mine = runs[(runs.layout == winner.layout) & runs.status.isin(FINISHED)]
    ran = int(mine.seed.nunique())
    if ran >= conf["seeds"]:
        return conf
    why = list(conf.get("why") or [])
    if ran < 2 and not any(w.startswith("one seed") for w in why):
        why.append(f"one seed: no seed noise measured ({winner.layout}'s other seeds did not finish)")
    return {**conf, "seeds": ran, "why": why, "level": "provisional"}


def _plan_record(ctx: Context, stress: dict[str, Any], final: FinalRecord) -> dict[str, Any]:
    """recommendation.json's "plan": what the plan was and what the rounds ran."""
    p = ctx.plan
    return {
        "screen_width": ctx.found.screen["width"],
        "depth": p.depth,
        "stress": stress,
        "final": final.to_dict(),
        "cut": p.cut,
        "predicted": p.predicted,
        "screened": p.screened,
        "order": p.order,
        "ladder": p.ladder,
    }


TAX_TURNS_S = 40.0  # the eager tax's turns may take this long beyond its first five (a narrower interval)
COMPILED_MIN_S = 150.0  # the compiled tax is timed only with this much of the budget left (its compilation)


def norm_tax(ctx: Context, base: str, cand: str) -> dict[str, Any]:
    """The leader's norm tax against the user's placement at the user's shape (`normlab.recommend.tax`),
    eager and, where the budget leaves room for its compilation (or a cache holds it), compiled, within what
    is left of the budget; the compiled figure where measured (what a compiled run pays), else the eager one;
    where neither can be timed, why."""
    ctx.log(f"{ctx.clock.stamp()} norm tax: {ctx.labels.get(cand) or cand} against {base} at your width")
    end = ctx.clock.stop_at  # the report's reserve is left for the files still to write
    by_mode: dict[str, Any] = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled" and not ctx.cfg.tax_compiled:
            by_mode[mode] = {"value": None, "why": "not asked (--no-tax-compiled)"}
            continue
        if (
            mode == "compiled"
            and end - time.time() < COMPILED_MIN_S
            and not tax.is_cached(ctx.user.config, base, cand, mode)
        ):
            by_mode[mode] = {
                "value": None,
                "why": f"not timed: less than {COMPILED_MIN_S:g} s of the budget left "
                "for its compilation (benchmarks/norm_tax.py --compile times it)",
            }
            continue
        try:
            by_mode[mode] = tax.measure(
                ctx.user.config, base, cand, mode=mode, deadline=end, extra_s=TAX_TURNS_S
            ).to_dict()
        except tax.TaxSkipped as e:
            by_mode[mode] = {"value": None, "interval": None, "why": str(e)}
    chosen = by_mode["compiled"] if by_mode["compiled"].get("value") is not None else by_mode["eager"]
    return {**chosen, "by_mode": {m: {k: v for k, v in t.items() if k != "by_mode"} for m, t in by_mode.items()}}


def with_ladder(ctx: Context, sp: dict[str, Any], base: Evidence, lead: Evidence, tx: dict[str, Any]) -> None:
    """The speedup at each of the ladder's rungs (the proxy's among them), the trend over compute and its
    projection to the user's scale (`normlab.recommend.ladder`), and ladder.png; into `sp`."""
    assert ctx.found.runs is not None and ctx.plan.ladder is not None
    assert base.best_lr is not None and lead.best_lr is not None
    rungs = []
    proxy = dict(
        sp["by_scale"][0], compute=speedup.cell_compute(ctx.found.runs, ctx.folder.grid.path, base.layout, base.best_lr)
    )
    for w in sorted({PROXY_WIDTH, *(int(x) for x in ctx.plan.ladder["steps"])}):
        if w == PROXY_WIDTH:
            rungs.append({**proxy, "bound": sp.get("bound")})
            continue
        runs = speedup.gathered([ctx.folder.ladder(w, lr).path for lr in sorted({base.best_lr, lead.best_lr})])
        if runs is None:
            rungs.append({"width": w, "value": None, "why": "not trained"})
            continue
        # what each side's runs did at this rung: the gate counts a failure at any rung (normlab.recommend.gate)
        did = {
            n: {
                "failed": int(runs[runs.layout == n].status.isin(("diverged", "stalled")).sum()),
                "finished": int(runs[runs.layout == n].status.isin(FINISHED).sum()),
            }
            for n in (base.layout, lead.layout)
        }
        one = speedup.for_pair(runs, ctx.folder.path, base, lead, tx, w, ctx.plan.depth)
        compute = speedup.cell_compute(runs, ctx.folder.path, base.layout, base.best_lr)
        rungs.append(
            {
                "width": w,
                "depth": ctx.plan.depth,
                "tokens": one.get("by_scale", [{}])[0].get("tokens"),
                "compute": compute,
                "value": one.get("value"),
                "interval": one.get("interval"),
                "interval_bounded": one.get("interval_bounded"),
                "bound": one.get("bound"),
                "seeds": one.get("seeds"),
                "why": one.get("why"),
                "runs": did,
            }
        )
    sp["by_scale"] = rungs
    n = analytic_params(ctx.user.config, as_layout(base.layout).resolve(ctx.user.config.n_layers)).non_embedding
    scale, how = ladder.user_compute(ctx.user.config, n, ctx.cfg.tokens)
    usable = [r for r in rungs if r.get("compute")]
    sp["projection"] = {**ladder.fit(usable, scale), "tokens": how}
    # the gate reads the widest rung: its speedup and interval, or why there is none; and a failure at any rung
    widest = rungs[-1]
    sp["largest_rung"] = {
        "width": widest["width"],
        "value": widest.get("value"),
        "interval": widest.get("interval"),
        "bound": widest.get("bound"),
        "interval_bounded": widest.get("interval_bounded"),
        "why": widest.get("why") or (None if widest.get("interval") else "no interval at the widest rung"),
        "ladder_failures": {
            n: sum((r.get("runs") or {}).get(n, {}).get("failed", 0) for r in rungs) for n in (base.layout, lead.layout)
        },
    }
    try:
        ladder.figure(ctx.folder.ladder_figure, usable, sp["projection"])
    except (ValueError, RuntimeError) as e:  # a figure never costs the answer
        ctx.log(f"  ladder.png not drawn: {e}")


def gated_speedup(ctx: Context, ranked: list[Evidence]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The leader's effective speedup against the user's placement (with its norm tax) and the gate's verdict."""
    assert ctx.found.runs is not None
    base = next((r for r in ranked if r.layout == ctx.current), None) if ctx.current else None
    lead = gate.leader(ranked, ctx.current)
    sp: dict[str, Any] | None = None
    if base is not None and lead is not None:
        t0 = time.time()
        tx = norm_tax(ctx, base.layout, lead.layout)  # the placement's cost, whatever its runs did
        if base.best_lr is not None and lead.best_lr is not None:
            sp = speedup.for_pair(ctx.found.runs, ctx.folder.grid.path, base, lead, tx, PROXY_WIDTH, ctx.plan.depth)
            if ctx.found.ladder is not None:
                with_ladder(ctx, sp, base, lead, tx)
        else:
            who = base.layout if base.best_lr is None else lead.layout
            sp = {"baseline": base.layout, "candidate": lead.layout, "value": None, "interval": None, "tax": tx}
            sp["why"] = f"{who} finished no run: no loss to reach"
        sp["tax_seconds"] = time.time() - t0
    gated = sp
    if sp and sp.get("largest_rung"):  # the gate reads the ladder's widest rung (normlab.recommend.gate)
        gated = {**sp, **sp["largest_rung"]}
    return sp, gate.verdict(ranked, ctx.current, gated)


def ranked_now(ctx: Context) -> list[Evidence]:
    """The evidence rows ranked from the grid's runs, their signals read first."""
    found = ctx.found
    assert found.runs is not None
    if "at_risk" not in found.runs:  # the signals that predict trouble, from each finished run's probes
        found.runs = with_signals(found.runs, ctx.folder.grid, ctx.precision)
    return evidence(ctx)


def conclude(ctx: Context, verify: dict[str, Any] | None = None) -> Recommendation:
    """The recommendation from what the stages found, written to the folder (module doc). One pass, each step
    reading its own modules once: the ranking and its checks, the gated speedup, the answer's sizing, the
    winner's settings, then the record and its files."""
    assert ctx.found.final is not None and ctx.found.runs is not None
    ranked, winner, checks = _ranking(ctx)
    speed, decision = gated_speedup(ctx, ranked)
    record = explain.transfer_record()
    sized = {**_sized(ctx, ranked, winner, speed, record), "recipe_checks": checks, "verdict": decision}
    result = _record(ctx, ranked, winner, verify or {"status": "not asked"}, {**sized, "transfer_record": record})
    return _written(ctx, result, ranked)


def _ranking(ctx: Context) -> tuple[list[Evidence], Evidence | None, list[dict[str, Any]]]:
    """The evidence ranked, its winner (None where nothing ranked), and the recipes' verdicts checked against it."""
    assert ctx.found.runs is not None
    ranked = ranked_now(ctx)
    ranks = {r.layout: r.rank for r in ranked if r.rank is not None and r.finished}
    checks = agreement.check(ranks, ctx.precision, agreement.cells(ctx.found.runs))
    return ranked, (ranked[0] if ranked and ranked[0].rank is not None else None), checks


def _sized(
    ctx: Context,
    ranked: list[Evidence],
    winner: Evidence | None,
    speed: dict[str, Any] | None,
    record: dict[str, Any],
) -> dict[str, Any]:
    """The answer sized to its evidence (`normlab.recommend.answer`): the effect (with the gated speedup), the
    confidence (its seeds those that ran), what changed since the last call (kept in plan.json's "answers"), the
    recipe and the domain; the fields of the Recommendation they fill."""
    found, p = ctx.found, ctx.plan
    assert found.final is not None and found.runs is not None
    eff = answer.effect(found.runs, ranked, ctx.current, len(found.final.lrs))
    eff["speedup"] = speed
    rounds = [r.to_dict() for r in ctx.rounds]
    # every call's rounds (a resumed call's own are in ctx.rounds; earlier calls' cuts are in plan.json)
    conf = seeds_that_ran(answer.confidence(ranked, rounds, p.to_dict(), eff), found.runs, winner)
    answers = ctx.saved.setdefault("answers", [])
    name = winner.layout if winner else None
    changed = answer.changed_from(answers, name)
    entry = {"call": len(ctx.calls), "winner": name, "confidence": conf["level"], "runs": sum(conf["runs"].values())}
    if not answers or answers[-1] != entry:
        answers.append(entry)
    return {
        "effect": eff,
        "confidence": conf,
        "changed_from": changed,
        "recipe": answer.recipe(winner, optimizer=p.optimizer, record=record, width=ctx.user.config.d_model),
        "domain": answer.domain(ctx.user, ctx.precision, p.optimizer, p.depth, record, ctx.cfg.tokens, name),
    }


def _record(
    ctx: Context, ranked: list[Evidence], winner: Evidence | None, verify: dict[str, Any], sized: dict[str, Any]
) -> Recommendation:
    """The Recommendation: the winner's settings in the code bases and what it drops, what the proxy cannot tell,
    how far the answer could move, the plan, the rounds and the minutes; `sized`: the answer's sizing, the recipes'
    checks, the gate's verdict and the transfer record."""
    found, p, folder, user = ctx.found, ctx.plan, ctx.folder, ctx.user
    assert found.final is not None
    settings = (
        named(settings_for(winner.layout, user.config, base_layout=user.layout, unmodelled=user.unmodelled), winner)
        if winner
        else {}
    )
    dropped = derived.dropped(ctx.current, winner.layout) if winner else []
    stress = {"depth": p.depth, "depth_fixed": ctx.cfg.depth is not None, "candidates": found.order, "lr": p.stress_lr}
    rounds = [r.to_dict() for r in ctx.rounds]
    used = ctx.clock.used_minutes()
    return Recommendation(
        model=user.describe(),
        notes=list(user.notes),
        precision=ctx.precision,
        current=ctx.current,
        winner=winner.layout if winner else None,
        ranking=[r.to_dict() for r in ranked],
        settings=settings,
        limits=explain.limits(user, ctx.precision, stress, found.screen, ctx.extra, ranked),
        optimizer=p.optimizer,
        verify=verify,
        plan=_plan_record(ctx, stress, found.final),
        rounds=rounds,
        movement=explain.movement(ranked, p.to_dict(), found.final.to_dict(), rounds),
        minutes=used,
        budget_minutes=ctx.clock.budget_s / 60,
        call_minutes=[*ctx.calls[:-1], used],
        files={
            "grid": folder.grid_files(),
            "screen": folder.screen_file.name,
            "plan": folder.plan_file.name,
            "json": folder.json_file.name,
        },
        dropped=dropped,
        labels=dict(ctx.labels),
        **sized,
    )


def _written(ctx: Context, result: Recommendation, ranked: list[Evidence]) -> Recommendation:
    """recommendation.md, recommendation.json and report.html written; the markdown kept in `result.text`."""
    as_dict = result.to_dict()
    result.text = explain.markdown(as_dict, ranked)
    atomic_write_bytes(ctx.folder.markdown_file, result.text.encode())
    atomic_write_json(ctx.folder.json_file, as_dict)
    explain.write_page(ctx.folder, as_dict, ranked)
    return result


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
