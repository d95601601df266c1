"""SLURM trust without a cluster (issue 51 item 4): the [slurm] table typed and checked before anything is
written, a plain `fuse` mount taken as shared, sbatch's stderr in one line, a request the scheduler would accept
and never start refused up front, `sweep --cancel` touching only this sweep's jobs, a used-up timeout budget
said in one line, and submitit's result pickle never opened. The scheduler's commands are small scripts first
on PATH (`fake_slurm`), so these run where SLURM is not installed; tests/slurm/test_trust4.py plays the same
cases on a real one."""

from __future__ import annotations

import os
import pickle
import textwrap
from pathlib import Path

import pytest

from normlab.cli import main
from normlab.errors import ConfigError
from normlab.experiments import SweepConfig
from normlab.experiments.runner import _to_toml, prepare
from normlab.experiments.scheduler import check_options, never_starts, slurm_minutes

submitit = pytest.importorskip("submitit")

TOKEN = "0123456789abcdef"

# The scheduler's commands as shell scripts. squeue prints $FAKE_SQUEUE's lines ("id|state|reason|comment"), or one
# job's state for -j; scancel logs its ids to $FAKE_LOG and drops them from the queue; sbatch answers --test-only
# with $FAKE_TEST_ONLY ("ok" or the error it prints) and a submission with $FAKE_SBATCH (same); scontrol shows
# $FAKE_PARTITIONS for `show partition -o`.
FAKES = {
    "squeue": """
        job=""
        while [ $# -gt 0 ]; do [ "$1" = -j ] && job="$2"; shift; done
        if [ -n "$job" ]; then grep "^$job|" "$FAKE_SQUEUE" | cut -d'|' -f2; else cat "$FAKE_SQUEUE"; fi
        """,
    "scancel": """
        for j in "$@"; do
            echo "scancel $j" >> "$FAKE_LOG"
            grep -v "^$j|" "$FAKE_SQUEUE" > "$FAKE_SQUEUE.new"; mv "$FAKE_SQUEUE.new" "$FAKE_SQUEUE"
        done
        """,
    "sbatch": """
        echo "sbatch $*" >> "$FAKE_LOG"
        if [ "$1" = --test-only ]; then answer="$FAKE_TEST_ONLY"; else answer="$FAKE_SBATCH"; fi
        if [ "$answer" = ok ]; then
            [ "$1" = --test-only ] && echo "sbatch: Job 99 to start at 2026-01-01T00:00:00 using 1 processors" >&2
            [ "$1" = --test-only ] || echo "Submitted batch job 99"
            exit 0
        fi
        printf '%b\\n' "$answer" >&2
        exit 1
        """,
    "scontrol": """
        [ "$1" = show ] && cat "$FAKE_PARTITIONS"
        exit 0
        """,
    "sacct": "exit 0",
    "srun": "exit 0",
}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """The fake scheduler on PATH; returns its folder (queue, log, partitions are files there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + textwrap.dedent(body))
        (bin_dir / name).chmod(0o755)
    for name in ("queue", "log"):
        (tmp_path / name).write_text("")
    (tmp_path / "partitions").write_text("PartitionName=debug Default=YES MaxTime=UNLIMITED State=UP\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SQUEUE", str(tmp_path / "queue"))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_PARTITIONS", str(tmp_path / "partitions"))
    monkeypatch.setenv("FAKE_TEST_ONLY", "ok")
    monkeypatch.setenv("FAKE_SBATCH", "ok")
    monkeypatch.setenv("NORMLAB_SLURM_POLL_S", "0.1")
    return tmp_path


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: ") and "Traceback" not in err, err
    return lines[0]


def sweep_file(tmp_path: Path, slurm: dict) -> Path:
    sweep = SweepConfig(name="t", base={"size": "nano", "steps": 2}, grid={"seed": [0]}).to_dict()
    path = tmp_path / "s.toml"
    path.write_text(_to_toml({**sweep, "executor": "slurm", "slurm": slurm}))
    return path


# --- the [slurm] table, typed -------------------------------------------------------------------------------------

BAD_TABLES = [
    ({"timeout_min": "10"}, "timeout_min: expected an integer, got '10' (str)"),
    ({"timeout_min": 0}, "timeout_min must be > 0, got 0"),
    ({"timeout_min": 1.5}, "timeout_min: expected an integer, got 1.5 (float)"),
    ({"cpus_per_task": True}, "cpus_per_task: expected an integer, got True (bool)"),
    ({"mem_gb": "lots"}, "mem_gb: expected a number, got 'lots' (str)"),
    ({"slurm_partition": 5}, "slurm_partition: expected a string, got 5 (int)"),
    ({"slurm_partition": "debug\necho hi"}, "slurm_partition must be one line of text without control characters"),
    ({"slurm_setup": "module load cuda"}, "slurm_setup: expected a list of values"),
    ({"slurm_mem": "4 gigs"}, "slurm_mem must be a memory size as sbatch reads it"),
    ({"slurm_array_parallelism": 0}, "slurm_array_parallelism must be > 0, got 0"),
    ({"slurm_max_num_timeout": -1}, "slurm_max_num_timeout must be >= 0, got -1"),
    ({"nodes": 2}, "nodes must be 1: each run of a sweep trains in one process"),
    ({"slurm_additional_parameters": {"hold": True}}, "may not set --hold: normlab sets it for every job"),
    ({"slurm_additional_parameters": {"comment": "x"}}, "may not set --comment"),
    ({"slurm_additional_parameters": "--mail-type=END"}, "must be a table of sbatch flags"),
    ({"slurm_comment": "normlab-sweep:feed"}, "slurm_comment may not hold a word starting normlab:"),
    ({"timeout_min": 5, "slurm_time": 5}, "gives both timeout_min and slurm_time, which set the same sbatch flag"),
    ({"slurm_exclusive": 3}, "slurm_exclusive must be true or sbatch's --exclusive word"),
]


@pytest.mark.parametrize(("table", "said"), BAD_TABLES, ids=[str(t) for t, _ in BAD_TABLES])
def test_a_bad_slurm_value_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, table, said):
    assert main(["sweep", str(sweep_file(tmp_path, table)), "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys)
    assert said in line and "[slurm]" in line, line
    assert not (tmp_path / "out").exists()


def test_a_good_slurm_table_passes_as_given():
    table = {
        "timeout_min": 120,
        "mem_gb": 16,
        "cpus_per_task": 8,
        "gpus_per_node": 1,
        "slurm_partition": "gpu,gpu-long",
        "slurm_setup": ["module load cuda"],
        "slurm_mem_per_cpu": "2G",
        "slurm_exclusive": True,
        "slurm_additional_parameters": {"mail-type": "END", "requeue": True},
        "slurm_signal_delay_s": 120,
        "slurm_max_num_timeout": 10,
        "slurm_comment": "project x",
    }
    check_options(table, "slurm")
    assert SweepConfig(name="t", executor="slurm", slurm=dict(table)).slurm == table  # passed to submitit as given


# --- filesystems ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "shared"),
    [("fuse", True), ("fuse.sshfs", True), ("fuse.bindfs", True), ("nfs4", True), ("fuseblk", False), ("ext4", False)],
)
def test_a_plain_fuse_mount_counts_as_shared(tmp_path, monkeypatch, kind, shared):
    """/proc/mounts says "fuse" for a FUSE filesystem that names no subtype: shared, so the store keeps the rollback
    journal (WAL needs memory shared between machines) and locks are O_EXCL files, not flock."""
    import normlab.io
    from normlab.runs.lock import FolderLock
    from normlab.runs.store import SweepStore

    monkeypatch.delenv("NORMLAB_SHARED_FS", raising=False)
    monkeypatch.setattr(normlab.io, "filesystem_type", lambda path: kind)
    assert normlab.io.shared_filesystem(tmp_path) is shared
    assert SweepStore(tmp_path / "sweep.db").wal is (not shared)
    lock = FolderLock(tmp_path / ".lock", wait=0, busy=str)
    assert (lock.file is None) is shared  # O_EXCL: no flock file held open
    lock.release()
    assert (tmp_path / ".lock").exists() is (not shared)  # an O_EXCL lock file is removed on release


# --- what the scheduler says, in one line -----------------------------------------------------------------------


def test_sbatchs_own_stderr_becomes_part_of_one_line(fake_slurm, tmp_path, capsys, monkeypatch):
    """sbatch refuses with two error lines: the sweep ends with exit 2 and one line holding both (submitit's own
    print of them never reaches the terminal), and the runs stay pending for the next try."""
    monkeypatch.setenv(
        "FAKE_SBATCH",
        "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified\\n"
        "sbatch: error: second complaint",
    )
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file(tmp_path, {"timeout_min": 5})), "--out", str(out)]) == 2
    line = one_line(capsys)
    assert (
        "the scheduler refused the jobs: Batch job submission failed: Invalid account or account/partition "
        "combination specified; second complaint; 1 run(s) left pending" in line
    ), line
    from normlab.runs.store import SweepStore

    assert [r["status"] for r in SweepStore(out / "sweep.db").rows()] == ["pending"]


def test_a_request_no_node_can_meet_is_refused_before_anything_is_written(fake_slurm, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_TEST_ONLY", "allocation failure: Requested node configuration is not available")
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file(tmp_path, {"cpus_per_task": 64})), "--out", str(out)]) == 2
    line = one_line(capsys)
    assert "the scheduler can never run these jobs: allocation failure: Requested node configuration" in line, line
    assert not out.exists()
    assert "sbatch --test-only" in (fake_slurm / "log").read_text()  # asked, and nothing submitted
    assert "sbatch " + str(fake_slurm) not in (fake_slurm / "log").read_text().replace("--test-only ", "")


def test_a_time_limit_over_the_partitions_maxtime_is_refused(fake_slurm, tmp_path, capsys):
    """sbatch --test-only passes such a job (EnforcePartLimits=NO: SLURM accepts it, then it pends forever,
    PartitionTimeLimit): the partition's MaxTime is read and compared."""
    (fake_slurm / "partitions").write_text(
        "PartitionName=debug Default=YES MaxTime=UNLIMITED State=UP\n"
        "PartitionName=short Default=NO MaxTime=00:05:00 State=UP\n"
    )
    out = tmp_path / "out"
    table = {"timeout_min": 10, "slurm_partition": "short"}
    assert main(["sweep", str(sweep_file(tmp_path, table)), "--out", str(out)]) == 2
    line = one_line(capsys)
    assert "timeout_min = 10 is over the partition's time limit (short's MaxTime is 5 min)" in line, line
    assert "give timeout_min <= 5" in line and not out.exists()
    # a limit within MaxTime, or a partition list with an unlimited one, passes
    from normlab.experiments.cluster import preflight

    preflight({"timeout_min": 5, "slurm_partition": "short"}, "t")
    preflight({"timeout_min": 10, "slurm_partition": "short,debug"}, "t")


