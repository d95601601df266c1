"""Experiments: sweeps over layouts, learning rates, seeds and any setting; their summaries; the
`compare` job behind `make demo`; and recipes that restate the papers' studies at small scale."""

from normlab.experiments.compare import compare
from normlab.experiments.recipes import RECIPES, load_recipe
from normlab.experiments.runner import run_sweep
from normlab.experiments.summarize import load_sweep, summarize
from normlab.experiments.sweep import RunSpec, SweepConfig

__all__ = ["RECIPES", "RunSpec", "SweepConfig", "compare", "load_recipe", "load_sweep", "run_sweep", "summarize"]
