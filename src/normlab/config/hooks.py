"""The settings of the training loop's built-in hooks, one section each (`normlab.train.hook_registry` builds each
hook by name from its section): probes, tier, divergence (with the spike policy), checkpointing, loggers,
warnings, faults.

Each leaf keeps the key, flag and doc it had when `RunSettings` held it (`--on-spike`, `--set on_spike=skip`);
the stored form (config.json, checkpoints, sweep.db) still holds them in its "run" table, in `RUN_ORDER`, so
files and run ids are unchanged; `run.NAME`, their old key, is read as `SECTION.NAME` (`MOVED`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from normlab.settings import nonneg, open_unit, positive, setting


def _spike_window(v: int) -> str | None:
    return None if v >= 20 else f"must be >= 20 (the skip rule needs max(20, window/2) values in its window), got {v}"


@dataclass(frozen=True)
class ProbeSettings:
    """The probe pass (`normlab.diagnostics.probes`, probes.jsonl)."""

    probe_every: int = setting(
        100,
        "probe pass every N steps, at step 0 and at the end (0: off); see docs/diagnostics.md",
        identity=False,
        check=nonneg,
    )
    probe_batch: int = setting(
        8, "sequences in the fixed probe batch (the first validation windows)", identity=False, check=positive
    )


@dataclass(frozen=True)
class TierSettings:
    """The per-step tier (`normlab.diagnostics.tier`, layers.jsonl) and its per-layer spike rule."""

    layer_stats: bool = setting(
        True,
        "the per-step tier: per layer, the stream's largest |x|, gradient norm, update "
        "RMS and update/weight ratio, the largest attention logit per head (layers.jsonl; "
        "docs/diagnostics.md)",
        identity=False,
    )
    layer_stats_every: int = setting(
        1,
        "the per-step tier's interval: its row every N steps (1: every step); the steps between skip its work, and "
        "its per-layer spike rule and summary maxima see every Nth step only. On an H100 at gpu-126m, eager, the "
        "tier added 15-25% to a step (docs/benchmarks.md)",
        identity=False,
        check=positive,
    )


@dataclass(frozen=True)
class DivergenceSettings:
    """The divergence rules and the spike policy (`normlab.train.divergence`, `normlab.train.spikes`)."""

    max_overflow_streak: int = setting(
        20,
        "fp16: diverged after this many consecutive steps whose gradients overflowed (each halves the loss scale)",
        check=positive,
    )
    min_loss_scale: float = setting(
        1.0,
        "fp16: diverged once the loss scale falls below this (the gradients overflow FP16 even unscaled)",
        check=positive,
    )
    on_nonfinite: Literal["stop", "skip"] = setting(
        "stop", "a NaN/Inf loss or gradient: stop (diverged) or skip the step", choices=("stop", "skip")
    )
    max_skipped: float = setting(
        0.1,
        "with on_nonfinite=skip: diverged once more than this fraction of the steps so far (after 10) were skipped",
        check=open_unit,
    )
    on_spike: Literal["count", "skip"] = setting(
        "count",
        "a loss or gradient-norm spike (OLMo-core's skip rule: more than spike_sigmas sample std from the "
        "mean of the previous spike_window steps): count it, or skip the step (rerun on the pre-step weights, "
        "attributed, its batch saved; bounded by max_skipped with the non-finite skips)",
        choices=("count", "skip"),
    )
    spike_window: int = setting(
        128, "steps in the spike rule's window (it applies once max(20, window/2) are known)", check=_spike_window
    )
    spike_sigmas: float = setting(6.0, "standard deviations from the window's mean that make a spike", check=positive)
    diverge_patience: int = setting(
        50, "diverged if the loss stays above its initial value this many steps (0: off)", check=nonneg
    )
    diverge_final_loss: float | None = setting(None, "diverged if the final loss ends above this", check=positive)
    stall_margin: float = setting(
        0.05,
        "stalled if the final loss ends within this fraction of the corpus's unigram "
        "loss (or above it) and improved by less than a fifth of that over the last "
        "quarter of the run (0: off); see normlab.train.divergence",
        identity=False,
        check=nonneg,
    )


@dataclass(frozen=True)
class CheckpointSettings:
    """When the run saves and what it keeps (`normlab.train.ckpt_schedule`)."""

    ckpt_every: int = setting(
        0,
        "checkpoint every N steps (0: every 10% of the run, 10 to 100 steps apart, stretched where a save "
        "takes a second or more so saving costs at most 5% of the training time); a checkpoint always ends the run",
        identity=False,
        check=nonneg,
    )
    keep_last: int = setting(2, "checkpoints kept", identity=False, check=positive)
    keep_optimizer: bool = setting(
        True,
        "the run's final checkpoint keeps the optimizer state (to train it further "
        "with --init-from or a longer schedule); off: the model only, a third of the "
        "size with AdamW (sweeps default to off)",
        identity=False,
    )


@dataclass(frozen=True)
class LoggerSettings:
    """Where the metrics rows go besides metrics.jsonl (`normlab.train.loggers`)."""

    progress: bool = setting(True, "progress bar", identity=False)
    tensorboard: bool = setting(False, "needs the tensorboard extra", identity=False)
    wandb: bool = setting(False, "needs the wandb extra; WANDB_MODE=offline works without a network", identity=False)


@dataclass(frozen=True)
class WarningSettings:
    """The live early warnings (`normlab.diagnostics.early_warning`)."""

    early_warnings: bool = setting(
        True,
        "alert while training when a signal predicts trouble (stream or attention-logit growth toward the "
        "precision's limit, gradient-norm, loss and update/weight spikes, the spike score): a line on stderr, "
        "warnings.jsonl, TensorBoard/W&B events (normlab.diagnostics.early_warning)",
        identity=False,
    )


@dataclass(frozen=True)
class QKSpectrumSettings:
    """The QK spectral entropy probe (`normlab.diagnostics.qk_spectrum`, qk_spectrum.jsonl), read by the early
    warnings."""

    qk_spectrum_every: int = setting(
        0,
        "the QK spectral entropy probe's interval (normlab.diagnostics.qk_spectrum: each head's W_q^T W_k form and its "
        "step's first-order change, two small factorizations per head, one host read): a row to qk_spectrum.jsonl "
        "every N steps for the early warnings (0: off)",
        identity=False,
        check=nonneg,
    )


@dataclass(frozen=True)
class FaultSettings:
    """A fault injected on purpose, for the early-warning study (`normlab.train.faults`)."""

    fault: Literal["none", "lr_jump", "corrupt_batch", "logit_growth"] = setting(
        "none",
        "a fault injected from step fault_step, for the early-warning study (normlab.train.faults): lr_jump (the "
        "learning rate x fault_scale from then on), corrupt_batch (fault_scale steps of batches of one repeated "
        "token), logit_growth (W_q and W_k x sqrt(fault_scale) after every step: the logits grow x fault_scale a "
        "step)",
        choices=("none", "lr_jump", "corrupt_batch", "logit_growth"),
    )
    fault_step: int = setting(0, "the step the fault starts at", check=nonneg)
    fault_scale: float = setting(10.0, "the fault's size (see fault)", check=positive)


# section name -> its settings
HOOK_SECTIONS: dict[str, type] = {
    "probes": ProbeSettings,
    "tier": TierSettings,
    "divergence": DivergenceSettings,
    "checkpointing": CheckpointSettings,
    "loggers": LoggerSettings,
    "qk_spectrum": QKSpectrumSettings,
    "warnings": WarningSettings,
    "faults": FaultSettings,
}
# every leaf that moved out of the run section -> its section now
MOVED: dict[str, str] = {f.name: sec for sec, cls in HOOK_SECTIONS.items() for f in fields(cls)}
# the run table of the stored form, in the order it has always had (config.json, checkpoints, sweep.db, run ids)
RUN_ORDER: tuple[str, ...] = (
    "precision",
    "activation_dtype",
    "compile",
    "device",
    "fsdp",
    "activation_checkpointing",
    "loss_chunk",
    "tf32",
    "loss_scale_init",
    "max_overflow_streak",
    "min_loss_scale",
    "on_nonfinite",
    "max_skipped",
    "on_spike",
    "spike_window",
    "spike_sigmas",
    "layer_stats",
    "layer_stats_every",
    "qk_spectrum_every",
    "early_warnings",
    "fault",
    "fault_step",
    "fault_scale",
    "diverge_patience",
    "diverge_final_loss",
    "stall_margin",
    "probe_every",
    "probe_batch",
    "eval_every",
    "eval_batches",
    "out",
    "ckpt_every",
    "keep_last",
    "keep_optimizer",
    "resume",
    "progress",
    "tensorboard",
    "wandb",
)
