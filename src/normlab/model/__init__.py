"""The decoder-only LM: config and sizes, norms, attention, MLP, block, init, parameter counts."""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "build_model": "normlab.model.build",
        "SIZES": "normlab.model.config",
        "ConfigError": "normlab.model.config",
        "ModelConfig": "normlab.model.config",
        "get_size": "normlab.model.config",
        "INIT_SCHEMES": "normlab.model.init_schemes",
        "init_weights": "normlab.model.init",
        "LMOutput": "normlab.model.lm",
        "NormLM": "normlab.model.lm",
        "ParamCount": "normlab.model.params",
        "analytic_params": "normlab.model.params",
        "count_params": "normlab.model.params",
    },
    globals(),
)

__all__ = [
    "INIT_SCHEMES",
    "SIZES",
    "ConfigError",
    "LMOutput",
    "ModelConfig",
    "NormLM",
    "ParamCount",
    "analytic_params",
    "build_model",
    "count_params",
    "get_size",
    "init_weights",
]
