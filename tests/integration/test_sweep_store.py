"""The sweep store under adversity (issue 35 item 6, issue 40): a 0-byte, corrupt, locked or read-only store,
8 concurrent writers in both journal modes, the O_EXCL lock of shared filesystems, and [slurm] typos."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.cli import main
from normlab.experiments import SweepConfig, run_sweep, summarize
from normlab.experiments.runner import _to_toml
from normlab.runs.lock import FolderLock, LockBusy, RunLock
from normlab.runs.store import SweepStore
from tests.helpers import PATIENCE_S, REPO

QUIET = lambda *a, **k: None


@pytest.fixture(scope="module")
def trained_sweep(tmp_path_factory):
    """Two nano runs, summarized: the folder every test here copies."""
    from tests.conftest import SENTENCES

    root = tmp_path_factory.mktemp("store")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)))
    out = root / "sw"
    base = dict(
        data=str(corpus),
        size="nano",
        seq_len=32,
        batch_size=8,
        steps=4,
        eval_every=0,
        eval_batches=1,
        probe_every=0,
        layout="pre",
    )
    run_sweep(SweepConfig(name="st", base=base, grid={"seed": [0, 1]}), out, workers=1, log=QUIET)
    summarize(out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_zero_byte_store_is_rebuilt_from_the_run_folders(trained_sweep, tmp_path, capsys):
    sw = _copy(trained_sweep, tmp_path / "sw")
    want = (sw / "runs.csv").read_text()
    (sw / "sweep.db").write_bytes(b"")
    for side in ("sweep.db-wal", "sweep.db-shm"):
        (sw / side).unlink(missing_ok=True)
    assert main(["summarize", str(sw)]) == 0
    capsys.readouterr()
    rows = SweepStore(sw / "sweep.db").rows()
    assert sorted(r["status"] for r in rows) == ["ok", "ok"]
    got = (sw / "runs.csv").read_text()
    assert got.splitlines()[0] == want.splitlines()[0] and len(got.splitlines()) == 3
    # the same final losses as the store the runs wrote, read back from their summary.json
    for line_want, line_got in zip(sorted(want.splitlines()[1:]), sorted(got.splitlines()[1:])):
        assert line_want.split(",")[:4] == line_got.split(",")[:4]
    # a rerun of the sweep on a 0-byte store finds both runs finished: nothing is trained again
    (sw / "sweep.db").write_bytes(b"")
    counts = run_sweep(SweepConfig.from_toml(sw / "sweep.toml"), sw, log=QUIET)
    assert counts["ok"] == 2 and all(r["attempts"] == 0 for r in SweepStore(sw / "sweep.db").rows())


def test_a_corrupt_store_is_named_corrupt_with_the_way_to_rebuild_it(trained_sweep, tmp_path, capsys):
    sw = _copy(trained_sweep, tmp_path / "sw")
    garbage = b"SQLite format 3\x00" + bytes(range(256)) * 16
    (sw / "sweep.db").write_bytes(garbage)
    before = (sw / "summary.md").read_bytes()
    assert main(["summarize", str(sw)]) == 2
    line = _one_line(capsys)
    assert "is corrupt" in line and f"mv {sw / 'sweep.db'}" in line and "rebuilt from" in line
    assert (sw / "sweep.db").read_bytes() == garbage and (sw / "summary.md").read_bytes() == before  # nothing touched
    # following the advice rebuilds it
    (sw / "sweep.db").rename(sw / "sweep.db.corrupt")
    assert main(["summarize", str(sw)]) == 0
    assert sorted(r["status"] for r in SweepStore(sw / "sweep.db").rows()) == ["ok", "ok"]


def test_someone_elses_sqlite_file_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    with sqlite3.connect(tmp_path / "d" / "sweep.db") as con:
        con.execute("create table users (name text)")
    before = (tmp_path / "d" / "sweep.db").read_bytes()
    assert main(["summarize", str(tmp_path / "d")]) == 2
    assert "not a normlab sweep store" in _one_line(capsys)
    assert (tmp_path / "d" / "sweep.db").read_bytes() == before


def test_a_store_locked_by_another_writer_is_one_line(trained_sweep, tmp_path, capsys, monkeypatch):
    sw = _copy(trained_sweep, tmp_path / "sw")
    monkeypatch.setattr(SweepStore, "timeout", 0.3)
    with sqlite3.connect(sw / "sweep.db", isolation_level=None) as holder:
        holder.execute("pragma journal_mode=delete")
        holder.execute("begin exclusive")
        try:
            assert main(["summarize", str(sw)]) == 2  # after the 0.3 s it was given, as the line says
        finally:
            holder.execute("rollback")
    assert "locked by another writer (waited 0.3 s)" in _one_line(capsys)


@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="needs root to mount read-only")
def test_a_sweep_on_read_only_storage_is_summarized_elsewhere(trained_sweep, tmp_path):
    sw = _copy(trained_sweep, tmp_path / "sw")
    for f in ("summary.md", "runs.csv", "cells.csv", "report.html"):
        (sw / f).unlink()
    listing = sorted(p.name for p in sw.iterdir())
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    script = (
        f"mount --bind {sw} {sw} && mount -o remount,bind,ro {sw} && "
        f"{sys.executable} -m normlab summarize {sw} --out {tmp_path / 'out'}; a=$?; "
        f"{sys.executable} -m normlab summarize {sw}; echo codes $a $?"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=PATIENCE_S
    )
    assert "codes 0 2" in proc.stdout, proc.stdout + proc.stderr
    assert "read-only storage; give --out DIR" in proc.stderr
    assert (
        "| 2 (2 ok)" in (tmp_path / "out" / "summary.md").read_text()
        or "runs: 2 (2 ok)" in (tmp_path / "out" / "summary.md").read_text()
    )
    assert sorted(p.name for p in sw.iterdir()) == listing  # nothing written into the sweep


WRITER = """
import sys, time
from normlab.runs.store import SweepStore
store, k = SweepStore(sys.argv[1]), int(sys.argv[2])
for i in range(k, 64, 8):
    store.mark_running(f"r{i}", f"writer{k}")
    store.record(f"r{i}", {"status": "ok", "final_loss": i / 7, "steps": i, "tokens": 1000 + i}, worker=f"writer{k}")
