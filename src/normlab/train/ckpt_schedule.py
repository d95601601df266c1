"""When a run saves a checkpoint.

With ``ckpt_every`` set, every that many steps. Left at 0, every 10% of the run (10 to 100 steps apart), and
stretched where a save is expensive: a save that took ``MATERIAL_S`` or more sets the interval to the smallest
multiple of that base for which saving costs at most ``SAVE_SHARE`` of the time spent training, and at most
half the run (so a killed run keeps a checkpoint from its middle). Measured on an NVIDIA H200
(docs/benchmarks.md, GPU lease of 2026-11-26): gpu-126m's 1.5 GB checkpoint took seconds against 70 ms
steps, so a save every 100 steps spent more time saving than training. A run whose saves take under a
second (every CPU run of the suite) keeps the base interval: its checkpoint steps stay a function of its
configuration alone.

The multiple only grows (a save that happened to be quick does not bring the short interval back), and the
next save is due that many steps after the last one, at a multiple of the base as a fixed interval's are.
Under torchrun every rank must save at the same step (a sharded save is collective), so the multiple is
agreed after each save: the largest over the ranks (the slowest save decides). A resumed run starts again
from the base and stretches after its first save.
"""

from __future__ import annotations

import math
import time

from normlab.train import distributed

SAVE_SHARE = 0.05  # saving costs at most this share of the training time between two saves
MATERIAL_S = 1.0  # a save quicker than this never stretches the interval
_clock = time.perf_counter  # the schedule's clock (a test drives it)


def stretch(base: int, save_s: float, step_s: float) -> int:
    """The multiple of ``base`` steps between saves for which a save of ``save_s`` seconds costs at most
    ``SAVE_SHARE`` of training steps of ``step_s`` seconds: ceil(save_s / (SAVE_SHARE * step_s * base)),
    1 for a save under ``MATERIAL_S``."""
    if save_s < MATERIAL_S or step_s <= 0:
        return 1
    return max(1, math.ceil(save_s / (SAVE_SHARE * step_s * base)))


class CheckpointSchedule:
    """The steps a run saves at: ``due(step)`` after each step, ``saved(step, seconds)`` after each save."""

    def __init__(self, base: int, adaptive: bool, steps: int, info: distributed.DistInfo, start_step: int = 0) -> None:
        """``base``: `TrainConfig.checkpoint_every`; ``adaptive``: ckpt_every was left at 0; ``steps``: the
        run's length; ``start_step``: the step it starts (or resumes) at."""
        self.base, self.adaptive, self.info = base, adaptive, info
        self.k_max = max(1, steps // 2 // base)  # at most half the run between saves
        self.k = 1
        self.next_due = (start_step // base + 1) * base
        self._from_step, self._from_time = start_step, _clock()

    def now(self) -> float:
        """The schedule's clock (what `saved` reckons training time in), for timing a save."""
        return _clock()

    @property
    def every(self) -> int:
        return self.base * self.k

    def due(self, step: int) -> bool:
        return step >= self.next_due

    def saved(self, step: int, save_s: float) -> tuple[int, float] | None:
        """Record a save that ended at ``step`` and took ``save_s`` seconds on this rank. Returns (the new
        interval, the slowest rank's save) when the interval grew, else None. Called on every rank after
        every save: it all-reduces when the interval is adaptive."""
        now = _clock()
        steps, train_s = step - self._from_step, now - self._from_time - save_s
        self._from_step, self._from_time = step, now
        grew = None
        if self.adaptive:
            k = stretch(self.base, save_s, train_s / steps) if steps > 0 else self.k
            agreed, slowest = distributed.max_across([float(min(k, self.k_max)), save_s], self.info)
            if int(agreed) > self.k:
                self.k = int(agreed)
                grew = (self.every, slowest)
        self.next_due = (step // self.base) * self.base + self.every
        return grew
