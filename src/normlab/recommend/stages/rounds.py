"""The training rounds: the stress round (every candidate the screen left, trained once at the stress
learning rate with the user's precision stored) and the final round (the best of the stress round, and the
user's current placement, over the plan's learning rates x seeds, plus one learning rate beyond an edge
where the plan has room), each one sweep folder's runs (grid/) under the budget's deadline; then the
machine's calibration refreshed from the finished runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pandas as pd

from normlab.errors import ConfigError
from normlab.experiments.cpus import threads_per_worker
from normlab.model.config import ModelConfig
from normlab.recommend.evidence.rank import VERDICT_ORDER, ScreenSummary, evidence_from_grid
from normlab.recommend.planning import from_runs
from normlab.recommend.planning.inputs import proxy_sweep
from normlab.recommend.planning.plan import finalists_from, next_lr
from normlab.recommend.planning.shape import UserModel, screen_shape
from normlab.recommend.stages.context import Context, minutes, stage_record
from normlab.recommend.stages.records import FinalRecord, ScreenRecord
from normlab.runs.files import RecommendDir
from normlab.runs.store import open_store


def stress_order(
    runs: pd.DataFrame, screen: Mapping[str, ScreenSummary], candidates: list[str], lr: float, seed: int
) -> list[str]:
    """The stress round's candidates, best first, from their stress runs only (`runs` may hold the final
    round's too): trained to the end before stalled before diverged; then the lower final loss, or for a
    diverged run the later step it diverged at (its last finite loss says nothing); then the screen's verdict."""
    stress = runs[(runs.lr - lr).abs() <= 1e-9 * lr] if len(runs) else runs
    stress = stress[stress.seed == seed] if len(stress) else stress

    def key(name: str) -> tuple[int, float, int]:
        row = stress[stress.layout == name]
        status = row.status.iloc[0] if len(row) else "pending"
        if status == "diverged":
            value = -float(row.step.iloc[0]) if row.step.iloc[0] is not None else 0.0
        else:
            loss = row.final_loss.iloc[0] if len(row) else None
            value = float(loss) if loss is not None and math.isfinite(float(loss)) else math.inf
        return (
            {"ok": 0, "stalled": 1, "diverged": 2}.get(status, 3),
            value,
            VERDICT_ORDER.get(screen[name]["verdict"], 3) if name in screen else 3,
        )

    return sorted(candidates, key=key)


def lr_edges(runs: pd.DataFrame, finalists: list[str], lrs: list[float]) -> dict[str, float]:
    """Finalists whose best learning rate is the lowest or highest tried -> the next one beyond it."""
    grid = evidence_from_grid(runs[runs.layout.isin(finalists)], {n: 1 for n in finalists})
    out = {}
    for n in finalists:
        best = grid[n].get("best_lr")
        if best is None or len(lrs) < 2:
            continue
        if (
            best <= min(lrs) * (1 + 1e-9)
            and (beyond := next_lr(min(lrs), up=False))
            or best >= max(lrs) * (1 - 1e-9)
            and (beyond := next_lr(max(lrs), up=True))
        ):
            out[n] = beyond
    return out


def refresh_calibration(
    folder: RecommendDir, user: UserModel, screen: ScreenRecord | None, workers: int, log: Callable[[str], Any]
) -> None:
    """The finished proxy runs' steps and the screens against this machine's cached calibration: lowered where
    they ran faster than it predicts (measured under a load), never raised (`from_runs.refresh_from_runs`)."""
    if not folder.grid.store_file.is_file():
        return
    try:  # a record that cannot be read only leaves the calibration as it is
        steps = [
            step
            for row in open_store(folder.grid, readonly=True).rows()
            if (step := from_runs.run_step(row["config"], folder.grid.run(row["run_id"]).read_summary())) is not None
        ]
    except (ConfigError, OSError, ValueError):
        steps = []
    screens = []
    if screen is not None and screen.results:
        shape = ModelConfig(**screen_shape(user.config, screen.width, 64))
        seconds = [r.get("seconds") for r in screen.results.values() if isinstance(r, dict)]
        screens = [(shape, float(t)) for t in seconds if isinstance(t, (int, float)) and t > 0]
    from_runs.refresh_from_runs(threads_per_worker(workers), steps, screens, log=log)


class StressRound:
    """Stage 2: every candidate left trained once at the stress learning rate; no answer from nothing."""

    name = "stress"

    def cost(self, ctx: Context) -> float:
        return ctx.plan.predicted["stress"]

    def done(self, ctx: Context) -> bool:
        """Run in this call already (a resumed call runs it again: the runs the grid holds are not retrained)."""
        return bool(ctx.found.order)

    def run(self, ctx: Context) -> None:
        p, pred, log, found, depth = ctx.plan, ctx.plan.predicted, ctx.log, ctx.found, ctx.user.config.n_layers
        lr, seed0, alive = p.stress_lr, p.seed0, found.alive
        log(
            f"\n2/3 stress round {ctx.clock.stamp()}: {len(alive)} runs at lr {lr:g}, seed {seed0}, {p.depth} layers"
            f" ({'your depth' if p.depth == depth else f'yours: {depth}'}), {p.steps} "
            f"steps, {ctx.precision} storage; predicted {minutes(self.cost(ctx))}"
        )
        began = time.time()
        sweep = proxy_sweep(ctx.base, alive, [lr], [seed0])
        runs = ctx.sweeps.run(sweep, ctx.folder.grid.path, start_by=ctx.clock.stop_at - ctx.one_run_s())
        done = ctx.record(
            stage_record("stress", pred["stress"], began, runs[(runs.lr - lr).abs() <= 1e-9 * lr], alive, len(alive))
        )
        log(
            f"  stress round done in {minutes(time.time() - began)} (predicted {minutes(pred['stress'])}); "
            f"{done.finished} of {len(alive)} runs finished"
        )
        ctx.mark()
        if not done.finished:
            raise ConfigError(
                f"no candidate finished a run, so there is nothing to recommend ({_why_none(ctx, runs)}); no "
                "recommendation written: run the same command again to continue (the plan and what finished are "
                "kept), or give a larger --budget"
            )
        found.runs = runs
        assert found.screen is not None
        found.order = stress_order(runs, found.screen.results, alive, lr, seed0)


