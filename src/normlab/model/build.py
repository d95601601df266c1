"""`build_model`: layout + size + overrides -> an initialized `NormLM`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from normlab.layout import Layout, as_layout
from normlab.model.config import ModelConfig, get_size
from normlab.model.init import check_scheme, describe_init, init_weights
from normlab.model.lm import NormLM
from normlab.model.params import count_params

log = logging.getLogger("normlab")


def resolve_init(cfg: ModelConfig, layout: Layout) -> str:
    """``init="auto"`` takes the layout's prescribed scheme (DeepNorm's, HybridNorm's), else "normal"."""
    return check_scheme(layout.init or "normal") if cfg.init == "auto" else check_scheme(cfg.init)


def build_model(
    layout: Layout | str,
    size: str | ModelConfig = "tiny",
    *,
    seed: int | None = None,
    verbose: bool = False,
    **overrides: Any,
) -> NormLM:
    """Build a language model with the given normalization layout.

    layout: a `Layout`, a preset name (`normlab.layouts()`), or a string form such as
        ``"attn=AB,mlp=AB,final"`` or ``"peri,h=0.5"``.
    size: a size preset name (`normlab.model.config.SIZES`) or a `ModelConfig`.
    seed: seeds torch before initialization, for reproducible weights.
    verbose: print the resolved per-layer layout (it is always logged at INFO on "normlab").
    overrides: `ModelConfig` fields, e.g. ``n_layers=12, mlp="relu", init="xavier"``.
    """
    lay = as_layout(layout)
    cfg = (size if isinstance(size, ModelConfig) else get_size(size)).with_(**overrides)
    resolved = lay.resolve(cfg.n_layers)
    scheme = resolve_init(cfg, lay)
    if seed is not None:
        torch.manual_seed(seed)
    model = NormLM(cfg, resolved)
    init_weights(model, scheme)
    model.init_scheme = scheme
    init_line = describe_init(scheme, cfg.d_model, cfg.n_layers, cfg.init_std)
    source = ", the layout's" if cfg.init == "auto" and lay.init else ""
    report = f"{resolved.table()}\n  init={scheme}{source}: {init_line}\n  {count_params(model)}"
    if cfg.n_experts:
        report += (f"\n  feed-forward: MoE in layers 0-{cfg.n_layers - 1} ({cfg.n_experts} SwiGLU experts of width "
                   f"{cfg.expert_ffn_dim}, top {cfg.moe_top_k} of softmax, {'a shared expert, ' if cfg.moe_shared_expert else ''}"
                   f"load-balancing {cfg.moe_aux_coef:g}, router z-loss {cfg.moe_z_coef:g}, no token dropping)")
    log.info(report)
    if verbose:
        print(report)
    return model
