"""One Transformer block: two `Sublayer`s (attention, then the MLP) and the residual class of the layout's variant.

The residual class (normlab.model.residual, chosen from ``layout.residual`` at build time) writes each sublayer's
update into the state; with the plain sum (`Skip`) each sublayer f runs (Kim et al. 2025 Fig. 2 sites A/B/C; Kan
et al. 2025 Sec. 5 step h; DeepNorm skip scale alpha; Zhuo et al. 2025 eq. 9 skip from the normed input)::

        x ──┬──> N_A ──> f ──> N_B ──> * h ──┐          (N_* is nn.Identity where a site is off)
            │     │                          v
            │     └─(skip_normed)──> * alpha ─> (+) ──> N_C ──> x'      (Admin: alpha a learned omega)
            └───────(otherwise)────> * alpha ──^

so Post-LN is C alone, Pre-LN A alone, Peri-LN A+B, HybridNorm's FFN A with skip_normed, Keel A+C with alpha the
number of sublayers, SpanNorm's MLP C with skip_block (the skip is the block's input x_in, not the MLP's: x' =
N_C(x_in + FFN(y))), a learned skip lambda (x' = lambda x + h F) or GPAS after the add (x' <- x' - SiLU(a)
sg(x')). The other schemes: nGPT's lerp ((1 - a) x + a N_B(F), then N_C), with n > 1 residual streams the
hyper-connections' mixing in place of the skip (h_0 = pre . H into the branch; H' = res H + post * update;
normlab.model.streams), and with Attention Residuals a softmax read over the embedding and the blocks' sums in
place of x and the update added to its block's sum in place of the skip (normlab.model.depth_attention).

Capture points (`Tap`), the same paths under every layout:
    blocks.i.attn_update / mlp_update   h * N_B(f(N_A(x))): exactly the tensor added to the stream (SpanNorm's
                                         MLP: to the block's input; Attention Residuals: to its block's sum)
    blocks.i.resid_mid                   the stream after the attention sublayer (after N_C)
    blocks.i.resid_post                  the block's output
    blocks.i.{attn,mlp}_norms.{input,output,after_add}   the norm modules themselves
    blocks.i.attn.{q,k,v,context}        inside attention
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normlab.layout.sites import BlockLayout, Layout
from normlab.model.admin import AdminProfile
from normlab.model.attention import Attention
from normlab.model.config import ModelConfig
from normlab.model.decoding import Decoding
from normlab.model.depth_attention import DepthAttention
from normlab.model.mlp import MLP
from normlab.model.moe import MoE
from normlab.model.norms import Tap, site_norm
from normlab.model.residual import PART_NAMES, SUBLAYERS, ResidualPath
from normlab.model.storage import NO_STORAGE, Storage
from normlab.model.streams import HyperConnection
from normlab.model.sublayer import Flow, SiteNorms, Sublayer

__all__ = ["SCALE_PARAMS", "Block", "SiteNorms", "scale_params"]

# Learned scales that are not norms: residual steps (ReZero, LayerScale), Admin's omegas, NormFormer's head
# scales. Like norm gains they are left out of weight decay (which would pull them to 0) and probed.
# Each name maps to the prefix of its probe metrics (h_mean, omega_mean, head_scale_mean).
SCALE_PARAMS = {
    "attn_h": "h",
    "mlp_h": "h",
    "attn_omega": "omega",
    "mlp_omega": "omega",
    "head_scale": "head_scale",
    "sinks": "sink",
    "attn_skip": "skip",
    "mlp_skip": "skip",
    "attn_gpas": "gpas",
    "mlp_gpas": "gpas",
    "attn_eigen": "eigen",
    "mlp_eigen": "eigen",
    "sqk": "s_qk",
    "suv": "s_uv",
    "sz": "s_z",
}


def scale_params(model: nn.Module) -> list[nn.Parameter]:
    """Every learned scale parameter of ``model`` (see SCALE_PARAMS)."""
    found = [getattr(m, name, None) for m in model.modules() for name in SCALE_PARAMS]
    return [p for p in found if isinstance(p, nn.Parameter)]


class Block(nn.Module):
    """Two residual sublayers, attention then the MLP, each a `Sublayer` (its site norms and its function) whose
    update the model's residual path (normlab.model.residual, chosen from the layout's variant) writes into the
    state. The residual's learned pieces for each sublayer are registered here as ``attn_<part>`` / ``mlp_<part>``
    (``attn_h``, ``mlp_omega``, ``attn_hc``, ...; None where the scheme has no such part)."""

    store: Storage = NO_STORAGE  # the activation dtype (normlab.model.storage); set by NormLM.set_storage
    # the residual parts each scheme registers (normlab.model.residual); None where the layout's scheme has none
    attn_h: nn.Parameter | None
    mlp_h: nn.Parameter | None
    attn_omega: nn.Parameter | None
    mlp_omega: nn.Parameter | None
    attn_skip: nn.Parameter | None
    mlp_skip: nn.Parameter | None
    attn_gpas: nn.Parameter | None
    mlp_gpas: nn.Parameter | None
    attn_eigen: nn.Parameter | None
    mlp_eigen: nn.Parameter | None
    attn_hc: HyperConnection | None
    mlp_hc: HyperConnection | None
    attn_depth: DepthAttention | None
    mlp_depth: DepthAttention | None

    def __init__(
        self, cfg: ModelConfig, block: BlockLayout, layout: Layout, path: ResidualPath, index: int = 0
    ) -> None:
        super().__init__()
        self.residual = path
        for name in PART_NAMES:  # the parts of the other schemes read None
            for sub in SUBLAYERS:
                setattr(self, f"{sub}_{name}", None)
        parts = [path.parts(2 * index), path.parts(2 * index + 1)]  # in this order: the connections draw weights
        for name in path.part_names:
            for sub, own in zip(SUBLAYERS, parts):
                setattr(self, f"{sub}_{name}", own[name])
        self.admin: AdminProfile | None = None  # set only during Admin's profiling pass (normlab.model.admin)
        self.attn_norms = SiteNorms(block.attn, layout, cfg, "attn")
        self.attn = Attention(cfg, block.attn_inner, layout, layer_idx=index)
        self.attn_update, self.resid_mid = Tap(), Tap()
        self.mlp_norms = SiteNorms(block.mlp, layout, cfg, "mlp")
        self.mlp = (
            MoE(cfg)
            if cfg.n_experts
            else MLP(cfg, site_norm(block.mlp.hidden, layout.norm_at("mlp.H"), cfg.ffn_dim, cfg), ngpt=layout.ngpt)
        )
        self.mlp_update, self.resid_post = Tap(), Tap()
        # LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth", eq. 6): the input norm's output times
        # 1/sqrt(l), l = the layer's index counted from 1, so deep layers' updates grow no faster than shallow ones
        ln_scale = 1.0 / math.sqrt(index + 1) if layout.ln_scaling else 1.0
        self.sublayers = (
            Sublayer("attn", 2 * index, self.attn_norms, self.attn, self.attn_update, ln_scale),
            Sublayer("mlp", 2 * index + 1, self.mlp_norms, self.mlp, self.mlp_update, ln_scale),
        )

    @property
    def h(self) -> float:
        """The fixed branch step h of this block's residual path (a learned h is the ``attn_h`` / ``mlp_h`` part)."""
        return self.residual.h

    @h.setter
    def h(self, value: float) -> None:
        self.residual.h = float(value)

    @property
    def branch(self) -> float:
        """CompleteP's residual branch multiplier (1 under sp and mup): the residual path's."""
        return self.residual.branch

    def parts(self, sub: str) -> dict[str, nn.Parameter | nn.Module | None]:
        """Sublayer ``sub``'s residual parts, read at call time (a sharded run replaces the parameters)."""
        return {name: getattr(self, f"{sub}_{name}") for name in self.residual.part_names}

    def forward(self, x: torch.Tensor, dec: Decoding | None = None) -> torch.Tensor:
        flow = Flow(store=self.store, block_in=x, decoding=dec, admin=self.admin)
        attn, mlp = self.sublayers
        x = self.resid_mid(self.residual.write(x, attn, self.parts("attn"), flow))
        return self.resid_post(self.residual.write(x, mlp, self.parts("mlp"), flow))
