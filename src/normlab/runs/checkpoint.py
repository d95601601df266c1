"""Checkpoints: written atomically, kept last-k, found again on resume, loaded without executing code.

A checkpoint holds the model and optimizer state, the step (which is also the data position:
batches are a function of (seed, step)), the loss scaler, the divergence monitor and the RNG
states. It is streamed into a temporary file and renamed once complete (`normlab.io.atomic_open`),
hashed on the way, so a process killed mid-write leaves the previous checkpoint intact and no partial
file under a checkpoint name.

Loading uses `torch.load(weights_only=True)`: only tensors and plain containers/scalars are
unpickled, so a `.pt` whose pickle would call `os.system` (or anything else) is refused, not run.
Everything we store is of those types (the numpy RNG state is stored as a tensor).

Two forms, one per way of training:
- ``step_XXXXXXXX.pt``: one file (one process, DDP);
- ``step_XXXXXXXX.dcp/``: FSDP2's sharded form, torch.distributed.checkpoint (DCP): every rank
  writes its own shards of the model and optimizer, no rank gathers the whole model, and the
  checkpoint loads on any world size, one process included (DCP reshards on load). The scaler,
  monitor, RNG and counters go in ``extra.pt`` beside the shards. All ranks write into a hidden
  ``.step_XXXXXXXX.dcp.tmp/`` and the main rank renames it once every rank is done, so a killed
  write never leaves a folder under a checkpoint name. DCP reads its ``.metadata`` with plain
  `pickle`; normlab first unpickles it with an allowlist of DCP's own metadata classes, so a planted
  folder cannot run code either.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch

from normlab.errors import CheckpointError, UnsafeCheckpointError
from normlab.io import atomic_open, atomic_write_bytes
from normlab.runs.files import RunDir

_NAME = re.compile(r"^step_(\d{8})\.(pt|dcp)$")
EXTRA = "extra.pt"  # in a sharded checkpoint: everything but the model and optimizer shards


def checkpoint_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).checkpoints


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


def newest_checkpoint(source: str | Path) -> Path | None:
    """A run directory's newest checkpoint (None if it has none); a checkpoint file or sharded
    folder is its own answer."""
    src = Path(source)
    if src.is_dir() and not is_sharded(src):
        found = list_checkpoints(src)
        return found[-1] if found else None
    return src


# The hidden temp file of an atomic write (`atomic_write_bytes`) that was killed: ".NAME.XXXXXXXX.tmp".
TEMP_FILE = re.compile(r"\.[^/]+\.[A-Za-z0-9_]{4,}\.tmp")


def remove_stale_temp_files(run_dir: str | Path) -> list[str]:
    """Delete the hidden temp files of writes that were killed (see `atomic_write_bytes`): checkpoints,
    and the run's own files (config.json, summary.json, tokenizer.json). Called under the run's lock."""
    d, run = checkpoint_dir(run_dir), Path(run_dir)
    stale = sorted(
        [*d.glob(".step_*.pt.*.tmp"), *d.glob(".step_*.pt.sha256.*.tmp"), *d.glob(".step_*.dcp.tmp")]
        if d.is_dir()
        else []
    )
    stale += sorted(p for p in run.iterdir() if p.is_file() and TEMP_FILE.fullmatch(p.name)) if run.is_dir() else []
    for p in stale:
        _remove(p)
    return [p.name for p in stale]


SUM_SUFFIX = ".sha256"  # step_X.pt's SHA-256, written after it: a flipped bit is caught, not trained on
CHECKSUMS = "checksums.json"  # in a sharded folder: every file's SHA-256


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _verify(path: Path, expected: str) -> None:
    if _sha256_file(path) != expected.strip():
        raise CheckpointError(
            f"{path} is corrupt: its SHA-256 differs from the one written with it (a flipped bit or a partial copy)"
        )


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def is_sharded(path: str | Path) -> bool:
    return Path(path).suffix == ".dcp"


def rng_state() -> dict[str, Any]:
    # the legacy tuple (get_state's default); numpy's stubs give the union with the dict form
    state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    name, keys, pos, has_gauss, cached = state
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    keys = np.asarray(npst["keys"].numpy(), dtype=np.uint32)
    np.random.set_state((npst["name"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    random.setstate(state["python"])


class _Sha256Writer:
    """A file that hashes what passes through it (torch.save writes to any object with ``write``), so a
    checkpoint's sum costs no second read and no copy of it in memory."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as checkpoint ``step`` (steps completed) and prune to the last ``keep_last``.

    Streamed to its file (atomically), hashed on the way: at gpu-126m a checkpoint is 1.5 GB, and the
    earlier in-memory buffer held it twice and took most of a 100-step H200 run's 48 s (two stack dumps
    25 s apart, both inside the save)."""
    path = checkpoint_dir(run_dir) / f"step_{step:08d}.pt"
    with atomic_open(path) as f:
        out = _Sha256Writer(f)
        # torch.save only writes and flushes: the hashing writer serves as its file
        torch.save({**state, "step": step, "rng": rng_state()}, cast(BinaryIO, out))
    # after the file: a kill between the two leaves a complete checkpoint without its sum (loaded as
    # checkpoints of earlier normlab versions are: unverified)
    atomic_write_bytes(path.with_name(path.name + SUM_SUFFIX), out.sha.hexdigest().encode())
    prune(run_dir, keep_last)
    return path


def prune(run_dir: str | Path, keep_last: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep_last]:
        _remove(old)
        _remove(old.with_name(old.name + SUM_SUFFIX))


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int,
    is_main: bool,
) -> Path:
    """FSDP2: called on every rank; each writes its shards, the main rank ``extra.pt`` and the rename."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoint_dir(run_dir) / f"step_{step:08d}.dcp"
    tmp = final.with_name(f".{final.name}.tmp")
    if is_main:
        _remove(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, opt)  # sharded (DTensor) state dicts, keyed by parameter name
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    if is_main:
        buf = io.BytesIO()
        torch.save({**state, "step": step, "rng": rng_state()}, buf)
        atomic_write_bytes(tmp / EXTRA, buf.getvalue())
        sums = {p.name: _sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}  # every rank has written
        atomic_write_bytes(tmp / CHECKSUMS, json.dumps(sums, indent=1).encode())
        _remove(final)  # a checkpoint of the same step from a run replayed after a crash
        os.replace(tmp, final)
        prune(run_dir, keep_last)
    dist.barrier()
    return final


