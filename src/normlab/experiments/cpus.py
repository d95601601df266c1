"""The CPU cores a sweep may use and the torch threads each of its worker processes gets.

Two limits a user sets outside normlab are respected here:

- the process's CPU affinity (``taskset``, a SLURM cpuset, a container's cpuset): ``os.sched_getaffinity``, not
  ``os.cpu_count``, which counts every core of the machine;
- ``OMP_NUM_THREADS``: a cap on each worker's intra-op threads. Without it a lone worker on a 2-core machine takes 2
  threads, and when another process holds one of the cores every OpenMP parallel region waits for the thread that
  is not scheduled: measured on a 2-core VM beside one busy process, a micro step went from 0.16 s to 6 s (a sweep
  run at 166 tokens/s where the same command alone ran at 6,400). The user who sets ``OMP_NUM_THREADS=1`` to share
  the machine gets one thread per worker.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def thread_cap() -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer, or None where it is unset or not one (OpenMP ignores those)."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def threads_per_worker(workers: int) -> int:
    """Torch threads for each of ``workers`` processes side by side: the usable cores split evenly, at most
    ``OMP_NUM_THREADS``, at least one."""
    share = max(1, usable_cores() // max(1, workers))
    cap = thread_cap()
    return min(share, cap) if cap is not None else share
