"""The local executor's worker processes, forked from a server that has already imported torch and the trainer.

A worker is still one process per run (a run that segfaults or is OOM-killed costs that run only), but a
fresh interpreter spends about 3.5 s of CPU importing torch, the trainer and torch's compiler stack (which
every torch optimizer pulls in) before its first step: for recommend's proxy rounds of 150 short steps that
is a tenth of the work. Here the processes come from Python's own `multiprocessing` fork server
(`multiprocessing.get_context("forkserver")`, with those modules preloaded): it is started once per sweep
process, from a clean interpreter (nothing of the caller's state is inherited), and each run is a fork of
it that starts training in milliseconds.

What a worker gets is what a spawned one got: this process's environment and working directory at the
moment of the call (not the server's, which date from its start), its threads, its log file as stdout
and stderr. It must not outlive the sweep process: it watches that process through a pidfd and exits the
moment it ends (kill -9 included); where pidfds are missing, the fork server exits when the sweep process
does (its end of a pipe closes) and each worker asks the kernel for SIGKILL when its parent, the server,
ends (PR_SET_PDEATHSIG).

Runs on CUDA keep `subprocess` (a fresh interpreter, `runner._spawn`): forking a process that has
imported torch is safe only while nothing in it has touched CUDA, and a GPU run's minutes make the
imports negligible anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "normlab.experiments.execute", "normlab.train.trainer"]

_context: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def available() -> bool:
    """Whether this platform has the fork server (Linux and macOS; not Windows)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def _main(sweep: int, root: str, run_id: str, threads: int, env: dict[str, str], cwd: str, log: str) -> None:
    """The worker, in the forked process: the caller's environment and folder, its log as stdout and
    stderr, then the run (`execute_run`), ending when the fork server (its parent) does."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux: the watchers below end it instead
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    _end_with(sweep)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from normlab.experiments.execute import execute_run

    execute_run(root, run_id, threads=threads, watch_parent=os.getppid())


def _end_with(sweep: int) -> None:
    """End this process the moment the sweep process `sweep` ends (a pidfd becomes readable then, kill -9
    included), without waiting for the fork server to notice and shut its interpreter down; at once if it
    has ended already. Where pidfds are missing (Linux before 5.3, macOS) the server's end still ends it."""
    try:
        fd = os.pidfd_open(sweep)
    except ProcessLookupError:
        os._exit(3)
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


class ForkedWorker:
    """A run's process, with the part of `subprocess.Popen` the sweep uses (poll, returncode, kill, wait)."""

    def __init__(self, root: Path, run_id: str, threads: int, log: Path) -> None:
        self.process = _server().Process(
            target=_main,
            args=(os.getpid(), str(root), run_id, threads, dict(os.environ), os.getcwd(), str(log)),
            daemon=False,
        )
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status; minus the signal's number when a signal ended it (as Popen's)."""
        return self.process.exitcode

    def poll(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode
