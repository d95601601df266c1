"""The calibration lowered by finished work (`normlab.recommend.planning.cost`'s module doc): a proxy run's median
step (`RunStep`, from its configuration and summary.json) and the screens' times against what the cached calibration
predicts; where they ran faster by more than `LOWER_BELOW` (their median), the cached rates are scaled down
(`lowered`, `refresh_from_runs`), never up.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from normlab.model.config import ModelConfig
from normlab.recommend.planning.cost import (
    LOWER_BELOW,
    STEP_TIMINGS,
    Calibration,
    cache_file,
    cached_calibration,
    machine_key,
    positive_finite,
    store_calibration,
)
from normlab.recommend.planning.work import CAL_BATCH, CAL_SEQ

if TYPE_CHECKING:
    from normlab.config.train import TrainConfig
    from normlab.runs.summary import RunSummary


@dataclass(frozen=True)
class RunStep:
    """A finished proxy run's median training step (its summary's tokens a second) and what it trained."""

    shape: ModelConfig
    layout: str
    seconds: float
    tokens: int = CAL_BATCH * CAL_SEQ
    seq: int = CAL_SEQ
    optimizer: str = "adamw"
    ns_steps: int = 5

    def ratio(self, cal: Calibration) -> float:
        """Its seconds over the step `cal` predicts for it (< 1: the machine ran faster than calibrated; inf where
        `cal` predicts nothing)."""
        predicted = cal.step_seconds(self.shape, self.layout, self.optimizer, self.ns_steps, self.tokens, self.seq)
        return self.seconds / predicted if predicted > 0 else math.inf


def run_step(config: TrainConfig, summary: RunSummary | None) -> RunStep | None:
    """A run's `RunStep` from its configuration and summary.json, None unless it finished its steps normally
    (ok or stalled: a diverged run's last steps are not a training step's work) on the CPU (what the calibration
    measures) with a throughput recorded."""
    if summary is None or not summary.trained or summary.device != "cpu":
        return None
    tok_s = summary.tok_per_s
    if tok_s is None or not positive_finite(tok_s):
        return None
    tokens = config.data.batch_size * config.data.seq_len
    return RunStep(
        config.model.config,
        config.model.layout_label,
        tokens / tok_s,
        tokens,
        config.data.seq_len,
        config.optim.optimizer,
        config.optim.muon_ns_steps,
    )


def _median_of_positive(ratios: list[float]) -> float:
    """The median of the finite positive ratios (1 where there is none)."""
    kept = [r for r in ratios if positive_finite(r)]
    return statistics.median(kept) if kept else 1.0


def lowered(
    cal: Calibration, step_ratios: list[float], screen_ratios: list[float], when: float
) -> tuple[Calibration, float, float] | None:
    """`cal` lowered by what finished work showed (module doc): the training rates (c0, c_flop, c_norm and the
    step timings behind them) scaled by the runs' median ratio, the screen's by the screens' median ratio, each
    only where it is below `LOWER_BELOW`; (the lowered calibration, the step scale, the screen scale), or None
    where neither is. Never raised: runs slower than predicted (a busy machine) leave it as it is."""
    step, screen = _median_of_positive(step_ratios), _median_of_positive(screen_ratios)
    step = step if step < LOWER_BELOW else 1.0
    screen = screen if screen < LOWER_BELOW else 1.0
    if step == 1.0 and screen == 1.0:
        return None
    timed = dict(cal.measured or {})
    for k in timed:
        timed[k] *= step if k in STEP_TIMINGS else screen
    out = replace(
        cal,
        c0=cal.c0 * step,
        c_flop=cal.c_flop * step,
        c_norm=cal.c_norm * step,
        c_stream={m: r * step for m, r in cal.c_stream.items()},
        s0=cal.s0 * screen,
        s_layer=cal.s_layer * screen,
        s_flop=cal.s_flop * screen,
        measured=timed or cal.measured,
        runs_factor=cal.runs_factor * step,
        runs_at=when if step < 1.0 else cal.runs_at,
    )
    return out, step, screen


def refresh_from_runs(
    threads: int,
    steps: list[RunStep],
    screens: list[tuple[ModelConfig, float]],
    log: Callable[[str], Any] = print,
    when: float | None = None,
) -> Calibration | None:
    """Lower this machine's cached calibration where finished work ran faster than it predicts (`lowered`):
    `steps`, the proxy runs' median steps; `screens`, (shape, seconds) of screens. Returns the calibration
    written, None where the cache is left as it was (nothing faster, or no cached calibration)."""
    path = cache_file(machine_key(threads))
    cal = cached_calibration(path)
    if cal is None or not (steps or screens):
        return None
    got = lowered(
        cal,
        [s.ratio(cal) for s in steps],
        [t / cal.screen_seconds(shape) for shape, t in screens if cal.screen_seconds(shape) > 0],
        time.time() if when is None else when,
    )
    if got is None:
        return None
    out, step, screen = got
    try:
        out = store_calibration(path, out)
    except OSError as err:  # a cache that cannot be written: the next plan is priced as this one was
        log(f"  calibration not refreshed: {path} cannot be written ({err.strerror or err})")
        return None
    what = [
        f"{len(steps)} proxy runs' steps took {step:.2f}x" if step < 1 else "",
        f"the screens {screen:.2f}x" if screen < 1 else "",
    ]
    log(
        f"  calibration refreshed: {' and '.join(w for w in what if w)} of what it predicted; this machine is now "
        f"{out.speed:.2f}x the reference VM's step time (was {cal.speed:.2f}x), in {path}"
    )
    return out
