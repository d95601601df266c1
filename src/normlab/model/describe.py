"""What `normlab show` prints and `build_model` logs: a model's resolved layout per layer, its init
scheme with the numbers at this size, and its parameter counts. No torch: the counts are analytic
(`params.analytic_params`, equal to the measured count for every preset, tests/unit/test_params.py), so
`show` answers in a fraction of a second, even for a 7B shape."""

from __future__ import annotations

from typing import Any

from normlab.layout import Layout, as_layout
from normlab.layout.sites import ResolvedLayout
from normlab.model.config import ModelConfig, get_size
from normlab.model.init_schemes import describe_init, resolve_init
from normlab.model.params import ParamCount, analytic_params


def model_report(cfg: ModelConfig, layout: Layout, resolved: ResolvedLayout, scheme: str, params: ParamCount) -> str:
    init_line = describe_init(scheme, cfg.d_model, cfg.n_layers, cfg.init_std)
    source = ", the layout's" if cfg.init == "auto" and layout.init else ""
    report = f"{resolved.table()}\n  init={scheme}{source}: {init_line}\n  {params}"
    if cfg.n_experts:
        report += (
            f"\n  feed-forward: MoE in layers 0-{cfg.n_layers - 1} ({cfg.n_experts} SwiGLU experts of width "
            f"{cfg.expert_ffn_dim}, top {cfg.moe_top_k} of softmax, "
            f"{'a shared expert, ' if cfg.moe_shared_expert else ''}"
            f"load-balancing {cfg.moe_aux_coef:g}, router z-loss {cfg.moe_z_coef:g}, no token dropping)"
        )
    if cfg.attention == "mla":
        d_c, d_cq, nope, rope, v = cfg.mla_dims
        report += (
            f"\n  attention: MLA (DeepSeek-V2), latent d_c {d_c}, query latent {d_cq or 'none'}, per head d_h {nope} + "
            f"RoPE d_h^R {rope}, value {v}, latent norms {'on' if cfg.mla_latent_norm else 'off'}"
        )
    elif cfg.attention == "moda":
        report += "\n  attention: MoDA (each query also reads the earlier layers' keys and values at its position" + (
            "; each FFN's input too, through W_K^F, W_V^F)" if cfg.moda_ffn_kv else ")"
        )
    elif cfg.attention == "depth_value":
        report += "\n  attention: Depth-Attention (each value first mixed over the earlier layers' values at its token)"
    if cfg.q_lr_mult != 1.0 or cfg.k_lr_mult != 1.0:
        report += f"\n  learning rate x {cfg.q_lr_mult:g} on the query projections, x {cfg.k_lr_mult:g} on the key ones"
    return report


def describe(layout: Layout | str, size: str | ModelConfig = "tiny", **overrides: Any) -> str:
    """The report `build_model(..., verbose=True)` prints, without building the model."""
    lay = as_layout(layout)
    cfg = (size if isinstance(size, ModelConfig) else get_size(size)).with_(**overrides)
    resolved = lay.resolve(cfg.n_layers)
    return model_report(cfg, lay, resolved, resolve_init(cfg, lay), analytic_params(cfg, resolved))
