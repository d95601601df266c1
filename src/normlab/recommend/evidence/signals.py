"""The signals that predict trouble before a run fails, per proxy run: the largest attention logit and the
largest activation over training (first and last probe, and the growth per 100 steps), each against what
the user's precision can hold.

Why these two. Attention-logit growth is the instability that appears first at scale and that QK-norm
removes (Dehghani et al. 2023, ViT-22B, Sec. 3.1.1: logits past ~5e4 collapsed attention entropy and
diverged; Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", Sec. 3.1: the same growth reproduced in small models at high learning rates, and
qk-layernorm removes it); Muon makes it worse without QK-clip (Kimi K2, 2025). The largest activation is
the stream Kim et al. 2025 (Peri-LN, Sec. 4) show growing past fp16's 65,504 under Pre-LN.

What a precision can hold (`LIMITS`):
- fp16 stores activations up to 65,504 (`FP16_MAX`): past it they overflow. Its 10-bit significand
  carries a relative error of 2^-11 in each stored q and k, so a logit L = q.k is uncertain by up to
  about L * 2^-11 nats where its terms share a sign: past 2,048, by about a nat.
- bf16 has fp32's exponent range: no overflow at any size a model reaches. What it risks is its 7-bit
  significand: relative error 2^-8, so a logit past 256 is uncertain by about a nat (the softmax's weights
  then move by factors of e), and a stream entry of size A absorbs any update smaller than A * 2^-8 (a
  massive activation freezes its channel in bf16 storage).
These limits are a heuristic bound, not a measurement: the error of q.k depends on sum |q_i k_i| (larger than
|L| where terms cancel) and the products accumulate in fp32 in most kernels; what they mark is the scale at
which the stored precision, not the model, decides the attention weights.
- fp32 (2^-24) reaches one nat of logit error only past 1.7e7.
A run "at risk" ended with its largest logit past its precision's logit limit, or (fp16) its largest
activation within `HEADROOM` of the overflow (`normlab.experiments.transfer`: the same margin the
transfer study counts as a predicted failure).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from normlab.diagnostics.stats import OVERFLOW_HEADROOM as HEADROOM
from normlab.diagnostics.stats import PRECISION_LIMITS as LIMITS
from normlab.diagnostics.stats import log_growth
from normlab.runs.files import RunDir
from normlab.runs.metrics import ProbeMetric
from normlab.runs.outcome import FINISHED


def limits(precision: str) -> tuple[float, float]:
    """(logit limit, activation limit) of the precision activations are stored in (fp32 for anything else)."""
    return LIMITS.get(precision, LIMITS["fp32"])


@dataclass
class Series:
    """One quantity over a run's probes: first and last value, the growth factor per 100 steps (a least-squares
    fit of log value against step over the probes after step 0: the init's own value is not growth) and the
    steps until `limit` at that growth (None: not growing, or no limit)."""

    first: float
    last: float
    growth: float  # x per 100 steps
    steps_to_limit: float | None

    def words(self) -> str:
        """ "57 -> 1,218 (x3.4 / 100 steps)" """
        return f"{self.first:,.3g} -> {self.last:,.4g} (x{self.growth:.2g} / 100 steps)"


def fit(points: list[tuple[int, float]], limit: float = math.inf) -> Series | None:
    """`Series` of (step, value) points (None where fewer than two finite positive values)."""
    pts = sorted((s, v) for s, v in points if v is not None and math.isfinite(v) and v > 0)
    if len(pts) < 2:
        return None
    grown = [(s, v) for s, v in pts if s > 0] if len(pts) > 2 else pts
    slope = log_growth([(s, math.log(v)) for s, v in grown]) or 0.0
    last = pts[-1][1]
    to_limit = None
    if slope > 0 and math.isfinite(limit):
        to_limit = max(0.0, math.log(limit / last) / slope)
    return Series(pts[0][1], last, math.exp(100 * slope), to_limit)


@dataclass
class RunSignals:
    """A run's largest attention logit and largest activation over training (`Series`), and whether it ended
    at risk under its precision (module doc), with the reason in words."""

    logit: Series | None
    activation: Series | None
    at_risk: bool
    risk: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_signals(run: RunDir, precision: str) -> RunSignals:
    """The signals of one run folder's probes (probes.jsonl: `attn` max_logit by block, `global` max_abs)."""
    logit_limit, act_limit = limits(precision)
    by_step: dict[int, float] = {}
    acts: list[tuple[int, float]] = []
    for r in run.probes():
        site, metric, value = r.get("site"), r.get("metric"), r.get("value")
        if not isinstance(value, (int, float)):
            continue
        if site == "attn" and metric == ProbeMetric.MAX_LOGIT:
            by_step[r["step"]] = max(by_step.get(r["step"], -math.inf), float(value))
        elif site == "global" and metric == "max_abs":
            acts.append((r["step"], float(value)))
    logit = fit(sorted(by_step.items()), logit_limit)
    act = fit(acts, act_limit / HEADROOM if math.isfinite(act_limit) else math.inf)
    reasons = []
    if logit is not None and logit.last > logit_limit:
        reasons.append(
            f"largest attention logit {logit.last:,.0f} past {logit_limit:,.0f}, where {precision}'s q and k "
            "leave about a nat of error"
        )
    if act is not None and math.isfinite(act_limit) and act.last > act_limit / HEADROOM:
        reasons.append(f"largest activation {act.last:,.0f} within {HEADROOM:g}x of {precision}'s {act_limit:,.0f}")
    return RunSignals(logit, act, bool(reasons), "; ".join(reasons))


