"""`SweepConfig`: a grid of training runs as data, and its expansion into named runs.

A sweep is a base `TrainConfig` (any field, `[base.model]` for model options) and a grid: for each
axis a list of values; the runs are the Cartesian product. Axes are TrainConfig fields (`layout`,
`lr`, `seed`, `weight_decay`, `precision`, ...) or model options written `model.NAME`
(`model.n_layers`, `model.init`, `model.init_std`) or layout options written `layout.NAME` and
appended to the run's layout string (`layout.h = [1, 0.5]` on layout "peri" gives "peri,h=1" and
"peri,h=0.5"; also `layout.norm`, `layout.alpha`, `layout.init`). In TOML:

    name = "kim-lr"
    source = "Kim et al. 2025, Fig. 3a"
    scale = "tiny (1.6M params), 300 steps of byte-level Shakespeare"
    claim = "Pre-LN's loss rises or diverges at learning rates where Peri-LN still trains"
    [base]
    steps = 300
    [grid]
    layout = ["pre", "peri"]
    lr = [1e-3, 3e-3, 1e-2]
    seed = [0, 1]

Each run gets an id made of its axis values and a hash of its whole resolved config, so re-running a
sweep finds the same runs (resume) and a changed setting makes a new run, never a silent reuse.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.io import read_toml
from normlab.layout import LayoutError
from normlab.model.config import ConfigError
from normlab.train.config import TrainConfig

# Fields that say where and how a run reports, not what it computes: not part of a run's identity.
NON_IDENTITY = ("out", "progress", "tensorboard", "wandb", "resume")
EXECUTORS = ("local", "slurm", "submitit-local")


@dataclass
class RunSpec:
    """One run of a sweep: its id, its grid coordinates and its full training config."""

    run_id: str
    index: int
    axes: dict[str, Any]
    config: dict[str, Any]  # TrainConfig.to_dict() without `out`

    def train_config(self, out: str | Path) -> TrainConfig:
        return TrainConfig.from_dict({**self.config, "out": str(out), "progress": False})


@dataclass
class SweepConfig:
    name: str = "sweep"
    base: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields shared by every run
    grid: dict[str, list[Any]] = field(default_factory=dict)  # axis -> values; runs = product
    source: str = ""  # the paper, table or figure the sweep reproduces
    scale: str = ""  # model size, steps, data: what "small scale" means here
    claim: str = ""  # what the paper found, to check against the summary
    workers: int | None = None  # parallel runs on this machine (None: one per CPU core, at most the runs)
    executor: str = "local"  # local (worker processes) | slurm | submitit-local (submitit, for tests)
    slurm: dict[str, Any] = field(default_factory=dict)  # submitit options: slurm_partition, timeout_min, ...

    def __post_init__(self) -> None:
        if not isinstance(self.grid, dict):
            raise ConfigError("grid must be a table of axis = [values]")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise ConfigError(f"workers must be a positive integer, got {self.workers!r}")
        for axis, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid axis {axis!r} needs a non-empty list of values, got {values!r}")
            if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
                raise ConfigError(f"grid axis {axis!r} repeats a value: {values}")
            _check_axis(axis)
        if "out" in self.base:
            raise ConfigError("base.out is set by the sweep (runs go to SWEEP_DIR/runs/ID); remove it")
        self.expand()  # every run's config validated now, before anything runs

    def expand(self) -> list[RunSpec]:
        axes = list(self.grid)
        specs, seen = [], set()
        for i, combo in enumerate(itertools.product(*(self.grid[a] for a in axes))):
            point = dict(zip(axes, combo))
            cfg = _apply(self.base, point)
            try:
                train = TrainConfig.from_dict({**cfg, "progress": False})
                _check_model(train)
            except (ConfigError, LayoutError) as err:
                raise ConfigError(f"sweep {self.name!r}, run {point}: {err}") from None
            config = {k: v for k, v in train.to_dict().items() if k not in NON_IDENTITY}
            rid = run_id(point, config)
            if rid in seen:
                raise ConfigError(f"sweep {self.name!r}: two grid points give the same run {point}")
            seen.add(rid)
            specs.append(RunSpec(rid, i, point, config))
        return specs

    @classmethod
    def from_toml(cls, path: str | Path) -> SweepConfig:
        return cls.from_dict(read_toml(path, "sweep file"), source_file=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source_file: str = "sweep") -> SweepConfig:
        valid = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ConfigError(f"{source_file}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _check_model(cfg: TrainConfig) -> None:
    """The layout parses and the size exists (TrainConfig leaves these to build time)."""
    from normlab.layout import as_layout
    from normlab.model.config import get_size

    as_layout(cfg.layout).resolve(get_size(cfg.size).with_(**cfg.model).n_layers)


LAYOUT_OPTIONS = ("h", "norm", "alpha", "init", "inner")


def _check_axis(axis: str) -> None:
    from dataclasses import fields

    from normlab.model.config import ModelConfig

    if axis.startswith("layout."):
        if axis.removeprefix("layout.") not in LAYOUT_OPTIONS:
            raise ConfigError(f"grid axis {axis!r}: layout options are {', '.join('layout.' + o for o in LAYOUT_OPTIONS)}")
        return
    if axis.startswith("model."):
        name = axis.removeprefix("model.")
        if name not in {f.name for f in fields(ModelConfig)}:
            raise ConfigError(f"grid axis {axis!r}: {name!r} is not a model option "
                              f"(valid: {', '.join(f.name for f in fields(ModelConfig))})")
        return
    valid = {f.name for f in fields(TrainConfig)} - set(NON_IDENTITY) - {"model"}
    if axis not in valid:
        raise ConfigError(f"grid axis {axis!r} is not a training setting; valid: {', '.join(sorted(valid))}, "
                          "or model.NAME for a model option")


def _apply(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    cfg = {k: v for k, v in base.items() if k != "model"}
    model = dict(base.get("model", {}))
    for axis, value in point.items():
        if axis.startswith("model."):
            model[axis.removeprefix("model.")] = value
        elif not axis.startswith("layout."):
            cfg[axis] = value
    for axis, value in point.items():  # after the layout axis, whatever the axes' order
        if axis.startswith("layout."):
            cfg["layout"] = f"{cfg.get('layout', TrainConfig.layout)},{axis.removeprefix('layout.')}={value}"
    cfg["model"] = model
    return cfg


def _slug(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-")[:40] or "x"


def run_id(point: dict[str, Any], config: dict[str, Any]) -> str:
    """`<axis values>-<hash>`: readable in `ls`, unique per resolved config.

    The hash covers the settings that differ from TrainConfig's defaults, so a normlab version that
    adds a setting (with a default that keeps the old behaviour) keeps every id, and resumes work
    across upgrades; the cost is that changing a default would reuse old results, which normlab
    does not do silently (defaults are part of the documented protocol).
    """
    defaults = TrainConfig().to_dict()
    changed = {k: v for k, v in config.items() if k not in defaults or v != defaults[k]}
    digest = hashlib.sha1(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:8]
    names = "_".join(_slug(v) if axis == "layout" else f"{axis.split('.')[-1]}{_slug(v)}" for axis, v in point.items())
    return f"{names}-{digest}" if names else digest
