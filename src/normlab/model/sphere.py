"""nGPT: the normalized Transformer (Loshchilov et al. 2024, "nGPT: Normalized Transformer with Representation
Learning on the Hypersphere", arXiv 2410.01131), the parts that are not norm sites.

The layout ``ngpt`` (attn=qkBC, mlp=BC, norm=l2, qk-rope, ngpt) places nGPT's Norm(x) = x / ||x|| where the paper
does: on each sublayer's output (B), after the update (C), and on q and k after RoPE. This module holds the rest,
as the authors' code (NVIDIA/ngpt, model.py and train.py's normalize_matrices) computes it:

- eigen learning rates (eqs. 10-11): h <- Norm(h + a (Norm(F(h)) - h)), a per channel, one for attention (a_A)
  and one for the MLP (a_M); the block applies it as a lerp, skip (1 - a) h and branch a Norm(F(h)), h being a
  unit vector already. Stored as a_stored = a_scale at init and used as |a_stored * a_init / a_scale|,
  a_init = 0.05, a_scale = 1/sqrt(d) (the code's ``abs`` and its scaled-parameter trick, which sets the
  parameter's effective learning rate);
- s_qk (eq. 15-16): q <- s_qk Norm(q), k <- s_qk Norm(k) per head and channel, stored at 1/sqrt(d) for a value
  of 1; the softmax then scales the logits by sqrt(d_k), not 1/sqrt(d_k) (the unit-norm q and k make q.k a cosine);
- s_u, s_v (eqs. 19-20): u <- s_u u, v <- s_v sqrt(d) v in SwiGLU's u * SiLU(v), stored at 1 (the code scales u by
  sqrt(d) too; since the MLP's output is normalized, that factor changes only s_u's gradient scale);
- s_z (eq. 22): logits z <- s_z z per vocabulary entry, stored at 1/sqrt(d) for a value of 1;
- the weights on the sphere: every matrix's vectors along the embedding dimension (the rows of W_q, W_k, W_v,
  W_u, W_v(gate), the embedding and W_out; the columns of W_o and W_down) normalized after init and after every
  optimizer step (`project`; normlab.train.optim registers it as the step's post-hook).

nGPT trains without weight decay and without warm-up (its Sec. 2.6): these are run settings (weight_decay=0,
warmup=0), not the layout's; its scaling factors are never decayed (normlab.model.block.SCALE_PARAMS).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

ALPHA_INIT = 0.05  # a_A, a_M at init (the authors' code; the paper's 1/n_layers-order suggestion)


def base_scale(d: int) -> float:
    """The code's ``base_scale`` 1/sqrt(d): the stored value of a scaled parameter at init, and the init std."""
    return 1.0 / math.sqrt(d)


def eigen(stored: torch.Tensor, d: int) -> torch.Tensor:
    """The eigen learning rate a used in the lerp: |a_stored * a_init / a_scale|."""
    return (stored * (ALPHA_INIT / base_scale(d))).abs()


def rescaled(stored: torch.Tensor, d: int) -> torch.Tensor:
    """A scaling factor stored at 1/sqrt(d) for a value of 1 (s_qk, s_z): stored * sqrt(d)."""
    return stored / base_scale(d)


def _rows(w: torch.Tensor, dim: int) -> None:
    w.copy_(w / w.float().norm(dim=dim, keepdim=True).to(w.dtype))


@torch.no_grad()
def project(model: nn.Module) -> None:
    """Every weight's vectors along the embedding dimension to unit norm (the authors' normalize_matrices): rows of
    the embedding, the head and the matrices that read the stream, columns of those that write it."""
    _rows(cast(nn.Embedding, model.embed).weight, 1)
    _rows(cast(nn.Linear, model.lm_head).weight, 1)
    blocks: list[Any] = list(cast(nn.ModuleList, model.blocks))  # Blocks (normlab.model.block imports this module)
    for block in blocks:
        for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.mlp.gate_proj, block.mlp.up_proj):
            if lin is not None:
                _rows(lin.weight, 1)
        for lin in (block.attn.o_proj, block.mlp.down_proj):
            _rows(lin.weight, 0)
