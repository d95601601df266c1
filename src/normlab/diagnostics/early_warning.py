"""Early warnings: the signals the per-step tier and the loss row carry, each turned into a detector that
says, at the step it fires, what it saw and where ("block 11's stream 9,120 will reach fp16's 65,504 in
~40 steps at the current growth"). The same detectors run live (`EarlyWarningHook`, a line on stderr, an
event for the loggers, warnings.jsonl) and offline over a finished run's files (`replay`), which is how
the lead-time study (`normlab.experiments.leadtime`) measures how early each warns.

The signals (`DETECTORS`):
- ``stream growth``: per stream layer, the largest |activation| of the tier's rows; a log-linear fit over
  the last `WINDOW` rows (once the value is past `FLOOR` of the limit) projects when it reaches the
  precision's maximum (fp16: 65,504); it fires when that is within `HORIZON` steps on `PERSIST` rows in a
  row, or at once within
  `HEADROOM` of the maximum. Where nothing overflows (bf16, fp32) it stays silent: a large stream there is
  no failure by itself (massive activations), and its risk is the attention logits'.
- ``logit growth``: per block, the largest attention logit over heads; the same projection (or the logit
  past the limit itself: 8x below it is where healthy models live) to the logit the precision still
  resolves to about a nat (bf16 256, fp16 2,048: `normlab.recommend.evidence.signals`; fp32 runs
  are judged at bf16's, where attention is computed at scale).
- ``grad-norm spike``, ``loss spike``: OLMo-core's spike rule (a value above the mean + 6 std of the
  previous values of the series, `normlab.diagnostics.stability.SpikeScoreRule`) over a window of `SPIKE_WINDOW`
  steps (OLMo-core's 128 is longer than a proxy run's healthy stretch).
- ``update/weight spike``: the same rule on the largest per-layer update/weight ratio (marin's observation:
  update-norm spikes come before loss spikes).
- ``spike score``: OLMo-core's spike score (the share of steps with a loss or gradient-norm spike) past
  `SCORE_ALERT` over the steps seen.
- ``loss rise``: an absolute rule that needs no history, so it speaks from the second step on: a loss more
  than `LOSS_RISE` nats above the run's first finite loss (a model e times less likely on its tokens than when
  the run started: at a random init, worse than uniform guessing), or a non-finite loss. The spike rules
  above wait for a full window (`SPIKE_WINDOW` steps); a run that blows up in its first steps passes them
  unseen. Its twin for the stream is the growth detector's headroom check, which also needs no history.

- ``head logit``, ``qk entropy``, ``qk update entropy``: the newer precursors (`normlab.diagnostics.precursors`:
  a head's own max logit past a tau; the QK spectral entropy of `normlab.diagnostics.qk_spectrum` dropping).

Each detector fires at most once per run (its first warning is what a lead time measures); `replay`
returns every detector's first alert. Each turns on one threshold (`normlab.diagnostics.warning_record.
THRESHOLDS`), which `EarlyWarnings(precision, thresholds)` sets; each alert carries its detector's measured
record at that threshold and what to do (``advice``).
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from normlab.diagnostics import precursors
from normlab.diagnostics.hooks import StepHook
from normlab.diagnostics.precursors import PRECURSORS
from normlab.diagnostics.stability import SpikeScoreRule
from normlab.diagnostics.stats import OVERFLOW_HEADROOM, PRECISION_LIMITS, log_growth
from normlab.errors import ConfigError
from normlab.runs.metrics import Metric, ProbeMetric

WINDOW = 20  # tier rows in a growth fit
MIN_POINTS = 10  # rows before a growth fit speaks
FLOOR = 1 / 16  # a growth fit speaks only past this share of the limit (four doublings short of it): the fast
# rise from the init's small values in a run's first steps is not the growth that ends in an overflow
PERSIST = 5  # rows in a row whose projection is within the horizon before it warns (one noisy fit is not growth)
HORIZON = 50  # steps: a projected limit this close warns
HEADROOM = OVERFLOW_HEADROOM  # a value within this factor of the limit warns at once (the transfer study's margin)
SPIKE_WINDOW = 32
SPIKE_SIGMAS = 6.0
SCORE_ALERT = 0.02  # spike score: 2% of the steps seen
LOSS_RISE = 1.0  # nats above the first finite loss: the loss-rise rule (module docstring)
PRECISIONS = ("fp16", "bf16", "fp32")  # the precisions whose limits the detectors know (stats.PRECISION_LIMITS)


@dataclass
class Alert:
    """One warning: which signal, at which step, where, the value and the evidence in words."""

    signal: str
    step: int
    where: str
    value: float
    evidence: str
    advice: str = ""  # the detector's measured record and what to do (normlab.diagnostics.warning_record)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        said = f"normlab warning at step {self.step}: {self.signal}: {self.evidence}"
        return f"{said}. {self.advice}" if self.advice else said


@dataclass
class _Growth:
    """A per-layer growth detector over one list-valued key of the tier's rows."""

    signal: str
    key: str
    what: str
    limit: float  # inf: no overflow in reach, judged by growth since the first row
    precision: str
    reduce: Callable[[Any], float] = float
    headroom: float = HEADROOM  # the value within this factor of the limit warns at once
    horizon: float = HORIZON  # steps: a projected limit this close warns
    history: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    near: dict[int, int] = field(default_factory=dict)  # rows in a row projected within the horizon, per layer
    fired: bool = False

    def feed(self, step: int, row: dict[str, Any]) -> Alert | None:
        values = row.get(self.key)
        if self.fired or not isinstance(values, list):
            return None
        for j, raw in enumerate(values):
            v = self.reduce(raw)
            if not (isinstance(v, float) and math.isfinite(v) and v > 0):
                continue
            hist = self.history.setdefault(j, deque(maxlen=WINDOW))
            hist.append((step, math.log(v)))
            alert = self._judge(step, j, v, hist)
            if alert is not None:
                self.fired = True
                return alert
        return None

    def _judge(self, step: int, j: int, v: float, hist: deque[tuple[int, float]]) -> Alert | None:
        where = f"{self.what} {j}"
        if math.isinf(self.limit):
            return None
        if v * self.headroom >= self.limit:
            return Alert(
                self.signal,
                step,
                where,
                v,
                f"{where}: {v:,.4g}, "
                + (f"within {self.headroom:g}x of " if self.headroom > 1 else "past ")
                + f"{self.precision}'s {self.limit:,.0f}",
            )
        if len(hist) < MIN_POINTS or v < FLOOR * self.limit:
            self.near[j] = 0
            return None
        slope = log_growth(hist)
        if slope is None:
            return None
        if slope <= 0:
            self.near[j] = 0
            return None
        to_limit = math.log(self.limit / v) / slope
        self.near[j] = self.near.get(j, 0) + 1 if to_limit <= self.horizon else 0
        if self.near[j] < PERSIST:
            return None
        return Alert(
            self.signal,
            step,
            where,
            v,
            f"{where}: {v:,.4g} will reach {self.precision}'s {self.limit:,.0f} in ~{to_limit:,.0f} steps at the "
            f"current growth (doubling every {math.log(2) / slope:,.3g} steps)",
        )


