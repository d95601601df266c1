"""The newer precursors beside the early warnings' detectors (`normlab.diagnostics.early_warning`, issue 66):

- ``head logit``: a head's own maximum attention logit (the tier's ``max_logit``, per block per head: the
  quantity kernel-side maxima now expose, cuDNN-frontend PR 1131, Transformer Engine's ``return_max_logit``)
  at or past ``tau`` on `HEAD_PERSIST` tier rows in a row. Where ``logit growth`` projects the largest
  logit to the precision's limit, this one is the threshold rule QK-clip acts on (Kimi K2's tau,
  arXiv 2507.20534, Sec. 2.1: they used 100). Its default is the lead-time study's choice from its
  precision-recall curve (docs/results.md, "Early warnings at length"): at 100 it fired on every run of the
  study hundreds of steps before anything failed.
- ``qk entropy`` and ``qk update entropy``: a layer's QK spectral entropy (`normlab.diagnostics.qk_spectrum`:
  the normalized entropy (Q3) of each head's bilinear form B_h (Q1), and of the step's first-order term T_h
  (Q2), the quantity Huang et al. 2026, arXiv 2606.28116, monitor), the mean over the layer's heads, falls
  more than ``sigmas`` standard deviations below the mean of that layer's previous `ENTROPY_WINDOW` probe rows
  (OLMo-core's spike rule, `normlab.diagnostics.stability.SpikeScoreRule`, on the negated entropy): the form, or the
  update, collapsing onto fewer directions faster than it has been moving. A fixed drop below a recent maximum
  fired on every run of the lead-time study within its first ~110 steps, when the entropies fall as training
  finds structure (0.97 -> 0.6-0.8 at micro); the window, full only after `ENTROPY_WINDOW` probes, and the
  rule relative to the series' own spread do not.

Each fires at most once per run, as the other detectors do; each reads the merged row `EarlyWarnings.feed`
gets (the tier's row with the QK-spectrum probe's keys of the same step, `merge`) and returns (where,
value, evidence) for the caller's Alert.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.diagnostics.stability import SpikeScoreRule
from normlab.errors import ConfigError
from normlab.runs.metrics import Metric, ProbeMetric

HEAD_LOGIT_TAU = 800.0  # the head-logit rule's default tau (the lead-time study's choice; Kimi K2's QK-clip: 100)
HEAD_PERSIST = 3  # tier rows in a row at or past tau (one sampled row is not a trend)
# the entropy rules' defaults, standard deviations below the window's mean: the lead-time study's choices from
# their precision-recall curves (OLMo-core's 6 for spikes warned of few of its events)
ENTROPY_SIGMAS = 3.0  # the form's
UPDATE_ENTROPY_SIGMAS = 4.0  # the step's first-order term's
ENTROPY_WINDOW = 32  # probe rows in the window (OLMo-core's rule waits for a full one)
QK_SPECTRUM = "qk_spectrum.jsonl"  # the probe's rows in a run folder (normlab.diagnostics.qk_spectrum)
QK_KEYS = ("qk_entropy", "qk_update_entropy")
PRECURSORS = ("head logit", "qk entropy", "qk update entropy")

Found = tuple[str, float, str]  # where, value, evidence


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


@dataclass
class HeadLogit:
    """The head-logit rule (module docstring) at ``tau``."""

    tau: float = HEAD_LOGIT_TAU
    signal: str = "head logit"
    run: dict[tuple[int, int], int] = field(default_factory=dict)  # rows in a row at or past tau, per head
    fired: bool = False

    def feed(self, step: int, row: dict[str, Any]) -> Found | None:
        blocks = row.get(ProbeMetric.MAX_LOGIT)
        if self.fired or not isinstance(blocks, list):
            return None
        for b, heads in enumerate(blocks):
            for h, v in enumerate(heads if isinstance(heads, list) else []):
                over = _number(v) and float(v) >= self.tau
                n = self.run.get((b, h), 0) + 1 if over else 0
                self.run[(b, h)] = n
                if n >= HEAD_PERSIST:
                    self.fired = True
                    return (
                        f"block {b} head {h}",
                        float(v),
                        f"block {b} head {h}: max logit {float(v):,.4g}, at or past {self.tau:g} on {n} tier rows "
                        "in a row",
                    )
        return None


@dataclass
class EntropyFall:
    """An entropy rule (module docstring) over one key of the merged row, at ``sigmas``."""

    signal: str
    key: str
    what: str
    sigmas: float = ENTROPY_SIGMAS
    history: dict[int, deque[float]] = field(default_factory=dict)
    fired: bool = False

    def feed(self, step: int, row: dict[str, Any]) -> Found | None:
        layers = row.get(self.key)
        if self.fired or not isinstance(layers, list):
            return None
        for j, heads in enumerate(layers):
            vals = [float(v) for v in heads if _number(v)] if isinstance(heads, list) else []
            if not vals:
                continue
            v = sum(vals) / len(vals)
            hist = self.history.setdefault(j, deque(maxlen=ENTROPY_WINDOW))
            fell = SpikeScoreRule(ENTROPY_WINDOW, self.sigmas).spikes(-v, [-x for x in hist])
            mean = sum(hist) / len(hist) if hist else v
            hist.append(v)
            if fell:
                self.fired = True
                return (
                    f"layer {j}",
                    v,
                    f"layer {j}: {self.what} {v:.3f} against a mean of {mean:.3f} over its previous "
                    f"{ENTROPY_WINDOW} probes (more than {self.sigmas:g} std below it)",
                )
        return None


def detectors(
    tau: float = HEAD_LOGIT_TAU, sigmas: float = ENTROPY_SIGMAS, update_sigmas: float = UPDATE_ENTROPY_SIGMAS
) -> list[Any]:
    """The three precursors at their thresholds, in `PRECURSORS`' order."""
    return [
        HeadLogit(tau),
        EntropyFall("qk entropy", "qk_entropy", "QK-form spectral entropy", sigmas),
        EntropyFall("qk update entropy", "qk_update_entropy", "QK-update spectral entropy", update_sigmas),
    ]


