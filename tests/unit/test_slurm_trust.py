"""SLURM trust without a cluster (issue 51 item 4): the [slurm] table typed and checked before anything is
written, a plain `fuse` mount taken as shared, sbatch's stderr in one line, a request the scheduler would accept
and never start refused up front, `sweep --cancel` touching only this sweep's jobs, a used-up timeout budget
said in one line, and submitit's result pickle never opened; and (issue 63) a job that crashed before recording
anything reported with its error and not resubmitted, a hand scancel not undone, another user's job never watched,
adopted or cancelled, a per-job QOS limit, a `time` in slurm_additional_parameters and sbatch's own complaint
refused up front, and a full disk refused leaving nothing. The scheduler's commands are small scripts first
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

# The scheduler's commands as shell scripts. squeue prints $FAKE_SQUEUE's lines
# ("id|state|reason|comment[|user[|hidden]]": a line naming another user is left out, as --me does; one whose
# partition is hidden from the user, Hidden=YES, only with -a, as slurmctld does), or one job's state for -j, hidden
# or not (its user for -j ID -o %u);
# scancel logs its ids to $FAKE_LOG and drops them from the queue; sbatch answers --test-only
# with $FAKE_TEST_ONLY ("ok" or the error it prints) and a submission with $FAKE_SBATCH (same); scontrol shows
# $FAKE_PARTITIONS for `show partition -o`.
FAKES = {
    "squeue": """
        job=""; fmt=""; all=""
        while [ $# -gt 0 ]; do
            case "$1" in -j) job="$2"; shift ;; -o) fmt="$2"; shift ;; -a|--all) all=1 ;; esac
            shift
        done
        me=$(id -un)
        if [ -n "$job" ]; then
            line=$(grep "^$job|" "$FAKE_SQUEUE")
            [ -z "$line" ] && exit 0
            if [ "$fmt" = "%u" ]; then user=$(echo "$line" | cut -d'|' -f5); echo "${user:-$me}"
            else echo "$line" | cut -d'|' -f2; fi
        else
            awk -F'|' -v me="$me" -v all="$all" '($5 == "" || $5 == me) && ($6 != "hidden" || all != "") {
                print $1 "|" $2 "|" $3 "|" $4
            }' "$FAKE_SQUEUE"
        fi
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
    from normlab.experiments.slurm_preflight import preflight

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
    from normlab.experiments.cluster import SweepJobs, _ended
    from normlab.runs.files import SweepDir

    store, (a, _, _) = store_with_jobs
    root = tmp_path / "sw"
    store.mark_running(a, "11_0")
    job = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "11_0")
    job.paths.result_pickle.parent.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    job.paths.result_pickle.write_bytes(pickle.dumps(("success", Planted(str(marker)))))
    job.paths.stderr.write_text("Traceback (most recent call last):\n  ...\nValueError: the data ran out\n")
    assert _ended(SweepJobs(root, store, "slurm"), a, job, state, retry=True)[0] == "end:ended failed"
    assert not marker.exists()  # the pickle was never loaded
    row = store.row(a)
    assert row["status"] == "failed" and "\n" not in row["reason"]
    assert row["reason"] == f"job 11_0 ended {state}: ValueError: the data ran out; see {job.paths.stderr}"


def test_a_used_up_timeout_budget_says_where_to_continue(store_with_jobs, tmp_path):
    """submitit saves the run at the last USR2 and does not requeue it ("timed-out too many times"): the row says
    in one line how many times, the step it saved at, and to run the command again (not a pointer to a traceback).
    A job that saved and then was not requeued for another reason is submitted again, from that step."""
    from normlab.experiments.cluster import SweepJobs, _ended
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
    assert _ended(SweepJobs(root, store, "slurm", 3), a, job, "FAILED", retry=True)[0] == "end:ended timeout"
    assert store.row(a)["status"] == "failed"
    assert store.row(a)["reason"] == (
        "job 11_0 timed out 4 times (slurm_max_num_timeout = 3), saved at step 120; run the same command again to "
        "continue from step 120 (or raise timeout_min or slurm_max_num_timeout)"
    )
    other = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "12")
    then = _ended(SweepJobs(root, store, "slurm", 3), b, other, "FAILED", retry=True)
    assert then == (
        "end:requeued",
        "job 12 saved the run at step 120 and ended FAILED without requeueing itself; submitted again",
    )
    assert (store.row(b)["status"], store.row(b)["job"]) == ("pending", None)


