"""Nothing already written is lost: --out guards, resume checks, checkpoint fallbacks and checksums, kills
at every stage, one process per run, a killed sweep coordinator takes its workers."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from normlab.cli import main
from normlab.errors import ConfigError
from normlab.runs.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from normlab.runs.start import RunLock
from normlab.train import train
from normlab.train import trainer as trainer_mod
from normlab.train.divergence import DivergenceMonitor
from tests.helpers import (
    PATIENCE_S,
    REPO,
    export_nano,
    interrupt_at,
    interrupted,
    losses,
    rows,
    small,
    wait_until,
)


def test_no_command_writes_over_files_it_did_not_write(corpus, tmp_path, capsys, monkeypatch):
    """sweep, report, summarize and scan write only into folders normlab made (or new, empty ones)."""
    from normlab.io import MARKER

    mine = tmp_path / "project"
    mine.mkdir()
    user_files = {
        "sweep.toml": "# my sweep, with comments\nname = 'mine'\n[grid]\nlayout = ['pre']\n",
        "summary.md": "my notes",
        "report.html": "<p>mine</p>",
        "runs.csv": "a,b\n",
    }
    for name, text in user_files.items():
        (mine / name).write_text(text)
    monkeypatch.chdir(mine)
    base = [
        "--set",
        f"data={corpus}",
        "--set",
        "size=nano",
        "--set",
        "steps=2",
        "--set",
        "seq_len=16",
        "--set",
        "batch_size=4",
        "--set",
        "probe_every=0",
        "--set",
        "device=cpu",
    ]
    assert main(["sweep", "sweep.toml", "--out", ".", *base]) == 2
    assert "holds files normlab did not write" in capsys.readouterr().err
    assert main(["sweep", "sweep.toml", "--out", str(tmp_path / "sw"), *base]) == 0  # a new folder: fine
    assert (tmp_path / "sw" / MARKER).is_file()
    assert main(["sweep", "sweep.toml", "--out", str(tmp_path / "sw"), *base]) == 0  # its own folder: reused
    assert main(["summarize", str(tmp_path / "sw"), "--out", "."]) == 2
    run = next((tmp_path / "sw" / "runs").iterdir())
    report_dir = tmp_path / "rep"
    report_dir.mkdir()
    (report_dir / "index.html").write_text("<p>the user's page</p>")
    assert main(["report", str(run), "--out", str(report_dir)]) == 2
    assert (report_dir / "index.html").read_text() == "<p>the user's page</p>"
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 0  # its own report: rewritten
    (tmp_path / "rep2" / MARKER).unlink()  # without normlab's marker a report folder is someone's: refused
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 2
    export = export_nano(tmp_path)
    (export / "scan").mkdir()
    (export / "scan" / "table.md").write_text("the user's table")
    assert main(["scan", str(export)]) == 2
    assert (export / "scan" / "table.md").read_text() == "the user's table"
    assert main(["scan", str(run)]) == 2  # a run folder is not a transformers folder: one line
    assert "normlab run directory" in capsys.readouterr().err
    for name, text in user_files.items():
        assert (mine / name).read_text() == text
    assert sorted(p.name for p in mine.iterdir()) == sorted(user_files)


def test_a_refused_model_option_leaves_nothing_that_blocks_the_corrected_command(corpus, tmp_path):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--size",
                "nano",
                "--steps",
                "2",
                "--seq-len",
                "32",
                "--no-progress",
                "--model",
                "max_seq_len=8",
                "--out",
                str(run),
            ]
        )
        == 2
    )
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--size",
                "nano",
                "--steps",
                "2",
                "--seq-len",
                "32",
                "--no-progress",
                "--out",
                str(run),
            ]
        )
        == 0
    )


def test_out_refuses_folders_that_are_not_runs(corpus, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="not a normlab run"):
        train(small(corpus, export, steps=2))
    assert json.loads((export / "config.json").read_text()) == {"model_type": "llama"}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a normlab run"):
        train(small(corpus, plain, steps=2))
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train(small(corpus, afile, steps=2))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(small(corpus, empty, steps=2))["status"] == "ok"


def test_a_run_killed_before_its_first_checkpoint_restarts_cleanly(corpus, tmp_path, monkeypatch):
    full = small(corpus, tmp_path / "full", steps=12, eval_every=4, probe_every=4)
    train(full)
    cut = small(corpus, tmp_path / "cut", steps=12, eval_every=4, probe_every=4)
    restore = interrupt_at(monkeypatch, 5)  # the first checkpoint (auto: every 10 steps) is never reached
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    restore()
    assert not list_checkpoints(cut.run.out) and len(rows(cut.run.out)) == 5
    s = train(cut)
    assert s["status"] == "ok" and [r["step"] for r in rows(cut.run.out)] == list(range(12))
    assert losses(cut.run.out) == losses(full.run.out)


def test_corrupt_newest_checkpoint_falls_back_and_torn_jsonl_is_cut(corpus, tmp_path, monkeypatch, capsys):
    full, cut = interrupted(corpus, tmp_path, monkeypatch, probe_every=3)
    newest = list_checkpoints(cut.run.out)[-1]
    assert newest.name == "step_00000009.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # torn by a full disk
    for name in ("metrics.jsonl", "probes.jsonl"):
        with open(Path(cut.run.out) / name, "a") as f:
            f.write('{"step": 10, "loss": 1.2')  # a torn last line
    s = train(cut, log=print)
    assert "skipping checkpoint step_00000009.pt" in capsys.readouterr().out
    assert s["status"] == "ok" and losses(cut.run.out) == losses(full.run.out)
    assert [r["step"] for r in rows(cut.run.out)] == list(range(12))


def test_a_bit_flipped_checkpoint_is_caught_by_its_checksum_and_skipped(corpus, tmp_path, monkeypatch, capsys):
    full, cut = interrupted(corpus, tmp_path, monkeypatch, probe_every=0)
    newest = list_checkpoints(cut.run.out)[-1]
    assert (newest.parent / (newest.name + ".sha256")).is_file()
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, inside a tensor's bytes: torch.load alone would not notice
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        load_checkpoint(newest)
    s = train(cut, log=print)
    assert "skipping checkpoint step_00000009.pt" in capsys.readouterr().out
    assert s["status"] == "ok" and losses(cut.run.out) == losses(full.run.out)
    assert sorted(
        p.name for p in (Path(cut.run.out) / "checkpoints").iterdir() if p.name.endswith(".sha256")
    ) == sorted(p.name + ".sha256" for p in list_checkpoints(cut.run.out))  # pruned together


def test_a_kill_during_the_first_config_write_does_not_block_the_run(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("")
    (run / ".config.json.k2x9abcd.tmp").write_text('{"config": {"ste')  # killed mid-write
    s = train(small(corpus, run, steps=3))
    assert s["status"] == "ok" and not list(run.glob("*.tmp"))
    assert (run / ".lock").read_text() == ""  # a finished run's lock names no process


def test_a_kill_after_the_last_checkpoint_keeps_the_final_validation_loss(corpus, tmp_path):
    run = tmp_path / "run"
    s = train(small(corpus, run, steps=6, probe_every=0))
    (run / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    again = train(small(corpus, run, steps=6, probe_every=0))
    assert again["final_val_loss"] == s["final_val_loss"] is not None
    assert again["final_loss"] == s["final_loss"] and again["steps"] == s["steps"]


def test_resume_refuses_any_identity_change(corpus, tmp_path, monkeypatch):
    cut = small(corpus, tmp_path / "r", steps=12, ckpt_every=3)
    restore = interrupt_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    restore()
    for change, name in (
        (dict(grad_clip=0.01), "grad_clip"),
        (dict(beta2=0.5), "beta2"),
        (dict(eps=1e-6), "eps"),
        (dict(z_loss=1e-4), "z_loss"),
        (dict(wd_exclude="norms"), "wd_exclude"),
        (dict(beta1=0.8), "beta1"),
    ):
        with pytest.raises(ConfigError, match=f"different settings \\({name}:"):
            train(small(corpus, tmp_path / "r", steps=12, ckpt_every=3, **change))
    # reporting settings are not identity: a resume may change them
    assert train(small(corpus, tmp_path / "r", steps=12, ckpt_every=4, eval_every=3))["status"] == "ok"


def test_a_finished_run_is_not_rewritten(corpus, tmp_path):
    cfg = small(corpus, tmp_path / "r", steps=3)
    first = train(cfg)
    before = (tmp_path / "r" / "summary.json").read_bytes()
    again = train(cfg)
    assert again == first and again["final_val_loss"] is not None
    assert (tmp_path / "r" / "summary.json").read_bytes() == before


def test_a_run_never_executes_twice_at_once(tmp_path):
    held = RunLock(tmp_path / "r")
    try:
        with pytest.raises(ConfigError, match="being trained by pid"):
            RunLock(tmp_path / "r", wait=0.3)
    finally:
        held.release()
    RunLock(tmp_path / "r", wait=0.3).release()  # free again once released


RUN_HOLDER = """
import sys
from pathlib import Path
from normlab.runs.lock import RunLock
held = RunLock(Path(sys.argv[1]), wait=0)  # kept: the lock lives as long as this object
print("held", flush=True)
sys.stdin.read()  # until the test closes the pipe or kills it
"""


@pytest.mark.parametrize("shared", ["0", "1"], ids=["flock", "lock-file"])
def test_a_sweep_worker_waits_for_a_live_local_holder_of_its_run_however_long_it_takes(tmp_path, monkeypatch, shared):
    """A killed sweep's worker may still hold its run when the rerun's worker asks for it (kill -9 to exit takes
    what a loaded machine gives it): the new worker (`patient`) waits while that holder lives, judged by its pid
    and start time, not for a fixed 10 s; a caller that is not patient is refused at its bound, as before."""
    from normlab.runs import lock as lock_mod
    from normlab.runs.lock import LockBusy

    monkeypatch.setenv("NORMLAB_SHARED_FS", shared)
    run = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NORMLAB_SHARED_FS": shared}
    holder = subprocess.Popen(
        [sys.executable, "-c", RUN_HOLDER, str(run)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockBusy, match=f"being trained by pid {holder.pid}"):
            RunLock(run, wait=0)  # not patient: refused at its bound
        judged, real = threading.Event(), lock_mod.alive_here
        monkeypatch.setattr(lock_mod, "alive_here", lambda info: judged.set() or real(info))
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(RunLock(run, wait=0, patient=True)))
        waiter.start()
        wait_until("the patient worker to judge the holder", judged.is_set)
        assert not got and waiter.is_alive()  # the holder lives: still waiting, past its 0 s bound
    finally:
        holder.kill()
        holder.wait()
    waiter.join(PATIENCE_S)
    assert len(got) == 1, "the patient worker never took the run once its holder had ended"
    got[0].release()


def test_skipping_most_steps_is_divergence(corpus, tmp_path, monkeypatch):
    real = trainer_mod._loss
    monkeypatch.setattr(trainer_mod, "_loss", lambda *a: (real(*a)[0] * float("nan"), None))
    s = train(small(corpus, tmp_path / "nan", steps=15, on_nonfinite="skip"))
    assert s["status"] == "diverged" and "10 of 10 steps skipped" in s["reason"]
    m = DivergenceMonitor(max_skipped=0.1)
    for step in range(20):  # one skip in 20 steps is within the 10% allowed
        if step == 3:
            assert not m.check_finite(step, float("nan"), 1.0, "skip")
        else:
            m.update(step, 2.0, 1.0)
    m.finish(20)
    assert m.status == "ok" and m.skipped_steps == [3]


def _workers_of(coordinator: int) -> list[int]:
    """The run processes of the sweep process `coordinator`: the children of its fork server
    (`normlab.experiments.workers`), read from /proc."""
    parent, cmd = {}, {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(proc.name)] = (proc / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
    servers = {p for p, pp in parent.items() if pp == coordinator and b"multiprocessing.forkserver" in cmd[p]}
    return [p for p, pp in parent.items() if pp in servers]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the worker processes")
@pytest.mark.long
def test_kill_9_of_the_sweep_coordinator_takes_its_workers_and_nothing_runs_twice(corpus, tmp_path):
    root = tmp_path / "sw"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "normlab",
        "sweep",
        "--grid",
        "seed=0,1",
        "--set",
        "size=nano",
        "--set",
        "steps=60",
        "--set",
        f"data={corpus}",
        "--set",
        "seq_len=32",
        "--set",
        "batch_size=8",
        "--set",
        "eval_every=0",
        "--set",
        "probe_every=0",
        "--set",
        "ckpt_every=20",
        "--workers",
        "2",
        "--out",
        str(root),
    ]

    def start_then_kill(ready, what: str) -> list[int]:
        """Start the sweep, wait (however slow the machine) until both workers run and ``ready()``, kill -9 it."""
        coord = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def both_running() -> bool:
            if coord.poll() is not None:
                pytest.fail(f"the sweep ended (exit {coord.returncode}) before {what}; make its runs longer")
            return len(_workers_of(coord.pid)) == 2 and bool(ready())

        try:
            wait_until(f"the sweep's 2 workers and {what}", both_running)
            workers = _workers_of(coord.pid)
            assert len(workers) == 2
        finally:
            coord.send_signal(signal.SIGKILL)
            coord.wait()
        return workers

    def running(pids: list[int]) -> list[int]:
        """The pids still running (not gone, not zombies)."""
        left = []
        for p in pids:
            try:
                if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(p)
            except OSError:
                continue
        return left

    def ended_with_the_sweep(workers: list[int]) -> None:
        """The workers end (polled, however slow the machine) without finishing a run: one that outlived its
        sweep would train on to the end and write the run's summary.json."""
        wait_until(f"the killed sweep's workers {workers} to end", lambda: not running(workers))
        finished = [r.name for r in (root / "runs").glob("*") if (r / "summary.json").exists()]
        assert not finished, f"a worker outlived its killed sweep and finished {finished}"

    # 1. killed as its workers start: they must not live on (the fork server ends with the sweep process,
    # and each worker with the server); judged by their liveness, however long the machine takes to end them
    ended_with_the_sweep(start_then_kill(lambda: True, "nothing else"))
    # 2. killed mid-training, after a checkpoint: the workers go with it, the rerun resumes
    ended_with_the_sweep(
        start_then_kill(lambda: bool(list((root / "runs").glob("*/checkpoints/step_*.pt"))), "a run's first checkpoint")
    )
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert res.returncode == 0, res.stderr[-2000:]
    for run in (root / "runs").iterdir():
        assert [r["step"] for r in rows(run)] == list(range(60))  # resumed, each step once
    # 3. the same command once more: finished runs are neither redone nor rewritten (the quick cover of
    # test_experiments.py's slow kill-and-resume test)
    with sqlite3.connect(root / "sweep.db") as con:
        done = con.execute(
            "select run_id, status, final_loss, finished_at, attempts from runs order by run_id"
        ).fetchall()
    assert [r[1] for r in done] == ["ok", "ok"]
    assert main(cmd[3:]) == 0  # the same `normlab sweep` arguments, in this process: nothing left to start
    with sqlite3.connect(root / "sweep.db") as con:
        assert (
            con.execute("select run_id, status, final_loss, finished_at, attempts from runs order by run_id").fetchall()
            == done
        )


