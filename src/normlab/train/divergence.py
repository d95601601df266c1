"""Divergence and spike detection.

Divergence (the run is marked "diverged" with a step and a reason):
- a non-finite loss or gradient norm (policy ``stop``; ``skip`` skips the step and counts it, and
  the run diverges once more than ``max_skipped`` of its steps so far were skipped, from step 10 on:
  a run that skips most of its steps has not trained, whatever its last finite loss says);
- the loss stays above its initial value for ``patience`` consecutive steps: with gradient clipping,
  small runs often blow up without ever going non-finite;
- the final loss (mean of the last 10 steps) ends above ``final_loss``.

fp16 with dynamic loss scaling (torch's `GradScaler`): a step whose loss is finite but whose
gradients overflowed is the scaler calibrating, not divergence: the step is skipped, counted in
``overflow_steps`` and the scale halves. The run diverges in fp16 when the loss itself is non-finite
(the forward overflowed: activations past 65504, Kim et al.'s failure), when more than
``max_overflow_streak`` consecutive steps overflow, or when the scale falls below ``min_loss_scale``
(below 1 the gradients overflow FP16 even unscaled). bf16 and fp32 have no scaler and keep the rule above.

Stalled (the run finished, but learned nothing beyond token frequencies; distinct from diverged):
- its final loss (mean of the last 10 steps) ends within ``stall_margin`` x U of the corpus's unigram
  loss U (the entropy of the training tokens' frequencies: the loss of the best model that ignores
  context) or above it, **and** it improved by less than a fifth of that margin (1% of U by default)
  over the last quarter of the run: it sits on the unigram plateau.
  Post-LN at a high learning rate sits at U for hundreds of steps without ever exceeding its initial
  loss, which the rules above call ok. The second condition keeps a slow run (a low learning rate,
  still descending through U at the end, 0.09 nats per 50 steps in kim-lr at 3e-4) from being called
  stalled: it is short of budget, not stuck.

Spikes (counted and logged, never fatal), the published rules:
- OLMo-core: a value above mean + 6 std of the previous 128 steps (loss and grad norm separately);
- Megatron-LM: a loss above 10x the largest loss of the early steps (the first 128).

Spike skipping (``on_spike=skip``, `SkipRule`), OLMo-core's SkipStepOptimizer rule: a step whose loss or
gradient norm lies more than ``sigmas`` (6) sample standard deviations from the mean of the previous
``window`` (128) steps' values, either way, once max(20, window // 2) values are known, is not applied. Every
step's values enter the window, skipped or not (OLMo's). Skipped spikes are listed in
``spike_skipped_steps`` and count with the non-finite skips against ``max_skipped``.

The monitor is a small dataclass with `state_dict()` so resumed runs keep their history.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from normlab.config.hooks import DivergenceSettings
from normlab.diagnostics.stability import SkipStepRule, SpikeRule
from normlab.runs.metrics import Metric

SPIKE_WINDOW = 128
SPIKE_SIGMAS = 6.0
MEGATRON_FACTOR = 10.0
MIN_HISTORY = 16  # the OLMo rule needs some history before mean/std mean anything
_RULE = SpikeRule(SPIKE_SIGMAS, SPIKE_WINDOW, MIN_HISTORY)  # the rule diagnostics.training_monitor and the tier apply
MIN_SKIP_STEPS = 10  # the skipped-fraction rule applies from this many steps on
MIN_STALL_STEPS = 20  # the stalled rule needs this many steps (a last quarter of at least 5)
STALL_FLAT = 0.2  # "flat": improved by less than this fraction of the stall margin over the last quarter


@dataclass
class SpikeDetector:
    """The tier's count rule on one series (`normlab.diagnostics.stability.SpikeRule`): value > mean + 6
    population std of the previous 128 values, from 16 values on."""

    history: deque[Any] = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    count: int = 0

    def update(self, value: float) -> bool:
        spike = False
        limit = _RULE.threshold(self.history) if math.isfinite(value) else None
        if limit is not None:
            spike = value > limit
        if math.isfinite(value):
            self.history.append(value)
        self.count += int(spike)
        return spike


@dataclass
class SkipRule:
    """OLMo-core's skip rule in normlab's form (`normlab.diagnostics.stability.SkipStepRule`): |x - mean| > sigmas *
    std (sample std) over the previous ``window`` values of the loss, or of the gradient norm, once max(20,
    window // 2) values are known; this class keeps the two windows."""

    window: int = SPIKE_WINDOW
    sigmas: float = SPIKE_SIGMAS
    losses: deque[Any] = field(default_factory=deque)
    grad_norms: deque[Any] = field(default_factory=deque)

    @property
    def min_history(self) -> int:
        return self.rule.min_history

    @property
    def rule(self) -> SkipStepRule:
        """The rule itself (`normlab.diagnostics.stability.SkipStepRule`); this class keeps its two windows."""
        return SkipStepRule(self.window, self.sigmas)

    def z_scores(self, loss: float, grad_norm: float) -> tuple[float | None, float | None]:
        """This step's |z| of the loss and of the gradient norm against the previous values (None while
        fewer than `min_history` values, this one included, are known); then both enter the window."""
        out: list[float | None] = []
        rule = self.rule
        for values, x in ((self.losses, loss), (self.grad_norms, grad_norm)):
            z = rule.z(x, values)
            if math.isfinite(x):
                values.append(x)
                while len(values) > self.window:
                    values.popleft()
            out.append(z)
        return out[0], out[1]


def monitor_for(settings: DivergenceSettings, unigram_loss: float | None) -> DivergenceMonitor:
    """The monitor of a run's divergence section (`normlab.config.hooks.DivergenceSettings`); ``unigram_loss``:
    the corpus's unigram entropy where the stalled rule is on, else None."""
    return DivergenceMonitor(
        patience=settings.diverge_patience,
        final_loss=settings.diverge_final_loss,
        max_skipped=settings.max_skipped,
        max_overflow_streak=settings.max_overflow_streak,
        min_loss_scale=settings.min_loss_scale,
        stall_margin=settings.stall_margin,
        unigram_loss=unigram_loss,
        skip_rule=SkipRule(window=settings.spike_window, sigmas=settings.spike_sigmas),
    )


@dataclass
class DivergenceMonitor:
    patience: int = 50
    final_loss: float | None = None
    max_skipped: float = 0.1
    max_overflow_streak: int = 20
    min_loss_scale: float = 1.0
    unigram_loss: float | None = None  # the corpus's unigram entropy (nats/token); None: no stalled rule
    stall_margin: float = 0.05  # fraction of unigram_loss; 0: no stalled rule
    initial_loss: float | None = None
    above_initial: int = 0
    status: str = "ok"
    reason: str | None = None
    diverged_step: int | None = None
    skipped_steps: list[int] = field(default_factory=list)
    overflow_steps: list[int] = field(default_factory=list)
    overflow_streak: int = 0
    loss_spikes: SpikeDetector = field(default_factory=SpikeDetector)
    grad_spikes: SpikeDetector = field(default_factory=SpikeDetector)
    early_max: float = -math.inf
    megatron_spikes: int = 0
    losses: list[float] = field(default_factory=list)  # every finite step's loss (final loss, stalled rule)
    skip_rule: SkipRule = field(default_factory=SkipRule)
    spike_skipped_steps: list[int] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    def _diverge(self, step: int, reason: str) -> None:
        if not self.diverged:
            self.status, self.reason, self.diverged_step = "diverged", reason, step

    def check_finite(self, step: int, loss: float, grad_norm: float, policy: str, scaled: bool = False) -> bool:
        """True if the step may be applied. Non-finite values stop or skip per ``policy``; with
        ``scaled`` (fp16's loss scaler), finite loss and non-finite gradients are an overflow."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.overflow_streak = 0
            return True
        if scaled and math.isfinite(loss):
            self.overflow_steps.append(step)
            self.overflow_streak += 1
            if self.overflow_streak > self.max_overflow_streak:
                self._diverge(
                    step,
                    f"fp16 gradients overflowed on {self.overflow_streak} consecutive steps "
                    f"(more than {self.max_overflow_streak})",
                )
            return False
        what = (
            f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} "
            f"({loss if not math.isfinite(loss) else grad_norm}) at step {step}"
        )
        if policy == "skip":
            self.skipped_steps.append(step)
            self._check_skipped(step + 1)
        else:
            self._diverge(step, what)
        return False

    def check_scale(self, step: int, scale: float) -> None:
        """fp16: the loss scale after this step's update; below ``min_loss_scale`` the run diverged."""
        if scale < self.min_loss_scale:
            self._diverge(
                step,
                f"fp16 loss scale collapsed to {scale:g}, below min_loss_scale={self.min_loss_scale:g}: "
                "the gradients keep overflowing",
            )

    def _check_skipped(self, seen: int) -> None:
        skipped = len(self.skipped_steps) + len(self.spike_skipped_steps)
        if seen >= MIN_SKIP_STEPS and skipped > self.max_skipped * seen:
            why = " and ".join(
                w for w, n in (("non-finite values", self.skipped_steps), ("spikes", self.spike_skipped_steps)) if n
            )
            self._diverge(seen - 1, f"{skipped} of {seen} steps skipped for {why} (more than {self.max_skipped:.0%})")

    def check_spike(self, step: int, loss: float, grad_norm: float, skip: bool) -> dict[str, Any] | None:
        """OLMo's skip rule on a finite step (`SkipRule`): None if neither value spiked, else what spiked
        with its z-scores; with ``skip`` the step is recorded as skipped (and counted against max_skipped)."""
        z_loss, z_grad = self.skip_rule.z_scores(loss, grad_norm)
        kinds = [
            k
            for k, z in ((Metric.LOSS.value, z_loss), (Metric.GRAD_NORM.value, z_grad))
            if z is not None and z > self.skip_rule.sigmas
        ]
        if not kinds:
            return None
        if skip:
            self.spike_skipped_steps.append(step)
            self._check_skipped(step + 1)
        return {"kinds": kinds, "z_loss": z_loss, "z_grad_norm": z_grad}

    def update(self, step: int, loss: float, grad_norm: float) -> dict[str, bool]:
        """Record a finite step; returns which spike rules fired."""
        if self.initial_loss is None:
            self.initial_loss = loss
        self.losses.append(loss)
        if self.patience:
            self.above_initial = self.above_initial + 1 if loss > self.initial_loss else 0
            if self.above_initial >= self.patience:
                self._diverge(step, f"loss above its initial value {self.initial_loss:.4f} for {self.patience} steps")
        megatron = False
        if step < SPIKE_WINDOW:
            self.early_max = max(self.early_max, loss)
        elif loss > MEGATRON_FACTOR * self.early_max:
            megatron = True
            self.megatron_spikes += 1
        return {
            Metric.LOSS_SPIKE: self.loss_spikes.update(loss),
            Metric.GRAD_SPIKE: self.grad_spikes.update(grad_norm),
            Metric.MEGATRON_SPIKE: megatron,
        }

    def finish(self, step: int) -> None:
        if self.skipped_steps:
            self._check_skipped(step)
        if self.final_loss is not None and self.losses:
            final = statistics.fmean(self.losses[-10:])
            if final > self.final_loss:
                self._diverge(step, f"final loss {final:.4f} above the threshold {self.final_loss}")
        self._check_stalled()

    def _check_stalled(self) -> None:
        """The stalled rule (module docstring), for a run that finished ok."""
        n = len(self.losses)
        if self.status != "ok" or not self.unigram_loss or not self.stall_margin or n < MIN_STALL_STEPS:
            return
        margin = self.stall_margin * self.unigram_loss
        final = statistics.fmean(self.losses[-10:])
        quarter = n // 4
        start = statistics.fmean(self.losses[max(0, n - quarter - 10) : n - quarter])
        if final > self.unigram_loss - margin and start - final < STALL_FLAT * margin:
            self.status = "stalled"
            self.reason = (
                f"final loss {final:.4f} within {margin:.3f} of the unigram loss {self.unigram_loss:.4f} "
                f"(or above it), {start - final:+.4f} over the last {quarter} steps: it learned token "
                "frequencies and nothing more"
            )

    def summary(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "diverged_step": self.diverged_step,
            "skipped_steps": list(self.skipped_steps),
            "spike_skipped_steps": list(self.spike_skipped_steps),
            "overflow_steps": list(self.overflow_steps),
            "loss_spikes": self.loss_spikes.count,
            "grad_spikes": self.grad_spikes.count,
            "megatron_spikes": self.megatron_spikes,
            "unigram_loss": self.unigram_loss,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "initial_loss": self.initial_loss,
            "above_initial": self.above_initial,
            "status": self.status,
            "reason": self.reason,
            "diverged_step": self.diverged_step,
            "skipped_steps": list(self.skipped_steps),
            "loss_hist": list(self.loss_spikes.history),
            "loss_count": self.loss_spikes.count,
            "grad_hist": list(self.grad_spikes.history),
            "grad_count": self.grad_spikes.count,
            "early_max": self.early_max,
            "megatron_spikes": self.megatron_spikes,
            "overflow_steps": list(self.overflow_steps),
            "overflow_streak": self.overflow_streak,
            "losses": list(self.losses),
            "skip_losses": list(self.skip_rule.losses),
            "skip_grad_norms": list(self.skip_rule.grad_norms),
            "spike_skipped_steps": list(self.spike_skipped_steps),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.initial_loss, self.above_initial = s["initial_loss"], s["above_initial"]
        self.status, self.reason, self.diverged_step = s["status"], s["reason"], s["diverged_step"]
        self.skipped_steps = list(s["skipped_steps"])
        self.loss_spikes.history.extend(s["loss_hist"])
        self.loss_spikes.count = s["loss_count"]
        self.grad_spikes.history.extend(s["grad_hist"])
        self.grad_spikes.count = s["grad_count"]
        self.early_max, self.megatron_spikes = s["early_max"], s["megatron_spikes"]
        self.overflow_steps = list(s.get("overflow_steps", []))  # absent in older checkpoints
        # older checkpoints kept only the last 10 losses ("recent"): the stalled rule judges what follows
        self.losses = list(s.get("losses", s.get("recent", [])))
        self.overflow_streak = s.get("overflow_streak", 0)
        self.skip_rule.losses.extend(s.get("skip_losses", []))  # absent before the skip rule existed
        self.skip_rule.grad_norms.extend(s.get("skip_grad_norms", []))
        self.spike_skipped_steps = list(s.get("spike_skipped_steps", []))
