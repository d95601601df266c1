"""Experiments: sweeps over layouts, learning rates, seeds and any setting; their summaries; the
`compare` job behind `make demo`; and recipes that restate the papers' studies at small scale."""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "compare": "normlab.experiments.comparison",
        "RECIPES": "normlab.experiments.recipes",
        "load_recipe": "normlab.experiments.recipes",
        "run_sweep": "normlab.experiments.runner",
        "load_sweep": "normlab.experiments.summary",
        "summarize": "normlab.experiments.summary",
        "RunSpec": "normlab.experiments.sweep",
        "SweepConfig": "normlab.experiments.sweep",
    },
    globals(),
)

__all__ = ["RECIPES", "RunSpec", "SweepConfig", "compare", "load_recipe", "load_sweep", "run_sweep", "summarize"]
