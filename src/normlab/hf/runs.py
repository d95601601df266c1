"""A run directory (or one checkpoint) as a model and a tokenizer: what export and evaluation start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.data.corpus import DataError
from normlab.model.lm import NormLM


@dataclass
class RunModel:
    model: NormLM
    config: dict[str, Any]  # the run's TrainConfig, edge form
    checkpoint: Path
    run_dir: Path | None  # the run directory, when the source was one (or held the checkpoint)
    step: int | None  # the optimizer steps the checkpoint had taken


def run_tokenizer(cfg: dict[str, Any], run_dir: Path | None = None) -> Any:
    """The tokenizer a run trained with: the run's saved tokenizer.json, else bytes, a tokenizer.json
    path, or its (cached) trained BPE. None for pre-tokenized .bin data."""
    from normlab.data import ByteTokenizer, load_data, load_tokenizer

    if run_dir is not None and (run_dir / "tokenizer.json").is_file():
        return load_tokenizer(str(run_dir / "tokenizer.json"))
    if cfg["tokenizer"] == "bytes":
        if str(cfg.get("data", "")).endswith(".bin"):
            return None
        return ByteTokenizer()
    if cfg["tokenizer"].startswith("bpe:"):
        if run_dir is not None and _predates_end_of_text(run_dir):
            raise DataError(
                f"{run_dir} was trained with a BPE from before normlab's tokenizers had an end-of-text token; "
                "today's BPE reserves id 0 for it, so rebuilding it would not give the ids this model learned. "
                "Retrain the run, or export it with the normlab version that trained it")
        return load_data(cfg["data"], cfg["tokenizer"], cfg["val_fraction"], cfg["text_field"]).tokenizer
    return load_tokenizer(cfg["tokenizer"])


def _predates_end_of_text(run_dir: Path) -> bool:
    """Runs record their tokenizer's facts (end-of-text id included) in config.json since it existed."""
    import json

    try:
        return "tokenizer" not in json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False


def load_run_model(source: str | Path) -> RunModel:
    """The model of a run directory's newest checkpoint, or of a checkpoint file / sharded folder."""
    from normlab.model.build import build_model
    from normlab.model.config import get_size
    from normlab.train.checkpoint import CheckpointError, is_sharded, load_checkpoint, load_model_state, newest_checkpoint

    src = Path(source)
    if not src.exists():
        raise DataError(f"{src} does not exist; give a run directory or a checkpoint file")
    ckpt = newest_checkpoint(src)
    if ckpt is None or not ckpt.exists():
        raise CheckpointError(f"{src}: no checkpoint found (give a run directory or a checkpoint file)")
    state = load_checkpoint(ckpt)
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{ckpt} holds no run configuration; give a checkpoint written by normlab train")
    cfg, weights = state["config"], state["model"] if "model" in state else load_model_state(ckpt)
    overrides = {"vocab_size": weights["embed.weight"].shape[0], **cfg.get("model", {})}  # as the trainer built it
    overrides.setdefault("max_seq_len", max(cfg["seq_len"], get_size(cfg["size"]).max_seq_len))
    model = build_model(cfg["layout"], cfg["size"], seed=0, **overrides)
    model.load_state_dict(weights)
    run_dir = src if src.is_dir() and not is_sharded(src) else None
    if run_dir is None and ckpt.parent.name == "checkpoints":
        run_dir = ckpt.parent.parent
    return RunModel(model.eval(), cfg, ckpt, run_dir, state.get("step"))
