"""`normlab report RUN_DIR...`: the papers' figures for your runs, as PNGs and one HTML page.

The page opens with a reading of the runs (who diverged where, whose activations passed the FP16
limit), a summary table, evaluation and Kim Prop. 3.1 tables where the runs have them, then every
figure of `normlab.diagnostics.figures.FIGURES` the runs have data for. It is one self-contained
file (`normlab.pages`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from normlab.diagnostics.figures import FIGURES
from normlab.diagnostics.probe_store import Run, load_run
from normlab.diagnostics.stats import FP16_MAX
from normlab.io import own_folder
from normlab.pages import figure_html, table_html, write_page
from normlab.runs.evals import headline_scores
from normlab.runs.metrics import ProbeMetric


def _names(runs: list[Run]) -> list[str]:
    """Each run's layout name; where two runs share one, the shortest tail of their paths that tells them apart."""
    names = [r.name for r in runs]
    out = []
    for n, r in zip(names, runs):
        if names.count(n) == 1:
            out.append(n)
            continue
        twins = [o.path.parts for m, o in zip(names, runs) if m == n and o is not r]
        parts = r.path.parts
        k = next((k for k in range(1, len(parts) + 1) if all(t[-k:] != parts[-k:] for t in twins)), len(parts))
        tail = "/".join(parts[-k:])
        out.append(n if tail == n else f"{n} ({tail})")
    return out


def _layout(run: Run) -> str:
    """The run's layout string (a normlab run's config.json), or the label its summary or monitor recorded."""
    cfg = run.config.get("config") or {}  # a run's TrainConfig (nested) or a monitor's record (flat)
    return (
        run.config.get("layout")
        or run.summary.layout
        or cfg.get("layout")
        or (cfg.get("model") or {}).get("layout")
        or ""
    )


def _steps(run: Run) -> int | None:
    """Optimizer steps logged: the summary's count, else (a TrainingMonitor folder) the metrics' rows."""
    return run.summary.steps if run.summary.steps is not None else (len(run.metrics) or None)


def _status(run: Run) -> str:
    s = run.summary
    status = s.status or ("unfinished" if not s.keys else "?")
    return f"diverged at step {s.diverged_step}" if status == "diverged" and s.diverged_step is not None else status


def _global(run: Run, metric: str) -> dict[int, float]:
    """A model-level probe (the residual stream's top-100 band, max/median, ...) by step."""
    p = run.probes
    at = p[(p.site == "global") & (p.metric == metric)] if len(p) else p
    return {int(st): float(v) for st, v in zip(at.step, at.value)} if len(at) else {}


def activation_facts(run: Run) -> dict[str, Any]:
    """The largest activation of a run against the FP16 limit, as the summary table shows it: the run's
    largest |x| (its summary's, or the probes' for a monitor folder), and the headroom 65504 / max |x|;
    a run whose activations overflowed (the forensic re-run found an overflow, or a probe was not finite)
    says so, with the last finite probe's max instead of a headroom."""
    s = run.summary
    tops = _global(run, ProbeMetric.MAX_ABS)
    finite = {st: v for st, v in tops.items() if math.isfinite(v)}
    largest = s.max_activation
    if not isinstance(largest, (int, float)) and finite:
        largest = max(finite.values())
    brk = s.forensics
    broken = [st for st, v in tops.items() if not math.isfinite(v)]
    last = max(finite) if finite else None
    before = f"; last finite max {finite[last]:.4g} (step {last})" if last is not None else ""
    headroom: str | float | None  # where it overflowed, or 65504 / max |x|
    if brk is not None and brk.overflowed:
        headroom = f"overflowed (step {brk.step}){before}"
    elif broken:
        headroom = f"non-finite (step {min(broken)}){before}"
    elif isinstance(largest, (int, float)) and largest > 0:
        headroom = FP16_MAX / largest
    else:
        headroom = None
    ratio = _global(run, ProbeMetric.MAX_MEDIAN_RATIO)
    ratio = {st: v for st, v in ratio.items() if math.isfinite(v)}
    return {"max |x| in run": largest, "FP16 headroom": headroom, "max/median": ratio[max(ratio)] if ratio else None}


