"""Multi-head latent attention (MLA; DeepSeek-AI 2024, DeepSeek-V2, arXiv 2405.04434, Sec. 2.1), ``attention=mla``.

Keys and values come from one low-rank latent per token, the query optionally from its own (Sec. 2.1.2), and a
decoupled RoPE part carries the position (Sec. 2.1.3); for token t, head i::

    c_t^KV = W^DKV h_t                       (eq. 9)    the cached latent, width d_c = kv_lora_rank
    k_t,i^C = W^UK_i c_t^KV                  (eq. 10)   width d_h = qk_nope_head_dim
    v_t,i^C = W^UV_i c_t^KV                  (eq. 11)   width v_head_dim
    c_t^Q = W^DQ h_t                         (eq. 12)   width d_c' = q_lora_rank (none: c_t^Q = h_t, V2-Lite)
    q_t,i^C = W^UQ_i c_t^Q                   (eq. 13)
    q_t,i^R = RoPE(W^QR_i c_t^Q)             (eq. 14)   width d_h^R = qk_rope_head_dim
    k_t^R = RoPE(W^KR h_t)                   (eq. 15)   one per token, shared by the heads
    q_t,i = [q_t,i^C; q_t,i^R],  k_t,i = [k_t,i^C; k_t^R]                  (eqs. 16-17)
    o_t,i = sum_{j<=t} softmax_j(q_t,i . k_j,i / sqrt(d_h + d_h^R)) v_j,i^C     (eq. 18)
    u_t = W^O [o_t,1; ..; o_t,n_h]           (eq. 19)

DeepSeek-V2 adds "additional RMSNorm layers after the compressed latent vectors" (Sec. 3.1.2): c^KV and c^Q are
RMSNormed (a gain each) before their up-projections, as transformers' DeepseekV2Attention (kv_a_layernorm,
q_a_layernorm); ``model.mla_latent_norm=false`` drops them (eqs. 9-13 as written). With d_h^R = 0 there is no
RoPE part, and without the latent norms and with d_c = n_h d_h, W^DKV = I, MLA is multi-head attention with
W^K = W^UK, W^V = W^UV (tests/unit/test_mla.py).

QK-norm (the layout's q and k sites, e.g. ``qwen3`` or ``pre+qk``) acts per head on the full q_t,i and k_t,i
(both parts), before RoPE (after it with ``qk-rope``): the explicit post-projection QK RMSNorm that Han et al. 2026
("QK-Normed MLA", arXiv 2606.16310) show their latent-cache form equals in exact arithmetic (the key gain folded
into the query side, the key's RMS one scalar per token and head); normlab computes the explicit form. The v and
context sites act per head too.

The projections keep the names of `Attention`'s: ``q_proj`` is W^UQ (from c^Q, or from h without a query latent),
``k_proj`` W^UK, ``v_proj`` W^UV, ``o_proj`` W^O; besides them ``q_down`` (W^DQ), ``q_rope`` (W^QR), ``kv_down``
(W^DKV), ``k_rope`` (W^KR) and the latents' norms ``q_latent_norm``, ``kv_latent_norm``. Per-projection learning
rates (``model.q_lr_mult``, ``model.k_lr_mult``; `projection_lr`) take the query side (W^DQ, W^UQ, W^QR) and the
key-only side (W^UK, W^KR); W^DKV feeds keys and values alike and keeps the base rate.
The KV cache (generation) holds the up-projected k and v, not the latent: the arithmetic is the same.
"""

from __future__ import annotations

import torch
from torch import nn

from normlab.layout.sites import AttentionInnerSites, Layout
from normlab.model.attention import ATTENTION_CLASSES, Attention
from normlab.model.config import ModelConfig
from normlab.model.norms import RMSNorm, Tap, site_norm
from normlab.model.rope import Rotary


def mla_dims(cfg: ModelConfig) -> tuple[int, int | None, int, int, int]:
    """(d_c, d_c' or None, d_h, d_h^R, v_head_dim) of ``cfg``, the defaults filled in (ModelConfig's settings)."""
    return cfg.mla_dims


