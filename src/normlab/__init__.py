"""normlab: normalization placement in Transformer language models, as data.

import normlab
normlab.layouts()                          # the named presets
model = normlab.build_model("peri", size="tiny")
out = model(tokens, return_hidden_states=True)
"""

from normlab._lazy import lazy_exports
from normlab._version import __version__ as __version__
from normlab.layout import PRESETS, Layout, LayoutError, parse_layout

# torch is imported when one of these is first used, not by `import normlab` (the CLI starts fast)
__getattr__ = lazy_exports(
    __name__,
    {
        "ConfigError": "normlab.model.config",
        "ModelConfig": "normlab.model.config",
        "build_model": "normlab.model.build",
        "count_params": "normlab.model.params",
    },
    globals(),
)


def load_run(path):  # noqa: ANN001, ANN201 - imported lazily: pandas is slow to import
    """Read a run directory: config, summary, metrics and probes (pandas DataFrames)."""
    from normlab.diagnostics.probe_store import load_run as _load_run

    return _load_run(path)


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
    "load_run",
    "parse_layout",
]
