"""The run configuration: one typed declaration behind train, sweep, compare, resume and the screen.

`TrainConfig` is four frozen sections, each leaf a typed field whose metadata holds its doc, its
valid values and whether it is part of the run's *identity* (what the run computes or reports as
its result; the rest says where and how it runs and reports):

    TrainConfig
    ├── model: ModelSettings   layout (a Layout), size, options (ModelConfig overrides), init_from
    ├── data:  DataSettings    corpus, tokenizer, task, seq_len, batch_size, grad_accum, ...
    ├── optim: OptimSettings   optimizer (AdamW, SGD, Muon), lr schedule, betas, clipping, QK-clip, z-loss, steps, seed
    └── run:   RunSettings     precision, divergence rules, probes, evaluation, checkpoints, output

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
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from normlab.config.optimizers import OPTIMIZER_NAMES
from normlab.errors import ConfigError, LayoutError
from normlab.layout import Layout, parse_layout
from normlab.layout.sites import ResolvedLayout
from normlab.layout.spec import check_option
from normlab.layout.spec import edit_layout as spec_edit_layout
from normlab.model.config import POSITIONS, SIZES, ModelConfig, get_size
from normlab.settings import (
    Leaf,
    build,
    coerce,
    leaves,
    nonneg,
    open_unit,
    positive,
    setting,
    unit,
)

WD_EXCLUDABLE = ("norms", "biases", "embeddings")
SEED_LIMIT = 2**32  # numpy's generators take seeds below 2^32


# --- field declarations ---------------------------------------------------------------------------


def _seed(v: Any) -> str | None:
    return None if 0 <= v < SEED_LIMIT else f"must lie in [0, 2^32) (numpy's generators), got {v}"


def _spike_window(v: int) -> str | None:
    return None if v >= 20 else f"must be >= 20 (the skip rule needs max(20, window/2) values in its window), got {v}"


def _wd_exclude(v: str) -> str | None:
    bad = [x.strip() for x in v.split(",") if x.strip() and x.strip() not in WD_EXCLUDABLE]
    return f'unknown {bad}; valid: a comma list of {", ".join(WD_EXCLUDABLE)}, or ""' if bad else None


def _ns_steps(v: int) -> str | None:
    return None if 1 <= v < 100 else f"must lie in [1, 100) (torch.optim.Muon's limit), got {v}"


def _default_layout() -> Layout:
    return parse_layout("peri")


@dataclass(frozen=True)
class ModelSettings:
    layout: Layout = setting(_default_layout, "preset name or string form (see `normlab layouts`)")
    size: str = setting("tiny", "size preset", choices=tuple(SIZES))
    options: dict[str, Any] = setting(dict, "ModelConfig overrides of the size preset, e.g. model.n_layers=8")
    init_from: str | None = setting(None, "start from these weights: a run dir, a checkpoint, or a transformers folder")
    # The size preset with the options applied: built (and validated) once, when the section is made.
    config: ModelConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            raise ConfigError(
                f"layout must be a Layout, a preset name or a string form, not {type(self.layout).__name__}"
            )
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "config", get_size(self.size).with_(**self.options))

    @property
    def layout_label(self) -> str:
        """The layout as the user spelled it (a preset name, or a string form)."""
        return self.layout.name or self.layout.to_string()

    @property
    def resolved(self) -> ResolvedLayout:
        """The layout at the model's depth (resolved once per layout and depth in a process)."""
        return resolve_layout(self.layout, self.config.n_layers)

    def model_config(self, **extra: Any) -> ModelConfig:
        """The model's configuration; `extra` overrides on top (a data set's vocabulary, a sequence length)."""
        return self.config.with_(**extra) if extra else self.config

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout_label,
            "size": self.size,
            "options": dict(self.options),
            "init_from": self.init_from,
        }


@functools.lru_cache(maxsize=256)
def resolve_layout(layout: Layout, n_layers: int) -> ResolvedLayout:
    """`layout.resolve(n_layers)`, once per (layout, depth): a sweep's runs share their layouts' resolutions."""
    return layout.resolve(n_layers)


@functools.lru_cache(maxsize=256)
def _parse_layout(text: str) -> Layout:
    layout = parse_layout(text)
    return layout if layout.name else replace(layout, name=text)


