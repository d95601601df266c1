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

d is d_model. Norm gammas start at 1 and betas and biases at 0 under every scheme. MoE experts are
initialized as the dense MLP's matrices, each expert on its own (its down projection as down_proj);
the router as any linear layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normlab.layout.sites import deepnorm_beta
from normlab.model.config import ConfigError

INIT_SCHEMES: tuple[str, ...] = (
    "normal", "xavier", "he", "lecun", "10/d", "1/10d", "trunc-normal", "depth-scaled", "megatron", "deepnorm",
)
_XAVIER = ("xavier", "deepnorm")
_TRUNCATED = ("trunc-normal", "depth-scaled", "megatron")
_OUTPUT_PROJ = ("o_proj", "down_proj")  # path endings: attention, MLP, MoE experts and shared expert
_DEEPNORM_SCALED = ("attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def check_scheme(scheme: str) -> str:
    if scheme not in INIT_SCHEMES:
        raise ConfigError(f"unknown init scheme {scheme!r}; valid: {', '.join(INIT_SCHEMES)}")
    return scheme


def base_std(scheme: str, d_model: int, init_std: float) -> float:
    """The std of the scheme's plain normal draws (the embedding's std for the Xavier schemes)."""
    return {
        "normal": init_std,
        "xavier": init_std,
        "deepnorm": init_std,
        "he": math.sqrt(2.0 / d_model),
        "lecun": math.sqrt(1.0 / d_model),
        "10/d": math.sqrt(10.0 / d_model),
        "1/10d": math.sqrt(1.0 / (10.0 * d_model)),
        "trunc-normal": 1.0 / math.sqrt(2.5 * d_model),
        "depth-scaled": 1.0 / math.sqrt(2.5 * d_model),
        "megatron": 1.0 / math.sqrt(2.5 * d_model),
    }[scheme]


_SOURCES = {
    "normal": "Kim Table 2", "xavier": "Kim Table 8", "he": "Kim Table 9", "lecun": "Kim Table 9",
    "10/d": "Kim Table 9", "1/10d": "Kim Table 9", "trunc-normal": "Zhuo Sec. 4.4 Normal",
    "depth-scaled": "Zhuo Sec. 4.4", "megatron": "Zhuo Sec. 4.4, Table 7", "deepnorm": "Wang et al. 2022",
}


def describe_init(scheme: str, d_model: int, n_layers: int, init_std: float) -> str:
    """The scheme's numbers at this size and its source, e.g. for `normlab show`."""
    check_scheme(scheme)
    std = base_std(scheme, d_model, init_std)
    if scheme in _XAVIER:
        what = "Xavier normal on linear layers, embedding N(0, %.3g^2)" % std
        if scheme == "deepnorm":
            what += f", gain {deepnorm_beta(n_layers):.4g} on v/o/MLP"
    else:
        what = f"{'truncated at 3 std, ' if scheme in _TRUNCATED else ''}std {std:.4g}"
        if scheme == "megatron":
            what += f"; o_proj, down_proj std {std / math.sqrt(2.0 * n_layers):.4g} (/ sqrt(2L), L = {n_layers})"
        elif scheme == "depth-scaled":
            what += f"; o_proj, down_proj of layer l / sqrt(2l): {std / math.sqrt(2.0):.4g} ... {std / math.sqrt(2.0 * n_layers):.4g}"
    return f"{what} ({_SOURCES[scheme]})"


def _normal(w: torch.Tensor, std: float, truncated: bool) -> None:
    if truncated:
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
    else:
        nn.init.normal_(w, mean=0.0, std=std)


def linear_std(scheme: str, path: str, layer: int, n_layers: int, d_model: int, init_std: float) -> float:
    """The std for a (non-Xavier) linear weight at ``path`` inside block ``layer`` (0-based)."""
    std = base_std(scheme, d_model, init_std)
    if path.endswith(_OUTPUT_PROJ):
        if scheme == "depth-scaled":
            std /= math.sqrt(2.0 * (layer + 1))
        elif scheme == "megatron":
            std /= math.sqrt(2.0 * n_layers)
    return std


@torch.no_grad()
def init_weights(model: nn.Module, scheme: str) -> None:
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
        if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            module.reset_parameters()
