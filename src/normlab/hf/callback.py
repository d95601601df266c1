"""`NormlabCallback`: normlab's probes in a transformers `Trainer` run (`normlab.diagnostics.training_monitor`).

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NormlabCallback(every=50)])
    trainer.train()                       # writes OUTPUT_DIR/normlab: metrics, probes, spikes
    # normlab report OUTPUT_DIR/normlab

The monitor hooks the model's forward for the loss and the batch; the callback steps it at
``on_pre_optimizer_step`` and closes it at the end of training. Steps are numbered as the Trainer numbers
them: the event fires before the update that makes ``state.global_step`` N + 1, and the Trainer logs that
update's loss and ``grad_norm`` at step N + 1, so the monitor records it as step N + 1 (the first step is 1).

The early warnings (a line on stderr, warnings.jsonl, summary.json's ``warnings`` and status ``warned``:
`normlab.diagnostics.early_warning`) judge the run at its precision: ``precision=`` if given, else the
Trainer's ``fp16`` or ``bf16`` argument, else the model's parameter dtype (float16, bfloat16), else fp32.
An fp16 run's stream warns within 8x of 65,504 from its first step; in any precision a loss more than a nat
above the first step's warns from the second step on. transformers 5.24's inner loop
(``Trainer._run_epoch``) clips (``_clip_grad_norm``, when ``max_grad_norm`` > 0) and only then fires
``on_pre_optimizer_step``; no event fires between the last micro-batch's backward and the clip. So the
gradient norms are not read at that event: the monitor measures the gradients at the end of each backward
pass (after DDP's all-reduce and FSDP2's reduce-scatter) and the step reports the last backward's, the
accumulated gradients before the clip, over every parameter of the model: the Trainer's own ``grad_norm``
(what ``clip_grad_norm_`` returned), up to float rounding.

fp16 loss scaling: accelerate gives the Trainer a GradScaler for ``fp16`` on any device but the CPU (not
under DeepSpeed): the backward leaves the gradients times its scale, and the clip unscales them first. No
event passes the scaler: give it before training (``callback.grad_scaler = trainer.accelerator.scaler``) and
the measurements are divided by its scale. Without it such a run records the gradients as the event has
them (unscaled, but clipped), config.json's ``grad_norm.at`` says so, and the callback warns. Besides, at each
event the callback checks the measurement against the gradients there, which must be the measured ones
times the Trainer's clip coefficient, ``min(1, max_grad_norm / (norm + 1e-6))`` (torch's
``clip_grads_with_norm_``); where they are not (something else rescaled them: seen on steps the clip left
alone), it records the gradients at the event instead and warns once. DeepSpeed keeps the gradients inside
its engine (``.grad`` is empty): the norms are then null.

Norm sites are named as normlab's where the model is a registered architecture (`site_names`). Under torchrun
(DDP, or an FSDP2-sharded model) the Trainer calls the callback on every rank: the monitor reduces the loss
and the sharded gradients and gains across the ranks, and rank 0 writes (`normlab.diagnostics.training_monitor`).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab.diagnostics.early_warning import PRECISIONS
from normlab.diagnostics.stability import SpikeRule
from normlab.diagnostics.training_monitor import TrainingMonitor
from normlab.errors import ConfigError
from normlab.hf.archs import ARCHITECTURES
from normlab.hf.library import require_transformers

_DEFAULT_SPIKE = SpikeRule()  # frozen: one shared default

# what a step records when the gradients changed between the backward and the event by more than the clip
# (fp16 loss scaling without grad_scaler): config.json's grad_norm.at
AFTER_CLIP = "transformers' on_pre_optimizer_step: unscaled but already clipped (loss scaling, no grad_scaler given)"
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grads_with_norm_: max_norm / (total_norm + 1e-6)


def site_names(model: nn.Module) -> dict[str, str]:
    """A registered transformers architecture's norm paths inside a block -> normlab's site names."""
    arch = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    return {theirs: ours for ours, theirs in arch.norm_names.items()} if arch is not None else {}


def scales_the_loss(args: Any) -> bool:
    """Whether accelerate gives this Trainer a GradScaler: ``fp16`` on a device other than the CPU, without
    DeepSpeed (``accelerate.Accelerator.__init__``, accelerate 1.x)."""
    device = getattr(args, "device", None)
    return (
        bool(getattr(args, "fp16", False))
        and getattr(device, "type", "cpu") != "cpu"
        and not getattr(args, "deepspeed", None)
    )


def precision_of(args: Any, model: nn.Module | None) -> str:
    """The precision a Trainer run computes in: ``fp16`` or ``bf16`` where its TrainingArguments say so, else
    the dtype of the model's first floating-point parameter (a model loaded in float16 or bfloat16 trains in
    it without either flag), else fp32."""
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None) if model is not None else None
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")  # type: ignore[arg-type]


def _base() -> type:
    return require_transformers().TrainerCallback


class NormlabCallback(_base()):  # type: ignore[misc]
    """Record normlab's probes during `Trainer.train` (see the module docstring)."""

    def __init__(
        self,
        out: str | Path | None = None,
        every: int = 100,
        spike: SpikeRule | None = _DEFAULT_SPIKE,
        top_k: int = 100,
        grad_scaler: Any | None = None,
        precision: str | None = None,
    ) -> None:
        if precision is not None and precision not in PRECISIONS:
            raise ConfigError(
                f"NormlabCallback: precision must be one of {', '.join(PRECISIONS)} or None (read from the "
                f"Trainer's arguments), got {precision!r}"
            )
        self.precision = precision  # the early warnings' limits; None: `precision_of` the Trainer's run
        self.out, self.every, self.spike, self.top_k = out, every, spike, top_k
        self.grad_scaler = grad_scaler  # fp16: the Trainer's trainer.accelerator.scaler (module docstring)
        self.monitor: TrainingMonitor | None = None
        self._after_clip = False  # a GradScaler this callback was not given: record the gradients at the event
        self._warned = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        out = Path(self.out) if self.out is not None else Path(args.output_dir) / "normlab"
        self.monitor = TrainingMonitor(
            model,  # type: ignore[arg-type]  # None is refused there, in one line
            out,
            every=self.every,
            spike=self.spike,
            top_k=self.top_k,
            name=getattr(getattr(model, "config", None), "model_type", None),
            site_names=site_names(model) if model is not None else None,
            grad_scaler=self.grad_scaler,
            precision=self.precision or precision_of(args, model),
        )
        self._after_clip = self.grad_scaler is None and scales_the_loss(args)
        if self._after_clip:
            self._warned = True
            warnings.warn(
                "NormlabCallback: fp16 scales the gradients by the Trainer's GradScaler, which no callback event "
                "passes; recording the clipped gradient norms at on_pre_optimizer_step. Set callback.grad_scaler "
                "= trainer.accelerator.scaler before train() for the norms before the clip",
                stacklevel=2,
            )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is None:
            return
        if self._after_clip:
            self.monitor.capture_grads(AFTER_CLIP)
            self.monitor.step(state.global_step + 1)  # the Trainer's number for this update (module docstring)
            return
        measured = self.monitor.pending_grad_norm()
        if measured is not None and math.isfinite(measured):
            clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
            expected = measured * min(1.0, clip / (measured + CLIP_EPS)) if clip > 0 else measured
            now = self.monitor.grad_norm_now()
            if now is not None and not math.isclose(now, expected, rel_tol=1e-3, abs_tol=1e-30):
                self.monitor.capture_grads(AFTER_CLIP)
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"NormlabCallback: the gradients at on_pre_optimizer_step (norm {now:.4g}) are not the "
                        f"backward's ({measured:.4g}) clipped to max_grad_norm={clip:g}: they were rescaled (fp16 "
                        "loss scaling, whose scaler no callback event passes?); recording the norms at the event. "
                        "Set callback.grad_scaler = trainer.accelerator.scaler before train() if the loss is scaled",
                        stacklevel=2,
                    )
        self.monitor.step(state.global_step + 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