@dataclass(frozen=True)
class DataSettings:
    data: str = setting(
        "shakespeare",
        "text file/folder, .jsonl, .bin, a prepared folder, or a corpus name "
        "(shakespeare, english, stdlib: normlab.data.corpora)",
    )
    tokenizer: str = setting("bytes", "bytes | bpe:VOCAB | path to a tokenizer.json (or its folder)")
    text_field: str = setting("text", "JSONL field holding the text")
    token_dtype: str = setting("uint16", "dtype of a .bin token file", choices=("uint16", "uint32"))
    vocab_size: int | None = setting(None, "required for .bin data; else the tokenizer's", check=positive)
    val_fraction: float = setting(0.1, "fraction of the data held out for validation", check=open_unit)
    task: Literal["lm", "sft"] = setting(
        "lm", "lm: next-token on all text; sft: JSONL prompt/response, loss on responses only", choices=("lm", "sft")
    )
    prompt_field: str = setting("prompt", "SFT: the JSONL field of the prompt")
    response_field: str = setting("response", "SFT: the JSONL field of the response")
    seq_len: int = setting(128, "tokens per training sequence", check=positive)
    batch_size: int = setting(32, "global sequences per optimizer step (all ranks, all micro-batches)", check=positive)
    grad_accum: int = setting(1, "micro-batches per optimizer step (per rank)", check=positive)


@dataclass(frozen=True)
class OptimSettings:
    optimizer: str = setting(
        "adamw",
        "adamw | sgd | muon (torch.optim.Muon on the blocks' 2-D matrices, AdamW on the rest: normlab.train.optim)",
        choices=OPTIMIZER_NAMES,  # the rows of normlab.config.optimizers
    )
    lr: float = setting(3e-3, "peak learning rate", check=positive)
    min_lr: float | None = setting(None, "cosine floor; none: lr / 10", check=nonneg)
    warmup: float = setting(0.1, "fraction of steps with linear warmup", check=unit)
    beta1: float = setting(0.9, "AdamW beta1", check=unit)
    beta2: float = setting(0.95, "AdamW beta2", check=unit)
    eps: float = setting(1e-8, "AdamW epsilon", check=positive)
    momentum: float = setting(0.9, "SGD momentum", check=unit)
    muon_momentum: float = setting(0.95, "Muon's momentum (torch's and Keller Jordan's default)", check=unit)
    muon_nesterov: bool = setting(True, "Muon: Nesterov momentum (torch's default)")
    muon_ns_steps: int = setting(
        5, "Muon: Newton-Schulz iterations per matrix per step (torch's default)", check=_ns_steps
    )
    muon_ns_dtype: Literal["bf16", "fp32"] = setting(
        "bf16",
        "Muon: the dtype of the Newton-Schulz iteration: bf16 (torch's) or fp32 (the same iteration without bf16's "
        "rounding; on a CPU without bf16 instructions about 30x faster: normlab.train.muon_fp32)",
        choices=("bf16", "fp32"),
    )
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = setting(
        "match_rms_adamw",
        "Muon's lr per matrix shape (A, B): match_rms_adamw, lr * 0.2 sqrt(max(A, B)) (Moonshot, "
        "arXiv 2502.16982: AdamW's lr and weight decay carry over), or original, lr * sqrt(max(1, A/B)) (Keller "
        "Jordan)",
        choices=("match_rms_adamw", "original"),
    )
    muon_adamw_lr: float | None = setting(
        None,
        "Muon runs: the peak lr of the AdamW groups (embeddings, head, norms, scales, biases); none: lr",
        check=positive,
    )
    muon_weight_decay: float | None = setting(
        None, "Muon runs: the Muon matrices' decoupled weight decay; none: weight_decay", check=nonneg
    )
    qk_clip: float | None = setting(
        None,
        "QK-clip's tau (Kimi K2's MuonClip, arXiv 2507.20534; they used 100): "
        "after each step, a head whose max attention logit exceeded tau has W_q, W_k "
        "(or its QK-norm gains) scaled back to tau; none: off",
        check=positive,
    )
    weight_decay: float = setting(0.1, "decoupled weight decay", check=nonneg)
    wd_exclude: str = setting(
        "norms,biases,embeddings", 'comma list from: norms, biases, embeddings ("" decays all)', check=_wd_exclude
    )
    # The gain's own policy by what a norm feeds (arXiv 2605.26895: weight decay helps the gains of norms that feed a
    # linear map and hurts those after a sublayer); the kinds are normlab.layout.sites.GAIN_KINDS
    wd_input_gains: float | None = setting(
        None,
        "weight decay of the input norms' gains (sites A, H, q, k, v, c and the final norm: they feed a linear map) "
        "as a multiple of weight_decay (1: as the weights, 0: none); none: wd_exclude decides",
        check=nonneg,
    )
    wd_output_gains: float | None = setting(
        None,
        "weight decay of the output norms' gains (sites B, C and the embedding norm: after a sublayer or the add) as "
        "a multiple of weight_decay; none: wd_exclude decides",
        check=nonneg,
    )
    lr_input_gains: float = setting(1.0, "learning-rate multiplier of the input norms' gains", check=positive)
    lr_output_gains: float = setting(1.0, "learning-rate multiplier of the output norms' gains", check=positive)
    grad_clip: float = setting(
        1.0, "max global grad norm; 0 disables clipping (the norm is still logged)", check=nonneg
    )
    z_loss: float = setting(0.0, "coefficient of the z-loss log(Z)^2 (PaLM); 0 disables", check=nonneg)
    steps: int = setting(300, "optimizer steps", check=positive)
    seed: int = setting(0, "seed of the init, the batches and the probes", check=_seed)


