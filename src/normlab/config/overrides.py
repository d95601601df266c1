"""The one override list of a command: what the command line gave (its configuration's flags, the model
shortcuts --layers/--width/--heads, --model KEY=VALUE, --set KEY=VALUE, --grid AXIS=V1,V2, a --config file),
as settings for the one override function (`normlab.config.train.apply_settings`) or a command's declared
configuration (`normlab.settings.build`). Values stay text until each setting's type parses them. No torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from normlab.config.sections import ModelSettings
from normlab.config.train import LEAVES, TrainConfig, flatten_settings, resolve_key, typed_settings
from normlab.errors import ConfigError
from normlab.io import read_toml
from normlab.layout import parse_layout
from normlab.settings import add_flags, build, given, leaves

# Flags that stand for a model option (the model's shape), for the commands that take one.
MODEL_SHORTCUTS = {
    "layers": ("model.n_layers", "number of layers (depth)"),
    "width": ("model.d_model", "d_model, the width of the residual stream"),
    "heads": ("model.n_heads", "attention heads, must divide the width"),
}


def add_shortcuts(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """The model shortcuts ``names`` (layers, width, heads) as flags: --layers N is --set model.n_layers=N."""
    for short in names:
        key, doc = MODEL_SHORTCUTS[short]
        parser.add_argument(f"--{short}", metavar="N", default=argparse.SUPPRESS, help=f"{doc} (= --set {key}=N)")


def add_set(parser: argparse.ArgumentParser, help_text: str, metavar: str = "KEY=VALUE") -> None:
    """--set KEY=VALUE (repeatable): any setting the command takes, by its key."""
    parser.add_argument("--set", action="append", metavar=metavar, default=argparse.SUPPRESS, help=help_text)


def add_run_settings(parser: argparse.ArgumentParser, hooks: bool = False) -> None:
    """A run's whole override list (train, plan): --config FILE, --set, --model and one flag per run setting;
    with ``hooks`` (train), --hook module:Class, a step hook of the user's (`normlab.train.hook_registry`)."""
    if hooks:
        parser.add_argument(
            "--hook",
            action="append",
            default=[],
            metavar="MODULE:CLASS",
            help="a step hook you wrote (a normlab.diagnostics.hooks.StepHook subclass in an importable module), "
            "its settings from the [hook.CLASS] table of --config (repeatable)",
        )
    parser.add_argument(
        "--config",
        help="a TOML file of settings (key = value; [model] table for model options); flags and --set override it",
    )
    add_set(parser, "any setting by its key: lr=1e-3, model.n_layers=8, layout.h=0.5 (repeatable)")
    parser.add_argument(
        "--model",
        action="append",
        dest="model_options",
        default=argparse.SUPPRESS,
        metavar="KEY=VALUE",
        help="a model option, repeatable: --model n_layers=8 --model mlp=relu (= --set model.KEY=VALUE)",
    )
    add_flags(parser, {k: v for k, v in LEAVES.items() if k != "options"}, defaults={"out": "runs/LAYOUT-SIZE"})


def pairs(items: list[str] | None, flag: str, example: str) -> dict[str, str]:
    """KEY=VALUE arguments as a dict of strings (parsed later by each setting's type)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{flag} takes KEY=VALUE (e.g. {flag} {example}), got {item!r}")
        out[key.strip()] = value.strip()
    return out


def typed(settings: dict[str, Any], source: str) -> dict[str, Any]:
    """Text settings parsed and checked by their settings' types (a sweep's base, a command's run settings)."""
    return typed_settings(settings, source, from_text=True)


def overrides(args: argparse.Namespace, *flags: str) -> dict[str, str]:
    """The run settings a command was given: its run-setting ``flags``, the model shortcuts, --model and --set."""
    out = {**given(args, flags), **{MODEL_SHORTCUTS[k][0]: v for k, v in vars(args).items() if k in MODEL_SHORTCUTS}}
    model = pairs(getattr(args, "model_options", None), "--model", "n_layers=8")
    out.update({f"model.{k}": v for k, v in model.items()})
    return {**out, **pairs(getattr(args, "set", None), "--set", "steps=500")}


def declared(cls: type, args: argparse.Namespace, source: str, skip: tuple[str, ...] = (), **fixed: object) -> Any:
    """A command's configuration from the flags it was given (text, parsed by each setting's type);
    ``skip``: declared settings the command decides itself (passed in ``fixed``)."""
    values = {k: v for k, v in given(args, leaves(cls)).items() if k not in skip}
    return build(cls, values, source, from_text=True, as_flags=True, **fixed)


def settings_keys(args: argparse.Namespace) -> set[str]:
    """The names of the run settings the user gave (flags, --set, --model, the --config file), e.g. {"lr", "out"}."""
    keys = list(overrides(args, *LEAVES))
    if getattr(args, "config", None):
        keys += list(flatten_settings(read_toml(args.config, "config file"), args.config))
    return {resolve_key(k)[1] if resolve_key(k)[0] == "leaf" else k for k in keys}


def train_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then --config FILE (typed TOML), then flags and --set (text): one override function."""
    cfg = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    settings = overrides(args, *LEAVES)
    return cfg.with_(settings, "command line", from_text=True) if settings else cfg


def model_settings(args: argparse.Namespace, source: str, shape_of: str = "", **fixed: str) -> ModelSettings:
    """The model section from a command's shape (--size, the shortcuts, --set model.*) and ``fixed`` (show's
    layout), through the run configuration's one override function: the keys train takes, its checks.
    ``shape_of``: the command that takes only model.* and layout.* settings (others refused, not ignored)."""
    if "layout" in fixed:
        parse_layout(fixed["layout"])  # a bad layout is named in the layout grammar's own words
    other = [k for k in overrides(args) if not k.startswith(("model.", "layout."))]
    if shape_of and other:
        raise ConfigError(
            f"{shape_of} takes model.* and layout.* settings (the model's shape and placement), not {', '.join(other)}"
        )
    return TrainConfig().with_({**fixed, **overrides(args, "size")}, source, from_text=True).model


def grid_values(items: list[str] | None) -> dict[str, list[Any]]:
    """--grid AXIS=V1,V2 (or V1;V2 when a value has commas, as layout strings may), typed per axis."""
    grid = {}
    for item in items or []:
        axis, eq, values = (x.strip() for x in item.partition("="))
        if not eq or not values or not axis:
            raise ConfigError(f"--grid takes AXIS=V1,V2,... (e.g. --grid lr=1e-3,3e-3), got {item!r}")
        texts = [v.strip() for v in values.split(";" if ";" in values else ",") if v.strip()]
        grid[axis] = [typed({axis: v}, f"--grid {axis}")[axis] for v in texts]
    return grid
