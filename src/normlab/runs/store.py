"""The sweep's result store: one SQLite file, one row per run with its config and outcome.

SQLite (standard library) because a sweep's workers write from separate processes, a killed sweep
must keep every row already written (each write is a committed transaction), and the result must be
queryable without normlab: `sqlite3 SWEEP/sweep.db "select * from runs"`.

Journal: WAL on a local disk (readers never wait for a writer). On a filesystem shared between
machines (NFS, Lustre, GPFS, ...; `normlab.io.shared_filesystem`) the rollback journal instead: WAL
keeps its index in shared memory, which other nodes cannot see (sqlite.org/wal.html, "WAL does not
work over a network filesystem"); the rollback journal relies on the filesystem's POSIX locks (NFSv4,
Lustre mounted with -o flock). A transaction that waits on another writer for `timeout` seconds
ends with one line naming the store (no raw sqlite error).

Readers (`summarize`, `report`) open the store read-only (`readonly=True`): on a read-only mount as
an immutable file, so a sweep on read-only storage is summarized into another folder.

The SLURM coordinator reads every row and the meta table in one transaction per poll (`snapshot`, a `StoreView`
with nothing parsed) and writes what it decided back in order (`apply`).

Row life cycle: `pending` (a scheduler's job id in `job` once submitted) -> `running` (attempts + 1)
-> `ok` | `stalled` | `diverged` | `failed`. Results are never re-run; `failed` and interrupted
`running` rows are re-run when the sweep is started again; a requeued job's row goes back to `pending`.
"""

from __future__ import annotations

import errno
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from normlab.config.train import TrainConfig
from normlab.errors import ConfigError
from normlab.io import shared_filesystem, writable
from normlab.runs.files import SWEEP_FILE, SWEEP_RUNS, RunDir, SweepDir, check_run_id
from normlab.runs.outcome import FINISHED, OUTCOME, STATUSES

# Columns added after the first release, with their SQL types: an older sweep.db gains them when opened.
ADDED_COLUMNS = {"max_activation": "real", "first_break": "text", "job": "text", "spike_score": "real"}


class Spec(Protocol):
    """A run of a sweep as the store keeps it (normlab.experiments.sweep.RunSpec)."""

    run_id: str
    index: int
    axes: dict[str, Any]
    config: TrainConfig


SCHEMA = """
create table if not exists runs (
    run_id text primary key,
    idx integer not null,          -- position in the grid expansion
    axes text not null,            -- JSON: the grid coordinates of this run
    config text not null,          -- JSON: the full TrainConfig, nested (TrainConfig.to_dict; older stores: flat)
    status text not null default 'pending',
    step integer,                  -- last step reached (the diverged or failed step when not ok)
    reason text,                   -- why it diverged or failed
    initial_loss real, final_loss real, final_val_loss real, diverged_step integer,
    loss_spikes integer, grad_spikes integer, megatron_spikes integer, wall_time_s real, tokens integer,
    max_activation real,           -- the largest finite |activation| the run's probes and forensics saw
    first_break text,              -- a diverged run: where its forward first broke (normlab.diagnostics.forensics)
    spike_score real,              -- OLMo-core's spike score (diagnostics.stability.spike_score); none: too short
    attempts integer not null default 0,
    worker text,                   -- host:pid or scheduler job id of the attempt that wrote the row
    job text,                      -- the scheduler job that holds the run, stored at submission (SLURM: 123_4)
    started_at real, finished_at real
);
create table if not exists meta (key text primary key, value text not null);
"""


@dataclass(frozen=True)
class StoreView:
    """The store as one transaction read it (`SweepStore.snapshot`): run id -> its row's columns as stored (`axes`
    and `config` left as JSON text, unparsed), in grid order, and the meta table's values. What the SLURM
    coordinator reads once per poll (`normlab.experiments.cluster`)."""

    rows: dict[str, dict[str, Any]]
    meta: dict[str, Any]


