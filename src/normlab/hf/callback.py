"""`NormlabCallback`: normlab's probes in a transformers `Trainer` run (`normlab.diagnostics.monitor`).

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NormlabCallback(every=50)])
    trainer.train()                       # writes OUTPUT_DIR/normlab: metrics, probes, spikes
    # normlab report OUTPUT_DIR/normlab

The monitor hooks the model's forward for the loss and the batch; the callback calls it at
``on_pre_optimizer_step`` (the gradients of the whole accumulated step are there, not yet clipped or
cleared) and closes it at the end of training. Norm sites are named as normlab's where the model is a
registered architecture (`site_names`). Under torchrun (DDP, or an FSDP2-sharded model) the Trainer calls the
callback on every rank: the monitor reduces the loss and the sharded gradients and gains across the ranks,
and rank 0 writes (`normlab.diagnostics.monitor`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from normlab.diagnostics.monitor import SpikeRule, TrainingMonitor
from normlab.hf.archs import ARCHITECTURES
from normlab.hf.library import require_transformers

_DEFAULT_SPIKE = SpikeRule()  # frozen: one shared default


def site_names(model: nn.Module) -> dict[str, str]:
    """A registered transformers architecture's norm paths inside a block -> normlab's site names."""
    arch = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    return {theirs: ours for ours, theirs in arch.norm_names.items()} if arch is not None else {}


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
    ) -> None:
        self.out, self.every, self.spike, self.top_k = out, every, spike, top_k
        self.monitor: TrainingMonitor | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        out = Path(self.out) if self.out is not None else Path(args.output_dir) / "normlab"
        self.monitor = TrainingMonitor(
            model,
            out,
            every=self.every,
            spike=self.spike,
            top_k=self.top_k,
            name=getattr(getattr(model, "config", None), "model_type", None),
            site_names=site_names(model),
        )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is not None:
            self.monitor.step(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
