"""Checkpoints: written atomically, kept last-k, found again on resume, loaded without executing code.

A checkpoint holds the model and optimizer state, the step (which is also the data position:
batches are a function of (seed, step)), the loss scaler, the divergence monitor and the RNG
states. It is serialized in memory and written with `atomic_write_bytes`, so a process killed
mid-write leaves the previous checkpoint intact and no partial file under a checkpoint name.

Loading uses `torch.load(weights_only=True)`: only tensors and plain containers/scalars are
unpickled, so a `.pt` whose pickle would call `os.system` (or anything else) is refused, not run.
Everything we store is of those types (the numpy RNG state is stored as a tensor); checkpoints
written by normlab 0.1.0, which held the numpy state as an ndarray, load through an allowlist of
exactly the numpy globals that rebuild an array.
"""

from __future__ import annotations

import io
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab.io import atomic_write_bytes

_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be (safely) loaded; the message names the file and why."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose pickle holds more than tensors and plain values: refused, never skipped."""


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
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    if isinstance(npst, dict):
        keys = np.asarray(npst["keys"].numpy(), dtype=np.uint32)
        np.random.set_state((npst["name"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    else:  # a 0.1.0 checkpoint: numpy's own tuple
        np.random.set_state(npst)
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


def _legacy_numpy_globals() -> list:
    """The numpy globals a 0.1.0 checkpoint's RNG state needs (rebuild one uint32 array), nothing else."""
    from numpy.dtypes import UInt32DType

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, UInt32DType]


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True`; refuse (CheckpointError) anything else in it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message goes on to suggest weights_only=False: exactly what must not be done here
        lines = [x.strip() for x in str(err).splitlines() if "GLOBAL" in x or "Unsupported" in x]
        what = lines[0].removeprefix("WeightsUnpickler error: ")[:200] if lines else type(err).__name__
        raise UnsafeCheckpointError(
            f"{path} is not a checkpoint normlab will load: it holds objects other than tensors and plain "
            f"values ({what}); loading it could run code, so it was refused"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt): {type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a normlab checkpoint (no model state in it)")
    return state


def load_latest_checkpoint(run_dir: str | Path, warn=None) -> tuple[Path, dict[str, Any]] | None:  # noqa: ANN001
    """The newest checkpoint of a run that loads; a corrupt newer one is skipped with a warning.

    Returns None when the run has no checkpoint; raises CheckpointError when none of them loads.
    A checkpoint refused as unsafe (not merely corrupt) is never skipped silently: it is an error.
    """
    found = list_checkpoints(run_dir)
    errors = []
    for path in reversed(found):
        try:
            return path, load_checkpoint(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as err:
            errors.append(str(err))
            message = f"skipping checkpoint {path.name}: {err}; trying the previous one"
            (warn or (lambda m: warnings.warn(m, stacklevel=3)))(message)
    if errors:
        raise CheckpointError(f"{run_dir}: no checkpoint loads ({'; '.join(errors)})")
    return None