class LatentAttention(Attention):
    """DeepSeek-V2's MLA (module docstring, eqs. 9-19); built by ``Attention(cfg, ...)`` when cfg.attention = mla."""

    def __init__(self, cfg: ModelConfig, inner: AttentionInnerSites, layout: Layout, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        d, h, bias = cfg.d_model, cfg.n_heads, cfg.linear_bias
        d_c, d_cq, self.nope, self.rope_dim, self.v_dim = mla_dims(cfg)
        self.n_heads = self.n_kv_heads = h
        self.head_dim = self.nope + self.rope_dim  # the q . k width
        self.span, self.qk_after_rope = "head", layout.qk_after_rope
        q_in = d if d_cq is None else d_cq
        self.q_down = nn.Linear(d, d_cq, bias=False) if d_cq is not None else None
        latent = cfg.mla_latent_norm
        self.q_latent_norm = (
            RMSNorm(d_cq, cfg.norm_eps, cfg.norm_compute) if d_cq is not None and latent else nn.Identity()  # type: ignore[arg-type]
        )
        self.q_proj = nn.Linear(q_in, h * self.nope, bias=bias or cfg.qkv_bias)
        self.q_rope = nn.Linear(q_in, h * self.rope_dim, bias=False) if self.rope_dim else None
        self.kv_down = nn.Linear(d, d_c, bias=False)
        self.kv_latent_norm = RMSNorm(d_c, cfg.norm_eps, cfg.norm_compute) if latent else nn.Identity()  # type: ignore[arg-type]
        self.k_proj = nn.Linear(d_c, h * self.nope, bias=bias or cfg.qkv_bias)
        self.v_proj = nn.Linear(d_c, h * self.v_dim, bias=bias or cfg.qkv_bias)
        self.k_rope = nn.Linear(d, self.rope_dim, bias=False) if self.rope_dim else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)
        self.q_norm = site_norm(inner.q, layout.norm_at("q"), self.head_dim, cfg)
        self.k_norm = site_norm(inner.k, layout.norm_at("k"), self.head_dim, cfg)
        self.v_norm = site_norm(inner.v, layout.norm_at("v"), self.v_dim, cfg)
        self.context_norm = site_norm(inner.context, layout.norm_at("c"), self.v_dim, cfg)
        self.gate_proj, self.head_scale, self.sqk = None, None, None  # refused by ModelConfig.attention_problem
        self.gate = Tap()
        self.rotary = (
            Rotary(self.rope_dim, cfg.max_seq_len, cfg.rope_theta_of(layer_idx))
            if cfg.position == "rope" and self.rope_dim
            else None
        )
        self.q, self.k, self.v, self.context = Tap(), Tap(), Tap(), Tap()
        self.scale = cfg.attention_scale(self.head_dim)
        self.window = cfg.window_of(layer_idx)
        self.softcap = cfg.attn_softcap
        self.softmax = layout.softmax
        self.sinks = nn.Parameter(torch.zeros(h)) if layout.softmax == "sink" else None

    def _rope_part(self, x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """x (B, H, T, d_h + d_h^R) with RoPE on its last d_h^R features (eqs. 14-15)."""
        if self.rotary is None:
            return x
        return torch.cat([x[..., : self.nope], self.rotary(x[..., self.nope :], pos)], dim=-1)

    def _project(self, x: torch.Tensor, pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        h, store = self.n_heads, self.store
        c_q = x if self.q_down is None else store(self.q_latent_norm(self.q_down(x)))
        c_kv = store(self.kv_latent_norm(self.kv_down(x)))
        q = self.q_proj(c_q).view(b, t, h, self.nope)
        k = self.k_proj(c_kv).view(b, t, h, self.nope)
        if self.q_rope is not None and self.k_rope is not None:
            q = torch.cat([q, self.q_rope(c_q).view(b, t, h, self.rope_dim)], dim=-1)
            k_r = self.k_rope(x).view(b, t, 1, self.rope_dim).expand(b, t, h, self.rope_dim)
            k = torch.cat([k, k_r], dim=-1)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, d_h + d_h^R)
        if self.qk_after_rope:
            q, k = self.q_norm(self._rope_part(q, pos)), self.k_norm(self._rope_part(k, pos))
        else:
            q, k = self._rope_part(self.q_norm(q), pos), self._rope_part(self.k_norm(k), pos)
        v = self.v_norm(self.v_proj(c_kv).view(b, t, h, self.v_dim)).transpose(1, 2)
        return self.q(store(q)), self.k(store(k)), self.v(store(v))


def projection_lr(model: nn.Module) -> dict[int, float]:
    """Each query and key-only projection weight's learning-rate multiplier (ids; model.q_lr_mult, k_lr_mult), as
    Anson & Aitchison 2025 (arXiv 2511.21377) give W_q and W_k learning rates of their own. MHA/MoDA: q_proj and
    k_proj; MLA: W^DQ, W^UQ, W^QR on the query side and W^UK, W^KR on the key side (module docstring). Empty when both
    multipliers are 1. Biases follow their weight's rate."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or (cfg.q_lr_mult == 1.0 and cfg.k_lr_mult == 1.0):
        return {}
    out: dict[int, float] = {}
    for m in model.modules():
        if not isinstance(m, Attention):
            continue
        for names, mult in (
            (("q_down", "q_proj", "q_rope"), cfg.q_lr_mult),
            (("k_proj", "k_rope"), cfg.k_lr_mult),
        ):
            for name in names:
                lin = getattr(m, name, None)
                if isinstance(lin, nn.Linear):
                    out.update({id(p): mult for p in lin.parameters()})
    return out


ATTENTION_CLASSES.update(mla=LatentAttention)  # Attention(cfg, ...) builds it for attention=mla
