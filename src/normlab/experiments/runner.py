"""Run a sweep: every pending run once, in parallel, resumable, never stopped by one bad run.

The sweep folder (sweep.toml, sweep.db, runs/ID/, logs/ID.log) is `normlab.runs.files.SweepDir`;
its store is `normlab.runs.store.SweepStore`.

Executors:
- `local` (default): one process per run, `workers` at a time, torch threads split evenly between
  them (the cores the process may use, at most ``OMP_NUM_THREADS`` each: `normlab.experiments.cpus`). A process
  per run (not a pool) so a run that segfaults or is OOM-killed costs that run only; its row says how the process
  ended. On the CPU each is forked from a server that has torch and the
  trainer imported (`normlab.experiments.workers`); a GPU run starts a fresh interpreter.
- `slurm`: job arrays through submitit (`pip install submitit`), options from the sweep's `[slurm]`
  table (e.g. `slurm_partition`, `timeout_min`, `cpus_per_task`, `slurm_array_parallelism`):
  re-attached on a rerun, checkpointed and requeued on preemption or a time limit
  (`normlab.experiments.cluster`).
- `submitit-local`: the same through submitit's LocalExecutor, which runs here and tests that path.

Resuming: the workers write each outcome to the store themselves, in a committed transaction, the
moment a run ends; a killed sweep keeps every row written. On restart, `ok`/`diverged` runs are
skipped; a `running` row left by a killed sweep is first reconciled with its run's summary.json
(the run may have finished just before the kill) and otherwise re-run, continuing from the run's
newest checkpoint when it has one; `failed` runs are re-run. A lock file keeps two sweeps from
driving the same directory. A lost store (0 bytes, or a corrupt one moved aside) is rebuilt from
sweep.toml and the run folders (`rebuild_store`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.errors import ConfigError, OutputError
from normlab.experiments.cluster import run_cluster
from normlab.experiments.cpus import threads_per_worker, usable_cores
from normlab.experiments.progress import SweepProgress, last_step
from normlab.experiments.scheduler import check_options
from normlab.experiments.slurm_preflight import preflight
from normlab.experiments.sweep import RunSpec, SweepConfig
from normlab.experiments.workers import ForkedWorker
from normlab.experiments.workers import available as workers_available
from normlab.io import STORAGE_ERRORS, atomic_write_bytes, own_folder
from normlab.runs.files import SweepDir
from normlab.runs.lock import FolderLock
from normlab.runs.outcome import BUDGET_STOP, FINISHED, describe, shown_counts
from normlab.runs.store import SweepStore, open_store


def prepare(sweep: SweepConfig, out: str | Path) -> tuple[SweepStore, list[RunSpec]]:
    """Create or reopen the sweep directory; refuse to mix runs of different base settings."""
    folder = SweepDir(out)
    root = folder.path
    root.mkdir(parents=True, exist_ok=True)
    store = open_store(folder)
    if folder.sweep_file.is_file():
        rebuild_store(root, store)  # a lost store: the runs already trained are found again
    specs = sweep.expand()
    base = json.loads(json.dumps(sweep.base, sort_keys=True))
    old = store.get_meta("base")
    if old is not None and old != base:
        changed = sorted(k for k in set(old) | set(base) if old.get(k) != base.get(k))
        raise ConfigError(
            f"{root} holds a sweep with other base settings (changed: {', '.join(changed)}); "
            "a sweep directory only grows by grid values; use a new --out for new base settings"
        )
    store.set_meta("base", base)
    store.set_meta("name", sweep.name)
    store.set_meta("sweep", sweep.to_dict())
    store.add(specs)
    atomic_write_bytes(folder.sweep_file, _to_toml(sweep.to_dict()).encode())
    return store, specs


def _made_by_this_call(out: Path) -> tuple[Path, bool] | None:
    """What a new sweep's setup creates, and whether it goes whole if the setup fails: the outermost missing folder
    of `out` (whole), or `out` itself when it is an empty folder (emptied again, kept); None for a folder that
    holds anything (a sweep to continue: nothing of it is ever removed)."""
    if out.is_dir():
        return (out, False) if not any(out.iterdir()) else None
    if out.exists():
        return None
    top = out
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top, True


def _setup_failed(out: Path, made: tuple[Path, bool] | None, err: OSError | sqlite3.Error) -> OutputError:
    """The one line for a sweep whose folder or store could not be written (a full disk, a read-only mount, a quota),
    once what this call made is removed again (`_made_by_this_call`): a new sweep leaves nothing behind, one being
    continued keeps everything it held."""
    if made is not None and made[1]:
        shutil.rmtree(made[0], ignore_errors=True)
    elif made is not None:  # an empty folder of the user's: emptied again, kept
        for child in list(out.iterdir()) if out.is_dir() else []:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    where = next((p for p in (out, *out.parents) if p.exists()), out)
    code = getattr(err, "errno", None)
    if isinstance(err, sqlite3.Error) and "full" in str(err):
        code = errno.ENOSPC  # SQLite's SQLITE_FULL: "database or disk is full"
    if code in STORAGE_ERRORS:
        why = f"{where} {STORAGE_ERRORS[code]}"
        fix = "free space and run the same command again"
        if code == errno.EROFS:
            fix = "give a folder on writable storage"
    elif code in (errno.EACCES, errno.EPERM):
        why, fix = f"{where} is not writable by this user", "give a folder this user may write"
    else:
        why, fix = f"writing in {where} failed ({type(err).__name__}: {err})", "run the same command again"
    left = "nothing was left there" if made is not None else "the sweep's files there are as they were"
    return OutputError(f"cannot set up the sweep in {out}: {why}; {left}; {fix}")


def rebuild_store(root: str | Path, store: SweepStore | None = None) -> int:
    """Rows for a store that holds none while the folder holds runs (a 0-byte sweep.db, or a corrupt one moved
    aside): the runs of sweep.toml's grid, then any other run folder from its config.json, each with the
    outcome its summary.json records (as a resumed sweep would find it). Returns how many rows were made."""
    folder = SweepDir(root)
    store = store or open_store(folder)
    runs = folder.run_folders()
    if not runs or store.rows():
        return 0
    specs: list[RunSpec] = []
    if folder.sweep_file.is_file():
        sweep = SweepConfig.from_toml(folder.sweep_file)
        specs = sweep.expand()
        store.set_meta("base", json.loads(json.dumps(sweep.base, sort_keys=True)))
        store.set_meta("name", sweep.name)
        store.set_meta("sweep", sweep.to_dict())
    axes = list(specs[0].axes) if specs else []
    known = {s.run_id for s in specs}
    for run in runs:
        if run.path.name in known:
            continue
        config = run.train_config()
        if config is None:
            continue
        flat = config.to_flat()
        point = {a: flat.get(a, flat["model"].get(a.removeprefix("model."))) for a in axes}
        specs.append(RunSpec(run.path.name, len(specs), point, config))
    store.add(specs)
    steps = {s.run_id: s.config.optim.steps for s in specs}
    for run in runs:
        summary = run.read_summary()
        if summary is not None and (summary.status == "failed" or summary.finished(steps.get(run.path.name))):
            store.record(run.path.name, summary.to_json())
    return len(specs)


def _reconcile(store: SweepStore, root: Path) -> int:
    """Rows left `running` by a killed sweep: take the result if the run finished, else re-run."""
    taken = 0
    for row in store.rows("running"):
        summary = SweepDir(root).run(row["run_id"]).read_summary()
        if summary is not None and summary.finished(row["config"].optim.steps):
            store.record(row["run_id"], summary.to_json())
            taken += 1
    return taken


# a run at its last step at the deadline (training it, or in the closing evaluation, which comes before the
# step's metrics row) gets this long past `stop_at` to finish, so that a budget never fails a run that trained
# to the end (issue 53: a complete 150-step run was recorded failed in its closing evaluation)
CLOSING_GRACE_S = 60.0


@dataclass(frozen=True)
class Deadline:
    """Wall-clock limits (time.time()) for a sweep under a time budget (local executor): no run starts
    after `start_by`; a run still training at `stop_at` is stopped and recorded `failed` with the reason
    ("stopped at the end of the time budget at step S of N"), and is run again (from its newest checkpoint)
    by the next run of the same sweep, as any failed run. A run at its last step (its rows reach the step
    before: the last row is written after the closing evaluation) is given up to `CLOSING_GRACE_S` more."""

    start_by: float
    stop_at: float


def run_sweep(
    sweep: SweepConfig,
    out: str | Path,
    workers: int | None = None,
    executor: str | None = None,
    log: Callable[[str], object] = print,
    deadline: Deadline | None = None,
) -> dict[str, int]:
    """Run every run of `sweep` that has no result yet; returns the store's status counts. With a
    `deadline` (local executor only) runs not started by then stay pending."""
    check_options(sweep.slurm, executor or sweep.executor)  # before anything is written
    if (executor or sweep.executor) == "slurm":
        preflight(sweep.slurm, sweep.name)  # a request SLURM would accept and never start: refused, nothing written
    made = _made_by_this_call(Path(out))
    try:
        root = own_folder(out, "sweep")  # never a folder of the user's
        root.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(
            SweepDir(root).lock_file,
            wait=0,
            busy=lambda holder: f"another normlab sweep is running in {root} ({holder}); wait for it or stop it first",
        )
    except (OSError, sqlite3.Error) as err:
        raise _setup_failed(Path(out), made, err) from None
    try:
        try:
            store, specs = prepare(sweep, root)
            _reconcile(store, root)
        except (OSError, sqlite3.Error) as err:  # a full disk, a read-only mount: nothing of a new sweep is left
            lock.release()
            raise _setup_failed(root, made, err) from None
        ids = {s.run_id for s in specs}
        todo = [r["run_id"] for r in store.rows() if r["run_id"] in ids and r["status"] not in FINISHED]
        done = len(ids) - len(todo)
        log(f"{_label(sweep)}: {len(ids)} runs, {done} done, {len(todo)} to run -> {root}")
        kind = executor or sweep.executor
        if todo:
            if kind == "local":
                steps = {s.run_id: s.config.optim.steps for s in specs if s.run_id in todo}
                bar = SweepProgress(root, steps, sweep.name, log=log)
                try:
                    gpus = _gpu_plan([s for s in specs if s.run_id in todo], workers or sweep.workers, log)
                    _run_local(root, store, todo, workers or sweep.workers, log, bar, gpus, deadline)
                finally:
                    bar.close()
            else:
                run_cluster(root, store, todo, kind, sweep.slurm, sweep.name, log)
        counts = store.counts()
        shown = shown_counts(store.rows()) if counts.get("failed") else {k: v for k, v in counts.items() if v}
        log("{}: {}".format(_label(sweep), ", ".join(f"{v} {k}" for k, v in shown.items() if v)))
        return counts
    finally:
        lock.release()


# The worker's first lines, run before anything else is imported: from here on the kernel kills the
# worker when the coordinator dies (PR_SET_PDEATHSIG, Linux), and a worker whose coordinator died
# before that took effect exits at once. Importing normlab and torch takes seconds; a worker started
# just before a `kill -9` of the sweep would otherwise live on and race the restarted sweep.
_BOOT = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass  # not Linux: execute_run's watcher thread ends the worker within a second instead
if os.getppid() != parent:
    os._exit(3)
from normlab.experiments.execute import execute_run
execute_run(sys.argv[2], sys.argv[3], threads=int(sys.argv[4]), watch_parent=parent)
"""


