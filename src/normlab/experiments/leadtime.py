"""The lead-time study (issue 55 item 4): how many steps before a run diverges each early-warning signal
fires, and how often it fires on runs that stay healthy (`normlab leadtime SWEEP...`).

Each run of the sweeps given is replayed through the early warnings (`normlab.diagnostics.early_warning.
replay`: the same detectors the live alerts use, over its metrics.jsonl and layers.jsonl, in the precision
it stored). A run is

- *faulted* where its ``run.fault`` is not "none" (`normlab.train.faults`); a stress setting (fp16 storage
  at a learning rate Pre-LN cannot hold, Muon without QK-clip) is a fault of its own where the run diverges;
- an *event* where it diverged (its summary's diverged_step) or, faulted and not diverged, where its loss
  went past the run's initial loss after the fault (the event a warning should come before);
- *healthy* where it had no event and trained to the end without stalling: a warning there is a false alarm.

Per signal and placement: of the events, how many the signal warned of strictly before they happened
(detected) and the lead time, event step minus the signal's first warning step (median and range); false
alarms: healthy runs on which the signal fired at all, and faulted runs on which it fired before the fault
(counted over both). A warning at or after the event is no warning (late).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.diagnostics.early_warning import DETECTORS, PRECISIONS, EarlyWarnings, replayed
from normlab.runs.files import SweepDir
from normlab.runs.store import open_store


@dataclass
class RunOutcome:
    """One run: its placement, whether faulted, its event step (None: none) and each signal's first warning."""

    run_id: str
    layout: str
    fault: str
    faulted: bool
    event: int | None
    event_kind: str
    status: str = "ok"
    fault_step: int = 0
    warnings: dict[str, int] = field(default_factory=dict)
    skipped_rows: int = 0  # rows of its metrics.jsonl the detectors could not read (hand-edited), skipped

    @property
    def healthy(self) -> bool:
        """No fault injected, no event, trained to the end: a warning here is a false alarm."""
        return not self.faulted and self.event is None and self.status == "ok"


def _event(run: SweepDir, rid: str, summary: dict[str, Any], fault_step: int, faulted: bool) -> tuple[int | None, str]:
    """The step of the run's event (module doc) and its kind."""
    diverged = summary.get("diverged_step")
    if summary.get("status") == "diverged" and isinstance(diverged, int) and not isinstance(diverged, bool):
        return diverged, "diverged"
    if not faulted:
        return None, ""
    initial = summary.get("initial_loss")
    for m in run.run(rid).metrics():
        loss = m.get("loss")
        step = m.get("step")
        if (
            isinstance(step, int)
            and not isinstance(step, bool)
            and step >= fault_step
            and isinstance(loss, (int, float))
            and isinstance(initial, (int, float))
            and (not math.isfinite(loss) or loss > initial)
        ):
            return step, "loss past its initial value"
    return None, ""


def replayed_run(run: Path) -> EarlyWarnings:
    """The early warnings over a run folder's files in the precision its summary.json records (fp32 where it
    names none the detectors know), with the count of rows they could not read."""
    from normlab.runs.files import RunDir

    stored = (RunDir(run).summary() or {}).get("activation_dtype")
    return replayed(run, stored if stored in PRECISIONS else "fp32")


def _store_rows(folder: SweepDir) -> list[dict[str, Any]]:
    """The store's rows; a lost store (0 bytes, moved aside) with run folders is rebuilt from them first, as
    `normlab summarize` does (refused in one line where the folder is read-only)."""
    from normlab.errors import ConfigError
    from normlab.experiments.runner import rebuild_store
    from normlab.io import writable

    rows = open_store(folder, readonly=True).rows() if folder.is_sweep() else []
    if not rows and folder.run_folders():
        if not writable(folder.path):
            raise ConfigError(
                f"{folder.store_file} holds no runs but {folder.path} holds run folders, and the folder is read-only, "
                "so the store cannot be rebuilt there; copy the sweep folder somewhere writable"
            )
        rebuild_store(folder.path)
        rows = open_store(folder, readonly=True).rows()
    return rows


def outcomes(sweep: str | Path) -> list[RunOutcome]:
    """Every finished run of a sweep folder as a `RunOutcome`."""
    folder = SweepDir(Path(sweep))
    out = []
    for row in _store_rows(folder):
        if row["status"] not in ("ok", "stalled", "diverged"):
            continue
        cfg, rid = row["config"], row["run_id"]
        summary = folder.run(rid).summary() or {}
        fault = cfg.faults.fault
        faulted = fault != "none"
        event, kind = _event(folder, rid, summary, cfg.faults.fault_step, faulted)
        warn = replayed_run(folder.run(rid).path)
        alerts = warn.alerts
        out.append(
            RunOutcome(
                rid,
                str(row["axes"].get("layout", cfg.model.layout)),
                fault,
                faulted,
                event,
                kind,
                row["status"],
                cfg.faults.fault_step if faulted else 0,
                {a.signal: a.step for a in alerts},
                warn.skipped_rows,
            )
        )
    return out


