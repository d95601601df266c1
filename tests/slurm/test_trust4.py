"""Issue 51 item 4 on a real one-node SLURM (scripts/slurm_up.sh: partitions debug and short, MaxTime 5 min): a
store naming someone else's job (cancel and rerun leave it alone), requests SLURM accepts and never starts (refused
up front; a limit lowered after submission stops the coordinator instead of leaving it waiting), a planted result
pickle never unpickled, a used-up timeout budget said in one line, and bad [slurm] options refused in one line with
sbatch's own words. Nano runs, one CPU per job; every wait is bounded."""

from __future__ import annotations

import os
import pickle
import re
import signal
import sqlite3
import subprocess
import sys
import tomllib

import pytest

from tests.slurm.test_cluster import ENV, finish, nano_step_seconds, rows, sacct, sweep_cmd, wait_for, write_sweep

pytest.importorskip("submitit")


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: ") and "Traceback" not in err, err
    return lines[0]


def squeue_lists(job: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip())


@pytest.fixture
def short_partition():
    """The partition `short` of slurm_up.sh (MaxTime 5 min); its MaxTime put back after a test that lowers it."""
    shown = subprocess.run(["scontrol", "show", "partition", "short", "-o"], capture_output=True, text=True)
    if "MaxTime=00:05:00" not in shown.stdout:
        pytest.skip("no partition `short` with MaxTime 5 min: run scripts/slurm_up.sh again")
    yield "short"
    subprocess.run(["scontrol", "update", "PartitionName=short", "MaxTime=5"], check=True)