def _why_none(ctx: Context, runs: pd.DataFrame) -> str:
    """Why no stress run finished: every run failed (the first reason), or the budget stopped them."""
    stress_runs = runs[runs.layout.isin(ctx.found.alive)]
    failed = stress_runs[stress_runs.status == "failed"]
    if len(failed) and failed.reason.iloc[0] and "time budget" not in str(failed.reason.iloc[0]):
        return f"every run failed; the first: {failed.reason.iloc[0]}"
    screen = next((r for r in ctx.rounds if r.stage == "screen"), None)
    stress = next((r for r in ctx.rounds if r.stage == "stress"), None)
    took = [f"the screen took {minutes(screen.actual_s)}, predicted {minutes(screen.predicted_s)}" if screen else ""]
    took.append(
        f"the stress round {minutes(stress.actual_s)}, predicted {minutes(stress.predicted_s)}" if stress else ""
    )
    slower = any(r is not None and r.actual_s > r.predicted_s for r in (screen, stress))
    took.append("this machine ran slower than its calibration (loaded?)" if slower else "")
    return "the budget ran out before any run finished" + "".join(f"; {t}" for t in took if t)


class FinalRound:
    """Stage 3: the best of the stress round (and the current placement) over learning rates x seeds, and
    one learning rate beyond an edge where the plan extends; none where the plan has no final round."""

    name = "final"

    def cost(self, ctx: Context) -> float:
        return ctx.plan.predicted["final"] + ctx.plan.predicted["extend"]

    def done(self, ctx: Context) -> bool:
        """Run in this call already (a resumed call runs it again: the runs the grid holds are not retrained)."""
        return ctx.found.final is not None

    def run(self, ctx: Context) -> None:
        p, pred, log, found = ctx.plan, ctx.plan.predicted, ctx.log, ctx.found
        finalists = finalists_from(found.order, p.finalists, ctx.current) if p.finalists else []
        found.final = final = FinalRecord(finalists, p.lrs, p.seeds)
        if not finalists:
            log(f"\n3/3 final round {ctx.clock.stamp()}: none in this budget; the ranking rests on the stress round")
            return
        log(
            f"\n3/3 final round {ctx.clock.stamp()}: {ctx.names(finalists)} x lr "
            f"{', '.join(f'{x:g}' for x in p.lrs)} x seed(s) {', '.join(map(str, p.seeds))}; predicted "
            f"{minutes(pred['final'])}"
        )
        began = time.time()
        sweep = proxy_sweep(ctx.base, finalists, p.lrs, p.seeds)
        runs = ctx.sweeps.run(sweep, ctx.folder.grid.path, start_by=ctx.clock.stop_at - ctx.one_run_s())
        in_grid = runs[runs.lr.isin(p.lrs) & runs.seed.isin(p.seeds)]
        done = ctx.record(
            stage_record("final", pred["final"], began, in_grid, finalists, len(finalists) * len(p.lrs) * len(p.seeds))
        )
        log(
            f"  final round done in {minutes(time.time() - began)} (predicted {minutes(pred['final'])}); "
            f"{done.finished} of {done.planned} runs finished"
        )
        found.runs = runs
        found.final = final = replace(final, edges=lr_edges(in_grid, finalists, p.lrs))
        assert final.edges is not None
        self._extend(ctx, final.edges)
        ctx.mark()

    @staticmethod
    def _extend(ctx: Context, edges: dict[str, float]) -> None:
        """One learning rate beyond the edge for the finalists whose best is at one (where the plan has room)."""
        p, log = ctx.plan, ctx.log
        if edges and not p.extend:
            log(
                "  best learning rate at an edge of those tried: "
                + ", ".join(f"{ctx.name(n)} (next: {x:g})" for n, x in edges.items())
                + "; the budget has no room to extend the range"
            )
        if not edges or not p.extend:
            return
        began = time.time()
        log(
            "  best learning rate at an edge of those tried: "
            + "; ".join(f"{ctx.name(n)} -> also {x:g}" for n, x in edges.items())
            + f"; predicted {minutes(p.predicted['extend'])}"
        )
        for x in sorted(set(edges.values())):
            sweep = proxy_sweep(ctx.base, [n for n, v in edges.items() if v == x], [x], p.seeds)
            ctx.sweeps.run(sweep, ctx.folder.grid.path, start_by=ctx.clock.stop_at - ctx.one_run_s())
        runs = ctx.found.runs = ctx.sweeps.runs(ctx.folder.grid.path)
        assert ctx.found.final is not None
        ctx.found.final = replace(ctx.found.final, extended=edges)
        extended = runs[runs.lr.isin(sorted(set(edges.values())))]
        ctx.record(
            stage_record("extend", p.predicted["extend"], began, extended, list(edges), len(edges) * len(p.seeds))
        )
