"""The decoder-only LM: config and sizes, norms, attention, MLP, block, init, parameter counts."""

from normlab.model.build import build_model
from normlab.model.config import SIZES, ConfigError, ModelConfig, get_size
from normlab.model.init import INIT_SCHEMES, init_weights
from normlab.model.lm import LMOutput, NormLM
from normlab.model.params import ParamCount, analytic_params, count_params

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
