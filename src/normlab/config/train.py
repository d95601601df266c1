"""The run configuration: one typed declaration behind train, sweep, compare, resume and the screen.

`TrainConfig` is frozen sections, each leaf a typed field whose metadata holds its doc, its
valid values and whether it is part of the run's *identity* (what the run computes or reports as
its result; the rest says where and how it runs and reports):

    TrainConfig
    ├── model: ModelSettings   layout (a Layout), size, options (ModelConfig overrides), init_from
    ├── data:  DataSettings    corpus, tokenizer, task, seq_len, batch_size, grad_accum, ...
    ├── optim: OptimSettings   optimizer (AdamW, SGD, Muon), lr schedule, betas, clipping, QK-clip, z-loss, steps, seed
    ├── run:   RunSettings     precision, device, evaluation, output, resume
    └── probes, tier, divergence, checkpointing, loggers, warnings, faults: the built-in hooks' sections
                               (normlab.config.hooks)

Every setting is addressed by one key, the same everywhere (`train --set`, flags, TOML, `sweep
--grid/--set`, `compare --set`, the screen):
- a leaf's name, `lr`, `seq_len`, or with its section, `optim.lr`;
- `model.NAME` for a model option (a `ModelConfig` field overriding the size preset);
- `layout.NAME` for a layout option (h, norm, alpha, init, inner): it edits the `Layout` itself.
`apply_settings` is the one function that applies such keys: it type-checks each value (strings
from a command line are parsed; TOML/JSON values must already have the right type), rejects
NaN/inf, checks ranges and choices, and validates the layout against the model's depth.

A configuration is built and validated once: `ModelSettings` holds the `ModelConfig` (the size preset
with the options applied) and the `Layout`, resolved at the model's depth once per process. The stored
form (`to_dict`, `from_dict`) is nested, one table per section: config.json, checkpoints and sweep.db
hold it. The flat form they held before is read through `migrate`, the one migration; `to_flat` is
that form's canonical spelling, which run ids hash, so the same settings keep their ids. Defaults follow the
papers' protocol where it applies at small scale: AdamW (beta2 0.95, Zhuo Table 7), warmup 10% then
cosine (Kim Table 2) to lr/10 (Zhuo's min LR ratio), clipping at 1.0, weight decay 0.1 without decay
on norms, biases and embeddings.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from normlab.config.hooks import (
    HOOK_SECTIONS,
    MOVED,
    RUN_ORDER,
    CheckpointSettings,
    DivergenceSettings,
    FaultSettings,
    LoggerSettings,
    ProbeSettings,
    QKSpectrumSettings,
    TierSettings,
    WarningSettings,
)
from normlab.config.optimizers import OPTIMIZERS
from normlab.config.sections import (
    DataSettings,
    ModelSettings,
    OptimSettings,
    RunSettings,
    _parse_layout,
)
from normlab.errors import ConfigError, LayoutError
from normlab.layout import Layout
from normlab.layout.spec import check_option
from normlab.layout.spec import edit_layout as spec_edit_layout
from normlab.model.config import POSITIONS, ModelConfig
from normlab.settings import (
    Leaf,
    build,
    coerce,
    leaves,
)

STORED: dict[str, type] = {"model": ModelSettings, "data": DataSettings, "optim": OptimSettings, "run": RunSettings}
SECTIONS: dict[str, type] = {**STORED, **HOOK_SECTIONS}  # the hooks' sections: normlab.config.hooks


def _leaves() -> dict[str, Leaf]:
    """Every leaf by name: the model's, data's and optimizer's, then the run's in the stored form's order (the
    hooks' sections' leaves among them, where the run section held them), which flags and run ids follow."""
    every = {name: leaf for sec, cls in SECTIONS.items() for name, leaf in leaves(cls, sec).items()}
    head = {k: v for k, v in every.items() if v.section in ("model", "data", "optim")}
    return {**head, **{name: every[name] for name in RUN_ORDER}}


LEAVES: dict[str, Leaf] = _leaves()
IDENTITY: tuple[str, ...] = tuple(k for k, leaf in LEAVES.items() if leaf.identity and k != "options") + ("model",)
_MODEL_HINTS = typing.get_type_hints(ModelConfig)
MODEL_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(ModelConfig))


# --- value checking ---------------------------------------------------------------------------------


def _model_option(key: str, name: str, value: Any, from_text: bool = False) -> Any:
    if name not in MODEL_OPTIONS:
        close = difflib.get_close_matches(name, MODEL_OPTIONS, n=1)
        hint = f" (did you mean model.{close[0]}?)" if close else ""
        raise ConfigError(f"{key}: {name!r} is not a model option{hint}; valid: {', '.join(MODEL_OPTIONS)}")
    # mlp's choices come from its Literal annotation; position is a plain str with a list of values
    choices = POSITIONS if name == "position" else None
    return coerce(key, value, _MODEL_HINTS[name], choices=choices, from_text=from_text)


# --- keys -------------------------------------------------------------------------------------------


def resolve_key(key: str) -> tuple[str, str]:
    """A setting key -> (kind, name): ("leaf", "lr"), ("model", "n_layers") or ("layout", "h")."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"a setting key must be a non-empty string, got {key!r}")
    head, dot, rest = key.partition(".")
    if dot:
        if head == "layout":  # any token of the layout grammar (layout/spec.py), checked by it
            return "layout", rest
        if head == "model":
            if rest in LEAVES and LEAVES[rest].section == "model" and rest != "options":
                return "leaf", rest  # model.layout, model.size, model.init_from
            if rest not in MODEL_OPTIONS:
                _model_option(key, rest, None)  # raises, naming the closest option
            return "model", rest
        if head in SECTIONS and rest in LEAVES and LEAVES[rest].section == head and rest != "options":
            return "leaf", rest
        if head == "run" and rest in MOVED:  # its key before the hooks had their own sections
            return "leaf", rest
        raise ConfigError(f"unknown setting {key!r}; " + _suggest(key))
    if key in LEAVES and key != "options":
        return "leaf", key
    raise ConfigError(f"unknown setting {key!r}; " + _suggest(key))


