"""Causal multi-head attention with grouped-query option, RoPE, and Zhuo et al.'s inner norms.

    attn_#(Q, K, V) = N_c( softmax( N_q(Q) N_k(K)^T / sqrt(d_k) ) N_v(V) )     Zhuo eqs. 7, 35-39

Each N_* is on or off per the layout (`AttentionInnerSites`). With ``span="head"`` the norms act
on each head's d_k features (Zhuo Alg. 1, Gemma 3, Wortsman et al.'s QK-norm); with ``span="full"``
on all heads together before the split (OLMo 2). Q/K norms act before RoPE, as in OLMo 2 and Gemma 3,
or after it with ``qk-rope`` (Llama 4). The context can also be gated from the sublayer's input (Qiu et
al. 2025) and scaled per head (NormFormer); see `AttentionInnerSites` for the order. A layer with a
sliding window (`ModelConfig.sliding_window`, Mistral; Gemma 3 / OLMo 3 on their local layers) masks
keys older than the window once the keys outnumber it.
The products go through `scaled_dot_product_attention` (flash / memory-efficient kernels).

The layout's ``softmax`` decides how logits l_ij = s q_i . k_j become weights (`attention_weights`):

    softmax      exp(l_ij) / sum_j exp(l_ij)
    sink         exp(l_ij) / (exp(a_h) + sum_j exp(l_ij)),  a_h learned per head, from 0   (GPT-OSS, 2025)
    off-by-one   exp(l_ij) / (1 + sum_j exp(l_ij))          (a sink fixed at 0: Evan Miller's softmax_1, 2023)
    softpick     ReLU(exp(l_ij) - 1) / (sum_j |exp(l_ij) - 1| + eps)   (Zuhri et al. 2025, arXiv 2504.20966)

With a sink, a query may give attention to nothing: the weights sum to 1 - p_sink. SDPA has no sink or
softpick, so these (like Gemma 2's soft-capping) are written out: the (B, H, T, N) logits exist in memory, as in
SDPA's unfused math kernel, instead of the flash kernel's O(T) per head; a sink is one more logit column, the
softmax then drops it (transformers' GPT-OSS eager attention).
Softpick follows its authors' stable form (zaydzuhri/softpick-attention): with m the row max over visible keys
(here at least 0, so e^(-m) cannot overflow), ReLU(e^(l-m) - e^(-m)) / (sum_visible |e^(l-m) - e^(-m)| + eps),
eps = 1e-8 as theirs; masked keys count in neither sum.
Generation and padded batches pass a `Decoding` (positions, mask, KV cache; `normlab.model.decoding`).

``ModelConfig.attention`` picks the kind `Attention(cfg, ...)` builds: this class (mha), DeepSeek-V2's multi-head
latent attention (mla, `normlab.model.mla`: q, k, v from low-rank latents with a decoupled RoPE part; it overrides
`_project`) or mixture-of-depths attention (moda, `normlab.model.moda`: the softmax also over the earlier layers'
keys and values at the query's position; it overrides `_mix`). The rest (cache, masks, gate, context norm, W_O)
is `_attend`, shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normlab.errors import ConfigError
from normlab.layout.sites import AttentionInnerSites, Layout
from normlab.model.config import ModelConfig
from normlab.model.decoding import Decoding
from normlab.model.norms import Tap, site_norm
from normlab.model.rope import Rotary
from normlab.model.sphere import base_scale, rescaled
from normlab.model.storage import NO_STORAGE, Storage


def expand_kv_heads(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether grouped-query attention should repeat its KV heads before SDPA instead of passing
    ``enable_gqa``: on CUDA only the flash kernel takes ``enable_gqa``, and flash runs neither float32 nor
    an explicit mask, so either would drop SDPA to its unfused math kernel (the whole T x T score matrix
    in memory); with the heads repeated the memory-efficient kernel runs. Elsewhere (CPU) ``enable_gqa``
    costs nothing."""
    return q.is_cuda and (q.dtype == torch.float32 or mask is not None)


_ID = nn.Identity()
SOFTPICK_EPS = 1e-8  # the authors' code (zaydzuhri/softpick-attention)