class SweepStore:
    """A thin wrapper over the SQLite file; every method is one short transaction."""

    timeout = 60.0  # seconds a transaction waits for another writer before it gives up with one line

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.tables: set[str] = set()
        if readonly:
            if not self.path.is_file():
                raise ConfigError(f"{self.path} does not exist; give a folder written by normlab sweep or compare")
            with self._connect() as db:
                self.tables = self._tables(db)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wal = not shared_filesystem(self.path.parent)
        with self._connect() as db:
            self._tables(db)
            db.executescript(SCHEMA)
            have = {row[1] for row in db.execute("pragma table_info(runs)")}
            for name, kind in ADDED_COLUMNS.items():
                if name not in have:
                    db.execute(f"alter table runs add column {name} {kind}")
        self.tables = {"runs", "meta"}

    def _tables(self, db: sqlite3.Connection) -> set[str]:
        """The store's tables; a SQLite file of someone else's (tables, none of them ours) is refused untouched."""
        tables = {r[0] for r in db.execute("select name from sqlite_master where type = 'table'")}
        if tables and "runs" not in tables:
            raise ConfigError(
                f"{self.path} is a SQLite file that is not a normlab sweep store (its tables: "
                f"{', '.join(sorted(tables)[:5])}); give a folder written by normlab sweep or compare"
            )
        return tables

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        if self.readonly:  # read-only storage: immutable (no lock, no -shm file to create)
            mode = "mode=ro" if writable(self.path.parent) else "immutable=1"
            db = sqlite3.connect(f"file:{quote(str(self.path.absolute()))}?{mode}", uri=True, timeout=self.timeout)
        else:
            db = sqlite3.connect(self.path, timeout=self.timeout)
        db.row_factory = sqlite3.Row
        try:
            if not self.readonly:
                db.execute(f"pragma journal_mode={'wal' if self.wal else 'delete'}")
            with db:  # commit on success, roll back on error
                yield db
        except sqlite3.DatabaseError as err:
            if self._disk_full(err):  # the disk, not the file: the command says so in one line (exit 2)
                raise OSError(errno.ENOSPC, f"{err} (sqlite)", str(self.path)) from None
            raise ConfigError(self._explain(err)) from None
        finally:
            db.close()

    def _disk_full(self, err: sqlite3.DatabaseError) -> bool:
        """Whether sqlite failed for want of space: SQLITE_FULL ("database or disk is full"), or an I/O error (a
        journal that could not be created) on a file system with less than `normlab.io.FULL` bytes free."""
        import shutil

        from normlab.io import FULL

        if "full" in str(err):
            return True
        try:
            return "I/O error" in str(err) and shutil.disk_usage(self.path.parent).free < FULL
        except OSError:
            return False

    def _explain(self, err: sqlite3.DatabaseError) -> str:
        """One line for what sqlite raised: busy, read-only, or a corrupt file and how to rebuild it."""
        text = str(err)
        folder = self.path.parent
        if "locked" in text or "busy" in text:
            return (
                f"{self.path} is locked by another writer (waited {self.timeout:g} s): a sweep or one of its runs "
                "holds it; wait for it to end, or stop it, then run this again"
            )
        if "readonly" in text or "read-only" in text:
            return f"{self.path} is on read-only storage; give --out DIR to write elsewhere"
        if "unable to open" in text:
            return f"{self.path} cannot be opened ({text}); check the folder's permissions"
        return (
            f"{self.path} is corrupt ({text}); nothing was changed. Move it aside (mv {self.path} "
            f"{self.path}.corrupt), then run `normlab summarize {folder}` or the same sweep command: the store "
            f"is rebuilt from {folder / SWEEP_FILE} and the run folders in {folder / SWEEP_RUNS}"
        )

    # --- metadata ---
    def get_meta(self, key: str) -> Any:
        if "meta" not in self.tables:
            return None
        with self._connect() as db:
            return self._meta(db, key)

    @staticmethod
    def _meta(db: sqlite3.Connection, key: str) -> Any:
        row = db.execute("select value from meta where key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row["value"])

    def set_meta(self, key: str, value: Any) -> None:
        with self._connect() as db:
            db.execute(
                "insert or replace into meta values (?, ?)", (key, json.dumps(value))
            )  # key order kept: the grid axes

    def add_meta_entry(self, key: str, name: str, value: Any) -> None:
        """Set `name` -> `value` in the mapping meta `key` holds (made when absent), read and written in one
        transaction (e.g. a SLURM submission announced, `normlab.experiments.submission`)."""
        with self._connect() as db:
            held = self._meta(db, key) or {}
            db.execute("insert or replace into meta values (?, ?)", (key, json.dumps({**held, name: value})))

    def drop_meta_entries(self, key: str, names: list[str]) -> None:
        """Remove `names` from the mapping meta `key` holds (written, empty, when absent), read and written in one
        transaction (e.g. announcements released or refused)."""
        with self._connect() as db:
            left = {name: value for name, value in (self._meta(db, key) or {}).items() if name not in names}
            db.execute("insert or replace into meta values (?, ?)", (key, json.dumps(left)))

    # --- rows ---
    def add(self, specs: Sequence[Spec]) -> int:
        """Insert runs not yet in the store; returns how many were new."""
        with self._connect() as db:
            before = db.total_changes
            db.executemany(
                "insert or ignore into runs (run_id, idx, axes, config) values (?, ?, ?, ?)",
                [
                    (s.run_id, s.index, json.dumps(s.axes), json.dumps(s.config.to_dict(), sort_keys=True))
                    for s in specs
                ],
            )
            return db.total_changes - before

    def rows(self, status: str | tuple[str, ...] | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
        """The rows (of one status or run), each with its axes as a dict and its config as a `TrainConfig`
        (a flat config of an older store read through `normlab.config.train.migrate`)."""
        if "runs" not in self.tables:  # a read-only 0-byte store: nothing recorded
            return []
        query, where = "select * from runs", []
        args: tuple[str, ...] = ()
        if status is not None:
            statuses = (status,) if isinstance(status, str) else status
            where.append(f"status in ({','.join('?' * len(statuses))})")
            args = tuple(statuses)
        if run_id is not None:
            where.append("run_id = ?")
            args += (run_id,)
        if where:
            query += " where " + " and ".join(where)
        with self._connect() as db:
            rows = [dict(r) for r in db.execute(query + " order by idx", args)]
        for r in rows:
            check_run_id(r["run_id"])
            try:
                r["axes"], r["config"] = json.loads(r["axes"]), json.loads(r["config"])
            except (TypeError, ValueError):
                r["axes"] = None
            if not isinstance(r["axes"], dict) or not isinstance(r["config"], dict) or r["status"] not in STATUSES:
                raise ConfigError(
                    f"{self.path}: run {r['run_id']} has an unreadable row (axes and config are JSON "
                    f"objects, status one of {', '.join(STATUSES)}); the store was edited or is not "
                    "normlab's"
                )
            r["config"] = TrainConfig.from_dict(r["config"], f"{self.path}: run {r['run_id']}")
        return rows

    def snapshot(self) -> StoreView:
        """Every row and the meta table in one transaction, nothing parsed but the meta values (a status outside
        `STATUSES` is refused as `rows` refuses it)."""
        if "runs" not in self.tables:
            return StoreView({}, {})
        with self._connect() as db:
            rows = {r["run_id"]: dict(r) for r in db.execute("select * from runs order by idx")}
            found = db.execute("select key, value from meta") if "meta" in self.tables else []
            meta = {r["key"]: json.loads(r["value"]) for r in found}
        for rid, r in rows.items():
            if r["status"] not in STATUSES:
                raise ConfigError(
                    f"{self.path}: run {rid} has an unreadable row (status one of {', '.join(STATUSES)}); the store "
                    "was edited or is not normlab's"
                )
        return StoreView(rows, meta)

    def apply(self, writes: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
        """The writes a reader of a `snapshot` decided on, in order: each (a method of this store's that writes,
        its arguments), e.g. ("pending_again", (run_id, reason)); each one transaction, as when called."""
        for name, args in writes:
            if name not in WRITES:
                raise ValueError(f"{name!r} is not a write of the store; give one of {', '.join(WRITES)}")
            getattr(self, name)(*args)

    def row(self, run_id: str) -> dict[str, Any]:
        found = self.rows(run_id=run_id)
        if not found:
            raise KeyError(f"run {run_id} is not in {self.path}")
        return found[0]

    def mark_running(self, run_id: str, worker: str) -> None:
        with self._connect() as db:
            db.execute(
                "update runs set status = 'running', attempts = attempts + 1, worker = ?, started_at = ?, "
                "finished_at = null, reason = null where run_id = ?",
                (worker, time.time(), run_id),
            )

    def set_job(self, run_ids: list[str], jobs: list[str], submitted: bool = True) -> None:
        """The scheduler's job ids, stored the moment they are submitted (a rerun re-attaches to them): an
        unfinished row is `pending` again (a failed or interrupted run submitted anew). `submitted=False`: a job
        found already holding the run (re-attached), whose row is left as that job wrote it."""
        guard = ", ".join(repr(s) for s in FINISHED)
        started = "status = 'running' and worker = :job"  # the new job already marked it (it started that fast)
        sets = (
            f"status = case when {started} then status else 'pending' end, "
            f"reason = case when {started} then reason else null end, "
            if submitted
            else ""
        )
        with self._connect() as db:
            db.executemany(
                f"update runs set {sets}job = :job where run_id = :run_id and status not in ({guard})",
                [{"job": job, "run_id": rid} for rid, job in zip(run_ids, jobs)],
            )

    def trained_by(self, run_id: str, job: str) -> None:
        """A finished run's row names the job that trained it (its `worker`) as its job, where it named another job
        of the sweep: one submitted again for the run while a job whose id was lost still pended, which then started
        first, trained the run to its end and left the new one nothing to do."""
        guard = ", ".join(repr(s) for s in FINISHED)
        with self._connect() as db:
            db.execute(
                f"update runs set job = :job where run_id = :run_id and worker = :job and status in ({guard})",
                {"job": job, "run_id": run_id},
            )

    def requeued(self, run_id: str, reason: str, step: int | None = None) -> None:
        """A job that saved its run and went back to the scheduler's queue: pending again, the reason and the step
        it saved at kept (a job that then is not requeued, its time limits used up, says where to continue)."""
        with self._connect() as db:
            db.execute(
                "update runs set status = 'pending', reason = ?, step = coalesce(?, step) where run_id = ? and "
                "status = 'running'",
                (reason, step, run_id),
            )

    def pending_again(self, run_id: str, reason: str) -> None:
        """A run whose job ended without a result and is submitted again: pending, the reason kept, no job."""
        guard = ", ".join(repr(s) for s in FINISHED)
        with self._connect() as db:
            db.execute(
                f"update runs set status = 'pending', reason = ?, job = null where run_id = ? and status not in "
                f"({guard})",
                (reason, run_id),
            )

    def record(
        self, run_id: str, summary: dict[str, Any], worker: str | None = None, unless_finished: bool = False
    ) -> bool:
        """Store a run's outcome from its summary.json (or a failure dict with status and reason), and the
        worker that wrote it; `unless_finished`: leave a row that already holds a result as it is. Returns
        whether the row was written."""
        status = summary.get("status", "failed")
        if status not in (*FINISHED, "failed"):
            status = "failed"
        step = summary.get("failed_step", summary.get("diverged_step") or summary.get("steps"))
        values = {k: summary.get(k) for k in OUTCOME}
        sets = ", ".join(f"{k} = :{k}" for k in values)
        guard = f" and status not in ({', '.join(repr(s) for s in FINISHED)})" if unless_finished else ""
        with self._connect() as db:
            cur = db.execute(
                f"update runs set status = :status, step = :step, reason = :reason, {sets}, "
                "worker = coalesce(:worker, worker), finished_at = :now where run_id = :run_id" + guard,
                {
                    **values,
                    "status": status,
                    "step": step,
                    "reason": summary.get("reason"),
                    "worker": worker,
                    "now": time.time(),
                    "run_id": run_id,
                },
            )
            return cur.rowcount > 0

    def counts(self) -> dict[str, int]:
        found = {}
        if "runs" in self.tables:
            with self._connect() as db:
                found = dict(db.execute("select status, count(*) from runs group by status").fetchall())
        return {s: found.get(s, 0) for s in STATUSES}


# what `apply` may call
WRITES = (
    "set_meta",
    "drop_meta_entries",
    "set_job",
    "trained_by",
    "pending_again",
    "record",
    "requeued",
    "mark_running",
)


def open_store(folder: SweepDir, readonly: bool = False) -> SweepStore:
    """The store of a sweep folder (readers: `readonly=True`)."""
    return SweepStore(folder.store_file, readonly=readonly)


def logged_runs(folder: SweepDir) -> list[RunDir]:
    """The runs of a sweep's store that logged a step, in grid order (a ConfigError if none has yet)."""
    if not folder.is_sweep():
        raise ConfigError(
            f"{folder.path} holds no {folder.store_file.name}; give a folder written by normlab sweep or compare"
        )
    found = [folder.run(row["run_id"]) for row in open_store(folder, readonly=True).rows()]
    logged = [r for r in found if r.has_metrics()]
    if not logged:
        raise ConfigError(f"sweep {folder.path} has no run that logged a step yet")
    return logged
