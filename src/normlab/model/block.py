"""One Transformer block, one code path for every layout.

Each sublayer f (attention, then MLP) runs (Kim et al. 2025 Fig. 2 sites A/B/C; Kan et al. 2025
Sec. 5 step h; DeepNorm skip scale alpha; Zhuo et al. 2025 eq. 9 skip from the normed input)::

        x ──┬──> N_A ──> f ──> N_B ──> * h ──┐          (N_* is nn.Identity where a site is off)
            │     │                          v
            │     └─(skip_normed)──> * alpha ─> (+) ──> N_C ──> x'      (Admin: alpha a learned omega)
            └───────(otherwise)────> * alpha ──^

so Post-LN is C alone, Pre-LN A alone, Peri-LN A+B, HybridNorm's FFN A with skip_normed, Keel A+C with alpha the
number of sublayers, SpanNorm's MLP C with skip_block (the skip is the block's input x_in, not the MLP's: x' =
N_C(x_in + FFN(y))). Options on the same path: a learned skip lambda (x' = lambda x + h F), GPAS after the add
(x' <- x' - SiLU(a) sg(x')), nGPT's lerp ((1 - a) x + a N_B(F), then N_C), with n > 1 residual streams the
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
from collections.abc import Callable

import torch
from torch import nn

from normlab.layout.sites import ADMIN, BlockLayout, Layout, SublayerSites
from normlab.model.admin import AdminProfile
from normlab.model.attention import Attention
from normlab.model.config import ModelConfig
from normlab.model.decoding import Decoding
from normlab.model.depth_attention import DepthAttention, add_to_slot, block_of, n_sources
from normlab.model.mlp import MLP
from normlab.model.moe import MoE
from normlab.model.norms import Tap, site_norm
from normlab.model.sphere import base_scale, eigen
from normlab.model.storage import NO_STORAGE, Storage
from normlab.model.streams import HyperConnection, connection

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


class SiteNorms(nn.Module):
    """The three norm sites of one sublayer: ``input`` (A), ``output`` (B), ``after_add`` (C)."""

    def __init__(self, sites: SublayerSites, layout: Layout, cfg: ModelConfig, sublayer: str) -> None:
        super().__init__()
        d = cfg.d_model
        self.input = site_norm(sites.input, layout.norm_at(f"{sublayer}.A"), d, cfg)
        self.output = site_norm(
            sites.output, layout.norm_at(f"{sublayer}.B"), d, cfg, frozen_gamma=layout.freeze_output_gamma
        )
        self.after_add = site_norm(sites.after_add, layout.norm_at(f"{sublayer}.C"), d, cfg)
        self.skip_normed = sites.skip_normed
        self.skip_block = sites.skip_block  # SpanNorm: the skip is the block's input


class Block(nn.Module):
    store: Storage = NO_STORAGE  # the activation dtype (normlab.model.storage); set by NormLM.set_storage

    def __init__(
        self, cfg: ModelConfig, block: BlockLayout, layout: Layout, alpha: float, index: int = 0, attn_res_size: int = 0
    ) -> None:
        super().__init__()
        self.h, self.alpha = float(layout.h), float(alpha)
        # CompleteP's residual branch multiplier (L / L_base)^-alpha; 1 under sp and mup (normlab.model.parametrization)
        self.branch = cfg.branch_multiplier
        # LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth", eq. 6): the input norm's output times
        # 1/sqrt(l), l = the layer's index counted from 1, so deep layers' updates grow no faster than shallow ones
        self.ln_scale = 1.0 / math.sqrt(index + 1) if layout.ln_scaling else 1.0
        # a learned residual step: ReZero (Bachlechner et al. 2021, x + a F(x), a a scalar from 0) or LayerScale
        # (Touvron et al. 2021, x + diag(lambda) F(x), lambda per channel from a small h); else the number h
        self.attn_h = self.mlp_h = None
        if layout.h_learned is not None:
            shape = (1,) if layout.h_learned == "scalar" else (cfg.d_model,)
            self.attn_h = nn.Parameter(torch.full(shape, float(layout.h)))
            self.mlp_h = nn.Parameter(torch.full(shape, float(layout.h)))
        # Admin (Liu et al. 2020, eq. 7): x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1})), omega_i a learned vector per
        # sublayer, its start set by the profiling pass of normlab.model.admin (ones until then)
        self.attn_omega = self.mlp_omega = None
        if layout.alpha == ADMIN:
            self.attn_omega = nn.Parameter(torch.ones(cfg.d_model))
            self.mlp_omega = nn.Parameter(torch.ones(cfg.d_model))
        self.admin: AdminProfile | None = None  # set only during the profiling pass
        # modded-nanogpt's residual lambda: a learned scalar on the skip, from 1 (x' = lambda_skip x + h F(.))
        self.attn_skip = self.mlp_skip = None
        if layout.skip_learned:
            self.attn_skip, self.mlp_skip = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
        # GPAS (Chen et al. 2025, arXiv 2506.22049, Sec. 3; the authors' GPASBlock): after the sublayer,
        # x <- x - SiLU(a) * sg(x), a learned scalar from 0 (the identity at init). The forward scales x by
        # 1 - SiLU(a); the backward passes dL/dx unchanged (the subtracted copy is detached) and gives a its gradient.
        self.attn_gpas = self.mlp_gpas = None
        if layout.gpas:
            self.attn_gpas, self.mlp_gpas = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        # nGPT's eigen learning rates a_A, a_M per channel (normlab.model.sphere): h <- Norm((1 - a) h + a Norm(F(h)))
        self.attn_eigen = self.mlp_eigen = None
        if layout.ngpt:
            self.attn_eigen = nn.Parameter(torch.full((cfg.d_model,), base_scale(cfg.d_model)))
            self.mlp_eigen = nn.Parameter(torch.full((cfg.d_model,), base_scale(cfg.d_model)))
        # hyper-connections (normlab.model.streams): n streams in, n out; sublayer k = 2 l (attention), 2 l + 1 (MLP)
        self.attn_hc = self.mlp_hc = None
        if layout.streams > 1:
            self.attn_hc = connection(layout.stream_mix, layout.streams, cfg.d_model, 2 * index)
            self.mlp_hc = connection(layout.stream_mix, layout.streams, cfg.d_model, 2 * index + 1)
        # Attention Residuals (normlab.model.depth_attention): each sublayer's read over the depth sources (eqs. 2-6)
        self.attn_depth = self.mlp_depth = None
        if attn_res_size:
            self.attn_depth, self.mlp_depth = (
                DepthAttention(
                    cfg.d_model,
                    cfg.norm_eps,
                    n_sources(k, attn_res_size),
                    block_of(k, attn_res_size)[0],
                    cfg.norm_compute,
                )
                for k in (2 * index, 2 * index + 1)
            )
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

    def _sublayer(
        self,
        x: torch.Tensor,
        norms: SiteNorms,
        f: Callable[[torch.Tensor], torch.Tensor],
        update_tap: Tap,
        h: nn.Parameter | None = None,
        omega: nn.Parameter | None = None,
        lam: nn.Parameter | None = None,
        gpas: nn.Parameter | None = None,
        hc: HyperConnection | None = None,
        eig: nn.Parameter | None = None,
        block_in: torch.Tensor | None = None,
        depth: DepthAttention | None = None,
    ) -> torch.Tensor:
        store = self.store  # every tensor a real fp16 run writes to memory is rounded where it is made
        if hc is not None:  # x holds the n streams side by side; the branch reads h_0 = sum_j pre_j H_j
            streams = x.unflatten(-1, (hc.n, -1))
            x, res, post = hc(streams)
            x = store(x)
        if depth is not None:  # x holds the depth sources side by side; the branch reads h_l = sum_i alpha_i v_i
            state, x = x, store(depth(x))
        u = store(norms.input(x))
        skip = u if norms.skip_normed else block_in if norms.skip_block else x
        assert skip is not None  # a layout that skips from the block's input passes it (forward)
        if self.ln_scale != 1.0:
            u = store(u * self.ln_scale)
        update = store(norms.output(store(f(u))))
        # h and alpha are 1 in most layouts; skipping the multiply then saves two elementwise passes.
        if h is not None:
            update = store(h.to(update.dtype) * update)
        elif self.h != 1.0:
            update = store(self.h * update)
        if self.branch != 1.0:
            update = store(self.branch * update)
        if hc is not None:  # H'_i = sum_j res_ij H_j + post_i * update (the layout refuses C, S, alpha, lambda, GPAS)
            return store(hc.depth(streams, res, post, update_tap(update)).flatten(-2))
        if depth is not None:  # b_n^i = b_n^{i-1} + update (the layout refuses C, S, W, alpha, lambda, GPAS, streams)
            assert depth.slot is not None
            return store(add_to_slot(state, update_tap(update), depth.slot))
        if self.alpha != 1.0:
            skip = store(self.alpha * skip)
        if omega is not None:
            if self.admin is not None:
                self.admin.set(omega, skip, update)
            skip = store(omega.to(skip.dtype) * skip)
        if lam is not None:
            skip = store(lam.to(skip.dtype) * skip)
        if eig is not None:  # nGPT's lerp: (1 - a) h + a Norm(F(h)), then N_C = Norm (the layout's C site)
            a = eigen(eig, eig.shape[0]).to(update.dtype)
            skip, update = store((1 - a) * skip), store(a * update)
        out = store(norms.after_add(store(skip + update_tap(update))))
        if gpas is not None:
            out = store(out - nn.functional.silu(gpas).to(out.dtype) * out.detach())
        return out

    def forward(self, x: torch.Tensor, dec: Decoding | None = None) -> torch.Tensor:
        attn = self.attn if dec is None else (lambda u: self.attn(u, dec))
        x_in = x  # SpanNorm's MLP takes its skip from here (skip_block)
        x = self.resid_mid(
            self._sublayer(
                x,
                self.attn_norms,
                attn,
                self.attn_update,
                self.attn_h,
                self.attn_omega,
                self.attn_skip,
                self.attn_gpas,
                self.attn_hc,
                self.attn_eigen,
                depth=self.attn_depth,
            )
        )
        return self.resid_post(
            self._sublayer(
                x,
                self.mlp_norms,
                self.mlp,
                self.mlp_update,
                self.mlp_h,
                self.mlp_omega,
                self.mlp_skip,
                self.mlp_gpas,
                self.mlp_hc,
                self.mlp_eigen,
                block_in=x_in if self.mlp_norms.skip_block else None,
                depth=self.mlp_depth,
            )
        )
