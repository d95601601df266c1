"""Recipes: ready-made sweeps that restate the papers' studies at a scale this machine can run.

Each `NAME.toml` here is a sweep file (see `normlab.experiments.sweep`) that names its paper source,
its scale and the paper's claim. `normlab sweep --recipe NAME` runs one; `--set KEY=VALUE` scales it
up (e.g. `--set size=small --set steps=2000`). docs/results.md records what each shows here.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from normlab.errors import ConfigError
from normlab.experiments.sweep import SweepConfig

RECIPE_DIR = Path(__file__).parent
RECIPES: dict[str, Path] = {p.stem: p for p in sorted(RECIPE_DIR.glob("*.toml"))}


def load_recipe(name: str) -> SweepConfig:
    if name not in RECIPES:
        close = difflib.get_close_matches(name, RECIPES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint}; valid: {', '.join(RECIPES)}")
    return SweepConfig.from_toml(RECIPES[name])


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def recipes_text(machine: str | None = None, names_only: bool = False) -> str:
    """`normlab recipes`: each recipe's runs, machine, source, scale, claim and disk budget (or the names)."""
    recipes = {name: load_recipe(name) for name in RECIPES}
    recipes = {n: r for n, r in recipes.items() if machine in (None, r.machine)}
    if names_only:
        return "\n".join(recipes)
    out = []
    for name, r in recipes.items():
        final, flight = r.disk_budget()
        out.append(
            f"{name}  ({len(r.expand())} runs, {r.machine})\n  source: {r.source}\n  scale:  {r.scale}\n"
            f"  claim:  {r.claim}\n  disk:   checkpoints {_size(final)} once finished ({_size(flight)} per run "
            "in flight)\n"
        )
    return "\n".join(out)
