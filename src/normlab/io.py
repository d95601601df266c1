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

from normlab.errors import ConfigError, ForeignFolderError


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

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {p} is not a text file (not UTF-8); give a TOML file") from None


def _jsonl_lines(path: Path):  # noqa: ANN202 - iterator of (line, row or None)
    """Each non-blank line with its parsed row; None for a line that does not parse to an object (a torn
    last line, left by a kill or a full disk mid-write)."""
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        yield line, row if isinstance(row, dict) else None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file; torn lines are skipped, so a reader never fails on what a crash left."""
    path = Path(path)
    return [row for _, row in _jsonl_lines(path) if row is not None] if path.exists() else []


def truncate_jsonl(path: str | os.PathLike, before_step: int) -> None:
    """Keep only the rows with ``step < before_step`` (a resumed run replays the rest); torn lines are
    dropped too."""
    path = Path(path)
    kept = []
    if path.exists():
        kept = [line for line, row in _jsonl_lines(path)
                if row is not None and isinstance(row.get("step"), int) and row["step"] < before_step]
    atomic_write_bytes(path, ("\n".join(kept) + "\n").encode() if kept else b"")


# Filesystems shared between machines, by their /proc/mounts type: SQLite's WAL journal needs shared memory
# between its readers and writers, which these cannot give across nodes (sqlite.org/wal.html), and flock
# there is missing (Lustre without -o flock), node-local (-o localflock) or emulated. NORMLAB_SHARED_FS=1
# marks any folder as shared (a filesystem this list does not know); =0 marks none.
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "panfs",
             "orangefs", "pvfs2", "afs", "9p", "virtiofs", "wekafs", "vast")


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding `path` (its deepest existing folder), from /proc/mounts; "" if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    best, kind = -1, ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (path == Path(point) or Path(point) in path.parents) and len(point) > best:
            best, kind = len(point), parts[2]
    return kind


def shared_filesystem(path: str | os.PathLike) -> bool:
    """Whether `path` is on a filesystem other machines share (NFS, Lustre, GPFS, ...; see SHARED_FS)."""
    forced = os.environ.get("NORMLAB_SHARED_FS", "")
    if forced in ("0", "1"):
        return forced == "1"
    kind = filesystem_type(path)
    return kind in SHARED_FS or kind.startswith("fuse.")


def writable(folder: str | os.PathLike) -> bool:
    """Whether files can be created in `folder`: not on a read-only mount, and permitted (root included)."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(folder, os.W_OK)


MARKER = ".normlab"  # in every output folder normlab made: what kind of folder it is


def own_folder(path: str | os.PathLike, kind: str, legacy: Any = None) -> Path:
    """Make ``path`` an output folder of ``kind`` (sweep, report, scan, summary) that normlab may write
    into, or refuse: a new or empty folder is claimed (a ``.normlab`` marker is written), a folder
    normlab made for the same kind is reused, and ``legacy(path)`` recognizes one an older normlab made
    before markers existed. Anything else holds someone's files: ForeignFolderError, nothing written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ForeignFolderError(f"{path} is a file; give a folder for the {kind} (it is created if missing)")
    marker = path / MARKER
    if marker.is_file():
        try:
            made = json.loads(marker.read_text()).get("kind")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            made = None
        if made == kind:
            return path
        raise ForeignFolderError(f"{path} is a normlab {made or 'unknown'} folder, not a {kind} folder; "
                                 f"give a new or empty folder for the {kind}")
    held = sorted(p.name for p in path.iterdir() if p.name != ".lock") if path.is_dir() else []  # .lock: normlab's
    if held and not (legacy is not None and legacy(path)):
        raise ForeignFolderError(
            f"{path} holds files normlab did not write ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); "
            f"nothing there is overwritten: give a new or empty folder for the {kind}")
    atomic_write_json(marker, {"kind": kind})
    return path
