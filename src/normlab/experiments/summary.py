"""`normlab summarize SWEEP`: the papers' tables from a sweep's result store.

- **Cells** (every grid point with the seed axis folded): runs, divergences as "k/n" (Kim Tables
  10-12, Kan Table 1), and mean +/- sample std (ddof 1) of the final training and validation loss
  over the seeds that did not diverge (Kim Table 1 practice: diverged runs are excluded and counted).
  Stalled runs (finished at the corpus's unigram loss; `normlab.train.divergence`) are counted as "k/n
  stalled" beside the divergences and stay in the loss means: their loss is finite and is the result.
  Crashed (`failed`) runs are neither results nor divergences: counted apart; so are runs a time budget
  stopped ("stopped by the budget", `normlab.runs.outcome.shown_status`), which are not failures either.
- **Learning-rate curves** (when `lr` is an axis): per group (the cell without its lr) the mean final
  loss at each lr, the U-curve of Kim Fig. 3a, 12, 16-18.
- **Depth use** (runs with probes): the mean angular distance between consecutive layers at the last
  probe over the first and second half of depth (`angular_halves`; Sun et al. 2025's deep-layer test).
- **LR sensitivity** (Wortsman et al. 2024, "Small-scale proxies for large-scale Transformer training
  instabilities", Sec. 3.2): E_lr[min(loss(lr), loss_0)] - min_lr loss(lr), the expectation over the
  swept (log-spaced) learning rates, each run's final loss capped at its initial loss loss_0 so that a
  diverged or non-finite run counts as "learned nothing". We also give the expectation itself and the
  best lr.

Tables go out as Markdown (`summary.md`) and CSV; figures (U-curves, divergence counts, loss by
cell) and the tables go into `report.html`.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from normlab.config.train import TrainConfig
from normlab.diagnostics.forensics import tally
from normlab.errors import ConfigError
from normlab.experiments.runner import rebuild_store
from normlab.io import atomic_write_bytes, own_folder, writable
from normlab.runs.evals import headline_scores
from normlab.runs.files import STORE, SWEEP_REPORT, SWEEP_SUMMARY, SweepDir
from normlab.runs.metrics import ProbeMetric
from normlab.runs.outcome import FINISHED, OUTCOME, STOPPED, TRAINED, shown_counts, shown_status
from normlab.runs.store import open_store
from normlab.runs.summary import RunSummary

SEED = "seed"
LR = "lr"
EVAL_PREFIX = "eval: "  # columns of lm-eval scores (normlab eval SWEEP), one per task's headline metric


def load_sweep(path: str | Path) -> tuple[pd.DataFrame, list[str]]:
    """The store as a DataFrame (one row per run: axis columns, status, outcomes) and the axis names."""
    root = Path(path)
    db = SweepDir(root).store_file if root.is_dir() else root
    folder = SweepDir(db.parent)
    lost = not db.is_file() and folder.sweep_file.is_file() and folder.run_folders()  # moved aside as corrupt
    if not db.is_file() and not lost:
        raise FileNotFoundError(f"{path}: no {STORE} here; give a directory written by normlab sweep")
    store = None if lost else open_store(folder, readonly=True)  # read-only storage is summarized elsewhere (--out)
    rows = [] if store is None else store.rows()
    if not rows and folder.run_folders():  # a lost store (0 bytes, moved aside): rebuilt from the run folders
        if not writable(folder.path):
            raise ConfigError(
                f"{db} holds no runs but {folder.path} holds run folders, and the folder is read-only, "
                "so the store cannot be rebuilt there; copy the sweep folder somewhere writable"
            )
        rebuild_store(folder.path)
        store = open_store(folder, readonly=True)
        rows = store.rows()
    assert store is not None  # a lost store is rebuilt above (lost means run folders to rebuild from)
    sweep = store.get_meta("sweep") or {}
    axes = list(sweep.get("grid") or {}) or sorted({a for r in rows for a in r["axes"]})
    records = []
    for r in rows:
        rec = {
            "run_id": r["run_id"],
            **{a: r["axes"].get(a, _config_value(r["config"], a)) for a in axes},
            "status": r["status"],
            "step": r["step"],
            "reason": r["reason"],
            "attempts": r["attempts"],
        }
        rec.update({k: r[k] for k in OUTCOME})
        rec.update({EVAL_PREFIX + k: v for k, v in headline_scores(folder.run(r["run_id"]).evals()).items()})
        rec.update(angular_halves(folder.run(r["run_id"])) if r["status"] in TRAINED else {})
        records.append(rec)
    scores = list(dict.fromkeys(k for rec in records for k in rec if k.startswith(EVAL_PREFIX)))
    depth = [k for k in ANGULAR if any(k in rec for rec in records)]
    df = pd.DataFrame.from_records(
        records, columns=["run_id", *axes, "status", "step", "reason", "attempts", *OUTCOME, *scores, *depth]
    )
    # One row per grid point: a store can hold two ids for one point (runs recorded by a normlab
    # whose ids hashed other settings); the finished one, else the newest, is the result.
    if axes and len(df):
        df["_rank"] = [(s in FINISHED, r["finished_at"] or 0) for s, r in zip(df.status, rows)]
        df = df.sort_values("_rank", kind="stable").drop_duplicates(subset=axes, keep="last")
        df = df.drop(columns="_rank").sort_index()
    return df, axes


ANGULAR = ("angular_shallow", "angular_deep")


def angular_halves(run: Any) -> dict[str, float]:
    """How much the layers still change the stream at the run's last probe: the mean angular distance between
    consecutive layers' streams at the last token (Gromov et al. 2024; `angular_next` probes) over the first
    and the second half of depth. Sun et al. 2025 ("The Curse of Depth") read a small second-half value as
    deep layers close to the identity. Empty without probes."""
    rows = [r for r in run.probes() if r.get("site") == "stream" and r.get("metric") == "angular_next"]
    if not rows:
        return {}
    last = max(r["step"] for r in rows)
    values = [v for _, v in sorted((r["layer"], r["value"]) for r in rows if r["step"] == last)]
    half = len(values) // 2
    if not half:
        return {}
    return {"angular_shallow": float(np.mean(values[:half])), "angular_deep": float(np.mean(values[half:]))}


def _config_value(config: TrainConfig, axis: str) -> Any:
    flat = config.to_flat()
    if axis.startswith("model."):
        return flat["model"].get(axis.removeprefix("model."))
    return flat.get(axis)


def _mean_std(values: pd.Series) -> tuple[float, float]:
    v = values.dropna().astype(float)
    v = v[np.isfinite(v)]
    if v.empty:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else math.nan


def cells(df: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """One row per grid point with seeds folded: counts, "k/n" divergences, loss mean and std."""
    keys = [a for a in axes if a != SEED]
    groups = df.groupby(keys, sort=False, dropna=False) if keys else [((), df)]
    out = []
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        n = {s: int((g.status == s).sum()) for s in (*FINISHED, "failed")}
        # a run the time budget stopped is not a failure (`shown_status`): counted apart
        n["stopped"] = sum(shown_status(s, r) == STOPPED for s, r in zip(g.status, g.get("reason", [None] * len(g))))
        n["failed"] -= n["stopped"]
        finished = sum(n[s] for s in FINISHED)
        trained = g[g.status.isin(TRAINED)]
        fm, fs = _mean_std(trained.final_loss)
        vm, vs = _mean_std(trained.final_val_loss)
        scores = {}
        for col in (x for x in g.columns if x.startswith(EVAL_PREFIX)):
            scores[col + " mean"], scores[col + " std"] = _mean_std(trained[col])
        for col in (x for x in ANGULAR if x in g.columns):
            scores[col], _ = _mean_std(trained[col])
        peak = pd.to_numeric(g.max_activation, errors="coerce").dropna()
        spike = pd.to_numeric(g.get("spike_score", pd.Series(dtype=float)), errors="coerce").dropna()
        out.append(
            {
                **dict(zip(keys, key)),
                "runs": len(g),
                **n,
                "pending": int(len(g) - finished - n["failed"] - n["stopped"]),
                "divergences": f"{n['diverged']}/{finished}",
                "stalls": f"{n['stalled']}/{finished}",
                "max_activation": float(peak.max()) if len(peak) else math.nan,
                "spike_score": float(spike.mean()) if len(spike) else math.nan,
                "first_breaks": tally(list(g[g.status == "diverged"].first_break)),
                "final_loss_mean": fm,
                "final_loss_std": fs,
                "val_loss_mean": vm,
                "val_loss_std": vs,
                **scores,
            }
        )
    return pd.DataFrame(out)


def _capped(row: pd.Series) -> float:
    """Final loss capped at the initial loss; a diverged or non-finite run counts as the initial loss
    (Wortsman et al. 2024's min(loss, L_0)): a diverged run's final_loss is the last finite loss it
    logged before the non-finite one, not a loss it trained to."""
    init = row.initial_loss
    loss = row.final_loss
    if init is None or not math.isfinite(init):
        return math.nan
    if row.status == "diverged" or loss is None or not math.isfinite(loss):
        return float(init)
    return float(min(loss, init))


def lr_curves(df: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Per group and lr: mean final loss over non-diverged seeds, divergences and stalls k/n, mean capped loss."""
    if LR not in axes:
        return pd.DataFrame()
    keys = [a for a in axes if a not in (SEED, LR)]
    done = df[df.status.isin(FINISHED)].copy()
    done["capped"] = done.apply(_capped, axis=1) if len(done) else []
    out = []
    for key, g in done.groupby(keys + [LR], sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        m, s = _mean_std(g[g.status.isin(TRAINED)].final_loss)
        out.append(
            {
                **dict(zip(keys + [LR], key)),
                "final_loss_mean": m,
                "final_loss_std": s,
                "divergences": f"{(g.status == 'diverged').sum()}/{len(g)}",
                "stalls": f"{(g.status == 'stalled').sum()}/{len(g)}",
                "capped_loss": float(g.capped.mean()),
            }
        )
    return pd.DataFrame(out)


def lr_sensitivity(curves: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Wortsman et al.'s LR sensitivity per group, with the best lr (lowest mean final loss)."""
    if curves.empty:
        return pd.DataFrame()
    keys = [a for a in axes if a not in (SEED, LR)]
    groups = curves.groupby(keys, sort=False, dropna=False) if keys else [((), curves)]
    out = []
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        capped = g.capped_loss.dropna()
        trained = g.dropna(subset=["final_loss_mean"])
        best = trained.loc[trained.final_loss_mean.idxmin()] if len(trained) else None
        out.append(
            {
                **dict(zip(keys, key)),
                "lrs": len(g),
                "lr_range": f"{g[LR].min():g}-{g[LR].max():g}",
                "expected_capped_loss": float(capped.mean()) if len(capped) else math.nan,
                "lr_sensitivity": float(capped.mean() - capped.min()) if len(capped) else math.nan,
                "best_lr": None if best is None else float(best[LR]),
                "best_final_loss": math.nan if best is None else float(best.final_loss_mean),
            }
        )
    return pd.DataFrame(out)


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return "-" if v is None else str(v)


def _pm(m: float, s: float) -> str:
    if math.isnan(m):
        return "-"
    return f"{m:.4f}" if math.isnan(s) else f"{m:.4f} ± {s:.4f}"


def to_markdown(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none)\n"
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def cell_table(c: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """The cells as the papers print them: axes, divergences k/n, loss mean ± std."""
    keys = [a for a in axes if a != SEED]
    t = c[keys].copy()
    t["divergences"] = c.divergences
    t["stalled"] = c.stalls
    t["failed"] = c.failed
    if "stopped" in c and c.stopped.any():
        t[STOPPED] = c.stopped
    if (
        "max_activation" in c and c.max_activation.notna().any()
    ):  # runs with probes: Kim Fig. 11's quantity against the FP16 limit
        t["max |x|"] = [_fmt(v) for v in c.max_activation]
    if "spike_score" in c and c.spike_score.notna().any():  # OLMo-core's spike score, mean over the seeds
        t["spike score"] = [_fmt(v) for v in c.spike_score]
    if "first_breaks" in c and (c.first_breaks != "").any():
        t["first overflow (diverged runs)"] = [b or "-" for b in c.first_breaks]
    if "angular_deep" in c and c.angular_deep.notna().any():  # probes with angular distance (Sun et al. 2025)
        t["angular step, 1st / 2nd half"] = [
            f"{a:.3f} / {b:.3f}" if math.isfinite(b) else "-" for a, b in zip(c.angular_shallow, c.angular_deep)
        ]
    t["final loss"] = [_pm(m, s) for m, s in zip(c.final_loss_mean, c.final_loss_std)]
    t["val loss"] = [_pm(m, s) for m, s in zip(c.val_loss_mean, c.val_loss_std)]
    for col in (x for x in c.columns if x.startswith(EVAL_PREFIX) and x.endswith(" mean")):
        base = col.removesuffix(" mean")
        t[base.removeprefix(EVAL_PREFIX)] = [_pm(m, s) for m, s in zip(c[col], c[base + " std"])]
    return t


def lr_table(curves: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Groups as rows, learning rates as columns: "mean (k/n diverged, j/n stalled)"."""
    if curves.empty:
        return curves
    keys = [a for a in axes if a not in (SEED, LR)]
    cell = []
    for m, d, st in zip(curves.final_loss_mean, curves.divergences, curves.stalls):
        notes = [f"{x} {what}" for x, what in ((d, "diverged"), (st, "stalled")) if not x.startswith("0/")]
        cell.append(("-" if math.isnan(m) else f"{m:.4f}") + (f" ({', '.join(notes)})" if notes else ""))
    t = curves.assign(cell=cell)
    if not keys:
        t = t.assign(group="all")
        keys = ["group"]
    wide = t.pivot_table(index=keys, columns=LR, values="cell", aggfunc="first", sort=False)
    wide.columns = [f"lr={c:g}" for c in wide.columns]
    return wide.reset_index()


def summarize(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write summary.md, the CSVs and report.html into ``out`` (default: the sweep directory)."""
    root = Path(path)
    df, axes = load_sweep(root)
    if out and Path(out).resolve() != root.resolve():  # another folder: only one normlab made for summaries
        own_folder(out, "summary")
    elif not writable(root if root.is_dir() else root.parent):
        raise ConfigError(f"{root} is on read-only storage; give --out DIR for the summary and the report")
    out = Path(out) if out else root
    out.mkdir(parents=True, exist_ok=True)
    sweep = open_store(SweepDir(root), readonly=True).get_meta("sweep") or {}
    c = cells(df, axes)
    curves = lr_curves(df, axes)
    sens = lr_sensitivity(curves, axes)
    counts = shown_counts(df.to_dict("records"))  # a run the budget stopped: "stopped by the budget", not failed
    head = [f"# Sweep `{sweep.get('name', root.name)}`", ""]
    for k in ("source", "scale", "claim"):
        if sweep.get(k):
            head.append(f"- {k}: {sweep[k]}")
    if sweep.get("base"):  # what every run shares, --set included (the prose scale above is the recipe's)
        head.append("- base: " + ", ".join(f"{k}={v}" for k, v in sorted(sweep["base"].items())))
    head.append(f"- runs: {len(df)} (" + ", ".join(f"{v} {k}" for k, v in counts.items()) + ")")
    head.append(f"- axes: {', '.join(axes)}")
    md = (
        "\n".join(head)
        + "\n\n## Cells: divergences, stalls and loss over seeds (mean ± std, diverged runs excluded)\n\n"
    )
    md += to_markdown(cell_table(c, axes))
    if not curves.empty:
        md += (
            "\n## Final loss by learning rate (mean over seeds that did not diverge; k/n diverged or stalled)\n\n"
            + to_markdown(lr_table(curves, axes))
        )
        md += "\n## LR sensitivity (Wortsman et al. 2024) and best learning rate\n\n" + to_markdown(sens)
    bad = df[df.status.isin(["diverged", "stalled", "failed"])].copy()
    if len(bad):
        bad["status"] = [shown_status(s, r) for s, r in zip(bad.status, bad.reason)]
        md += "\n## Diverged, stalled, failed and stopped runs\n\n" + to_markdown(
            bad[["run_id", "status", "step", "reason", "first_break"]]
        )
    atomic_write_bytes(out / SWEEP_SUMMARY, md.encode())
    for name, table in (("runs", df), ("cells", c), ("lr_curve", curves), ("lr_sensitivity", sens)):
        if not table.empty:
            atomic_write_bytes(out / f"{name}.csv", table.to_csv(index=False).encode())
    html_path = _report(out, df, axes, c, curves, sens, sweep, root)
    return {
        "markdown": out / SWEEP_SUMMARY,
        "html": html_path,
        "cells": c,
        "lr_curve": curves,
        "lr_sensitivity": sens,
        "runs": df,
    }


def _group_label(row: dict[str, Any], keys: list[str]) -> str:
    """ "pre, lr=0.01, init=he": the layout bare, other axes named (model./layout. prefixes dropped)."""
    return ", ".join(str(row[k]) if k == "layout" else f"{k.split('.')[-1]}={row[k]}" for k in keys) or "all"


def _top100_figure(root: Path, df: pd.DataFrame, axes: list[str]):  # noqa: ANN202 - a Figure or None
    """Kim Fig. 11 per cell: each seed's global top-100 maximum over its probe steps, one panel per cell
    on shared axes, the FP16 maximum dashed and an X where a run's stored activations overflowed."""
    import matplotlib.pyplot as plt

    from normlab.diagnostics.stats import FP16_MAX

    keys = [a for a in axes if a != SEED]
    curves = []
    fp16 = False  # the FP16 maximum is drawn only where a run stored its activations in fp16
    for row in df.to_dict("records"):
        run = SweepDir(root).run(row["run_id"])
        pts = run.probe_series("global", ProbeMetric.TOP100_MAX)
        summary = run.read_summary() or RunSummary()
        if pts:
            curves.append((_group_label(row, keys), row.get(SEED), pts, summary.forensics))
            fp16 = fp16 or summary.activation_dtype == "fp16"
    if not curves:
        return None
    labels = list(dict.fromkeys(c[0] for c in curves))
    cols = min(len(labels), 5)
    rows = -(-len(labels) // cols)
    fig, panels = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.9 * rows), squeeze=False, sharex=True, sharey=True)
    for ax in panels.flat[len(labels) :]:
        ax.set_visible(False)
    for ax, label in zip(panels.flat, labels):
        for _, seed, pts, forensics in (c for c in curves if c[0] == label):
            steps, values = zip(*pts)
            (line,) = ax.plot(steps, [v if math.isfinite(v) else np.nan for v in values], lw=1, label=f"seed {seed}")
            if forensics is not None and forensics.overflowed:
                ax.scatter(
                    [forensics.step],
                    [forensics.limit or FP16_MAX],
                    marker="X",
                    s=60,
                    color=line.get_color(),
                    zorder=5,
                )
        if fp16:
            ax.axhline(FP16_MAX, ls="--", color="tab:orange", lw=1)
        ax.set(title=label, yscale="log", xlabel="step")
    panels.flat[0].set_ylabel("largest |hidden state| (top-100 max)")
    panels.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Top-100 |activations| per seed" + ("; dashed: FP16 max 65504; X: overflowed" if fp16 else ""), fontsize=10
    )
    fig.tight_layout()
    return fig


def _lr_curve_figure(curves: pd.DataFrame, keys: list[str]) -> Any:
    """Final loss against the peak learning rate, a line per cell of the other axes (x: a seed diverged)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for _, g in curves.groupby(keys, sort=False, dropna=False) if keys else [((), curves)]:
        label = _group_label(g[keys].iloc[0].to_dict(), keys) if keys else "all"
        g = g.sort_values(LR)  # in learning-rate order: in run order a curve can seem to improve with the rate
        (line,) = ax.plot(g[LR], g.final_loss_mean, marker="o", label=label)
        div = g[~g.divergences.str.startswith("0/")]
        if len(div):  # a diverged seed counts as its initial loss (the capped loss), as in the sensitivity
            ax.scatter(div[LR], div.capped_loss, marker="x", s=80, color=line.get_color(), zorder=5)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final training loss (nats/token)")
    ax.set_title("Loss vs learning rate (x: a seed diverged; at the mean capped loss)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _report(
    out: Path,
    df: pd.DataFrame,
    axes: list[str],
    c: pd.DataFrame,
    curves: pd.DataFrame,
    sens: pd.DataFrame,
    sweep: dict,
    root: Path | None = None,
) -> Path:
    import matplotlib.pyplot as plt

    from normlab.pages import figure_html, table_html, write_page

    sections = []
    if not curves.empty:
        fig = _lr_curve_figure(curves, [a for a in axes if a not in (SEED, LR)])
        sections.append(figure_html(fig, out, "lr_curve", "Final loss vs learning rate (Kim Fig. 3a)"))
    labels = [_group_label(r, [a for a in axes if a != SEED]) for r in c.to_dict("records")]
    y = np.arange(len(c))
    losses = pd.to_numeric(c.final_loss_mean, errors="coerce")
    if losses.notna().any():  # a cell trained to the end: its loss drawn beside the divergences
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.35 * len(c) + 1.5)))
        a.errorbar(losses, y, xerr=c.final_loss_std.fillna(0), fmt="o", color="tab:blue", capsize=3)
        a.set_yticks(y, labels, fontsize=8)
        a.set_xlabel("final training loss, mean ± std over seeds")
        a.set_title("Loss by cell (diverged runs excluded)")
        a.set_ylim(len(c) - 0.5, -0.5)
    else:  # no cell trained to the end (every run diverged, stalled or was stopped): no empty loss chart
        fig, b = plt.subplots(1, 1, figsize=(7, max(3.0, 0.35 * len(c) + 1.5)))
    finished = sum(c[s] for s in FINISHED).replace(0, np.nan)
    b.barh(y, c.diverged / finished, color="tab:red", alpha=0.8, label="diverged")
    b.barh(
        y,
        c.stalled / finished,
        left=(c.diverged / finished).fillna(0),
        color="tab:orange",
        alpha=0.8,
        label="stalled (unigram loss)",
    )
    for yi, d, st in zip(y, c.divergences, c.stalls):
        b.text(0.01, yi, f"{d} diverged" + ("" if st.startswith("0/") else f", {st} stalled"), va="center", fontsize=8)
    b.set_yticks(y, [""] * len(y) if losses.notna().any() else labels, fontsize=8)
    b.invert_yaxis()
    b.set_xlim(0, 1)
    b.set_xlabel("fraction of seeds diverged or stalled")
    b.set_title("Divergences and stalls (k/n)")
    b.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    title = (
        "Loss and divergences by cell" if losses.notna().any() else "Divergences by cell (no cell trained to the end)"
    )
    sections.append(figure_html(fig, out, "cells", title))
    top = _top100_figure(root or out, df, axes)
    if top is not None:
        sections.append(
            figure_html(
                top,
                out,
                "top100_fp16",
                "Largest activations over training against the FP16 limit, every seed (Kim Fig. 11)",
            )
        )
    meta = "".join(
        f"<li>{html.escape(k)}: {html.escape(str(sweep[k]))}</li>" for k in ("source", "scale", "claim") if sweep.get(k)
    )
    body = (
        f"<h1>Sweep {html.escape(str(sweep.get('name', out.name)))}</h1><ul>{meta}</ul>"
        f"<h2>Cells</h2>{table_html(cell_table(c, axes).to_dict('records'))}"
        + (f"<h2>LR sensitivity</h2>{table_html(sens.to_dict('records'))}" if not sens.empty else "")
        + "\n".join(sections)
    )
    return write_page(out / SWEEP_REPORT, f"normlab sweep: {sweep.get('name', '')}", body)
