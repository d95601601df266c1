"""A SLURM submission that survives its coordinator: the job ids are known again after any kill.

A coordinator can die between sbatch accepting an array and storing its job ids (kill -9, a lost login
session), and sbatch can report a timeout on a busy controller that did accept the jobs. A rerun that does
not know those jobs submits their runs again: a duplicate job per run, and, since submitit hands a job its
pickle only after sbatch returns, jobs that start, wait a minute for a pickle that never comes and fail. So
each submission goes in four steps:

1. announced in the store (meta `slurm_submissions`: a token -> the run ids in array-task order);
2. sent held (`sbatch --hold`), the token in the job's comment (`normlab:TOKEN`), the pickles put in place
   (submitit);
3. the job ids stored in the rows, with the coordinator's other writes of that pass (its one write,
   `SweepStore.apply`);
4. released (`scontrol release`, `release_held`), and only then the announcement dropped (with the coordinator's
   next write).

`send` does the first two; the coordinator (`normlab.experiments.cluster`) the last two, so that each pass writes the
store once after sbatch.

Every job also carries the sweep's own token (`normlab-sweep:TOKEN`, made once per sweep store: meta
`slurm_sweep`): a job id the store names is this sweep's only if squeue shows that word in its comment. `normlab
sweep --cancel` cancels no other job, and a rerun watches no other (an edited store, or one naming an id the
scheduler has since given to someone else's job). A copy of the folder keeps the token: its jobs are the
original's too.

No job starts before its id is stored. A rerun, and the next try after a refused sbatch, asks squeue for the
live jobs of every announcement left (`unreleased`): the coordinator (`normlab.experiments.cluster`) stores
each in its run's row, gives it its pickle if it has none (`hand_over`), watches it and releases it; a job
whose run is done or has another live job is cancelled. Only runs with no such job are submitted again.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.runs.files import SweepDir
from normlab.runs.store import SweepStore

KEY = "slurm_submissions"  # the store's meta key: token -> run ids, for submissions not yet released
TAG = "normlab:"  # the comment's word that names the token
SWEEP_KEY = "slurm_sweep"  # the store's meta key: the token every job of this sweep carries
SWEEP_TAG = "normlab-sweep:"  # the comment's word that names it


def sweep_token(store: SweepStore) -> tuple[str, bool]:
    """The token every job of this sweep carries in its comment, and whether it was made just now (a store whose
    jobs, if any, were submitted by a normlab that gave them none)."""
    token = store.get_meta(SWEEP_KEY)
    if isinstance(token, str) and token:
        return token, False
    token = uuid.uuid4().hex[:16]
    store.set_meta(SWEEP_KEY, token)
    return token, True


def carries(comment: str, token: str) -> bool:
    """Whether a job's comment (squeue %k) names this sweep's token."""
    return f"{SWEEP_TAG}{token}" in comment.split()


def parameters(options: dict[str, Any], token: str, sweep: str) -> dict[str, Any]:
    """submitit's parameters for a held submission whose comment names `token` and the sweep's token `sweep` (the
    user's comment kept, first)."""
    comment = " ".join(x for x in (options.get("slurm_comment"), f"{TAG}{token}", f"{SWEEP_TAG}{sweep}") if x)
    extra = {**(options.get("slurm_additional_parameters") or {}), "hold": True}
    return {"slurm_comment": comment, "slurm_additional_parameters": extra}


def unreleased(
    tokens: dict[str, list[str]], queue: dict[str, tuple[str, str, str]] | None
) -> dict[str, tuple[str, str, str, str]] | None:
    """run id -> (token, job id, state, reason) of each live job of an announced submission (`tokens`: the store's
    meta `KEY`; `queue`: `slurm_poll.live_jobs()`); None when squeue did not answer (the caller must not submit
    those runs then). A run named by two announcements gets its newest job."""
    if not tokens:
        return {}
    if queue is None:
        return None
    found: dict[str, tuple[str, str, str, str]] = {}
    for jid, (state, reason, comment) in queue.items():
        token = next((w[len(TAG) :] for w in comment.split() if w.startswith(TAG)), None)
        if token is None or token not in tokens:
            continue
        task = int(jid.split("_", 1)[1]) if "_" in jid else 0  # a batch of one is a plain job, not an array
        if task < len(tokens[token]):
            rid = tokens[token][task]
            if rid not in found or _number(jid) > _number(found[rid][1]):
                found[rid] = (token, jid, state, reason)
    return found


def _number(jid: str) -> int:
    return int(jid.split("_", 1)[0]) if jid.split("_", 1)[0].isdigit() else 0


def release(job_ids: list[str]) -> bool:
    """scontrol release: True once none of the jobs is held any more (a task that ended meanwhile is no failure)."""
    if not job_ids:
        return True
    try:
        out = subprocess.run(["scontrol", "release", ",".join(job_ids)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if out.returncode == 0:
        return True
    errors = [x for x in out.stderr.splitlines() if x.strip()]
    harmless = ("already finished", "No error", "Invalid job id", "not held")
    return bool(errors) and all(any(h in x for h in harmless) for x in errors)


class Refused(Exception):
    """sbatch refused an array (`send`): ``error`` is what submitit raised, ``maybe_accepted`` whether the array was
    announced (sbatch may have timed out on jobs the controller accepted: squeue must be asked before submitting)."""

    def __init__(self, error: Exception, maybe_accepted: bool) -> None:
        super().__init__(str(error))
        self.error, self.maybe_accepted = error, maybe_accepted


@dataclass(frozen=True)
class Sent:
    """An array sent held (`send`): its jobs in the batch's order, their ids, and the token of its announcement
    (None on submitit-local: nothing announced or held)."""

    jobs: list[Any]
    ids: list[str]
    token: str | None


def send(ex: Any, store: SweepStore, root: Path, batch: list[str], options: dict[str, Any], sweep: str | None) -> Sent:
    """One array of runs through the first two steps above, in that order: announced (written at once), then sent
    held, on SLURM (`sweep`: the sweep's token); through submitit alone on submitit-local (`sweep` None). The caller
    stores the ids, then releases (`release_held`). A refusal raises `Refused`, submitit's pickles of the refused
    array removed (a submitted job's move to its own folder). submitit prints a refusing sbatch's stderr as it
    raises: it is kept off the terminal here and the caller says it in one line."""
    from normlab.experiments.job import RunJob

    token = None  # the submission's, in its jobs' comment
    if sweep is not None:
        token = uuid.uuid4().hex[:12]
        ex.update_parameters(**parameters(options, token, sweep))
    runs = [RunJob(str(root), rid) for rid in batch]
    if token is not None:
        store.add_meta_entry(KEY, token, batch)  # 1. announced
    try:
        with contextlib.redirect_stderr(io.StringIO()), ex.batch():  # 2. sent (held on SLURM)
            submitted = [ex.submit(run) for run in runs]
    except Exception as err:  # sbatch refused: its message decides what follows (`Refused`)
        for pickled in SweepDir(root).jobs_dir.glob("*.pkl"):
            pickled.unlink(missing_ok=True)
        raise Refused(err, token is not None) from err
    return Sent(submitted, [str(job.job_id) for job in submitted], token)


def release_held(held: dict[str, list[str]]) -> tuple[list[str], dict[str, list[str]]]:
    """Release the held jobs of each announcement (token -> job ids, their ids stored): the tokens released (their
    announcements to drop from the store) and those scontrol did not release yet (to try again)."""
    released: list[str] = []
    left: dict[str, list[str]] = {}
    for token, ids in held.items():
        if release(ids):
            released.append(token)
        else:
            left[token] = ids
    return released, left


def hand_over(job: Any, sweep_dir: Path, run_id: str, options: dict[str, Any]) -> None:
    """Write the pickle a job of a run waits for (`python -m submitit.core._submit`), unless submitit already did:
    the job was sent but its coordinator died before moving the pickle in place. Atomic: the job may be starting."""
    from submitit.helpers import DelayedSubmission

    from normlab.experiments.job import RunJob

    target = job.paths.submitted_pickle
    if target.exists():
        return
    delayed = DelayedSubmission(RunJob(str(sweep_dir), run_id))
    delayed.set_timeout(int(options.get("timeout_min", 5)), int(options.get("slurm_max_num_timeout", 3)))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    delayed.dump(partial)
    partial.replace(target)
