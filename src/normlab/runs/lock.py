"""Folder locks: one process drives a sweep folder, one process trains a run, on a laptop or a cluster.

Two kinds, chosen by where the folder lives:
- On a local disk, `flock` on the lock file: the kernel releases it when the holder dies (kill -9
  included). The file names its holder while held and nothing once released.
- On a filesystem shared between machines (`normlab.io.shared_filesystem`: NFS, Lustre, GPFS, ...),
  or wherever flock fails (Lustre without -o flock: ENOSYS), a lock file created with O_CREAT|O_EXCL
  (atomic on NFSv3+ and Lustre), holding its holder as JSON: host, pid, the process's start time and
  the SLURM job id. Nobody releases it for a holder that died, so a waiting process judges it stale:
  on the same host, the pid is gone (or is another process: its start time differs); anywhere, the
  holder's job is no longer alive in the scheduler (`squeue`), or it is this job's own earlier life (a
  requeued job). A holder on another host outside any job cannot be checked: the refusal names the
  file to delete once that process is known to be gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from normlab.errors import ConfigError
from normlab.io import shared_filesystem
from normlab.runs.files import RunDir

FLOCK_MISSING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LockBusy(ConfigError):
    """The folder is locked by a live process (the message names it; `holder`: its lock file's JSON, if readable)."""

    def __init__(self, message: str, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None off Linux or if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def job_id() -> str | None:
    """This process's SLURM job (an array task as JOB_TASK), None outside a job."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def job_alive(job: str) -> bool | None:
    """Whether a SLURM job is pending or running (squeue); None when squeue cannot tell (no SLURM here)."""
    if not shutil.which("squeue"):
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return bool(out.stdout.strip())


def holder_info() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()), "job": job_id()}


def describe_holder(info: dict[str, Any] | None) -> str:
    if not info:
        return "another process"
    text = f"pid {info.get('pid')} on {info.get('host')}"
    return text + (f" (SLURM job {info['job']})" if info.get("job") else "")


def stale(info: dict[str, Any] | None, age: float) -> bool:
    """Whether a lock file's holder is gone (see the module docstring); `age`: seconds since the file changed."""
    if not isinstance(info, dict):
        return age > 10  # empty or torn: a holder that died between creating and writing it
    mine = job_id()
    if info.get("job") and info["job"] == mine and info.get("pid") != os.getpid():
        return True  # this job's earlier life, before the scheduler requeued it
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        start = _start_time(info["pid"])
        return start is None or (info.get("start") is not None and start != info["start"])
    if info.get("job"):
        return job_alive(str(info["job"])) is False
    return False


def alive_here(info: dict[str, Any] | None) -> bool:
    """Whether a lock file names a live process on this host outside any other scheduler job (its pid running, with
    the start time the file recorded): a holder whose end can be awaited by watching it, not by a clock."""
    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return False
    if info.get("job") and info["job"] != job_id():  # another job's: the scheduler says when it ends
        return False
    pid = info.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    start = _start_time(pid)
    return start is not None and (info.get("start") is None or start == info["start"])


class FolderLock:
    """An exclusive lock on `lock_file` for the life of the holder (see the module docstring). Waits up to `wait`
    seconds for a dying holder, then refuses with `busy(holder)` (a LockBusy). `patient`: past `wait`, keep
    waiting while the holder is a live process on this host outside any other job (`alive_here`): a sweep's worker
    taking its run from the worker of a killed sweep, which ends with that sweep however long a loaded machine
    takes to end it (its liveness decides, not a fixed number of seconds)."""

    def __init__(self, lock_file: Path, wait: float, busy: Callable[[str], str], *, patient: bool = False) -> None:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.patient = lock_file, patient
        self.file: IO[str] | None = None  # the flock'd file while held
        self.info: dict[str, Any] | None = None  # what the lock names while held
        if not shared_filesystem(lock_file.parent):
            try:
                self._flock(wait, busy)
                return
            except OSError as err:
                if err.errno not in FLOCK_MISSING:
                    raise
                if self.file is not None:
                    self.file.close()
                    self.file = None
        self._exclusive(wait, busy)

    def _flock(self, wait: float, busy: Callable[[str], str]) -> None:
        self.file = file = open(self.path, "a+")  # noqa: SIM115 - held until release()
        deadline = time.monotonic() + wait
        last_look = False  # a patient caller's one more try after its holder was seen gone
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    file.seek(0)
                    text = file.read().strip()
                    if self.patient and alive_here(_parse(text)):
                        last_look = False  # a live holder: the next one that ends gets its own last look
                    else:
                        # the holder may have ended between the try and the look (its exit frees the lock before
                        # its pid goes), or be releasing it (its file emptied, then closed): a patient caller waits
                        # one interval and tries once more before it refuses
                        if self.patient and not last_look:
                            last_look = True
                            time.sleep(0.2)
                            continue
                        file.close()
                        raise LockBusy(busy(_holder_text(text)), _parse(text)) from None
                time.sleep(0.2)
        file.seek(0)
        file.truncate(0)
        file.write(json.dumps(holder_info()))
        file.flush()

    def _exclusive(self, wait: float, busy: Callable[[str], str]) -> None:
        deadline = time.monotonic() + wait
        info = holder_info()
        last_look = False  # as in _flock: the holder may end between the staleness check and the liveness one
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held, age = _read(self.path)
                if stale(held, age):
                    _break(self.path, held)
                    continue
                alive = self.patient and alive_here(held)
                if alive:
                    last_look = False  # as in _flock: each holder that ends gets its own last look
                if time.monotonic() >= deadline and not alive:
                    if self.patient and not last_look:
                        last_look = True
                        time.sleep(0.2)
                        continue
                    raise LockBusy(
                        busy(f"{describe_holder(held)}; if that process is gone, delete {self.path}"), held
                    ) from None
                time.sleep(0.2)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info))
                f.flush()
                os.fsync(f.fileno())
            self.info = info
            return

    def release(self) -> None:
        if self.file is not None:  # flock: a released lock names no process, so nothing reads as still running
            self.file.truncate(0)
            self.file.close()
            self.file = None
        elif self.info is not None:
            held, _ = _read(self.path)
            if held == self.info:  # never another holder's file
                self.path.unlink(missing_ok=True)
            self.info = None


