"""A sweep on SLURM through submitit: job arrays, re-attaching on a rerun, checkpoint and requeue, cancel.

- **Arrays.** The runs to do go to the scheduler as job arrays (submitit's `executor.batch()`), at most
  `slurm_array_parallelism` of an array running at once. Each job id (`123_4`) is stored in the run's
  row the moment sbatch accepts it.
- **Before submitting.** The [slurm] table is typed and checked before anything is written
  (`normlab.experiments.scheduler.SlurmTable`), then the scheduler is asked, submitting nothing, whether such a job
  could ever start (`preflight`: `sbatch --test-only` with the job script, and the partitions' MaxTime): a request
  it would accept and never start (more CPUs or memory than a node has, a time limit over the partition's MaxTime)
  is refused in one line (exit 2). A job that pends for a reason that can never clear (squeue's
  PartitionTimeLimit, PartitionConfig, ...: `scheduler.NEVER_STARTS`, read with each poll) is cancelled and the
  coordinator stops the same way, instead of waiting forever.
- **Refusals.** A submission the scheduler refuses for a limit on how many jobs may wait (a QOS's or an
  association's MaxSubmitJobs) or a busy controller is tried again with smaller arrays, then after a growing
  wait (10 s to 5 min) while the jobs already submitted run; any other refusal (an unknown partition) is reported in
  one line, sbatch's own words in it (nothing of submitit's dump reaches the terminal), and the coordinator
  keeps watching what it submitted before it exits. Nothing is orphaned. A refusal that names a limit on each
  job (QOSMaxWallDurationPerJobLimit with DenyOnLimit, ...PerJob...: `scheduler.never_passes`) never passes
  by waiting, whatever else it says ("job submit limit"): preflight refuses it before anything is written.
- **This sweep's jobs only.** Every job carries the sweep's token in its comment (`normlab-sweep:TOKEN`,
  `normlab.experiments.submission`); a job id the store or a lock file names is watched, adopted or cancelled
  only when squeue shows the token in its comment (an edited store, an id the scheduler gave to another job since),
  and never when it is another user's (`foreign`: squeue's owner of the job, not only this user's queue).
- **Re-attaching.** Each array is announced in the store, sent held and released only once its ids are
  stored (`normlab.experiments.submission`): no job runs unknown to the store. A rerun of the same
  command asks the scheduler (sacct through submitit, squeue when sacct has no record yet) about every
  unfinished row's job: a pending or running job is watched again, never submitted twice; so is a live
  job of an announced submission (squeue, by its comment: a coordinator killed between sbatch and
  storing the ids, or before the release), and a live job that the run's lock file names; only runs with
  no live job are submitted.
  A job that finds its run locked by another job (a duplicate) records nothing and names that job,
  which the coordinator watches instead: a live run is never marked failed.
- **Checkpoint and requeue.** `normlab.experiments.job.RunJob` is a `submitit.helpers.Checkpointable`: SLURM
  signals USR2
  `slurm_signal_delay_s` before the time limit, or on preemption (`scancel --signal=USR2`); the run
  then stops after its current step with a checkpoint (`normlab.train.trainer.Stopped`), its row goes
  back to `pending`, and submitit requeues the job (`scontrol requeue`), which continues from that
  checkpoint. After a time limit that is retried `slurm_max_num_timeout` times (submitit's default 3).
  SIGTERM (scancel, a limit reached without the warning) saves the run the same way, without a requeue, and a
  CANCELLED job is never submitted again by this coordinator (cancelled means cancelled); a job that ends TIMEOUT,
  NODE_FAIL, BOOT_FAIL or PREEMPTED without having requeued itself is submitted
  again by the coordinator (as many times), continuing from the newest save. A run whose time limits are used up
  (submitit then saves it and does not requeue) ends `failed` with one line: "job J timed out N times
  (slurm_max_num_timeout = M), saved at step S; run the same command again to continue from step S".
- **Outcomes** come from normlab's own files: the store's row (the job writes it), the run's summary.json and
  lock file, the job's text logs. A job whose run raised before recording anything exits non-zero (`job.RunJob`):
  its row says "ended FAILED: ImportError: ...; see LOG", and it is not submitted again. submitit's result pickle is
  never opened: unpickling runs code, and a pickle planted in the sweep folder would run it in the coordinator.
- **Threads** come from the allocation: SLURM_CPUS_PER_TASK (else the CPUs SLURM gave the node's
  task), into torch.set_num_threads and OMP_NUM_THREADS.
- **Ctrl-C** writes what the pass had decided and releases an array sent held (its ids now stored), then asks,
  on a terminal, whether to cancel the sweep's jobs; elsewhere it leaves them running and says how to cancel them
  (`normlab sweep --cancel DIR`). A cancelled job's row says so in one line, written once the job has left the
  queue (its run may still save until the cluster's KillWait ends).
- Job scripts, logs and submitit's pickles go to SWEEP/logs/jobs/.

Only the job that trains a run writes its row while it trains (`running`, then its outcome, as the local
workers do); the coordinator writes a row when a job ended without one (cancelled, killed, node failure).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from normlab.errors import ConfigError
from normlab.experiments import submission
from normlab.experiments.scheduler import never_passes, time_over_partition
from normlab.experiments.slurm_poll import Poll, Watcher, foreign, live_jobs
from normlab.experiments.slurm_preflight import _executor, _one_line, _passes
from normlab.experiments.slurm_states import ENDED, WAITING, JobEnd, Phase, decide, saved_step
from normlab.runs.files import SweepDir
from normlab.runs.lock import holder_job, job_alive
from normlab.runs.outcome import FINISHED, describe
from normlab.runs.store import SweepStore, open_store

POLL_S = float(os.environ.get("NORMLAB_SLURM_POLL_S", "10"))  # seconds between scheduler queries (one sacct call)


def __getattr__(name: str) -> Any:
    if name == "RunJob":
        from normlab.experiments.job import RunJob

        return RunJob
    raise AttributeError(name)


def scancel(job_ids: list[str]) -> None:
    """scancel, its output kept off the terminal (a job that ended meanwhile is no failure)."""
    if job_ids:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60, check=False)


# (phase, event) -> the next phase: the whole graph
TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.PENDING, "submit"): Phase.SUBMITTED,
    (Phase.REQUEUED, "submit"): Phase.SUBMITTED,
    (Phase.PENDING, "watch"): Phase.SUBMITTED,  # a live job found for it (re-attaching): watched, not submitted
    (Phase.REQUEUED, "watch"): Phase.SUBMITTED,
    (Phase.SUBMITTED, "start"): Phase.RUNNING,
    (Phase.SUBMITTED, "never starts"): Phase.PENDING,
    (Phase.SUBMITTED, "cancelled before"): Phase.PENDING,
    (Phase.RUNNING, "cancelled before"): Phase.PENDING,
    (Phase.SUBMITTED, "adopt"): Phase.SUBMITTED,  # another job of the sweep trains it: that one is watched
    (Phase.RUNNING, "adopt"): Phase.SUBMITTED,
    **{(p, f"end:{e.value}"): e for p in (Phase.SUBMITTED, Phase.RUNNING) for e in ENDED},
    **{(p, "end:requeued"): Phase.REQUEUED for p in (Phase.SUBMITTED, Phase.RUNNING)},
}


class Runs:
    """Each run's phase, moved only along `TRANSITIONS`; `waiting` keeps the order runs are submitted in."""

    def __init__(self, todo: list[str]) -> None:
        self.phase = dict.fromkeys(todo, Phase.PENDING)
        self.waiting: list[str] = list(todo)

    def move(self, rid: str, event: str) -> Phase:
        now = self.phase[rid]
        nxt = TRANSITIONS.get((now, event))
        if nxt is None:
            raise RuntimeError(f"run {rid}: no move {event!r} from {now.value}")
        self.phase[rid] = nxt
        if nxt in WAITING and rid not in self.waiting:
            self.waiting.append(rid)
        elif nxt not in WAITING and rid in self.waiting:
            self.waiting.remove(rid)
        return nxt

    def ended(self) -> int:
        return sum(p in ENDED for p in self.phase.values())