"""


@pytest.mark.parametrize("shared", ["0", "1"], ids=["wal", "rollback-journal"])
def test_eight_concurrent_writers_keep_every_row(tmp_path, shared, monkeypatch):
    """8 processes record 64 runs at once (each 8, interleaved): every row present, with its own numbers."""
    from normlab.config import TrainConfig
    from normlab.experiments.sweep import RunSpec

    monkeypatch.setenv("NORMLAB_SHARED_FS", shared)
    db = tmp_path / "sweep.db"
    store = SweepStore(db)
    store.add([RunSpec(f"r{i}", i, {"i": i}, TrainConfig.of(steps=i + 1)) for i in range(64)])
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NORMLAB_SHARED_FS": shared}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(k)], env=env) for k in range(8)]
    assert [p.wait(timeout=PATIENCE_S) for p in procs] == [0] * 8
    with sqlite3.connect(db) as con:
        mode = con.execute("pragma journal_mode").fetchone()[0]
    assert mode == ("delete" if shared == "1" else "wal")
    rows = SweepStore(db).rows()
    assert len(rows) == 64
    for r in rows:
        i = r["idx"]
        assert (r["run_id"], r["status"], r["step"], r["tokens"], r["attempts"], r["worker"]) == (
            f"r{i}",
            "ok",
            i,
            1000 + i,
            1,
            f"writer{i % 8}",
        )
        assert r["final_loss"] == pytest.approx(i / 7)


HOLDER = """
import sys, time
from pathlib import Path
from normlab.runs.lock import FolderLock
FolderLock(Path(sys.argv[1]), wait=0, busy=str)
print("held", flush=True)
time.sleep(600)
"""


def test_shared_filesystem_lock_is_an_exclusive_file_judged_stale_by_its_holder(tmp_path, monkeypatch):
    """NFS/Lustre (forced here): an O_EXCL lock file naming host, pid and job; a holder killed with -9 leaves it,
    and the next process finds it stale and takes it; a live holder is named in the refusal."""
    monkeypatch.setenv("NORMLAB_SHARED_FS", "1")
    lock = tmp_path / ".lock"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        info = json.loads(lock.read_text())
        assert info["pid"] == proc.pid and info["host"] and info["start"]
        with pytest.raises(LockBusy, match=f"pid {proc.pid} on .*if that process is gone, delete {lock}"):
            FolderLock(lock, wait=0.3, busy=str)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert lock.exists()  # nobody released it ...
    taken = FolderLock(lock, wait=0, busy=str)  # ... and it is stale: its pid is gone
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert not lock.exists()
    # a requeued job finds its own earlier life's lock stale, whatever host it ran on
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": "1", "job": "77_3"}))
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    FolderLock(lock, wait=0, busy=str).release()
    # another host's holder outside any job cannot be checked: refused, naming the file
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": "1", "job": None}))
    with pytest.raises(LockBusy, match="pid 1 on elsewhere"):
        FolderLock(lock, wait=0, busy=str)


def test_a_slurm_typo_is_refused_before_anything_is_written(tmp_path, capsys):
    pytest.importorskip("submitit")
    sweep = SweepConfig(name="t", base={"size": "nano"}, grid={"seed": [0]}).to_dict()
    text = _to_toml({**sweep, "executor": "slurm", "slurm": {"slurm_partiton": "debug"}})
    (tmp_path / "s.toml").write_text(text)
    assert main(["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "did you mean slurm_partition?" in _one_line(capsys)
    assert not (tmp_path / "out").exists()


def test_threads_come_from_the_allocation(monkeypatch):
    from normlab.experiments.scheduler import allocation_threads

    for key in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    assert allocation_threads() is None  # outside a job: torch's own default
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "8")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert allocation_threads() == 4  # the node's CPUs over its tasks
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert allocation_threads() == 3  # srun -c 3 / cpus_per_task = 3


def test_a_signal_delay_not_shorter_than_the_time_limit_is_refused_and_the_default_fits(tmp_path, capsys):
    """USR2 `slurm_signal_delay_s` before the limit: a delay >= the limit would signal the job as it starts."""
    pytest.importorskip("submitit")
    from normlab.experiments.scheduler import signal_delay

    sweep = SweepConfig(name="t", base={"size": "nano"}, grid={"seed": [0]}).to_dict()
    (tmp_path / "s.toml").write_text(
        _to_toml({**sweep, "executor": "slurm", "slurm": {"timeout_min": 1, "slurm_signal_delay_s": 60}})
    )
    assert main(["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "slurm_signal_delay_s = 60 is not shorter than timeout_min = 1 (60 s)" in _one_line(capsys)
    assert not (tmp_path / "out").exists()
    # left out: submitit's 90 s, at most a quarter of the limit, at least 5 s
    assert [signal_delay(m) for m in (None, 1, 2, 6, 120, 0.05)] == [90, 15, 30, 90, 90, 5]


def test_a_second_worker_on_a_locked_run_leaves_its_row_and_names_the_holders_job(tmp_path, monkeypatch):
    """A duplicate job of a run another job trains: it takes the lock before touching the row, so the row stays as
    the holder wrote it, and it returns the holder's job for the coordinator to watch."""
    from normlab.experiments.execute import execute_run
    from normlab.experiments.runner import prepare
    from normlab.runs.files import SweepDir

    sweep = SweepConfig(name="t", base={"size": "nano", "steps": 2}, grid={"seed": [0]})
    store, (spec,) = prepare(sweep, tmp_path / "sw")
    store.mark_running(spec.run_id, "41_0")
    lock = SweepDir(tmp_path / "sw").run(spec.run_id).lock_file
    keep = HOLDER.replace("FolderLock(Path", "held = FolderLock(Path")  # a flock lasts as long as its file is open
    holder = subprocess.Popen(
        [sys.executable, "-c", keep, str(lock)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_ID": "0"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(RunLock.__init__, "__defaults__", (0.0,))  # no 10 s wait for the holder to go
        got = execute_run(str(tmp_path / "sw"), spec.run_id, worker="42_0")
    finally:
        holder.kill()
        holder.wait()
    assert got["status"] == "running" and got["holder_job"] == "41_0" and "being trained by pid" in got["reason"]
    row = store.row(spec.run_id)
    assert (row["status"], row["worker"], row["attempts"]) == ("running", "41_0", 1)  # untouched by the duplicate


def test_a_job_ended_by_the_scheduler_is_submitted_again_or_failed_in_one_line(tmp_path):
    """How the coordinator reads a job that left the queue without a result: TIMEOUT (a limit without the warning),
    NODE_FAIL, ...: pending again, to be submitted again, while retries are left, then failed; cancelled: failed,
    naming who cancelled it."""
    from types import SimpleNamespace

    from normlab.experiments.cluster import SweepJobs, _ended
    from normlab.experiments.runner import prepare

    sweep = SweepConfig(name="t", base={"size": "nano", "steps": 2}, grid={"seed": [0, 1]})
    store, specs = prepare(sweep, tmp_path / "sw")
    a, b = (s.run_id for s in specs)
    job = SimpleNamespace(
        job_id="7_0", paths=SimpleNamespace(result_pickle=tmp_path / "none.pkl", stderr=tmp_path / "7_0_log.err")
    )
    store.set_job([a, b], ["7_0", "7_1"])
    store.mark_running(a, "7_0")
    then = _ended(SweepJobs(tmp_path / "sw", store, "slurm"), a, job, "TIMEOUT", retry=True)
    assert then == (
        "end:requeued",
        "job 7_0 ended TIMEOUT without requeueing itself; submitted again, from its newest checkpoint",
    )
    assert (store.row(a)["status"], store.row(a)["job"]) == ("pending", None)
    assert (
        _ended(SweepJobs(tmp_path / "sw", store, "slurm"), a, job, "NODE_FAIL", retry=False)[0] == "end:ended preempted"
    )  # no retry left
    assert store.row(a)["status"] == "failed" and store.row(a)["reason"].startswith("job 7_0 ended NODE_FAIL; see ")
    assert (
        _ended(SweepJobs(tmp_path / "sw", store, "slurm"), b, job, "CANCELLED by 1000", retry=True)[0]
        == "end:ended cancelled"
    )
    assert store.row(b)["reason"] == "job 7_0 was cancelled by uid 1000; the next run of this sweep submits it again"
