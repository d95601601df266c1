"""Optimizers and the learning-rate schedule.

AdamW with parameter groups (no weight decay on the parameters named in ``wd_exclude``: norm
gammas/betas and the learned scales with them, biases, embeddings), or SGD with momentum (Kim App. I). Schedule: linear warmup over
``warmup * steps`` steps, then cosine decay to ``min_lr`` (Kim Table 2, Zhuo Table 7).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normlab.config.train import TrainConfig
from normlab.model.block import scale_params
from normlab.model.norms import is_norm


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    exclude = set(cfg.wd_exclusions)
    norm_params, emb_params = set(), set()
    for m in model.modules():
        if is_norm(m):  # every kind: RMS, Layer, DyT (its alpha too), ScaleNorm
            norm_params.update(id(p) for p in m.parameters(recurse=False))
        if isinstance(m, nn.Embedding):
            emb_params.update(id(p) for p in m.parameters(recurse=False))
    # learned residual steps, Admin's omegas and head scales are scales too (normlab.model.block.SCALE_PARAMS)
    norm_params.update(id(p) for p in scale_params(model))
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_excluded = (
            ("norms" in exclude and id(p) in norm_params)
            or ("embeddings" in exclude and id(p) in emb_params)
            or ("biases" in exclude and name.endswith(".bias"))
        )
        (no_decay if is_excluded else decay).append(p)
    return [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW or SGD; ``fused`` (CUDA): torch's fused kernels, one launch for all parameters."""
    groups = param_groups(model, cfg)
    if cfg.optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum, fused=fused or None)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=fused or None)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr/warmup_steps to lr, then cosine to the floor at the last step."""
    warmup_steps = int(cfg.optim.warmup * cfg.optim.steps)
    if step < warmup_steps:
        return cfg.optim.lr * (step + 1) / warmup_steps
    span = max(1, cfg.optim.steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = cfg.lr_floor
    return floor + 0.5 * (cfg.optim.lr - floor) * (1 + math.cos(math.pi * progress))
