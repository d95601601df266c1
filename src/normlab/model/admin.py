"""Admin's profiling pass: the skip scale omega of every sublayer, set from one forward at init.

Liu et al. 2020 ("Understanding the Difficulty of Training Transformers", Sec. 4.3, eq. 7) rewrite a
Post-LN sublayer as ``x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))`` with omega_i a learned vector, and start
it at ``omega_i = sqrt(sum_{j<i} Var[f_j(x_{j-1})])`` so that no sublayer's update dominates the stream
(the amplification they blame for Post-LN's divergence). The authors' profiling code (Transformer-Clinic,
``adaptive-profiling``) fills that sum in one forward pass, sublayer by sublayer in order, as

    omega_1 = 1;   omega_{i+1} = sqrt(Var[omega_i * skip_i] + Var[update_i])

which is the paper's sum with the embedding's variance counted as its first term (omega_i^2 = Var of the
stream the sublayer adds to). `profile_admin` runs that pass on a batch of random tokens with the
model's own weights (at init the statistics depend on the weights, not on which tokens are read) and
leaves every omega a learned vector filled with its value. Any layout with ``alpha=admin`` gets it;
the `admin` preset is the paper's Post-LN.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from normlab.model.config import ModelConfig


class AdminProfile:
    """The running ratio of one profiling pass, shared by the blocks in order."""

    def __init__(self) -> None:
        self.ratio = 1.0
        self.omegas: list[float] = []

    @torch.no_grad()
    def set(self, omega: nn.Parameter, skip: torch.Tensor, update: torch.Tensor) -> None:
        """Fill this sublayer's omega with the running ratio, then add its own variances to the ratio."""
        omega.fill_(self.ratio)
        self.omegas.append(self.ratio)
        # float64: a once-per-model statistic, the precision of the stream's dtype is not needed here
        self.ratio = math.sqrt(float((skip.double() * self.ratio).var()) + float(update.double().var()))


@torch.no_grad()
def profile_admin(model: nn.Module, batch: int = 4, seq_len: int = 64, seed: int = 0) -> list[float]:
    """Set every Admin omega of ``model`` (a NormLM) by one profiling forward; returns the omegas in
    sublayer order (attention, MLP, attention, ...). A model without Admin sublayers is left alone."""
    all_blocks: list[Any] = list(cast(nn.ModuleList, model.blocks))  # Blocks (normlab.model.block imports this module)
    blocks = [b for b in all_blocks if getattr(b, "attn_omega", None) is not None]
    if not blocks:
        return []
    profile = AdminProfile()
    cfg = cast(ModelConfig, model.config)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, min(seq_len, cfg.max_seq_len)), generator=gen)
    device = next(model.parameters()).device
    for b in all_blocks:
        b.admin = profile
    training = model.training
    try:
        model.eval()
        model(tokens.to(device))
    finally:
        model.train(training)
        for b in all_blocks:
            b.admin = None
    return profile.omegas
