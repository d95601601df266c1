"""The SLURM sweep as a small state machine over the store: each run's phase, the events that move it, and how a
job's end is read, each in one table.

A run of the sweep is in one phase at a time:

    pending --submit--> submitted --start--> running --end:...--> ended ok | ended failed | cancelled
       ^                    |                   |
       |                    +---never starts----+---> pending (cancelled by the coordinator, the sweep stops)
       +-------------- requeued <--- again -----+     (a time limit or a node's failure without a requeue)

`normlab.experiments.cluster.TRANSITIONS` is the whole graph (beside the coordinator that moves runs along it): a
move it does not list is a bug and raises. A job that left the scheduler is read by `ENDINGS`, an ordered table of
(what the files say, the phase it leads to, the row's one-line reason); the first row that applies decides. Only
normlab's own files are read (the store's row, summary.json, the lock file, the job's text logs): submitit's result
pickle is never opened, since unpickling runs code.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from normlab.experiments.scheduler import HELD_LINE
from normlab.runs.files import SweepDir

# how a job ends that the coordinator submits again itself (the run continues from its newest checkpoint): a time
# limit that came without the USR2 warning (a limit shortened with scontrol, a signal delay longer than the limit),
# a node that failed or did not boot, a preemption that cancelled instead of requeueing
RESUBMIT = ("TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "PREEMPTED")


class Phase(StrEnum):
    """Where a run of the sweep stands, as the coordinator sees it."""

    PENDING = "pending"  # waiting to be submitted (never submitted, refused, or cancelled before this sweep run)
    SUBMITTED = "submitted"  # a job holds it; the scheduler has not started it yet
    RUNNING = "running"  # its job runs
    REQUEUED = "requeued"  # its job ended on a time limit, a node's failure or a preemption: submitted again
    OK = "ended ok"  # its job recorded its outcome (ok, diverged, stalled or failed: the run's own result)
    FAILED = "ended failed"  # its job ended without an outcome the run recorded: the row says how, in one line
    TIMEOUT = "ended timeout"  # its time limits are used up (slurm_max_num_timeout), saved: the same command continues
    PREEMPTED = "ended preempted"  # it ended on a time limit or a node's failure with no retry left
    CANCELLED = "ended cancelled"  # scancel-ed: never submitted again by this coordinator


ENDED = (Phase.OK, Phase.FAILED, Phase.TIMEOUT, Phase.PREEMPTED, Phase.CANCELLED)
WAITING = (Phase.PENDING, Phase.REQUEUED)  # the phases whose runs the coordinator submits


@dataclass(frozen=True)
class JobEnd:
    """What normlab's own files say about a job that left the scheduler (`read_end`)."""

    jid: str
    word: str  # the scheduler's state word: COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    state: str  # the whole state text ("CANCELLED by 0")
    worker: str  # the row's worker
    by_this_job: bool  # this job wrote the row
    stopped: bool  # this job saved the run and set its row pending again ("saved at step S")
    saved: int | None  # the step the run continues from
    job: Any  # the submitit job: its text logs are read when a row of ENDINGS asks (`lines`)
    retry: bool  # submitting it again is allowed (retries left)
    timeouts: int  # slurm_max_num_timeout

    @property
    def again(self) -> str:
        saved = self.saved
        return f"run the same command again to continue from step {saved}" if saved else "run the same command again"

    @functools.cached_property
    def lines(self) -> tuple[str, ...]:
        return log_lines(self.job)

    @property
    def stderr(self) -> str:
        return str(self.job.paths.stderr)

    def logged(self, words: str) -> bool:
        return any(words in x for x in self.lines)


def _cancelled(e: JobEnd) -> str:
    by = e.state.split(" by ")[-1] if " by " in e.state else None
    return (
        f"job {e.jid} was cancelled"
        + (f" by uid {by}" if by else "")
        + (f" and saved the run at step {e.saved}" if e.stopped else "")
        + "; the next run of this sweep submits it again"
        + (f", continuing from step {e.saved}" if e.stopped else "")
    )


