"""Numbers a team can set early-warning thresholds by (issue 66 item 3): per detector and failure kind, over
the runs of `normlab leadtime`'s sweeps, each replayed through the detectors at every threshold of its grid
(`normlab.diagnostics.warning_record.THRESHOLDS`).

Definitions (``horizon`` H steps, stated with every table; each detector speaks at most once per run, as it
does live, at its first warning step w):

- an *event* is a run's divergence (or, on a faulted run, its loss passing its initial value: the lead-time
  study's event, `normlab.experiments.leadtime`); its *kind* is its sweep's name (one recipe, one failure,
  whichever folders its seeds ran in);
- **recall**: the events warned of, 0 < event - w <= H, over the events;
- **precision**: the warnings an event followed within H (w < event <= w + H) over all warnings (a warning on
  a faulted run before its fault counts as one that nothing followed; one at or after the event is late, no
  warning and no false alarm, counted apart);
- **false alarms per 1,000 healthy steps**: the warnings nothing followed, per 1,000 steps that were not in
  the H steps before an event (every step of a run without one);
- **lead**: event - w over the events warned of, in steps and as a share of the steps the run had trained
  when it failed (the event step).

Intervals, 95%: for recall and precision the Wilson score interval (Wilson 1927: a proportion of few runs,
where the normal approximation breaks at 0 and n); for the false-alarm rate the exact Poisson interval on its
count (Garwood 1936: chi-square quantiles, count/exposure); for the median lead a cluster bootstrap over
seeds (the runs of a resampled seed taken together, `BOOTSTRAP` resamples, percentile interval, a fixed RNG
seed so the same runs give the same interval): with three seeds it has few distinct resamples and says so by
its width.

The default threshold chosen from each detector's precision-recall curve: the grid point of the largest F1
(the harmonic mean of precision and recall: a missed divergence and a page that nothing followed weighed
alike, the one criterion that needs no cost ratio a team has not given), ties to the stricter threshold
(fewer warnings); a detector that warned of no event at any threshold keeps its default.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from normlab.diagnostics.warning_record import THRESHOLDS

HORIZON = 500  # steps: a warning an event follows within this many steps preceded it
BOOTSTRAP = 2000
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass
class Replayed:
    """One run: its kind, seed, steps trained, event step (None: none), fault step, and per threshold grid
    position per detector the first warning's step (None: silent)."""

    run_id: str
    kind: str
    seed: int
    steps: int
    event: int | None
    fault_step: int = 0
    warnings: dict[str, list[int | None]] = field(default_factory=dict)  # detector -> per grid point
    default: dict[str, int | None] = field(default_factory=dict)  # detector -> at its default threshold


def wilson(k: int, n: int) -> tuple[float, float] | None:
    """Wilson's 95% score interval for k successes of n (None for n = 0)."""
    if n == 0:
        return None
    p, z2 = k / n, Z95 * Z95
    mid = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def poisson_rate(count: int, exposure: float, per: float = 1000.0) -> tuple[float, float] | None:
    """Garwood's exact 95% interval of a Poisson rate, ``count`` events in ``exposure`` units, per ``per``."""
    from scipy.stats import chi2

    if exposure <= 0:
        return None
    lo = 0.0 if count == 0 else chi2.ppf(0.025, 2 * count) / 2
    hi = chi2.ppf(0.975, 2 * count + 2) / 2
    return float(lo) * per / exposure, float(hi) * per / exposure


