"""A run's model: built once, the same way, for the trainer, export and evaluation.

`build_run_model` is the one place that turns a run's settings into a `NormLM` (the size preset with
the run's model options, the vocabulary of its data, a context long enough for its sequences);
`load_run_model` rebuilds a finished run's model from a checkpoint with it, and `run_tokenizer`
gives back the tokenizer the run trained with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.config.train import TrainConfig
from normlab.errors import CheckpointError, ConfigError, DataError
from normlab.layout import Layout
from normlab.model.lm import NormLM
from normlab.runs.files import RunDir


def build_run_model(
    layout: Layout | str, size: str, options: Mapping[str, Any], seq_len: int, vocab_size: int, seed: int = 0
) -> NormLM:
    """The model a run trains: `size` with the run's model `options`, ``vocab_size`` the data's unless the
    options set a larger one, and ``max_seq_len`` at least the run's `seq_len`. Refuses, before anything
    is built, a vocabulary below the data's or a context shorter than the run's sequences."""
    from normlab.model.build import build_model
    from normlab.model.config import get_size

    overrides = {"vocab_size": vocab_size, **options}
    overrides.setdefault("max_seq_len", max(seq_len, get_size(size).max_seq_len))
    if overrides["vocab_size"] < vocab_size:
        raise ConfigError(
            f"vocab_size={overrides['vocab_size']} is below the tokenizer's {vocab_size} ids; "
            f"give at least {vocab_size} (or leave it out: the tokenizer's size is used)"
        )
    if overrides["max_seq_len"] < seq_len:
        raise ConfigError(
            f"max_seq_len={overrides['max_seq_len']} is below seq_len={seq_len}; give "
            f"max_seq_len >= {seq_len} or a shorter --seq-len"
        )
    return build_model(layout, size, seed=seed, **overrides)


@dataclass
class RunModel:
    model: NormLM
    config: TrainConfig  # the run's configuration
    checkpoint: Path
    run_dir: Path | None  # the run directory, when the source was one (or held the checkpoint)
    step: int | None  # the optimizer steps the checkpoint had taken


def run_tokenizer(cfg: TrainConfig, run_dir: Path | None = None) -> Any:
    """The tokenizer a run trained with: the run's saved tokenizer.json, else bytes, a tokenizer.json
    path, or its (cached) trained BPE. None for pre-tokenized .bin data."""
    from normlab.data import ByteTokenizer, load_data, load_tokenizer

    run = RunDir(run_dir) if run_dir is not None else None
    if run is not None and run.tokenizer_file.is_file():
        return load_tokenizer(str(run.tokenizer_file))
    d = cfg.data
    if d.tokenizer == "bytes":
        if d.data.endswith(".bin"):
            return None
        return ByteTokenizer()
    if d.tokenizer.startswith("bpe:"):
        if run is not None and run.predates_end_of_text():
            raise DataError(
                f"{run_dir} was trained with a BPE from before normlab's tokenizers had an end-of-text token; "
                "today's BPE reserves id 0 for it, so rebuilding it would not give the ids this model learned. "
                "Retrain the run, or export it with the normlab version that trained it"
            )
        return load_data(d.data, d.tokenizer, d.val_fraction, d.text_field).tokenizer
    return load_tokenizer(d.tokenizer)


def load_run_model(source: str | Path) -> RunModel:
    """The model of a run directory's newest checkpoint, or of a checkpoint file / sharded folder."""
    from normlab.runs.checkpoint import (
        is_sharded,
        load_checkpoint,
        load_model_state,
        newest_checkpoint,
    )

    src = Path(source)
    if not src.exists():
        raise DataError(f"{src} does not exist; give a run directory or a checkpoint file")
    ckpt = newest_checkpoint(src)
    if ckpt is None or not ckpt.exists():
        raise CheckpointError(f"{src}: no checkpoint found (give a run directory or a checkpoint file)")
    state = load_checkpoint(ckpt)
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{ckpt} holds no run configuration; give a checkpoint written by normlab train")
    cfg = TrainConfig.from_dict(state["config"], str(ckpt))
    weights = state["model"] if "model" in state else load_model_state(ckpt)
    model = build_run_model(
        cfg.model.layout, cfg.model.size, cfg.model.options, cfg.data.seq_len, weights["embed.weight"].shape[0]
    )
    model.load_state_dict(weights)
    run_dir = src if src.is_dir() and not is_sharded(src) else None
    if run_dir is None and ckpt.parent == RunDir(ckpt.parent.parent).checkpoints:
        run_dir = ckpt.parent.parent
    return RunModel(model.eval(), cfg, ckpt, run_dir, state.get("step"))
