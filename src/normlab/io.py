"""Atomic file writes: a reader never sees a half-written checkpoint, result or cache file.

Write to a temporary file in the same directory, flush and fsync it, then `os.replace` it over the
target (atomic on POSIX and Windows); a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
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
    # FUSE: any user-space filesystem may be a network one (sshfs, s3fs, gcsfuse, ...): "fuse.NAME" when it names
    # its subtype, plain "fuse" when it does not; "fuseblk" is a local block device's (ntfs-3g, exfat)
    return kind in SHARED_FS or kind == "fuse" or kind.startswith("fuse.")


def writable(folder: str | os.PathLike) -> bool:
    """Whether files can be created in `folder`: not on a read-only mount, and permitted (root included)."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _nearest_folder(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists, as the user spelled it (relative stays relative)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable(path: str | os.PathLike) -> str | None:
    """Why nothing can be written at ``path`` (a folder to write in, or to create), naming the folder that
    stops it: on a read-only mount (``mount -o ro``: root cannot write there either), or not writable by this
    user; None when it can be written (or when that cannot be told: the write itself then says)."""
    folder = _nearest_folder(Path(path))
    if not folder.is_dir():
        return None  # a file in the way: the callers refuse that in their own words
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    except OSError:
        return None
    return None if os.access(folder, os.W_OK) else f"{folder} is not writable by this user"


def check_writable(path: str | os.PathLike, what: str) -> None:
    """Refuse (OutputError, one line, nothing written) an output ``path`` that cannot be written (`unwritable`);
    ``what`` names the output (e.g. "the export folder")."""
    why = unwritable(path)
    if why is not None:
        raise OutputError(f"cannot write {what} {path}: {why}; nothing was written: give a folder on writable storage")


# What the user's storage did to a write, by errno: one line and exit 2 (`storage_refusal`), not a traceback
STORAGE_ERRORS = {
    errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "is on a full disk (no space left on device)",
    errno.EDQUOT: "is on a disk whose quota is used up",
}
PERMISSION_ERRORS = (errno.EACCES, errno.EPERM)


def storage_refusal(err: OSError) -> str | None:
    """The one line for an OSError that the user's storage caused (a read-only mount, a full disk, a path this
    user may not use), naming the folder and the file that was being written; None for any other OSError (a
    defect: the command line shows it as one)."""
    if not err.filename or (err.errno not in STORAGE_ERRORS and err.errno not in PERMISSION_ERRORS):
        return None
    target = Path(os.fsdecode(err.filename))
    if err.errno in PERMISSION_ERRORS:
        return f"permission denied on {target} ({err.strerror}); give a path this user may read and write"
    fix = "give an output folder on writable storage" if err.errno == errno.EROFS else "free space and run it again"
    return f"{_nearest_folder(target.parent)} {STORAGE_ERRORS[err.errno]}: writing {target} failed; {fix}"


MARKER = ".normlab"  # in every output folder normlab made: what kind of folder it is