def summary_rows(runs: list[Run], names: list[str]) -> list[dict[str, Any]]:
    """One row per run, from its summary (status, steps, losses, spikes, first break) and its probes where the
    summary has no entry (a TrainingMonitor folder); the columns are explained under the table."""
    rows = []
    for run, name in zip(runs, names):
        s, x = run.summary, run.summary.extra
        rows.append(
            {
                "run": name,
                "layout": _layout(run),
                "status": _status(run),
                "steps": _steps(run),
                "final loss": s.final_loss,
                "val loss": s.final_val_loss,
                "activations": s.activation_dtype or "-",
                **activation_facts(run),
                "spikes (loss/grad)": f"{x.get('loss_spikes', x.get('spikes', 0))}/{x.get('grad_spikes', 0)}",
                "spike score": x.get("spike_score"),  # the monitor's keys: kept as written (RunSummary.extra)
                "first break": s.first_break or "-",
                **headline_scores(run.evals),
            }
        )
    keys = list(dict.fromkeys(k for r in rows for k in r))  # runs evaluated on different tasks: one column set
    return [{k: r.get(k) for k in keys} for r in rows]


SUMMARY_NOTE = (
    "final loss: the mean of the last 10 finite training losses (a diverged run's, before it broke; a "
    "TrainingMonitor folder's: its last loss); "
    "max |x| in run: the largest finite |activation| the probes (and a diverged run's forensic re-run) saw; "
    "FP16 headroom: 65504 / max |x|, or where the activations overflowed, the last finite probe's max; "
    "max/median: the residual stream's largest |activation| over its median at the last finite probe; "
    "spike score: OLMo-core's, the share of steps whose loss or gradient norm rose 6 sigma above the mean of the "
    "previous 128 (- for a run shorter than 128 steps)."
)


def _last_layer_variance(runs: list[Run]) -> tuple[int, list[float]] | None:
    """The last layer's hidden-state variance of every run at the latest probe step where all runs'
    streams were finite (Kim Figs. 1, 6 compare layouts at one step): (step, variances)."""
    tabs = [r.probe("stream", ProbeMetric.VAR) for r in runs]
    if any(t.empty for t in tabs):
        return None
    finite = [{int(st) for st in t.index if np.all(np.isfinite(t.loc[st].to_numpy(dtype=float)))} for t in tabs]
    common = set.intersection(*finite)
    if not common:
        return None
    step = max(common)
    return step, [float(t.loc[step].to_numpy(dtype=float)[-1]) for t in tabs]


def warning_lines(runs: list[Run], names: list[str], first: int = 3) -> list[str]:
    """Each run's first ``first`` early warnings (summary.json's ``warnings``), each with its detector's
    measured record and what to do where the alert carries them (`normlab.diagnostics.warning_record`)."""
    lines = []
    for n, r in zip(names, runs):
        said = [a for a in r.summary.extra.get("warnings") or [] if isinstance(a, dict) and "signal" in a][:first]
        for a in said:
            advice = f" {a['advice']}." if a.get("advice") else ""
            lines.append(f"{n} warned at step {a.get('step')}: {a['signal']}: {a.get('evidence', '')}.{advice}")
    return lines