@dataclass(frozen=True)
class SweepJobs:
    """What reading a job's end needs: the sweep's folder and store, the executor's kind, slurm_max_num_timeout and
    the token this sweep's jobs carry (None: unchecked)."""

    root: Path
    store: SweepStore
    kind: str
    timeouts: int = 3
    token: str | None = None


def run_cluster(
    root: Path,
    store: SweepStore,
    todo: list[str],
    kind: str,
    options: dict[str, Any],
    name: str,
    log: Callable[[str], object],
) -> None:
    """Run `todo` as scheduler jobs and watch them to the end (see the module docstring)."""
    sweep = SweepJobs(root, store, kind, int(options.get("slurm_max_num_timeout", 3)))
    Coordinator(sweep, todo, options, name, log).run()


class Coordinator:
    """The loop of a SLURM (or submitit-local) sweep: each run's phase moved along `TRANSITIONS` as jobs are
    submitted, start and end. Each pass reads, decides, submits, writes, then releases: the scheduler and the store
    read once (`slurm_poll.Watcher.poll`: sacct, squeue, a `StoreView`); from that reading, the jobs of an unfinished
    submission found, runs whose job started moved on, jobs that can never start cancelled, each ended job read
    (`_ended`: the row, the run's files, `slurm_states.ENDINGS`); the next batch announced and sent held
    (`_submit`, `submission.send`); the rows and the new jobs' ids written back at once (`SweepStore.apply`) and the
    pass's lines said; then the held arrays released (their ids now stored), their announcements dropped with the
    next pass's write. The store is written once before sbatch (the announcement) and once after."""

    def __init__(
        self, sweep: SweepJobs, todo: list[str], options: dict[str, Any], name: str, log: Callable[[str], object]
    ) -> None:
        self.sweep, self.todo, self.options, self.log = sweep, todo, options, log
        self.root, self.store, self.kind = sweep.root, sweep.store, sweep.kind
        self.runs = Runs(todo)  # each run's phase, moved along TRANSITIONS
        self.watch = Watcher(sweep.root, sweep.kind)
        self.ex = _executor(sweep.root, sweep.kind, options, name)
        self.jobs: dict[str, Any] = {}  # run id -> the submitit job that holds it
        self.cancelled_before: set[str] = set()  # runs whose job was cancelled before this coordinator
        self.to_release: dict[str, list[str]] = {}  # token -> its held jobs that scontrol did not release yet
        self.retries: dict[str, int] = {}  # run id -> how many times a job of it ended TIMEOUT, ... and was resubmitted
        self.token: str | None = None  # the token every job of this sweep carries (submission.py)
        self.fatal: str | None = None
        self.unsure = sweep.kind == "slurm"  # an announced submission's jobs may be live: found before submitting
        self.chunk, self.wait, self.next_try, self.refusals = 1, 10.0, 0.0, 0
        self.writes: list[tuple[str, tuple[Any, ...]]] = []  # this pass's store writes (`SweepStore.apply`)
        self.lines: list[tuple[str, str | None]] = []  # this pass's lines: (text, run id whose row ends it, if any)

    def run(self) -> None:
        todo, total = self.todo, len(self.todo)
        first: list[str] | None = todo if self.kind == "slurm" else None  # a rerun re-attaches on the first pass
        self.chunk = max(1, len(self.runs.waiting))
        try:
            while (self.runs.waiting and self.fatal is None) or self.jobs:
                self._pass(todo, total, self.watch.poll(self.store, self.jobs, first, self.unsure), first)
                first = None
                if self.jobs or self.runs.waiting:
                    time.sleep(POLL_S if self.kind == "slurm" else 0.5)
            if self.writes:  # the announcements of a release in the last pass, dropped
                self._write()
        except KeyboardInterrupt:
            self._write()  # what the pass had decided (each write whole): a job's end already read is kept
            if self.to_release:  # sent held, their ids now stored: released, so that the jobs left to run do run
                submission.release_held(self.to_release)
            _interrupted(self.root, self.store, self.jobs, self.kind, self.log)
            raise
        except Exception:  # a failure mid-pass (a store that cannot be written: sqlite's "database is locked")
            with contextlib.suppress(Exception):  # what the pass had decided, kept if it can be; the failure raised
                self._write()
            raise
        if self.fatal:
            raise ConfigError(
                f"{self.fatal}; {len(self.runs.waiting)} run(s) left pending: fix the [slurm] options and run the "
                "same command again"
            )

    def _pass(self, todo: list[str], total: int, seen: Poll, first: list[str] | None) -> None:
        """One pass over one reading (`seen`): decide, send the next batch held, write the rows and its ids back at
        once and say what happened, then release what is held. The first pass on SLURM re-attaches (`_reattach`)
        instead of reading the jobs' ends."""
        if first is not None:
            self._reattach(first, seen)
            self.chunk = max(1, len(self.runs.waiting))
        if self.unsure:  # a submission may have been accepted without its ids reaching the store
            self.unsure = not self._find_unreleased(todo, seen)
        if first is None:
            self._poll(total, seen)
        if self.runs.waiting and self.fatal is None and time.time() >= self.next_try and not self.unsure:
            self._submit(self.runs.waiting[: self.chunk])
        self._write()
        if self.to_release:  # their ids are stored: released, their announcements dropped with the next write
            released, self.to_release = submission.release_held(self.to_release)
            if released:
                self.writes.append(("drop_meta_entries", (submission.KEY, released)))

    def _write(self) -> None:
        """The pass's rows written back (`SweepStore.apply`), then its lines said (a run's row read again where its
        line ends with the row's words). An interrupted write leaves every write and line queued, for the Ctrl-C
        handler's `_write` (each of the coordinator's writes may be applied twice: the second changes nothing)."""
        reread = any(rid for _, rid in self.lines)
        self.store.apply(self.writes)
        lines, self.writes, self.lines = self.lines, [], []
        view = self.store.snapshot() if reread else None
        for text, rid in lines:
            self.log(text + (describe(view.rows[rid]) if view and rid else ""))

    def _say(self, text: str, rid: str | None = None) -> None:
        self.lines.append((text, rid))

    def _watch(self, rid: str, job: Any) -> None:
        self.jobs[rid] = job
        self.runs.move(rid, "watch")

    def _reattach(self, todo: list[str], seen: Poll) -> None:
        """A rerun: every unfinished row's job asked about (`seen`); a live job of this sweep is watched, not
        submitted again; so is a live job the run's lock names (submitted just before a kill, before its id was
        stored; or a duplicate's twin: squeue must see it, a name left in the lock file by a job that died is no
        reason to wait). The sweep's token is made here when the store has none (its jobs, if any, carry none)."""
        rows, queue, held = seen.view.rows, seen.queue, seen.held
        stored = seen.view.meta.get(submission.SWEEP_KEY)
        check = stored if isinstance(stored, str) and stored else None  # (submission.sweep_token, from the snapshot)
        self.token = check or uuid.uuid4().hex[:16]
        if check is None:
            self.writes.append(("set_meta", (submission.SWEEP_KEY, self.token)))
        self.sweep = replace(self.sweep, token=check)
        for rid, state in seen.states.items():
            jid = held[rid].job_id
            other = foreign(str(jid), queue, check)
            if seen.live[rid] and other:
                self.writes.append(
                    ("pending_again", (rid, f"job {jid} is not a job of this sweep ({other}); not watched"))
                )
                self._say(f"{rid}: job {jid} named by the store is not this sweep's ({other}); not watched")
            elif seen.live[rid]:
                self._watch(rid, held[rid])
                self._say(f"{rid}: job {jid} is {state.split()[0].lower()}; watching it (not submitted again)")
                if "(ended CANCELLED" in state:  # scancel-ed before this run of the sweep, its run still saving
                    self.cancelled_before.add(rid)
        for rid in [rid for rid in todo if rid not in self.jobs]:
            jid = seen.holders.get(rid)
            if jid and jid != rows[rid].get("job") and job_alive(jid) and not foreign(jid, queue, check):
                self._watch(rid, self.watch.job(jid))
                self.writes.append(("set_job", ([rid], [jid], False)))
                self._say(f"{rid}: job {jid} holds its lock and is alive; watching it (not submitted again)")

    def _submit(self, batch: list[str]) -> None:
        """One array of runs announced and sent held (`submission.send`), its ids and release queued for the pass's
        write (`_pass`), or the refusal handled."""
        try:
            sent = submission.send(
                self.ex, self.store, self.root, batch, self.options, str(self.token) if self.kind == "slurm" else None
            )
        except submission.Refused as refused:
            self.unsure = refused.maybe_accepted  # sbatch may have timed out on jobs the controller accepted
            self._refused(_one_line(getattr(refused.error, "stderr", None) or refused.error))
            return
        submitted, ids = sent.jobs, sent.ids
        if sent.token is not None:  # 3. the ids stored with the pass's write, 4. then released (`_pass`)
            self.writes.append(("set_job", (batch, ids)))
            self.to_release[sent.token] = [ids[0].split("_")[0]]
        for rid, job in zip(batch, submitted):
            self.jobs[rid] = job
            self.runs.move(rid, "submit")
            self.watch.seen.setdefault(str(job.job_id), time.time())
        self.wait, self.refusals = 10.0, 0
        left = len(self.runs.waiting)
        self._say(
            f"submitted {len(batch)} run(s) as "
            + (f"job array {ids[0].split('_')[0]}" if "_" in ids[0] else f"job(s) {', '.join(ids)}")
            + (f" ({left} to submit)" if left else "")
        )

    def _refused(self, why: str) -> None:
        """sbatch refused: a refusal that never passes stops submitting; one that passes is tried with half the
        array, then after a growing wait (10 s to 5 min)."""
        waiting, jobs = len(self.runs.waiting), len(self.jobs)
        if not _passes(why):
            meaning = never_passes(why)
            self.fatal = f"the scheduler refused the jobs: {why}" + (
                f" ({meaning.split(': ', 1)[1]})" if meaning else ""
            )
            self._say(
                f"{self.fatal}; {waiting} run(s) not submitted"
                + (f"; watching the {jobs} submitted job(s) to their end" if jobs else "")
            )
        elif self.chunk > 1:
            self.chunk = max(1, self.chunk // 2)
        elif not jobs and self.refusals >= 6:
            self.refusals += 1
            self.fatal = f"the scheduler refused the jobs 7 times with none of this sweep's running: {why}"
        else:
            self.refusals += 1
            self._say(
                f"submission refused ({why}); {waiting} run(s) wait, retrying in {self.wait:.0f}s"
                + (f" while {jobs} job(s) run" if jobs else "")
            )
            self.next_try, self.wait = time.time() + self.wait, min(self.wait * 2, 300.0)

    def _poll(self, total: int, seen: Poll) -> None:
        """Runs whose job started move on, jobs that can never start are cancelled (the sweep stops), and each job
        that left the queue is read."""
        states = seen.states
        for rid, state in states.items():
            if state.startswith("RUNNING") and self.runs.phase[rid] == Phase.SUBMITTED:
                self.runs.move(rid, "start")
        if seen.stuck:
            stuck, runs = _never_starting(self.jobs, seen, self.options, self.writes)
            self.fatal = f"the scheduler accepted the jobs but can never start them: {stuck}"
            for rid in runs:
                self.runs.move(rid, "never starts")
            self._say(
                f"{self.fatal}; cancelled them" + (f"; watching the other {len(self.jobs)} job(s)" if self.jobs else "")
            )
        for rid, state in states.items():
            if not seen.live[rid] and rid in self.jobs:
                self._job_left(rid, self.jobs.pop(rid), state, total, seen)

    def _job_left(self, rid: str, job: Any, state: str, total: int, seen: Poll) -> None:
        self.next_try = 0.0  # a job of this sweep has left the queue: a refused submission may pass now
        if rid in self.cancelled_before and seen.view.rows[rid]["status"] not in FINISHED:
            self.cancelled_before.discard(rid)  # "the next run of this sweep submits it again": this is that run
            self.writes.append(("pending_again", (rid, f"job {job.job_id} was cancelled before this run of the sweep")))
            self.runs.move(rid, "cancelled before")
            self._say(f"{rid}: job {job.job_id} was cancelled before this run of the sweep; submitted again")
            return
        retry = self.retries.get(rid, 0) < self.sweep.timeouts
        event, detail = _ended(self.sweep, rid, job, state, retry, seen, self.writes)
        if event == "adopt":  # this job found the run trained by another job of it: that one is watched
            self.writes.append(("set_job", ([rid], [detail], False)))
            self.jobs[rid] = self.watch.job(detail)
            self.runs.move(rid, event)
            self._say(f"{rid}: job {job.job_id} found it trained by job {detail}; watching that one")
        elif event == "end:requeued":  # a time limit or a node's failure without a save: submitted again
            self.runs.move(rid, event)
            self.retries[rid] = self.retries.get(rid, 0) + 1
            self._say(f"{rid}: {detail} ({self.retries[rid]}/{self.sweep.timeouts})")
        else:  # the run's phase, then (once the row is written) its words
            self.runs.move(rid, event)
            self._say(f"[{self.runs.ended()}/{total}] {rid}: ", rid)

    def _find_unreleased(self, todo: list[str], seen: Poll) -> bool:
        """The live jobs of submissions announced but not released (`normlab.experiments.submission`), found in
        squeue: each run's job is stored in its row, handed its pickle if it has none, watched and queued for
        release; a pending one whose run is done or has another live job is cancelled. False when squeue cannot
        answer (nothing may be submitted until it does: those runs may have jobs)."""
        jobs, say, meta, found = self.jobs, self._say, seen.view.meta, seen.unreleased
        if found is None:
            say("squeue did not answer about the jobs of an unfinished submission; asking again before submitting")
            return False
        extra = []
        for rid, (token, jid, state, reason) in found.items():
            if rid in todo and (rid not in jobs or str(jobs[rid].job_id) == jid):
                if rid not in jobs:
                    self._watch(rid, self.watch.job(jid))
                    submission.hand_over(jobs[rid], self.root, rid, self.options)
                    self.writes.append(("set_job", ([rid], [jid])))
                    say(
                        f"{rid}: job {jid} is {state.lower()}, its id not stored yet; watching it (not submitted again)"
                    )
                if reason == "JobHeldUser":
                    self.to_release.setdefault(token, []).append(jid)
            elif state == "PENDING":
                extra.append(jid)
            else:
                say(f"{rid}: job {jid} is {state.lower()} though the run has a result or another job; left to end")
        if extra:
            subprocess.run(["scancel", *extra], capture_output=True, check=False)
            say(f"cancelled {len(extra)} pending job(s) of runs done or held by another job: {' '.join(extra)}")
        # announcements with nothing left to release: their jobs are released, ended, or were never accepted
        done = [t for t in meta.get(submission.KEY) or {} if t not in self.to_release]
        self.writes.append(("drop_meta_entries", (submission.KEY, done)))
        return True


def _never_starting(
    jobs: dict[str, Any], seen: Poll, options: dict[str, Any], writes: list[tuple[str, tuple[Any, ...]]]
) -> tuple[str, list[str]]:
    """Pending jobs that squeue says can never start as submitted (`seen.stuck`, `slurm_poll.never_starting`; the
    caller asks only when there are some): cancelled, their runs pending again without a job (in `writes`), and
    dropped from `jobs`. Returns one line naming them and why, and their runs."""
    stuck = seen.stuck
    scancel([jid for jid, _, _ in stuck.values()])
    for rid, (jid, reason, why) in stuck.items():
        writes.append(("pending_again", (rid, f"job {jid} could never start ({reason}: {why}); cancelled")))
        del jobs[rid]
    _, reason, why = next(iter(stuck.values()))
    detail = time_over_partition(options) if reason == "PartitionTimeLimit" else None
    ids = " ".join(jid for jid, _, _ in stuck.values())
    return f"{ids} pending for {reason}: {detail or why}", list(stuck)


def _ended(
    sweep: SweepJobs,
    rid: str,
    job: Any,
    state: str,
    retry: bool,
    seen: Poll | None = None,
    writes: list[tuple[str, tuple[Any, ...]]] | None = None,
) -> tuple[str, str]:
    """A job left the scheduler: the run's next move (an event of `slurm_states.TRANSITIONS`) and its detail.
    ("end:ended ok", "") when the job recorded the run's outcome (its row, else the run's summary.json, which is
    then recorded); ("adopt", JOB) when another live job of this sweep holds the run's lock; else the first row of
    `slurm_states.ENDINGS` that applies decides: ("end:requeued", why) with the row pending again, when the job ended
    on a time limit or a node's failure without requeueing itself and `retry` allows it, or the row failed with one
    line saying why.

    Only normlab's own files are read (the store, summary.json, the lock file, the job's text logs): submitit's
    result pickle is never opened, since unpickling runs code and one planted in the sweep folder would run here.
    `seen`: this poll's reading (the row from its store snapshot, squeue's jobs; None: both read now); `writes`: the
    pass's store writes, the row's appended to them (None: written now)."""
    write = writes.append if writes is not None else lambda w: sweep.store.apply([w])
    store, jid = sweep.store, str(job.job_id)
    row = seen.view.rows[rid] if seen else store.row(rid)
    worker = str(row.get("worker") or "")
    if row["status"] in FINISHED:
        if sweep.kind == "slurm" and worker and worker != jid:  # another job of the sweep trained it: the row's job
            write(("trained_by", (rid, worker)))
        return "end:ended ok", ""
    run = SweepDir(sweep.root).run(rid)
    summary = run.summary()
    if summary and summary.get("status") in FINISHED and summary.get("steps") == store.row(rid)["config"].optim.steps:
        write(("record", (rid, summary, jid, True)))
        return "end:ended ok", ""
    holder = holder_job(run.lock_file)
    if holder and holder != jid and job_alive(holder):
        queue = seen.queue if seen and seen.queue is not None else live_jobs()
        if not foreign(holder, queue, sweep.token):
            return "adopt", holder  # a duplicate's twin trains it: its row is that job's to write
    by_this_job = worker == jid or (sweep.kind != "slurm" and worker.endswith(f":{jid}"))  # submitit-local: host:pid
    if row["status"] == "failed" and by_this_job:
        return "end:ended ok", ""  # the job recorded its run's failure itself: the row's reason says why
    stopped = by_this_job and row["status"] == "pending" and (row["reason"] or "").startswith("saved at step")
    end = JobEnd(
        jid=jid,
        word=state.split()[0] if state else "UNKNOWN",
        state=state,
        worker=worker,
        by_this_job=by_this_job,
        stopped=stopped,
        saved=saved_step(sweep.root, rid, row),
        job=job,
        retry=retry,
        timeouts=sweep.timeouts,
    )
    phase, why = decide(end)
    if phase == Phase.REQUEUED:
        write(("pending_again", (rid, why)))
        return "end:requeued", why
    failure = {"status": "failed", "reason": why, **({"failed_step": end.saved} if stopped else {})}
    write(("record", (rid, failure, jid, True)))
    return f"end:{phase.value}", why


def _interrupted(root: Path, store: SweepStore, jobs: dict[str, Any], kind: str, log) -> None:  # noqa: ANN001
    """Ctrl-C in the coordinator: on a terminal, ask whether to cancel the jobs; elsewhere leave them and say how."""
    if not jobs or kind != "slurm":
        return
    ids = " ".join(str(job.job_id) for job in jobs.values())
    answer = ""
    if sys.stdin is not None and sys.stdin.isatty():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            answer = input(f"\ncancel this sweep's {len(jobs)} job(s) ({ids})? [y/N] ").strip().lower()
        except (EOFError, KeyboardInterrupt):
            answer = ""
    if answer in ("y", "yes"):
        cancelled = cancel_jobs(root, store, jobs, "cancelled at Ctrl-C")
        log(f"cancelled {cancelled} job(s); the same command submits their runs again")
    else:
        log(
            f"left {len(jobs)} job(s) running ({ids}): the same command watches them again; cancel them with "
            f"`normlab sweep --cancel {root}` (or scancel {ids})"
        )


def cancel_jobs(root: Path, store: SweepStore, jobs: dict[str, Any], why: str, wait: float = 300.0) -> int:
    """scancel the jobs, wait (up to `wait` s) until the scheduler lists none of them (a cancelled job's run saves
    on SIGTERM and may still write its row until the cluster's KillWait ends), then record each unfinished run
    `failed`, saying why in one line."""
    scancel([str(job.job_id) for job in jobs.values()])
    deadline = time.time() + wait
    while time.time() < deadline and any(job_alive(str(job.job_id)) for job in jobs.values()):
        time.sleep(1.0)
    for rid, job in jobs.items():
        store.record(
            rid,
            {"status": "failed", "reason": f"job {job.job_id} {why}; the next run of this sweep submits it again"},
            worker=str(job.job_id),
            unless_finished=True,
        )
    return len(jobs)


def cancel_sweep(root: str | Path, log=print) -> int:  # noqa: ANN001 - log: print-like
    """`normlab sweep --cancel DIR`: cancel the live jobs of a sweep's unfinished runs; returns how many.

    Only jobs that carry this sweep's token in their comment (`normlab.experiments.submission`), as squeue shows
    them, are cancelled: a job id the store names that squeue lists without it (an edited store, an id
    since given to another job) is left alone, with a line saying why. So are all of them when the store holds no
    token (written by an older normlab): scancel them yourself."""
    folder = SweepDir(root)
    if not folder.is_sweep():
        raise ConfigError(f"{root} holds no sweep store; give a folder written by normlab sweep")
    store = open_store(folder)
    queue = live_jobs()
    if queue is None:
        raise ConfigError(
            f"cannot cancel the jobs of {root}: squeue does not answer here (is this a SLURM login node?)"
        )
    token = store.get_meta(submission.SWEEP_KEY)
    token = token if isinstance(token, str) and token else None
    watch = Watcher(folder.path, "slurm")
    alive: dict[str, Any] = {}
    for row in store.rows():
        jid = row.get("job")
        if not jid or row["status"] in FINISHED:
            continue
        if jid not in queue:  # ended, or another user's (said: it is never cancelled)
            whose = foreign(jid, queue, token)
            if whose:
                log(f"skipped job {jid} (run {row['run_id']}): not a job of this sweep ({whose}); left as it is")
            continue
        other = (
            foreign(jid, queue, token)
            if token
            else "the store names no token of this sweep (an older normlab wrote it)"
        )
        if other:
            log(f"skipped job {jid} (run {row['run_id']}): not a job of this sweep ({other}); left as it is")
        else:
            alive[row["run_id"]] = watch.job(jid)
    # jobs of a submission whose coordinator died before it stored or released them (submission.py): found by the
    # submission's token, which only this store names
    for rid, (_, jid, _, _) in (submission.unreleased(store.get_meta(submission.KEY) or {}, queue) or {}).items():
        if rid not in alive and store.row(rid)["status"] not in FINISHED:
            alive[rid] = watch.job(jid)
    n = cancel_jobs(folder.path, store, alive, "cancelled by normlab sweep --cancel")
    log(
        f"cancelled {n} job(s) of {root}"
        + (f": {' '.join(str(j.job_id) for j in alive.values())}" if n else " (none was pending or running)")
    )
    return n