def check_row(tier: dict[str, Any]) -> None:
    """The QK-spectrum keys of a merged row, each a list (per layer) of lists of numbers or None (per head),
    or a ConfigError in one line."""
    for key in QK_KEYS:
        values = tier.get(key)
        if values is None:
            continue
        ok = isinstance(values, list) and all(
            isinstance(v, list)
            and all(h is None or (isinstance(h, numbers.Real) and not isinstance(h, bool)) for h in v)
            for v in values
        )
        if not ok:
            raise ConfigError(
                f"EarlyWarnings.feed: tier[{str(key)!r}] must be a list of lists of numbers (a layer's heads), "
                f"got {values!r:.80}"
            )


def merge(tier: dict[str, Any] | None, qk: dict[str, Any] | None, step: int) -> dict[str, Any]:
    """The row the detectors read at ``step``: the tier's row and the QK-spectrum probe's, each where it is of
    that step ({} where neither is)."""
    row: dict[str, Any] = {}
    for part in (tier, qk):
        if part and part.get(Metric.STEP) == step:
            row.update(part)
    return row


def qk_rows(run: str | Path) -> dict[int, dict[str, Any]]:
    """A run folder's QK-spectrum rows by step ({} without the file; torn lines skipped)."""
    from normlab.io import read_jsonl

    path = Path(run) / QK_SPECTRUM
    if not path.is_file():
        return {}
    return {r[Metric.STEP]: r for r in read_jsonl(path) if isinstance(r.get(Metric.STEP), int)}


__all__ = ["PRECURSORS", "EntropyFall", "HeadLogit", "check_row", "detectors", "merge", "qk_rows"]