def test_pending_reasons_that_never_clear_and_slurm_durations():
    assert never_starts("PartitionTimeLimit") == "its time limit is over the partition's MaxTime"
    assert never_starts("PartitionConfig")
    assert never_starts("QOSMaxWallDurationPerJobLimit")
    for waiting in ("Resources", "Priority", "JobHeldUser", "ReqNodeNotAvail, UnavailableNodes:n1", "None", ""):
        assert never_starts(waiting) is None, waiting
    got = [slurm_minutes(t) for t in ("00:05:00", "5:00", "1-00:00:00", "2-03", "30", "1-02:03", "UNLIMITED")]
    assert got == [5, 5, 1440, 2 * 1440 + 180, 30, 1440 + 123, None]


# --- this sweep's jobs only ------------------------------------------------------------------------------------


@pytest.fixture
def store_with_jobs(tmp_path):
    """A sweep of three runs whose rows name jobs 11_0, 12 and 13."""
    sweep = SweepConfig(name="t", base={"size": "nano", "steps": 2}, grid={"seed": [0, 1, 2]}, executor="slurm")
    store, specs = prepare(sweep, tmp_path / "sw")
    store.set_job([s.run_id for s in specs], ["11_0", "12", "13"])
    return store, [s.run_id for s in specs]


def test_cancel_cancels_only_the_jobs_that_carry_this_sweeps_token(fake_slurm, store_with_jobs, tmp_path, capsys):
    """The store names three jobs: 11_0 carries the sweep's token, 12 is someone else's (no token), 13 has left
    the queue. Only 11_0 is scancel-ed; 12 gets a line saying why it is left alone."""
    from normlab.experiments import submission

    store, (a, b, c) = store_with_jobs
    store.set_meta(submission.SWEEP_KEY, TOKEN)
    (fake_slurm / "queue").write_text(
        f"11_0|RUNNING|None|normlab:aa normlab-sweep:{TOKEN}\n12|RUNNING|None|(null)\n99|RUNNING|None|(null)\n"
    )
    assert main(["sweep", "--cancel", str(tmp_path / "sw")]) == 0
    out = capsys.readouterr().out
    assert (fake_slurm / "log").read_text().split("\n")[:-1] == ["scancel 11_0"]
    assert f"cancelled 1 job(s) of {tmp_path / 'sw'}: 11_0" in out, out
    assert (
        f"skipped job 12 (run {b}): not a job of this sweep (no comment, without this sweep's "
        f"normlab-sweep:{TOKEN}); left as it is" in out
    ), out
    rows = {r["run_id"]: r for r in store.rows()}
    assert rows[a]["status"] == "failed" and "cancelled by normlab sweep --cancel" in rows[a]["reason"]
    assert rows[b]["status"] == rows[c]["status"] == "pending"
    assert (fake_slurm / "queue").read_text().startswith("12|")  # someone else's jobs still there


