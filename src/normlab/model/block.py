"""One Transformer block, one code path for every layout.

Each sublayer f (attention, then MLP) runs (Kim et al. 2025 Fig. 2 sites A/B/C; Kan et al. 2025
Sec. 5 step h; DeepNorm skip scale alpha; Zhuo et al. 2025 eq. 9 skip from the normed input)::

        x ──┬──> N_A ──> f ──> N_B ──> * h ──┐          (N_* is nn.Identity where a site is off)
            │     │                          v
            │     └─(skip_normed)──> * alpha ─> (+) ──> N_C ──> x'
            └───────(otherwise)────> * alpha ──^

so Post-LN is C alone, Pre-LN A alone, Peri-LN A+B, HybridNorm's FFN A with skip_normed.

Capture points (`Tap`), the same paths under every layout:
    blocks.i.attn_update / mlp_update   h * N_B(f(N_A(x))): exactly the tensor added to the stream
    blocks.i.resid_mid                   the stream after the attention sublayer (after N_C)
    blocks.i.resid_post                  the block's output
    blocks.i.{attn,mlp}_norms.{input,output,after_add}   the norm modules themselves
    blocks.i.attn.{q,k,v,context}        inside attention
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from normlab.layout.sites import BlockLayout, Layout, SublayerSites
from normlab.model.attention import Attention
from normlab.model.config import ModelConfig
from normlab.model.decoding import Decoding
from normlab.model.mlp import MLP
from normlab.model.moe import MoE
from normlab.model.norms import Tap, maybe_norm
from normlab.model.storage import NO_STORAGE, Storage


class SiteNorms(nn.Module):
    """The three norm sites of one sublayer: ``input`` (A), ``output`` (B), ``after_add`` (C)."""

    def __init__(self, sites: SublayerSites, layout: Layout, cfg: ModelConfig) -> None:
        super().__init__()
        kind, d, eps, bias, c = layout.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias, cfg.norm_compute
        self.input = maybe_norm(sites.input, kind, d, eps, bias, compute=c, dyt_alpha=cfg.dyt_alpha)
        self.output = maybe_norm(sites.output, kind, d, eps, bias, frozen_gamma=layout.freeze_output_gamma, compute=c,
                                 dyt_alpha=cfg.dyt_alpha)
        self.after_add = maybe_norm(sites.after_add, kind, d, eps, bias, compute=c, dyt_alpha=cfg.dyt_alpha)
        self.skip_normed = sites.skip_normed


class Block(nn.Module):
    store: Storage = NO_STORAGE  # the activation dtype (normlab.model.storage); set by NormLM.set_storage

    def __init__(self, cfg: ModelConfig, block: BlockLayout, layout: Layout, alpha: float, index: int = 0) -> None:
        super().__init__()
        self.h, self.alpha = float(layout.h), float(alpha)
        self.attn_norms = SiteNorms(block.attn, layout, cfg)
        self.attn = Attention(cfg, block.attn_inner, layout.inner_span, layout.norm, layer_idx=index)
        self.attn_update, self.resid_mid = Tap(), Tap()
        self.mlp_norms = SiteNorms(block.mlp, layout, cfg)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)
        self.mlp_update, self.resid_post = Tap(), Tap()

    def _sublayer(
        self, x: torch.Tensor, norms: SiteNorms, f: Callable[[torch.Tensor], torch.Tensor], update_tap: Tap
    ) -> torch.Tensor:
        store = self.store  # every tensor a real fp16 run writes to memory is rounded where it is made
        u = store(norms.input(x))
        skip = u if norms.skip_normed else x
        update = store(norms.output(store(f(u))))
        # h and alpha are 1 in most layouts; skipping the multiply then saves two elementwise passes.
        if self.h != 1.0:
            update = store(self.h * update)
        if self.alpha != 1.0:
            skip = store(self.alpha * skip)
        return store(norms.after_add(store(skip + update_tap(update))))

    def forward(self, x: torch.Tensor, dec: Decoding | None = None) -> torch.Tensor:
        attn = self.attn if dec is None else (lambda u: self.attn(u, dec))
        x = self.resid_mid(self._sublayer(x, self.attn_norms, attn, self.attn_update))
        return self.resid_post(self._sublayer(x, self.mlp_norms, self.mlp, self.mlp_update))