# What DCP's .metadata pickle may reference (torch 2.13 writes exactly these, plus torch dtypes).
_DCP_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")


def _safe_planner():  # noqa: ANN202 - a DefaultLoadPlanner
    """DCP's load planner with its byte entries read weights-only.

    DCP stores every non-tensor entry of a state dict (an optimizer's ``param_groups``: floats, bools,
    tuples) as a `torch.save` blob, and torch's `DefaultLoadPlanner.load_bytes` reads it back with
    ``torch.load(weights_only=False)``: a crafted shard runs code on resume. normlab's own entries are
    plain values, so they load under ``weights_only=True``; anything else is refused."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 - a ReadItem
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointError(
                    f"entry {read_item.dest_index.fqn!r} of a sharded checkpoint holds objects other than "
                    f"tensors and plain values ({refused_global(err)}); loading it could run code, so it was "
                    "refused"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    from torch.distributed.checkpoint._traverse import set_element

    return SafeLoadPlanner()


def refused_global(err: pickle.UnpicklingError) -> str:
    """The global a weights-only load refused, from torch's message (whose advice to retry with
    weights_only=False is exactly what must not be done here)."""
    lines = [x.strip() for x in str(err).splitlines() if "GLOBAL" in x or "Unsupported" in x]
    return lines[0].removeprefix("WeightsUnpickler error: ")[:200] if lines else type(err).__name__


def _check_sharded(path: Path, verify: bool = True) -> None:
    """Refuse a DCP folder that is incomplete, corrupt (``verify``: every file against its SHA-256 in
    checksums.json), or whose metadata pickle references anything but DCP's classes."""
    meta = path / ".metadata"
    if not meta.is_file() or not (path / EXTRA).is_file():
        raise CheckpointError(f"{path} is an incomplete sharded checkpoint (no .metadata or {EXTRA})")
    sums = path / CHECKSUMS
    if verify and sums.is_file():  # written by normlab since 2026-11-23, after every shard
        try:
            expected = json.loads(sums.read_text())
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{sums} is unreadable (truncated or corrupt)") from None
        for name, digest in expected.items():
            if Path(name).name != name or not (path / name).is_file():
                raise CheckpointError(f"{path} is incomplete or corrupt: {name!r} is listed in {CHECKSUMS} but absent")
            _verify(path / name, str(digest))
    try:
        with meta.open("rb") as f:
            _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path / '.metadata'} is not DCP metadata normlab will load ({str(err)[:200]}); loading it could "
            "run code, so it was refused"
        ) from None
    except (EOFError, OSError, ValueError, AttributeError, ImportError) as err:
        raise CheckpointError(f"{meta} is unreadable (truncated or corrupt): {type(err).__name__}") from None