def folder_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of a folder normlab made (``{"kind": ..., ...}``), or None: no marker, or not one normlab wrote."""
    try:
        record = json.loads((Path(path) / MARKER).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("kind"), str) else None


def own_folder(path: str | os.PathLike, kind: str, claim: bool = True) -> Path:
    """Make ``path`` an output folder of ``kind`` (sweep, report, scan, summary) that normlab may write
    into, or refuse: a new or empty folder is claimed (a ``.normlab`` marker is written) and a folder
    normlab made for the same kind is reused. Anything else holds someone's files: ForeignFolderError,
    nothing written; a folder on read-only storage (or not this user's to write) is an OutputError naming it.
    ``claim=False``: the same checks, writing nothing (a refusal before any work, the folder made later)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ForeignFolderError(f"{path} is a file; give a folder for the {kind} (it is created if missing)")
    if (path / MARKER).is_file():
        made = (folder_record(path) or {}).get("kind")
        if made != kind:
            raise ForeignFolderError(
                f"{path} is a normlab {made or 'unknown'} folder, not a {kind} folder; "
                f"give a new or empty folder for the {kind}"
            )
        check_writable(path, f"the {kind} folder")
        return path
    held = sorted(p.name for p in path.iterdir() if p.name != ".lock") if path.is_dir() else []  # .lock: normlab's
    if held:
        raise ForeignFolderError(
            f"{path} holds files normlab did not write ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); "
            f"nothing there is overwritten: give a new or empty folder for the {kind}"
        )
    check_writable(path, f"the {kind} folder")
    if claim:
        atomic_write_json(path / MARKER, {"kind": kind})
    return path


FULL = 1 << 20  # a file system with less free space than this after a failed write: the write failed for want of it

# A staged folder's hidden sibling while it is written (`staged_folder`): .OUT.PID.RANDOM.tmp, holding a marker
# that names its kind and the process writing it; .OUT.PID.old: the previous copy of OUT for the instant of the swap
_STAGING_NAME = r"\.{name}\.(\d+)\.(?:([A-Za-z0-9_]+)\.tmp|old)"
_STAGING: set[Path] = set()  # the staging folders this process is writing now


def _process_start(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): a pid reused by another
    process has another; None off Linux or when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _writer_gone(pid: int, host: str | None, start: str | None) -> bool:
    """Whether the process that wrote a staging folder is gone: on this host only (a process on another
    host cannot be checked: its folder is left), by pid and, where recorded, its start time."""
    if host is not None and host != socket.gethostname():
        return False
    if pid == os.getpid():
        return True  # not among this process's staging folders (`_STAGING`): an earlier process with this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    return start is not None and _process_start(pid) not in (None, start)


def _tidy_staging(out: Path, kind: str) -> None:
    """Clear what a killed `staged_folder` of ``out`` left beside it (kill -9, a power cut): its staging
    folder, recognised by name, by its marker (normlab's, of this ``kind``) and by its writer being gone, is
    removed; a previous copy of ``out`` moved aside for the swap is put back when ``out`` is missing (else
    removed). A folder that only looks like one (a user's, or another kind's) is never touched."""
    import re

    pattern = re.compile(_STAGING_NAME.format(name=re.escape(out.name)))
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink() or entry.resolve() in _STAGING:
            continue
        if not any(entry.iterdir()):  # made, then killed before its marker was written
            if _writer_gone(int(match.group(1)), None, None):
                entry.rmdir()  # empty: it holds nothing of anyone's
            continue
        record = folder_record(entry)
        if record is None or record.get("kind") != kind:
            continue
        staging = record.get("staging")
        writer = staging if isinstance(staging, dict) else {}
        if not _writer_gone(int(match.group(1)), writer.get("host"), writer.get("start")):
            continue
        if entry.name.endswith(".old") and not out.exists():
            os.replace(entry, out)  # killed between the two renames of the swap: the previous copy comes back
        else:
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike, kind: str, record: dict[str, Any] | None = None) -> Iterator[Path]:
    """Write the output folder ``out`` whole or not at all. ``out`` must be new, empty or a folder normlab
    made for ``kind`` (`own_folder`: someone's files, or read-only storage, are refused before anything is
    written); the body writes into a hidden sibling folder, which replaces ``out`` only once complete, with
    ``out``'s marker (``{"kind": kind, **record}``). A process killed mid-write (kill -9) leaves ``out`` as it
    was and the sibling, which the next staged write of ``out`` recognises as its own and removes. A write that
    fails (an OSError; or any error of a writing library when the disk is full, e.g. safetensors' or torch's)
    removes the sibling, leaves ``out`` as it was and is one OutputError line; other errors pass unchanged,
    the sibling removed all the same."""
    out = Path(out)
    made: list[Path] = []  # the parent folders this call creates: removed again if it fails
    tmp: Path | None = None
    try:
        own_folder(out, kind, claim=False)
        parent = out.parent
        while not parent.exists():
            made.append(parent)
            parent = parent.parent
        out.parent.mkdir(parents=True, exist_ok=True)
        _tidy_staging(out, kind)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp"))
        _STAGING.add(tmp.resolve())
        writer = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}
        atomic_write_json(tmp / MARKER, {"kind": kind, "staging": writer})
        yield tmp
        atomic_write_json(tmp / MARKER, {**(record or {}), "kind": kind})
        own_folder(out, kind, claim=False)  # again: files of someone's may have appeared there meanwhile
        if out.is_dir() and any(out.iterdir()):  # a folder normlab made for this kind: its previous copy goes
            old = out.with_name(f".{out.name}.{os.getpid()}.old")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)  # a missing folder, or an empty one (a rename replaces an empty directory)
        made.clear()
    except Exception as err:
        if isinstance(err, USER_ERRORS) or not _write_failed(err, tmp or _nearest_folder(out.parent)):
            raise
        raise OutputError(
            f"could not write the {kind} folder {out} ({_why(err)}); nothing was left half-written: {_fix(err)}"
        ) from None
    finally:
        if tmp is not None:
            _STAGING.discard(tmp.resolve())
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # deepest first; only while empty
            with contextlib.suppress(OSError):
                folder.rmdir()


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


def _fix(err: Exception) -> str:
    if isinstance(err, OSError) and err.errno == errno.EROFS:
        return "give a folder on writable storage"
    if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM):
        return "give a folder this user can write"
    return "free space or give a folder on another disk"
