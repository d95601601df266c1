"""`build_model`: layout + size + overrides -> an initialized `NormLM`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from normlab.layout import Layout, as_layout
from normlab.model.config import ModelConfig, get_size
from normlab.model.describe import model_report
from normlab.model.init import init_weights
from normlab.model.init_schemes import resolve_init
from normlab.model.lm import NormLM
from normlab.model.params import count_params

log = logging.getLogger("normlab")


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
    report = model_report(cfg, lay, resolved, scheme, count_params(model))
    log.info(report)
    if verbose:
        print(report)
    return model
