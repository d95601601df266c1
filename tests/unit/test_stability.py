"""The spike rules of `normlab.diagnostics.stability`, each against its source's formula written out here.

OLMo-core (allenai/OLMo-core):
- src/olmo_core/train/callbacks/stability_monitor.py, `StabilityMonitorCallback._is_spike`: no check before the
  history holds window_size values; mean = sum / n; variance = sum((x - mean)^2) / n; no spike when std < 1e-10;
  spike when value > mean + threshold_std * std;
- src/olmo_core/optim/skip_step_optimizer.py, `SkipStepOptimizer.get_step_factor`: no skip while the history
  (this step's value included) holds fewer than max(2, rolling_interval_length // 2) values; std, mean =
  torch.std_mean(previous values) (sample std); the step applies when value - mean <= sigma_factor * std.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from normlab.diagnostics.stability import SkipStepRule, SpikeRule, SpikeScoreRule, spike_score
from normlab.diagnostics.tier import TierSpikes
from normlab.train.divergence import SkipRule, SpikeDetector


def olmo_is_spike(value: float, history: list[float], window_size: int, threshold_std: float) -> bool:
    if len(history) < window_size:
        return False
    mean = sum(history) / len(history)
    std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
    if std < 1e-10:
        return False
    return value > mean + threshold_std * std


def olmo_skips(value: float, previous: list[float], rolling: int, sigma: float) -> bool:
    if len(previous) + 1 < max(2, rolling // 2):
        return False
    std, mean = torch.std_mean(torch.tensor(previous, dtype=torch.float64))
    return not bool(value - mean <= sigma * std)


def _series(seed: int, n: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        x = 2.0 + 0.1 * rng.gauss(0, 1)
        out.append(x + (rng.choice([1.0, 3.0, -2.0]) if i % 17 == 16 else 0.0))  # spikes up and down now and then
    return out


@pytest.mark.parametrize("seed", range(3))
def test_the_spike_score_rule_is_olmo_cores(seed):
    values, window, sigmas = _series(seed, 120), 16, 3.0
    rule = SpikeScoreRule(window, sigmas)
    hits = [rule.spikes(v, values[max(0, i - window) : i]) for i, v in enumerate(values)]
    assert hits == [olmo_is_spike(v, values[max(0, i - window) : i], window, sigmas) for i, v in enumerate(values)]
    assert any(hits) and not any(hits[:window])  # nothing before the window is full
    assert rule.min_history == window
    assert not rule.spikes(5.0, [1.0] * window)  # a flat window: never a spike


def test_the_spike_score_counts_steps_where_either_series_spiked():
    losses, grads, window = _series(0, 80), _series(1, 80), 16
    rule = SpikeScoreRule(window, 3.0)
    expected = sum(
        rule.spikes(losses[i], losses[max(0, i - window) : i]) or rule.spikes(grads[i], grads[max(0, i - window) : i])
        for i in range(80)
    )
    out = spike_score(losses, grads, window=window, sigmas=3.0)
    assert out["spike_steps"] == expected > 0 and out["spike_score"] == expected / 80


@pytest.mark.parametrize("window", [40, 64, 128])
def test_the_skip_rule_is_olmo_cores_for_upward_spikes(window):
    """For windows of 40 or more the minimum history is OLMo-core's (max(20, w // 2) = w // 2); above the mean
    the two tests agree; below it normlab's two-sided test also skips (a sudden drop), OLMo-core's does not."""
    values, sigmas = _series(2, 300), 4.0
    rule = SkipStepRule(window, sigmas)
    assert rule.min_history == max(2, window // 2)
    up = down = 0
    for i, v in enumerate(values):
        previous = values[max(0, i - window) : i]
        ours, olmo = rule.spikes(v, previous), olmo_skips(v, previous, window, sigmas)
        mean = sum(previous) / len(previous) if previous else v
        if v >= mean:
            assert ours == olmo, i
            up += ours
        else:
            assert not olmo
            down += ours
    assert up > 0 and down > 0  # both kinds happen in this series


def test_the_skip_rule_needs_twenty_values_and_uses_the_sample_std():
    rule = SkipStepRule(window=24, sigmas=2.0)
    assert rule.min_history == 20  # not OLMo-core's 12: normlab's floor
    history = [1.0, 2.0] * 9 + [1.0]  # 19 previous values: with this one, 20
    mean, sample = np.mean(history), np.std(history, ddof=1)
    assert rule.z(10.0, history) == pytest.approx(abs(10.0 - mean) / sample, rel=4 * np.finfo(np.float64).eps)
    assert rule.z(10.0, history[:-1]) is None  # 19 with this one
    assert rule.z(1.0, [1.0] * 30) == 0.0 and rule.z(1.5, [1.0] * 30) == math.inf
    # the run's skip rule (its two windows) gives the same z
    skip = SkipRule(window=24, sigmas=2.0)
    for x in history:
        skip.z_scores(x, x)
    assert skip.z_scores(10.0, 10.0)[0] == rule.z(10.0, history)


@pytest.mark.parametrize("seed", range(3))
def test_the_tier_rule_is_mean_plus_sigmas_population_std_from_min_history(seed):
    values, rule = _series(seed, 100), SpikeRule(sigmas=3.0, window=12, min_history=5)
    tier, detector = TierSpikes(sigmas=3.0, window=12, min_history=5), SpikeDetector()
    fires = 0
    for i, v in enumerate(values):
        previous = values[max(0, i - 12) : i]
        by_hand = len(previous) >= 5 and v > np.mean(previous) + 3.0 * np.std(previous)
        assert rule.spikes(v, previous) == by_hand
        fired = tier.check({"grad_norm": [v]})
        assert (fired == ["grad_norm[0]"]) == by_hand, i
        fires += by_hand
    assert fires > 0
    # the divergence monitor's counts: the same rule at its defaults (6 std, 128 values, from 16 on)
    hits = [detector.update(v) for v in values]
    default = SpikeRule()
    assert hits == [default.spikes(v, values[max(0, i - 128) : i]) for i, v in enumerate(values)]
