"""`NormlabLightningCallback`: normlab's probes in a Lightning run (`normlab.diagnostics.monitor`).

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__(); self.model = AutoModelForCausalLM.from_config(...)   # any causal LM
        def training_step(self, batch, i):
            return self.model(**batch).loss
        ...
    L.Trainer(callbacks=[NormlabLightningCallback("runs/lit", every=50)]).fit(LitLM(), loader)
    # normlab report runs/lit

The monitor is built on the LightningModule's causal LM (``model_attr``, "model" by default, or the module
itself), hooks its forward for the batch, and steps at ``on_train_batch_end`` with the loss the training step
returned: under Lightning's automatic optimization the gradients of the step are still there (they are
cleared just before the next backward). Lightning is an optional dependency: this module imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from normlab.diagnostics.monitor import SpikeRule, TrainingMonitor

_DEFAULT_SPIKE = SpikeRule()  # frozen: one shared default is safe


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
    ) -> None:
        self.out, self.every, self.spike, self.top_k = out, every, spike, top_k
        self.model_attr, self.site_names = model_attr, site_names
        self.monitor: TrainingMonitor | None = None

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
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else None
        self.monitor.step(trainer.global_step - 1, loss=value)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
