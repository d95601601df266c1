"""The verify stage (--verify): the ranking's best k trained once more at a wider width, at the winner's
best learning rate, ranked by the transfer study's rule (`normlab.experiments.transfer`) and compared with
the ranking: Kendall's tau, top-1 agreement, failures predicted against seen. The recommendation is written
before it starts and again with its verdict. `verify_added`: --verify on a folder planned without it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from normlab.config.commands import RecommendConfig
from normlab.errors import ConfigError
from normlab.experiments import transfer
from normlab.experiments.cpus import threads_per_worker
from normlab.layout import as_layout
from normlab.recommend.planning import cost, plan
from normlab.recommend.planning.inputs import has_streams, proxy_settings, proxy_sweep
from normlab.recommend.planning.plan_record import Plan, VerifyStagePlan
from normlab.recommend.planning.shape import PROXY_WIDTH, UserModel
from normlab.recommend.stages.context import Context, minutes, stage_record
from normlab.recommend.stages.records import Recommendation, StageRecord
from normlab.runs.files import RecommendDir


def verify_added(
    folder: RecommendDir,
    p: Plan,
    user: UserModel,
    cfg: RecommendConfig,
    budget_s: float,
    workers: int,
    log: Callable[[str], Any],
) -> VerifyStagePlan | None:
    """--verify on a folder planned without it: the verify stage within this call's budget. Where the
    recommendation is done, verifying is all this call asks: refused (exit 2) if the budget cannot buy it;
    else (rounds still to run) said in one line and the recommendation goes on without it."""
    names = p.screened
    cal, _ = cost.calibration(threads_per_worker(workers), log=log, streams=has_streams(names))
    done = folder.json_file.is_file()
    reserve = (plan.STARTUP_RESERVE_S + plan.REPORT_RESERVE_S) * cal.speed
    room = (budget_s - reserve) * plan.FILL - (0.0 if done else p.predicted["total"])
    pricing = plan.VerifyPricing(names, user.config, cal, workers, p.depth, p.steps, cfg.optimizer)
    stage, why, need_s = plan.verify_plan(pricing, room, seed=p.seed0)
    if stage is None:
        if math.isfinite(need_s):
            rounds_s = 0.0 if done else p.predicted["total"]
            need = math.ceil((need_s / plan.FILL + reserve + rounds_s) / 60)
            why = (
                f"--verify: --budget {cfg.budget:g} min cannot buy the verify stage (2 runs at width "
                f"{plan.verify_widths(user.config)[0]}); give --budget {need} or more ({plan.calibration_used(cal)})"
            )
        if done:
            raise ConfigError(why)
        log(f"  {why}; recommending without it")
        return None
    log(f"  --verify added to this recommendation: the best {stage.k} at width {stage.width}")
    return stage


class VerifyStage:
    """After the ranking: its best k at the plan's wider width, compared with the ranking."""

    name = "verify"

    def cost(self, ctx: Context) -> float:
        return ctx.plan.verify.predicted_s if ctx.plan.verify else 0.0

    def done(self, ctx: Context) -> bool:
        """Not in the plan, or its record made in this call already."""
        return not ctx.plan.verify or ctx.found.verified.get("status") != "pending"

    def run(self, ctx: Context) -> None:
        """The verify record (recommendation.json's "verify") of the recommendation written, into
        `ctx.found.verified`; its round recorded where it ran."""
        assert ctx.found.result is not None
        verified = self._record(ctx, ctx.found.result)
        if "round" in verified:
            ctx.record(StageRecord.from_json(verified["round"]))
        ctx.found.verified = verified

    def _record(self, ctx: Context, result: Recommendation) -> dict[str, Any]:
        v = ctx.plan.verify
        assert v is not None
        ranked = [r for r in result.ranking if r.get("rank") is not None and not as_layout(r["layout"]).ngpt]
        top = [r["layout"] for r in ranked[: v.k]]  # in muP from the proxy's width: nGPT sets its own (left out)
        mup = ctx.plan.optimizer != "sgd"  # as proxy_settings trains them
        record: dict[str, Any] = {**v.to_json(), "candidates": top, "parametrization": "mup" if mup else "sp"}
        if len(top) < 2:
            return {**record, "status": "not run", "why": f"{len(top)} candidate(s) ranked: nothing to order"}
        lr = ranked[0].get("best_lr") or result.plan.stress.lr
        record["lr"] = lr
        ctx.log(
            f"\nverify {ctx.clock.stamp()}: {', '.join(top)} at width {v.width} ({v.width // PROXY_WIDTH}x "
            f"the proxy), {v.depth} layers, {v.steps} steps, lr {lr:g} (the winner's best), seed {v.seed}; "
            f"predicted {minutes(self.cost(ctx))}"
        )
        began = time.time()
        base = proxy_settings(ctx.user, v.depth, ctx.precision, ctx.extra, ctx.plan.optimizer, width=v.width)
        sweep = proxy_sweep(base, top, [lr], [v.seed], name="recommend-verify")
        wide = ctx.sweeps.run(sweep, ctx.folder.verify.path, start_by=ctx.clock.stop_at - v.predicted_s / 2)
        record["round"] = stage_record("verify", v.predicted_s, began, wide, top, len(top)).to_json()
        ctx.log(
            f"  verify done in {minutes(time.time() - began)} (predicted {minutes(v.predicted_s)}); "
            f"{record['round']['finished']} of {len(top)} runs finished"
        )
        return compare(record, ctx.found.runs, wide)


