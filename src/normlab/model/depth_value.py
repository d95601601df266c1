"""Depth-Attention: cross-layer value mixing (Zeng et al. 2026, arXiv 2606.05014), ``attention=depth_value``.

Only the paper's abstract could be read here (no equations, no authors' code found); it says: "before a layer
attends over the sequence, its query attends over the keys of earlier layers at the same token position and mixes
their values into the value that self-attention then reads. Because Depth-Attention reuses the standard attention
queries, keys, and value-cache slots, storing depth-mixed values in place of the original values, it adds no
parameters and introduces no persistent inference state beyond the standard key-value cache". normlab computes,
for layer l (0-based), key-value head g and position t::

    a_{l,j,t} = softmax_{j in 0..l} ( q^g_{l,t} . k_{j,t} * s )                         (depth weights)
    v~_{l,t}  = sum_{j=0}^{l} a_{l,j,t} v~_{j,t},   with v~_{l,t} on the right = v_{l,t}   (depth-mixed value)
    o_{l,t}   = Attn(q_l, K_l, V~_l)_t: the layer's own attention with v~ in place of v    (sequence attention)

Each reading the abstract leaves open, and the choice made:

- **The layer itself is a depth entry** (j = l, its own k_{l,t} and v_{l,t}): without it layer l's own value would
  never be read (W_V of every layer but the first would get no gradient). Layer 0 mixes one entry: plain attention.
- **Earlier layers' values are their stored, depth-mixed v~_{j,t}**: the cache holds v~ in place of v, and that is
  all a later layer can read at inference without more state ("storing depth-mixed values in place of the original
  values"). The keys are the earlier layers' keys k_{j,t} as their caches hold them.
- **One query per key-value head**: q^g is the mean of the group's query heads (GQA; with n_kv_heads = n_heads, the
  head's own query). The mixed value fills one value-cache slot per key-value head, so it cannot depend on the query
  head; the group's mean query gives the group's mean logit (logits are linear in q), the same cache size as GQA's.
- **Scale s**: the layer's own attention scale (1/sqrt(d_head) unless muP's 1/d_head or Gemma's attn_scale), the
  plain softmax over the l + 1 entries, computed in at least float32.
- **RoPE**: keys and the query after the layer's norms and RoPE, as the cache holds them. At one position t both
  are rotated by the same orthogonal R_t, so (R_t q) . (R_t k) = q . k: the depth logits are those of the unrotated
  q and k (tests/unit/test_depth_value.py checks it), unless two layers use different RoPE bases (rope_local_theta
  on windowed layers), where the cached keys are used as they are.

Cost per layer l >= 1 and token, beyond MHA (layer 0 mixes nothing): l + 1 depth logits and l + 1 value terms per
key-value head, 2 (2 (l + 1)) H_k d FLOPs, and (H - H_k) d for the group's mean query (`depth_value_flops`; under
0.01% of a large model's, as the abstract says); no parameters; the cache keeps its size. The keys and mixed values
of the new tokens are shared through one `normlab.model.moda.DepthKV` per model (`link_values`; here (k, v~) per
earlier layer), emptied by layer 0 on each forward and after the last layer reads it, so the layers' mixes are causal
along the sequence (each reads position t only) and work with the KV cache, chunked prefill and left padding. Its
sequence attention is the layer's own (any softmax kind the layout names).
"""

from __future__ import annotations

import torch
from torch import nn

from normlab.layout.sites import AttentionInnerSites, Layout
from normlab.model.attention import ATTENTION_CLASSES, Attention
from normlab.model.config import ModelConfig
from normlab.model.moda import DepthKV, share_depth


def depth_value_mix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, earlier: list[tuple[torch.Tensor, torch.Tensor]], scale: float
) -> torch.Tensor:
    """v~ (B, Hkv, T, d): at each position, a softmax over the earlier layers' keys and this layer's own key
    (``earlier``: (k_j, v~_j), each (B, Hkv, T, d); k, v this layer's) of the group-mean query (q: (B, H, T, d)),
    times the matching values (the module docstring's equation)."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, t, d).mean(dim=2)  # query head h reads key-value head h // (H / Hkv)
    keys = torch.stack([kj for kj, _ in earlier] + [k], dim=-2)  # (B, Hkv, T, l + 1, d)
    vals = torch.stack([vj for _, vj in earlier] + [v], dim=-2)
    logits = (qg.unsqueeze(-2) @ keys.transpose(-2, -1)).squeeze(-2) * scale  # (B, Hkv, T, l + 1)
    wide = torch.promote_types(q.dtype, torch.float32)  # at least float32 (bf16/fp16 runs), float64 kept
    w = torch.softmax(logits.to(wide), dim=-1).to(v.dtype)
    return (w.unsqueeze(-2) @ vals).squeeze(-2)


class DepthValueAttention(Attention):
    """Depth-Attention (module docstring): `Attention` whose value is first mixed with the earlier layers' stored
    values at the same position; the mixed value is what the sequence attention and the KV cache get."""

    def __init__(self, cfg: ModelConfig, inner: AttentionInnerSites, layout: Layout, layer_idx: int = 0) -> None:
        super().__init__(cfg, inner, layout, layer_idx)
        self.last_layer = layer_idx == cfg.n_layers - 1
        self.depth = DepthKV()  # the keys and mixed values so far; replaced by the model's shared one (link_values)

    def _attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: object) -> torch.Tensor:
        if self.layer_idx == 0:
            self.depth.entries = []
        earlier = list(self.depth.entries)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        mixed = self.store(depth_value_mix(q, k, v, earlier, scale)) if earlier else v
        self.depth.entries.append((k, mixed))  # the new tokens' keys and mixed values, before any cache
        try:
            return super()._attend(x, q, k, mixed, dec)  # type: ignore[arg-type]
        finally:
            if self.last_layer:
                self.depth.entries = []


def link_values(blocks: nn.ModuleList) -> None:
    """Give every Depth-Attention layer of ``blocks`` one shared store of (k, v~) (a no-op for other kinds)."""
    share_depth(blocks, DepthValueAttention)


def depth_value_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Depth-Attention's forward FLOPs per sequence beyond MHA's: at layer l, each of T positions and H_k key-value
    heads takes l + 1 depth logits and l + 1 value terms, 2 d each (l = 0 mixes nothing: 0); the group-mean query,
    (H - H_k) d adds per position: sum_{l >= 1} (4 (l + 1) H_k d + (H - H_k) d) T. 0 for other attention kinds."""
    if cfg.attention != "depth_value":
        return 0
    hk, d = cfg.kv_heads, cfg.head_dim
    return sum(4 * (layer + 1) * hk * d + (cfg.n_heads - hk) * d for layer in range(1, cfg.n_layers)) * seq_len


ATTENTION_CLASSES.update(depth_value=DepthValueAttention)  # Attention(cfg, ...) builds it for attention=depth_value