@dataclass
class _Spike:
    """OLMo-core's spike rule on one series (a metrics key, or a tier key reduced over layers)."""

    signal: str
    read: Callable[[dict[str, Any], dict[str, Any]], float | None]
    what: str
    sigmas: float = SPIKE_SIGMAS
    history: list[float] = field(default_factory=list)
    fired: bool = False
    hit: bool = False  # whether the last value fed was a spike by OLMo-core's rule (the spike score counts
    # every one, at SPIKE_SIGMAS whatever this detector's own threshold: the score is OLMo-core's)

    def feed(self, step: int, tier: dict[str, Any], metrics: dict[str, Any]) -> Alert | None:
        v = self.read(tier, metrics)
        self.hit = False
        if v is None or not math.isfinite(v):
            return None
        self.hit = SpikeScoreRule(SPIKE_WINDOW, SPIKE_SIGMAS).spikes(v, self.history)
        mine = (
            self.hit
            if self.sigmas == SPIKE_SIGMAS
            else SpikeScoreRule(SPIKE_WINDOW, self.sigmas).spikes(v, self.history)
        )
        self.history.append(v)
        if len(self.history) > SPIKE_WINDOW:
            self.history.pop(0)
        if not mine or self.fired:
            return None
        self.fired = True
        mean = sum(self.history[:-1]) / max(1, len(self.history) - 1)
        return Alert(
            self.signal,
            step,
            self.what,
            v,
            f"{self.what} {v:,.4g} against a mean of {mean:,.4g} over the previous {SPIKE_WINDOW} steps "
            f"(more than {self.sigmas:g} std above it)",
        )


