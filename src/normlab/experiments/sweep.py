"""`SweepConfig`: a grid of training runs as data, and its expansion into named runs.

A sweep is a base (any setting of `TrainConfig`, `[base.model]` for model options) and a grid: for
each axis a list of values; the runs are the Cartesian product. Keys are those of
`normlab.config.train` everywhere: settings (`layout`, `lr`, `seed`, `weight_decay`, `precision`,
...; only those that are part of a run's identity can be axes), model options `model.NAME`
(`model.n_layers`, `model.init`, `model.init_std`) and layout options `layout.NAME`, which edit the
run's Layout (`layout.h = [1, 0.5]` on layout "peri" gives the layouts labelled "peri,h=1" and
"peri,h=0.5"; also `layout.norm`, `layout.alpha`, `layout.init`, `layout.inner`). In TOML:

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

import functools
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from normlab.config.sections import RunSettings
from normlab.config.train import LEAVES, TrainConfig, flatten_settings, resolve_key, typed_settings
from normlab.errors import ConfigError, LayoutError
from normlab.experiments.scheduler import check_options
from normlab.io import read_toml
from normlab.settings import build, check_fields, check_leaf, leaves, positive, setting, unknown_key

EXECUTORS = ("local", "slurm", "submitit-local")
# A sweep's disk budget: each run keeps its newest checkpoint only (the one a killed run resumes from),
# and a finished run's final checkpoint holds the model without the optimizer state (a third of the size
# with AdamW). 70 runs at 126M kept 2 checkpoints with optimizer state each: about 225 GB; this: about 35 GB.
# A base (or a recipe) that sets keep_last or keep_optimizer decides for itself.
SWEEP_RUN_DEFAULTS = {"keep_last": 1, "keep_optimizer": False}
# what a sweep sets for every run itself; a base or grid may not
SET_BY_SWEEP = ("out", "progress")


@dataclass
class RunSpec:
    """One run of a sweep: its id, its grid coordinates and its whole training config (validated once,
    when the sweep was expanded or its store row read; `out` left at its default, no progress bar)."""

    run_id: str
    index: int
    axes: dict[str, Any]
    config: TrainConfig

    def __post_init__(self) -> None:
        self.config = sweep_run_config(self.config)

    def train_config(self, out: str | Path) -> TrainConfig:
        return replace(self.config, run=replace(self.config.run, out=str(out)))


def sweep_run_config(cfg: TrainConfig) -> TrainConfig:
    """A run's config as a sweep stores it: `out` at its default (the sweep puts each run in its folder)
    and no progress bar (the sweep has its own)."""
    default_out = RunSettings.out
    if cfg.run.out == default_out and not cfg.loggers.progress:
        return cfg
    return replace(cfg, run=replace(cfg.run, out=default_out), loggers=replace(cfg.loggers, progress=False))


def _sweep_name(name: str) -> str | None:
    return (
        None
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}", name)
        else "is not a valid sweep name: use letters, digits and . _ + - (it names a folder under runs/sweeps)"
    )


@dataclass
class SweepConfig:
    """A sweep: its declared settings (name, provenance, where runs execute), a base of run settings
    shared by every run, and a grid of axes whose product gives the runs."""

    name: str = setting("sweep", "sweep name (names the folder runs/sweeps/NAME)", check=_sweep_name)
    base: dict[str, Any] = field(default_factory=dict)  # settings shared by every run (any key of TrainConfig)
    grid: dict[str, list[Any]] = field(default_factory=dict)  # axis -> values; runs = product
    source: str = setting("", "the paper, table or figure the sweep reproduces")
    scale: str = setting("", "model size, steps, data: what small scale means here")
    claim: str = setting("", "what the paper found, to check against the summary")
    workers: int | None = setting(
        None, "parallel runs on this machine (none: one per CPU core, at most the runs)", check=positive
    )
    executor: str = setting(
        "local",
        "where runs execute: local worker processes, slurm (submitit) or submitit-local (submitit here, for tests)",
        choices=EXECUTORS,
    )
    slurm: dict[str, Any] = field(default_factory=dict)  # submitit options: slurm_partition, timeout_min, ...

    @property
    def machine(self) -> str:
        """ "gpu" for a sweep whose runs ask for CUDA (the gpu-* recipes), else "cpu"."""
        devices = [self.base.get("device"), *self.grid.get("device", [])]
        return "gpu" if any(isinstance(d, str) and d.startswith("cuda") for d in devices) else "cpu"

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.grid, dict):
            raise ConfigError("grid must be a table of axis = [values]")
        if not isinstance(self.base, dict) or not isinstance(self.slurm, dict):
            raise ConfigError("base and slurm must be tables")
        check_options(self.slurm, self.executor)  # a typo in [slurm] is refused before any folder is made
        self.base = typed_settings(self.base, "sweep base")
        for key in self.base:
            if key.split(".")[-1] in SET_BY_SWEEP and resolve_key(key)[0] == "leaf":
                raise ConfigError(f"base.{key} is set by the sweep (runs go to SWEEP_DIR/runs/ID); remove it")
        grid = {}
        for axis, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid axis {axis!r} needs a non-empty list of values, got {values!r}")
            _check_axis(axis)
            values = [typed_settings({axis: v}, f"grid axis {axis!r}")[axis] for v in values]
            if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
                raise ConfigError(f"grid axis {axis!r} repeats a value: {values}")
            grid[axis] = values
        self.grid = grid
        self._runs = self._expand()  # every run's config built and validated now, once, before anything runs

    def with_(
        self,
        settings: dict[str, Any] | None = None,
        base: dict[str, Any] | None = None,
        grid: dict[str, list[Any]] | None = None,
        from_text: bool = False,
    ) -> SweepConfig:
        """This sweep with declared settings replaced (`settings`, e.g. from flags), run settings added to
        its base and axes added to (or replacing) its grid; the result is validated as a whole."""
        decl = leaves(SweepConfig)
        values = {k: v for k, v in self.to_dict().items() if k in decl}
        for key, value in (settings or {}).items():
            if key not in decl:
                raise unknown_key(key, list(decl), "the sweep's settings")
            values[key] = check_leaf(decl[key], value, from_text=from_text)
        merged_base = {**flatten_settings(self.base), **flatten_settings(base or {})}
        return SweepConfig(**values, base=merged_base, grid={**self.grid, **(grid or {})}, slurm=dict(self.slurm))

    def expand(self) -> list[RunSpec]:
        """The runs of the grid, one per point, in the grid's order (built when the sweep was made)."""
        return list(self._runs)

    def _expand(self) -> list[RunSpec]:
        axes = list(self.grid)
        specs, seen = [], set()
        for i, combo in enumerate(itertools.product(*(self.grid[a] for a in axes))):
            point = dict(zip(axes, combo))
            try:
                train = TrainConfig().with_({**SWEEP_RUN_DEFAULTS, **self.base, **point, "progress": False})
            except (ConfigError, LayoutError) as err:
                raise ConfigError(f"sweep {self.name!r}, run {point}: {err}") from None
            rid = run_id(point, train)
            if rid in seen:
                raise ConfigError(f"sweep {self.name!r}: two grid points give the same run {point}")
            seen.add(rid)
            specs.append(RunSpec(rid, i, point, train))
        return specs

    def disk_budget(self) -> tuple[int, int]:
        """(bytes its runs' checkpoints hold once all finished, bytes one run holds while in flight), from
        the analytic parameter counts: float32 weights (4 N) and the optimizer's state, its registered float32
        numbers per parameter over all N (normlab.config.optimizers, normlab.train.memory.optimizer_state_bytes:
        AdamW's two moments 8 N, SGD's momentum 4 N, Muon's 4 N counted over every parameter, not split with the
        AdamW on the rest as `normlab plan` does)."""
        from normlab.model.params import analytic_params
        from normlab.train.memory import optimizer_state_bytes

        final, flight = 0, 0
        for spec in self.expand():
            cfg = spec.config
            n = analytic_params(cfg.model.model_config(vocab_size=cfg.expected_vocab), cfg.model.resolved).total
            whole = 4 * n + optimizer_state_bytes(cfg, cfg.optim.optimizer, n)
            last = whole if cfg.checkpointing.keep_optimizer else 4 * n
            final += last + (cfg.checkpointing.keep_last - 1) * whole
            flight = max(flight, cfg.checkpointing.keep_last * whole)
        return final, flight

    @classmethod
    def from_toml(cls, path: str | Path) -> SweepConfig:
        return cls.from_dict(read_toml(path, "sweep file"), source_file=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source_file: str = "sweep") -> SweepConfig:
        """A sweep from its TOML/JSON form: the declared settings, and the base, grid and slurm tables."""
        tables = {k: data[k] for k in ("base", "grid", "slurm") if k in data}
        try:
            return build(
                cls,
                {k: v for k, v in data.items() if k not in tables},
                source_file,
                base=tables.get("base", {}),
                grid=tables.get("grid", {}),
                slurm=tables.get("slurm", {}),
            )
        except ConfigError as err:
            text = str(err)
            raise ConfigError(
                text if text.startswith(source_file) or source_file == "sweep" else f"{source_file}: {text}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _check_axis(axis: str) -> None:
    """A grid axis is a setting that is part of a run's identity (a grid over `out` or `progress`
    would give runs that compute the same thing)."""
    kind, name = resolve_key(axis)
    if kind == "leaf" and not LEAVES[name].identity:
        valid = sorted(k for k, leaf in LEAVES.items() if leaf.identity and k != "options")
        raise ConfigError(
            f"grid axis {axis!r} does not change what a run computes, so it cannot be an axis; "
            f"valid: {', '.join(valid)}, model.NAME or layout.NAME"
        )


def _slug(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-")[:40] or "x"


@functools.lru_cache(maxsize=1)
def _default_identity() -> dict[str, Any]:
    return TrainConfig().identity()


def run_id(point: dict[str, Any], config: TrainConfig) -> str:
    """`<axis values>-<hash>`: readable in `ls`, unique per resolved config.

    The hash covers the identity settings (see `normlab.config.train`) that differ from their
    defaults, so a normlab version that adds a setting (with a default that keeps the old behaviour)
    keeps every id, and resumes work across upgrades; settings that only say where and how a run
    reports (probes, evaluation cadence, checkpoints, device) never change an id.
    """
    defaults = _default_identity()
    changed = {k: v for k, v in config.identity().items() if v != defaults[k]}
    digest = hashlib.sha1(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:8]
    names = "_".join(_slug(v) if axis == "layout" else f"{axis.split('.')[-1]}{_slug(v)}" for axis, v in point.items())
    return f"{names}-{digest}" if names else digest