def load_checkpoint(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True`; refuse (CheckpointError) anything else in it.

    ``verify``: check its SHA-256 first (the other ranks of a resume skip it: the main rank chose this
    checkpoint after verifying it). A sharded checkpoint gives its ``extra.pt`` with ``"sharded"`` set
    to its folder; the model and optimizer shards are read by `load_sharded_state` (training) or
    `load_model_state` (weights).
    """
    path = Path(path)
    if is_sharded(path) and path.is_dir():
        _check_sharded(path, verify)
        return {**_load_file(path / EXTRA, require_model=False), "sharded": str(path)}
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    checksum = path.with_name(path.name + SUM_SUFFIX)
    if verify and checksum.is_file():
        _verify(path, checksum.read_text(errors="replace"))
    return _load_file(path, require_model=True)


def _load_file(path: Path, require_model: bool) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path} is not a checkpoint normlab will load: it holds objects other than tensors and plain "
            f"values ({refused_global(err)}); loading it could run code, so it was refused"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path} is unreadable (truncated or corrupt): {type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else ''}"
        ) from None
    if not isinstance(state, dict) or (require_model and "model" not in state):
        raise CheckpointError(f"{path} is not a normlab checkpoint (no model state in it)")
    return state


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes the intent is to load in a single process": here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _dcp_errors(path: str | Path) -> Iterator[None]:
    """DCP wraps what a rank raised in a CheckpointException (a BaseException): an unsafe entry is
    raised as itself, anything else as a CheckpointError naming the folder."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        raised = [exc for exc, _ in err.failures.values()]
        unsafe = [e for e in raised if isinstance(e, UnsafeCheckpointError)]
        if unsafe:
            raise UnsafeCheckpointError(f"{path}: {unsafe[0]}") from None
        first = raised[0] if raised else err
        raise CheckpointError(f"{path} is unreadable: {type(first).__name__}: {str(first)[:200]}") from None


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def load_sharded_state(path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Model and optimizer from a sharded checkpoint, on any world size (FSDP2, DDP or one process).
    Its files' checksums were verified when `load_checkpoint` chose it; they are not hashed again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _check_sharded(Path(path), verify=False)
    model_sd, optim_sd = get_state_dict(model, opt)  # this run's layout of the same keys: DCP fills it
    with _quiet_single_process(), _dcp_errors(path):
        dcp.load(
            {"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, no_dist=_no_dist(), planner=_safe_planner()
        )
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from either form of checkpoint, in one process (export, --init-from)."""
    path = Path(path)
    if not is_sharded(path):
        return load_checkpoint(path)["model"]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _check_sharded(path)  # complete, and its metadata pickle references only DCP's classes
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    model = {
        k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with _quiet_single_process(), _dcp_errors(path):
        dcp.load({"model": model}, checkpoint_id=path, no_dist=True, planner=_safe_planner())
    return model


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
