"""What the SLURM coordinator reads once per poll (`normlab.experiments.cluster`): its jobs' states (one sacct call
through submitit), the user's live jobs (one squeue call, with their pending reasons and comments: also what says
whether a job sacct does not call live is still queued) and the store (one snapshot), read in that order, so that a
job sacct says ended has written its row before the store is read, and gathered into a `Poll`. Also who a job
belongs to (`foreign`): a job the store or a lock file names is acted on only when it is this sweep's."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.experiments import submission
from normlab.experiments.scheduler import ask_scheduler, never_starts
from normlab.runs.files import SweepDir
from normlab.runs.lock import holder_job
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
    # run id -> (job id, squeue's pending reason, what it means) of each pending job whose reason never clears
    # (`scheduler.never_starts`)
    stuck: dict[str, tuple[str, str, str]] = field(default_factory=dict)


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
        """The jobs' states from sacct, then (on SLURM, when a job is watched or `always`) squeue's live jobs, then
        the store. Given `todo` (a rerun re-attaching), the store is read first too, for the jobs its rows of `todo`
        name, and the job each run's lock file names last. With `always` (a submission may have been accepted without
        its ids stored), the live jobs of the store's announced submissions too (`submission.unreleased`; none asked
        for when none is announced). Everything is read first, then the reading built in one `Poll`."""
        if todo is not None:
            rows = store.snapshot().rows
            jobs = {rid: self.job(rows[rid]["job"]) for rid in todo if rows[rid].get("job")}
        words = self.sacct(jobs)
        queue = live_jobs() if self.kind == "slurm" and (jobs or always or todo is not None) else None
        view = store.snapshot()  # after sacct: a job sacct says ended has written its row
        tokens = view.meta.get(submission.KEY) or {}
        found = submission.unreleased(tokens, queue) if always and tokens else {}
        holders = {}
        for rid in todo or []:  # a rerun: the job each run's lock file names
            holders[rid] = holder_job(self.root.run(rid).lock_file)
        states, alive = self.states(jobs, words, queue)
        stuck = never_starting(jobs, states, queue)
        return Poll(states, queue, view, jobs, alive, found, holders, stuck)

    def sacct(self, jobs: dict[str, Any]) -> dict[str, str]:
        """run id -> its job's state word as sacct gives it (one sacct call for all the jobs, through submitit; on
        submitit-local, whether the job is done)."""
        if not jobs:
            return {}
        if self.kind != "slurm":
            return {rid: ("COMPLETED" if job.done() else "RUNNING") for rid, job in jobs.items()}
        watcher = next(iter(jobs.values())).watcher
        watcher.update()  # the one sacct call: each state below is read from its answer
        return {rid: watcher.get_state(job.job_id, mode="cache") for rid, job in jobs.items()}

    def states(
        self, jobs: dict[str, Any], words: dict[str, str], queue: dict[str, tuple[str, str, str]] | None
    ) -> tuple[dict[str, str], dict[str, bool]]:
        """run id -> the job's state word (PENDING, RUNNING, COMPLETED, CANCELLED by 0, ..., or UNKNOWN), and run id
        -> whether that state is live (`live`), from sacct's `words` and squeue's live jobs read after them (`queue`,
        None when squeue did not answer: no job listed). On SLURM, a job sacct does not call live is looked up in
        squeue's answer: one sacct has no record of (just submitted, or squeue still holds it) is PENDING while
        squeue lists it or for UNKNOWN_GRACE_S after it was first watched; one sacct says ended that squeue still
        lists is COMPLETING (its processes not yet gone: KillWait)."""
        found = dict(words)
        alive = {rid: live(state) for rid, state in found.items()}
        if self.kind != "slurm":
            return found, alive
        listed = queue or {}
        for rid in [rid for rid in found if not alive[rid]]:
            jid = str(jobs[rid].job_id)
            queued = jid in listed
            if found[rid] == "UNKNOWN":  # sacct has no record: just submitted, or squeue still holds it
                alive[rid] = queued or time.time() - self.seen.get(jid, time.time()) < UNKNOWN_GRACE_S
                found[rid] = "PENDING" if alive[rid] else "UNKNOWN"
            elif queued:  # ended for sacct, its processes not yet gone (KillWait)
                found[rid], alive[rid] = f"COMPLETING (ended {found[rid]})", True
        return found, alive


def never_starting(
    jobs: dict[str, Any], states: dict[str, str], queue: dict[str, tuple[str, str, str]] | None
) -> dict[str, tuple[str, str, str]]:
    """run id -> (job id, reason, what it means) of each pending job whose pending reason in squeue's answer
    (`queue`) never clears as submitted (`scheduler.NEVER_STARTS`: a time limit over the partition's MaxTime, more
    CPUs than its nodes have, ...)."""
    stuck = {}
    for rid, state in states.items():
        jid = str(jobs[rid].job_id)
        reason = (queue or {}).get(jid, ("", "", ""))[1]
        why = never_starts(reason) if state.startswith("PENDING") else None
        if why:
            stuck[rid] = (jid, reason.split(",")[0].strip(), why)
    return stuck


def live_jobs() -> dict[str, tuple[str, str, str]] | None:
    """This user's pending, running and completing jobs (squeue's default states), array tasks one by one: job id
    (123_4, or 123) -> (state, pending reason, comment); None when squeue cannot answer. In every partition (-a):
    without it squeue leaves out the jobs in a partition hidden from the user (Hidden=YES), which `squeue -j ID`
    shows, and such a job would be taken for ended."""
    lines = ask_scheduler(["squeue", "-h", "-r", "-a", "--me", "-o", "%i|%T|%r|%k"])
    if lines is None:
        return None
    found = {}
    for line in lines:
        parts = line.strip().split("|", 3)
        if len(parts) == 4:
            found[parts[0]] = (parts[1], parts[2], parts[3])
    return found


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