def reading_lines(runs: list[Run], names: list[str]) -> list[str]:
    """The report's opening: what the runs show, computed from them (which diverged and where, stream
    growth, largest activation against the FP16 limit, loss)."""
    lines = []
    broke = [(n, r) for n, r in zip(names, runs) if r.summary.status == "diverged"]
    fine = [n for n, r in zip(names, runs) if r.summary.trained]
    for n, r in broke:
        s = r.summary
        where = (s.forensics.text if s.forensics else None) or s.reason or "reason not recorded"
        stored = s.activation_dtype if s.given("activation_dtype") else "fp32"  # written since fp16 storage existed
        lines.append(f"{n} diverged at step {s.diverged_step} ({stored} activations): {where}.")
    for n, r in zip(names, runs):
        if r.summary.status == "warned":  # a TrainingMonitor folder whose early warnings fired
            lines.append(f"{n} trained with early warnings: {r.summary.reason or 'see warnings.jsonl'}.")
    lines += warning_lines(runs, names)
    if broke and fine:
        lines.append(f"Trained to the end: {', '.join(fine)}.")
    elif not broke and fine:
        lines.append(f"No run diverged ({', '.join(fine)}).")
    stalled = [n for n, r in zip(names, runs) if r.summary.status == "stalled"]
    if stalled:
        lines.append(f"Stalled at the corpus's unigram loss (learned token frequencies only): {', '.join(stalled)}.")
    seen = [
        (n, r.summary.max_activation, ((f.forward or {}).get("kind") if (f := r.summary.forensics) else None))
        for n, r in zip(names, runs)
    ]
    peaks = [(n, v, k) for n, v, k in seen if isinstance(v, (int, float))]
    if peaks:

        def said(v: float, kind: str | None) -> str:
            if kind == "overflow":
                return "then overflowed"
            return "past 65504" if v > FP16_MAX else f"{FP16_MAX / v:,.3g}x below 65504" if v > 0 else "zero"

        parts = [f"{n} {v:,.4g} ({said(v, k)})" for n, v, k in sorted(peaks, key=lambda p: -p[1])]
        lines.append(
            "Largest |activation| seen (top-100 probes; a diverged run's last finite value): " + "; ".join(parts) + "."
        )
    var = _last_layer_variance(runs)
    if var is not None:
        step, values = var
        lines.append(
            f"Hidden-state variance at the last layer, step {step} (the last probe where every run was "
            "finite): " + "; ".join(f"{n} {v:,.4g}" for n, v in sorted(zip(names, values), key=lambda p: -p[1])) + "."
        )
    finished = [(n, r.summary.final_loss) for n, r in zip(names, runs) if r.summary.trained]
    losses = [(n, v) for n, v in finished if isinstance(v, (int, float))]
    if losses:
        best = min(losses, key=lambda p: p[1])
        lines.append(
            "Final training loss (runs that finished): "
            + "; ".join(f"{n} {v:.4f}" for n, v in sorted(losses, key=lambda p: p[1]))
            + f" (best: {best[0]})."
        )
    return lines


PROP31_METRICS = (
    ProbeMetric.TOK_H_NORM,
    ProbeMetric.TOK_GRAD_MAX,
    ProbeMetric.TOK_GRAD_MEAN,
    ProbeMetric.GRAD_H_SLOPE,
    ProbeMetric.GRAD_H_CORR,
    ProbeMetric.TOK_WITHIN_BOUND,
)


def prop31_rows(runs: list[Run], names: list[str]) -> list[dict[str, Any]]:
    """Kim Prop. 3.1 per token (`prop31.per_token`) at each run's first and last probe."""
    rows = []
    for run, name in zip(runs, names):
        p = run.probes
        p = p[p.site == "prop31"] if len(p) else p
        if not len(p) or ProbeMetric.GRAD_H_SLOPE not in set(p.metric):
            continue
        for step in sorted({int(p.step.min()), int(p.step.max())}):
            at = p[p.step == step]
            vals: dict[str, Any] = {
                m: at[at.metric == m].value.iloc[0] if (at.metric == m).any() else None for m in PROP31_METRICS
            }
            rows.append({"run": name, "step": step, **vals})
    return rows


def eval_rows(runs: list[Run], names: list[str]) -> list[dict[str, Any]]:
    """Every lm-evaluation-harness metric of every run (normlab eval), with its stderr and sample count."""
    rows = []
    for run, name in zip(runs, names):
        for task, entry in run.evals.items():
            for metric, value in (entry.get("metrics") or {}).items():
                rows.append(
                    {
                        "run": name,
                        "task": task,
                        "metric": metric,
                        "value": value,
                        "stderr": (entry.get("stderr") or {}).get(metric),
                        "n": entry.get("n"),
                        "shots": entry.get("num_fewshot"),
                        "step": entry.get("step"),
                    }
                )
    return rows