@dataclass
class _Rise:
    """The loss-rise rule (module docstring): the first finite loss is the start; a later loss more than
    `LOSS_RISE` above it, or a non-finite one, fires."""

    signal: str = "loss rise"
    rise: float = LOSS_RISE
    start: float | None = None
    start_step: int | None = None
    fired: bool = False

    def feed(self, step: int, metrics: dict[str, Any]) -> Alert | None:
        v = metrics.get(Metric.LOSS)
        if self.fired or v is None:
            return None
        v = float(v)
        if math.isfinite(v) and self.start is None:
            self.start, self.start_step = v, step
            return None
        if math.isfinite(v) and v <= self.start + self.rise:  # type: ignore[operator]  # set above
            return None
        self.fired = True
        if not math.isfinite(v):
            return Alert(self.signal, step, "loss", v, f"the loss is {v} (non-finite)")
        return Alert(
            self.signal,
            step,
            "loss",
            v,
            f"loss {v:,.4g}, {v - self.start:,.3g} nats above its start ({self.start:,.4g} at step "  # type: ignore[operator]
            f"{self.start_step}; the rule: more than {self.rise:g})",
        )


def _metric(key: str) -> Callable[[dict[str, Any], dict[str, Any]], float | None]:
    def read(tier: dict[str, Any], metrics: dict[str, Any]) -> float | None:
        v = metrics.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    return read


def _largest(key: str) -> Callable[[dict[str, Any], dict[str, Any]], float | None]:
    def read(tier: dict[str, Any], metrics: dict[str, Any]) -> float | None:
        vals = [float(v) for v in tier.get(key) or [] if isinstance(v, (int, float)) and math.isfinite(v)]
        return max(vals) if vals else None

    return read


def _max_head(heads: Any) -> float:
    vals = [float(h) for h in heads if isinstance(h, (int, float))] if isinstance(heads, list) else []
    return max(vals) if vals else math.nan


DETECTORS = (
    "stream growth",
    "logit growth",
    "grad-norm spike",
    "loss spike",
    "update/weight spike",
    "spike score",
    "loss rise",
    *PRECURSORS,
)


def _step(step: Any, last: int | None) -> int:
    """``step`` as the next step to feed, or a ConfigError: a whole number >= 0 after the last one fed."""
    try:
        n = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ConfigError(f"EarlyWarnings.feed: the step must be a whole number >= 0, got {step!r}")
    if last is not None and n <= last:
        raise ConfigError(
            f"EarlyWarnings.feed: step {n} does not come after the last step fed ({last}); steps must increase"
        )
    return n


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_rows(tier: Any, metrics: Any) -> None:
    """The rows `EarlyWarnings.feed` reads, each refused in one line (ConfigError) where its shape is not the
    one the detectors read: dicts; the metrics' ``loss`` and ``grad_norm`` numbers or None; the tier's
    ``stream_max`` and ``update_ratio`` lists of numbers (a layer each) and ``max_logit`` a list of lists of
    numbers (a block's heads)."""
    for name, row in (("tier", tier), ("metrics", metrics)):
        if not isinstance(row, dict):
            raise ConfigError(
                f"EarlyWarnings.feed: {name} must be a dict (its row for the step, or {{}}), got {type(row).__name__}"
            )
    for metric in (Metric.LOSS, Metric.GRAD_NORM):
        v = metrics.get(metric)
        if v is not None and not _number(v):
            raise ConfigError(f"EarlyWarnings.feed: metrics[{str(metric)!r}] must be a number or None, got {v!r}")
    for key, nested in (
        (ProbeMetric.STREAM_MAX, False),
        (ProbeMetric.UPDATE_RATIO, False),
        (ProbeMetric.MAX_LOGIT, True),
    ):
        values = tier.get(key)
        if values is None:
            continue
        shape = "a list of lists of numbers (a block's heads)" if nested else "a list of numbers (one per layer)"
        ok = isinstance(values, list) and all(
            (isinstance(v, list) and all(_number(h) or h is None for h in v)) if nested else (_number(v) or v is None)
            for v in values
        )
        if not ok:
            raise ConfigError(f"EarlyWarnings.feed: tier[{str(key)!r}] must be {shape}, got {values!r:.80}")
    precursors.check_row(tier)


