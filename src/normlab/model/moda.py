"""Mixture-of-depths attention (MoDA; Zhu et al. 2026, arXiv 2603.15619), ``attention=moda``.

Each head of layer l attends, in one softmax, to the causal sequence keys and values of its own layer (eqs. 1-2)
and to the depth keys and values {K_i,t, V_i,t}_{i<l} that the earlier layers wrote at the query's own position t
(Sec. 2.2, "Mixture-of-Depths Attention"; Fig. 1; eq. 5 reads depth alone, MoDA joins it to the sequence)::

    o_t = sum_{j<=t} p_j V_l,j + sum_{i<l} p'_i V_i,t,
    (p, p') = softmax([q_t K_l,j^T / sqrt(d)]_{j<=t} ++ [q_t K_i,t^T / sqrt(d)]_{i<l})

one query head reading its key-value head (GQA's phi(h), eq. 2). The depth keys and values are the earlier layers'
own sequence keys and values (after their norms and RoPE: a key at t under a query at t is rotated alike, so RoPE
drops out of the depth logits), the variant of Table 3 row 3 ("we directly reuse the preceding layer's sequence KV
as the depth KV, which would not introduce additional projection parameters"; +0.12% FLOPs at 700M). The authors'
default adds a light-weight K/V projection of each FFN's input as more depth entries (Table 3 row 4, +5.5%
parameters; "projects the FFN's input X to its corresponding depth keys/values"): ``model.moda_ffn_kv``. Each layer
but the last then holds W_K^F, W_V^F (d x H_k d each; the last has no later reader) and a forward pre-hook on its
block's MLP (`FFNDepthWriter`) writes the MLP's input u, as the MLP reads it (after the input norm), as depth key
W_K^F u and value W_V^F u after the layer's attention wrote its own; the keys go through the layer's k-norm and RoPE
as its sequence keys do (the paper does not say; at the query's own position RoPE drops out either way). The joint
softmax is the one of the authors' reference, ``naive_mixture_of_depth_causal_ref`` (hustvl/MoDA,
libs/moda_triton/fla/ops/moda/moda_v14.py): logits over the visible sequence keys concatenated with the depth
logits at the query's own position, one softmax, one weighted sum.

Cost per layer l (0-based) and token, beyond MHA: l depth logits and l depth values per query head, 4 l H d FLOPs
(`depth_flops`; twice the entries with ``moda_ffn_kv``, plus its projections); no parameters (``moda_ffn_kv``:
2 d H_k d per layer but the last). The depth entries are shared through one `DepthKV` per model (`link_depth`),
emptied by layer 0 on each forward and after the last layer reads it. The paper reports MoDA doing better with
post-norm than pre-norm (Table 6; its Fig. 1 draws x + Attn(x) -> RMSNorm: Post-LN), so both are documented configs:
``--layout pre --set model.attention=moda`` and ``--layout post --set model.attention=moda``.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
from torch import nn

from normlab.layout.sites import AttentionInnerSites, Layout
from normlab.model.attention import ATTENTION_CLASSES, Attention
from normlab.model.config import ModelConfig


class DepthKV:
    """The depth keys and values one forward has written so far: (k, v) per earlier layer, each (B, kv_heads, T,
    head_dim) for the new tokens. Not a module: no parameters, not saved."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []


class DepthKVAttention(Attention):
    """MoDA (module docstring): `Attention` whose softmax also covers the earlier layers' keys and values at the
    query's own position."""

    def __init__(self, cfg: ModelConfig, inner: AttentionInnerSites, layout: Layout, layer_idx: int = 0) -> None:
        super().__init__(cfg, inner, layout, layer_idx)
        self.last_layer = layer_idx == cfg.n_layers - 1
        self.depth = DepthKV()  # replaced by the model's shared one (link_depth)
        self._depth_now: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._positions: torch.Tensor | None = None  # this forward's positions, for the FFN's depth keys
        # Table 3 row 4: the FFN's input projected to depth keys and values (none after the last layer: no reader)
        width = self.n_kv_heads * self.head_dim
        ffn_kv = cfg.moda_ffn_kv and not self.last_layer
        self.ffn_k = nn.Linear(cfg.d_model, width, bias=False) if ffn_kv else None
        self.ffn_v = nn.Linear(cfg.d_model, width, bias=False) if ffn_kv else None

    def _project(self, x: torch.Tensor, pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._positions = pos
        return super()._project(x, pos)

    def write_ffn(self, u: torch.Tensor) -> None:
        """The FFN's input u (B, T, d), as its MLP reads it, written as depth keys W_K^F u and values W_V^F u
        (Table 3 row 4), keys through this layer's k-norm and RoPE as its sequence keys go."""
        if self.ffn_k is None or self.ffn_v is None:
            return
        if self.qk_after_rope:
            k = self.k_norm(self._rotate(self._heads(self.ffn_k(u), self.n_kv_heads, nn.Identity()), self._positions))
        else:
            k = self._rotate(self._heads(self.ffn_k(u), self.n_kv_heads, self.k_norm), self._positions)
        v = self._heads(self.ffn_v(u), self.n_kv_heads, self.v_norm)
        self.depth.entries.append((self.store(k), self.store(v)))

    def _attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: object) -> torch.Tensor:
        if self.layer_idx == 0:
            self.depth.entries = []
        self._depth_now = list(self.depth.entries)
        self.depth.entries.append((k, v))  # this layer's keys and values of the new tokens, before any cache
        try:
            return super()._attend(x, q, k, v, dec)  # type: ignore[arg-type]
        finally:
            self._depth_now = []
            if self.last_layer:
                self.depth.entries = []

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if not self._depth_now:
            return super()._mix(q, k, v, mask)
        return depth_mix(q, k, v, self._depth_now, mask, self.scale)


