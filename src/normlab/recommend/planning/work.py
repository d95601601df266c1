"""The work a step and a screen do, counted from the shape and the layout's data (nothing is built or timed):
`normlab.recommend.planning.cost` multiplies these counts by this machine's calibrated rates.

- F: a training step's FLOPs, 6 N per token for the N weights in matrix products (attention's projections, the
  context gate's, the MLP or the experts a token uses and the router, the LM head) plus attention's 12 L H d_h T;
- E: the norm elements a step touches (every norm site's width over the layers);
- S: the stream elements every hyper-connection reads and writes (tokens x 2 L x n x d; 0 for one stream);
- B: one block's forward FLOPs on the screen's tokens;
- M: the FLOPs an optimizer step adds (Newton-Schulz over the matrices Muon takes; 0 for an elementwise step).
"""

from __future__ import annotations

from normlab.layout import Layout, as_layout
from normlab.model.config import ModelConfig
from normlab.model.params import gate_matrix_shapes

CAL_BATCH, CAL_SEQ = 16, 128  # the proxy runs' batch (RECOMMEND_BASE)
SCREEN_TOKENS, SCREEN_SEQ = 128, 64  # the screen's batch 2 x 64


def _matrix_weights(cfg: ModelConfig, layout: str | Layout) -> int:
    """N: the weights in matrix products per token (q, k, v, o, the gate's projection, the MLP or the k
    experts a token uses and the router, the LM head)."""
    d, hd, h, kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    resolved = as_layout(layout).resolve(cfg.n_layers)
    n_mats = 3 if cfg.mlp in ("swiglu", "geglu-tanh") else 2
    mlp = cfg.moe_top_k * cfg.expert_weights + d * cfg.n_experts if cfg.n_experts else n_mats * d * cfg.ffn_dim
    total = cfg.vocab_size * d
    for blk in resolved.blocks:
        total += d * h * hd + 2 * d * kv * hd + h * hd * d + mlp + (d * h * hd if blk.attn_inner.gate else 0)
    return total


def _norm_elements(cfg: ModelConfig, layout: str | Layout) -> int:
    """Norm elements per token: every norm site's width, over the layers."""
    lay = as_layout(layout)
    d, hd = cfg.d_model, cfg.head_dim
    total = d * (int(lay.embed_norm) + int(lay.final_norm))
    for blk in lay.resolve(cfg.n_layers).blocks:
        inner = blk.attn_inner
        total += d * (blk.attn.n_norms + blk.mlp.n_norms) + cfg.ffn_dim * int(blk.mlp.hidden)
        total += hd * (
            cfg.n_heads * (int(inner.q) + int(inner.context) + int(inner.gate))
            + cfg.kv_heads * (int(inner.k) + int(inner.v))
        )
    return total


def step_work(
    cfg: ModelConfig, layout: str | Layout, tokens: int = CAL_BATCH * CAL_SEQ, seq: int = CAL_SEQ
) -> tuple[float, float]:
    """(F, E) of one training step of `layout` at `cfg` on `tokens` tokens (module doc)."""
    layout = as_layout(layout)  # parsed once for both counts
    flops = 6 * _matrix_weights(cfg, layout) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq
    return float(tokens * flops), float(tokens * _norm_elements(cfg, layout))


def stream_work(cfg: ModelConfig, layout: str | Layout, tokens: int = CAL_BATCH * CAL_SEQ) -> tuple[str, float]:
    """(mix, S) of one training step (module doc): the stream elements every hyper-connection reads and writes,
    S = tokens x 2 L x n x d; ("", 0) for one stream."""
    lay = as_layout(layout)
    if lay.streams <= 1:
        return "", 0.0
    return lay.stream_mix, float(tokens * 2 * cfg.n_layers * lay.streams * cfg.d_model)


def block_work(cfg: ModelConfig) -> float:
    """B: one block's forward FLOPs on the screen's tokens."""
    per_layer = _matrix_weights(cfg.with_(n_layers=1), "pre") - cfg.vocab_size * cfg.d_model
    return float(SCREEN_TOKENS * (2 * per_layer + 4 * cfg.n_heads * cfg.head_dim * SCREEN_SEQ))


def muon_shapes(cfg: ModelConfig, layout: str | Layout) -> list[tuple[int, int]]:
    """The (out, in) shapes of the matrices Muon takes (`normlab.train.optim.muon_matrices`), counted from
    the shape and the layout's data: per block q, k, v, o, the gate's projection where the layout has one,
    and the MLP's matrices, or each expert's (and a shared expert's); routers stay with AdamW."""
    d, hd, h, kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    gated = cfg.mlp in ("swiglu", "geglu-tanh")
    out: list[tuple[int, int]] = []
    lay = as_layout(layout).resolve(cfg.n_layers)
    for blk in lay.blocks:
        out += [(h * hd, d), (kv * hd, d), (kv * hd, d), (d, h * hd)] + ([(h * hd, d)] if blk.attn_inner.gate else [])
        if cfg.n_experts:
            f = cfg.expert_ffn_dim
            out += cfg.n_experts * [(f, d), (f, d), (d, f)]
            out += [(f, d), (f, d), (d, f)] if cfg.moe_shared_expert else []
        else:
            out += [(cfg.ffn_dim, d)] * (2 if gated else 1) + [(d, cfg.ffn_dim)]
        out += gate_matrix_shapes(cfg, lay.layout, blk)  # GatedNorm's (normlab.model.params)
    return out


def optimizer_work(cfg: ModelConfig, layout: str | Layout, optimizer: str = "adamw", ns_steps: int = 5) -> float:
    """M: the FLOPs an optimizer step adds (module doc), by its step_flops fact (normlab.config.optimizers):
    Newton-Schulz iterations over the matrices it takes (Muon); 0 where its step is elementwise (AdamW, SGD)."""
    from normlab.config.optimizers import OPTIMIZERS

    if OPTIMIZERS[optimizer].step_flops != "newton_schulz":
        return 0.0
    from normlab.train.mfu import newton_schulz_flops

    return float(sum(newton_schulz_flops(s, ns_steps) for s in muon_shapes(cfg, layout)))
