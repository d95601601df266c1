"""Issue 63 items 13-16 on a real one-node SLURM (scripts/slurm_up.sh): a job that crashes before it records
anything (torch's import failing under slurm_setup's `ulimit -v`) is reported FAILED with its error and never
submitted again; a hand `scancel` of a job that saved is not undone; a rerun never watches another user's job that
the store names; a QOS's per-job MaxWall (DenyOnLimit), a `time` in slurm_additional_parameters over the
partition's MaxTime, an sbatch flag sbatch does not know, and a full disk are each refused in one line (exit 2)
with nothing written and no job submitted. Nano runs, one CPU per job; every wait is bounded."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tomllib

import pytest

from normlab.experiments.runner import _to_toml
from tests.slurm.test_cluster import ENV, finish, rows, sacct, sweep_cmd, wait_for, write_sweep
from tests.slurm.test_trust4 import one_line, squeue_lists

pytest.importorskip("submitit")


def test_a_job_that_crashes_before_recording_anything_is_reported_failed_once(corpus, tmp_path):
    """`ulimit -v 300000` in slurm_setup: torch cannot map its library, the run's thread raises ImportError before
    the run is marked running. The job exits non-zero (sacct FAILED), the row names the error and the job's log,
    and the run is not submitted again (the same crash would follow)."""
    path, name = write_sweep(tmp_path, corpus, "crash", seeds=1, steps=20, slurm_setup=["ulimit -v 300000"])
    out = tmp_path / "sw"
    done = finish(path, out, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    (row,) = rows(out)
    assert row["status"] == "failed", row
    assert re.fullmatch(rf"job {row['job']} ended FAILED: ImportError: .+; see \S+\.err", row["reason"]), row
    assert "submitted again" not in done.stdout and "held by" not in row["reason"], done.stdout
    assert sacct(f"normlab-{name}") == {row["job"]: "FAILED"}  # one job, never resubmitted


def test_a_hand_scancel_of_a_job_that_saved_is_not_undone(corpus, tmp_path):
    """The user scancels the job while its run trains: the run saves on SIGTERM, the job ends CANCELLED, and the row
    says it was cancelled and where the next run continues; the coordinator submits nothing again."""
    path, name = write_sweep(tmp_path, corpus, "handcancel", seeds=1, steps=3000)
    out = tmp_path / "sw"
    proc = subprocess.Popen(
        sweep_cmd(path, out), env=ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        row = wait_for("the run training", lambda: next((r for r in rows(out) if r["status"] == "running"), None))
        metrics = out / "runs" / row["run_id"] / "metrics.jsonl"
        wait_for("a few steps trained", lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3)
        subprocess.run(["scancel", row["job"]], check=True)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["scancel", "--name", f"normlab-{name}"], check=False)
    assert proc.returncode == 1, stdout + stderr
    (got,) = rows(out)
    assert got["status"] == "failed" and "submitted again (" not in stdout, stdout
    match = re.fullmatch(
        rf"job {row['job']} was cancelled by uid 0 and saved the run at step (\d+); the next run of this sweep "
        r"submits it again, continuing from step (\d+)",
        got["reason"],
    )
    assert match and match.group(1) == match.group(2) and int(match.group(1)) > 0, got["reason"]
    jobs = sacct(f"normlab-{name}")
    assert list(jobs) == [row["job"]] and jobs[row["job"]].startswith("CANCELLED"), jobs


OTHER = "normlab-other"


@pytest.fixture
def other_users_job():
    """A job of another user (`normlab-other`, made here with an association in the normlab account), pending or
    running `sleep 900`; cancelled afterwards. Needs root."""
    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("another user's job needs root and runuser")
    if subprocess.run(["id", OTHER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-M", "-s", "/bin/sh", OTHER], check=True)
    subprocess.run(["sacctmgr", "-i", "add", "user", OTHER, "Account=normlab", "Cluster=normlab"], capture_output=True)
    jid = subprocess.run(
        ["runuser", "-u", OTHER, "--", "sbatch", "--parsable", "-p", "debug", "-o", "/dev/null", "-D", "/tmp"]
        + ["--wrap", "sleep 900"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        yield jid
    finally:
        subprocess.run(["scancel", jid], check=False)


def test_a_rerun_never_watches_another_users_job(corpus, tmp_path, other_users_job):
    """The store names another user's live job for the run (an edited store, an id the scheduler reused): the rerun
    says whose it is, does not watch it, submits the run, and the run ends ok; the other user's job is untouched.
    The check is the job's owner (squeue -j ID -o %u), not this user's queue alone."""
    from normlab.experiments import submission
    from normlab.experiments.runner import prepare
    from normlab.experiments.sweep import SweepConfig
    from normlab.io import own_folder

    path, name = write_sweep(tmp_path, corpus, "owner", seeds=1, steps=20)
    out = tmp_path / "sw"
    store, (spec,) = prepare(SweepConfig.from_toml(path), own_folder(out, "sweep"))
    submission.sweep_token(store)
    store.set_job([spec.run_id], [other_users_job])
    done = finish(path, out, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        f"{spec.run_id}: job {other_users_job} named by the store is not this sweep's (it belongs to user {OTHER}, "
        "not to root); not watched" in done.stdout
    ), done.stdout
    (row,) = rows(out)
    assert row["status"] == "ok" and row["job"] != other_users_job and row["worker"] == row["job"], row
    assert squeue_lists(other_users_job)


@pytest.fixture
def maxwall_qos():
    """A QOS `normlab-maxwall` (MaxWall 2 min, DenyOnLimit) this user may use."""
    subprocess.run(
        ["sacctmgr", "-i", "add", "qos", "normlab-maxwall", "MaxWall=00:02:00", "Flags=DenyOnLimit"],
        capture_output=True,
    )
    subprocess.run(
        ["sacctmgr", "-i", "modify", "qos", "normlab-maxwall", "set", "MaxWall=00:02:00", "Flags=DenyOnLimit"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["sacctmgr", "-i", "modify", "user", "root", "set", "QOS+=normlab-maxwall"], capture_output=True)
    shown = subprocess.run(["sacctmgr", "-n", "-P", "show", "assoc", "user=root", "format=qos"], capture_output=True)
    if b"normlab-maxwall" not in shown.stdout:
        pytest.skip("could not give root the QOS normlab-maxwall")
    return "normlab-maxwall"


REFUSED = {
    "qos-maxwall-deny-on-limit": (
        {"slurm_qos": "normlab-maxwall", "timeout_min": 5},
        "QOSMaxWallDurationPerJobLimit; allocation failure: Job violates accounting/QOS policy (job submit limit, "
        "user's size and/or time limits) (its time limit is over the QOS's MaxWall)",
    ),
    "additional-time-over-maxtime": (
        {"slurm_partition": "short", "slurm_additional_parameters": {"time": "00:10:00"}},
        "slurm_additional_parameters' time = '00:10:00' (10 min) is over the partition's time limit (short's MaxTime "
        "is 5 min)",
    ),
    "unknown-sbatch-flag": (
        {"slurm_additional_parameters": {"no_such_flag": "x"}},
        "the scheduler can never run these jobs: unrecognized option '--no-such-flag=x'",  # submitit writes - for _
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_request_that_can_never_run_is_refused_before_anything_is_written(corpus, tmp_path, maxwall_qos, case):
    table, said = REFUSED[case]
    path, name = write_sweep(tmp_path, corpus, f"refused-{case}", seeds=1, steps=20)
    sweep = tomllib.loads(path.read_text())
    slurm = {k: v for k, v in sweep["slurm"].items() if k != "timeout_min"}
    path.write_text(_to_toml({**sweep, "slurm": {**slurm, **table}}))
    out = tmp_path / "sw"
    done = finish(path, out, timeout=300)  # a refusal taken for a passing one would retry for minutes
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert said in line, line
    assert not out.exists() and sacct(f"normlab-{name}") == {}


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs filled up. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt}/filler", "bs=4k", "count=64"], capture_output=True)
        assert shutil.disk_usage(mnt).free == 0
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_new_sweep_on_a_full_disk_is_refused_and_leaves_nothing(corpus, tmp_path, full_disk):
    path, name = write_sweep(tmp_path, corpus, "full", seeds=1, steps=20)
    out = full_disk / "sw"
    done = finish(path, out, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert f"cannot set up the sweep in {out}: {out.parent} is on a full disk (no space left on device)" in line, line
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
    assert sacct(f"normlab-{name}") == {}