class EarlyWarnings:
    """Every detector of the module doc (and `normlab.diagnostics.precursors`') for one run in `precision`;
    `feed` each step's tier row (or {} on a step without one; the QK-spectrum probe's keys merged in where it
    ran) and metrics row; it returns the alerts that fired at that step, each with its detector's measured
    record and what to do (`normlab.diagnostics.warning_record`). ``thresholds``: a detector's threshold
    instead of its default (`warning_record.THRESHOLDS`: what each one is), as the lead-time study's
    precision-recall curves replay them. A precision other than `PRECISIONS`, a threshold for no detector or
    not a positive number, a step that is not a whole number above the last one fed, or a row of another
    shape is refused in one line (ConfigError) before any detector sees it."""

    def __init__(self, precision: str, thresholds: dict[str, float] | None = None) -> None:
        from normlab.diagnostics.warning_record import advice, thresholds_for

        if precision not in PRECISIONS:
            raise ConfigError(
                f"EarlyWarnings: precision must be one of {', '.join(PRECISIONS)} (the limits the detectors know), "
                f"got {precision!r}"
            )
        # fp32 runs' logits are judged at bf16's limit, where attention is computed at scale
        logit_limit = PRECISION_LIMITS["bf16" if precision == "fp32" else precision][0]
        act_limit = PRECISION_LIMITS[precision][1]
        t = thresholds_for(thresholds)
        self.precision, self.thresholds, self.advice = precision, t, advice
        self.growth = [
            _Growth(
                "stream growth",
                ProbeMetric.STREAM_MAX,
                "stream layer",
                act_limit,
                precision,
                horizon=t["stream growth"],
            ),
            # a logit warns at the limit itself (8x below it is where healthy models live: Qwen3's ~47 in bf16)
            _Growth(
                "logit growth",
                ProbeMetric.MAX_LOGIT,
                "block",
                logit_limit,
                precision,
                _max_head,
                1.0,
                t["logit growth"],
            ),
        ]
        self.spikes = [
            _Spike(s, read, what, t[s])
            for s, read, what in (
                ("grad-norm spike", _metric(Metric.GRAD_NORM), "gradient norm"),
                ("loss spike", _metric(Metric.LOSS), "loss"),  # the words of its alert
                ("update/weight spike", _largest(ProbeMetric.UPDATE_RATIO), "largest update/weight ratio"),
            )
        ]
        self.rise = _Rise(rise=t["loss rise"])
        self.score_alert = t["spike score"]
        self.precursors = precursors.detectors(t["head logit"], t["qk entropy"], t["qk update entropy"])
        self.steps = self.spiked = 0
        self.score_fired = False
        self.last_step: int | None = None
        self.skipped_rows = 0  # rows `replayed` could not feed
        self.alerts: list[Alert] = []

    def feed(self, step: int, tier: dict[str, Any], metrics: dict[str, Any]) -> list[Alert]:
        step = _step(step, self.last_step)
        _check_rows(tier, metrics)
        self.last_step = step
        fired = [a for g in self.growth if tier and (a := g.feed(step, tier)) is not None]
        rise = self.rise.feed(step, metrics)
        if rise is not None:
            fired.append(rise)
        spiked = False
        for s in self.spikes:
            alert = s.feed(step, tier, metrics)
            if alert is not None:
                fired.append(alert)
            spiked |= s.hit and s.signal in ("grad-norm spike", "loss spike")
        for p in self.precursors:
            found = p.feed(step, tier) if tier else None
            if found is not None:
                fired.append(Alert(p.signal, step, *found))
        self.steps += 1
        self.spiked += spiked
        if not self.score_fired and self.steps >= SPIKE_WINDOW and self.spiked / self.steps > self.score_alert:
            self.score_fired = True
            fired.append(
                Alert(
                    "spike score",
                    step,
                    "run",
                    self.spiked / self.steps,
                    f"{self.spiked} of {self.steps} steps spiked ({self.spiked / self.steps:.1%}; OLMo-core's spike "
                    f"score past {self.score_alert * 100:g}%)",
                )
            )
        for a in fired:
            a.advice = self.advice(a.signal, self.thresholds[a.signal])
        self.alerts += fired
        return fired


def replayed(
    run: str | Path, precision: str, until: int | None = None, thresholds: dict[str, float] | None = None
) -> EarlyWarnings:
    """The detectors fed a run folder's rows (metrics.jsonl and layers.jsonl, step by step) before step
    `until` (None: all): a finished run's alerts (`replay`), or a resumed run's detectors as they stood. A row
    the detectors cannot read (a step that is not a whole number above the last, a loss that is not a number, a
    tier row of another shape: hand-edited, or another program's) is skipped, as a torn line is, and counted in
    the result's ``skipped_rows``. ``thresholds``: as `EarlyWarnings`'."""
    return replay_rows(run_rows(run), precision, until, thresholds)


