"""Parameter counts, measured and analytic.

The papers report sizes without the vocabulary matrices (Kim Table 4: "excluding the embedding
parameters"); Zhuo's Table 6 sizes count the tied embedding once. `count_params` gives all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from normlab.layout.norm_kinds import NORM_FACTS
from normlab.layout.sites import ResolvedLayout
from normlab.model.config import ModelConfig

if TYPE_CHECKING:  # no torch at import: `normlab show` counts analytically
    from torch import nn


@dataclass(frozen=True)
class ParamCount:
    total: int  # unique parameters (a tied embedding counts once)
    embedding: int  # token embedding plus an untied LM head
    non_embedding: int
    active: int | None = None  # MoE: the parameters one token uses (k of E experts); None for dense models

    def __str__(self) -> str:
        text = f"{self.non_embedding / 1e6:.2f}M non-embedding, {self.total / 1e6:.2f}M total"
        return text + (f", {self.active / 1e6:.2f}M active" if self.active is not None else "")


def _inactive(cfg: ModelConfig) -> int:
    """Expert weights a token does not use, summed over the MoE layers (0 for a dense model)."""
    return cfg.n_layers * (cfg.n_experts - cfg.moe_top_k) * cfg.expert_weights if cfg.n_experts else 0


def count_params(model: nn.Module) -> ParamCount:
    seen = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    emb_ids = {id(cast("nn.Embedding", model.embed).weight), id(cast("nn.Linear", model.lm_head).weight)}
    pos_embed = getattr(model, "pos_embed", None)
    if pos_embed is not None:
        emb_ids.add(id(pos_embed.weight))
    embedding = sum(seen[i].numel() for i in emb_ids if i in seen)
    cfg = getattr(model, "config", None)
    active = total - _inactive(cfg) if cfg is not None and cfg.n_experts else None
    return ParamCount(total=total, embedding=embedding, non_embedding=total - embedding, active=active)


def analytic_params(cfg: ModelConfig, resolved: ResolvedLayout) -> ParamCount:
    """The same count from the configuration and the layout alone (no model built)."""
    d, hd, h, kv, ff = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim
    lay = resolved.layout

    def site(name: str, width: int) -> int:
        """Parameters of the norm at site ``name`` over ``width`` channels (normlab.model.norms)."""
        spec = lay.norm_at(name)
        # each parameter's size by the kind's facts (a centered gain is a weight too, 1 + w; a scalar gain one
        # number; without a per-channel gain torch's LayerNorm has no beta either)
        return NORM_FACTS[spec.kind].param_count(width, spec.gain, cfg.norm_bias, cfg.gated_norm_rank)

    b = 1 if cfg.linear_bias else 0
    qkv_b = 1 if (cfg.linear_bias or cfg.qkv_bias) else 0
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d + qkv_b * (h * hd + 2 * kv * hd) + b * d
    qk_width = v_width = hd  # the widths the per-head q/k and v/context norms act on
    if cfg.attention == "mla":
        attn, (_, _, nope, rope, v_width) = mla_attention_params(cfg), cfg.mla_dims
        qk_width = nope + rope
    ffn_kv = moda_ffn_kv_params(cfg)
    n_mats = 3 if cfg.mlp in ("swiglu", "geglu-tanh") else 2
    mlp = n_mats * d * ff + b * ((n_mats - 1) * ff + d)
    if cfg.n_experts:  # routed SwiGLU experts, the router, an optional shared expert (normlab.model.moe)
        per = cfg.expert_weights
        mlp = (
            cfg.n_experts * per
            + d * cfg.n_experts
            + (per + b * (2 * cfg.expert_ffn_dim + d) if cfg.moe_shared_expert else 0)
        )
    inner_dim = {"q": (h, "q"), "k": (kv, "k"), "v": (kv, "v"), "context": (h, "c")}
    per_block_scales = 2 * (1 if lay.h_learned == "scalar" else d) if lay.h_learned else 0
    per_block_scales += 2 * d if lay.alpha == "admin" else 0  # Admin's omega per sublayer and channel
    per_block_scales += 2 * (int(lay.skip_learned) + int(lay.gpas))  # a skip lambda, a GPAS a per sublayer
    n = lay.streams  # hyper-connections per sublayer (normlab.model.streams): HC's static A_m, A_r, B, dynamic
    if n > 1:  # W_m, W_r, W_b and s_a, s_b; mHC's phi (n d x (n^2 + 2n)), b and three gating factors
        per_block_scales += 2 * (
            d * (n + 2) + n * n + 2 * n + 2 if lay.stream_mix == "hc" else (n * d + 1) * (n * n + 2 * n) + 3
        )
    if lay.ngpt:  # a_A, a_M (d each), s_qk (heads x head_dim), s_u and s_v (ffn each); s_z below
        per_block_scales += 2 * d + h * hd + 2 * ff
    # Attention Residuals (normlab.model.depth_attention): per sublayer a pseudo-query w and its key RMSNorm's gain
    # (d each); the final read's two more below
    depth_reads = 2 * d if resolved.attn_res_size else 0
    per_block_scales += 2 * depth_reads
    # SiameseNorm (normlab.model.residual.SiamesePath): per sublayer the norms of its X and Y streams, of the layout's
    # kind and gain; two more read the streams before the final norm
    siamese_norm = NORM_FACTS[lay.norm].param_count(d, lay.gain, cfg.norm_bias, cfg.gated_norm_rank)
    siamese = siamese_norm if lay.residual.token == "siamese" else 0
    per_block_scales += 4 * siamese
    blocks = 0
    for blk in resolved.blocks:
        norms = 0
        for name, sites in (("attn", blk.attn), ("mlp", blk.mlp)):
            for letter, attr in (("A", "input"), ("B", "output"), ("C", "after_add")):
                norms += site(f"{name}.{letter}", d) if getattr(sites, attr) else 0
        norms += site("mlp.H", ff) if blk.mlp.hidden else 0
        for attr, (heads, name) in inner_dim.items():
            if getattr(blk.attn_inner, attr):
                width = qk_width if attr in ("q", "k") else v_width
                norms += site(name, width if lay.inner_span == "head" else heads * hd)
        extra = (d * h * hd + b * h * hd if blk.attn_inner.gate else 0) + (h if blk.attn_inner.head_scale else 0)
        extra += h if lay.softmax == "sink" else 0  # GPT-OSS's sink logit per query head
        blocks += attn + mlp + norms + extra + per_block_scales
    model_norms = (site("emb", d) if lay.embed_norm else 0) + (site("final", d) if lay.final_norm else 0)
    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    embedding += cfg.max_seq_len * d if cfg.position == "learned" else 0
    non_embedding = blocks + model_norms + (cfg.vocab_size if lay.ngpt else 0) + depth_reads + ffn_kv  # nGPT's s_z
    non_embedding += 2 * siamese
    total = non_embedding + embedding
    return ParamCount(
        total=total,
        embedding=embedding,
        non_embedding=non_embedding,
        active=total - _inactive(cfg) if cfg.n_experts else None,
    )


def mla_attention_params(cfg: ModelConfig, matrices_only: bool = False) -> int:
    """One MLA layer's attention parameters (normlab.model.mla; DeepSeek-V2 eqs. 9-19): W^DQ (or none), W^UQ, W^QR,
    W^DKV, W^UK, W^UV, W^KR, W^O, the latents' RMSNorm gains and the projections' biases; the q/k/v/context site
    norms are counted with the layout's sites. ``matrices_only``: the weight matrices alone."""
    d, h = cfg.d_model, cfg.n_heads
    d_c, d_cq, nope, rope, v = cfg.mla_dims
    q_in = d if d_cq is None else d_cq
    mats = (d * d_cq if d_cq else 0) + q_in * h * (nope + rope) + d * d_c + d_c * h * (nope + v) + d * rope
    mats += h * v * d
    if matrices_only:
        return mats
    latent = (d_c + (d_cq or 0)) if cfg.mla_latent_norm else 0
    qkv_b = 1 if (cfg.linear_bias or cfg.qkv_bias) else 0
    return mats + latent + qkv_b * h * (2 * nope + v) + (d if cfg.linear_bias else 0)