def _timed_out(e: JobEnd) -> str:
    t = e.timeouts
    return (
        f"job {e.jid} timed out {t + 1} time{'s' if t else ''} (slurm_max_num_timeout = {t}), saved at step "
        f"{e.saved}; {e.again} (or raise timeout_min or slurm_max_num_timeout)"
    )


def _saved(e: JobEnd) -> str:
    head = f"job {e.jid} saved the run at step {e.saved} and ended {e.word} without requeueing itself"
    return f"{head}; submitted again" if e.retry else f"{head}; {e.again}"


def _resubmit(e: JobEnd) -> str:
    if e.retry:
        return f"job {e.jid} ended {e.word} without requeueing itself; submitted again, from its newest checkpoint"
    return f"job {e.jid} ended {e.word}; see {e.stderr}; submitted again {e.timeouts} times already: {e.again}"


def _held(e: JobEnd) -> str:
    why = f"job {e.jid} ended {e.word} without training the run (held by {e.worker or 'another process'}, which has "
    why += "ended since)"
    return f"{why}; submitted again" if e.retry else f"{why}; {e.again}"


def _crashed(e: JobEnd) -> str:
    found = [x.strip() for x in e.lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", x.strip())]
    error = found[-1][:300] if found else None
    return (
        f"job {e.jid} ended {e.word}"
        + (f": {error}" if error else " without recording an outcome")
        + (f"; see {e.stderr}")
    )


@dataclass(frozen=True)
class Ending:
    """One row of `ENDINGS`: when it applies, the phase it leads to (`again` when retries are left: requeued), and
    the row's one-line reason."""

    name: str
    applies: Callable[[JobEnd], bool]
    phase: Phase
    again: bool
    reason: Callable[[JobEnd], str]


# the first row that applies decides (a CANCELLED job is never submitted again, even if it saved on SIGTERM; a job
# that ended without recording anything is failed with its log's last error, not resubmitted: the same crash would
# follow; only one whose log says it found the run held by another process is)
ENDINGS: tuple[Ending, ...] = (
    Ending("cancelled", lambda e: e.word == "CANCELLED", Phase.CANCELLED, False, _cancelled),
    Ending(
        "timeouts used up",
        lambda e: e.stopped and e.logged("timed-out too many times"),
        Phase.TIMEOUT,
        False,
        _timed_out,
    ),  # fmt: skip
    Ending("saved, not requeued", lambda e: e.stopped, Phase.PREEMPTED, True, _saved),
    Ending("time limit or node failure", lambda e: e.word in RESUBMIT, Phase.PREEMPTED, True, _resubmit),
    Ending(
        "found it held",
        lambda e: e.word == "COMPLETED" and not e.by_this_job and e.logged(HELD_LINE),
        Phase.FAILED,
        True,
        _held,
    ),  # fmt: skip
    Ending("crashed", lambda e: True, Phase.FAILED, False, _crashed),
)


def decide(end: JobEnd) -> tuple[Phase, str]:
    """The run's next phase and its row's reason, from the first row of `ENDINGS` that applies."""
    row = next(r for r in ENDINGS if r.applies(end))
    return (Phase.REQUEUED if row.again and end.retry else row.phase), row.reason(end)


def log_lines(job: Any) -> tuple[str, ...]:
    """The lines of a job's logs (submitit's stdout and stderr files, all its lives: opened for append), as text."""
    lines: list[str] = []
    for path in dict.fromkeys((job.paths.stderr, job.paths.stdout)):
        with contextlib.suppress(OSError):
            lines += Path(path).read_text(errors="replace").splitlines()
    return tuple(lines)


def saved_step(root: Path, rid: str, row: dict[str, Any]) -> int | None:
    """The step a run can continue from: the one its last job saved at (its row), else its newest checkpoint's."""
    if row.get("step") is not None and row["status"] == "pending":
        return int(row["step"])
    steps = [
        int(m.group(1))
        for p in SweepDir(root).run(rid).checkpoints.glob("step_*")
        if (m := re.match(r"step_(\d+)", p.name))
    ]
    return max(steps) if steps else None
