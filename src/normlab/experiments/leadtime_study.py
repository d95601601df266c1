"""`normlab leadtime`'s threshold study (issue 66): every run of the sweeps replayed through the early warnings
at each threshold of each detector's grid (`normlab.diagnostics.warning_record.THRESHOLDS`), the table per
detector and failure kind with intervals (`normlab.experiments.leadtime_stats`: the definitions), each
detector's precision-recall curve with the threshold chosen from it, the record live alerts quote
(``--record``) and the figure (``--figure``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from normlab.diagnostics.early_warning import PRECISIONS, replay_rows, run_rows
from normlab.diagnostics.warning_record import THRESHOLDS
from normlab.experiments import leadtime
from normlab.experiments.leadtime_stats import Replayed, choose, pr_curve, table

WRITTEN_BY = "normlab leadtime --record"


def _grid_thresholds(k: int) -> dict[str, float]:
    """Every detector at position k of its grid (its last where the grid is shorter)."""
    return {s: t.grid[min(k, len(t.grid) - 1)] for s, t in THRESHOLDS.items()}


def replay_run(rid: str, path: Path, kind: str, seed: int, event: int | None, fault_step: int) -> Replayed:
    """One run folder replayed at each grid position (its rows read once)."""
    from normlab.runs.files import RunDir

    summary = RunDir(path).summary() or {}
    stored = summary.get("activation_dtype")
    precision = stored if stored in PRECISIONS else "fp32"
    rows = run_rows(path)
    steps = [m["step"] for m in rows[0] if isinstance(m.get("step"), int) and "loss" in m]
    out = Replayed(rid, kind, seed, (max(steps) + 1) if steps else 0, event, fault_step)
    width = max(len(t.grid) for t in THRESHOLDS.values())
    firsts = []
    for k in range(width):
        alerts = replay_rows(rows, precision, thresholds=_grid_thresholds(k)).alerts
        firsts.append({a.signal: a.step for a in alerts})
    for s, t in THRESHOLDS.items():
        out.warnings[s] = [firsts[k].get(s) for k in range(len(t.grid))]
        out.default[s] = out.warnings[s][t.grid.index(t.default)]
    return out


def gather(sweep: str | Path) -> list[Replayed]:
    """Every finished run of a sweep folder, its kind the sweep's name (`sweep_name`; the events are
    `normlab.experiments.leadtime`'s)."""
    from normlab.experiments.leadtime import _event, _store_rows
    from normlab.runs.files import SweepDir

    folder = SweepDir(Path(sweep))
    kind = sweep_name(folder.path)
    out = []
    for row in _store_rows(folder):
        if row["status"] not in ("ok", "stalled", "diverged"):
            continue
        cfg, rid = row["config"], row["run_id"]
        faulted = cfg.faults.fault != "none"
        event, _ = _event(folder, rid, folder.run(rid).summary() or {}, cfg.faults.fault_step, faulted)
        fault_step = cfg.faults.fault_step if faulted else 0
        out.append(replay_run(rid, folder.run(rid).path, kind, cfg.optim.seed, event, fault_step))
    return out


def sweep_name(folder: Path) -> str:
    """The sweep's name (its sweep.toml's ``name``: one recipe, one failure kind, whichever folders its seeds
    ran in), or the folder's name where it names none."""
    import tomllib

    from normlab.runs.files import SWEEP_FILE

    try:
        name = tomllib.loads((folder / SWEEP_FILE).read_text()).get("name")
    except (OSError, ValueError):
        name = None
    return name if isinstance(name, str) and name else folder.name


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ci(ci: Any, pct: bool = False, digits: int = 0) -> str:
    if not ci:
        return ""
    lo, hi = ci
    return f" [{100 * lo:.0f}-{100 * hi:.0f}]" if pct else f" [{lo:.{digits}f}-{hi:.{digits}f}]"


