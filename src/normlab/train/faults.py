"""Faults injected into a run on purpose, so that the early warnings' lead time can be measured against a
known cause (`normlab.diagnostics.early_warning`, `normlab.experiments.leadtime`; issue 55 item 4).

``run.fault`` from ``run.fault_step`` (``run.fault_scale`` its size):
- ``lr_jump``: the learning rate times fault_scale from then on (a schedule mistake, a restart at the wrong
  rate): `lr_factor`;
- ``corrupt_batch``: round(fault_scale) steps of batches whose every token is one token (a data-pipeline bug:
  a shard of padding or a repeated record): `corrupt`;
- ``logit_growth``: after every step W_q and W_k scaled by sqrt(fault_scale), so every attention logit grows
  x fault_scale a step (the growth QK-norm removes, forced where the optimizer would not produce it):
  `LogitGrowthHook`. With QK-norm on, the norms undo the scale: the fault has no effect there, as it should.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normlab.config.train import TrainConfig
from normlab.diagnostics.hooks import StepHook
from normlab.errors import ConfigError


def injected(cfg: TrainConfig) -> dict[str, object] | None:
    """The fault this run injects, as summary.json's ``fault`` (its setting, step, scale and what it does in
    words: said at the run's start and in its one-line outcome); None for ``run.fault = "none"``."""
    r = cfg.faults
    if r.fault == "none":
        return None
    does = {
        "lr_jump": f"the learning rate x {r.fault_scale:g} from then on",
        "corrupt_batch": f"{max(1, round(r.fault_scale))} step(s) of batches of one repeated token",
        "logit_growth": f"W_q and W_k x sqrt({r.fault_scale:g}) after every step",
    }[r.fault]
    return {
        "fault": r.fault,
        "fault_step": r.fault_step,
        "fault_scale": r.fault_scale,
        "text": f"{r.fault} from step {r.fault_step}: {does} (run.fault, injected on purpose)",
    }


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The factor on the schedule's learning rate at ``step`` (1 without an lr_jump)."""
    r = cfg.faults
    return r.fault_scale if r.fault == "lr_jump" and step >= r.fault_step else 1.0


def corrupt(step: int, cfg: TrainConfig, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch, or within a corrupt_batch fault's steps every input and target the batch's first token."""
    r = cfg.faults
    if r.fault != "corrupt_batch" or not r.fault_step <= step < r.fault_step + max(1, round(r.fault_scale)):
        return x, y
    token = x.reshape(-1)[0]
    return torch.full_like(x, int(token)), torch.full_like(y, int(token))


def _qk_weights(model: nn.Module) -> list[nn.Parameter]:
    """Each block's query and key projection weights (normlab's attention: ``q_proj``/``k_proj`` or a fused
    ``qkv`` whose first two thirds of rows are q and k)."""
    out = []
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "wq.weight", "wk.weight")):
            out.append(p)
    return out


class LogitGrowthHook(StepHook):
    """The logit_growth fault (module doc): after every step from ``start``, W_q and W_k x sqrt(scale)."""

    # post_step runs hooks in reverse priority: the highest runs last, after QK-clip (which would undo the fault)
    # and after the tier (whose update ratio would count the rescale as an update)
    priority = 100

    def __init__(self, model: nn.Module, start: int, scale: float) -> None:
        self.weights, self.start, self.factor = _qk_weights(model), start, math.sqrt(scale)
        if not self.weights:
            raise ConfigError("run.fault=logit_growth needs query and key projections (q_proj/k_proj) to scale")

    def post_step(self, step: int, applied: bool) -> None:
        if step >= self.start:
            with torch.no_grad():
                for w in self.weights:
                    w.mul_(self.factor)


__all__ = ["LogitGrowthHook", "corrupt", "lr_factor"]
