"""Checkpoints: written atomically, kept last-k, found again on resume.

A checkpoint holds the model and optimizer state, the step (which is also the data position:
batches are a function of (seed, step)), the loss scaler, the divergence monitor and the RNG
states. It is serialized in memory and written with `atomic_write_bytes`, so a process killed
mid-write leaves the previous checkpoint intact and no partial file under a checkpoint name.
"""

from __future__ import annotations

import io
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab.io import atomic_write_bytes

_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


def remove_stale_temp_files(run_dir: str | Path) -> list[str]:
    """Delete the hidden temp files of checkpoint writes that were killed (see `atomic_write_bytes`)."""
    d = checkpoint_dir(run_dir)
    stale = sorted(d.glob(".step_*.pt.*.tmp")) if d.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return [p.name for p in stale]


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as checkpoint ``step`` (steps completed) and prune to the last ``keep_last``."""
    buf = io.BytesIO()
    torch.save({**state, "step": step, "rng": rng_state()}, buf)
    path = checkpoint_dir(run_dir) / f"step_{step:08d}.pt"
    atomic_write_bytes(path, buf.getvalue())
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    # weights_only=False: the checkpoint holds RNG states (numpy arrays, tuples) and is our own file.
    return torch.load(path, map_location="cpu", weights_only=False)
