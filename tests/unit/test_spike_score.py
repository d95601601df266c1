"""OLMo-core's spike score (normlab.diagnostics.stability.spike_score), against its rule worked by hand."""

from __future__ import annotations

import math

import pytest

from normlab.diagnostics.stability import spike_score


def test_a_jump_past_six_sigma_counts_once_the_window_is_full():
    # alternating 1.0 / 1.2: mean 1.1, population std 0.1 over the window of 8; 6 sigma above: 1.7
    base = [1.0, 1.2] * 4
    grads = [0.5] * 9  # a flat series never spikes (std 0)
    assert spike_score([*base, 1.69], grads, window=8, sigmas=6.0)["spike_steps"] == 0
    out = spike_score([*base, 1.71], grads, window=8, sigmas=6.0)
    assert out["spike_steps"] == 1
    assert out["spike_score"] == pytest.approx(1 / 9)
    assert out["spike_score_steps"] == 9 and out["spike_score_window"] == 8
    # before the window is full nothing is checked: the same jump at step 3 is no spike
    assert spike_score([1.0, 1.2, 9.0, *base], [0.5] * 11, window=8)["spike_steps"] == 0


def test_the_windows_slide_and_a_step_counts_once_when_both_series_spike():
    window = [1.0, 1.2] * 4
    losses = [*window, 3.0]
    grads = [*[2.0, 2.4] * 4, 9.0]
    assert spike_score(losses, grads, window=8)["spike_steps"] == 1
    # the spike entered the loss window: the next ordinary value is not a spike against it
    assert spike_score([*losses, 1.1], [*grads, 2.2], window=8)["spike_steps"] == 1


def test_no_score_before_the_window_is_full_and_non_finite_values_are_not_spikes():
    assert spike_score([1.0] * 5, [1.0] * 5, window=8)["spike_score"] is None
    out = spike_score([*[1.0, 1.2] * 4, math.nan, math.inf], [1.0] * 10, window=8)
    assert out["spike_steps"] == 0 and out["spike_score"] == 0.0
