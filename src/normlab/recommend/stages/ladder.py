"""The ladder stage: the user's placement and its rival (`gate.leader`) trained again at the ladder's other
widths (`normlab.recommend.evidence.ladder`), each at its best learning rate of the final round carried by muP, with
the final round's seeds; one sweep per width and learning rate under the recommendation's folder
(ladder/w128-lr0.01), resumed like every sweep. The speedups per rung, their trend and the projection are
the conclusion's (`stage_conclude.gated_speedup`)."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd

from normlab.recommend.evidence import gate
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.evidence.rows import ranked_now
from normlab.recommend.planning.inputs import proxy_settings, proxy_sweep
from normlab.recommend.planning.shape import PROXY_WIDTH
from normlab.recommend.stages.context import Context, minutes, stage_record


def pair(ctx: Context, ranked: list[Evidence]) -> tuple[Evidence, Evidence] | str:
    """The user's placement and its rival, each with a best learning rate; else why the ladder cannot run."""
    base = next((r for r in ranked if r.layout == ctx.current), None) if ctx.current else None
    lead = gate.leader(ranked, ctx.current)
    if base is None or lead is None:
        return "no placement of yours or no rival to it was ranked"
    if base.best_lr is None or lead.best_lr is None:
        return (
            f"{(base if base.best_lr is None else lead).layout} finished no run at the proxy: no learning rate to carry"
        )
    return base, lead


def by_lr(base: Evidence, lead: Evidence) -> dict[float, list[str]]:
    """The two candidates grouped by their best learning rate (one sweep each)."""
    groups: dict[float, list[str]] = {}
    for r in (base, lead):
        assert r.best_lr is not None
        groups.setdefault(r.best_lr, []).append(r.layout)
    return groups


class LadderStage:
    """After the final round: the ladder's other rungs for the user's placement and its rival."""

    name = "ladder"

    def cost(self, ctx: Context) -> float:
        return float(ctx.plan.ladder.predicted_s) if ctx.plan.ladder else 0.0

    def done(self, ctx: Context) -> bool:
        """Not in the plan, or run in this call already."""
        return not ctx.plan.ladder or ctx.found.ladder is not None

    def run(self, ctx: Context) -> None:
        """The ladder's record (recommendation.json's `effect.speedup.ladder`) into `ctx.found.ladder`, for the
        pair the ranking so far puts forward."""
        ctx.found.ladder = self._record(ctx, ranked_now(ctx))
        ctx.mark()

    def _record(self, ctx: Context, ranked: list[Evidence]) -> dict[str, Any]:
        p = ctx.plan
        assert p.ladder is not None
        got = pair(ctx, ranked)
        if isinstance(got, str):
            ctx.log(f"\nladder: not run: {got}")
            return {"status": "not run", "why": got}
        base, lead = got
        predicted = float(p.ladder.predicted_s)
        widths = [int(w) for w in p.ladder.steps]  # the rungs beside the proxy
        ctx.log(
            f"\nladder {ctx.clock.stamp()}: {base.layout} and {lead.name} at widths "
            f"{', '.join(str(w) for w in widths)} beside the proxy's {PROXY_WIDTH} (muP from it; steps "
            f"{', '.join(str(p.ladder.steps[str(w)]) for w in widths)}), {len(p.seeds)} seeds; "
            f"predicted {minutes(self.cost(ctx))}"
        )
        began = time.time()
        frames = []
        sweeps = [(w, lr, names) for w in widths for lr, names in by_lr(base, lead).items()]
        for i, (w, lr, names) in enumerate(sweeps):
            settings = proxy_settings(ctx.user, p.depth, ctx.precision, ctx.extra, p.optimizer, width=w)
            settings["steps"] = int(p.ladder.steps[str(w)])
            sweep = proxy_sweep(settings, names, [lr], list(p.seeds), name=f"recommend-ladder-w{w}")
            share = predicted * (len(sweeps) - i - 1) / len(sweeps)  # what the sweeps after this one need
            frames.append(ctx.sweeps.run(sweep, ctx.folder.ladder(w, lr).path, start_by=ctx.clock.stop_at - share))
        runs = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        planned = len(widths) * 2 * len(p.seeds)
        record = stage_record("ladder", predicted, began, runs, [base.layout, lead.layout], planned)
        ctx.record(record)
        ctx.log(
            f"  ladder done in {minutes(time.time() - began)} (predicted {minutes(predicted)}); "
            f"{record.finished} of {planned} runs finished"
        )
        return {"status": "done", "round": record.to_json()}