def test_the_coordinator_module_loads_no_pickle():
    """Neither the coordinator nor the submission code calls submitit's result readers or pickle's loaders."""
    import inspect

    from normlab.experiments import cluster, slurm_poll, slurm_preflight, slurm_states, submission

    for module in (cluster, slurm_poll, slurm_preflight, slurm_states, submission):
        text = inspect.getsource(module)
        for call in (".result(", ".results(", "pickle.load", "pickle_load", "cloudpickle.load"):
            assert call not in text, (module.__name__, call)


def test_a_refusal_line_carries_no_raw_dump():
    from normlab.experiments.slurm_preflight import _one_line

    text = "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: Job violates"
    assert _one_line(text) == "QOSMaxSubmitJobPerUserLimit; Batch job submission failed: Job violates"
    with pytest.raises(ConfigError):
        check_options({"timeout_min": "1"}, "slurm")


# --- issue 63: a crash before anything is recorded, a hand scancel, another user's job, refusals, a full disk ------


def test_a_job_whose_run_raises_exits_with_that_error(tmp_path, monkeypatch, capsys):
    """torch failing to import in the run's thread (a memory limit in slurm_setup): the exception is raised again
    in the job's main thread, so submitit exits non-zero (sacct FAILED) with the traceback in the job's log; a job
    that found its run held by another process says so in one line of its log and returns."""
    import signal

    from normlab.experiments import job as job_module
    from normlab.experiments.scheduler import HELD_LINE

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    try:

        def crash(*args, **kwargs):
            raise ImportError("libtorch_cpu.so: failed to map segment from shared object")

        monkeypatch.setattr(job_module, "execute_run", crash)
        with pytest.raises(ImportError, match="failed to map segment"):
            job_module.RunJob(str(tmp_path), "r0")()
        held = {"status": "running", "reason": "held by pid 7 on n1 (SLURM job 12)", "holder_job": "12"}
        monkeypatch.setattr(job_module, "execute_run", lambda *a, **k: held)
        assert job_module.RunJob(str(tmp_path), "r0")() == held
        assert f"normlab: r0: {HELD_LINE} (held by pid 7 on n1 (SLURM job 12))" in capsys.readouterr().out
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_job_that_ended_without_recording_anything_is_reported_not_resubmitted(store_with_jobs, tmp_path):
    """A job that crashed before it touched its row: FAILED with the error its log ends with, in one line naming the
    log; one that ended COMPLETED without a word about a holder is no "held by another process" either. Neither is
    submitted again (the same crash would follow). Only a job whose log says it found the run held is."""
    from normlab.experiments.cluster import SweepJobs, _ended
    from normlab.experiments.scheduler import HELD_LINE
    from normlab.runs.files import SweepDir

    store, (a, b, c) = store_with_jobs
    root = tmp_path / "sw"
    jobs = {jid: submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", jid) for jid in ("11_0", "12", "13")}
    jobs["11_0"].paths.stderr.parent.mkdir(parents=True)
    jobs["11_0"].paths.stderr.write_text(
        "submitit ERROR (2026-01-01 00:00:00,000) - Submitted job triggered an exception\n"
        "Traceback (most recent call last):\n  ...\nImportError: libtorch_cpu.so: failed to map segment from shared "
        "object\n"
    )
    assert _ended(SweepJobs(root, store, "slurm"), a, jobs["11_0"], "FAILED", retry=True)[0] == "end:ended failed"
    assert store.row(a)["status"] == "failed"
    assert store.row(a)["reason"] == (
        "job 11_0 ended FAILED: ImportError: libtorch_cpu.so: failed to map segment from shared object; "
        f"see {jobs['11_0'].paths.stderr}"
    )
    assert _ended(SweepJobs(root, store, "slurm"), b, jobs["12"], "COMPLETED", retry=True)[0] == "end:ended failed"
    assert store.row(b)["status"] == "failed"
    said = f"job 12 ended COMPLETED without recording an outcome; see {jobs['12'].paths.stderr}"
    assert store.row(b)["reason"] == said
    jobs["13"].paths.stdout.parent.mkdir(parents=True)
    jobs["13"].paths.stdout.write_text(f"normlab: {c}: {HELD_LINE} (held by pid 7 on n1)\n")
    then = _ended(SweepJobs(root, store, "slurm"), c, jobs["13"], "COMPLETED", retry=True)
    assert (
        then is not None and then[0] == "end:requeued" and "held by another process, which has ended since" in then[1]
    )
    assert store.row(c)["status"] == "pending"


def test_a_run_trained_by_a_job_whose_id_was_lost_names_that_job_once_the_new_one_ends(store_with_jobs, tmp_path):
    """A run submitted again (job 12) while the job whose id the store lost (11_5) still pended: 11_5 started first
    and trained the run to its end, 12 found nothing to do. When 12 ends the row names 11_5, its worker, as its job;
    a run its own job trained keeps its job, and nothing but a finished row is rewritten."""
    from normlab.experiments.cluster import SweepJobs, _ended
    from normlab.runs.files import SweepDir

    store, (a, b, c) = store_with_jobs
    root = tmp_path / "sw"
    store.set_job([a], ["12"])
    store.mark_running(a, "11_5")
    store.record(a, {"status": "ok", "final_loss": 1.0}, worker="11_5")
    store.mark_running(b, "12")
    store.record(b, {"status": "ok", "final_loss": 1.0}, worker="12")
    job = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "12")
    assert _ended(SweepJobs(root, store, "slurm"), a, job, "COMPLETED", retry=True) == ("end:ended ok", "")
    assert _ended(SweepJobs(root, store, "slurm"), b, job, "COMPLETED", retry=True) == ("end:ended ok", "")
    assert (store.row(a)["job"], store.row(a)["worker"]) == ("11_5", "11_5")
    assert (store.row(b)["job"], store.row(b)["worker"]) == ("12", "12")
    store.mark_running(c, "14")  # running, not finished: the write leaves it as it is
    store.trained_by(c, "14")
    assert store.row(c)["job"] == "13"


