"""The screen, the first stage: Kan et al.'s four steps for every planned candidate at the user's depth
and the plan's width (`normlab.screen`), each result kept in screen.json the moment it exists; what the
screen rules out before training (`rank.ruled_out`), and the candidates left, the current placement first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from normlab.config.commands import ScreenConfig
from normlab.errors import ConfigError
from normlab.io import atomic_write_json
from normlab.recommend.evidence.rank import VERDICT_ORDER, ruled_out, screen_summary
from normlab.recommend.planning.shape import UserModel, screen_shape
from normlab.recommend.stages.context import Context, minutes
from normlab.recommend.stages.records import ScreenRecord, StageRecord
from normlab.runs.files import RecommendDir
from normlab.screen.screen import screen_layout

SCREEN_STRESSES = (1.0, 8.0)  # the screen's verdicts compare the lowest and highest stress


def screen_candidates(
    folder: RecommendDir,
    user: UserModel,
    names: list[str],
    width: int,
    predicted_each: float,
    log: Callable[[str], Any],
    stop_by: float = math.inf,
    name: Callable[[str], str] = str,
) -> ScreenRecord:
    """Screen `names` at the user's depth and `width`; resumable (each result kept as it exists). No
    screen starts after `stop_by` (time.time()): the screen keeps to its share of the budget. `name`: what the
    lines call a candidate (`Context.name`)."""
    kept = folder.read(folder.screen_file)
    saved = (
        ScreenRecord.from_json(kept)
        if kept
        else ScreenRecord(width, user.config.n_layers, predicted_seconds_each=predicted_each)
    )
    cfg = ScreenConfig(size="nano", model=screen_shape(user.config, width, 64), stresses=SCREEN_STRESSES)
    todo = [c for c in names if c not in saved.results]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrated; more threads on small tensors only spin, worst on a loaded machine
    bar = tqdm(
        total=len(names), initial=len(names) - len(todo), desc="screen", unit="layout", dynamic_ncols=True, disable=None
    )
    started = time.perf_counter()
    try:
        for i, layout in enumerate(todo, 1):
            if time.time() > stop_by:
                log(
                    f"  time budget: {len(todo) - i + 1} screen(s) not started "
                    f"({', '.join(map(name, todo[i - 1 :]))}); run the same command again to screen them"
                )
                break
            bar.set_postfix_str(name(layout))
            result = screen_summary(screen_layout(layout, cfg))
            saved = saved.with_result(layout, result)
            atomic_write_json(folder.screen_file, saved.to_json())  # each result kept the moment it exists
            bar.update(1)
            if bar.disable:  # a log, not a terminal: the bar's ETA as words
                left = len(todo) - i
                eta = f"; {left} left, ETA {left * (time.perf_counter() - started) / i / 60:.1f} min" if left else ""
                log(f"  screen {name(layout)}: {result['verdict']} ({result['seconds']:.1f} s{eta})")
    finally:
        bar.close()
        torch.set_num_threads(threads)
    return saved


class ScreenStage:
    """Stage 1: the planned candidates screened; the budget's share for it ends before the stress round's."""

    name = "screen"

    def cost(self, ctx: Context) -> float:
        return ctx.plan.predicted["screen"]

    def done(self, ctx: Context) -> bool:
        """Run in this call already (a resumed call runs it again: what the folder holds is read, not redone)."""
        return ctx.found.screen is not None

    def run(self, ctx: Context) -> None:
        p, pred, log = ctx.plan, ctx.plan.predicted, ctx.log
        if not p.screen:  # the quick question: the candidates given, trained at once
            log(f"\n1/3 screen {ctx.clock.stamp()}: none (--quick): {ctx.names(p.screened)} go straight to training")
            ctx.found.screen = ScreenRecord(0, ctx.user.config.n_layers, skipped=True)
            ctx.found.out_by_screen, ctx.found.alive = {}, list(p.screened)
            return
        log(
            f"\n1/3 screen {ctx.clock.stamp()}: {len(p.screened)} candidates at your depth {ctx.user.config.n_layers}, "
            f"width {p.screen_width}; predicted {minutes(self.cost(ctx))}"
        )
        began = time.time()
        screen = screen_candidates(
            ctx.folder,
            ctx.user,
            p.screened,
            p.screen_width,
            pred["screen"] / max(1, len(p.screened)),
            log,
            stop_by=ctx.clock.stop_at - pred["stress"],
            name=ctx.name,
        )
        done = [n for n in p.screened if n in screen.results]
        ctx.record(StageRecord("screen", pred["screen"], time.time() - began, len(p.screened), len(done)))
        log(f"  screen done in {minutes(time.time() - began)} (predicted {minutes(pred['screen'])})")
        ctx.mark()
        if not done:  # no screen started: each one that starts is finished (`screen_candidates`)
            raise ConfigError(
                f"the budget ran out before the screen started: {ctx.clock.used_minutes():.1f} of "
                f"{ctx.clock.budget_s / 60:g} min were used before it, and the screen and the stress round need "
                f"about {minutes(pred['screen'] + pred['stress'])} more; nothing recommended; run the same command "
                "again to continue, or give a larger --budget"
            )
        out_by_screen = {n: why for n in done if (why := ruled_out(screen.results[n], ctx.precision))}
        for n, why in out_by_screen.items():
            log(f"  ruled out: {ctx.name(n)}: {why}")
        alive = sorted(
            (n for n in done if n not in out_by_screen),
            key=lambda n: (n != ctx.current, VERDICT_ORDER.get(screen.results[n]["verdict"], 3)),
        )
        if not alive:
            raise ConfigError(
                "the screen rules out every candidate screened (see screen.json); give other --candidates"
            )
        ctx.found.screen, ctx.found.out_by_screen, ctx.found.alive = screen, out_by_screen, alive