def test_cancel_without_a_sweep_token_cancels_nothing_and_says_why(fake_slurm, store_with_jobs, tmp_path, capsys):
    store, (a, _, _) = store_with_jobs  # a store of an older normlab: no token to check the jobs against
    (fake_slurm / "queue").write_text("11_0|RUNNING|None|normlab:aa\n")
    assert main(["sweep", "--cancel", str(tmp_path / "sw")]) == 0
    out = capsys.readouterr().out
    assert (fake_slurm / "log").read_text() == "" and "(none was pending or running)" in out
    assert "skipped job 11_0" in out and "the store names no token of this sweep" in out
    assert store.row(a)["status"] == "pending"


def test_every_submission_carries_the_sweeps_token_after_the_users_comment():
    from normlab.experiments import submission

    got = submission.parameters({"slurm_comment": "project x"}, "sub1", TOKEN)
    assert got["slurm_comment"] == f"project x normlab:sub1 normlab-sweep:{TOKEN}"
    assert submission.carries(got["slurm_comment"], TOKEN)
    assert not submission.carries(f"normlab-sweep:{TOKEN}x", TOKEN) and not submission.carries("(null)", TOKEN)


# --- outcomes from normlab's own files ---------------------------------------------------------------------------


class Planted:
    """Unpickling this creates the file `marker`: what a planted pickle would do, harmlessly."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED"])
def test_a_planted_result_pickle_is_never_unpickled(store_with_jobs, tmp_path, state):
    """A job that left the queue with its run unfinished: the coordinator reads the store, summary.json, the lock
    and the job's text log, never submitit's result pickle (one planted there would run code as it loads)."""
    from normlab.experiments.cluster import _ended
    from normlab.runs.files import SweepDir

    store, (a, _, _) = store_with_jobs
    root = tmp_path / "sw"
    store.mark_running(a, "11_0")
    job = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "11_0")
    job.paths.result_pickle.parent.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    job.paths.result_pickle.write_bytes(pickle.dumps(("success", Planted(str(marker)))))
    job.paths.stderr.write_text("Traceback (most recent call last):\n  ...\nValueError: the data ran out\n")
    assert _ended(root, store, a, job, state, "slurm", retry=True) is None
    assert not marker.exists()  # the pickle was never loaded
    row = store.row(a)
    assert row["status"] == "failed" and "\n" not in row["reason"]
    assert row["reason"] == f"job 11_0 ended {state}: ValueError: the data ran out; see {job.paths.stderr}"


def test_a_used_up_timeout_budget_says_where_to_continue(store_with_jobs, tmp_path):
    """submitit saves the run at the last USR2 and does not requeue it ("timed-out too many times"): the row says
    in one line how many times, the step it saved at, and to run the command again (not a pointer to a traceback).
    A job that saved and then was not requeued for another reason is submitted again, from that step."""
    from normlab.experiments.cluster import _ended
    from normlab.runs.files import SweepDir

    store, (a, b, _) = store_with_jobs
    root = tmp_path / "sw"
    for rid, jid in ((a, "11_0"), (b, "12")):
        store.mark_running(rid, jid)
        store.requeued(rid, f"saved at step 120 by {jid}, stopped by the scheduler", step=120)
    job = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "11_0")
    job.paths.stderr.parent.mkdir(parents=True)
    job.paths.stderr.write_text(
        "submitit WARNING - Caught signal SIGUSR2: this job is timed-out.\n"
        "submitit INFO - Job not requeued because: timed-out too many times.\n"
        "submitit.core.utils.UncompletedJobError: Job not requeued because: timed-out too many times.\n"
    )
    assert _ended(root, store, a, job, "FAILED", "slurm", retry=True, timeouts=3) is None
    assert store.row(a)["status"] == "failed"
    assert store.row(a)["reason"] == (
        "job 11_0 timed out 4 times (slurm_max_num_timeout = 3), saved at step 120; run the same command again to "
        "continue from step 120 (or raise timeout_min or slurm_max_num_timeout)"
    )
    other = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "12")
    then = _ended(root, store, b, other, "FAILED", "slurm", retry=True, timeouts=3)
    assert then == (
        "again",
        "job 12 saved the run at step 120 and ended FAILED without requeueing itself; submitted again",
    )
    assert (store.row(b)["status"], store.row(b)["job"]) == ("pending", None)


def test_the_coordinator_module_loads_no_pickle():
    """Neither the coordinator nor the submission code calls submitit's result readers or pickle's loaders."""
    import inspect

    from normlab.experiments import cluster, submission

    for module in (cluster, submission):
        text = inspect.getsource(module)
        for call in (".result(", ".results(", "pickle.load", "pickle_load", "cloudpickle.load"):
            assert call not in text, (module.__name__, call)


def test_a_refusal_line_carries_no_raw_dump():
    from normlab.experiments.cluster import _one_line

    text = "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: Job violates"
    assert _one_line(text) == "QOSMaxSubmitJobPerUserLimit; Batch job submission failed: Job violates"
    with pytest.raises(ConfigError):
        check_options({"timeout_min": "1"}, "slurm")