def _suggest(key: str) -> str:
    names = [k for k in LEAVES if k != "options"]
    close = difflib.get_close_matches(key.split(".")[-1], names + list(MODEL_OPTIONS), n=1)
    hint = ""
    if close:
        hint = f"did you mean {'model.' if close[0] in MODEL_OPTIONS and close[0] not in LEAVES else ''}{close[0]}? "
    return hint + "valid: the settings in `normlab train --help`, model.NAME (model options) or layout.NAME"


def flatten_settings(data: Mapping[str, Any], source: str = "settings") -> dict[str, Any]:
    """Tables ({"model": {...}}, {"optim": {...}}) as dotted keys; the "model" table holds model options."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a table of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "hook":  # a user hook's own settings ([hook.Class]: normlab train --hook), not the run's
            continue
        if isinstance(value, Mapping):
            if key not in SECTIONS and key != "layout":
                raise ConfigError(
                    f"{source}: [{key}] is not a table of settings; tables: model (model options), "
                    f"{', '.join(s for s in SECTIONS if s != 'model')}, layout"
                )
            for sub, inner in value.items():
                if isinstance(inner, Mapping):
                    raise ConfigError(f"{source}: {key}.{sub} is a table; settings are single values")
                out[f"{key}.{sub}"] = inner
        else:
            out[key] = value
    return out


# --- the configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run, in typed sections; build it with `TrainConfig.of(...)`."""

    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    run: RunSettings = field(default_factory=RunSettings)
    probes: ProbeSettings = field(default_factory=ProbeSettings)
    tier: TierSettings = field(default_factory=TierSettings)
    divergence: DivergenceSettings = field(default_factory=DivergenceSettings)
    checkpointing: CheckpointSettings = field(default_factory=CheckpointSettings)
    loggers: LoggerSettings = field(default_factory=LoggerSettings)
    qk_spectrum: QKSpectrumSettings = field(default_factory=QKSpectrumSettings)
    warnings: WarningSettings = field(default_factory=WarningSettings)
    faults: FaultSettings = field(default_factory=FaultSettings)

    def __post_init__(self) -> None:
        self.validate()

    # -- construction --
    @classmethod
    def of(cls, **settings: Any) -> TrainConfig:
        """The defaults with these settings applied (keys as in `apply_settings`)."""
        return apply_settings(cls(), settings, "arguments")

    def with_(self, settings: Mapping[str, Any], source: str = "settings", from_text: bool = False) -> TrainConfig:
        return apply_settings(self, settings, source, from_text)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> TrainConfig:
        """A stored configuration (config.json's "config", a checkpoint's, a sweep row's): the nested form
        of `to_dict`, each section built by the settings engine; an older flat form is read through
        `migrate` first."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a table of settings, got {type(data).__name__}")
        if not is_nested(data):
            data = migrate(data, source)
        prefix = f"{source}: " if source not in ("arguments", "settings") else ""
        try:
            model = dict(data["model"])
            options = model.pop("options", {})
            if not isinstance(options, Mapping):
                raise ConfigError(f"model.options: expected a table of model options, got {options!r}")
            if "layout" in model:
                model["layout"] = _layout_value(model["layout"])
            sections: dict[str, Any] = {
                "model": build(
                    ModelSettings,
                    model,
                    "model",
                    options={k: _model_option(f"model.{k}", k, v) for k, v in options.items()},
                )
            }
            for name in ("data", "optim"):
                sections[name] = build(SECTIONS[name], data[name], name)
            run = dict(data["run"])  # the hooks' settings are read from the run table, where the stored form keeps them
            for name, section in HOOK_SECTIONS.items():
                sections[name] = build(section, {k: run.pop(k) for k in list(run) if MOVED.get(k) == name}, "run")
            sections["run"] = build(RunSettings, run, "run")
            return cls(**sections)
        except (ConfigError, LayoutError) as err:
            raise ConfigError(f"{prefix}{err}") from None

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A TOML file of settings (the keys of `apply_settings`, tables for sections) on the defaults."""
        from normlab.io import read_toml

        cfg = apply_settings(cls(), read_toml(path, "config file"), str(path))
        return apply_settings(cfg, overrides, "arguments") if overrides else cfg

    # -- checks --
    def validate(self) -> None:
        """The checks that span fields (each field checked its own value when it was set)."""
        o, d, r, m = self.optim, self.data, self.run, self.model
        if o.min_lr is not None and o.min_lr > o.lr:
            raise ConfigError(f"min_lr must lie in [0, lr={o.lr}], got {o.min_lr}")
        if d.batch_size % d.grad_accum:
            raise ConfigError(f"batch_size={d.batch_size} must be divisible by grad_accum={d.grad_accum}")
        if r.fsdp and (whole := OPTIMIZERS[o.optimizer].unsharded) is not None:
            raise ConfigError(
                f"{o.optimizer} {whole} and FSDP2 shards them across ranks; with "
                f"--optimizer {o.optimizer} leave --fsdp off (DDP is fine)"
            )
        if r.fsdp and o.qk_clip is not None:
            raise ConfigError(
                "qk_clip rescales each head's rows of W_q and W_k in place, which FSDP2 shards across "
                "ranks; with --qk-clip leave --fsdp off (DDP is fine)"
            )
        if o.optimizer == "sgd" and m.config.parametrization != "sp":
            raise ConfigError(
                f"parametrization={m.config.parametrization} sets Adam's and Muon's per-parameter learning rates; "
                "SGD's muP rule (mup.MuSGD: vector-like lr x m) is not built: use --optimizer adamw or muon"
            )
        try:
            m.resolved  # noqa: B018 - the layout against the model's depth (cached: a sweep resolves each layout once)
        except LayoutError as err:
            raise ConfigError(f"layout {m.layout_label!r} does not fit {m.config.n_layers} layers: {err}") from None
        if (why := m.config.parametrization_problem(m.resolved)) is not None:
            raise ConfigError(why)  # refused with the settings, before a folder is made (NormLM refuses it too)

    def for_device(self, device: str, bf16: bool = True) -> TrainConfig:
        """The settings with their device-dependent defaults decided: precision auto (bf16 on CUDA where the
        GPU has it, else fp32) and compile none (on for CUDA). A run resolves them once, at its start; its
        config.json holds the result, so a resume on another kind of device is a different run."""
        cuda = device.startswith("cuda")
        run = self.run
        precision = run.precision if run.precision != "auto" else ("bf16" if cuda and bf16 else "fp32")
        compile_ = run.compile if run.compile is not None else cuda
        if (precision, compile_) == (run.precision, run.compile):
            return self
        return replace(self, run=replace(run, precision=precision, compile=compile_))

    # -- views --
    @property
    def precision(self) -> str:
        """The precision with ``auto`` read as the CPU's (fp32) until `for_device` decides it."""
        return "fp32" if self.run.precision == "auto" else self.run.precision

    @property
    def stored_dtype(self) -> str:
        """The activation dtype with ``auto`` resolved: fp32, bf16 or fp16."""
        return (
            "fp32"
            if self.run.activation_dtype == "fp32"
            else (self.precision if self.run.activation_dtype == "auto" else self.run.activation_dtype)
        )

    @property
    def loss_scaled(self) -> bool:
        """fp16 anywhere (the products or the stored activations): gradients need dynamic loss scaling."""
        return "fp16" in (self.precision, self.stored_dtype)

    @property
    def expected_vocab(self) -> int:
        """The vocabulary the run will have, from its settings alone (before its data is read): the model
        option or --vocab-size, else bytes' 256 + end-of-text or a BPE's size; a tokenizer file's is only
        known once it is read, so the size preset's stands in."""
        given = self.model.options.get("vocab_size") or self.data.vocab_size
        if given:
            return int(given)
        tok = self.data.tokenizer
        if tok == "bytes":
            return 257
        if tok.startswith("bpe:") and tok[4:].isdigit():
            return int(tok[4:])
        return self.model.model_config().vocab_size

    @property
    def wd_exclusions(self) -> list[str]:
        return [x.strip() for x in self.optim.wd_exclude.split(",") if x.strip()]

    @property
    def lr_floor(self) -> float:
        return self.optim.lr / 10 if self.optim.min_lr is None else self.optim.min_lr

    @property
    def checkpoint_every(self) -> int:
        """ckpt_every, or (0) every 10% of the run, at least 10 and at most 100 steps apart: a killed run
        loses a bounded amount of work (and one killed before its first checkpoint restarts cleanly). The base
        interval: with ckpt_every 0, `normlab.train.ckpt_schedule` stretches it where saves are expensive."""
        return self.checkpointing.ckpt_every or min(100, max(10, self.optim.steps // 10))

    def to_dict(self) -> dict[str, Any]:
        """The stored form (config.json, checkpoints, sweep.db): one JSON object per section, every leaf by
        its name; the model section holds the layout's label, the size preset and the option overrides."""
        out: dict[str, Any] = {"model": self.model.to_dict()}
        for name in ("data", "optim"):
            section = getattr(self, name)
            out[name] = {k: getattr(section, k) for k in leaves(SECTIONS[name])}
        out["run"] = {k: getattr(getattr(self, MOVED.get(k, "run")), k) for k in RUN_ORDER}
        return out

    def to_flat(self) -> dict[str, Any]:
        """The canonical flat form: every leaf by its name, `layout` as its label, `model` the options dict.
        What run ids hash (`identity`) and what the command line spells (`to_args`): the same settings keep
        the ids they had when config.json held this form."""
        out: dict[str, Any] = {}
        for name, leaf in LEAVES.items():
            value = getattr(getattr(self, leaf.section), name)
            if name == "layout":
                value = self.model.layout_label
            elif name == "options":
                out["model"] = dict(value)
                continue
            out[name] = value
        return out

    def identity(self) -> dict[str, Any]:
        """The settings that make up what the run computes and reports (the resume check, sweep ids)."""
        flat = self.to_flat()
        return {k: flat[k] for k in IDENTITY}

    def identity_diff(self, other: TrainConfig) -> list[str]:
        """Identity settings that differ; the layout by structure (a preset equals its string form)."""
        a, b = self.identity(), other.identity()
        diff = [k for k in IDENTITY if k != "layout" and a[k] != b[k]]
        if self.model.layout != other.model.layout:
            diff.insert(0, "layout")
        return diff

    def to_args(self) -> list[str]:
        """The command line that reproduces this config: `normlab train <to_args()>`."""
        args: list[str] = []
        flat, default = self.to_flat(), TrainConfig().to_flat()
        for name, value in flat.items():
            if name == "model":
                args += [x for k, v in sorted(value.items()) for x in ("--model", f"{k}={_text(v)}")]
            elif value == default[name]:
                continue
            elif isinstance(value, bool):
                args.append(("--" if value else "--no-") + name.replace("_", "-"))
            else:
                args += ["--" + name.replace("_", "-"), _text(value)]
        return args


def is_nested(data: Mapping[str, Any]) -> bool:
    """The stored form of `TrainConfig.to_dict`: exactly the four stored sections, each a table."""
    return set(data) == set(STORED) and all(isinstance(v, Mapping) for v in data.values())


def migrate(data: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """The one migration of stored configurations: the flat form (every leaf by its name, `model` the
    table of model options), which config.json, checkpoints and sweep.db held before the nested form,
    as the nested form of `TrainConfig.to_dict`. Checked as it is read: a key no setting has is refused."""
    return apply_settings(TrainConfig(), data, source).to_dict()


def _text(value: Any) -> str:
    return "none" if value is None else repr(value) if isinstance(value, float) else str(value)


def apply_settings(
    cfg: TrainConfig, settings: Mapping[str, Any], source: str = "settings", from_text: bool = False
) -> TrainConfig:
    """`cfg` with `settings` applied: the one override function (see the module docstring).

    `from_text`: the values are command-line strings, parsed by each setting's type; otherwise
    (TOML, JSON, Python) each value must already have its setting's type.

    The `layout` key is applied before `layout.NAME` edits, whatever their order. Each value is
    type-checked and range-checked; the result is validated as a whole (the layout against the
    model's depth included) before anything else runs.
    """
    flat = flatten_settings(settings, source)
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    options = dict(cfg.model.options)
    layout_edits: dict[str, Any] = {}
    layout = cfg.model.layout
    prefix = "" if source in ("arguments", "settings") else f"{source}: "
    try:
        for key, value in flat.items():
            kind, name = resolve_key(key)
            if kind == "model":
                options[name] = _model_option(key, name, value, from_text)
            elif kind == "layout":
                layout_edits[name] = value
            elif name == "layout":
                layout = _layout_value(value)
            else:
                leaf = LEAVES[name]
                sections[leaf.section][name] = coerce(key, value, leaf.type, leaf.choices, leaf.check, from_text)
        if layout_edits:
            layout = edit_layout(layout, layout_edits)
        sections["model"].update(layout=layout, options=options)
        new = {name: replace(getattr(cfg, name), **vals) for name, vals in sections.items()}
        return TrainConfig(**new)
    except (ConfigError, LayoutError) as err:
        raise ConfigError(f"{prefix}{err}") from None


def _layout_value(value: Any) -> Layout:
    if isinstance(value, Layout):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"layout: expected a preset name or string form, got {value!r} ({type(value).__name__})")
    return _parse_layout(value)


def edit_layout(layout: Layout, edits: Mapping[str, Any]) -> Layout:
    """Layout options (``layout.h``, ``layout.alpha``, ``layout.norm.B``, ...) appended to the layout's string as
    tokens of the layout grammar and parsed with it (`normlab.layout.spec.edit_layout`): one parser for
    ``--layout``, ``--set layout.X``, a TOML ``[layout]`` table and a sweep axis. Labelled by that string
    (``peri`` with h=0.5 is ``peri,h=0.5``)."""
    return spec_edit_layout(
        layout.name or layout.to_string(), {k: typed_value(f"layout.{k}", v) for k, v in edits.items()}
    )


def typed_value(key: str, value: Any, from_text: bool = False) -> Any:
    """One setting's value, type-checked (and parsed, if a string) for its key; a layout and the
    values of layout options keep their spelling, since a layout's label is made of them."""
    kind, name = resolve_key(key)
    if kind == "model":
        return _model_option(key, name, value, from_text)
    if kind == "layout":  # numbers given as text read as numbers (a sweep id spells 0.5 one way); the grammar checks
        if isinstance(value, str):
            for parse in (int, float):
                try:
                    value = parse(value)
                    break
                except ValueError:
                    pass
        check_option(name, value)
        return value
    if name == "layout":
        if not isinstance(value, (str, Layout)):
            raise ConfigError(f"layout: expected a preset name or string form, got {value!r} ({type(value).__name__})")
        return value
    leaf = LEAVES[name]
    return coerce(key, value, leaf.type, leaf.choices, leaf.check, from_text)


def typed_settings(settings: Mapping[str, Any], source: str = "settings", from_text: bool = False) -> dict[str, Any]:
    """Settings as flat keys with checked, typed values (a sweep's base and grid values, `--set`)."""
    try:
        return {k: typed_value(k, v, from_text) for k, v in flatten_settings(settings, source).items()}
    except (ConfigError, LayoutError) as err:
        raise ConfigError(f"{source}: {err}" if source not in ("settings", "arguments") else str(err)) from None
