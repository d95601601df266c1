"""Configuration: every command's configuration (train, sweep, screen, compare, ...), built on the settings
engine (normlab.settings): one declaration per setting from which every command's flags, checks and docs come."""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"TrainConfig": "normlab.config.train"}, globals())

__all__ = ["TrainConfig"]
