"""Resuming a run from its checkpoint: whether this launch may (`resume_refusal`), and the checkpoint's model
and optimizer state loaded into the run's (`load_state`). Where a run starts is `normlab.runs.start`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from normlab.config.train import TrainConfig
from normlab.errors import CheckpointError
from normlab.runs.checkpoint import load_sharded_state
from normlab.runs.start import Start
from normlab.train import distributed
from normlab.train.optim import TrainOptimizer


def _optimizer_keyed_by_name(ckpt: dict[str, Any]) -> bool:
    """Whether a whole-model checkpoint's optimizer state names its parameters (FQNs), as
    `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` gathers it: the form an FSDP run
    of an older normlab release saved, before FSDP2 checkpoints were sharded. `Optimizer.state_dict`,
    which this normlab saves, numbers them."""
    optimizer = ckpt.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        return False  # no optimizer state (a final checkpoint), or Muon's pair of states
    return any(isinstance(p, str) for g in groups if isinstance(g, dict) for p in g.get("params", ()))


def resume_refusal(start: Start, cfg: TrainConfig, info: distributed.DistInfo) -> str | None:
    """Why the run cannot resume from ``start``'s checkpoint on this launch (one line), or None if it can.

    - A whole-model checkpoint whose optimizer state is keyed by parameter name was written by an FSDP
      run of an older release; it is not read (whatever the world size), its weights are: ``--init-from``.
    - Under torchrun with ``--fsdp`` only sharded checkpoints resume (`load_sharded_state`); a whole-model
      file (one process, DDP) resumes without ``--fsdp``.
    """
    ckpt, path = start.checkpoint, start.path
    if ckpt is None or "sharded" in ckpt:
        return None
    fresh = f"`normlab train --init-from {path} --out NEW_FOLDER` (its weights; the optimizer starts anew)"
    if _optimizer_keyed_by_name(ckpt):
        return (
            f"{path} was written by an old normlab release (an FSDP run's gathered checkpoint, its optimizer "
            f"state keyed by parameter name), which this normlab does not resume; start a new run from it with "
            f"{fresh}"
        )
    if cfg.run.fsdp and info.enabled:
        return (
            f"{path} is a whole-model checkpoint (of a run in one process or under DDP) and --fsdp under "
            f"torchrun resumes only sharded ones (step_N.dcp); resume this run without --fsdp, or start a "
            f"new run from it with {fresh}"
        )
    return None


def load_state(model: nn.Module, opt: TrainOptimizer, ckpt: dict[str, Any], cfg: TrainConfig) -> None:
    """A checkpoint's model and optimizer state into the run's (`resume_refusal` has passed it)."""
    if "sharded" in ckpt:  # FSDP2's DCP folder: resharded onto this run's world size, whatever it is
        assert isinstance(opt, torch.optim.Optimizer)  # FSDP2 refuses Muon (TrainConfig's validation)
        load_sharded_state(ckpt["sharded"], model, opt)
        return
    distributed.unwrap(model).load_state_dict(ckpt["model"])
    if "optimizer" in ckpt:
        opt.load_state_dict(ckpt["optimizer"])
    elif ckpt["step"] < cfg.optim.steps:  # a final checkpoint saved without it (keep_optimizer off)
        raise CheckpointError(
            f"the checkpoint at step {ckpt['step']} holds no optimizer state (keep_optimizer was "
            f"off), so the run cannot continue to step {cfg.optim.steps}; start a new run with "
            "--init-from to train these weights further"
        )
