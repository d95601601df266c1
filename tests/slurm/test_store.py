"""The sweep store written by 8 SLURM tasks at once (issue 40: "the store must stay consistent under 8 concurrent
writers"): `srun -n 8 --overcommit` starts 8 writers on the one node, in both journal modes (WAL on a local disk,
the rollback journal a shared filesystem gets). `make test` runs the same without SLURM
(tests/integration/test_sweep_store.py); here the processes are the scheduler's tasks, started together."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from normlab.config import TrainConfig
from normlab.experiments.sweep import RunSpec
from normlab.runs.store import SweepStore
from tests.helpers import REPO

# each task: its 8 runs (k, k + 8, ...) marked running, then recorded, one transaction each, while reading the rows
# (as a coordinator polls); k is the task's rank
WRITER = """
import os, sys
from normlab.runs.store import SweepStore
store, k = SweepStore(sys.argv[1]), int(os.environ["SLURM_PROCID"])
for i in range(k, 64, 8):
    store.mark_running(f"r{i}", f"task{k}")
    assert len(store.rows()) == 64
    store.record(f"r{i}", {"status": "ok", "final_loss": i / 7, "steps": i, "tokens": 1000 + i}, worker=f"task{k}")
print(f"task {k} done", flush=True)
"""


@pytest.mark.parametrize("shared", ["0", "1"], ids=["wal", "rollback-journal"])
def test_eight_slurm_tasks_writing_at_once_keep_every_row(tmp_path, shared, monkeypatch):
    """8 tasks of one srun record 64 runs (8 each, interleaved): every row present once, with its own numbers and
    its own writer, attempts 1, and SQLite's integrity check passes."""
    monkeypatch.setenv("NORMLAB_SHARED_FS", shared)
    db = tmp_path / "sweep.db"
    SweepStore(db).add([RunSpec(f"r{i}", i, {"i": i}, TrainConfig.of(steps=i + 1)) for i in range(64)])
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NORMLAB_SHARED_FS": shared, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["srun", "-n", "8", "--overcommit", "-p", "debug", "-J", "normlab-store-stress", sys.executable, "-c", WRITER]
        + [str(db)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.split("\n")[:-1]) == sorted(f"task {k} done" for k in range(8)), done.stdout
    with sqlite3.connect(db) as con:
        assert con.execute("pragma journal_mode").fetchone()[0] == ("delete" if shared == "1" else "wal")
        assert con.execute("pragma integrity_check").fetchone()[0] == "ok"
    rows = SweepStore(db).rows()
    assert [r["run_id"] for r in rows] == [f"r{i}" for i in range(64)]
    for r in rows:
        i = r["idx"]
        assert (r["status"], r["step"], r["tokens"], r["attempts"], r["worker"]) == (
            "ok",
            i,
            1000 + i,
            1,
            f"task{i % 8}",
        )
        assert r["final_loss"] == pytest.approx(i / 7)
