"""`RunState`: everything a training run holds between steps (`normlab.train.trainer` builds and steps it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab.config.train import TrainConfig
from normlab.diagnostics.hooks import StepHooks
from normlab.runs.summary import Forensics
from normlab.train import distributed
from normlab.train.divergence import DivergenceMonitor
from normlab.train.loggers import Sinks
from normlab.train.optim import TrainOptimizer


@dataclass
class RunState:
    """Everything a training run holds between steps; `step` is the next step to run."""

    cfg: TrainConfig
    info: distributed.DistInfo
    run: Path
    data: Any
    model: nn.Module  # wrapped (DDP/FSDP) when distributed
    fwd: nn.Module  # what the step calls: the model, compiled or not
    opt: TrainOptimizer
    scaler: torch.amp.GradScaler
    monitor: DivergenceMonitor  # its state (the checkpoint's "monitor"); its decisions are the divergence hook's
    params: Any  # count_params of the unwrapped model
    val: list[Any]
    trainable: list[Any]  # the parameters the clip and the optimizer see (frozen gammas excluded)
    step: int = 0
    tokens: int = 0
    wall_before: float = 0.0  # wall time of earlier sessions of this run (from the checkpoint)
    t_start: float = field(default_factory=time.perf_counter)
    final_val: float | None = None
    sinks: Sinks | None = None
    # probes, the tier, QK-clip, divergence and spikes, the checkpoint schedule, the loggers (train.hook_registry)
    hooks: StepHooks = field(default_factory=StepHooks)
    forensics: Forensics | None = None  # where a diverged run first broke (normlab.diagnostics.forensics)
    flops_per_token: int = 0  # 6N + 12 L H Q T (normlab.train.mfu)
    memory_plan: Any = None  # normlab.train.memory.MemoryPlan on CUDA (checked against the device before the start)
    peak_flops: float | None = None  # the device's dense peak for the run's precision; None: unknown

    @property
    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()  # closing twice is harmless
        self.hooks.close()