def test_a_cancelled_job_that_saved_is_not_submitted_again(store_with_jobs, tmp_path):
    """scancel by hand: the run saves on SIGTERM (its row pending, "saved at step 120"), the job ends CANCELLED.
    Cancelled means cancelled: the row says so, and where the next run of the sweep continues; nothing is
    submitted again now (a job that saved and ended FAILED without its requeue still is)."""
    from normlab.experiments.cluster import SweepJobs, _ended
    from normlab.runs.files import SweepDir

    store, (a, _, _) = store_with_jobs
    root = tmp_path / "sw"
    store.mark_running(a, "11_0")
    store.requeued(a, "saved at step 120 by 11_0, stopped by the scheduler", step=120)
    job = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "11_0")
    assert _ended(SweepJobs(root, store, "slurm"), a, job, "CANCELLED by 0", retry=True)[0] == "end:ended cancelled"
    row = store.row(a)
    assert row["status"] == "failed"
    assert row["reason"] == (
        "job 11_0 was cancelled by uid 0 and saved the run at step 120; the next run of this sweep submits it again, "
        "continuing from step 120"
    )


def test_another_users_job_is_never_this_sweeps(fake_slurm, store_with_jobs, tmp_path, capsys):
    """squeue --me lists this user's jobs only: a live job the store or a lock names that is not among them is
    another user's (squeue -j ID -o %u says whose), and is neither watched, adopted nor cancelled, token or not."""
    from normlab.experiments import slurm_poll, submission
    from normlab.experiments.cluster import SweepJobs, _ended
    from normlab.experiments.slurm_poll import current_user, foreign
    from normlab.runs.files import SweepDir
    from normlab.runs.lock import holder_job

    store, (a, b, _) = store_with_jobs
    (fake_slurm / "queue").write_text(
        f"12|RUNNING|None|normlab-sweep:{TOKEN}|someone-else\n11_0|RUNNING|None|normlab-sweep:{TOKEN}\n"
    )
    queue = slurm_poll.live_jobs()
    assert set(queue) == {"11_0"}
    me = current_user()
    for token in (TOKEN, None):
        assert foreign("12", queue, token) == f"it belongs to user someone-else, not to {me}"
        assert foreign("11_0", queue, token) is None
    assert foreign("77", queue, TOKEN) is None  # not listed at all: ended, nothing to act on
    store.set_meta(submission.SWEEP_KEY, TOKEN)
    assert main(["sweep", "--cancel", str(tmp_path / "sw")]) == 0  # cancels 11_0, never 12
    said = capsys.readouterr().out
    assert f"skipped job 12 (run {b}): not a job of this sweep (it belongs to user someone-else" in said, said
    assert (fake_slurm / "log").read_text().split() == ["scancel", "11_0"]
    store.set_job([a], ["11_0"])
    (fake_slurm / "queue").write_text(
        f"12|RUNNING|None|normlab-sweep:{TOKEN}|someone-else\n11_0|RUNNING|None|normlab-sweep:{TOKEN}\n"
    )
    # a lock naming the other user's job, alive: not adopted (the row is this coordinator's to write), token or not
    root = tmp_path / "sw"
    store.mark_running(a, "11_0")
    lock_file = SweepDir(root).run(a).lock_file
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock_file.write_text('{"host": "n1", "pid": 1, "start": null, "job": "12"}')
    assert holder_job(lock_file) == "12"
    job = submitit.SlurmJob(SweepDir(root).jobs_dir / "%j", "11_0")
    assert _ended(SweepJobs(root, store, "slurm", 3, None), a, job, "FAILED", retry=True)[0] == "end:ended failed"
    assert store.row(a)["status"] == "failed"
    (fake_slurm / "queue").write_text(f"12|RUNNING|None|normlab-sweep:{TOKEN}\n")  # the same job, this user's
    store.mark_running(a, "11_0")
    assert _ended(SweepJobs(root, store, "slurm", 3, TOKEN), a, job, "FAILED", retry=True) == ("adopt", "12")


