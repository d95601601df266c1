"""Data parallel training on torch's own engine: DDP, or FSDP2 (`fully_shard`) for large models.

Launched with ``torchrun --nproc_per_node N -m normlab train ...``: gloo on CPU, NCCL on GPU. Each rank
takes its slice of the same global batch (batches are a function of (seed, step)), so N ranks
train on exactly what one process would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from normlab.errors import ConfigError
from normlab.model.lm import NormLM
from normlab.model.norms import TaperNorm


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def pick_device(device: str, local_rank: int = 0) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device=cuda, but CUDA is not available here (torch {torch.__version__}); use --device cpu or auto"
            )
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} needs cuda:{local_rank}, but this machine has "
                f"{torch.cuda.device_count()} GPU(s); start at most that many ranks per node"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device: str) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo(device=pick_device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world=world, local_rank=local, device=dev)


def teardown(info: DistInfo, clean: bool = True) -> None:
    if info.enabled and dist.is_initialized():
        # Without the barrier a rank can tear gloo down while rank 0 still writes the summary,
        # and the other aborts ("terminate called without an active exception").
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def unwrap(model: nn.Module) -> NormLM:
    """The `NormLM` inside a DDP wrapper (FSDP2 shards the model in place: it is its own); ``model`` is what `wrap`
    returned."""
    return cast(NormLM, model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model)


def wrap(model: NormLM, info: DistInfo, fsdp: bool) -> nn.Module:
    if not info.enabled:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    # a TaperNorm's scaling branch is unused before its taper starts and its normalization after it ends: DDP is
    # told that some parameters may have no gradient in a step (normlab.model.norms.TaperNorm)
    scheduled = any(isinstance(m, TaperNorm) for m in model.modules())
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[info.local_rank] if info.device.type == "cuda" else None, find_unused_parameters=scheduled
    )


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """The main rank's `obj` on every rank (pickled; for small decisions, not tensors)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (pickled; small records only)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def mean_across_tensor(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of a device tensor over ranks, on the device (no host sync)."""
    if not info.enabled:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / info.world


def _reduce_floats(values: list[float], info: DistInfo, op: Any) -> list[float]:
    """Host floats reduced over the ranks with ``op`` in one all-reduce (themselves in one process)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def max_across(values: list[float], info: DistInfo) -> list[float]:
    """Each value's largest over the ranks."""
    return _reduce_floats(values, info, dist.ReduceOp.MAX)


def sum_across(values: list[float], info: DistInfo) -> list[float]:
    """Each value's sum over the ranks."""
    return _reduce_floats(values, info, dist.ReduceOp.SUM)