def moda_ffn_kv_params(cfg: ModelConfig) -> int:
    """MoDA's FFN depth projections W_K^F, W_V^F (d x kv_heads head_dim each) in every layer but the last
    (normlab.model.moda; ``moda_ffn_kv``); 0 otherwise."""
    if cfg.attention != "moda" or not cfg.moda_ffn_kv:
        return 0
    return (cfg.n_layers - 1) * 2 * cfg.d_model * cfg.kv_heads * cfg.head_dim


def analytic_matrices(cfg: ModelConfig, resolved: ResolvedLayout) -> int:
    """The blocks' matrix weights, from the configuration: attention's q/k/v/o (and gate), the MLP's or the
    experts' (and a shared expert's) matrices, the block norms' own (GatedNorm's gates), routers excluded: what Muon
    optimizes
    (`normlab.train.optim.muon_matrices` measures the same)."""
    d, hd, h, kv, ff = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim
    attn = mla_attention_params(cfg, matrices_only=True) if cfg.attention == "mla" else 2 * d * h * hd + 2 * d * kv * hd
    n_mats = 3 if cfg.mlp in ("swiglu", "geglu-tanh") else 2
    mlp = n_mats * d * ff
    if cfg.n_experts:
        mlp = cfg.n_experts * cfg.expert_weights + (cfg.expert_weights if cfg.moe_shared_expert else 0)
    gates = sum(d * h * hd for blk in resolved.blocks if blk.attn_inner.gate)
    norm_gates = sum(r * w for blk in resolved.blocks for r, w in gate_matrix_shapes(cfg, resolved.layout, blk))
    return cfg.n_layers * (attn + mlp) + gates + norm_gates + moda_ffn_kv_params(cfg)


def gate_matrix_shapes(cfg: ModelConfig, lay: Any, blk: Any) -> list[tuple[int, int]]:
    """A block's norms' own matrices (a kind with a "gate" parameter: GatedNorm's (r, w) and (w, r), r the rank as set,
    marin's at every width) at each norm site the block turns on, w the site's width (normlab.model.norms.GatedNorm)."""
    d, hd = cfg.d_model, cfg.head_dim
    full = lay.inner_span == "full"
    inner = {"q": cfg.n_heads, "k": cfg.kv_heads, "v": cfg.kv_heads, "c": cfg.n_heads}
    sites = [
        (f"{sub}.{x}", d)
        for sub, ss in (("attn", blk.attn), ("mlp", blk.mlp))
        for x, on in (("A", ss.input), ("B", ss.output), ("C", ss.after_add))
        if on
    ]
    sites += [("mlp.H", cfg.ffn_dim)] if blk.mlp.hidden else []
    ins = blk.attn_inner
    sites += [(k, hd * n if full else hd) for k, n in inner.items() if getattr(ins, "context" if k == "c" else k)]
    kinds = [(lay.norm_at(site).kind, w) for site, w in sites]
    if lay.residual.token == "siamese":  # SiameseNorm's X and Y stream norms of both sublayers (residual.SiamesePath)
        kinds += [(lay.norm, d)] * 4
    out: list[tuple[int, int]] = []
    for kind, w in kinds:
        if any(size == "gate" for _, size in NORM_FACTS[kind].params):
            r = cfg.gated_norm_rank
            out += [(r, w), (w, r)]
    return out
