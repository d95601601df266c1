"""The worker's side of a sweep: train one run and record its outcome in the store (a spawned local worker, a
scheduler job). Below `runner` (which spawns the workers) and `job` (a run as a scheduler job)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from normlab.experiments.sweep import RunSpec
from normlab.runs.files import SweepDir
from normlab.runs.lock import LockBusy, RunLock
from normlab.runs.outcome import FINISHED
from normlab.runs.store import open_store


def execute_run(
    sweep_dir: str,
    run_id: str,
    threads: int | None = None,
    watch_parent: int | None = None,
    stop: threading.Event | None = None,
    worker: str | None = None,
) -> dict[str, Any]:
    """Train one run of a sweep and record its outcome in the store; returns the run's summary.
    `watch_parent`: the pid of the sweep process that spawned this worker, which it must not outlive.
    `stop` (a scheduler job): set, the run saves a checkpoint after its step, its row goes back to `pending`
    and `Stopped` is raised (the job is requeued). `worker`: the name the row gives this attempt.

    Never raises for a run's own failure: a crash becomes a `failed` row with the reason. A run whose row
    already holds a result is left as it is; so is a run that another process is training (its lock, taken
    here before the row is touched): its row is that process's to write, and the returned dict names it
    (`holder_job`: its SLURM job, which a coordinator then watches instead of this one).
    """
    import torch

    from normlab.train import TrainingFailed, train
    from normlab.train.trainer import Stopped

    if watch_parent:
        _exit_with_parent(watch_parent)
    if threads:
        torch.set_num_threads(threads)
    folder = SweepDir(sweep_dir)
    store = open_store(folder)
    if store.row(run_id)["status"] in FINISHED:  # a duplicate attempt (a job requeued after its run ended)
        return {**store.row(run_id)}
    run = folder.run(run_id)
    try:
        # a local worker (`watch_parent`) waits out a killed sweep's worker still holding the run for as long as
        # that process lives (it ends with its sweep), however slow the machine; a job refuses after 10 s and
        # names the holder's job
        lock = RunLock(run.path, patient=watch_parent is not None)
    except LockBusy as err:  # another process trains it (a duplicate job's twin): the row stays as it wrote it
        return {"status": "running", "reason": str(err), "holder_job": (err.holder or {}).get("job")}
    try:
        row = store.row(run_id)
        if row["status"] in FINISHED:  # the other process ended it while this one waited for the lock
            return {**row}
        spec = RunSpec(run_id, row["idx"], row["axes"], row["config"])
        worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        store.mark_running(run_id, worker)
        try:
            summary = train(spec.train_config(run.path), stop=stop, lock=lock)
        except Stopped as err:
            store.requeued(
                run_id,
                f"saved at step {err.step} by {worker}, stopped by the scheduler (preempted, at "
                "its time limit or cancelled)",
                step=err.step,
            )
            return {"status": "pending", "reason": "requeued", "step": err.step}
        except TrainingFailed as err:
            summary = run.summary() or {"status": "failed", "reason": str(err)}
        except Exception as err:  # noqa: BLE001 - bad data path, bad config combination, ...: recorded, not raised
            summary = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
        store.record(run_id, summary, worker=worker)
        return summary
    finally:
        lock.release()


def _exit_with_parent(parent: int) -> None:
    """End this worker once its parent is no longer the sweep process `parent` that spawned it (kill -9
    leaves no chance to tell it). The pid comes from the spawner: taking getppid() here would read the
    reaper's pid if the sweep had already died, and the worker would never exit."""
    if os.getppid() != parent:
        os._exit(3)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
