"""What the SLURM coordinator reads once per poll (`normlab.experiments.cluster`): the states of its jobs (sacct
through submitit, squeue for a job sacct does not know yet), the user's live jobs (squeue, with their comments) and
the store (one snapshot), gathered into a `Poll` in that order, so that a job sacct says ended has written its row
before the store is read. Also who a job belongs to (`foreign`): a job the store or a lock file names is acted on
only when it is this sweep's."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.experiments import submission
from normlab.experiments.scheduler import ask_scheduler
from normlab.runs.files import SweepDir
from normlab.runs.lock import holder_job, job_alive
from normlab.runs.store import StoreView, SweepStore

# squeue's and sacct's words for a job that has not ended
# fmt: off
LIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING", "SUSPENDED",
        "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD")
# fmt: on
UNKNOWN_GRACE_S = 120.0  # a job neither sacct nor squeue knows for this long has ended


def live(state: str) -> bool:
    return state.split()[0] in LIVE if state else False


@dataclass(frozen=True)
class Poll:
    """One poll's reading: run id -> its job's state word (`Watcher.states`), the user's live jobs (squeue: job id ->
    (state, pending reason, comment); None when squeue did not answer or was not asked), the store, and the jobs
    asked about."""

    states: dict[str, str]
    queue: dict[str, tuple[str, str, str]] | None
    view: StoreView
    held: dict[str, Any]  # run id -> the job whose state was asked
    live: dict[str, bool]  # run id -> whether its job has not ended (`live`)
    # run id -> (token, job id, state, reason) of the live jobs of announced submissions (`submission.unreleased`;
    # None: squeue did not answer), read when asked to (`always`); else empty
    unreleased: dict[str, tuple[str, str, str, str]] | None = field(default_factory=dict)
    holders: dict[str, str | None] = field(default_factory=dict)  # a rerun's runs -> the job its lock file names


class Watcher:
    """The states of submitted jobs, one scheduler query per poll (sacct through submitit; squeue for a job sacct
    does not know yet)."""

    def __init__(self, root: Path, kind: str) -> None:
        self.kind, self.root, self.folder = kind, SweepDir(root), SweepDir(root).jobs_dir / "%j"
        self.seen: dict[str, float] = {}  # job id -> when it was first watched

    def job(self, job: str) -> Any:
        import submitit

        self.seen.setdefault(job, time.time())
        return submitit.SlurmJob(self.folder, job)

    def poll(self, store: SweepStore, jobs: dict[str, Any], todo: list[str] | None, always: bool) -> Poll:
        """The jobs' states, then (on SLURM, when a job is watched or `always`) squeue's live jobs, then the store.
        Given `todo` (a rerun re-attaching), the store first, then the states of the jobs its rows of `todo` name,
        then squeue, then the job each run's lock file names. With `always` (a submission may have been accepted
        without its ids stored), the live jobs of the store's announced submissions too (`submission.unreleased`;
        none asked for when none is announced). Everything is read first, then the reading built in one `Poll`."""
        view = store.snapshot() if todo is not None else None
        if view is not None:
            jobs = {rid: self.job(view.rows[rid]["job"]) for rid in todo or [] if view.rows[rid].get("job")}
        states, alive = self.states(jobs)
        queue = submission.live_jobs() if self.kind == "slurm" and (jobs or always or todo is not None) else None
        view = view or store.snapshot()
        tokens = view.meta.get(submission.KEY) or {}
        found = submission.unreleased(tokens, queue) if always and tokens else {}
        holders = {}
        for rid in todo or []:  # a rerun: the job each run's lock file names
            holders[rid] = holder_job(self.root.run(rid).lock_file)
        return Poll(states, queue, view, jobs, alive, found, holders)

    def states(self, jobs: dict[str, Any]) -> tuple[dict[str, str], dict[str, bool]]:
        """run id -> the job's state word (PENDING, RUNNING, COMPLETED, CANCELLED by 0, ..., or UNKNOWN), and run id
        -> whether that state is live (`live`). On SLURM, one sacct call for all the jobs, then squeue (`job_alive`)
        about each job sacct does not call live: one sacct has no record of (just submitted, or squeue still holds
        it) is PENDING while squeue lists it or for UNKNOWN_GRACE_S after it was first watched; one sacct says ended
        that squeue still lists is COMPLETING (its processes not yet gone: KillWait)."""
        if not jobs:
            return {}, {}
        if self.kind != "slurm":
            found = {rid: ("COMPLETED" if job.done() else "RUNNING") for rid, job in jobs.items()}
            return found, {rid: live(state) for rid, state in found.items()}
        watcher = next(iter(jobs.values())).watcher
        watcher.update()  # the one sacct call: each state below is read from its answer
        found = {rid: watcher.get_state(job.job_id, mode="cache") for rid, job in jobs.items()}
        alive = {rid: live(state) for rid, state in found.items()}
        listed = {rid: job_alive(jobs[rid].job_id) for rid in found if not alive[rid]}  # squeue, job by job
        for rid, queued in listed.items():
            if found[rid] == "UNKNOWN":  # sacct has no record: just submitted, or squeue still holds it
                first = self.seen.get(jobs[rid].job_id, time.time())
                alive[rid] = bool(queued) or time.time() - first < UNKNOWN_GRACE_S
                found[rid] = "PENDING" if alive[rid] else "UNKNOWN"
            elif queued:  # ended for sacct, its processes not yet gone (KillWait)
                found[rid], alive[rid] = f"COMPLETING (ended {found[rid]})", True
        return found, alive


def foreign(jid: str, queue: dict[str, tuple[str, str, str]] | None, token: str | None) -> str | None:
    """Why a job the store or a lock file names is not this sweep's: it is another user's (squeue lists it, but not
    among this user's jobs, `queue`: its owner is asked, `squeue -j ID -o %u`), or it is this user's and its comment
    lacks the sweep's token (`normlab.experiments.submission`). None when it is this sweep's, when squeue does not
    list it at all (ended: nothing to act on), or when squeue cannot answer; the comment goes unchecked when there
    is no token to check it against (a store of an older normlab), the owner never."""
    if queue is None:
        return None
    if jid not in queue:
        owner = job_owner(jid)
        me = current_user()
        return f"it belongs to user {owner}, not to {me}" if owner and owner != me else None
    if token is None:
        return None
    comment = queue[jid][2]
    if submission.carries(comment, token):
        return None
    shown = "no comment" if comment in ("", "(null)") else f"its comment is {comment!r}"
    return f"{shown}, without this sweep's {submission.SWEEP_TAG}{token}"


def job_owner(jid: str) -> str | None:
    """The user a live job belongs to (squeue %u); None when squeue lists no such job or cannot answer."""
    lines = ask_scheduler(["squeue", "-h", "-j", jid, "-o", "%u"])
    found = [x.strip() for x in lines or [] if x.strip()]
    return found[0] if found else None


def current_user() -> str:
    """This process's user name, as squeue prints a job's owner."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())
