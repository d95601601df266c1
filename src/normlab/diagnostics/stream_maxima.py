"""The stream's largest |x| at every block boundary on every training step, for a model normlab did not build.

The per-step tier (`normlab.diagnostics.tier`) hooks normlab's own blocks; `TrainingMonitor` watches any causal LM
in any loop and probes it every ``every`` steps. The live alert that warned earliest in the lead-time study
(docs/results.md, "Lead time": stream growth, 12-15 steps before the fp16 overflow, no false alarm on a healthy
run) needs the stream's maximum at every step, which the probes' cadence does not give. `StreamMaxima` records it
from forward hooks on the blocks the monitor found: the largest |x| of the stream entering block 0 (layer 0) and
leaving each block l (layer l + 1), over the training forwards (autograd on) since the last `take`, as the tier's
``stream_max``; one max reduction per block per forward (`normlab.diagnostics.stats.abs_max`) and one read back to
the host per step. Evaluation forwards (no grad) and the monitor's own probe passes (``paused``) do not count.
Under torchrun the ranks' maxima are reduced by their maximum: each rank saw its share of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from normlab.diagnostics.stats import abs_max


def _first_tensor(value: Any) -> torch.Tensor | None:
    """A block's hidden states from what it returned or received: the tensor, or the first element of a tuple
    (transformers' decoder layers return a tuple in older releases)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class StreamMaxima:
    """Forward hooks on ``blocks`` keeping each boundary's largest |x| until `take` (module docstring)."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, world: int = 1) -> None:
        self.device, self.world = device, world
        self.paused = False  # set by the monitor around its probe forwards
        self._maxima: list[torch.Tensor | None] = [None] * (len(blocks) + 1)
        self._handles: list[RemovableHandle] = []
        if blocks:
            self._handles.append(blocks[0].register_forward_pre_hook(self._entering, with_kwargs=True))
            for i, block in enumerate(blocks):
                self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._record(i + 1, o)))

    def _entering(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        self._record(0, x)

    def _record(self, layer: int, value: Any) -> None:
        x = _first_tensor(value)
        if self.paused or x is None or not torch.is_grad_enabled() or not x.is_floating_point():
            return
        v = abs_max(x)
        old = self._maxima[layer]
        self._maxima[layer] = v if old is None else torch.maximum(old, v)

    def take(self) -> list[float] | None:
        """The maxima since the last call, by layer (0: entering block 0), and start again; None where no training
        forward ran (a layer no forward reached reads 0). Under torchrun every rank must call it."""
        seen = any(t is not None for t in self._maxima)
        if not seen and self.world == 1:
            return None
        zero = torch.zeros((), device=self.device)
        values = torch.stack([zero if t is None else t.to(self.device) for t in self._maxima])
        if self.world > 1:  # a rank that ran no forward still joins, with zeros
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        self._maxima = [None] * len(self._maxima)
        out = values.tolist()
        return out if seen or any(v != 0 for v in out) else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