def test_cancel_and_rerun_leave_a_job_without_this_sweeps_token_alone(corpus, tmp_path):
    """Two runs training, the coordinator killed; then the store is made to name someone else's job for run b (a
    store edited, an id since reused). `sweep --cancel` cancels run a's job only and says why it left the
    other; the rerun does not watch that job either: it finds run b's own job by the run's lock and watches it, submits
    run a again, and both end ok. The foreign job is never cancelled."""
    path, name = write_sweep(tmp_path, corpus, "foreign", seeds=2, steps=3000, slurm_array_parallelism=2)
    out = tmp_path / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    foreign = None
    try:
        wait_for("both runs training", lambda: sum(r["status"] == "running" for r in rows(out)) == 2, timeout=600)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        foreign = subprocess.run(  # pending: the two runs hold both CPUs
            ["sbatch", "--parsable", "-p", "debug", "-o", "/dev/null", "-J", f"other-{name}", "--wrap", "sleep 900"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        a, b = rows(out)
        with sqlite3.connect(out / "sweep.db", timeout=30) as con:
            con.execute("update runs set job = ? where run_id = ?", (foreign, b["run_id"]))
            # an edited store names no announcement either (one the kill left, dropped a pass after its release,
            # would name b's own job by the submission's token, and --cancel would rightly cancel it)
            con.execute("delete from meta where key = 'slurm_submissions'")
        cancel = subprocess.run(
            [sys.executable, "-m", "normlab", "sweep", "--cancel", str(out)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=600,
        )
        assert cancel.returncode == 0 and cancel.stderr == "", cancel.stdout + cancel.stderr
        assert f"cancelled 1 job(s) of {out}: {a['job']}" in cancel.stdout, cancel.stdout
        assert (
            f"skipped job {foreign} (run {b['run_id']}): not a job of this sweep (no comment, without this sweep's "
            "normlab-sweep:" in cancel.stdout
        ), cancel.stdout
        assert squeue_lists(foreign) and squeue_lists(b["job"])  # someone else's job, and b's own (not named)
        assert not squeue_lists(a["job"])
        got = {r["run_id"]: r for r in rows(out)}
        assert (
            got[a["run_id"]]["status"] == "failed"
            and "cancelled by normlab sweep --cancel" in got[a["run_id"]]["reason"]
        )
        done = finish(path, out, timeout=1500)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{b['run_id']}: job {foreign} named by the store is not this sweep's" in done.stdout, done.stdout
        assert f"{b['run_id']}: job {b['job']} holds its lock and is alive; watching it" in done.stdout, done.stdout
        final = {r["run_id"]: r for r in rows(out)}
        assert all(r["status"] == "ok" and r["worker"] == r["job"] for r in final.values()), final
        assert final[b["run_id"]]["job"] == b["job"] and final[a["run_id"]]["job"] != a["job"]
        assert squeue_lists(foreign)  # still waiting, untouched by the sweep
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["scancel", "--name", f"normlab-{name}"], check=False)
        if foreign:
            subprocess.run(["scancel", foreign], check=False)


IMPOSSIBLE = {
    "time-over-maxtime": (
        {"slurm_partition": "short", "timeout_min": 10},
        "timeout_min = 10 is over the partition's time limit (short's MaxTime is 5 min): SLURM would accept the jobs "
        "and never start them (PartitionTimeLimit); give timeout_min <= 5",
    ),
    "cpus-over-a-node": ({"cpus_per_task": 64}, "Requested node configuration is not available"),
    "memory-over-a-node": ({"mem_gb": 100000}, "Requested node configuration is not available"),
    "gpus-on-a-cpu-node": ({"gpus_per_node": 1}, "Invalid generic resource (gres) specification"),
    "unknown-partition": ({"slurm_partition": "nope"}, "invalid partition specified: nope"),
    "unknown-qos": ({"slurm_qos": "nope"}, "Invalid qos specification"),
    "unknown-account": ({"slurm_account": "nope"}, "Invalid account or account/partition combination specified"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_a_request_slurm_would_never_run_is_refused_before_anything_is_written(corpus, tmp_path, short_partition, case):
    """Each of these SLURM either refuses (sbatch's words become part of the one line) or accepts and never starts
    (a time limit over MaxTime: accepted, PENDING PartitionTimeLimit forever, since EnforcePartLimits is NO; more
    CPUs than the node has: accepted when held). The sweep asks first (sbatch --test-only, the partition's MaxTime):
    exit 2, one line, no folder, no job."""
    table, said = IMPOSSIBLE[case]
    path, name = write_sweep(tmp_path, corpus, f"never-{case}", seeds=1, steps=20, **table)
    out = tmp_path / "sw"
    done = finish(path, out, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert said in line, line
    assert not out.exists() and sacct(f"normlab-{name}") == {}


# `scontrol release` that first lowers partition short's MaxTime below the jobs' limit: the limit changed between the
# check and the start (an administrator's edit), and the released jobs pend for PartitionTimeLimit
LOWERING_SCONTROL = (
    '#!/bin/sh\n[ "$1" = release ] && /usr/bin/scontrol update PartitionName=short MaxTime=1\n'
    'exec /usr/bin/scontrol "$@"\n'
)


def test_a_job_pending_for_a_limit_that_never_clears_stops_the_coordinator(corpus, tmp_path, short_partition):
    """The jobs were accepted, then can never start (PartitionTimeLimit): the coordinator cancels them and stops with
    one line and exit 2, the rows pending for the next try, instead of waiting forever."""
    path, name = write_sweep(
        tmp_path, corpus, "stuck", seeds=2, steps=20, slurm_partition="short", timeout_min=3, slurm_signal_delay_s=30
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(LOWERING_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "sw"
    done = subprocess.run(
        sweep_cmd(path, out),
        env={**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert "the scheduler accepted the jobs but can never start them: " in line and "PartitionTimeLimit" in line
    assert "timeout_min = 3 is over the partition's time limit (short's MaxTime is 1 min)" in line, line
    assert "2 run(s) left pending: fix the [slurm] options and run the same command again" in line, line
    got = rows(out)
    assert all(r["status"] == "pending" and r["job"] is None and "PartitionTimeLimit" in r["reason"] for r in got)
    wait_for(
        "the jobs gone",
        lambda: (
            not sacct(f"normlab-{name}") or all(s.startswith("CANCELLED") for s in sacct(f"normlab-{name}").values())
        ),
        timeout=120,
    )
    assert not subprocess.run(["squeue", "-h", "--name", f"normlab-{name}"], capture_output=True, text=True).stdout


class Planted:
    """Unpickled, this creates the file `marker`: what a planted pickle does, harmlessly."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_result_pickle_is_never_unpickled(corpus, tmp_path):
    """A run that fails (its data gone by the time the job starts) ends COMPLETED with a failed row; the job's
    teardown then replaces submitit's result pickle with one that runs code as it loads. The coordinator takes the
    outcome from the store (the row the job wrote) and never opens the pickle: no marker, one line in the row."""
    data = tmp_path / "data.txt"
    data.write_text(corpus.read_text())
    marker, payload = tmp_path / "payload-ran", tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps(("success", Planted(str(marker)))))
    out = tmp_path / "sw"
    folder = out / "logs" / "jobs" / "$SLURM_JOB_ID"
    path, name = write_sweep(
        tmp_path,
        data,
        "planted",
        seeds=1,
        steps=20,
        slurm_setup=[f"rm -f {data}"],
        slurm_teardown=[f'cp {payload} "{folder}/${{SLURM_JOB_ID}}_0_result.pkl"'],
    )
    done = finish(path, out, timeout=600)
    (row,) = rows(out)
    assert (out / "logs" / "jobs" / row["job"] / f"{row['job']}_0_result.pkl").read_bytes() == payload.read_bytes()
    assert not marker.exists(), "the planted pickle was unpickled"
    assert row["status"] == "failed" and row["worker"] == row["job"] and "\n" not in row["reason"], row
    assert str(data) in row["reason"] or "data" in row["reason"].lower(), row
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert sacct(f"normlab-{name}") == {row["job"]: "COMPLETED"}


def test_a_used_up_timeout_budget_says_how_many_times_and_where_to_continue(corpus, tmp_path):
    """slurm_max_num_timeout = 0 and a two-minute limit: at the first USR2 submitit saves the run and does not
    requeue it (timed-out too many times); the row says so in one line with the step it saved at and to run the
    command again, not a pointer to a traceback. The same command then continues from that step. The run is sized
    to need about ten minutes at this machine's measured pace, so neither two-minute job can finish it (on an idle
    machine 20,000 steps fitted in the second job)."""
    steps = max(20000, int(600 / nano_step_seconds(corpus, tmp_path)))
    path, name = write_sweep(tmp_path, corpus, "budget", seeds=1, steps=steps, timeout_min=2, slurm_max_num_timeout=0)
    out = tmp_path / "sw"
    first = finish(path, out, timeout=900)  # exit 1: a run failed (not a bad input: that is 2)
    assert first.returncode == 1 and "Traceback" not in first.stdout + first.stderr, first.stdout + first.stderr
    (row,) = rows(out)
    said = re.fullmatch(
        rf"job {row['job']} timed out 1 time \(slurm_max_num_timeout = 0\), saved at step (\d+); run the same "
        r"command again to continue from step (\d+) \(or raise timeout_min or slurm_max_num_timeout\)",
        row["reason"] or "",
    )
    assert row["status"] == "failed" and said and said.group(1) == said.group(2), row
    assert row["step"] == int(said.group(1))
    step = int(said.group(1))
    assert f"failed: {row['reason']}" in first.stdout
    second = finish(path, out, timeout=900)
    assert second.returncode == 1, second.stdout + second.stderr
    (again,) = rows(out)
    later = re.search(r"saved at step (\d+)", again["reason"] or "")
    assert again["job"] != row["job"] and later and int(later.group(1)) > step, again
    logs = "".join(p.read_text() for p in (out / "logs" / "jobs").rglob(f"{again['job']}_0_log.*"))
    assert re.search(rf"resuming from step_0*{step}\b", logs), logs[-2000:]


BAD_OPTIONS = {
    "typed": ({"timeout_min": "10"}, "the [slurm] table: timeout_min: expected an integer, got '10' (str)"),
    "reserved-flag": ({"slurm_additional_parameters": {"hold": True}}, "may not set --hold"),
    "control-character": ({"slurm_partition": "debug\n#SBATCH --x"}, "one line of text without control characters"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_slurm_options_are_one_line_and_nothing_is_written(corpus, tmp_path, case):
    from normlab.experiments.runner import _to_toml

    table, said = BAD_OPTIONS[case]
    path, name = write_sweep(tmp_path, corpus, f"bad-{case}", seeds=1, steps=20)
    sweep = tomllib.loads(path.read_text())
    path.write_text(_to_toml({**sweep, "slurm": {**sweep["slurm"], **table}}))  # as a user would write it
    out = tmp_path / "sw"
    done = finish(path, out, timeout=300)
    assert done.returncode == 2 and said in one_line(done.stderr), done.stdout + done.stderr
    assert not out.exists() and sacct(f"normlab-{name}") == {}
