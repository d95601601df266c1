"""`TrainConfig`: every setting of a run, typed and documented, with a command-line round trip.

Defaults follow the papers' protocol where it applies at small scale: AdamW (beta2 0.95, Zhuo
Table 7), warmup 10% then cosine (Kim Table 2) to lr/10 (Zhuo's min LR ratio), clipping at 1.0,
weight decay 0.1 without decay on norms, biases and embeddings.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from normlab.model.config import ConfigError, ModelConfig

WD_EXCLUDABLE = ("norms", "biases", "embeddings")


@dataclass
class TrainConfig:
    # --- model ---
    layout: str = "peri"  # preset name or string form (see `normlab layouts`)
    size: str = "tiny"  # size preset
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides, e.g. {"n_layers": 8}
    # --- data ---
    data: str = "shakespeare"  # text file/folder, .jsonl, .bin, "shakespeare" or "stdlib"
    tokenizer: str = "bytes"  # bytes | bpe:VOCAB | path to a tokenizer.json (or its folder)
    text_field: str = "text"  # JSONL field holding the text
    token_dtype: str = "uint16"  # dtype of a .bin token file
    vocab_size: int | None = None  # required for .bin data; else the tokenizer's
    val_fraction: float = 0.1
    task: Literal["lm", "sft"] = "lm"  # lm: next-token on all text; sft: JSONL prompt/response, loss on responses only
    prompt_field: str = "prompt"  # SFT: the JSONL field of the prompt
    response_field: str = "response"  # SFT: the JSONL field of the response
    init_from: str | None = None  # start from these weights: a run dir, a checkpoint, or a transformers folder
    seq_len: int = 128
    batch_size: int = 32  # global sequences per optimizer step (all ranks, all micro-batches)
    grad_accum: int = 1  # micro-batches per optimizer step (per rank)
    # --- optimization ---
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3
    min_lr: float | None = None  # cosine floor; None: lr / 10
    warmup: float = 0.1  # fraction of steps with linear warmup
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # SGD
    weight_decay: float = 0.1
    wd_exclude: str = "norms,biases,embeddings"  # comma list from: norms, biases, embeddings ("" decays all)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    z_loss: float = 0.0  # coefficient of the z-loss log(Z)^2 (PaLM); 0 disables
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # fp16 uses dynamic loss scaling
    compile: bool = False  # torch.compile the model
    steps: int = 300
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    fsdp: bool = False  # under torchrun: FSDP2 sharding instead of DDP
    # --- divergence ---
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf loss or gradient: stop (diverged) or skip the step
    diverge_patience: int = 50  # diverged if the loss stays above its initial value this many steps (0: off)
    diverge_final_loss: float | None = None  # diverged if the final loss ends above this
    # --- diagnostics ---
    probe_every: int = 100  # probe pass every N steps, at step 0 and at the end (0: off); see docs/diagnostics.md
    probe_batch: int = 8  # sequences in the fixed probe batch (the first validation windows)
    # --- evaluation, logging, checkpoints ---
    eval_every: int = 100  # validation every N steps and at the end (0: only at the end)
    eval_batches: int = 8
    out: str = "runs/run"
    ckpt_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2
    resume: bool = True  # continue from the newest checkpoint in `out` if one exists
    progress: bool = True  # progress bar
    tensorboard: bool = False  # needs the tensorboard extra
    wandb: bool = False  # needs the wandb extra; WANDB_MODE=offline works without a network

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "keep_last", "probe_batch")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("eval_every", "ckpt_every", "diverge_patience", "probe_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr must lie in [0, lr={self.lr}], got {self.min_lr}")
        if not 0 <= self.warmup < 1:
            raise ConfigError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.z_loss < 0:
            raise ConfigError("weight_decay, grad_clip and z_loss must be >= 0")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"optimizer must be adamw or sgd, got {self.optimizer!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite must be stop or skip, got {self.on_nonfinite!r}")
        if self.task not in ("lm", "sft"):
            raise ConfigError(f"task must be lm or sft, got {self.task!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        bad = [x for x in self.wd_exclusions if x not in WD_EXCLUDABLE]
        if bad:
            raise ConfigError(f"wd_exclude: unknown {bad}; valid: {', '.join(WD_EXCLUDABLE)}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}")
        if self.fsdp and self.probe_every:
            raise ConfigError("probes need the whole model on one rank; with --fsdp set --probe-every 0")
        ModelConfig().with_(**self.model)  # unknown model options fail here, with suggestions

    @property
    def wd_exclusions(self) -> list[str]:
        return [x.strip() for x in self.wd_exclude.split(",") if x.strip()]

    @property
    def lr_floor(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_args(self) -> list[str]:
        """The command line that reproduces this config: `normlab train <to_args()>`."""
        args: list[str] = []
        default = TrainConfig()
        for f in fields(self):
            value, dflt = getattr(self, f.name), getattr(default, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.name == "model":
                for k, v in sorted(value.items()):
                    args += ["--model", f"{k}={v}"]
            elif value == dflt:
                continue
            elif isinstance(value, bool):
                args.append(flag if value else "--no-" + f.name.replace("_", "-"))
            else:
                args += [flag, "none" if value is None else repr(value) if isinstance(value, float) else str(value)]
        return args

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        from normlab.io import read_toml

        return cls.from_dict({**read_toml(path, "config file"), **overrides}, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> TrainConfig:
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            import difflib

            hints = [f"{k} (did you mean {difflib.get_close_matches(k, valid, n=1)[0]}?)"
                     if difflib.get_close_matches(k, valid, n=1) else k for k in unknown]
            raise ConfigError(f"{source}: unknown setting(s) {', '.join(hints)}")
        return cls(**data)


def field_type(name: str) -> type:
    """The scalar type of a TrainConfig field (Optional and Literal unwrapped)."""
    hints = typing.get_type_hints(TrainConfig)
    t = hints[name]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    if typing.get_origin(t) is Literal:
        return str
    return t
