"""When a run saves a checkpoint.

With ``ckpt_every`` set, every that many steps. Left at 0, every 10% of the run (10 to 100 steps apart), and
stretched where a save is expensive: a save that took ``MATERIAL_S`` or more sets the interval to the smallest
multiple of that base for which saving costs at most ``SAVE_SHARE`` of the time spent training. Measured on
an NVIDIA H200 (docs/benchmarks.md, GPU lease of 2026-11-26): gpu-126m's 1.5 GB checkpoint took seconds
against 70 ms steps, so a save every 100 steps spent more time saving than training. A run whose saves
take under a second (every CPU run of the suite) keeps the base interval: its checkpoint steps stay a
function of its configuration alone.

Under torchrun every rank must save at the same step (a sharded save is collective), so the multiple is
agreed after each save: the largest over the ranks (the slowest save decides). The interval stays a
multiple of the base, so the checkpoint steps stay multiples of the base as a fixed interval's are. A
resumed run starts again from the base and stretches after its first save.
"""

from __future__ import annotations

import math
import time

from normlab.train import distributed

SAVE_SHARE = 0.05  # saving costs at most this share of the training time between two saves
MATERIAL_S = 1.0  # a save quicker than this never stretches the interval


def stretch(base: int, save_s: float, step_s: float) -> int:
    """The multiple of ``base`` steps between saves for which a save of ``save_s`` seconds costs at most
    ``SAVE_SHARE`` of training steps of ``step_s`` seconds: ceil(save_s / (SAVE_SHARE * step_s * base)),
    1 for a save under ``MATERIAL_S``."""
    if save_s < MATERIAL_S or step_s <= 0:
        return 1
    return max(1, math.ceil(save_s / (SAVE_SHARE * step_s * base)))


class CheckpointSchedule:
    """The steps a run saves at: ``due(step)`` after each step, ``saved(step, seconds)`` after each save."""

    def __init__(self, base: int, adaptive: bool, info: distributed.DistInfo, start_step: int = 0) -> None:
        """``base``: `TrainConfig.checkpoint_every`; ``adaptive``: ckpt_every was left at 0."""
        self.base = base
        self.adaptive = adaptive
        self.every = self.base
        self.info = info
        self._from_step, self._from_time = start_step, time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def saved(self, step: int, save_s: float) -> int | None:
        """Record a save that ended at ``step`` and took ``save_s`` seconds (on this rank); the new interval
        when it changed, else None. Called on every rank after every save (it may all-reduce)."""
        now = time.perf_counter()
        steps, train_s = step - self._from_step, now - self._from_time - save_s
        self._from_step, self._from_time = step, now
        if not self.adaptive:
            return None
        k = stretch(self.base, save_s, train_s / steps) if steps > 0 else 1
        k = int(distributed.max_across([float(k)], self.info)[0])
        every, self.every = self.every, self.base * k
        return self.every if self.every != every else None