def seed_bootstrap_median(leads_by_seed: dict[int, list[float]]) -> tuple[float, float] | None:
    """The 95% percentile interval of the median lead, resampling seeds (each with its runs' leads)."""
    import numpy as np

    seeds = sorted(leads_by_seed)
    if not any(leads_by_seed.values()):
        return None
    rng = np.random.default_rng(0)
    meds = []
    for _ in range(BOOTSTRAP):
        pick = rng.integers(0, len(seeds), len(seeds))
        pooled = [x for i in pick for x in leads_by_seed[seeds[i]]]
        if pooled:
            meds.append(float(np.median(pooled)))
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _fields(runs: list[Replayed], warned_at: list[int | None], horizon: int) -> dict[str, Any]:
    """The counts and leads of one detector at one threshold over ``runs`` (``warned_at``: each run's
    first warning step, or None)."""
    events = [r for r in runs if r.event is not None]
    leads: dict[int, list[float]] = {}
    shares: list[float] = []
    warned = preceded = alarms = late = 0
    healthy = 0.0
    for r, w in zip(runs, warned_at):
        healthy += r.steps if r.event is None else max(0, r.event - horizon)
        if w is None:
            continue
        event = r.event if r.event is not None else -1
        if 0 <= event <= w:  # at or after the event: no warning, and no false alarm either (late)
            late += 1
            continue
        warned += 1
        if event >= 0 and w >= r.fault_step and 0 < event - w <= horizon:
            preceded += 1
            leads.setdefault(r.seed, []).append(float(event - w))
            shares.append((event - w) / max(1, event))
        else:
            alarms += 1
    pooled = sorted(x for v in leads.values() for x in v)
    return {
        "events": len(events),
        "warned": preceded,
        "warnings": warned,
        "preceded": preceded,
        "false_alarms": alarms,
        "late": late,
        "healthy_steps": int(healthy),
        "lead_median": statistics.median(pooled) if pooled else None,
        "lead_min": pooled[0] if pooled else None,
        "lead_max": pooled[-1] if pooled else None,
        "lead_share_median": statistics.median(shares) if shares else None,
        "_leads": leads,
    }


def measure(runs: list[Replayed], warned_at: list[int | None], horizon: int) -> dict[str, Any]:
    """`_fields` with their rates and intervals (module docstring)."""
    f = _fields(runs, warned_at, horizon)
    leads = f.pop("_leads")
    n_ev, n_w = f["events"], f["warnings"]
    f["recall"] = f["warned"] / n_ev if n_ev else None
    f["recall_ci"] = wilson(f["warned"], n_ev)
    f["precision"] = f["preceded"] / n_w if n_w else None
    f["precision_ci"] = wilson(f["preceded"], n_w)
    f["alarms_per_1k"] = 1000 * f["false_alarms"] / f["healthy_steps"] if f["healthy_steps"] else None
    f["alarms_ci"] = poisson_rate(f["false_alarms"], f["healthy_steps"])
    f["lead_ci"] = seed_bootstrap_median(leads) if f["lead_median"] is not None else None
    return f


def f1(m: dict[str, Any]) -> float:
    p, r = m.get("precision"), m.get("recall")
    return 0.0 if not p or not r else 2 * p * r / (p + r)


def pr_curve(runs: list[Replayed], signal: str, horizon: int) -> list[dict[str, Any]]:
    """The detector's measures at each threshold of its grid, over every run given."""
    grid = THRESHOLDS[signal].grid
    return [
        {"threshold": t, **measure(runs, [r.warnings[signal][i] for r in runs], horizon)} for i, t in enumerate(grid)
    ]


def choose(curve: list[dict[str, Any]], signal: str) -> float:
    """The threshold of largest F1 on ``curve``, ties to the stricter (module docstring); the detector's
    default where no threshold warned of an event."""
    best = max((f1(m) for m in curve), default=0.0)
    if best <= 0:
        return THRESHOLDS[signal].default
    tied = [m["threshold"] for m in curve if f1(m) == best]
    # stricter: a shorter horizon for the growth rules (looser with size), a higher bar for the rest
    return min(tied) if THRESHOLDS[signal].looser else max(tied)


def table(runs: list[Replayed], horizon: int) -> list[dict[str, Any]]:
    """Per detector and kind (and "all" kinds), at the detector's default threshold."""
    rows = []
    kinds = sorted({r.kind for r in runs})
    for signal in THRESHOLDS:
        for kind in [*kinds, "all"] if len(kinds) > 1 else kinds:
            mine = [r for r in runs if kind == "all" or r.kind == kind]
            m = measure(mine, [r.default[signal] for r in mine], horizon)
            rows.append({"signal": signal, "kind": kind, "threshold": THRESHOLDS[signal].default, **m})
    return rows


__all__ = [
    "HORIZON",
    "Replayed",
    "choose",
    "measure",
    "poisson_rate",
    "pr_curve",
    "seed_bootstrap_median",
    "table",
    "wilson",
]