def test_a_job_in_a_hidden_partition_is_still_one_of_this_users_live_jobs(fake_slurm, tmp_path):
    """squeue --me leaves out the jobs in a partition hidden from the user (Hidden=YES) unless asked with -a; squeue
    -j ID (the per-job liveness check before the one answer) shows them. A job of the sweep there that sacct has no
    record of past the grace (slurmdbd lagging, a cluster without accounting) is still queued, not ended and
    submitted again; one sacct says ended is still completing; an unreleased one is found by its token."""
    import time
    from types import SimpleNamespace

    from normlab.experiments import slurm_poll, submission
    from normlab.experiments.slurm_poll import UNKNOWN_GRACE_S, Watcher
    from normlab.runs.lock import job_alive

    (fake_slurm / "queue").write_text(
        f"41_0|PENDING|JobHeldUser|normlab:tok normlab-sweep:{TOKEN}||hidden\n"
        f"41_1|COMPLETING|None|normlab:tok normlab-sweep:{TOKEN}||hidden\n"
    )
    assert job_alive("41_0") and job_alive("41_1")  # squeue -j shows them
    queue = slurm_poll.live_jobs()
    assert queue is not None and {"41_0", "41_1"} <= set(queue)
    watch = Watcher(tmp_path, "slurm")
    watch.seen = {"41_0": time.time() - 10 * UNKNOWN_GRACE_S, "41_1": time.time()}
    jobs = {"r0": SimpleNamespace(job_id="41_0"), "r1": SimpleNamespace(job_id="41_1")}
    states, alive = watch.states(jobs, {"r0": "UNKNOWN", "r1": "COMPLETED"}, queue)
    assert states == {"r0": "PENDING", "r1": "COMPLETING (ended COMPLETED)"}
    assert alive == {"r0": True, "r1": True}
    assert submission.unreleased({"tok": ["r0", "r1"]}, queue)["r0"] == ("tok", "41_0", "PENDING", "JobHeldUser")


