"""RMSNorm and LayerNorm, and the capture point `Tap`.

Both norms are torch's own modules (fused kernels, `torch.nn.functional.rms_norm/layer_norm`):
    RMSNorm(x)   = gamma * x / sqrt(mean(x^2) + eps)                  Zhang & Sennrich 2019
    LayerNorm(x) = gamma * (x - mean(x)) / sqrt(var(x) + eps) + beta  Ba et al. 2016
A site that is off holds `nn.Identity()`, so module paths are the same under every layout.
"""

from __future__ import annotations

from torch import nn

from normlab.layout.sites import NormKind


def make_norm(kind: NormKind, dim: int, eps: float, bias: bool = True, frozen_gamma: bool = False) -> nn.Module:
    """A norm over the last dimension; ``frozen_gamma`` fixes gamma at 1 (Kim et al. Fig. 8)."""
    if kind == "rms":
        norm: nn.Module = nn.RMSNorm(dim, eps=eps)
    elif kind == "layer":
        norm = nn.LayerNorm(dim, eps=eps, bias=bias)
    else:
        raise ValueError(f"unknown norm kind {kind!r}; valid: rms, layer")
    if frozen_gamma:
        norm.weight.requires_grad_(False)
    return norm


def maybe_norm(on: bool, kind: NormKind, dim: int, eps: float, bias: bool = True, frozen_gamma: bool = False) -> nn.Module:
    return make_norm(kind, dim, eps, bias, frozen_gamma) if on else nn.Identity()


class Tap(nn.Identity):
    """A named capture point: returns its input unchanged, so a forward hook on it sees exactly
    the tensor that flows there (e.g. ``blocks.3.attn_update``, the update added to the stream)."""
