"""What each early warning's threshold is, what the lead-time study measured of it, and what to do when it
fires (issue 66 item 4).

`THRESHOLDS`: per detector (`normlab.diagnostics.early_warning.DETECTORS`), the one number its rule turns on,
its default, the grid the lead-time study's precision-recall curve replays it over and whether a larger value
warns more often (``looser``: a longer horizon) or less (a higher bar). `ACTIONS`: what to do when it fires.

warning_record.json (in the package, beside this module) is written by `normlab leadtime SWEEP... --record
FILE` from the study's runs: per detector, at its default threshold, how many of its warnings an event
followed within the study's horizon and the median lead. `advice` turns that into the sentence a live alert
carries: "logit growth: 39 of 48 such warnings preceded a divergence within 500 steps, median 235 steps ahead
in normlab's study (warn-late-fp16, warn-late-muon: 60 runs, 16 seeds); lower the learning rate, or add QK-norm
or QK-clip". A detector the
study measured at another threshold than the one in use, or never measured, says so instead of borrowing
figures.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from normlab.diagnostics import precursors
from normlab.errors import ConfigError

RECORD = Path(__file__).with_name("warning_record.json")


@dataclass(frozen=True)
class Threshold:
    """One detector's threshold: its meaning, default, the study's grid and its direction."""

    meaning: str
    default: float
    grid: tuple[float, ...]
    looser: bool  # True: a larger value warns more often (and earlier); False: a larger value warns less


_HORIZONS = (12.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0)
_SIGMAS = (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 14.0)

THRESHOLDS: dict[str, Threshold] = {
    "stream growth": Threshold("horizon, steps: a projected overflow this close warns", 50.0, _HORIZONS, True),
    "logit growth": Threshold("horizon, steps: a projected logit limit this close warns", 50.0, _HORIZONS, True),
    "grad-norm spike": Threshold("standard deviations above the window's mean", 6.0, _SIGMAS, False),
    "loss spike": Threshold("standard deviations above the window's mean", 6.0, _SIGMAS, False),
    "update/weight spike": Threshold("standard deviations above the window's mean", 6.0, _SIGMAS, False),
    "spike score": Threshold("share of the steps seen that spiked", 0.02, (0.005, 0.01, 0.02, 0.05, 0.1), False),
    "loss rise": Threshold("nats above the run's first finite loss", 1.0, (0.25, 0.5, 1.0, 2.0, 3.0), False),
    "head logit": Threshold(
        "a head's max attention logit",
        precursors.HEAD_LOGIT_TAU,
        (30.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0),
        False,
    ),
    "qk entropy": Threshold("standard deviations below the window's mean", precursors.ENTROPY_SIGMAS, _SIGMAS, False),
    "qk update entropy": Threshold(
        "standard deviations below the window's mean", precursors.UPDATE_ENTROPY_SIGMAS, _SIGMAS, False
    ),
}

ACTIONS: dict[str, str] = {
    "stream growth": "lower the learning rate, or move the norms (Peri-LN's output norms bound the stream), or "
    "store activations in bf16",
    "logit growth": "lower the learning rate, or add QK-norm or QK-clip",
    "grad-norm spike": "skip the batch (run.on_spike=skip) and look at it (spikes/); lower the learning rate if "
    "they recur",
    "loss spike": "skip the batch (run.on_spike=skip) and look at it (spikes/)",
    "update/weight spike": "lower the learning rate (or its warm-up's slope) before the loss follows",
    "spike score": "lower the learning rate; skip the spiking batches (run.on_spike=skip)",
    "loss rise": "stop and resume from the last checkpoint at a lower learning rate",
    "head logit": "add QK-clip (qk_clip=100) or QK-norm, or lower the learning rate",
    "qk entropy": "add QK-norm or QK-clip, or lower the learning rate",
    "qk update entropy": "lower the learning rate, or add QK-norm or QK-clip",
}


def thresholds_for(given: dict[str, float] | None) -> dict[str, float]:
    """Every detector's threshold: ``given``'s where it names one, else its default; a name that is no
    detector or a value that is not a positive number is refused in one line (ConfigError)."""
    out = {name: t.default for name, t in THRESHOLDS.items()}
    for name, v in (given or {}).items():
        if name not in THRESHOLDS:
            raise ConfigError(f"thresholds: {name!r} is no detector; valid: {', '.join(THRESHOLDS)}")
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v)) and float(v) > 0
        if not ok:
            raise ConfigError(f"thresholds: {name!r} must be a positive number ({THRESHOLDS[name].meaning}), got {v!r}")
        out[name] = float(v)
    return out


@lru_cache(maxsize=4)
def load(path: str = str(RECORD)) -> dict[str, Any]:
    """The record's detectors ({} where the file is missing or not the study's JSON: alerts then carry the
    action alone)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    dets = data.get("detectors") if isinstance(data, dict) else None
    return {"about": data.get("about", ""), "detectors": dets} if isinstance(dets, dict) else {}


def measured(signal: str, threshold: float, record: dict[str, Any] | None = None) -> str:
    """The study's figure for ``signal`` at ``threshold`` in words, or "" where the record has none there."""
    rec = load() if record is None else record
    m = (rec.get("detectors") or {}).get(signal)
    if not isinstance(m, dict) or m.get("threshold") != threshold:
        return ""
    n, k, h = m.get("warnings"), m.get("preceded"), m.get("horizon")
    if not isinstance(n, int) or not isinstance(k, int) or n == 0:
        return ""
    lead = m.get("lead_median")
    ahead = f", median {lead:,.0f} steps ahead" if isinstance(lead, (int, float)) and k else ""
    return (
        f"{signal}: {k} of {n} such warnings preceded a divergence within {h:,} steps{ahead} in normlab's "
        f"study ({rec.get('about') or 'normlab leadtime'})"
    )


def advice(signal: str, threshold: float, record: dict[str, Any] | None = None) -> str:
    """The sentence an alert carries: the detector's measured precision and lead at ``threshold`` (where the
    record has them) and what to do."""
    said = measured(signal, threshold, record)
    act = ACTIONS.get(signal, "")
    if said:
        return f"{said}; {act}" if act else said
    return f"to do: {act}" if act else ""


__all__ = ["ACTIONS", "RECORD", "THRESHOLDS", "Threshold", "advice", "load", "measured", "thresholds_for"]
