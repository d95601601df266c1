"""The torch threads a sweep's workers get: the usable cores split evenly, capped by OMP_NUM_THREADS."""

from __future__ import annotations

import os

import pytest

from normlab.experiments import cpus


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's count is not the process's share


def test_cores_are_the_affinity_mask_not_the_machine(four_cores: None) -> None:
    assert cpus.usable_cores() == 4


@pytest.mark.parametrize(
    ("omp", "workers", "threads"),
    [
        (None, 1, 4),  # alone: every usable core
        (None, 2, 2),
        (None, 3, 1),  # 4 // 3
        (None, 8, 1),  # more workers than cores: still one thread each
        ("1", 1, 1),  # the user shares the machine: one thread even for a lone worker
        ("2", 1, 2),
        ("8", 2, 2),  # a cap above the share changes nothing
        ("0", 1, 4),  # not a positive integer: OpenMP ignores it, and so do we
        ("two", 1, 4),
        (" 3 ", 1, 3),
    ],
)
def test_threads_per_worker(
    four_cores: None, monkeypatch: pytest.MonkeyPatch, omp: str | None, workers: int, threads: int
) -> None:
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert cpus.threads_per_worker(workers) == threads