@dataclass(frozen=True)
class RunSettings:
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto",
        "the dtype the products compute in (autocast; fp16 uses dynamic loss scaling); auto: bf16 on a "
        "GPU that has it (twice TF32's peak on an H100), fp32 on the CPU",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    activation_dtype: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto",
        "the dtype activations and the residual stream are stored in (auto: the precision's, as Megatron's "
        "fp16/bf16 that the papers trained with); fp16 with precision fp32 emulates fp16 storage on a CPU: "
        "values past 65504 become inf (normlab.model.storage, docs/training.md)",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    compile: bool | None = setting(None, "torch.compile the model (none: on CUDA, off on the CPU)", identity=False)
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "auto | cpu | cuda", identity=False, choices=("auto", "cpu", "cuda")
    )
    fsdp: bool = setting(
        False,
        "under torchrun: FSDP2 sharding instead of DDP (checkpoints sharded with torch.distributed.checkpoint)",
        identity=False,
    )
    activation_checkpointing: bool = setting(
        False,
        "keep only each block's input for the backward and recompute the block (memory of one block's "
        "activations instead of all; about a third more compute)",
        identity=False,
    )
    loss_chunk: int = setting(
        4096,
        "compute the loss over chunks of this many tokens, so the float32 logits of "
        "the whole micro-batch never exist at once (0: one pass)",
        identity=False,
        check=nonneg,
    )
    tf32: bool = setting(True, "precision fp32 on CUDA: TF32 tensor-core matmuls", identity=False)
    loss_scale_init: float = setting(
        65536.0, "fp16: the loss scaler's initial scale (torch's default, 2^16)", check=positive
    )
    max_overflow_streak: int = setting(
        20,
        "fp16: diverged after this many consecutive steps whose gradients overflowed (each halves the loss scale)",
        check=positive,
    )
    min_loss_scale: float = setting(
        1.0,
        "fp16: diverged once the loss scale falls below this (the gradients overflow FP16 even unscaled)",
        check=positive,
    )
    on_nonfinite: Literal["stop", "skip"] = setting(
        "stop", "a NaN/Inf loss or gradient: stop (diverged) or skip the step", choices=("stop", "skip")
    )
    max_skipped: float = setting(
        0.1,
        "with on_nonfinite=skip: diverged once more than this fraction of the steps so far (after 10) were skipped",
        check=open_unit,
    )
    on_spike: Literal["count", "skip"] = setting(
        "count",
        "a loss or gradient-norm spike (OLMo-core's skip rule: more than spike_sigmas sample std from the "
        "mean of the previous spike_window steps): count it, or skip the step (rerun on the pre-step weights, "
        "attributed, its batch saved; bounded by max_skipped with the non-finite skips)",
        choices=("count", "skip"),
    )
    spike_window: int = setting(
        128, "steps in the spike rule's window (it applies once max(20, window/2) are known)", check=_spike_window
    )
    spike_sigmas: float = setting(6.0, "standard deviations from the window's mean that make a spike", check=positive)
    layer_stats: bool = setting(
        True,
        "the per-step tier: per layer, the stream's largest |x|, gradient norm, update "
        "RMS and update/weight ratio, the largest attention logit per head (layers.jsonl; "
        "docs/diagnostics.md)",
        identity=False,
    )
    layer_stats_every: int = setting(
        1,
        "the per-step tier's interval: its row every N steps (1: every step); the steps between skip its work, and "
        "its per-layer spike rule and summary maxima see every Nth step only. On an H100 at gpu-126m, eager, the "
        "tier added 15-25% to a step (docs/benchmarks.md)",
        identity=False,
        check=positive,
    )
    qk_spectrum_every: int = setting(
        0,
        "the QK spectral entropy probe's interval (normlab.diagnostics.qk_spectrum: each head's W_q^T W_k form and its "
        "step's first-order change, two small factorizations per head, one host read): a row to qk_spectrum.jsonl "
        "every N steps for the early warnings (0: off)",
        identity=False,
        check=nonneg,
    )
    early_warnings: bool = setting(
        True,
        "alert while training when a signal predicts trouble (stream or attention-logit growth toward the "
        "precision's limit, gradient-norm, loss and update/weight spikes, the spike score): a line on stderr, "
        "warnings.jsonl, TensorBoard/W&B events (normlab.diagnostics.early_warning)",
        identity=False,
    )
    fault: Literal["none", "lr_jump", "corrupt_batch", "logit_growth"] = setting(
        "none",
        "a fault injected from step fault_step, for the early-warning study (normlab.train.faults): lr_jump (the "
        "learning rate x fault_scale from then on), corrupt_batch (fault_scale steps of batches of one repeated "
        "token), logit_growth (W_q and W_k x sqrt(fault_scale) after every step: the logits grow x fault_scale a "
        "step)",
        choices=("none", "lr_jump", "corrupt_batch", "logit_growth"),
    )
    fault_step: int = setting(0, "the step the fault starts at", check=nonneg)
    fault_scale: float = setting(10.0, "the fault's size (see fault)", check=positive)
    diverge_patience: int = setting(
        50, "diverged if the loss stays above its initial value this many steps (0: off)", check=nonneg
    )
    diverge_final_loss: float | None = setting(None, "diverged if the final loss ends above this", check=positive)
    stall_margin: float = setting(
        0.05,
        "stalled if the final loss ends within this fraction of the corpus's unigram "
        "loss (or above it) and improved by less than a fifth of that over the last "
        "quarter of the run (0: off); see normlab.train.divergence",
        identity=False,
        check=nonneg,
    )
    probe_every: int = setting(
        100,
        "probe pass every N steps, at step 0 and at the end (0: off); see docs/diagnostics.md",
        identity=False,
        check=nonneg,
    )
    probe_batch: int = setting(
        8, "sequences in the fixed probe batch (the first validation windows)", identity=False, check=positive
    )
    eval_every: int = setting(
        100, "validation every N steps and at the end (0: only at the end)", identity=False, check=nonneg
    )
    eval_batches: int = setting(8, "validation batches (of batch_size windows) per evaluation", check=positive)
    out: str = setting("runs/run", "the run directory", identity=False)
    ckpt_every: int = setting(
        0,
        "checkpoint every N steps (0: every 10% of the run, 10 to 100 steps apart, stretched where a save "
        "takes a second or more so saving costs at most 5% of the training time); a checkpoint always ends the run",
        identity=False,
        check=nonneg,
    )
    keep_last: int = setting(2, "checkpoints kept", identity=False, check=positive)
    keep_optimizer: bool = setting(
        True,
        "the run's final checkpoint keeps the optimizer state (to train it further "
        "with --init-from or a longer schedule); off: the model only, a third of the "
        "size with AdamW (sweeps default to off)",
        identity=False,
    )
    resume: bool = setting(True, "continue from the newest checkpoint in `out` if one exists", identity=False)
    progress: bool = setting(True, "progress bar", identity=False)
    tensorboard: bool = setting(False, "needs the tensorboard extra", identity=False)
    wandb: bool = setting(False, "needs the wandb extra; WANDB_MODE=offline works without a network", identity=False)


