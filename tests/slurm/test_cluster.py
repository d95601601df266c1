"""Sweeps on a real one-node SLURM (scripts/slurm_up.sh): a killed coordinator re-attached, a time limit and a
preemption checkpointed and requeued, a QOS submit limit, cancelling. Nano runs, one CPU per job.

Every test checks what a cluster user is promised: every run ends `ok` once, its row names the job that
trained it, sacct agrees (COMPLETED), no job is submitted twice, no live run is ever marked failed."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from normlab.experiments import SweepConfig
from normlab.experiments.runner import _to_toml
from tests.helpers import REPO

pytest.importorskip("submitit")

ENV = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NORMLAB_SLURM_POLL_S": "2", "OMP_NUM_THREADS": "1"}


def write_sweep(tmp_path: Path, corpus: Path, name: str, seeds: int, steps: int, **slurm) -> tuple[Path, str]:
    """The sweep file, and its name made unique (jobs are named normlab-NAME: sacct then finds this test's only)."""
    name = f"{name}-{uuid.uuid4().hex[:6]}"
    base = dict(
        data=str(corpus),
        size="nano",
        seq_len=32,
        batch_size=8,
        steps=steps,
        eval_every=0,
        eval_batches=1,
        probe_every=0,
        layout="pre",
        ckpt_every=max(1, steps // 4),
    )
    opts = {"timeout_min": 10, "cpus_per_task": 1, "slurm_partition": "debug", "slurm_signal_delay_s": 30, **slurm}
    sweep = SweepConfig(name=name, base=base, grid={"seed": list(range(seeds))}, executor="slurm", slurm=opts)
    path = tmp_path / f"{name}.toml"
    path.write_text(_to_toml(sweep.to_dict()))
    return path, name


def nano_step_seconds(corpus: Path, tmp_path: Path) -> float:
    """Seconds a step of the sweeps' nano run takes here now: 200 steps trained once, as a job would (one thread)."""
    out = tmp_path / "pace"
    cmd = [sys.executable, "-m", "normlab", "train", "--size", "nano", "--layout", "pre", "--data", str(corpus)]
    cmd += ["--seq-len", "32", "--batch-size", "8", "--steps", "200", "--eval-every", "0", "--probe-every", "0"]
    cmd += ["--no-progress", "--out", str(out)]
    subprocess.run(cmd, env={**ENV, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    return summary["wall_time_s"] / summary["steps"]


def sweep_cmd(path: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "normlab", "sweep", str(path), "--out", str(out)]


def rows(out: Path) -> list[dict]:
    try:
        with sqlite3.connect(out / "sweep.db", timeout=30) as con:
            con.row_factory = sqlite3.Row
            return [dict(r) for r in con.execute("select * from runs order by idx")]
    except sqlite3.OperationalError:
        return []


def wait_for(what: str, check, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def sacct(job_name: str) -> dict[str, str]:
    """job id -> final state of every job (array task) of that name; requeued incarnations counted once."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "--name", job_name, "-S", "now-2hours", "-o", "JobID,State"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line.strip())


def finish(path: Path, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_cmd(path, out), capture_output=True, text=True, env=ENV, timeout=timeout)


def check_ok_once(out: Path, name: str, runs: int) -> list[dict]:
    """Every run ok, recorded by the job the store holds for it, and sacct says that job COMPLETED; no other job."""
    got = rows(out)
    assert len(got) == runs and all(r["status"] == "ok" for r in got), [
        (r["run_id"], r["status"], r["reason"]) for r in got
    ]
    jobs = sacct(f"normlab-{name}")
    assert sorted(jobs) == sorted(r["job"] for r in got), (jobs, [r["job"] for r in got])  # one job per run
    for r in got:
        assert r["worker"] == r["job"] and jobs[r["job"]] == "COMPLETED", (r, jobs)
    return got


def test_killed_coordinator_rerun_reattaches_to_live_jobs(corpus, tmp_path):
    """kill -9 of the coordinator while its jobs train, then the same command: no job submitted twice, no live run
    marked failed, every run ok once (attempts 1) with its first job."""
    path, name = write_sweep(tmp_path, corpus, "reattach", seeds=3, steps=600, slurm_array_parallelism=2)
    out = tmp_path / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for("a run training", lambda: any(r["status"] == "running" for r in rows(out)))
    jobs_before = {r["run_id"]: r["job"] for r in rows(out)}
    assert all(jobs_before.values())  # every job id stored at submission
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = finish(path, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not submitted again" in done.stdout
    got = check_ok_once(out, name, 3)
    assert {r["run_id"]: r["job"] for r in got} == jobs_before
    assert all(r["attempts"] == 1 for r in got)
    logs = "".join(p.read_text() for p in (out / "logs" / "jobs").rglob("*_log.out"))
    assert logs.count("1 torch thread(s), from the allocation") == 3  # cpus_per_task = 1, on a 2-CPU node


def test_time_limit_checkpoints_requeues_and_ends_ok(corpus, tmp_path):
    """A run longer than its --time (2 min): SLURM's USR2 30 s before the limit saves it and requeues the job,
    which continues from that save; the row and sacct agree: ok, COMPLETED, one job."""
    # The steps sized from this machine's own pace (not from a figure measured elsewhere): a life of 2 minutes trains
    # at most about 90 s, so steps worth 300 s at the measured pace need three lives or more even if the machine
    # runs 3x faster during the test, and end within the ten requeues allowed if it runs 3x slower
    steps = max(2000, int(300 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(
        tmp_path, corpus, "timelimit", seeds=1, steps=steps, timeout_min=2, slurm_max_num_timeout=10
    )
    out = tmp_path / "sw"
    done = finish(path, out, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = check_ok_once(out, name, 1)
    assert row["attempts"] >= 2  # trained in two jobs' lives at least
    logs = "".join(p.read_text() for p in (out / "logs" / "jobs").rglob("*_log.*"))
    assert "Job has timed out" in logs and "resuming from step_" in logs


def test_preemption_signal_checkpoints_requeues_and_ends_ok(corpus, tmp_path):
    """scancel --signal=USR2 (what a preempting scheduler sends): saved now, requeued, resumed, ok once."""
    path, name = write_sweep(tmp_path, corpus, "preempt", seeds=1, steps=800)
    out = tmp_path / "sw"
    proc = subprocess.Popen(sweep_cmd(path, out), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = wait_for("the run", lambda: next((out / "runs").glob("*"), None) if (out / "runs").is_dir() else None)
    wait_for(
        "steps logged",
        lambda: (
            (run_dir / "metrics.jsonl").is_file() and len((run_dir / "metrics.jsonl").read_text().splitlines()) > 50
        ),
    )
    (job,) = [r["job"] for r in rows(out)]
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_for(
        "the run back in the queue",
        lambda: any(r["status"] == "pending" and r["reason"] for r in rows(out)),
        timeout=120,
    )
    assert "saved at step" in rows(out)[0]["reason"]
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text
    (row,) = check_ok_once(out, name, 1)
    assert row["attempts"] == 2


def test_a_qos_submit_limit_is_waited_out_never_orphaning_jobs(corpus, tmp_path):
    """QOS normlab-limited lets 3 jobs wait or run; 5 runs: the refused part is retried with smaller arrays and a
    growing wait while the submitted jobs run; all 5 end ok, each in one job. Each job trains for about 20 s at this
    machine's measured pace, so the 3 the QOS admits still wait or run when the rest are sent (on a fast machine
    40 steps ended before the next submission, and nothing was refused)."""
    steps = max(40, int(20 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(
        tmp_path, corpus, "qos", seeds=5, steps=steps, slurm_qos="normlab-limited", slurm_array_parallelism=2
    )
    out = tmp_path / "sw"
    done = finish(path, out, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "submission refused (" in done.stdout and "QOSMaxSubmitJobPerUserLimit" in done.stdout
    check_ok_once(out, name, 5)


def test_ctrl_c_leaves_the_jobs_and_cancel_is_one_line(corpus, tmp_path):
    """Ctrl-C without a terminal leaves the job running and says how to cancel it; `normlab sweep --cancel DIR`
    cancels it, the row says so in one line, and the rerun trains the run in a new job. The run lasts about two
    minutes at this machine's measured pace, so the job is still there when Ctrl-C comes."""
    steps = max(1500, int(120 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(tmp_path, corpus, "cancel", seeds=1, steps=steps)
    out = tmp_path / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out),
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for("the run training", lambda: any(r["status"] == "running" for r in rows(out)))
    time.sleep(3)  # the coordinator back in its watch loop
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "left 1 job(s) running" in text and f"normlab sweep --cancel {out}" in text, text
    (job,) = [r["job"] for r in rows(out)]
    assert subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip()  # still there
    cancel = subprocess.run(
        [sys.executable, "-m", "normlab", "sweep", "--cancel", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert cancel.returncode == 0 and f"cancelled 1 job(s) of {out}: {job}" in cancel.stdout, (
        cancel.stdout + cancel.stderr
    )
    (row,) = rows(out)
    assert (
        row["status"] == "failed"
        and "\n" not in row["reason"]
        and "cancelled by normlab sweep --cancel" in row["reason"]
    ), row
    done = finish(path, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        rows(out)[0]["status"] == "ok" and rows(out)[0]["job"] != job and rows(out)[0]["worker"] == rows(out)[0]["job"]
    )
    # the cancelled job saved its run on SIGTERM: the new one continued from there
    logs = "".join(p.read_text() for p in (out / "logs" / "jobs").rglob("*_log.*") if rows(out)[0]["job"] in p.name)
    assert "resuming from step_" in logs, logs[-2000:]


def test_ctrl_c_on_a_terminal_asks_and_cancels(corpus, tmp_path):
    """On a terminal, Ctrl-C asks whether to cancel the sweep's jobs; "y" cancels them (the run sized to last about
    two minutes at this machine's measured pace, so the job is still there to cancel)."""
    import pty

    steps = max(1500, int(120 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(tmp_path, corpus, "ask", seeds=1, steps=steps)
    out = tmp_path / "sw"
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=ENV, stdin=follower, stdout=follower, stderr=follower, start_new_session=True
    )
    os.close(follower)
    wait_for("the run training", lambda: any(r["status"] == "running" for r in rows(out)))
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    seen = b""
    deadline = time.time() + 60
    while b"[y/N]" not in seen and time.time() < deadline:
        seen += os.read(leader, 4096)
    assert b"cancel this sweep's 1 job(s)" in seen, seen
    os.write(leader, b"y\n")
    proc.wait(timeout=120)
    os.close(leader)
    (row,) = rows(out)
    assert row["status"] == "failed" and "cancelled at Ctrl-C" in row["reason"], row
    wait_for(
        "the job gone",
        lambda: not subprocess.run(["squeue", "-h", "-j", row["job"]], capture_output=True, text=True).stdout.strip(),
        timeout=60,
    )


class Watch:
    """Every (run, status, job) the store shows, polled twice a second while a test runs: a run seen `failed` must
    never have had a live job at that moment (`failed_while_live`)."""

    def __init__(self, out: Path) -> None:
        import threading

        self.out, self.failed, self.stop = out, set(), threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            for r in rows(self.out):
                if r["status"] == "failed":
                    self.failed.add((r["run_id"], r["job"], r["reason"]))
            time.sleep(0.5)

    def failed_while_live(self, name: str) -> list[tuple]:
        """The failed rows seen whose job ended other than cancelled (sacct): a live run marked failed."""
        self.stop.set()
        self.thread.join()
        jobs = sacct(f"normlab-{name}")
        return [f for f in self.failed if not jobs.get(f[1], "").startswith("CANCELLED")]


def test_jobs_scancelled_by_the_user_are_submitted_again_by_the_rerun(corpus, tmp_path):
    """The user scancels one job while the coordinator watches it, then kill -9 of the coordinator and a scancel of
    another job: the first row says in one line that its job was cancelled; the rerun submits exactly the two
    cancelled runs again (the third is re-attached), and every run ends ok once, no row ever failed but a
    cancelled job's."""
    path, name = write_sweep(tmp_path, corpus, "scancel", seeds=3, steps=1500, slurm_array_parallelism=3)
    out = tmp_path / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    watch = Watch(out)
    first = wait_for("a run training", lambda: next((r for r in rows(out) if r["status"] == "running"), None))
    subprocess.run(["scancel", first["job"]], check=True)
    row = wait_for(
        "the cancel recorded",
        lambda: next((r for r in rows(out) if r["run_id"] == first["run_id"] and r["status"] == "failed"), None),
        timeout=120,
    )
    assert "\n" not in row["reason"] and f"job {first['job']} was cancelled by uid" in row["reason"], row
    second = wait_for(
        "another run training",
        lambda: next((r for r in rows(out) if r["status"] == "running" and r["run_id"] != first["run_id"]), None),
        timeout=120,
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    subprocess.run(["scancel", second["job"]], check=True)
    done = finish(path, out)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(out)
    assert len(got) == 3 and all(r["status"] == "ok" and r["worker"] == r["job"] for r in got), got
    jobs = sacct(f"normlab-{name}")
    cancelled = {first["run_id"]: first["job"], second["run_id"]: second["job"]}
    assert {j for j, s in jobs.items() if s.startswith("CANCELLED")} == set(cancelled.values()), jobs
    for r in got:  # the cancelled runs trained by a new job; the other by its first
        assert r["job"] != cancelled.get(r["run_id"]) and jobs[r["job"]] == "COMPLETED", (r, jobs)
    assert len(jobs) == 5  # 3 first jobs, 2 submitted again: none twice
    assert watch.failed_while_live(name) == []


def test_a_job_whose_id_was_never_stored_is_found_by_the_runs_lock(corpus, tmp_path):
    """Rows whose job ids are lost after their jobs were released (the store edited, or written by a normlab that
    did not hold its submissions; simulated: the ids and any announcement erased): the rerun finds the running jobs
    by their runs' locks and watches them; the pending one it cannot know is submitted again, and whichever of the two
    jobs starts second finds the run locked or done: no row ever failed, each run ok once with the job that trained
    it. (A coordinator
    killed as it submits loses no id: test_a_coordinator_killed_as_it_submits_reattaches_to_the_pending_jobs.)

    Each job trains for about 30 s at this machine's measured pace, so the two running jobs still hold their locks
    and the third still pends when the rerun reads them (on a fast machine 1,500 steps ended in 13 s, before the
    rerun's first pass, and the third job was found by its lock instead)."""
    steps = max(1500, int(30 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(tmp_path, corpus, "lost-id", seeds=3, steps=steps, slurm_array_parallelism=3)
    out = tmp_path / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    watch = Watch(out)
    wait_for("two runs training", lambda: sum(r["status"] == "running" for r in rows(out)) == 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {r["run_id"]: (r["status"], r["job"]) for r in rows(out)}
    with sqlite3.connect(out / "sweep.db", timeout=30) as con:
        con.execute("update runs set job = null")
        con.execute("delete from meta where key = 'slurm_submissions'")  # dropped with the pass after the release
    done = finish(path, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("holds its lock and is alive; watching it") >= 2, done.stdout
    got = rows(out)
    assert len(got) == 3 and all(r["status"] == "ok" and r["worker"] == r["job"] for r in got), got
    jobs = sacct(f"normlab-{name}")
    assert all(s == "COMPLETED" for s in jobs.values()), jobs
    for r in got:
        if before[r["run_id"]][0] == "running":  # re-attached, not submitted again
            assert r["job"] == before[r["run_id"]][1] and r["attempts"] == 1, (r, before)
    assert len(jobs) == 4  # the one duplicate: the pending job whose id was lost
    assert watch.failed_while_live(name) == []


def test_a_time_limit_cut_short_saves_at_the_cut_and_the_run_goes_on(corpus, tmp_path):
    """`scontrol update TimeLimit=1` on a job that has trained past a minute: SLURM ends it at once and signals
    USR2 with it; the run saves at that step (not at a periodic checkpoint), the job is requeued and continues
    from that save (its limit given back while it waits: a requeued job keeps the shortened one), and the run
    ends ok once, no row ever failed."""
    # steps for about four minutes at this machine's measured pace: longer than the minute the job must pass
    # before it is cut (a fixed 12,000 steps ended in 70 s on an idle machine, before the cut), and the pace
    # measured here, so a loaded machine does not stretch the run past the waits below
    steps = max(12000, int(240 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(tmp_path, corpus, "cut", seeds=1, steps=steps, slurm_max_num_timeout=10)
    out = tmp_path / "sw"
    proc = subprocess.Popen(sweep_cmd(path, out), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = Watch(out)
    (job,) = [
        wait_for("the run training", lambda: next((r["job"] for r in rows(out) if r["status"] == "running"), None))
    ]

    def elapsed() -> int:
        text = subprocess.run(["squeue", "-h", "-j", job, "-o", "%M"], capture_output=True, text=True).stdout.strip()
        parts = [int(x) for x in text.replace("-", ":").split(":")] if text else [0]
        return sum(v * 60**i for i, v in enumerate(reversed(parts)))

    wait_for("the job past a minute", lambda: elapsed() > 65, timeout=200)
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"], check=True)
    wait_for(
        "the run saved and requeued",
        lambda: any(r["status"] == "pending" and "saved at step" in (r["reason"] or "") for r in rows(out)),
        timeout=200,
    )
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], check=True)
    text, _ = proc.communicate(timeout=1800)
    assert proc.returncode == 0, text
    (row,) = check_ok_once(out, name, 1)
    assert row["attempts"] >= 2
    logs = "".join(p.read_text() for p in (out / "logs" / "jobs").rglob("*_log.*"))
    resumed = [int(step) for step in re.findall(r"resuming from step_(\d+)", logs)]
    assert resumed and resumed[0] % (steps // 4) != 0, resumed  # saved at the cut, not at a periodic checkpoint
    assert watch.failed_while_live(name) == []


# The coordinator killed the moment sbatch accepted its array (an `sbatch` first on PATH runs the real one, prints
# its answer, then kill -9s its caller): before it stored the job ids or handed the jobs their pickles. Or killed as
# it releases the held array (an `scontrol` that kill -9s its caller on `release`): the ids stored, the jobs held.
KILLERS = {  # (sbatch --test-only, the check before anything is written, passes through)
    "sbatch": '#!/bin/sh\n[ "$1" = --test-only ] && exec /usr/bin/sbatch "$@"\n'
    'out=$(/usr/bin/sbatch "$@") || exit $?\necho "$out" | tee {accepted}\nkill -9 $PPID\n',
    "scontrol": '#!/bin/sh\n[ "$1" = release ] && echo "$2" > {accepted} && kill -9 $PPID && exit\n'
    'exec /usr/bin/scontrol "$@"\n',
}


@pytest.mark.parametrize("moment", sorted(KILLERS))
def test_a_coordinator_killed_as_it_submits_reattaches_to_the_pending_jobs(corpus, tmp_path, moment):
    """The coordinator killed while it submits (KILLERS), the node busy (a 2-CPU job holds it): the array's jobs wait
    PENDING. The rerun must find them through the scheduler and watch them, submitting nothing: each run ends ok once
    with the job of that array, and sacct knows no other job of the sweep."""
    path, name = write_sweep(tmp_path, corpus, f"pending-{moment}", seeds=2, steps=40)
    out = tmp_path / "sw"
    bin_dir, accepted = tmp_path / "bin", tmp_path / "accepted"
    bin_dir.mkdir()
    (bin_dir / moment).write_text(KILLERS[moment].format(accepted=accepted))
    (bin_dir / moment).chmod(0o755)
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-c2", "-p", "debug", "-o", "/dev/null", "-J", f"normlab-blocker-{name}"]
        + ["--wrap", "sleep 600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        killed = subprocess.run(
            sweep_cmd(path, out), env={**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}"}, capture_output=True, text=True
        )
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        array = accepted.read_text().split()[-1]
        states = subprocess.run(["squeue", "-h", "-r", "-j", array, "-o", "%i %T %r"], capture_output=True, text=True)
        assert [x.split()[:2] for x in states.stdout.splitlines()] == [
            [f"{array}_0", "PENDING"],
            [f"{array}_1", "PENDING"],
        ], states.stdout
        if moment == "scontrol":  # sent held, and never released
            assert states.stdout.count("JobHeldUser") == 2, states.stdout
        stored = sorted(r["job"] or "" for r in rows(out))
        assert stored == (["", ""] if moment == "sbatch" else [f"{array}_0", f"{array}_1"]), stored
        rerun = subprocess.Popen(
            sweep_cmd(path, out), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        wait_for("the rerun watching both jobs", lambda: all(r["job"] for r in rows(out)), timeout=120)
    finally:
        subprocess.run(["scancel", blocker], check=False)
    text, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, text
    assert text.count("; watching it (not submitted again)") == 2 and "submitted" not in text.replace(
        "not submitted again", ""
    ), text
    got = check_ok_once(out, name, 2)
    assert sorted(r["job"] for r in got) == [f"{array}_0", f"{array}_1"]
    assert all(r["attempts"] == 1 for r in got)


def test_cancel_reaches_the_jobs_of_a_coordinator_killed_as_sbatch_accepts(corpus, tmp_path):
    """`normlab sweep --cancel DIR` after a coordinator was killed the moment sbatch accepted its array (ids not
    stored, jobs held): it cancels those jobs too, and the rerun submits both runs anew; each ends ok once."""
    path, name = write_sweep(tmp_path, corpus, "cancel-held", seeds=2, steps=40)
    out = tmp_path / "sw"
    bin_dir, accepted = tmp_path / "bin", tmp_path / "accepted"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(KILLERS["sbatch"].format(accepted=accepted))
    (bin_dir / "sbatch").chmod(0o755)
    killed = subprocess.run(
        sweep_cmd(path, out), env={**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}"}, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    array = accepted.read_text().split()[-1]
    cancel = subprocess.run(
        [sys.executable, "-m", "normlab", "sweep", "--cancel", str(out)], capture_output=True, text=True, env=ENV
    )
    assert cancel.returncode == 0 and "cancelled 2 job(s)" in cancel.stdout, cancel.stdout + cancel.stderr
    assert not subprocess.run(["squeue", "-h", "-j", array], capture_output=True, text=True).stdout.strip()
    done = finish(path, out)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(out)
    assert all(r["status"] == "ok" and r["worker"] == r["job"] and not r["job"].startswith(f"{array}_") for r in got)
    jobs = sacct(f"normlab-{name}")  # the jobs that ran; the held array never did: sacct lists it by its id only
    assert sorted(jobs.values()) == ["COMPLETED", "COMPLETED"], jobs
    held = subprocess.run(["sacct", "-n", "-X", "-P", "-j", array, "-o", "State"], capture_output=True, text=True)
    assert held.stdout.split("\n")[0].startswith("CANCELLED"), held.stdout