@pytest.mark.parametrize("shared", ["0", "1"], ids=["flock", "lock-file"])
def test_a_patient_worker_takes_the_run_when_its_holder_ends_between_its_try_and_its_look(
    tmp_path, monkeypatch, shared
):
    """The race a loaded machine hit: the patient worker's try fails while the holder lives, the holder exits (its
    lock freed), and the worker's liveness look finds it gone. It must take the lock, not refuse it."""
    from normlab.runs import lock as lock_mod

    monkeypatch.setenv("NORMLAB_SHARED_FS", shared)
    lock_file = tmp_path / "r" / "run.lock"
    lock_file.parent.mkdir()
    if shared == "0":
        holder = open(lock_file, "a+")  # noqa: SIM115 - another open file description: flock conflicts in one process too
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write(json.dumps(lock_mod.holder_info()))
        holder.flush()
        end_holder = holder.close
    else:
        lock_file.write_text(json.dumps({**lock_mod.holder_info(), "pid": 1}))  # a live pid: never stale here
        end_holder = lock_file.unlink
    looks: list[bool] = []

    def the_holder_just_ended(info):
        if not looks:
            end_holder()  # it exits between the worker's failed try and this look
        looks.append(False)
        return False

    monkeypatch.setattr(lock_mod, "alive_here", the_holder_just_ended)
    monkeypatch.setattr(lock_mod, "stale", lambda held, age: False)
    got = lock_mod.FolderLock(lock_file, 0, lambda text: f"busy: {text}", patient=True)
    try:
        assert looks == [False]  # one look, then the lock was taken
    finally:
        got.release()
    # a holder that stays (not a live process here: another host's, say) is still refused, after one more try
    other = open(lock_file, "a+") if shared == "0" else None  # noqa: SIM115 - closed below
    try:
        if other is not None:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            lock_file.write_text(json.dumps({**lock_mod.holder_info(), "pid": 1}))
        monkeypatch.setattr(lock_mod, "alive_here", lambda info: False)
        with pytest.raises(lock_mod.LockBusy, match="busy: "):
            lock_mod.FolderLock(lock_file, 0, lambda text: f"busy: {text}", patient=True)
    finally:
        if other is not None:
            other.close()


def test_each_holder_that_ends_gets_the_patient_workers_last_look(tmp_path, monkeypatch):
    """The first holder ends and a second takes the run at once; the worker sees the second alive, then it ends
    too between a try and a look: the worker's extra try is renewed for each holder, so it takes the run."""
    from normlab.runs import lock as lock_mod

    monkeypatch.setenv("NORMLAB_SHARED_FS", "0")
    lock_file = tmp_path / "r" / "run.lock"
    lock_file.parent.mkdir()
    holders = [open(lock_file, "a+")]  # noqa: SIM115 - closed by the looks below
    fcntl.flock(holders[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
    looks: list[bool] = []

    def look(info):
        n = len(looks)
        if n == 0:  # the first holder ends and a second takes the lock before the worker's next try
            holders[0].close()
            holders.append(open(lock_file, "a+"))  # noqa: SIM115
            fcntl.flock(holders[1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        alive = n == 1  # the second holder is seen alive once, then ends just before the third look
        if n == 2:
            holders[1].close()
        looks.append(alive)
        return alive

    monkeypatch.setattr(lock_mod, "alive_here", look)
    got = lock_mod.FolderLock(lock_file, 0, lambda text: f"busy: {text}", patient=True)
    got.release()
    assert looks == [False, True, False]
