"""Normalization layouts as data: sites, the string form, and the named presets."""

from normlab.errors import LayoutError
from normlab.layout.presets import PRESETS, Preset
from normlab.layout.residual import AttnRes, Residual, Skip, Sphere, Streams, deepnorm_alpha
from normlab.layout.sites import (
    AttentionInnerSites,
    BlockLayout,
    LayerRange,
    LayerRule,
    Layout,
    NormSpec,
    ResolvedLayout,
    SiteNorm,
    SublayerSites,
    deepnorm_beta,
    format_layout,
    resolve,
)
from normlab.layout.spec import parse_layout


def as_layout(layout: "Layout | str") -> Layout:
    """Accept a `Layout`, a preset name or a string form."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str):
        return parse_layout(layout)
    raise LayoutError(f"a layout is a Layout, a preset name or a string form, not {type(layout).__name__}")


__all__ = [
    "PRESETS",
    "AttentionInnerSites",
    "AttnRes",
    "BlockLayout",
    "LayerRange",
    "LayerRule",
    "Layout",
    "LayoutError",
    "NormSpec",
    "Preset",
    "Residual",
    "ResolvedLayout",
    "SiteNorm",
    "Skip",
    "Sphere",
    "Streams",
    "SublayerSites",
    "as_layout",
    "deepnorm_alpha",
    "deepnorm_beta",
    "format_layout",
    "parse_layout",
    "resolve",
]