def depth_mix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    depth: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """One softmax over the visible sequence keys ``k`` (B, Hkv, N, d) and the depth keys at each query's position
    (``depth``: (k_i, v_i) of shape (B, Hkv, T, d)); q (B, H, T, d); ``mask`` bool (visible) or None (causal, the
    queries the last T of the N keys). Returns (B, H, T, d_v); the softmax in at least float32."""
    h, t, n = q.shape[1], q.shape[-2], k.shape[-2]
    rep = h // k.shape[1]
    s = scale if scale is not None else q.shape[-1] ** -0.5
    kd = torch.stack([ki for ki, _ in depth], dim=-2).repeat_interleave(rep, dim=1)  # (B, H, T, L, d)
    vd = torch.stack([vi for _, vi in depth], dim=-2).repeat_interleave(rep, dim=1)
    seq = (q @ k.repeat_interleave(rep, dim=1).transpose(-2, -1)) * s  # (B, H, T, N)
    dep = (q.unsqueeze(-2) @ kd.transpose(-2, -1)).squeeze(-2) * s  # (B, H, T, L)
    visible = mask if mask is not None else torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
    wide = torch.promote_types(q.dtype, torch.float32)  # at least float32 (bf16/fp16 runs), float64 kept
    logits = torch.cat([seq.to(wide).masked_fill(~visible, float("-inf")), dep.to(wide)], dim=-1)
    w = torch.softmax(logits, dim=-1).to(q.dtype)
    out = w[..., :n] @ v.repeat_interleave(rep, dim=1)
    return out + (w[..., n:].unsqueeze(-2) @ vd).squeeze(-2)


class FFNDepthWriter:
    """A forward pre-hook on a block's MLP: its input written as depth keys and values by the block's attention."""

    def __init__(self, attn: DepthKVAttention) -> None:
        self.attn = attn

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.attn.write_ffn(args[0])


_A = TypeVar("_A", bound=Attention)


def share_depth(blocks: nn.ModuleList, kind: type[_A]) -> list[tuple[nn.Module, _A]]:
    """Give every attention of ``kind`` in ``blocks`` one shared `DepthKV` (the layers that read each other's
    entries within a forward: MoDA, Depth-Attention); returns those (block, attention) pairs."""
    shared = DepthKV()
    found = [(blk, attn) for blk in blocks if isinstance(attn := getattr(blk, "attn", None), kind)]
    for _, attn in found:
        attn.depth = shared  # type: ignore[assignment]  # each kind declares depth: DepthKV
    return found


def link_depth(blocks: nn.ModuleList) -> None:
    """Give every MoDA attention of ``blocks`` one shared `DepthKV`, and with ``moda_ffn_kv`` hook each block's MLP
    to write its input there (a no-op for other attention kinds)."""
    for blk, attn in share_depth(blocks, DepthKVAttention):
        if attn.ffn_k is not None:
            cast(nn.Module, blk.mlp).register_forward_pre_hook(FFNDepthWriter(attn))


def depth_flops(cfg: ModelConfig, seq_len: int) -> int:
    """MoDA's forward FLOPs per sequence beyond MHA's: at layer l, each of T queries of H heads takes l depth logits
    (2 d each) and l depth values (2 d each): sum_l 4 l H d T = 2 L (L - 1) H d T (the paper's Table 1 term
    2 G T L^2 H_k d, G H_k = H); with ``moda_ffn_kv`` twice the depth entries, and the L - 1 FFN projections W_K^F,
    W_V^F, 2 x 2 d (H_k d) T each. 0 for other attention kinds."""
    if cfg.attention != "moda":
        return 0
    reads = 2 * cfg.n_layers * (cfg.n_layers - 1) * cfg.n_heads * cfg.head_dim * seq_len
    if not cfg.moda_ffn_kv:
        return reads
    return 2 * reads + (cfg.n_layers - 1) * 4 * cfg.d_model * cfg.kv_heads * cfg.head_dim * seq_len


ATTENTION_CLASSES.update(moda=DepthKVAttention)  # Attention(cfg, ...) builds it for attention=moda