def attention_weights(
    scores: torch.Tensor, visible: torch.Tensor, kind: str, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """The weights of the logits ``scores`` (B, H, T, N) over the ``visible`` keys (bool, broadcast), computed
    in float32 (see the module docstring): softmax, a sink logit per head (``sinks`` (H,); off-by-one: 0), or
    softpick."""
    x = scores.float().masked_fill(~visible, float("-inf"))
    if kind == "softpick":
        # m >= 0 keeps e^(-m) <= 1 (a row of negative logits: m = 0, the formula as written)
        m = x.amax(dim=-1, keepdim=True).clamp_min(0.0)
        e = (torch.exp(x - m) - torch.exp(-m)).masked_fill(~visible, 0.0)
        return torch.relu(e) / (e.abs().sum(dim=-1, keepdim=True) + SOFTPICK_EPS)
    if kind in ("sink", "off-by-one"):
        b, h, t, _ = x.shape
        sink = (sinks.float() if sinks is not None else x.new_zeros(h)).view(1, h, 1, 1).expand(b, h, t, 1)
        return torch.softmax(torch.cat([x, sink], dim=-1), dim=-1)[..., :-1]  # the sink's column dropped
    return torch.softmax(x, dim=-1)


def window_mask(t: int, n: int, window: int, device: torch.device) -> torch.Tensor:
    """(1, 1, t, n) bool: the last ``t`` of ``n`` positions as queries, True where key j is visible to query
    i: i - window < j <= i (causal, the last ``window`` keys, itself included; transformers' sliding window)."""
    query = torch.arange(n - t, n, device=device)[:, None]
    key = torch.arange(n, device=device)[None, :]
    return ((key <= query) & (key > query - window))[None, None]


class Attention(nn.Module):
    """Multi-head attention; ``Attention(cfg, ...)`` builds the kind ``cfg.attention`` names: this class (mha),
    `normlab.model.mla.LatentAttention` (mla) or `normlab.model.moda.DepthKVAttention` (moda), both subclasses that
    keep the projections' and taps' names and override `_project` (q, k, v) or `_mix` (the softmax over keys); each
    registers itself in `ATTENTION_CLASSES` when its module is imported."""

    store: Storage = NO_STORAGE  # the activation dtype of q, k, v and the context (normlab.model.storage)

    def __new__(cls, cfg: ModelConfig | None = None, *args: object, **kwargs: object) -> Attention:
        # no cfg: copy.deepcopy and pickle make the instance first and fill its state after
        if cls is Attention and cfg is not None and cfg.attention != "mha":
            if cfg.attention not in ATTENTION_CLASSES:
                raise ConfigError(
                    f"attention={cfg.attention}: its class registers when normlab.model.{cfg.attention} is imported "
                    "(normlab.model.lm imports every kind)"
                )
            cls = ATTENTION_CLASSES[cfg.attention]
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig, inner: AttentionInnerSites, layout: Layout, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # this layer's slot in a KV cache
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.span = span = layout.inner_span
        self.qk_after_rope = layout.qk_after_rope
        d, hd, bias = cfg.d_model, cfg.head_dim, cfg.linear_bias
        qkv_bias = bias or cfg.qkv_bias  # Qwen 2: biases on q, k, v and not on W_O
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)

        def dim(heads: int) -> int:
            return hd if span == "head" else heads * hd

        self.q_norm = site_norm(inner.q, layout.norm_at("q"), dim(self.n_heads), cfg)
        self.k_norm = site_norm(inner.k, layout.norm_at("k"), dim(self.n_kv_heads), cfg)
        self.v_norm = site_norm(inner.v, layout.norm_at("v"), dim(self.n_kv_heads), cfg)
        self.context_norm = site_norm(inner.context, layout.norm_at("c"), dim(self.n_heads), cfg)
        # gated attention (Qiu et al. 2025 eq. 5, G1, elementwise): Y * sigmoid(X W_theta), X the sublayer's input
        self.gate_proj = nn.Linear(d, self.n_heads * hd, bias=bias) if inner.gate else None
        # NormFormer's HeadScale (Shleifer et al. 2021 eq. 3): head i's context times a learned gamma_i from 1
        self.head_scale = nn.Parameter(torch.ones(self.n_heads)) if inner.head_scale else None
        self.gate = Tap()  # the gate's scores sigmoid(X W_theta) (Qiu et al. report them sparse: mean ~0.1)
        # learned absolute positions (GPT-2) are added to the embedding instead: no rotation here
        self.rotary = Rotary(hd, cfg.max_seq_len, cfg.rope_theta_of(layer_idx)) if cfg.position == "rope" else None
        # Capture points: q, k, v as they enter attention, (B, heads, T, head_dim), q and k after
        # their norms and RoPE; the context after its norm, (B, T, n_heads * head_dim).
        self.q, self.k, self.v, self.context = Tap(), Tap(), Tap(), Tap()
        # None: SDPA's 1/sqrt(head_dim); Gemma 2's attn_scale^-1/2; muP's 1/d_head law (normlab.model.parametrization)
        self.scale = cfg.attention_scale(hd)
        self.window = cfg.window_of(layer_idx)  # sliding-window attention on this layer (None: full)
        self.softcap = cfg.attn_softcap
        self.softmax = layout.softmax
        # nGPT's s_qk per head and channel (stored at 1/sqrt(d): normlab.model.sphere) on the unit q and k, and the
        # softmax scale sqrt(d_k): q.k is a cosine, scaled up (Loshchilov et al. 2024 eqs. 15-16)
        self.sqk = nn.Parameter(torch.full((self.n_heads * hd,), base_scale(d))) if layout.ngpt else None
        if layout.ngpt:
            self.scale = hd**0.5
        # GPT-OSS's learned sink logit per query head (from 0: the off-by-one softmax at init)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if layout.softmax == "sink" else None

    def _heads(self, x: torch.Tensor, heads: int, norm: nn.Module) -> torch.Tensor:
        b, t, _ = x.shape
        if self.span == "full":
            x = norm(x)
        x = x.view(b, t, heads, self.head_dim)
        if self.span == "head":
            x = norm(x)
        return x.transpose(1, 2)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return x if self.rotary is None else self.rotary(x, positions)

    def _written_out(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention with its logits in memory, for what SDPA cannot compute: Gemma 2's soft-capping
        c tanh(q k^T s / c), sinks and softpick (`attention_weights`); causal or the given mask."""
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (self.scale if self.scale is not None else self.head_dim**-0.5)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if mask is None:  # queries are the last t of the keys
            t, n = q.shape[-2], k.shape[-2]
            mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
        return attention_weights(scores, mask, self.softmax, self.sinks).to(q.dtype) @ v

    def forward(self, x: torch.Tensor, dec: Decoding | None = None) -> torch.Tensor:
        q, k, v = self._project(x, dec.positions if dec is not None else None)
        return self._attend(x, q, k, v, dec)

    def _project(self, x: torch.Tensor, pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, heads, T, head_dim), after their norms and RoPE (the taps q, k, v see them)."""
        store = self.store
        if self.qk_after_rope:  # Llama 4: RoPE first, then each head's q and k normalized
            q = store(self.q_norm(self._rotate(self._heads(self.q_proj(x), self.n_heads, _ID), pos)))
            k = store(self.k_norm(self._rotate(self._heads(self.k_proj(x), self.n_kv_heads, _ID), pos)))
            if self.sqk is not None:  # nGPT: s_qk Norm(q), s_qk Norm(k) (n_kv_heads = n_heads: the layout checks)
                sqk = rescaled(self.sqk, self.q_proj.in_features).to(q.dtype).view(1, self.n_heads, 1, self.head_dim)
                q, k = store(sqk * q), store(sqk * k)
            q, k = self.q(q), self.k(k)
        else:
            q = self.q(store(self._rotate(self._heads(self.q_proj(x), self.n_heads, self.q_norm), pos)))
            k = self.k(store(self._rotate(self._heads(self.k_proj(x), self.n_kv_heads, self.k_norm), pos)))
        v = self.v(store(self._heads(self.v_proj(x), self.n_kv_heads, self.v_norm)))
        return q, k, v

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The heads' contexts (B, heads, T, v's head_dim): softmax(q k^T s + mask) v over the keys."""
        t = q.shape[-2]
        if self.softcap is None and self.softmax == "softmax":
            # no mask: causal over the new tokens when nothing is cached, else one query that sees every key
            causal = mask is None and k.shape[-2] == t
            gqa = self.n_kv_heads != self.n_heads
            if gqa and expand_kv_heads(q, mask):
                rep = self.n_heads // self.n_kv_heads
                k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )
        return self._written_out(q, k, v, mask)

    def _attend(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: Decoding | None
    ) -> torch.Tensor:
        """The sublayer's output from q, k, v of the new tokens: the cache, the masks, the heads' mix, then the
        gate, context norm, head scales and W_O."""
        b, t, _ = x.shape
        store = self.store
        mask = None
        if dec is not None:
            if dec.cache is not None:
                k, v = dec.cache.update(k, v, self.layer_idx)
            mask = dec.mask
        if self.window is not None and k.shape[-2] > self.window:  # shorter: the window hides nothing
            band = window_mask(t, k.shape[-2], self.window, q.device)
            mask = band if mask is None else mask & band
        y = self._mix(q, k, v, mask).transpose(1, 2)  # (B, T, heads, head_dim)
        if self.gate_proj is not None:
            y = store(y * self.gate(torch.sigmoid(self.gate_proj(x))).view(b, t, self.n_heads, self.head_dim))
        if self.span == "head":
            y = self.context_norm(y)
        y = y.reshape(b, t, -1)
        if self.span == "full":
            y = self.context_norm(y)
        if self.head_scale is not None:
            y = store(
                (y.view(b, t, self.n_heads, self.head_dim) * self.head_scale.to(y.dtype)[:, None]).reshape(b, t, -1)
            )
        return self.o_proj(self.context(store(y)))


# ModelConfig.attention -> the class `Attention(cfg, ...)` builds; normlab.model.mla and normlab.model.moda add theirs
ATTENTION_CLASSES: dict[str, type[Attention]] = {"mha": Attention}