QOS_REFUSAL = (
    "sbatch: error: QOSMaxWallDurationPerJobLimit\\n"
    "allocation failure: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"
)


def test_a_per_job_qos_limit_is_refused_up_front_not_waited_out(fake_slurm, tmp_path, capsys, monkeypatch):
    """A QOS's MaxWall with DenyOnLimit: sbatch --test-only refuses it with a line that says "limit", as a MaxSubmit
    refusal does; only the latter passes by waiting. Refused in one line, exit 2, nothing written or submitted."""
    from normlab.experiments.slurm_preflight import _passes

    monkeypatch.setenv("FAKE_TEST_ONLY", QOS_REFUSAL)
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file(tmp_path, {"timeout_min": 5, "slurm_qos": "short"})), "--out", str(out)]) == 2
    line = one_line(capsys)
    assert (
        "the scheduler can never run these jobs: QOSMaxWallDurationPerJobLimit; allocation failure: Job violates "
        "accounting/QOS policy (job submit limit, user's size and/or time limits) (its time limit is over the QOS's "
        "MaxWall)" in line
    ), line
    assert not out.exists() and "--test-only" in (fake_slurm / "log").read_text()
    assert (fake_slurm / "log").read_text().count("sbatch") == 1
    submit_limit = "QOSMaxSubmitJobPerUserLimit; Batch job submission failed: Job violates accounting/QOS policy"
    assert _passes(submit_limit) and _passes("Socket timed out on send/recv operation")
    for never in ("AssocMaxCpuPerJobLimit; x limit", "QOSMaxTRESPerJob; limit", QOS_REFUSAL.replace("\\n", "; ")):
        assert not _passes(never), never


def test_a_time_in_additional_parameters_is_checked_against_maxtime(fake_slurm, tmp_path, capsys):
    """submitit writes slurm_additional_parameters after its own flags, so `time` there is the jobs' limit: checked
    against the partition's MaxTime like timeout_min (and refused beside it, or when sbatch could not read it)."""
    (fake_slurm / "partitions").write_text(
        "PartitionName=debug Default=YES MaxTime=UNLIMITED State=UP\n"
        "PartitionName=short Default=NO MaxTime=00:05:00 State=UP\n"
    )
    out = tmp_path / "out"
    table = {"slurm_partition": "short", "slurm_additional_parameters": {"time": "00:10:00"}}
    assert main(["sweep", str(sweep_file(tmp_path, table)), "--out", str(out)]) == 2
    line = one_line(capsys)
    assert (
        "slurm_additional_parameters' time = '00:10:00' (10 min) is over the partition's time limit (short's MaxTime "
        "is 5 min)" in line
    ), line
    assert not out.exists()
    table = {"slurm_additional_parameters": {"time": 10, "partition": "short"}}  # its partition there too
    assert main(["sweep", str(sweep_file(tmp_path, table)), "--out", str(out)]) == 2
    assert "(10 min) is over the partition's time limit (short's MaxTime is 5 min)" in one_line(capsys)
    for table, said in (
        ({"timeout_min": 5, "slurm_additional_parameters": {"time": 5}}, "gives both timeout_min and"),
        ({"slurm_additional_parameters": {"time": "ten minutes"}}, "time must be a duration as sbatch reads it"),
    ):
        assert main(["sweep", str(sweep_file(tmp_path, table)), "--out", str(out)]) == 2
        assert said in one_line(capsys)
        assert not out.exists()
    from normlab.experiments.slurm_preflight import preflight

    preflight({"slurm_partition": "short", "slurm_additional_parameters": {"time": "4:00"}}, "t")  # 4 min: fits