def make_report(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Render the figures as PNGs into ``out`` and write ``out/index.html``; returns its path."""
    runs = [load_run(p) for p in run_dirs]
    names = _names(runs)
    out = own_folder(out, "report")  # a new folder, or one a normlab report made
    out.mkdir(parents=True, exist_ok=True)
    probed = [(r, n) for r, n in zip(runs, names) if len(r.probes)]
    sections = []
    for figure in FIGURES:
        if not figure.shown(runs):
            continue
        if figure.needs_probes:  # drawn for the runs that recorded probes; left out when none did
            if not probed:
                continue
            fig = figure.draw([r for r, _ in probed], [n for _, n in probed])
        else:
            fig = figure.draw(runs, names)
        sections.append(figure_html(fig, out, figure.key, figure.title))
    if len(probed) < len(runs):
        missing = ", ".join(n for r, n in zip(runs, names) if not len(r.probes))
        sections.insert(
            0,
            f"<p>No probes recorded for {html.escape(missing)} (probe_every 0): the figures below "
            "the loss show the other runs only.</p>"
            if probed
            else "<p>No run recorded probes (probe_every 0): only the loss is drawn.</p>",
        )
    prop31 = prop31_rows(runs, names)
    if prop31:
        sections.insert(
            0,
            '<h2 id="prop31">Kim Prop. 3.1, per token (last MLP): does the gradient grow with ||h||?</h2>'
            "<p>tok_grad_max / tok_grad_mean: the largest entry of one token's own dl/dW2 (max, mean over "
            "tokens); grad_h_slope: slope of log ||dl_t/dW2|| on log ||h_t|| across tokens (1: grows with "
            "||h||, Pre-LN's regime; near 0: bounded by ||h||/||a||, an output norm's); tok_within_bound: "
            "fraction of tokens within 4 gamma sqrt(D) ||h_t||/||a_t|| (output-normalized MLPs only)</p>"
            + table_html(prop31),
        )
    evals = eval_rows(runs, names)
    if evals:
        sections.insert(
            0,
            '<h2 id="evaluation">Downstream evaluation (lm-evaluation-harness; normlab eval)</h2>' + table_html(evals),
        )
    reading = "".join(f"<li>{html.escape(line)}</li>" for line in reading_lines(runs, names))
    body = (
        f"<h1>normlab report</h1>\n<p>Runs: {', '.join(f'<code>{html.escape(str(r.path))}</code>' for r in runs)}</p>\n"
        f'<h2 id="reading">Reading</h2><ul>{reading}</ul>\n'
        f'<h2 id="summary">Summary</h2>{table_html(summary_rows(runs, names))}\n'
        f'<p class="note">{html.escape(SUMMARY_NOTE)}</p>\n' + "\n".join(sections)
    )
    return write_page(out / "index.html", f"normlab report: {', '.join(names)}", body)


def report_runs(paths: list[str], out: str | None = None, log: Any = print) -> Path:
    """`normlab report`: run folders, a sweep folder (its runs that logged a step) or a folder holding run
    folders one level down (a transformers Trainer's output_dir), each checked before any work; the page
    goes to ``out``, else the sweep's report folder or report/ beside the first run."""
    from normlab.runs.files import REPORT_DIR, RunDir, SweepDir
    from normlab.runs.store import logged_runs

    runs: list[Path] = []
    for r in paths:
        folder = SweepDir(r)
        if folder.is_sweep():
            runs += [run.path for run in logged_runs(folder)]
            continue
        path = Path(r)
        inner = (
            [c for c in sorted(path.iterdir()) if c.is_dir() and RunDir(c).has_metrics()]
            if path.is_dir() and not RunDir(path).has_metrics()
            else []
        )
        if inner:
            log(f"reading {', '.join(str(c) for c in inner)} (the run folder{'s' if len(inner) > 1 else ''} in {path})")
        runs += inner or [path]
    for run in runs:
        RunDir(run).check_logged()
    first = Path(paths[0])
    sweep_given = len(paths) == 1 and SweepDir(first).is_sweep()
    return make_report(runs, out or (SweepDir(first).report_dir if sweep_given else runs[0].parent / REPORT_DIR))
