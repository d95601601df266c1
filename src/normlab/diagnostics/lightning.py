"""`NormlabLightningCallback`: normlab's probes in a Lightning run (`normlab.diagnostics.training_monitor`).

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__(); self.model = AutoModelForCausalLM.from_config(...)   # any causal LM
        def training_step(self, batch, i):
            return self.model(**batch).loss
        ...
    L.Trainer(callbacks=[NormlabLightningCallback("runs/lit", every=50)]).fit(LitLM(), loader)
    # normlab report runs/lit

The monitor is built on the LightningModule's causal LM (``model_attr``, "model" by default, or the module
itself) and hooks its forward for the batch. The gradients are measured at ``on_before_optimizer_step``:
Lightning 2.x calls it after the closure's backward and, under 16-bit AMP, after unscaling, and only then
clips (``Precision._after_closure``: the hook, then ``_clip_gradients`` with ``gradient_clip_val``), so the
norms are those before clipping, over every parameter of the monitored model, as Lightning's own
``lightning.pytorch.utilities.grad_norm`` computes them in that hook. The step is recorded at
``on_train_batch_end`` of the batch whose optimizer step that was (once per optimizer step, under gradient
accumulation too), with the training step's loss: the sum of ``outputs["loss"]`` over the accumulated
batches (Lightning divides each by ``accumulate_grad_batches``: their mean). The early warnings judge the run
at ``precision=`` if given, else at the Trainer's (``16-mixed``/``16-true``: fp16, ``bf16-*``: bf16, else
fp32; `precision_of`). Lightning is an optional dependency: this module imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from normlab.diagnostics.early_warning import PRECISIONS
from normlab.diagnostics.stability import SpikeRule
from normlab.diagnostics.training_monitor import TrainingMonitor
from normlab.errors import ConfigError

_DEFAULT_SPIKE = SpikeRule()  # frozen: one shared default is safe

# where the gradients are measured (config.json's grad_norm.at)
BEFORE_CLIP = "Lightning's on_before_optimizer_step: after the backward and AMP unscaling, before clipping"


def precision_of(trainer: Any) -> str:
    """The early warnings' precision for a Lightning Trainer's ``precision`` setting ("16-mixed" -> fp16,
    "bf16-mixed" -> bf16, "32-true" -> fp32; anything else fp32)."""
    said = str(getattr(trainer, "precision", "32-true"))
    return "bf16" if said.startswith("bf16") else "fp16" if said.startswith("16") else "fp32"


class NormlabLightningCallback(pl.Callback):
    """Record normlab's probes during `Trainer.fit` (see the module docstring)."""

    def __init__(
        self,
        out: str | Path,
        every: int = 100,
        spike: SpikeRule | None = _DEFAULT_SPIKE,
        model_attr: str | None = "model",
        site_names: dict[str, str] | None = None,
        top_k: int = 100,
        precision: str | None = None,
    ) -> None:
        if precision is not None and precision not in PRECISIONS:
            raise ConfigError(
                f"NormlabLightningCallback: precision must be one of {', '.join(PRECISIONS)} or None (read from "
                f"the Trainer), got {precision!r}"
            )
        self.precision = precision
        self.out, self.every, self.spike, self.top_k = out, every, spike, top_k
        self.model_attr, self.site_names = model_attr, site_names
        self.monitor: TrainingMonitor | None = None
        self._stepped = False  # an optimizer step happened since the last recorded step
        self._loss: float | None = None  # the sum of outputs["loss"] since the last recorded step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = getattr(pl_module, self.model_attr, None) if self.model_attr else None
        model = model if isinstance(model, torch.nn.Module) else pl_module
        self.monitor = TrainingMonitor(
            model,
            self.out,
            every=self.every,
            spike=self.spike,
            top_k=self.top_k,
            name=type(model).__name__,
            site_names=self.site_names,
            precision=self.precision or precision_of(trainer),
        )
        self._stepped, self._loss = False, None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.monitor is not None:
            self.monitor.capture_grads(BEFORE_CLIP)
            self._stepped = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._loss = (self._loss or 0.0) + float(loss.detach())
        if self._stepped:  # the optimizer stepped in this batch: global_step counts it already
            self.monitor.step(trainer.global_step - 1, loss=self._loss)
            self._stepped, self._loss = False, None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
