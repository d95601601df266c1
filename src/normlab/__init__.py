"""normlab: normalization placement in Transformer language models, as data.

    import normlab
    normlab.layouts()                          # the named presets
    model = normlab.build_model("peri", size="tiny")
    out = model(tokens, return_hidden_states=True)
"""

from normlab.layout import PRESETS, Layout, LayoutError, parse_layout
from normlab.model import ConfigError, ModelConfig, build_model, count_params

__version__ = "0.1.0"


def layouts() -> list[str]:
    """The names of the preset layouts (see `normlab.layout.PRESETS` for equations and sources)."""
    return list(PRESETS)


__all__ = [
    "PRESETS",
    "ConfigError",
    "Layout",
    "LayoutError",
    "ModelConfig",
    "build_model",
    "count_params",
    "layouts",
    "parse_layout",
]