def compare(record: dict[str, Any], runs: pd.DataFrame | None, wide: pd.DataFrame) -> dict[str, Any]:
    """The verify runs `wide` ranked by the transfer study's rule against the ranking's best (`record`'s
    candidates, trained in `runs`): the order held or not, in numbers and words."""
    v, top, lr = record, record["candidates"], record["lr"]
    table = transfer.rank_sweep(wide)
    order = [x for x in table.layout if x in top]
    said = {
        r.layout: (f"{r.failed}/{r.finished} failed" if r.failed else f"loss {r.best_loss:.3f}")
        for r in table.itertuples(index=False)
    }
    if len(order) < 2:
        return {
            **record,
            "status": "unfinished",
            "why": f"{len(order)} of {len(top)} runs finished: nothing to order "
            "(run the same command again to finish them)",
        }
    agree = transfer.order_agreement([x for x in top if x in order], order)
    mine = runs[runs.layout.isin(top)] if runs is not None and len(runs) else runs
    tally, disagree = transfer.failure_tally(transfer.failure_cells(mine, [lr]), transfer.failure_cells(wide, [lr]))
    held = (
        "held"
        if agree.proxy_order == order
        else ("the winner held, the order below it changed" if agree.top1 else "did not hold: another placement won")
    )
    words = (
        f"At width {v['width']} ({v['width'] // PROXY_WIDTH}x the proxy) the order {held}: "
        f"{' > '.join(f'{x} ({said[x]})' for x in order)} against the ranking's {' > '.join(agree.proxy_order)} "
        f"(Kendall's tau "
        f"{agree.tau:+.2f} over {len(order)} placements, top-1 {'agrees' if agree.top1 else 'differs'}; "
        f"failures at lr {lr:g}: {tally['predicted_and_seen']} predicted and seen, {tally['predicted_only']} "
        f"predicted only, {tally['seen_only']} seen only, {tally['neither']} neither). One seed, "
        f"{v['steps']} steps: a check of the order, not of the loss gap at your width."
    )
    return {
        **record,
        "status": "done",
        "held": agree.proxy_order == order,
        "top1": agree.top1,
        "tau": agree.tau,
        "p_value": agree.p_value,
        "proxy_order": agree.proxy_order,
        "verify_order": order,
        "failures": tally,
        "failures_disagreeing": disagree,
        "words": words,
    }
