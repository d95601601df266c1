"""The threshold study's numbers (issue 66 item 3) on constructed runs whose recall, precision, false-alarm
rate and leads are worked out by hand, its intervals against their formulas, and the chosen threshold."""

from __future__ import annotations

import math

import pytest

from normlab.diagnostics.warning_record import THRESHOLDS
from normlab.experiments import leadtime_stats as ls
from normlab.experiments.leadtime_study import markdown, record

H = 100


def _run(rid, seed, steps, event, first, kind="k"):
    """A run whose every detector first warned at ``first`` (None: silent) at every threshold."""
    r = ls.Replayed(rid, kind, seed, steps, event)
    for s, t in THRESHOLDS.items():
        r.warnings[s] = [first] * len(t.grid)
        r.default[s] = first
    return r


def _runs():
    # seed 0: an event at 1,000 warned at 950 (lead 50); a healthy run warned at 300 (false alarm)
    # seed 1: an event at 1,200 warned at 1,000 (lead 200 > H: not counted; a warning nothing followed)
    # seed 2: an event at 1,100 warned at 1,080 (lead 20); a healthy run never warned
    return [
        _run("a", 0, 1000, 1000, 950),
        _run("b", 0, 1500, None, 300),
        _run("c", 1, 1200, 1200, 1000),
        _run("d", 2, 1100, 1100, 1080),
        _run("e", 2, 1500, None, None),
        _run("f", 2, 800, 800, 800),  # warned at its event's own step: late, neither warning nor false alarm
    ]


def test_recall_precision_false_alarms_and_leads_by_hand():
    runs = _runs()
    m = ls.measure(runs, [r.default["loss spike"] for r in runs], H)
    assert (m["events"], m["warned"], m["late"]) == (
        4,
        2,
        1,
    )  # a and d within 100 steps; c 200 steps ahead: not within H
    assert (m["warnings"], m["preceded"], m["false_alarms"]) == (4, 2, 2)  # b's and c's warnings: nothing followed
    # healthy steps: b 1,500 + e 1,500 + the steps before event - H: a 900, c 1,100, d 1,000, f 700
    assert m["healthy_steps"] == 1500 + 1500 + 900 + 1100 + 1000 + 700
    assert m["alarms_per_1k"] == pytest.approx(2 * 1000 / 6700)
    assert (m["lead_median"], m["lead_min"], m["lead_max"]) == (35, 20, 50)
    assert m["lead_share_median"] == pytest.approx((50 / 1000 + 20 / 1100) / 2)
    assert m["recall"] == pytest.approx(2 / 4) and m["precision"] == pytest.approx(1 / 2)


def test_wilson_matches_its_formula_and_the_poisson_interval_its_chi_square_form():
    k, n, z = 2, 3, 1.959963984540054
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo, hi = ls.wilson(k, n)
    assert lo == pytest.approx(centre - half, rel=1e-12) and hi == pytest.approx(centre + half, rel=1e-12)
    assert ls.wilson(0, 5)[0] == 0.0 and ls.wilson(0, 0) is None
    # Garwood: 0 events -> [0, -ln(0.025)] (chi2 with 2 d.o.f. / 2 is an exponential), per 1,000 of 2,000 steps
    lo, hi = ls.poisson_rate(0, 2000)
    assert lo == 0.0 and hi == pytest.approx(-math.log(0.025) * 1000 / 2000, rel=1e-9)


def test_the_seed_bootstrap_is_degenerate_with_one_seed_and_fixed_between_calls():
    assert ls.seed_bootstrap_median({0: [10.0, 30.0]}) == (20.0, 20.0)  # one seed: every resample the same
    two = {0: [10.0], 1: [30.0]}
    lo, hi = ls.seed_bootstrap_median(two)
    assert (lo, hi) == (10.0, 30.0) and ls.seed_bootstrap_median(two) == (lo, hi)  # same runs, same interval


def test_the_chosen_threshold_is_the_largest_f1_ties_to_the_stricter():
    curve = [
        {"threshold": 3.0, "precision": 0.2, "recall": 1.0},
        {"threshold": 6.0, "precision": 0.5, "recall": 0.5},
        {"threshold": 8.0, "precision": 0.5, "recall": 0.5},
        {"threshold": 10.0, "precision": None, "recall": 0.0},
    ]
    # F1: 1/3, 1/2, 1/2, 0 -> 6 and 8 tie; sigmas: a higher bar is stricter
    assert ls.choose(curve, "loss spike") == 8.0
    horizon_curve = [dict(c, threshold=t) for c, t in zip(curve, (12.0, 25.0, 50.0, 100.0))]
    assert ls.choose(horizon_curve, "stream growth") == 25.0  # horizons: the shorter is stricter
    assert ls.choose([{"threshold": 1.0, "precision": None, "recall": 0.0}], "loss rise") == 1.0  # the default


def test_the_table_and_the_record_say_the_same_counts():
    runs = _runs()
    text = markdown(runs, H)
    assert "6 runs over 3 seed(s)" in text and "4 events (2 after step 1,000)" in text
    assert "| loss spike (6) | k | 2/4 50%" in text
    rec = record(runs, H, ["/somewhere/k"])
    m = rec["detectors"]["loss spike"]
    assert (m["warnings"], m["preceded"], m["lead_median"], m["horizon"]) == (4, 2, 35, H)
    assert rec["sweeps"] == ["k"]
