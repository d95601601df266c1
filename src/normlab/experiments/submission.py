"""A SLURM submission that survives its coordinator: the job ids are known again after any kill.

A coordinator can die between sbatch accepting an array and storing its job ids (kill -9, a lost login
session), and sbatch can report a timeout on a busy controller that did accept the jobs. A rerun that does
not know those jobs submits their runs again: a duplicate job per run, and, since submitit hands a job its
pickle only after sbatch returns, jobs that start, wait a minute for a pickle that never comes and fail. So
each submission goes in four steps:

1. announced in the store (meta `slurm_submissions`: a token -> the run ids in array-task order);
2. sent held (`sbatch --hold`), the token in the job's comment (`normlab:TOKEN`);
3. the job ids stored in the rows and the pickles in place (submitit);
4. released (`scontrol release`), and only then the announcement dropped.

No job starts before its id is stored. A rerun, and the next try after a refused sbatch, asks squeue for the
live jobs of every announcement left (`unreleased`): the coordinator (`normlab.experiments.cluster`) stores
each in its run's row, gives it its pickle if it has none (`hand_over`), watches it and releases it; a job
whose run is done or has another live job is cancelled. Only runs with no such job are submitted again.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from normlab.runs.store import SweepStore

KEY = "slurm_submissions"  # the store's meta key: token -> run ids, for submissions not yet released
TAG = "normlab:"  # the comment's word that names the token


def announce(store: SweepStore, run_ids: list[str]) -> str:
    """Record a submission about to be sent; returns its token."""
    token = uuid.uuid4().hex[:12]
    store.set_meta(KEY, {**(store.get_meta(KEY) or {}), token: list(run_ids)})
    return token


def forget(store: SweepStore, tokens: list[str]) -> None:
    """Drop announcements: their jobs are stored and released, or sbatch refused them and squeue lists none."""
    left = {t: ids for t, ids in (store.get_meta(KEY) or {}).items() if t not in tokens}
    store.set_meta(KEY, left)


def parameters(options: dict[str, Any], token: str) -> dict[str, Any]:
    """submitit's parameters for a held submission whose comment names `token` (the user's comment kept)."""
    comment = " ".join(x for x in (options.get("slurm_comment"), f"{TAG}{token}") if x)
    extra = {**(options.get("slurm_additional_parameters") or {}), "hold": True}
    return {"slurm_comment": comment, "slurm_additional_parameters": extra}


def unreleased(store: SweepStore) -> dict[str, tuple[str, str, str, str]] | None:
    """run id -> (token, job id, state, reason) of each live job of an announced submission; None when squeue cannot
    answer (the caller must not submit those runs then). A run named by two announcements gets its newest job."""
    tokens = store.get_meta(KEY) or {}
    if not tokens:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "--me", "-o", "%i|%T|%r|%k"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    found: dict[str, tuple[str, str, str, str]] = {}
    for line in out.stdout.splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) < 4:
            continue
        jid, state, reason, comment = parts
        token = next((w[len(TAG) :] for w in comment.split() if w.startswith(TAG)), None)
        if token not in tokens:
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