def precision_words(precision: str) -> str:
    """What the precision risks, for the report."""
    logit_limit, act_limit = limits(precision)
    if precision == "bf16":
        return (
            "bf16 has fp32's exponent range, so nothing overflows; its 8-bit significand is the risk: attention "
            f"logits past {logit_limit:,.0f} carry about a nat of error from the stored q and k (a heuristic bound), "
            "and a stream entry of size A absorbs updates below A/256."
        )
    if precision == "fp16":
        return (
            f"fp16 overflows past {act_limit:,.0f} (activations within {HEADROOM:g}x of it count as at risk) and its "
            f"attention logits past {logit_limit:,.0f} carry about a nat of error (a heuristic bound)."
        )
    return f"{precision}: attention logits past {logit_limit:,.0g} carry about a nat of error (a heuristic bound)."


SIGNAL_COLUMNS = ("logit_first", "logit_last", "logit_growth", "logit_steps_to_limit", "act_growth", "at_risk", "risk")


def with_signals(runs: Any, sweep: Any, precision: str) -> Any:
    """`runs` (`load_sweep`'s table) with each finished run's signals as columns (`SIGNAL_COLUMNS`; NaN, False
    and "" where a run has no probes or did not finish); `sweep`: its `SweepDir`."""
    out = runs.copy()
    values: dict[str, list[Any]] = {c: [] for c in SIGNAL_COLUMNS}
    for row in out.itertuples():
        s = run_signals(sweep.run(row.run_id), precision) if row.status in FINISHED else None
        lg, act = (s.logit, s.activation) if s is not None else (None, None)
        values["logit_first"].append(lg.first if lg else math.nan)
        values["logit_last"].append(lg.last if lg else math.nan)
        values["logit_growth"].append(lg.growth if lg else math.nan)
        values["logit_steps_to_limit"].append(lg.steps_to_limit if lg and lg.steps_to_limit is not None else math.nan)
        values["act_growth"].append(act.growth if act else math.nan)
        values["at_risk"].append(bool(s and s.at_risk and row.status == "ok"))
        values["risk"].append(s.risk if s is not None and row.status == "ok" else "")
    for c, v in values.items():
        out[c] = v
    return out


__all__ = [
    "LIMITS",
    "SIGNAL_COLUMNS",
    "RunSignals",
    "Series",
    "fit",
    "limits",
    "precision_words",
    "run_signals",
    "with_signals",
]