def markdown(runs: list[Replayed], horizon: int) -> str:
    """The study's table per detector and kind at the default thresholds, then each detector's curve."""
    kinds = sorted({r.kind for r in runs})
    seeds = sorted({r.seed for r in runs})
    late = [r for r in runs if r.event is not None and r.event > 1000]
    lines = [
        f"{len(runs)} runs over {len(seeds)} seed(s) in {len(kinds)} kind(s) ({', '.join(kinds)}); "
        f"{sum(r.event is not None for r in runs)} events ({len(late)} after step 1,000), "
        f"{sum(r.event is None for r in runs)} runs without one. A warning counts when an event follows it "
        f"within {horizon:,} steps; 95% intervals: Wilson (recall, precision), exact Poisson (false alarms), "
        "bootstrap over seeds (median lead).",
        "",
        "| detector (default) | kind | recall | precision | false alarms / 1k healthy steps | lead, steps: median "
        "[CI] (min-max) | lead, share of run |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in table(runs, horizon):
        lead = (
            "-"
            if m["lead_median"] is None
            else f"{m['lead_median']:,.0f}{_ci(m['lead_ci'])} ({m['lead_min']:,.0f}-{m['lead_max']:,.0f})"
        )
        rate = "-" if m["alarms_per_1k"] is None else f"{m['alarms_per_1k']:.2f}{_ci(m['alarms_ci'], digits=2)}"
        lines.append(
            f"| {m['signal']} ({m['threshold']:g}) | {m['kind']} | {m['warned']}/{m['events']} "
            f"{_pct(m['recall'])}{_ci(m['recall_ci'], True)} | {m['preceded']}/{m['warnings']} "
            f"{_pct(m['precision'])}{_ci(m['precision_ci'], True)} | {rate} | {lead} | {_pct(m['lead_share_median'])} |"
        )
    lines += ["", "Precision-recall over each detector's threshold (all kinds; chosen: largest F1, ties stricter):", ""]
    for signal, t in THRESHOLDS.items():
        curve = pr_curve(runs, signal, horizon)
        pts = ", ".join(
            f"{m['threshold']:g}: P {_pct(m['precision'])} R {_pct(m['recall'])} ({m['warnings']} warnings)"
            for m in curve
        )
        lines.append(f"- {signal} ({t.meaning}): {pts}; chosen {choose(curve, signal):g} (default {t.default:g})")
    return "\n".join(lines) + "\n"


def record(runs: list[Replayed], horizon: int, sweeps: list[str]) -> dict[str, Any]:
    """The record live alerts quote (`normlab.diagnostics.warning_record`): per detector over all kinds at its
    default threshold, and the threshold its curve chose."""
    kinds = sorted({r.kind for r in runs})
    dets = {}
    for signal, t in THRESHOLDS.items():
        from normlab.experiments.leadtime_stats import measure

        m = measure(runs, [r.default[signal] for r in runs], horizon)
        dets[signal] = {
            "threshold": t.default,
            "warnings": m["warnings"],
            "preceded": m["preceded"],
            "events": m["events"],
            "warned": m["warned"],
            "horizon": horizon,
            "lead_median": m["lead_median"],
            "alarms_per_1k": m["alarms_per_1k"],
            "chosen": choose(pr_curve(runs, signal, horizon), signal),
        }
    seeds = len({r.seed for r in runs})
    return {
        "written_by": WRITTEN_BY,
        "about": f"{', '.join(kinds)}: {len(runs)} runs, {seeds} seeds",
        "sweeps": [Path(s).name for s in sweeps],
        "detectors": dets,
    }


def figure(runs: list[Replayed], horizon: int, out: str) -> None:
    """PR curves (one line per detector over its grid) and the lead-time distribution at the defaults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    leads: list[list[float]] = []
    names: list[str] = []
    for signal in THRESHOLDS:
        curve = pr_curve(runs, signal, horizon)
        pts = [(m["recall"] or 0.0, m["precision"]) for m in curve if m["precision"] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=signal)
        d = [_lead(r.event, r.default[signal]) for r in runs]
        leads.append([float(x) for x in d if x is not None and 0 < x <= horizon])
        names.append(signal)
    ax.set(xlabel="recall (events warned)", ylabel=f"precision (event within {horizon} steps)", xlim=(0, 1.02))
    ax.set_ylim(0, 1.02)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title("precision-recall over each detector's threshold")
    bx.boxplot([x or [float("nan")] for x in leads], orientation="horizontal")
    bx.set_yticks(range(1, len(names) + 1), names, fontsize=8)
    bx.set(xlabel="lead, steps before the event (default thresholds)")
    bx.set_title(f"{len(runs)} runs, {sum(r.event is not None for r in runs)} events")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _lead(event: int | None, warned: int | None) -> int | None:
    return None if event is None or warned is None else event - warned


def write_record(data: dict[str, Any], out: str) -> None:
    from normlab.io import atomic_write_bytes

    atomic_write_bytes(out, (json.dumps(data, indent=1) + "\n").encode())


def wrote_record(path: str | Path) -> bool:
    """Whether ``path`` is a record an earlier ``--record`` wrote (the one existing file it writes over)."""
    return leadtime.wrote(path, WRITTEN_BY)


__all__ = ["figure", "gather", "markdown", "record", "replay_run", "write_record", "wrote_record"]
