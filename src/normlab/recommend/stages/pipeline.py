"""`normlab recommend`: a placement for the user's own model, with the evidence behind it, in stages
that fit a time budget, each resumable.

    screen        Kan et al.'s four steps for every candidate at the user's depth (and width, where the
                  budget allows): the verdicts, and what rules a candidate out before training
    stress round  every candidate left, trained once at the stress learning rate with the user's
                  precision stored (fp16: activations past 65504 overflow, as in the papers' Megatron runs)
    final round   the best of the stress round (and the user's current placement) over learning rates x
                  seeds
    ranking       divergences and stalls, best loss, screen verdict, LR sensitivity (`normlab.recommend.evidence.rank`),
                  checked against the recipes' verdicts; the winner's settings in five code bases
    verify        (--verify) the ranking's best k trained again at a wider width, at the winner's best
                  learning rate, and ranked by the same rule (`normlab.experiments.transfer`): Kendall's tau
                  and top-1 agreement with the ranking, failures predicted vs seen; the recommendation is
                  written before it starts and again with its verdict

The proxies train with `--optimizer` (adamw, muon, sgd), as the user will; the plan counts Muon's
Newton-Schulz steps (`normlab.recommend.planning.cost`).

The folder (`--out`) holds plan.json (the inputs and both rounds' plans: a resumed recommendation reuses
them), screen.json, grid/ (one sweep folder for both rounds: its summary.md and report.html), verify/
(the verify stage's sweep), and recommendation.md / recommendation.json / report.html. `--verify` on a
folder whose recommendation is done adds the verify stage alone, within this call's budget (refused with
the budget that would do where it does not fit). Run the same command again and only what is
missing runs (a changed input is refused: use a new --out).

The stages are named (`Stage`: each says what it costs, whether it has nothing left to add, and runs; one
signature for all) and share one `Context` (the folder, the budget's clock, the workers, the log, an
executor for the sweeps, the plan, what the stages found): `stage_screen.ScreenStage`,
`stage_rounds.StressRound` and `FinalRound`, `GridReport`, `stage_ladder.LadderStage`, `stage_conclude.Conclude`,
`stage_verify.VerifyStage`; `run_stages` runs each that is not done, in order (`STAGES`). The
records they keep are typed (`plan_record.Plan`, `records.ScreenRecord`, `records.StageRecord`, `records.FinalRecord`,
`records.Recommendation`) and become JSON only where the folder is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from normlab.config.commands import RECOMMEND_BASE, RecommendConfig, check_recommend_settings
from normlab.errors import ConfigError
from normlab.experiments.cpus import threads_per_worker, usable_cores
from normlab.experiments.summary import summarize
from normlab.io import own_folder
from normlab.layout import as_layout
from normlab.recommend.planning import cost, derived, plan
from normlab.recommend.planning.inputs import (
    CandidateChoice,
    check_run_settings,
    choose,
    has_streams,
    proxy_settings,
    recorded_inputs,
)
from normlab.recommend.planning.plan_record import Plan, VerifyStagePlan
from normlab.recommend.planning.shape import UserModel
from normlab.recommend.stages.conclude import Conclude
from normlab.recommend.stages.context import BudgetClock, Context, SweepExecutor, minutes
from normlab.recommend.stages.ladder import LadderStage
from normlab.recommend.stages.records import Recommendation
from normlab.recommend.stages.rounds import FinalRound, StressRound, refresh_calibration
from normlab.recommend.stages.screen import SCREEN_STRESSES, ScreenStage
from normlab.recommend.stages.verify import VerifyStage, verify_added
from normlab.runs.files import RecommendDir
from normlab.runs.lock import FolderLock


class Stage(Protocol):
    """A named stage of a recommendation: one signature for all of them. `run_stages` runs each that is not
    `done`; a stage reads what the stages before it found from `ctx.found` and adds its own there."""

    name: str

    def cost(self, ctx: Context) -> float:
        """Its predicted seconds (the plan's): what its first line says it will take."""
        ...

    def done(self, ctx: Context) -> bool:
        """Whether it has nothing to add to this call: not in the plan, or run already."""
        ...

    def run(self, ctx: Context) -> None:
        """Run it (resuming what an earlier call left in the folder), its findings kept in `ctx.found`."""
        ...


class GridReport:
    """After the rounds: the grid's summary.md and report.html, and the calibration refreshed from its runs."""

    name = "grid report"

    def cost(self, ctx: Context) -> float:
        return 0.0  # counted in the plan's reserves

    def done(self, ctx: Context) -> bool:
        return ctx.found.summarized

    def run(self, ctx: Context) -> None:
        summarize(ctx.folder.grid.path)
        ctx.found.summarized = True
        ctx.mark()
        refresh_calibration(ctx.folder, ctx.user, ctx.found.screen, ctx.workers, ctx.log)


# every stage, in order: the conclusion is written before the verify stage and again with its verdict
STAGES: tuple[Stage, ...] = (
    ScreenStage(),
    StressRound(),
    FinalRound(),
    GridReport(),
    LadderStage(),
    Conclude(),
    VerifyStage(),
    Conclude(),
)


def recommend(
    user: UserModel,
    cfg: RecommendConfig,
    extra: dict[str, Any] | None = None,
    log: Callable[[str], Any] = print,
    started: float | None = None,
) -> dict[str, Any]:
    """Run the stages within `cfg.budget` minutes from `started` (the command's start; default now);
    returns the recommendation (also written to the folder)."""
    cfg = cfg.with_quick_defaults()  # the quick question: yours against the changes given, 3 minutes
    clock = BudgetClock(started or time.time(), cfg.budget * 60)
    workers = cfg.workers or usable_cores()
    precision = cfg.precision or user.precision or "bf16"
    extra = dict(extra or {})
    check_recommend_settings(extra)
    choice, user = _asked(cfg, user)
    candidates, current = choice.names, choice.current
    _announce(user, cfg, precision, len(candidates), workers, log)

    # 0. the plan: settings checked, costs counted, nothing screened or trained yet
    log(f"\n0/3 plan {clock.stamp()}")
    folder = RecommendDir(Path(cfg.out))
    saved = folder.read(folder.plan_file) if folder.plan_file.is_file() else {}
    kept = Plan.from_json(saved["plan"]) if saved.get("plan") else None  # the plan a resumed folder holds
    the_plan = None
    if kept is None:
        the_plan = _new_plan(user, cfg, extra, choice, clock.budget_s, workers, log, started=clock.t0)
        depth = the_plan.depth
    else:
        depth = kept.depth
        if cfg.recalibrate:  # measured as asked; the plan this folder holds stays (the same command resumes it)
            cal, _ = cost.calibration(_threads(workers), log=log, streams=False, remeasure=True)
            log(f"  this machine: {cal.describe()}; {folder.plan_file.name}'s plan is kept, the next plans use it")
    base = proxy_settings(user, depth, precision, extra, cfg.optimizer)
    inputs = recorded_inputs(user, cfg, precision, extra, candidates)
    _check_same_inputs(folder, saved, inputs)
    if kept is None:
        check_run_settings(base, candidates[0], _stress_lr(cfg), _seed0(cfg), log)
    added = _verify_asked(folder, kept, user, cfg, clock, workers, log)
    root = own_folder(cfg.out, "recommend")  # nothing written before this line: a refusal leaves no trace
    lock = FolderLock(
        folder.lock_file,
        wait=0,
        busy=lambda holder: (
            f"another normlab recommend is running in {root} ({holder}); wait for it, or give another --out"
        ),
    )
    try:
        saved = folder.read(folder.plan_file) or {"inputs": inputs}  # read again under the lock
        the_plan = Plan.from_json(saved["plan"]) if saved.get("plan") else the_plan
        assert the_plan is not None
        if added and not the_plan.verify:
            was = the_plan.predicted
            predicted = {**was, "total": was["total"] + added.predicted_s - was.get("verify", 0.0)}
            predicted["verify"] = added.predicted_s
            the_plan = replace(the_plan, verify=added, verify_note="", predicted=predicted)
        sweeps = SweepExecutor(workers, log, clock.stop_at, short=choice.short)
        ctx = Context(
            folder,
            user,
            cfg,
            precision,
            extra,
            candidates,
            current,
            base,
            clock,
            sweeps,
            the_plan,
            saved,
            labels=choice.labels,
            short=choice.short,
        )
        return run_stages(ctx).as_result()
    finally:
        lock.release()


def _verify_asked(
    folder: RecommendDir,
    p: Plan | None,
    user: UserModel,
    cfg: RecommendConfig,
    clock: BudgetClock,
    workers: int,
    log: Callable[[str], Any],
) -> VerifyStagePlan | None:
    """--verify on a folder whose plan has no verify stage: the stage added within this call's budget
    (`stage_verify.verify_added`); None where it is not asked, the folder holds no plan yet (`p`), or its plan has
    the stage already."""
    if cfg.verify and p and not p.verify and (not p.verify_note or p.budget_s != clock.budget_s):
        return verify_added(folder, p, user, cfg, clock.budget_s, workers, log)
    return None


def _asked(cfg: RecommendConfig, user: UserModel) -> tuple[CandidateChoice, UserModel]:
    """The candidates and the user's model with the notes on the defaults it cannot take; what cannot be
    asked refused in one line (--quick without a named placement or another candidate, --depth deeper than
    the model)."""
    if cfg.quick and user.layout is None:
        raise ConfigError(
            "--quick compares your model's placement with the changes given, and your model file does not name it: "
            'give a .toml with layout = "..." or a config.json normlab reads the placement of'
        )
    choice = choose(cfg, user)
    if cfg.quick and len(choice.names) < 2:  # suggested: only the changes that apply to the user's placement
        apply = derived.applicable(user.layout) if user.layout else []
        other = "pre" if user.layout != "pre" else "peri"
        suggest = (
            f"changes that apply to it: {', '.join(apply)}; or a layout"
            if apply
            else f"no yours+... change applies to {user.layout}: a layout, e.g. {other}"
        )
        given = (
            f"{', '.join(choice.inapplicable)} {'does' if len(choice.inapplicable) == 1 else 'do'} not apply to your "
            f"placement {user.layout} (nothing of it to add or take away); "
            if choice.inapplicable
            else ""
        )
        raise ConfigError(f"--quick compares your model with the --candidates given: {given}give another ({suggest})")
    if choice.unfit:  # default candidates this model cannot take: said wherever the notes are (output, recommendation)
        notes = [
            f"left out of the default candidates: {n} (your model cannot take it: {w})" for n, w in choice.unfit.items()
        ]
        user = replace(user, notes=(*user.notes, *notes))
    if cfg.depth is not None and cfg.depth > user.config.n_layers:
        raise ConfigError(
            f"--depth {cfg.depth} is deeper than your model ({user.config.n_layers} layers): the proxies "
            f"are at most your depth; give --depth {min(user.config.n_layers, plan.MIN_DEPTH)} ... "
            f"{user.config.n_layers}"
        )
    return choice, user


def _check_same_inputs(folder: RecommendDir, saved: dict[str, Any], inputs: dict[str, Any]) -> None:
    """Refuse to resume a folder whose plan.json was made for other inputs (a resumed call continues one question)."""
    if saved and json.loads(json.dumps(saved.get("inputs"))) != json.loads(json.dumps(inputs)):
        changed = sorted(k for k in inputs if saved["inputs"].get(k) != json.loads(json.dumps(inputs[k])))
        raise ConfigError(
            f"{folder.path} holds a recommendation for other inputs (changed: {', '.join(changed)}); give a new --out"
        )


def _announce(
    user: UserModel, cfg: RecommendConfig, precision: str, n_candidates: int, workers: int, log: Callable[[str], Any]
) -> None:
    """The output's first lines: the user's model, its notes, what the recommendation is asked."""
    log(f"recommend: {user.describe()}")
    for note in user.notes:
        log(f"  note: {note}")
    log(
        f"  precision {precision}; optimizer {cfg.optimizer}; {n_candidates} candidates; "
        f"budget {cfg.budget:g} min on "
        f"{workers} worker(s) "
        f"-> {cfg.out}"
    )


def _threads(workers: int) -> int:
    return threads_per_worker(workers)


def _seed0(cfg: RecommendConfig) -> int:
    return min(cfg.seeds) if cfg.seeds else 0


def _stress_lr(cfg: RecommendConfig) -> float:
    return max(cfg.lrs) if cfg.lrs else max(plan.LRS[2])


def _new_plan(
    user: UserModel,
    cfg: RecommendConfig,
    extra: dict[str, Any],
    choice: CandidateChoice,
    budget_s: float,
    workers: int,
    log: Callable[[str], Any],
    started: float | None = None,
) -> Plan:
    """A new folder's plan, priced with this machine's calibration (measured where none is cached), for the
    budget left at `started` (time.time() of the command's start: what the call used before the plan, the
    calibration's measuring among it, is counted in the plan; none: nothing used)."""
    started = time.time() if started is None else started
    candidates, current = choice.names, choice.current
    cal, cached = cost.calibration(_threads(workers), log=log, streams=False, remeasure=cfg.recalibrate)
    unmeasured: set[str] = set()
    if has_streams(candidates):  # priced at the cached stream rates, else the reference VM's: measured below if run
        cal, unmeasured = cost.stream_rates(cal)
    log(
        f"  this machine: {cal.speed:.2f}x the reference VM's step time "
        + ("(cached calibration)" if cached else f"(calibrated in {cal.seconds:.1f} s)")
    )
    request = plan.PlanRequest(
        candidates,
        current,
        user.config,
        cal,
        budget_s,
        workers,
        int(extra.get("steps", RECOMMEND_BASE["steps"])),
        stress_lr=_stress_lr(cfg),
        seed0=_seed0(cfg),
        lrs=tuple(cfg.lrs),
        seeds=tuple(cfg.seeds),
        depth=cfg.depth,
        steps_fixed="steps" in extra,
        optimizer=cfg.optimizer,
        ns_steps=int(extra.get("muon_ns_steps", 5)),
        verify=cfg.verify,
        ladders={"auto": (1, 2), "wide": (1,), "narrow": (2,), "none": ()}[cfg.ladder],
        first=tuple(n for n in choice.labels if n not in choice.removals),
        last=choice.removals,
        screen=not cfg.quick,
        used_s=max(0.0, time.time() - started),
    )
    try:
        the_plan = plan.plan_for(request)
        # only the stream mixes the plan runs are measured (at most once each), then the plan made again with them
        while todo := tuple(sorted(unmeasured & _mixes(the_plan.screened))):
            cal = cost.measure_stream_rates(cal, _threads(workers), todo, log)
            unmeasured -= set(todo)
            request = replace(request, cal=cal, used_s=max(0.0, time.time() - started))
            the_plan = plan.plan_for(request)
        return the_plan
    except plan.BudgetTooSmall as err:
        raise ConfigError(str(err)) from None


def _mixes(names: list[str]) -> set[str]:
    """The stream mixes of `names`' layouts with several streams."""
    return {lay.stream_mix for lay in map(as_layout, names) if lay.streams > 1}


def _log_plan(ctx: Context) -> None:
    """The plan in one line, what the budget cut, and why a verify stage asked for is not in it."""
    p, log = ctx.plan, ctx.log
    final_lrs = ", ".join(f"{x:g}" for x in p.lrs)
    log(
        f"  plan (kept in {ctx.folder.plan_file.name}; the same command resumes it): "
        + (
            f"screen {len(p.screened)} of {len(p.order)} candidates at width {p.screen_width}"
            if p.screen
            else "no screen"
        )
        + f"; stress round at {p.depth} layers, {p.steps} "
        f"steps, lr {p.stress_lr:g}; "
        + (
            f"final round {p.finalists} finalists x lr {final_lrs} x {len(p.seeds)} seed(s)"
            if p.finalists
            else "no final round"
        )
        + ("; an edge learning rate extended where needed" if p.extend else "")
        + (
            f"; the ladder at widths {', '.join(str(w) for w in p.ladder.widths)}, predicted "
            f"{minutes(p.ladder.predicted_s)}"
            if p.ladder
            else ""
        )
        + (
            f"; verify: the best {p.verify.k} again at width {p.verify.width}, predicted "
            f"{minutes(p.verify.predicted_s)}"
            if p.verify
            else ""
        )
        + f"; predicted {minutes(p.predicted['total'])} of {ctx.clock.budget_s / 60:g}"
        + (
            f" ({p.predicted['used'] / 60:.1f} of them used before the plan)"
            if p.predicted.get("used", 0.0) >= 0.05 * 60
            else ""
        )
    )
    for cut in p.cut:
        log(f"  the budget buys: {cut}")
    if p.verify_note:
        log(f"  {p.verify_note}")


def run_stages(ctx: Context) -> Recommendation:
    """Every stage in order (`STAGES`), each skipped where it is `done`, plan.json kept at each; the
    recommendation written before the verify stage and again with its verdict."""
    ctx.start_call()
    _log_plan(ctx)
    p = ctx.plan
    ctx.found.verified = (
        {"status": "not asked"}
        if not p.verify and not p.verify_note
        else {"status": "not bought", "why": p.verify_note}
        if not p.verify
        else {"status": "pending"}
    )
    for stage in STAGES:
        if not stage.done(ctx):
            stage.run(ctx)
    result = ctx.found.result
    assert result is not None
    if p.verify:
        ctx.log(f"  {ctx.found.verified.get('words') or ctx.found.verified['why']}")
    ctx.log("\n" + result.text)
    ctx.log(
        f"done in {ctx.clock.used_minutes():.1f} min (budget {ctx.cfg.budget:g}; predicted "
        f"{minutes(p.predicted['total'])})\nrecommendation: {ctx.folder.markdown_file}\n"
        f"report: {ctx.folder.report_file}"
    )
    return result


__all__ = ["SCREEN_STRESSES", "STAGES", "Stage", "recommend", "run_stages"]