def run_rows(run: str | Path) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """A run folder's metrics rows and, by step, the rows the detectors read beside them (the tier's with the
    QK-spectrum probe's merged in: `normlab.diagnostics.precursors.merge`)."""
    from normlab.runs.files import RunDir

    folder = RunDir(run)
    tier = {r[Metric.STEP]: r for r in folder.layers() if isinstance(r.get(Metric.STEP), int)}
    qk = precursors.qk_rows(run)
    rows = {s: precursors.merge(tier.get(s), qk.get(s), s) for s in tier.keys() | qk.keys()}
    return folder.metrics(), rows


def replay_rows(
    rows: tuple[list[dict[str, Any]], dict[int, dict[str, Any]]],
    precision: str,
    until: int | None = None,
    thresholds: dict[str, float] | None = None,
) -> EarlyWarnings:
    """`replayed` over rows `run_rows` read (the lead-time study reads a run once and replays it at each
    threshold)."""
    metrics, tier = rows
    warn = EarlyWarnings(precision, thresholds)
    for m in metrics:
        step: Any = m.get(Metric.STEP)  # checked by feed
        if Metric.LOSS not in m or (until is not None and isinstance(step, (int, float)) and step >= until):
            continue
        try:
            warn.feed(step, tier.get(step, {}) if isinstance(step, int) else {}, m)
        except ConfigError:
            warn.skipped_rows += 1
    return warn


def replay(run: str | Path, precision: str | None = None) -> list[Alert]:
    """Every detector's first alert over a finished run folder, in the precision its summary.json records (or
    `precision`)."""
    from normlab.runs.files import RunDir

    if precision is None:
        # a summary that names no precision the detectors know is judged as fp32 (no overflow in reach)
        stored = (RunDir(run).summary() or {}).get("activation_dtype")
        precision = stored if stored in PRECISIONS else "fp32"
    return replayed(run, precision).alerts


class EarlyWarningHook(StepHook):
    """The early warnings live in normlab's loop (`normlab.diagnostics.hooks`): the step's loss and gradient
    norm kept at the veto (asked before the spike policy, which may decide), the tier's row read after the
    step (this hook's post_step runs after the tier's), each alert handed to ``on_alert`` (the trainer: a line
    on stderr, warnings.jsonl, an event for TensorBoard/W&B) and every alert in the run's summary
    (``warnings``). ``tier_row``: the tier's last row ({"step": ..., ...}) or None without a tier. Another
    loop feeds `EarlyWarnings` itself: ``warn.feed(step, tier_row_or_{}, {"loss": ..., "grad_norm": ...})``."""

    priority = 25

    def __init__(
        self,
        precision: str,
        tier_row: Callable[[], dict[str, Any] | None],
        on_alert: Callable[[Alert], None],
        warnings: EarlyWarnings | None = None,
    ) -> None:
        self.warnings = warnings or EarlyWarnings(precision)  # a resumed run's: `replayed` up to its start
        self.tier_row, self.on_alert = tier_row, on_alert  # tier_row: the merged row (precursors.merge)
        self.metrics: dict[str, Any] = {}

    def pre_step(self, step: int) -> None:
        self.metrics = {}

    def veto(self, step: int, loss: float, grad_norm: float) -> dict[str, Any] | None:
        self.metrics = {Metric.LOSS: loss, Metric.GRAD_NORM: grad_norm}
        return None

    def post_step(self, step: int, applied: bool) -> None:
        row = self.tier_row() or {}
        tier = row if row.get(Metric.STEP) == step else {}
        for alert in self.warnings.feed(step, tier, self.metrics):
            self.on_alert(alert)

    def summary(self) -> dict[str, Any]:
        return {"warnings": [a.to_dict() for a in self.warnings.alerts]}


def print_alert(alert: Alert) -> None:
    """A live alert's line on stderr."""
    print(alert.line(), file=sys.stderr, flush=True)


__all__ = [
    "DETECTORS",
    "Alert",
    "EarlyWarningHook",
    "EarlyWarnings",
    "print_alert",
    "replay",
    "replay_rows",
    "replayed",
    "run_rows",
]
