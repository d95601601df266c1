"""The stored sections of a run's configuration (normlab.config.train.TrainConfig): the model (a layout and a size
with its options), the data, the optimizer and the run (precision, device, evaluation, output); each leaf a typed
field whose metadata holds its doc, valid values and whether it is part of the run's identity. The hooks' own
sections are normlab.config.hooks."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from normlab.config.optimizers import OPTIMIZER_NAMES
from normlab.errors import ConfigError
from normlab.layout import Layout, parse_layout
from normlab.layout.sites import ResolvedLayout
from normlab.model.config import SIZES, ModelConfig, get_size
from normlab.settings import (
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
    """Where and how a run computes and what it records besides its hooks' own sections (normlab.config.hooks)."""

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
    eval_every: int = setting(
        100, "validation every N steps and at the end (0: only at the end)", identity=False, check=nonneg
    )
    eval_batches: int = setting(8, "validation batches (of batch_size windows) per evaluation", check=positive)
    out: str = setting("runs/run", "the run directory", identity=False)
    resume: bool = setting(True, "continue from the newest checkpoint in `out` if one exists", identity=False)
