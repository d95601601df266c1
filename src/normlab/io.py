"""Atomic file writes: a reader never sees a half-written checkpoint, result or cache file.

Write to a temporary file in the same directory, flush and fsync it, then `os.replace` it over the
target (atomic on POSIX and Windows); a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_toml(path: str | os.PathLike, what: str = "file") -> dict[str, Any]:
    """Parse a TOML file; a missing or malformed file is a ConfigError naming it."""
    import tomllib

    from normlab.model.config import ConfigError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p} is not valid TOML: {err}") from None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line that does not parse (a torn last line, left by a kill or a full
    disk mid-write) is skipped, so a reader never fails on what a crash left behind."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def truncate_jsonl(path: str | os.PathLike, before_step: int) -> int:
    """Keep only the rows with ``step < before_step`` (a resumed run replays the rest); torn lines are
    dropped too. Returns how many lines were dropped because they did not parse."""
    path = Path(path)
    kept, torn = [], 0
    if path.exists():
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = row["step"]
            except (ValueError, KeyError, TypeError):
                torn += 1
                continue
            if isinstance(step, int) and step < before_step:
                kept.append(line)
    atomic_write_bytes(path, ("\n".join(kept) + "\n").encode() if kept else b"")
    return torn
