"""Adding an optimizer at run time: its facts row (normlab.config.optimizers.OptimizerFacts) and its builder
(normlab.train.optim.OPTIMIZER_BUILDERS) registered together, and taken out again.

An optimizer written into those two files is registered at import; `register_optimizer` does the same for one
defined elsewhere (a user's, a test's). Everything that decides by optimizer reads the registry's facts
(``OPTIMIZERS``): the memory plan and the sweep's disk budget (its state), the FSDP check (whether its step runs
on shards), the FLOP counts and recommend's costing (its step's work). The settings that name an optimizer
(``optim.optimizer``, ``normlab recommend --optimizer``) take their choices from the registry, recomputed here on
each change.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from normlab.config import commands, optimizers
from normlab.config.optimizers import OPTIMIZERS, OptimizerFacts
from normlab.config.sections import OptimSettings
from normlab.config.train import LEAVES, TrainConfig
from normlab.settings import leaves, set_choices
from normlab.train.optim import OPTIMIZER_BUILDERS, TrainOptimizer

Builder = Callable[[nn.Module, TrainConfig, bool], TrainOptimizer]


def _recompute() -> None:
    """The names derived from the registry at import, and the settings' choices, from the registry as it is now."""
    optimizers.OPTIMIZER_FACTS = tuple(OPTIMIZERS.values())
    optimizers.OPTIMIZER_NAMES = tuple(OPTIMIZERS)
    commands.RECOMMEND_OPTIMIZERS = tuple(sorted(OPTIMIZERS))
    set_choices(OptimSettings, "optimizer", optimizers.OPTIMIZER_NAMES)
    set_choices(commands.RecommendConfig, "optimizer", commands.RECOMMEND_OPTIMIZERS)
    LEAVES["optimizer"] = leaves(OptimSettings, "optim")["optimizer"]  # the training settings' table, in place


def register_optimizer(facts: OptimizerFacts, builder: Builder) -> None:
    """Add the optimizer ``facts.name``: its facts and its builder (model, config, fused) -> `TrainOptimizer`.
    Refused (ValueError) for a name already registered, or a ``rest`` that is not."""
    if facts.name in OPTIMIZERS or facts.name in OPTIMIZER_BUILDERS:
        raise ValueError(f"optimizer {facts.name!r} is already registered; registered: {', '.join(OPTIMIZERS)}")
    if facts.rest is not None and facts.rest not in OPTIMIZERS:
        raise ValueError(f"optimizer {facts.name!r}: its rest {facts.rest!r} is not registered")
    OPTIMIZERS[facts.name] = facts
    OPTIMIZER_BUILDERS[facts.name] = builder
    _recompute()


def unregister_optimizer(name: str) -> None:
    """Take the optimizer ``name`` out of the registry (a no-op for a name not registered)."""
    OPTIMIZERS.pop(name, None)
    OPTIMIZER_BUILDERS.pop(name, None)
    _recompute()
