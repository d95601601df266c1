"""The initialization schemes as numbers: names, stds at a size, sources (no torch; `normlab.model.init`
applies them to a model, `normlab show` prints them). The table of schemes is in `normlab.model.init`."""

from __future__ import annotations

import math

from normlab.errors import ConfigError
from normlab.layout.sites import Layout, deepnorm_beta
from normlab.model.config import ModelConfig

INIT_SCHEMES: tuple[str, ...] = (
    "normal",
    "xavier",
    "he",
    "lecun",
    "10/d",
    "1/10d",
    "trunc-normal",
    "depth-scaled",
    "megatron",
    "deepnorm",
    "spannorm",
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
        "spannorm": init_std,
        "he": math.sqrt(2.0 / d_model),
        "lecun": math.sqrt(1.0 / d_model),
        "10/d": math.sqrt(10.0 / d_model),
        "1/10d": math.sqrt(1.0 / (10.0 * d_model)),
        "trunc-normal": 1.0 / math.sqrt(2.5 * d_model),
        "depth-scaled": 1.0 / math.sqrt(2.5 * d_model),
        "megatron": 1.0 / math.sqrt(2.5 * d_model),
    }[scheme]


_SOURCES = {
    "normal": "Kim Table 2",
    "xavier": "Kim Table 8",
    "he": "Kim Table 9",
    "lecun": "Kim Table 9",
    "10/d": "Kim Table 9",
    "1/10d": "Kim Table 9",
    "trunc-normal": "Zhuo Sec. 4.4 Normal",
    "depth-scaled": "Zhuo Sec. 4.4",
    "megatron": "Zhuo Sec. 4.4, Table 7",
    "deepnorm": "Wang et al. 2022",
    # the abstract's "principled scaling strategy" read as the 1/sqrt(L) output-projection init of a third-party
    # adaptation of SpanNorm's eqs. 5-8 (the paper's text was not retrievable; docs/layouts.md)
    "spannorm": "Wang et al. 2026 (SpanNorm), as adapted",
}


def describe_init(scheme: str, d_model: int, n_layers: int, init_std: float) -> str:
    """The scheme's numbers at this size and its source, e.g. for `normlab show`."""
    check_scheme(scheme)
    std = base_std(scheme, d_model, init_std)
    if scheme in _XAVIER:
        what = f"Xavier normal on linear layers, embedding N(0, {std:.3g}^2)"
        if scheme == "deepnorm":
            what += f", gain {deepnorm_beta(n_layers):.4g} on v/o/MLP"
    else:
        what = f"{'truncated at 3 std, ' if scheme in _TRUNCATED else ''}std {std:.4g}"
        if scheme == "megatron":
            what += f"; o_proj, down_proj std {std / math.sqrt(2.0 * n_layers):.4g} (/ sqrt(2L), L = {n_layers})"
        elif scheme == "spannorm":
            what += f"; o_proj, down_proj std {std / math.sqrt(n_layers):.4g} (/ sqrt(L), L = {n_layers})"
        elif scheme == "depth-scaled":
            what += (
                f"; o_proj, down_proj of layer l / sqrt(2l): {std / math.sqrt(2.0):.4g} ... "
                f"{std / math.sqrt(2.0 * n_layers):.4g}"
            )
    return f"{what} ({_SOURCES[scheme]})"


def linear_std(scheme: str, path: str, layer: int, n_layers: int, d_model: int, init_std: float) -> float:
    """The std for a (non-Xavier) linear weight at ``path`` inside block ``layer`` (0-based)."""
    std = base_std(scheme, d_model, init_std)
    if path.endswith(_OUTPUT_PROJ):
        if scheme == "depth-scaled":
            std /= math.sqrt(2.0 * (layer + 1))
        elif scheme == "megatron":
            std /= math.sqrt(2.0 * n_layers)
        elif scheme == "spannorm":
            std /= math.sqrt(n_layers)
    return std


def resolve_init(cfg: ModelConfig, layout: Layout) -> str:
    """``init="auto"`` takes the layout's prescribed scheme (DeepNorm's, HybridNorm's), else "normal"."""
    return check_scheme(layout.init or "normal") if cfg.init == "auto" else check_scheme(cfg.init)
