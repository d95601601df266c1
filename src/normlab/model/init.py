"""Weight initialization schemes from the papers.

| scheme        | weights of every linear layer (and the embedding)            | source                |
|---------------|---------------------------------------------------------------|-----------------------|
| normal        | N(0, init_std^2), init_std = 0.02                             | Kim Table 2           |
| xavier        | Glorot normal, var 2 / (fan_in + fan_out); embedding N(0, 0.02^2) | Kim Table 8       |
| he            | N(0, 2/d)                                                     | Kim Table 9           |
| lecun         | N(0, 1/d)                                                     | Kim Table 9           |
| 10/d          | N(0, 10/d)                                                    | Kim Table 9           |
| 1/10d         | N(0, 1/(10 d))                                                | Kim Table 9           |
| trunc-normal  | N(0, 1/(2.5 d)) truncated at 3 std                            | Zhuo Sec. 4.4 "Normal"|
| depth-scaled  | trunc-normal; o_proj, down_proj of layer l (1-based) / sqrt(2 l) | Zhuo Sec. 4.4      |
| megatron      | trunc-normal; o_proj, down_proj / sqrt(2 L)                   | Zhuo Sec. 4.4, Table 7|
| deepnorm      | Xavier normal, gain beta = (8N)^(-1/4) on v_proj, o_proj and the MLP, 1 on q, k | Wang et al. 2022 |
| spannorm      | normal; o_proj, down_proj / sqrt(L) (SpanNorm's scale, as adapted) | Wang et al. 2026 |

d is d_model. Norm gammas start at 1 and betas and biases at 0 under every scheme; learned residual
steps at the layout's h, head scales at 1, Admin's omegas at their profiled values, and Attention Residuals'
pseudo-queries at 0 (Kimi Team 2026 Sec. 5: "all pseudo-query vectors must be initialized to zero"). MoE experts are
initialized as the dense MLP's matrices, each expert on its own (its down projection as down_proj);
the router as any linear layer.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from normlab.layout.sites import deepnorm_beta
from normlab.model.admin import profile_admin
from normlab.model.block import Block
from normlab.model.config import ModelConfig
from normlab.model.init_schemes import _DEEPNORM_SCALED, _TRUNCATED, _XAVIER, base_std, check_scheme, linear_std
from normlab.model.lm import NormLM
from normlab.model.mlp import MLP
from normlab.model.norms import is_norm
from normlab.model.parametrization import base_model, param_scales
from normlab.model.sphere import base_scale, project


def _normal(w: torch.Tensor, std: float, truncated: bool) -> None:
    if truncated:
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
    else:
        nn.init.normal_(w, mean=0.0, std=std)


@torch.no_grad()
def init_weights(model: NormLM, scheme: str) -> None:
    """Initialize a `NormLM` in place with one of `INIT_SCHEMES`."""
    check_scheme(scheme)
    cfg = model.config
    d, n_layers = cfg.d_model, cfg.n_layers
    truncated = scheme in _TRUNCATED
    std0 = base_std(scheme, d, cfg.init_std)
    _normal(model.embed.weight, std0, truncated)
    if model.pos_embed is not None:
        _normal(model.pos_embed.weight, std0, truncated)
    if not cfg.tie_embeddings:
        if scheme in _XAVIER:
            nn.init.xavier_normal_(model.lm_head.weight)
        else:
            _normal(model.lm_head.weight, std0, truncated)
    beta = deepnorm_beta(n_layers)
    for layer, block in enumerate(model.blocks):
        for path, module in block.named_modules():
            if isinstance(module, nn.Linear):
                if scheme in _XAVIER:
                    gain = beta if scheme == "deepnorm" and path in _DEEPNORM_SCALED else 1.0
                    nn.init.xavier_normal_(module.weight, gain=gain)
                else:
                    _normal(module.weight, linear_std(scheme, path, layer, n_layers, d, cfg.init_std), truncated)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        experts = getattr(block.mlp, "experts", None)  # MoE: each expert as the dense MLP's matrices
        if experts is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                w = getattr(experts, name)
                for e in range(w.shape[0]):
                    if scheme in _XAVIER:
                        gain = beta if scheme == "deepnorm" else 1.0
                        nn.init.xavier_normal_(w[e], gain=gain)
                    else:
                        _normal(w[e], linear_std(scheme, f"mlp.{name}", layer, n_layers, d, cfg.init_std), truncated)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if is_norm(module) and reset is not None:
            reset()
    blocks = cast("list[Block]", list(model.blocks))
    for block in blocks:  # learned steps and scales back to their starts
        for name in ("attn_h", "mlp_h"):
            p = getattr(block, name, None)
            if p is not None:
                p.fill_(float(model.layout.h))
        for name, start in (("attn_skip", 1.0), ("mlp_skip", 1.0), ("attn_gpas", 0.0), ("mlp_gpas", 0.0)):
            p = getattr(block, name, None)
            if p is not None:
                p.fill_(start)
        for hc in (block.attn_hc, block.mlp_hc):  # hyper-connections: their papers' starts (normlab.model.streams)
            if hc is not None:
                hc.reset_parameters(cfg.init_std)
        head_scale = getattr(block.attn, "head_scale", None)
        if head_scale is not None:
            head_scale.fill_(1.0)
        for depth in (block.attn_depth, block.mlp_depth):  # Attention Residuals: w from 0, uniform weights at init
            if depth is not None:
                depth.reset_parameters()
    if model.final_depth is not None:
        model.final_depth.reset_parameters()
    if model.layout.ngpt:  # nGPT: every weight row on the unit sphere from the start (normlab.model.sphere)
        for name in ("attn_eigen", "mlp_eigen"):
            for block in blocks:
                getattr(block, name).fill_(base_scale(d))
        for block in blocks:
            assert block.attn.sqk is not None and isinstance(block.mlp, MLP) and block.mlp.suv is not None  # nGPT
            block.attn.sqk.fill_(base_scale(d))
            block.mlp.suv.fill_(1.0)
        assert model.sz is not None
        model.sz.fill_(base_scale(d))
        project(model)
    if cfg.parametrization != "sp":
        apply_parametrization(model, scheme)
    profile_admin(model)  # Admin's omegas, from a forward with the weights just drawn (normlab.model.admin)


def _sp_std(scheme: str, name: str, shape: tuple[int, ...], cfg: ModelConfig, vocab: int) -> float | None:
    """The std SP draws parameter ``name`` of ``shape`` with in a model of ``cfg``'s width and depth; None for
    what no scheme draws (norm gains, scales, hyper-connections' maps: their starts do not depend on width)."""
    d, n_layers = cfg.d_model, cfg.n_layers
    if name in ("embed.weight", "pos_embed.weight"):
        return base_std(scheme, d, cfg.init_std)
    if name == "lm_head.weight":
        if scheme in _XAVIER:
            return math.sqrt(2.0 / (vocab + d))
        return base_std(scheme, d, cfg.init_std)
    parts = name.split(".")
    if parts[0] != "blocks" or len(shape) < 2 or parts[-1] != "weight" and "experts" not in parts:
        return None
    layer, path = int(parts[1]), ".".join(parts[2:]).removesuffix(".weight")
    if "_hc" in path:  # hyper-connections' own starts
        return None
    if scheme in _XAVIER:
        fan_in, fan_out = (shape[-2], shape[-1]) if "experts" in parts else (shape[-1], shape[-2])
        gain = deepnorm_beta(n_layers) if scheme == "deepnorm" and path in _DEEPNORM_SCALED else 1.0
        return gain * math.sqrt(2.0 / (fan_in + fan_out))
    return linear_std(scheme, path, layer, n_layers, d, cfg.init_std)


@torch.no_grad()
def apply_parametrization(model: NormLM, scheme: str) -> None:
    """muP / CompleteP init (normlab.model.parametrization): each weight SP drew is rescaled to the std SP draws at
    the base shape (the base width; under CompleteP also the base depth, so init does not depend on depth), and
    matrix-like weights further by 1 / sqrt(fan-in width multiplier), as `mup.init.normal_` with the base's std."""
    cfg = model.config
    base = cfg.base_config()
    if cfg.parametrization == "completep" and cfg.base_n_layers is not None:
        base = base.with_(n_layers=cfg.base_n_layers)
    base_params = {name: tuple(q.shape) for name, q in base_model(model).named_parameters()}
    scales = param_scales(model)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        actual = _sp_std(scheme, name, tuple(p.shape), cfg, cfg.vocab_size)
        if actual is None:
            continue
        layer_name = name
        if base.n_layers != cfg.n_layers and name.startswith("blocks."):  # the base depth's layer at this fraction
            parts = name.split(".")
            parts[1] = str(int(parts[1]) * base.n_layers // cfg.n_layers)
            layer_name = ".".join(parts)
        target = _sp_std(scheme, layer_name, base_params[name], base, cfg.vocab_size)
        assert target is not None
        p.mul_(target / actual * scales[name].init)
