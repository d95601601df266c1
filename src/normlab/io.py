"""Atomic file writes: a reader never sees a half-written checkpoint, result or cache file.

Write to a temporary file in the same directory, flush and fsync it, then `os.replace` it over the
target (atomic on POSIX and Windows); a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from normlab.errors import USER_ERRORS, ConfigError, DataError, ForeignFolderError, OutputError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to stream into that appears at ``path`` only once complete (flushed, fsynced, renamed);
    an exception inside the block leaves ``path`` as it was. Streaming keeps a large write (a checkpoint of
    gigabytes) out of memory: the content is never held whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


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


MAX_JSON_DEPTH = 64  # a transformers config.json nests 3 or 4 levels, a tokenizer.json 5; JSONL records fewer
MAX_JSON_BYTES = 1 << 30  # a model folder's largest JSON (a tokenizer.json) is tens of MB
MAX_RECORD_BYTES = 64 << 20  # one JSONL record (one document); a longer one is refused, never loaded whole


def loads_json(data: bytes | str, what: str) -> Any:
    """JSON from a file normlab did not write (``what`` names it in the error): text that is not UTF-8,
    not JSON, or nested deeper than MAX_JSON_DEPTH is a DataError, never a RecursionError."""
    try:
        obj = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except UnicodeDecodeError as err:
        raise DataError(f"{what} is not UTF-8 text (invalid byte at offset {err.start}); JSON is UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{what} is not JSON ({err.msg} at character {err.pos})") from None
    except RecursionError:  # Python's parser gives up near 1000 levels, far past the limit below
        raise DataError(_too_deep(what)) from None
    depth, stack = 0, [(obj, 1)]
    while stack and depth <= MAX_JSON_DEPTH:  # without recursion: a deep value must not fail the check itself
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    if depth > MAX_JSON_DEPTH:
        raise DataError(_too_deep(what))
    return obj


def _too_deep(what: str) -> str:
    return (
        f"{what} nests its JSON deeper than {MAX_JSON_DEPTH} levels; a model's configuration or tokenizer "
        "file nests a few levels"
    )


def read_json(path: str | os.PathLike, what: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`loads_json` of a file, refused unread when it is larger than ``max_bytes``."""
    path = Path(path)
    what = what or str(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise DataError(
            f"{what} is {size / 2**20:.0f} MiB; a JSON file normlab reads may hold at most {max_bytes / 2**20:.0f} MiB"
        )
    return loads_json(path.read_bytes(), what)


def read_utf8(path: str | os.PathLike) -> str:
    """A text file's text; an empty, binary (a NUL byte) or non-UTF-8 file is a DataError naming the offset."""
    path = Path(path)
    data = path.read_bytes()
    if not data.strip():
        raise DataError(f"{path} is empty; give a file with text in it")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{path} looks binary (a NUL byte at offset {nul}); expected UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (invalid byte at offset {err.start}); give UTF-8 text") from None


def jsonl_records(path: str | os.PathLike, max_bytes: int | None = None):  # noqa: ANN201 - iterator of (line, value)
    """(line number, value) of each non-blank line of a user's JSONL file, streamed: a line longer than
    ``max_bytes`` (default MAX_RECORD_BYTES) is refused as soon as that many bytes are read, and a line that
    is not UTF-8 or not JSON is a DataError naming its number."""
    limit = MAX_RECORD_BYTES if max_bytes is None else max_bytes
    path = Path(path)
    with path.open("rb") as f:
        n = 0
        while True:
            line = f.readline(limit + 1)
            if not line:
                return
            n += 1
            if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
                raise DataError(
                    f"{path} line {n} is longer than {_mib(limit)}, the most one record may hold; "
                    f"split the document into records of at most {_mib(limit)}"
                )
            if line.strip():
                yield n, loads_json(line, f"{path} line {n}")


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n:,} bytes"


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
        kept = [
            line
            for line, row in _jsonl_lines(path)
            if row is not None and isinstance(row.get("step"), int) and row["step"] < before_step
        ]
    atomic_write_bytes(path, ("\n".join(kept) + "\n").encode() if kept else b"")


# Filesystems shared between machines, by their /proc/mounts type: SQLite's WAL journal needs shared memory
# between its readers and writers, which these cannot give across nodes (sqlite.org/wal.html), and flock
# there is missing (Lustre without -o flock), node-local (-o localflock) or emulated. NORMLAB_SHARED_FS=1
# marks any folder as shared (a filesystem this list does not know); =0 marks none.
SHARED_FS = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cifs",
    "smb3",
    "smbfs",
    "ceph",
    "glusterfs",
    "panfs",
    "orangefs",
    "pvfs2",
    "afs",
    "9p",
    "virtiofs",
    "wekafs",
    "vast",
)


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


def own_folder(path: str | os.PathLike, kind: str, claim: bool = True) -> Path:
    """Make ``path`` an output folder of ``kind`` (sweep, report, scan, summary) that normlab may write
    into, or refuse: a new or empty folder is claimed (a ``.normlab`` marker is written) and a folder
    normlab made for the same kind is reused. Anything else holds someone's files: ForeignFolderError,
    nothing written.
    ``claim=False``: the same check, writing nothing (a refusal before any work, the folder made later)."""
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
        raise ForeignFolderError(
            f"{path} is a normlab {made or 'unknown'} folder, not a {kind} folder; "
            f"give a new or empty folder for the {kind}"
        )
    held = sorted(p.name for p in path.iterdir() if p.name != ".lock") if path.is_dir() else []  # .lock: normlab's
    if held:
        raise ForeignFolderError(
            f"{path} holds files normlab did not write ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); "
            f"nothing there is overwritten: give a new or empty folder for the {kind}"
        )
    if claim:
        atomic_write_json(marker, {"kind": kind})
    return path


FULL = 1 << 20  # a file system with less free space than this after a failed write: the write failed for want of it


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike, kind: str) -> Iterator[Path]:
    """Write the output folder ``out`` whole or not at all. ``out`` is claimed with `own_folder` (a folder
    holding someone's files is refused before anything is written); the body writes into a hidden sibling
    folder, which replaces ``out`` only once complete. A write that fails (an OSError; or any error of a
    writing library when the disk is full, e.g. safetensors' or torch's) removes the sibling, leaves ``out``
    as it was (a folder it made is removed again) and is one OutputError line; other errors pass unchanged."""
    out = Path(out)
    made = not out.exists()
    tmp: Path | None = None
    try:
        own_folder(out, kind)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        yield tmp
        atomic_write_json(tmp / MARKER, {"kind": kind})
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)  # ``out`` is a folder normlab made for this kind: its previous copy goes
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except Exception as err:
        if isinstance(err, USER_ERRORS) or not _write_failed(err, tmp or out.parent):
            raise
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise OutputError(
            f"could not write the {kind} folder {out} ({_why(err)}); nothing was left half-written: "
            "free space or give a folder on another disk"
        ) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_failed(err: Exception, where: Path) -> bool:
    if isinstance(err, OSError):
        return True
    try:
        return "No space left on device" in str(err) or shutil.disk_usage(where).free < FULL
    except OSError:
        return False


def _why(err: Exception) -> str:
    if isinstance(err, OSError):
        return err.strerror or type(err).__name__
    return "No space left on device"  # a library's error, on a full disk (`_write_failed`)
