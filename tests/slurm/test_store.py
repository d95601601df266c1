"""The sweep store written by 8 SLURM tasks at once (issue 40: "the store must stay consistent under 8 concurrent
writers"): `srun -n 8 --overcommit` starts 8 writers on the one node, in both journal modes (WAL on a local disk,
the rollback journal a shared filesystem gets, forced and on a real FUSE mount). `make test` runs the same without
SLURM (tests/integration/test_sweep_store.py); here the processes are the scheduler's tasks, started together. And
a sweep on the FUSE mount, its coordinator killed and rerun: the O_EXCL lock files of a shared filesystem."""

from __future__ import annotations

import json
import os
import signal
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


@pytest.mark.parametrize("shared", ["0", "1", "fuse"], ids=["wal", "rollback-journal", "fuse-mount"])
def test_eight_slurm_tasks_writing_at_once_keep_every_row(tmp_path, shared, monkeypatch, request):
    """8 tasks of one srun record 64 runs (8 each, interleaved): every row present once, with its own numbers and
    its own writer, attempts 1, and SQLite's integrity check passes. `fuse`: the store on a FUSE mount, found
    shared by its type (NORMLAB_SHARED_FS unset)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    if shared == "fuse":
        monkeypatch.delenv("NORMLAB_SHARED_FS", raising=False)
        env.pop("NORMLAB_SHARED_FS", None)
        db = request.getfixturevalue("fuse_dir") / "sweep.db"
    else:
        monkeypatch.setenv("NORMLAB_SHARED_FS", shared)
        env["NORMLAB_SHARED_FS"] = shared
        db = tmp_path / "sweep.db"
    SweepStore(db).add([RunSpec(f"r{i}", i, {"i": i}, TrainConfig.of(steps=i + 1)) for i in range(64)])
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
        assert con.execute("pragma journal_mode").fetchone()[0] == ("wal" if shared == "0" else "delete")
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


def test_a_sweep_on_a_fuse_mount_is_killed_and_rerun(corpus, fuse_dir):
    """A 2-run sweep on the FUSE mount (taken as shared: rollback journal, O_EXCL lock files), its coordinator
    killed with -9 while a run trains: its sweep lock file stays behind, the rerun judges it stale (same host, pid
    gone), re-attaches to the jobs and ends with every run ok once; no run's lock file is left."""
    from tests.slurm.test_cluster import ENV, check_ok_once, rows, sweep_cmd, wait_for, write_sweep

    env = {k: v for k, v in ENV.items() if k != "NORMLAB_SHARED_FS"}
    path, name = write_sweep(fuse_dir, corpus, "fuse", seeds=2, steps=300)
    out = fuse_dir / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for("a run training", lambda: any(r["status"] == "running" for r in rows(out)))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    locks = [p for p in out.rglob("*lock*") if p.is_file()]
    assert any(json.loads(p.read_text()).get("pid") == proc.pid for p in locks), locks  # the dead coordinator's
    done = subprocess.run(sweep_cmd(path, out), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not submitted again" in done.stdout, done.stdout
    check_ok_once(out, name, 2)
    with sqlite3.connect(out / "sweep.db") as con:
        assert con.execute("pragma journal_mode").fetchone()[0] == "delete"
    assert [p for p in out.rglob("*lock*") if p.is_file()] == []