def test_sbatchs_own_complaint_is_kept_in_the_one_line(fake_slurm, tmp_path, capsys, monkeypatch):
    """sbatch's `unrecognized option` line has no "error:" in it; its "Try sbatch --help" hint is left out."""
    from normlab.experiments.slurm_preflight import _one_line

    said = "sbatch: unrecognized option '--no_such_flag=x'\nTry \"sbatch --help\" for more information"
    assert _one_line(said) == "unrecognized option '--no_such_flag=x'"
    monkeypatch.setenv("FAKE_TEST_ONLY", said.replace("\n", "\\n"))
    table = {"slurm_additional_parameters": {"no_such_flag": "x"}}
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file(tmp_path, table)), "--out", str(out)]) == 2
    line = one_line(capsys)
    assert "the scheduler can never run these jobs: unrecognized option '--no_such_flag=x' (sbatch" in line, line
    assert not out.exists()


@pytest.mark.parametrize("where", ["marker", "store"])
def test_a_new_sweep_on_a_full_disk_is_refused_and_leaves_nothing(tmp_path, capsys, monkeypatch, where):
    """No space left as the folder's marker or the store is written: one line, exit 2, and neither the folder nor
    the missing folders above it are left behind; a sweep being continued keeps everything it held."""
    import errno
    import sqlite3

    import normlab.io
    from normlab.experiments import runner
    from normlab.runs.store import SweepStore

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_prepare = runner.prepare

    def store_full(sweep, root):
        real_prepare(sweep, root)  # the store and sweep.toml written, then SQLite finds the disk full
        with SweepStore(root / "sweep.db")._connect():
            raise sqlite3.OperationalError("database or disk is full")

    sweep = SweepConfig(name="t", base={"size": "nano", "steps": 2}, grid={"seed": [0]})
    path = tmp_path / "s.toml"
    path.write_text(_to_toml(sweep.to_dict()))
    out = tmp_path / "new" / "sw"
    with monkeypatch.context() as patch:
        if where == "marker":
            patch.setattr(normlab.io, "atomic_write_json", no_space)
        else:
            patch.setattr(runner, "prepare", store_full)
        assert main(["sweep", str(path), "--out", str(out)]) == 2
        line = one_line(capsys)
        assert f"cannot set up the sweep in {out}: " in line and "is on a full disk (no space left on device)" in line
        assert "nothing was left there; free space and run the same command again" in line, line
        assert not (tmp_path / "new").exists()
        (tmp_path / "empty").mkdir()  # an empty folder of the user's: emptied again, kept
        assert main(["sweep", str(path), "--out", str(tmp_path / "empty")]) == 2
        one_line(capsys)
        assert list((tmp_path / "empty").iterdir()) == []
    kept = tmp_path / "kept"
    runner.prepare(sweep, normlab.io.own_folder(kept, "sweep"))
    before = sorted(p.name for p in kept.iterdir())
    monkeypatch.setattr(runner, "prepare", store_full)
    assert main(["sweep", str(path), "--out", str(kept)]) == 2
    assert "the sweep's files there are as they were" in one_line(capsys)
    assert sorted(p.name for p in kept.iterdir() if p.name != ".lock") == before  # .lock: the sweep's flock file
