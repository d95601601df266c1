"""The sweep's result store: one SQLite file, one row per run with its config and outcome.

SQLite (standard library) because a sweep's workers write from separate processes, a killed sweep
must keep every row already written (each write is a committed transaction, WAL journal), and the
result must be queryable without normlab: `sqlite3 SWEEP/sweep.db "select * from runs"`.

Row life cycle: `pending` -> `running` (attempts + 1) -> `ok` | `diverged` | `failed`. `ok` and
`diverged` are results and are never re-run; `failed` and interrupted `running` rows are re-run when
the sweep is started again.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from normlab.errors import ConfigError
from normlab.runs.files import check_run_id
from normlab.runs.outcome import FINISHED, OUTCOME, STATUSES

# Columns added after the first release, with their SQL types: an older sweep.db gains them when opened.
ADDED_COLUMNS = {"max_activation": "real", "first_break": "text"}


class Spec(Protocol):
    """A run of a sweep as the store keeps it (normlab.experiments.sweep.RunSpec)."""

    run_id: str
    index: int
    axes: dict[str, Any]
    config: dict[str, Any]


SCHEMA = """
create table if not exists runs (
    run_id text primary key,
    idx integer not null,          -- position in the grid expansion
    axes text not null,            -- JSON: the grid coordinates of this run
    config text not null,          -- JSON: the full TrainConfig (without out)
    status text not null default 'pending',
    step integer,                  -- last step reached (the diverged or failed step when not ok)
    reason text,                   -- why it diverged or failed
    initial_loss real, final_loss real, final_val_loss real, diverged_step integer,
    loss_spikes integer, grad_spikes integer, megatron_spikes integer, wall_time_s real, tokens integer,
    max_activation real,           -- the largest finite |activation| the run's probes and forensics saw
    first_break text,              -- a diverged run: where its forward first broke (normlab.diagnostics.forensics)
    attempts integer not null default 0,
    worker text,                   -- host:pid or scheduler job id of the last attempt
    started_at real, finished_at real
);
create table if not exists meta (key text primary key, value text not null);
"""


class SweepStore:
    """A thin wrapper over the SQLite file; every method is one short transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)
            have = {row[1] for row in db.execute("pragma table_info(runs)")}
            for name, kind in ADDED_COLUMNS.items():
                if name not in have:
                    db.execute(f"alter table runs add column {name} {kind}")

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=60)
        db.row_factory = sqlite3.Row
        try:
            db.execute("pragma journal_mode=wal")
            with db:  # commit on success, roll back on error
                yield db
        except sqlite3.DatabaseError as err:
            if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):
                raise
            raise ConfigError(f"{self.path} is not a normlab sweep store ({err}); give a folder written by "
                              "normlab sweep or compare") from None
        finally:
            db.close()

    # --- metadata ---
    def get_meta(self, key: str) -> Any:
        with self._connect() as db:
            row = db.execute("select value from meta where key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row["value"])

    def set_meta(self, key: str, value: Any) -> None:
        with self._connect() as db:
            db.execute("insert or replace into meta values (?, ?)", (key, json.dumps(value)))  # key order kept: the grid axes

    # --- rows ---
    def add(self, specs: list[Spec]) -> int:
        """Insert runs not yet in the store; returns how many were new."""
        with self._connect() as db:
            before = db.total_changes
            db.executemany(
                "insert or ignore into runs (run_id, idx, axes, config) values (?, ?, ?, ?)",
                [(s.run_id, s.index, json.dumps(s.axes), json.dumps(s.config, sort_keys=True)) for s in specs],
            )
            return db.total_changes - before

    def rows(self, status: str | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        query, args = "select * from runs", ()
        if status is not None:
            statuses = (status,) if isinstance(status, str) else status
            query += f" where status in ({','.join('?' * len(statuses))})"
            args = statuses
        with self._connect() as db:
            rows = [dict(r) for r in db.execute(query + " order by idx", args)]
        for r in rows:
            check_run_id(r["run_id"])
            try:
                r["axes"], r["config"] = json.loads(r["axes"]), json.loads(r["config"])
            except (TypeError, ValueError):
                r["axes"] = None
            if not isinstance(r["axes"], dict) or not isinstance(r["config"], dict) or r["status"] not in STATUSES:
                raise ConfigError(f"{self.path}: run {r['run_id']} has an unreadable row (axes and config are JSON "
                                  f"objects, status one of {', '.join(STATUSES)}); the store was edited or is not "
                                  "normlab's")
        return rows

    def row(self, run_id: str) -> dict[str, Any]:
        found = [r for r in self.rows() if r["run_id"] == run_id]
        if not found:
            raise KeyError(f"run {run_id} is not in {self.path}")
        return found[0]

    def mark_running(self, run_id: str, worker: str) -> None:
        with self._connect() as db:
            db.execute("update runs set status = 'running', attempts = attempts + 1, worker = ?, started_at = ?, "
                       "finished_at = null, reason = null where run_id = ?", (worker, time.time(), run_id))

    def record(self, run_id: str, summary: dict[str, Any]) -> None:
        """Store a run's outcome from its summary.json (or a failure dict with status and reason)."""
        status = summary.get("status", "failed")
        if status not in (*FINISHED, "failed"):
            status = "failed"
        step = summary.get("failed_step", summary.get("diverged_step") or summary.get("steps"))
        values = {k: summary.get(k) for k in OUTCOME}
        sets = ", ".join(f"{k} = :{k}" for k in values)
        with self._connect() as db:
            db.execute(f"update runs set status = :status, step = :step, reason = :reason, {sets}, "
                       "finished_at = :now where run_id = :run_id",
                       {**values, "status": status, "step": step, "reason": summary.get("reason"),
                        "now": time.time(), "run_id": run_id})

    def counts(self) -> dict[str, int]:
        with self._connect() as db:
            found = dict(db.execute("select status, count(*) from runs group by status").fetchall())
        return {s: found.get(s, 0) for s in STATUSES}