def _spawn(
    root: Path, run_id: str, threads: int, gpu: int | None = None, cuda: bool = False
) -> subprocess.Popen | ForkedWorker:
    """A run's worker process: forked from the preloaded server for a CPU run (`normlab.experiments.workers`),
    a fresh interpreter for a run on CUDA (`cuda`; `gpu`: the device it is given, when there are several)."""
    if not cuda and workers_available():
        return ForkedWorker(root, run_id, threads, SweepDir(root).log_file(run_id))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else None
    with open(SweepDir(root).log_file(run_id), "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(os.getpid()), str(root), run_id, str(threads)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _gpu_plan(specs: list[RunSpec], requested: int | None, log) -> tuple[int, int] | None:  # noqa: ANN001
    """(workers, devices) for runs that train on CUDA: as many side by side as fit by memory on each device
    (normlab.train.memory), or None when the runs train on the CPU. Runs that differ only in what does
    not change their memory (learning rate, seed, ...) are planned once."""
    import torch

    from normlab.train.memory import GIB, plan_memory, plan_workers

    cfgs = [s.config for s in specs]
    if not cfgs or not torch.cuda.is_available() or not any(c.run.device in ("cuda", "auto") for c in cfgs):
        return None
    devices = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    shape = (
        "layout",
        "size",
        "model",
        "batch_size",
        "grad_accum",
        "seq_len",
        "precision",
        "activation_dtype",
        "activation_checkpointing",
        "loss_chunk",
        "vocab_size",
        "tokenizer",
        "optimizer",
        "fsdp",
    )
    keys = [repr([c.to_flat()[k] for k in shape]) for c in cfgs]
    plans: dict[str, int] = {}
    for key, c in zip(keys, cfgs):
        if key not in plans:
            plans[key] = plan_memory(c).total
    workers = plan_workers([plans[key] for key in keys], devices, requested, usable_cores())
    log(
        f"GPU memory plan: up to {max(plans.values()) / GIB:.1f} GiB per run, {len(devices)} device(s) of "
        f"{min(devices) / GIB:.0f} GiB -> {workers} run(s) side by side"
    )
    return workers, len(devices)


def _run_local(
    root: Path,
    store: SweepStore,
    todo: list[str],
    workers: int | None,
    log,  # noqa: ANN001
    bar: SweepProgress | None = None,
    gpus: tuple[int, int] | None = None,
    deadline: Deadline | None = None,
) -> None:
    """Run `todo` in worker processes: on the CPU one per core (torch threads split between them); on
    GPUs (`gpus` = (workers, devices) from the memory plan) each worker is given the device with the
    fewest runs in flight (CUDA_VISIBLE_DEVICES). `deadline`: see `Deadline`."""
    workers = gpus[0] if gpus is not None else max(1, min(workers or usable_cores(), len(todo)))
    threads = threads_per_worker(workers)
    device_of: dict[str, int] = {}
    SweepDir(root).logs_dir.mkdir(exist_ok=True)
    queue = list(todo)
    running: dict[str, subprocess.Popen | ForkedWorker] = {}
    total, finished = len(todo), 0
    try:
        while queue or running:
            if deadline is not None and queue and time.time() >= deadline.start_by:
                log(
                    f"time budget: {len(queue)} run(s) not started, left pending "
                    "(run the same command again to add them)"
                )
                queue.clear()
            if deadline is not None and running and time.time() >= deadline.stop_at:
                _stop_at_deadline(root, store, running, deadline, bar, log)
                if not any(p.poll() is not None for p in running.values()):
                    time.sleep(0.2)
                    continue
            while queue and len(running) < workers:
                rid = queue.pop(0)
                gpu = None
                if gpus is not None and gpus[1] > 1:
                    load = [sum(1 for r in running if device_of.get(r) == d) for d in range(gpus[1])]
                    gpu = device_of[rid] = load.index(min(load))
                running[rid] = _spawn(root, rid, threads, gpu, cuda=gpus is not None)
                if bar is not None:
                    bar.started(rid)
            time.sleep(0.2)
            if bar is not None:
                bar.poll()
            for rid, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[rid]
                finished += 1
                row = _reaped(root, store, rid, proc)
                if bar is not None:
                    bar.finished(rid, row)
                (bar.write if bar is not None else log)(f"[{finished}/{total}] {rid}: {describe(row)}")
    finally:  # Ctrl-C or an error here: the workers go too (a kill -9 is handled by PR_SET_PDEATHSIG)
        for proc in running.values():
            proc.kill()
            proc.wait()


def _stop_at_deadline(
    root: Path,
    store: SweepStore,
    running: dict[str, subprocess.Popen | ForkedWorker],
    deadline: Deadline,
    bar: SweepProgress | None,
    log,  # noqa: ANN001
) -> None:
    """The budget's end: each run still going is killed and recorded failed (the next run of the sweep continues
    it), except one training its last step or evaluating (within `CLOSING_GRACE_S`) or one that ended by itself."""
    for rid, proc in list(running.items()):
        steps, done = store.row(rid)["config"].optim.steps, last_step(SweepDir(root).run(rid).metrics_file)
        # metrics.jsonl gets the last step's row only after the closing evaluation: a run whose rows
        # reach its second-to-last step is training its last step or evaluating (Deadline)
        if done >= steps - 1 and time.time() < deadline.stop_at + CLOSING_GRACE_S and proc.poll() is None:
            continue
        if proc.poll() is not None:
            continue  # ended by itself: recorded below as any run
        proc.kill()
        proc.wait()
        # spawned by this sweep: stopped by the budget whether or not its worker had marked it running
        if store.row(rid)["status"] in ("running", "pending"):
            store.record(
                rid,
                {
                    "status": "failed",
                    "reason": f"{BUDGET_STOP} at step {done} of {steps}; the next run of this sweep continues it",
                },
            )
        if bar is not None:
            bar.finished(rid, store.row(rid))
        del running[rid]
        log(f"time budget: stopped {rid} at step {done} of {steps}")


def _reaped(root: Path, store: SweepStore, rid: str, proc: subprocess.Popen | ForkedWorker) -> dict[str, Any]:
    """The row of a worker that ended; one whose process died without recording (a signal, an OOM kill,
    os._exit) is recorded failed, naming how it ended and its log."""
    row = store.row(rid)
    if row["status"] == "running":
        code = proc.returncode
        why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        store.record(
            rid,
            {
                "status": "failed",
                "reason": f"worker process ended by {why} without a result; see {SweepDir(root).log_file(rid)}",
            },
        )
        row = store.row(rid)
    return row


def _label(sweep: SweepConfig) -> str:
    """ "sweep kim-lr"; an unnamed sweep (the default name) is just "sweep"."""
    return "sweep" if sweep.name == "sweep" else f"sweep {sweep.name}"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def _to_toml(data: dict[str, Any]) -> str:
    """TOML for a sweep dict (scalars, lists, and the base/base.model/grid/slurm tables).

    The standard library reads TOML but does not write it; this covers the sweep file's shapes.
    """
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    for table in ("base", "grid", "slurm"):
        items = data.get(table) or {}
        scalars = {k: v for k, v in items.items() if not isinstance(v, dict) and v is not None}
        lines += ["", f"[{table}]"] + [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in scalars.items()]
        for sub, inner in items.items():
            if isinstance(inner, dict):
                lines += ["", f"[{table}.{sub}]"] + [
                    f"{json.dumps(k)} = {_toml_value(v)}" for k, v in inner.items() if v is not None
                ]
    text = "\n".join(lines) + "\n"
    tomllib.loads(text)  # what we write must read back
    return text
