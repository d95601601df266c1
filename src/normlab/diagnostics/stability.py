"""The spike rules, each named by its source, with its minimum history and its standard deviation stated.

A spike rule compares a step's value of a series (the loss, the gradient norm, a layer's gradient norm or stream
maximum) with the previous values of the same series. Three rules are used, and they differ on purpose:

=====================  =============================  =========================  ===============  ===========
rule                   source                         history it needs            std              test
=====================  =============================  =========================  ===============  ===========
`SpikeScoreRule`       OLMo-core's spike score        a full window (128)         population (/n)  one-sided
`SkipStepRule`         OLMo-core's skip-step rule     max(20, window // 2) values sample (/(n-1))   two-sided
`SpikeRule`            the tier's per-layer rule      ``min_history`` (16)        population (/n)  one-sided
=====================  =============================  =========================  ===============  ===========

- `SpikeScoreRule`: OLMo-core's ``StabilityMonitorCallback._is_spike``
  (allenai/OLMo-core, src/olmo_core/train/callbacks/stability_monitor.py): a value above
  mean + threshold_std * std of the last ``window_size`` values, checked only once the window is full, never while
  the window is flat (std < 1e-10). Its spike score (`spike_score`) is the share of steps where the loss or the
  gradient norm spiked, defined once ``window`` steps were seen ("spike/SpikeScore (total)"). The early warnings
  (`normlab.diagnostics.early_warning`) and the run summary's spike score use it.
- `SkipStepRule`: OLMo-core's ``SkipStepOptimizer.get_step_factor`` (src/olmo_core/optim/skip_step_optimizer.py):
  the step's value against the mean and sample std (``torch.std_mean``) of the previous values, once the history
  holding this value has max(2, rolling_interval_length // 2) values. normlab's form (``on_spike``:
  `normlab.train.divergence.SkipRule`, `normlab.train.spikes`) differs in two ways, kept so runs reproduce: it tests
  |x - mean| (a sudden drop counts too; OLMo-core's tests x - mean only) and it needs at least 20 values (the
  same as OLMo-core's for windows of 40 or more).
- `SpikeRule`: normlab's count rule on each layer's series (the per-step tier, `normlab.diagnostics.tier`), the
  monitors' loss rule (`normlab.diagnostics.training_monitor`) and the divergence monitor's spike counts
  (`normlab.train.divergence.SpikeDetector`): OLMo-core's threshold (population std, one-sided) but from
  ``min_history`` values on rather than a full window, so short runs and sparse tier steps are covered; no
  flat-window guard (a flat window's std is 0: any larger value spikes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPIKE_SCORE_WINDOW = 128  # OLMo-core's StabilityMonitorCallback defaults: window_size, threshold_std
SPIKE_SCORE_SIGMAS = 6.0
FLAT_STD = 1e-10  # OLMo-core's: no spike while the window's std is below this


@dataclass(frozen=True)
class SpikeScoreRule:
    """OLMo-core's spike rule (module docstring): value > mean + sigmas x population std of the previous
    ``window`` values, once ``window`` values are known; none while the window is flat."""

    window: int = SPIKE_SCORE_WINDOW
    sigmas: float = SPIKE_SCORE_SIGMAS

    @property
    def min_history(self) -> int:
        return self.window

    def spikes(self, value: float, history: Sequence[float]) -> bool:
        """Whether ``value`` spikes against ``history`` (the series' previous values, at most ``window``)."""
        if len(history) < self.window:
            return False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
        return std >= FLAT_STD and value > mean + self.sigmas * std


def spike_score(
    losses: Sequence[float | None],
    grad_norms: Sequence[float | None],
    window: int = SPIKE_SCORE_WINDOW,
    sigmas: float = SPIKE_SCORE_SIGMAS,
) -> dict[str, float | int | None]:
    """OLMo-core's spike score (StabilityMonitorCallback, "spike/SpikeScore (total)"): the share of a run's steps
    whose training loss or gradient norm exceeds the mean of the previous ``window`` (128) values of the same
    series by more than ``sigmas`` (6) standard deviations (`SpikeScoreRule`); a series is checked only once its
    window is full, and the score is defined once ``window`` steps were seen (None before: a run shorter than its
    window). Non-finite values are not spikes here (the divergence rules count them) and do not enter the windows.
    ``losses`` and ``grad_norms`` are per step, aligned (a missing value: NaN or None)."""
    rule = SpikeScoreRule(window, sigmas)
    loss_hist: list[float] = []
    grad_hist: list[float] = []
    spikes = steps = 0
    for loss, grad in zip(losses, grad_norms):
        hit = False
        for value, hist in ((loss, loss_hist), (grad, grad_hist)):
            if value is None or not math.isfinite(value):
                continue
            hit |= rule.spikes(value, hist)
            hist.append(value)
            if len(hist) > window:
                hist.pop(0)
        steps += 1
        spikes += hit
    return {
        "spike_score": spikes / steps if steps >= window else None,
        "spike_steps": spikes,
        "spike_score_steps": steps,
        "spike_score_window": window,
    }


@dataclass(frozen=True)
class SkipStepRule:
    """OLMo-core's skip-step rule in normlab's form (module docstring): |x - mean| > sigmas x sample std of the
    previous ``window`` values, once max(20, window // 2) values are known counting this one."""

    window: int = 128
    sigmas: float = 6.0

    @property
    def min_history(self) -> int:
        """Values known, this one included, before the rule applies."""
        return max(20, self.window // 2)

    def z(self, value: float, history: Sequence[float], min_history: int | None = None) -> float | None:
        """|value - mean| / std (sample std) of ``history``, the previous values; None while fewer than
        ``min_history`` (default `min_history`) values, this one included, are known, or fewer than 2 previous, or
        for a non-finite value. A flat history: 0 for its own value, inf for any other."""
        need = self.min_history if min_history is None else min_history
        if len(history) + 1 < need or len(history) < 2 or not math.isfinite(value):
            return None
        mean, std = statistics.fmean(history), statistics.stdev(history)
        return abs(value - mean) / std if std > 0 else (0.0 if value == mean else math.inf)

    def spikes(self, value: float, history: Sequence[float], min_history: int | None = None) -> bool:
        z = self.z(value, history, min_history)
        return z is not None and z > self.sigmas


@dataclass(frozen=True)
class SpikeRule:
    """The tier's per-layer rule (module docstring): value > mean + ``sigmas`` x population std of the previous
    ``window`` values, once at least ``min_history`` of them are known."""

    sigmas: float = 6.0
    window: int = 128
    min_history: int = 16

    def __post_init__(self) -> None:
        if not (self.sigmas > 0 and self.window >= 2 and 2 <= self.min_history <= self.window):
            raise ValueError(f"a spike rule needs sigmas > 0 and 2 <= min_history <= window, got {self}")

    def threshold(self, history: Sequence[float]) -> float | None:
        """The value above which the next step is a spike, or None while the history is too short."""
        if len(history) < self.min_history:
            return None
        return float(self.limits(np.fromiter(history, dtype=np.float64, count=len(history))))

    def limits(self, windows: np.ndarray) -> np.ndarray:
        """mean + sigmas * std over the last axis (population std): one window's threshold, or many windows' at
        once (a row each)."""
        out: np.ndarray = windows.mean(axis=-1) + self.sigmas * windows.std(axis=-1)
        return out

    def spikes(self, value: float, history: Sequence[float]) -> bool:
        limit = self.threshold(history)
        return limit is not None and value > limit
