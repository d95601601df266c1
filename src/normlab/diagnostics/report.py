"""`normlab report RUN_DIR...`: the papers' figures for your runs, as PNGs and one HTML page.

Figures (each titled, with axes, units and a legend of layout names, readable without the text):
loss and validation loss; pre-clip gradient norm; variance and mean |h| by depth at several points
of training (Kim Figs. 1, 6); gradient norm by layer at init and at the end (Kim Fig. 7, Zhuo Fig.
5); the top-100 activation band against the FP16 maximum (Kim Fig. 11); angular distance heatmaps
(Kim Figs. 9, 39); output-norm gamma by layer over training (Kim Fig. 39b); attention max logit; and
a summary table. The HTML embeds the PNGs, so the page is one self-contained file.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from normlab.diagnostics.stats import FP16_MAX  # noqa: E402
from normlab.diagnostics.store import Run, load_run  # noqa: E402
from normlab.runs.evals import headline_scores  # noqa: E402
from normlab.io import atomic_write_bytes, own_folder  # noqa: E402

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "axes.titlesize": 11, "axes.grid": True, "grid.alpha": 0.3})


def _names(runs: list[Run]) -> list[str]:
    names = [r.name for r in runs]
    return [f"{n} ({r.path.name})" if names.count(n) > 1 else n for n, r in zip(names, runs)]


def _legend(ax, **kw) -> None:  # noqa: ANN001 - an Axes
    """A legend where the axes have labelled artists (a run without probes draws none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _ema(y: np.ndarray, alpha: float = 0.1) -> np.ndarray:
    out, acc = np.empty_like(y, dtype=float), None
    for i, v in enumerate(y):
        acc = v if acc is None or not math.isfinite(acc) else alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def _grid(n: int, width: float = 4.2, height: float = 3.2, share: bool = False):  # noqa: ANN202
    """One panel per run; ``share``: the same x and y axes on every panel, so layouts compare at a glance."""
    cols = min(n, 4 if n == 4 else 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False,
                             sharex=share, sharey=share)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def fig_loss(runs: list[Run], names: list[str]):  # noqa: ANN201
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run, name in zip(runs, names):
        m = run.metrics
        line, = a.plot(m.step, _ema(m.loss.to_numpy()), label=f"{name} train (EMA)")
        if "val_loss" in m:
            v = m.dropna(subset=["val_loss"])
            a.plot(v.step, v.val_loss, "o--", color=line.get_color(), ms=4, label=f"{name} val")
        b.plot(m.step, m.grad_norm, lw=0.8, label=name)
    a.set(title="Loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    b.set(title="Gradient norm (pre-clip)", xlabel="step", ylabel="global L2 norm", yscale="log")
    _legend(a, fontsize=8)
    _legend(b, fontsize=8)
    fig.tight_layout()
    return fig


def fig_depth(runs: list[Run], names: list[str], metric: str, label: str):  # noqa: ANN201
    fig, axes = _grid(len(runs), share=True)
    for ax, run, name in zip(axes, runs, names):
        tab = run.probe("stream", metric)
        if tab.empty:
            ax.set_title(f"{name}: no probes")
            continue
        steps = tab.index.to_list()
        pick = sorted({steps[0], steps[len(steps) // 2], steps[-1]} | ({steps[len(steps) // 4]} if len(steps) > 4 else set()))
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(pick)))
        for c, st in zip(colors, pick):
            ax.plot(tab.columns.astype(int), tab.loc[st].to_numpy(dtype=float), "o-", ms=3, color=c, label=f"step {st}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=f"{name}: {label} by depth", xlabel="layer (0 = embedding output)", ylabel=label, yscale="log")
        if metric == "max_abs":
            ax.axhline(FP16_MAX, ls="--", color="tab:orange", label="FP16 max 65504")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def _layer_grad(run: Run) -> "object":
    df = run.probes[(run.probes.metric == "grad_norm") & run.probes.site.str.contains("_proj")]
    if df.empty:
        return None
    g = df.assign(sq=df.value**2).groupby(["step", "layer"]).sq.sum().pow(0.5)
    return g.unstack("layer")


def fig_grad_by_layer(runs: list[Run], names: list[str]):  # noqa: ANN201
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for run, name in zip(runs, names):
        g = _layer_grad(run)
        if g is None:
            continue
        a.plot(g.columns.astype(int), g.iloc[0].to_numpy(dtype=float), "o-", ms=3, label=name)
        b.plot(g.columns.astype(int), g.iloc[-1].to_numpy(dtype=float), "o-", ms=3, label=f"{name} (step {g.index[-1]})")
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set(title="Gradient norm by layer at initialization", xlabel="block", ylabel="||dL/dW|| over the block's matrices", yscale="log")
    b.set(title="Gradient norm by layer at the end", xlabel="block", yscale="log")
    _legend(a, fontsize=8)
    _legend(b, fontsize=8)
    fig.tight_layout()
    return fig


def fig_top100(runs: list[Run], names: list[str]):  # noqa: ANN201
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for run, name in zip(runs, names):
        lo, hi = run.probe("global", "top100_min"), run.probe("global", "top100_max")
        if lo.empty:
            continue
        x = lo.index.to_numpy()
        line, = ax.plot(x, hi.iloc[:, 0].to_numpy(dtype=float), label=f"{name} (top-100 band)")
        ax.fill_between(x, lo.iloc[:, 0].to_numpy(dtype=float), hi.iloc[:, 0].to_numpy(dtype=float), color=line.get_color(), alpha=0.25)
        brk = run.summary.get("forensics") or {}
        if (brk.get("forward") or {}).get("kind") == "overflow":  # where the stored activations overflowed
            ax.scatter([brk["step"]], [brk.get("limit") or FP16_MAX], marker="X", s=120, color=line.get_color(),
                       zorder=5, label=f"{name} overflowed (step {brk['step']})")
    ax.axhline(FP16_MAX, ls="--", color="tab:orange", label="FP16 max 65504")
    ax.set(title="Largest 100 |activations| in the residual stream", xlabel="step", ylabel="|hidden state|", yscale="log")
    _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def fig_angular(runs: list[Run], names: list[str]):  # noqa: ANN201
    fig, axes = _grid(len(runs), 4.0, 3.6)
    for ax, run, name in zip(axes, runs, names):
        df = run.probes[run.probes.site.str.startswith("angular:") & (run.probes.metric == "angular_distance")]
        if df.empty:
            ax.set_title(f"{name}: no probes")
            continue
        last = df[df.step == df.step.max()]
        n = int(last.layer.max()) + 1
        mat = np.zeros((n, n))
        for _, r in last.iterrows():
            mat[int(r.layer), int(r.site.split(":")[1])] = r.value
        im = ax.imshow(mat, vmin=0, vmax=0.5, cmap="magma_r", origin="lower")
        ax.set(title=f"{name}: angular distance, last token (step {int(last.step.max())})", xlabel="layer", ylabel="layer")
        ax.grid(False)
        fig.colorbar(im, ax=ax, fraction=0.046, label="arccos(cos)/π")
    fig.tight_layout()
    return fig


def _gamma_sites(run: Run) -> tuple[str, list[str]]:
    """The output norms (B) if the layout has them, else its after-add (C), else its input (A) norms."""
    sites = set(run.probes.site[run.probes.metric == "gamma_mean"])
    for kind, pair in (("output", ("attn_norms.output", "mlp_norms.output")),
                       ("after-add", ("attn_norms.after_add", "mlp_norms.after_add")),
                       ("input", ("attn_norms.input", "mlp_norms.input"))):
        found = [s for s in pair if s in sites]
        if found:
            return kind, found
    return "", []


def fig_gamma(runs: list[Run], names: list[str]):  # noqa: ANN201
    fig, axes = _grid(len(runs), share=True)
    for ax, run, name in zip(axes, runs, names):
        kind, sites = _gamma_sites(run)
        for site in sites:
            tab = run.probe(site, "gamma_mean")
            colors = plt.cm.plasma(np.linspace(0, 0.9, tab.shape[1]))
            style = "-" if site.startswith("attn") else "--"
            for c, layer in zip(colors, tab.columns):
                ax.plot(tab.index, tab[layer].to_numpy(dtype=float), style, color=c, lw=1,
                        label=f"{site.split('_')[0]} L{layer}" if tab.shape[1] <= 8 else None)
        if not sites:
            ax.text(0.5, 0.5, "no norms in this layout", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=f"{name}: {kind or 'no'} norm γ (mean) over training", xlabel="step", ylabel="mean γ")
        if sites and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2, title="solid attn, dashed mlp", title_fontsize=7)
    fig.tight_layout()
    return fig


def fig_attention(runs: list[Run], names: list[str]):  # noqa: ANN201
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run, name in zip(runs, names):
        tab = run.probe("attn", "max_logit")
        if tab.empty:
            continue
        a.plot(tab.index, tab.max(axis=1).to_numpy(dtype=float), "o-", ms=3, label=name)
        b.plot(tab.columns.astype(int), tab.iloc[-1].to_numpy(dtype=float), "o-", ms=3, label=f"{name} (step {tab.index[-1]})")
    a.set(title="Attention: largest logit over layers", xlabel="step", ylabel="max q·k/√d")
    b.set(title="Attention: max logit by layer at the end", xlabel="block", ylabel="max q·k/√d")
    b.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(a, fontsize=8)
    _legend(b, fontsize=8)
    fig.tight_layout()
    return fig


def summary_rows(runs: list[Run], names: list[str]) -> list[dict]:
    rows = []
    for run, name in zip(runs, names):
        s, p = run.summary, run.probes
        last = p[(p.site == "global") & (p.step == p.step.max())] if len(p) else p
        get = lambda metric: (last[last.metric == metric].value.iloc[0] if len(last[last.metric == metric]) else float("nan"))  # noqa: E731
        rows.append({
            "run": name, "layout": run.config.get("layout", ""), "status": s.get("status", "?"),
            "diverged at": s.get("diverged_step"), "steps": s.get("steps"),
            "final loss": s.get("final_loss"), "val loss": s.get("final_val_loss"),
            "first break": s.get("first_break") or "-", "activations": s.get("activation_dtype", "fp32"),
            "max |x| in run": s.get("max_activation"),
            "max |h| (last probe)": get("max_abs"), "FP16 headroom": get("fp16_headroom"),
            "max/median": get("max_median_ratio"),
            "spikes (loss/grad)": f"{s.get('loss_spikes', 0)}/{s.get('grad_spikes', 0)}",
            **headline_scores(run.evals),
        })
    keys = list(dict.fromkeys(k for r in rows for k in r))  # runs evaluated on different tasks: one column set
    return [{k: r.get(k) for k in keys} for r in rows]


def _last_layer_variance(runs: list[Run]) -> tuple[int, list[float]] | None:
    """The last layer's hidden-state variance of every run at the latest probe step where all runs'
    streams were finite (Kim Figs. 1, 6 compare layouts at one step): (step, variances)."""
    tabs = [r.probe("stream", "var") for r in runs]
    if any(t.empty for t in tabs):
        return None
    finite = [{int(st) for st in t.index if np.all(np.isfinite(t.loc[st].to_numpy(dtype=float)))} for t in tabs]
    common = set.intersection(*finite)
    if not common:
        return None
    step = max(common)
    return step, [float(t.loc[step].to_numpy(dtype=float)[-1]) for t in tabs]


def reading_lines(runs: list[Run], names: list[str]) -> list[str]:
    """The report's opening: what the runs show, computed from them (which diverged and where, stream
    growth, largest activation against the FP16 limit, loss)."""
    lines = []
    broke = [(n, r) for n, r in zip(names, runs) if r.summary.get("status") == "diverged"]
    fine = [n for n, r in zip(names, runs) if r.summary.get("status") in ("ok", "stalled")]
    for n, r in broke:
        s = r.summary
        where = (s.get("forensics") or {}).get("text") or s.get("reason") or "reason not recorded"
        lines.append(f"{n} diverged at step {s.get('diverged_step')} ({s.get('activation_dtype', 'fp32')} activations): {where}.")
    if broke and fine:
        lines.append(f"Trained to the end: {', '.join(fine)}.")
    elif not broke and fine:
        lines.append(f"No run diverged ({', '.join(fine)}).")
    stalled = [n for n, r in zip(names, runs) if r.summary.get("status") == "stalled"]
    if stalled:
        lines.append(f"Stalled at the corpus's unigram loss (learned token frequencies only): {', '.join(stalled)}.")
    peaks = [(n, r.summary.get("max_activation"), ((r.summary.get("forensics") or {}).get("forward") or {}).get("kind"))
             for n, r in zip(names, runs)]
    peaks = [(n, v, k) for n, v, k in peaks if isinstance(v, (int, float))]
    if peaks:
        def said(v: float, kind: str | None) -> str:
            if kind == "overflow":
                return "then overflowed"
            return "past 65504" if v > FP16_MAX else f"{FP16_MAX / v:,.3g}x below 65504" if v > 0 else "zero"
        parts = [f"{n} {v:,.4g} ({said(v, k)})" for n, v, k in sorted(peaks, key=lambda p: -p[1])]
        lines.append("Largest |activation| seen (top-100 probes; a diverged run's last finite value): " + "; ".join(parts) + ".")
    var = _last_layer_variance(runs)
    if var is not None:
        step, values = var
        lines.append(f"Hidden-state variance at the last layer, step {step} (the last probe where every run was "
                     "finite): " + "; ".join(f"{n} {v:,.4g}" for n, v in sorted(zip(names, values), key=lambda p: -p[1])) + ".")
    losses = [(n, r.summary.get("final_loss")) for n, r in zip(names, runs) if r.summary.get("status") in ("ok", "stalled")]
    losses = [(n, v) for n, v in losses if isinstance(v, (int, float))]
    if losses:
        best = min(losses, key=lambda p: p[1])
        lines.append("Final training loss (runs that finished): " + "; ".join(f"{n} {v:.4f}" for n, v in sorted(losses, key=lambda p: p[1]))
                     + f" (best: {best[0]}).")
    return lines


PROP31_METRICS = ("tok_h_norm", "tok_grad_max", "tok_grad_mean", "grad_h_slope", "grad_h_corr", "tok_within_bound")


def prop31_rows(runs: list[Run], names: list[str]) -> list[dict]:
    """Kim Prop. 3.1 per token (`prop31.per_token`) at each run's first and last probe."""
    rows = []
    for run, name in zip(runs, names):
        p = run.probes
        p = p[p.site == "prop31"] if len(p) else p
        if not len(p) or "grad_h_slope" not in set(p.metric):
            continue
        for step in sorted({int(p.step.min()), int(p.step.max())}):
            at = p[p.step == step]
            vals = {m: at[at.metric == m].value.iloc[0] if (at.metric == m).any() else None for m in PROP31_METRICS}
            rows.append({"run": name, "step": step, **vals})
    return rows


def eval_rows(runs: list[Run], names: list[str]) -> list[dict]:
    """Every lm-evaluation-harness metric of every run (normlab eval), with its stderr and sample count."""
    rows = []
    for run, name in zip(runs, names):
        for task, entry in run.evals.items():
            for metric, value in (entry.get("metrics") or {}).items():
                rows.append({"run": name, "task": task, "metric": metric, "value": value,
                             "stderr": (entry.get("stderr") or {}).get(metric), "n": entry.get("n"),
                             "shots": entry.get("num_fewshot"), "step": entry.get("step")})
    return rows


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return "-" if v is None else str(v)


def fig_expert_load(runs: list[Run], names: list[str]):  # noqa: ANN201
    """MoE routing over training: the busiest expert's load over the uniform share, per layer (1 is balanced)."""
    fig, axes = _grid(len(runs))
    for ax, run, name in zip(axes, runs, names):
        tab = run.probe("moe", "load_max_ratio")
        if tab.empty:
            ax.text(0.5, 0.5, "dense model: no experts", ha="center", va="center", transform=ax.transAxes)
        else:
            colors = plt.cm.viridis(np.linspace(0, 0.9, tab.shape[1]))
            for c, layer in zip(colors, tab.columns):
                ax.plot(tab.index, tab[layer].to_numpy(dtype=float), "o-", ms=3, color=c, lw=1, label=f"L{layer}")
            ax.axhline(1.0, color="gray", lw=0.8, ls=":")
            ax.legend(fontsize=7, ncol=2)
        ax.set(title=f"{name}: expert load", xlabel="step", ylabel="max expert load x E (1 = balanced)")
    fig.tight_layout()
    return fig


def _has_experts(runs: list[Run]) -> bool:
    return any(not run.probe("moe", "load_max_ratio").empty for run in runs)


FIGURES = [
    ("loss", "Loss and gradient norm", fig_loss),
    ("variance_by_depth", "Hidden-state variance by depth (Kim Fig. 1, 6)", lambda r, n: fig_depth(r, n, "var", "variance")),
    ("mean_abs_by_depth", "Mean |h| by depth (Kan Fig. 1)", lambda r, n: fig_depth(r, n, "mean_abs", "mean |h|")),
    ("grad_by_layer", "Gradient norm by layer (Kim Fig. 7, Zhuo Fig. 5)", fig_grad_by_layer),
    ("top100_fp16", "Massive activations against the FP16 limit (Kim Fig. 11)", fig_top100),
    ("angular_distance", "Angular distance between layers at the last token (Gromov et al.; Kim Fig. 9, 39)", fig_angular),
    ("output_gamma", "Norm γ over training: output norms where the layout has them (Kim Fig. 39b)", fig_gamma),
    ("attention_logits", "Attention logits (QK-norm motivation)", fig_attention),
]


PROBE_FIGURES = {key for key, _, _ in FIGURES if key != "loss"} | {"expert_load"}  # need probes.jsonl


def figure_html(fig, out: Path, key: str, title: str) -> str:  # noqa: ANN001 - a matplotlib Figure
    """Save ``fig`` as ``out/key.png`` and return an HTML section embedding it (base64)."""
    png = out / f"{key}.png"
    fig.savefig(png, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(png.read_bytes()).decode()
    return f'<h2 id="{key}">{html.escape(title)}</h2>\n<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">'


def table_html(rows: list[dict]) -> str:
    if not rows:
        return "<p>(no rows)</p>"
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_page(path: Path, title: str, body: str) -> Path:
    """One self-contained HTML file (inline CSS, images embedded), written atomically."""
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}th{{background:#f3f3f3}}img{{max-width:100%}}</style></head>
<body>
{body}
</body></html>
"""
    atomic_write_bytes(path, page.encode())
    return path


def _is_report(folder: Path) -> bool:
    """A report folder an older normlab wrote (before the .normlab marker): its index.html is ours."""
    index = folder / "index.html"
    try:
        return index.is_file() and "<title>normlab report" in index.read_text(errors="replace")[:2000]
    except OSError:
        return False


def make_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Render the figures as PNGs into ``out`` and write ``out/index.html``; returns its path."""
    runs = [load_run(p) for p in run_dirs]
    names = _names(runs)
    out = own_folder(out, "report", legacy=_is_report)  # a new folder, or one a normlab report made
    out.mkdir(parents=True, exist_ok=True)
    figures = FIGURES + ([("expert_load", "Expert load over training (MoE; Zhuo Sec. 4.3, OLMoE)", fig_expert_load)]
                         if _has_experts(runs) else [])
    probed = [(r, n) for r, n in zip(runs, names) if len(r.probes)]
    sections = []
    for key, title, make in figures:
        if key in PROBE_FIGURES:  # drawn for the runs that recorded probes; left out when none did
            if not probed:
                continue
            fig = make([r for r, _ in probed], [n for _, n in probed])
        else:
            fig = make(runs, names)
        sections.append(figure_html(fig, out, key, title))
    if len(probed) < len(runs):
        missing = ", ".join(n for r, n in zip(runs, names) if not len(r.probes))
        sections.insert(0, f"<p>No probes recorded for {html.escape(missing)} (probe_every 0): the figures below "
                        "the loss show the other runs only.</p>" if probed else
                        "<p>No run recorded probes (probe_every 0): only the loss is drawn.</p>")
    prop31 = prop31_rows(runs, names)
    if prop31:
        sections.insert(0, '<h2 id="prop31">Kim Prop. 3.1, per token (last MLP): does the gradient grow with ||h||?</h2>'
                        "<p>tok_grad_max / tok_grad_mean: the largest entry of one token's own dl/dW2 (max, mean over "
                        "tokens); grad_h_slope: slope of log ||dl_t/dW2|| on log ||h_t|| across tokens (1: grows with "
                        "||h||, Pre-LN's regime; near 0: bounded by ||h||/||a||, an output norm's); tok_within_bound: "
                        "fraction of tokens within 4 gamma sqrt(D) ||h_t||/||a_t|| (output-normalized MLPs only)</p>"
                        + table_html(prop31))
    evals = eval_rows(runs, names)
    if evals:
        sections.insert(0, '<h2 id="evaluation">Downstream evaluation (lm-evaluation-harness; normlab eval)</h2>'
                        + table_html(evals))
    reading = "".join(f"<li>{html.escape(line)}</li>" for line in reading_lines(runs, names))
    body = (f"<h1>normlab report</h1>\n<p>Runs: {', '.join(f'<code>{html.escape(str(r.path))}</code>' for r in runs)}</p>\n"
            f'<h2 id="reading">Reading</h2><ul>{reading}</ul>\n'
            f'<h2 id="summary">Summary</h2>{table_html(summary_rows(runs, names))}\n' + "\n".join(sections))
    return write_page(out / "index.html", f"normlab report: {', '.join(names)}", body)