def _holder_text(text: str) -> str:
    try:
        return describe_holder(json.loads(text))
    except ValueError:
        return text or "another process"  # a lock written by an older normlab: "pid N on HOST"


def _parse(text: str) -> dict[str, Any] | None:
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _read(path: Path) -> tuple[dict[str, Any] | None, float]:
    """A lock file's holder (None if empty or torn) and its age in seconds."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except OSError:
        return None, 0.0
    return _parse(text), age


def holder_job(lock_file: Path) -> str | None:
    """The SLURM job a lock file names as its holder, None if it names none. Only a hint: a holder killed with
    kill -9 leaves its name in a flock file (the caller asks the scheduler whether that job is alive)."""
    held, _ = _read(lock_file)
    job = (held or {}).get("job")
    return str(job) if job else None


def _break(path: Path, judged: dict[str, Any] | None) -> None:
    """Remove a stale lock file: renamed aside first (atomic), and put back if it turned out to be a new holder's
    (two waiters judging the same stale file at once)."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    taken, _ = _read(aside)
    if taken != judged:
        with contextlib.suppress(OSError):  # fails if a third process holds it by now: then that one wins
            os.link(aside, path)
    aside.unlink(missing_ok=True)


class RunLock(FolderLock):
    """The run's lock: one process trains a run at a time (a sweep restarted while a killed coordinator's
    worker still runs, two shells, a duplicate job)."""

    def __init__(self, run: Path, wait: float = 10.0, *, patient: bool = False) -> None:
        super().__init__(
            RunDir(run).lock_file,
            wait,
            lambda holder: (
                f"{run} is being trained by {holder}; a run never executes twice at once: wait for it or stop it"
            ),
            patient=patient,
        )
