"""`normlab train`: a run from its configuration (built by normlab.config.overrides from the command's one
override list), with what the command line adds around the trainer: --init-from's recorded shape where the
command gave none (a run's), or every setting it states (a transformers folder's: `normlab.train.init_from`),
an output folder named after the layout and size when --out is not given (said before any work), and the
run's outcome in one line."""

from __future__ import annotations

import sys

from normlab.config.train import TrainConfig
from normlab.diagnostics.hooks import StepHook
from normlab.errors import ConfigError
from normlab.io import read_toml
from normlab.runs.outcome import describe
from normlab.runs.start import default_out, recorded_shape
from normlab.train.faults import injected
from normlab.train.hook_registry import user_hook
from normlab.train.init_from import folder_settings
from normlab.train.trainer import TrainingFailed, train


def user_hooks(specs: list[str], config: str | None) -> list[StepHook]:
    """--hook module:Class, each built with its settings from the [hook.Class] table of the --config file
    (`normlab.train.hook_registry.user_hook`)."""
    tables = read_toml(config, "config file").get("hook", {}) if config and specs else {}
    if not isinstance(tables, dict):
        raise ConfigError(f"{config}: [hook] holds one table per hook class ([hook.CLASS]), got {tables!r}")
    return [user_hook(spec, tables.get(spec.partition(":")[2])) for spec in specs]


def train_command(cfg: TrainConfig, given: set[str], hooks: list[StepHook] | None = None) -> int:
    """Train ``cfg`` with the user's ``hooks``; ``given``: the names of the settings the user gave
    (`settings_keys`). Returns the exit status: 0, or 1 when the run failed (its reason on stderr)."""
    if cfg.model.init_from:
        cfg = folder_settings(recorded_shape(cfg, given), given)  # a run's recorded shape, a folder's settings
    if "out" not in given:
        cfg = cfg.with_({"out": default_out(cfg.model.layout_label, cfg.model.size)}, "command line")
        print(f"normlab train: no --out given: the run goes to {cfg.run.out}", flush=True)
    fault = injected(cfg)
    if fault is not None:
        print(f"normlab train: FAULT INJECTED: {fault['text']}", flush=True)
    try:
        summary = train(cfg, hooks=hooks or ())
    except TrainingFailed as err:
        print(f"normlab: {err}", file=sys.stderr)
        return 1
    if summary:
        print(f"{cfg.run.out}: {describe(summary)}")
    return 0