SECTIONS: dict[str, type] = {"model": ModelSettings, "data": DataSettings, "optim": OptimSettings, "run": RunSettings}


def _leaves() -> dict[str, Leaf]:
    return {name: leaf for sec, cls in SECTIONS.items() for name, leaf in leaves(cls, sec).items()}


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
    """Every setting of a run, in four typed sections; build it with `TrainConfig.of(...)`."""

    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    run: RunSettings = field(default_factory=RunSettings)

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
            for name in ("data", "optim", "run"):
                sections[name] = build(SECTIONS[name], data[name], name)
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
        if r.fsdp and o.optimizer == "muon":
            raise ConfigError(
                "muon orthogonalizes whole matrices and FSDP2 shards them across ranks; with "
                "--optimizer muon leave --fsdp off (DDP is fine)"
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
        return self.run.ckpt_every or min(100, max(10, self.optim.steps // 10))

    def to_dict(self) -> dict[str, Any]:
        """The stored form (config.json, checkpoints, sweep.db): one JSON object per section, every leaf by
        its name; the model section holds the layout's label, the size preset and the option overrides."""
        out: dict[str, Any] = {"model": self.model.to_dict()}
        for name in ("data", "optim", "run"):
            section = getattr(self, name)
            out[name] = {k: getattr(section, k) for k in leaves(SECTIONS[name])}
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
    """The stored form of `TrainConfig.to_dict`: exactly the four sections, each a table."""
    return set(data) == set(SECTIONS) and all(isinstance(v, Mapping) for v in data.values())


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