def table(runs: list[RunOutcome]) -> list[dict[str, Any]]:
    """Per signal and placement: events detected before they happened, lead times, false alarms."""
    rows = []
    for layout in sorted({r.layout for r in runs}):
        mine = [r for r in runs if r.layout == layout]
        events = [r for r in mine if r.event is not None]
        healthy = [r for r in mine if r.healthy]
        for signal in DETECTORS:
            # a warning counts when it came strictly before the event and, on a faulted run, at or after the
            # fault (before it the fault cannot have caused it: a false alarm)
            leads = [
                r.event - r.warnings[signal]
                for r in events
                if r.event is not None and signal in r.warnings and r.fault_step <= r.warnings[signal] < r.event
            ]
            early = [r for r in mine if r.faulted and signal in r.warnings and r.warnings[signal] < r.fault_step]
            alarms = [r for r in healthy if signal in r.warnings] + early
            rows.append(
                {
                    "layout": layout,
                    "signal": signal,
                    "events": len(events),
                    "detected": len(leads),
                    "lead_median": statistics.median(leads) if leads else None,
                    "lead_min": min(leads) if leads else None,
                    "lead_max": max(leads) if leads else None,
                    "healthy": len(healthy) + len([r for r in mine if r.faulted]),
                    "false_alarms": len(alarms),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], runs: list[RunOutcome]) -> str:
    """The lead-time table as markdown, with how many runs and events stand behind it."""
    faults = sorted({r.fault for r in runs if r.faulted})
    lines = [
        f"{len(runs)} runs ({sum(r.faulted for r in runs)} faulted: {', '.join(faults) or 'none'}; "
        f"{sum(r.healthy for r in runs)} healthy), {sum(r.event is not None for r in runs)} events",
        "",
        "| layout | signal | detected before the event | lead, steps (median; min-max) | false alarms |",
        "|---|---|---|---|---|",
    ]
    skipped = [(r.run_id, r.skipped_rows) for r in runs if r.skipped_rows]
    if skipped:
        lines[1:1] = [
            "",
            f"skipped {sum(n for _, n in skipped)} unreadable row(s) of metrics.jsonl in "
            + ", ".join(f"{rid} ({n})" for rid, n in skipped)
            + " (a step that is not a whole number above the last, a loss that is not a number)",
        ]
    for r in rows:
        lead = "-" if r["lead_median"] is None else f"{r['lead_median']:g} ({r['lead_min']}-{r['lead_max']})"
        lines.append(
            f"| {r['layout']} | {r['signal']} | {r['detected']}/{r['events']} | {lead} | "
            f"{r['false_alarms']}/{r['healthy']} |"
        )
    return "\n".join(lines) + "\n"


WRITTEN_BY = "normlab leadtime"  # the --json file's mark: the one existing file leadtime writes over


def wrote(path: str | Path, mark: str = WRITTEN_BY) -> bool:
    """Whether ``path`` is a regular JSON file carrying ``mark`` as its ``written_by`` (by default an earlier
    `normlab leadtime --json`'s; `leadtime_study.wrote_record` asks for --record's), which the same command may
    write again; any other existing file is refused (`normlab.experiments.commands.check_new_file`)."""
    p = Path(path)
    if p.is_symlink() or not p.is_file() or p.stat().st_size > 64 * 2**20:
        return False
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == mark


def report(sweeps: list[str], json_out: str | None = None) -> str:
    """`normlab leadtime`: the table over every run of `sweeps`; `json_out`: also the rows and runs as JSON."""
    runs = [r for s in sweeps for r in outcomes(s)]
    rows = table(runs)
    if json_out:  # a new file in an existing folder (normlab.experiments.commands.check_new_file), whole or not at all
        from normlab.io import atomic_write_bytes

        data = {"written_by": WRITTEN_BY, "sweeps": sweeps, "rows": rows, "runs": [r.__dict__ for r in runs]}
        atomic_write_bytes(json_out, (json.dumps(data, indent=1) + "\n").encode())
    return markdown(rows, runs)


__all__ = ["RunOutcome", "markdown", "outcomes", "report", "table"]
