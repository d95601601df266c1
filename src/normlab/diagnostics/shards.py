"""Statistics of tensors that may be sharded (FSDP2's DTensor parameters, gradients and optimizer states).

`moments(tensors)` returns, per tensor, its count, sum, sum of squares, minimum, maximum and largest |x|,
accumulated in float64. A plain tensor is reduced where it is. A DTensor is reduced on each rank over its
local shard, and only those six scalars per tensor are all-reduced (sums and counts with SUM, the extremes
with MAX), over the mesh dimensions along which it is sharded; a replicated dimension is not summed twice.
Nothing is gathered: no rank ever holds more of a parameter than its own shard.

The same function serves one process and many, so a sharded run's numbers equal the single process's on
the same weights up to the order of float64 additions (OLMo-core's GAPMonitor reduces its DTensor
statistics the same way: local sums and counts, then one all-reduce).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # for the annotations only (see below: the module is never imported here)
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs

# torch.distributed.tensor is read from sys.modules, never imported here: a DTensor exists only once something
# (FSDP2, a device mesh) has imported that module, and importing it costs about a second of CPU in every
# process (every `normlab` command and sweep worker) that never shards anything.
_DTENSOR_MODULE = "torch.distributed.tensor"


@dataclass(frozen=True)
class Moments:
    count: float
    total: float
    sumsq: float
    minimum: float
    maximum: float
    max_abs: float

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def norm(self) -> float:
        return math.sqrt(self.sumsq)

    @property
    def rms(self) -> float:
        return math.sqrt(self.sumsq / self.count) if self.count else math.nan


def is_sharded(t: torch.Tensor) -> TypeIs[DTensor]:
    dtensor = getattr(sys.modules.get(_DTENSOR_MODULE), "DTensor", None)  # None: nothing can be sharded yet
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (the whole tensor when it is not a DTensor)."""
    return t.to_local() if is_sharded(t) else t


def shard_groups(t: torch.Tensor) -> tuple[Any, ...]:
    """The process groups over which ``t``'s local values must be combined (its sharded mesh dims)."""
    if not is_sharded(t):
        return ()
    shard = sys.modules[_DTENSOR_MODULE].Shard
    mesh = t.device_mesh
    return tuple(mesh.get_group(d) for d, p in enumerate(t.placements) if isinstance(p, shard))


def _local_stats(t: torch.Tensor) -> list[float]:
    x = local(t).detach()
    if x.numel() == 0:
        return [0.0, 0.0, 0.0, -math.inf, -math.inf, 0.0]  # minimum carried negated: every extreme is a MAX
    x = x.double()
    return [
        float(x.numel()),
        x.sum().item(),
        x.pow(2).sum().item(),
        -x.min().item(),
        x.max().item(),
        x.abs().max().item(),
    ]


def moments(tensors: list[torch.Tensor]) -> list[Moments]:
    """Each tensor's `Moments`, over all of it (see the module docstring): one pair of all-reduces per
    group of shard process groups, whatever the number of tensors."""
    stats = [_local_stats(t) for t in tensors]
    by_groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups = shard_groups(t)
        if groups:
            by_groups.setdefault(groups, []).append(i)
    for groups, idx in by_groups.items():
        device = local(tensors[idx[0]]).device
        sums = torch.tensor([stats[i][:3] for i in idx], dtype=torch.float64, device=device)
        extremes = torch.tensor([stats[i][3:] for i in idx], dtype=torch.float64, device=device)
        for g in groups:
            dist.all_reduce(sums, group=g)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=g)
        for row, i in enumerate(idx):
            stats[i] = sums[row].tolist() + extremes[row].tolist()
    return [Moments(count=s[0], total=s[1], sumsq=s[2], minimum=-s[3], maximum=s[4], max_abs=s[5]) for s in stats]


def reshard(model: torch.nn.Module) -> None:
    """Free the parameters FSDP2 gathered for a forward outside training (a probe). FSDP2 keeps the root
    module's parameters gathered after its forward, expecting the backward; an optimizer step after a probe
    forward would then update the shards while the next forward read the stale gathered copy (the embedding,
    the final norm and the head of a Llama trained one step behind: measured, 1e-3 in the loss at the next
    step). No-op for a model that is not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def norms(tensors: list[torch.Tensor]) -> list[float]:
    """The Frobenius norm of each tensor (sharded or not)."""
    return [m.norm for m in moments(tensors)]
