"""Recipes: ready-made sweeps that restate the papers' studies at a scale this machine can run.

Each `NAME.toml` here is a sweep file (see `normlab.experiments.sweep`) that names its paper source,
its scale and the paper's claim. `normlab sweep --recipe NAME` runs one; `--set KEY=VALUE` scales it
up (e.g. `--set size=small --set steps=2000`). docs/results.md records what each shows here.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from normlab.experiments.sweep import SweepConfig
from normlab.model.config import ConfigError

RECIPE_DIR = Path(__file__).parent
RECIPES: dict[str, Path] = {p.stem: p for p in sorted(RECIPE_DIR.glob("*.toml"))}


def load_recipe(name: str) -> SweepConfig:
    if name not in RECIPES:
        close = difflib.get_close_matches(name, RECIPES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint}; valid: {', '.join(RECIPES)}")
    return SweepConfig.from_toml(RECIPES[name])
