"""The figures of a run report, as a registry: each entry draws one figure from a list of runs.

Each figure is titled, with axes, units and a legend of layout names, readable without the text:
loss and validation loss; pre-clip gradient norm; variance and mean |h| by depth at several points
of training (Kim Figs. 1, 6); gradient norm by layer at init and at the end (Kim Fig. 7, Zhuo Fig.
5); the top-100 activation band against the FP16 maximum (Kim Fig. 11); angular distance heatmaps
(Kim Figs. 9, 39); output-norm gamma by layer over training (Kim Fig. 39b); attention max logit;
the learnable scalars (DyT's alpha, learned residual steps, Admin's omega, head scales) where a layout
has them; expert load for MoE models. A new figure is one `Figure` entry in `FIGURES`; `normlab report` draws
every entry whose data the runs have.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.ticker import MaxNLocator

from normlab.diagnostics.probe_store import Run
from normlab.diagnostics.stats import FP16_MAX
from normlab.pages import legend as _legend
from normlab.pages import panels as _grid
from normlab.pages import plt
from normlab.runs.metrics import Metric, ProbeMetric

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.lines import Line2D


def _trailing_mean(y: np.ndarray, window: int = 10) -> np.ndarray:
    """The mean of the last ``window`` values at each point: the curve ends at the summary's final loss (the
    trainer's mean of the last 10 finite losses)."""
    c = np.concatenate([[0.0], np.cumsum(y, dtype=float)])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(0, i - window)
    out: np.ndarray = (c[i] - c[lo]) / (i - lo)
    return out


def finite_steps(tab: pd.DataFrame) -> list[int]:
    """The steps of a step x layer table whose every value is finite (a diverged run's last probes are not)."""
    return [int(st) for st in tab.index if np.all(np.isfinite(tab.loc[st].to_numpy(dtype=float)))]


def _when(step: int, last: int, diverged: int | None) -> str:
    """A legend's or title's note on the step a panel shows: the last probe's, or the last finite one's."""
    if step == last:
        return f"step {step}"
    why = f"diverged at step {diverged}" if diverged is not None else f"non-finite at step {last}"
    return f"step {step}, the last finite probe; {why}"


def _not_drawn(ax: Axes, name: str, why: str) -> None:
    """A legend entry for a run with nothing finite to draw, saying so (a legend never lists an invisible line)."""
    ax.plot([], [], ls="none", label=f"{name}: not drawn ({why})")


def _stored_fp16(runs: list[Run]) -> bool:
    """Whether any of the runs stored its activations in fp16: the FP16 maximum is drawn only then (a bf16 or
    fp32 run has no overflow in reach, and a line at 65504 would say it has)."""
    return any(run.summary.activation_dtype == "fp16" for run in runs)


def _depth_colorbar(fig: MplFigure, ax: Axes, n_layers: int, cmap: str = "viridis", top: float = 1.0) -> None:
    """The colour legend of a panel with a line per layer: a colour bar from layer 0 to the deepest."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    base = plt.get_cmap(cmap)
    scale = LinearSegmentedColormap.from_list(f"{cmap}_depth", base(np.linspace(0, top, 256)))
    bar = fig.colorbar(ScalarMappable(Normalize(0, max(n_layers - 1, 1)), cmap=scale), ax=ax, pad=0.01, fraction=0.05)
    bar.set_label("layer", fontsize=7)
    bar.ax.tick_params(labelsize=6)


def fig_loss(runs: list[Run], names: list[str]) -> MplFigure:
    """Every run's loss and gradient norm to its last finite step; a diverged run's end marked with an X."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run, name in zip(runs, names):
        m = run.metrics
        steps, loss = m.step.to_numpy(), m.loss.to_numpy(dtype=float)
        ok = np.isfinite(loss)
        diverged = run.summary.status == "diverged"
        if not ok.any():
            _not_drawn(
                a,
                name,
                f"no finite loss; diverged at step {run.summary.diverged_step}" if diverged else "no finite loss",
            )
            continue
        (line,) = a.plot(steps[ok], _trailing_mean(loss[ok]), label=f"{name} train (mean of 10 steps)")
        color = line.get_color()
        a.plot(steps[ok], loss[ok], lw=0.6, alpha=0.35, color=color)  # the raw losses the summary averages
        if Metric.VAL_LOSS in m:
            v = m[np.isfinite(m.val_loss.to_numpy(dtype=float))]
            if len(v):
                a.plot(v.step, v.val_loss, "o--", color=color, ms=4, label=f"{name} val")
        g = m.grad_norm.to_numpy(dtype=float)
        gok = np.isfinite(g) & (g > 0)
        b.plot(steps[gok], g[gok], lw=0.8, color=color, label=name)
        if diverged:
            at = run.summary.diverged_step
            a.scatter(
                [steps[ok][-1]],
                [loss[ok][-1]],
                marker="X",
                s=90,
                color=color,
                zorder=5,
                label=f"{name} diverged at step {at}",
            )
            if gok.any():
                b.scatter([steps[gok][-1]], [g[gok][-1]], marker="X", s=90, color=color, zorder=5)
    broke = any(run.summary.status == "diverged" for run in runs)
    a.set(
        title="Loss (faint: each step; X: a diverged run's last finite step)" if broke else "Loss (faint: each step)",
        xlabel="step",
        ylabel="cross-entropy (nats/token)",
    )
    b.set(title="Gradient norm (pre-clip)", xlabel="step", ylabel="global L2 norm", yscale="log")
    _legend(a, fontsize=8)
    _legend(b, fontsize=8)
    fig.tight_layout()
    return fig


def fig_depth(runs: list[Run], names: list[str], metric: str, label: str) -> MplFigure:
    fig, axes = _grid(len(runs), share=True)
    for ax, run, name in zip(axes, runs, names):
        tab = run.probe("stream", metric)
        if tab.empty:
            ax.set_title(f"{name}: no probes")
            continue
        # the probes with something finite to draw; a line that turns non-finite stops where it did (an X)
        steps = [int(st) for st in tab.index if np.isfinite(tab.loc[st].to_numpy(dtype=float)).any()]
        if not steps:
            ax.set_title(f"{name}: no finite probe")
            continue
        pick = sorted(
            {steps[0], steps[len(steps) // 2], steps[-1]} | ({steps[len(steps) // 4]} if len(steps) > 4 else set())
        )
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(pick)))
        layers = tab.columns.astype(int).to_numpy()
        for c, st in zip(colors, pick):
            y = tab.loc[st].to_numpy(dtype=float)
            ok = np.isfinite(y)
            note = "" if ok.all() else f" (non-finite from layer {int(layers[~ok][0])})"
            ax.plot(layers[ok], y[ok], "o-", ms=3, color=c, label=f"step {st}{note}")
            if not ok.all():
                ax.scatter([layers[ok][-1]], [y[ok][-1]], marker="X", s=60, color=c, zorder=5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=f"{name}: {label} by depth", xlabel="layer (0 = embedding output)", ylabel=label, yscale="log")
        if metric == ProbeMetric.MAX_ABS and _stored_fp16([run]):
            ax.axhline(FP16_MAX, ls="--", color="tab:orange", label="FP16 max 65504")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def _layer_grad(run: Run) -> pd.DataFrame | None:
    """Each block's gradient norm over its matrices: one row per probe step, one column per block (None: no
    matrix gradient was probed)."""
    df = run.probes[(run.probes.metric == ProbeMetric.GRAD_NORM) & run.probes.site.str.contains("_proj")]
    if df.empty:
        return None
    # a non-finite matrix gradient makes its block's norm non-finite (pandas' sum would skip it: a 0 on a log axis)
    g = df.assign(sq=df.value**2).groupby(["step", "layer"]).sq.agg(lambda v: float(np.sum(v.to_numpy()))).pow(0.5)
    return g.unstack("layer")


def _layer_line(ax: Axes, x: np.ndarray, y: np.ndarray, label: str, color: object = None) -> Line2D:
    """One run's values by block on a log axis; a block whose value is 0 (an fp16 gradient that underflowed)
    is drawn as a triangle at the bottom of the axes and counted in the label, never dropped unseen."""
    zero = y <= 0
    note = f"; 0 in {int(zero.sum())} of {len(y)} blocks (▼ at the bottom)" if zero.any() else ""
    (line,) = ax.plot(x[~zero], y[~zero], "o-", ms=3, color=color, label=label + note)
    if zero.any():
        ax.plot(
            x[zero],
            np.full(int(zero.sum()), 0.01),
            "v",
            ms=6,
            color=line.get_color(),
            transform=ax.get_xaxis_transform(),
            clip_on=False,
        )
    return line


def fig_grad_by_layer(runs: list[Run], names: list[str]) -> MplFigure:
    """At the first and the last probe whose every block's gradient was finite: a run that diverged before
    its last probe is drawn at its last finite one, and its legend entry says so."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for run, name in zip(runs, names):
        g = _layer_grad(run)
        if g is None:
            continue
        finite = finite_steps(g)
        if not finite:
            for ax in (a, b):
                _not_drawn(ax, name, "no probe with finite gradients")
            continue
        x = g.columns.astype(int).to_numpy()
        line = _layer_line(
            a,
            x,
            g.loc[finite[0]].to_numpy(dtype=float),
            name if finite[0] == g.index[0] else f"{name} (step {finite[0]})",
        )
        when = _when(finite[-1], int(g.index[-1]), run.summary.diverged_step)
        if finite[-1] == g.index[-1] and g.index[-1] < run.probes.step.max():  # a monitor's final probe: no gradients
            when += f", the last probe with gradients (step {int(run.probes.step.max())} has none)"
        _layer_line(b, x, g.loc[finite[-1]].to_numpy(dtype=float), f"{name} ({when})", line.get_color())
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set(
        title="Gradient norm by layer at initialization",
        xlabel="block",
        ylabel="||dL/dW|| over the block's matrices",
        yscale="log",
    )
    b.set(title="Gradient norm by layer at the end", xlabel="block", yscale="log")
    for ax in (a, b):  # below the panels: the notes on the steps shown are long
        _legend(ax, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    return fig


def fig_top100(runs: list[Run], names: list[str]) -> MplFigure:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for run, name in zip(runs, names):
        lo, hi = run.probe("global", ProbeMetric.TOP100_MIN), run.probe("global", ProbeMetric.TOP100_MAX)
        if lo.empty:
            continue
        x, top, low = lo.index.to_numpy(), hi.iloc[:, 0].to_numpy(dtype=float), lo.iloc[:, 0].to_numpy(dtype=float)
        ok = np.isfinite(top) & np.isfinite(low)
        if not ok.any():
            _not_drawn(ax, name, "no finite probe")
            continue
        (line,) = ax.plot(x[ok], top[ok], label=f"{name} (top-100 band)")
        ax.fill_between(x[ok], low[ok], top[ok], color=line.get_color(), alpha=0.25)
        brk = run.summary.forensics
        if brk is not None and brk.overflowed and brk.step is not None:  # where the stored activations overflowed
            ax.scatter(
                [brk.step],
                [brk.limit or FP16_MAX],
                marker="X",
                s=120,
                color=line.get_color(),
                zorder=5,
                label=f"{name} overflowed (step {brk.step})",
            )
    if _stored_fp16(runs):
        ax.axhline(FP16_MAX, ls="--", color="tab:orange", label="FP16 max 65504")
    ax.set(
        title="Largest 100 |activations| in the residual stream", xlabel="step", ylabel="|hidden state|", yscale="log"
    )
    _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def fig_angular(runs: list[Run], names: list[str]) -> MplFigure:
    """The layer x layer matrix at the last probe where it is finite; for a run that recorded only the
    distance to the next layer (`TrainingMonitor`, `StreamProbe`), that distance by depth."""
    fig, axes = _grid(len(runs), 4.0, 3.6)
    for ax, run, name in zip(axes, runs, names):
        df = run.probes[
            run.probes.site.str.startswith("angular:") & (run.probes.metric == ProbeMetric.ANGULAR_DISTANCE)
        ]
        if df.empty:
            nxt = run.probe("stream", ProbeMetric.ANGULAR_NEXT)
            finite = finite_steps(nxt) if not nxt.empty else []
            if not finite:
                ax.set_title(f"{name}: no angular probes")
                ax.set_axis_off()
                continue
            colors = plt.cm.viridis(np.linspace(0, 0.9, min(3, len(finite))))
            for c, st in zip(colors, sorted({finite[0], finite[len(finite) // 2], finite[-1]})):
                ax.plot(
                    nxt.columns.astype(int), nxt.loc[st].to_numpy(dtype=float), "o-", ms=3, color=c, label=f"step {st}"
                )
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set(
                title=f"{name}: angular distance, layer l to l+1",
                xlabel="layer l",
                ylabel="arccos(cos)/π",
                ylim=(0, None),
            )
            _legend(ax, fontsize=8)
            continue
        steps = sorted(int(st) for st in df.step.unique())
        finite = [st for st in steps if np.isfinite(df[df.step == st].value.to_numpy(dtype=float)).all()]
        if not finite:
            ax.set_title(f"{name}: no finite angular probe")
            ax.set_axis_off()
            continue
        last = df[df.step == finite[-1]]
        n = int(last.layer.max()) + 1
        mat = np.zeros((n, n))
        for _, r in last.iterrows():
            mat[int(r.layer), int(r.site.split(":")[1])] = r.value
        im = ax.imshow(mat, vmin=0, vmax=0.5, cmap="magma_r", origin="lower")
        when = _when(finite[-1], steps[-1], run.summary.diverged_step)
        ax.set(title=f"{name}: angular distance, last token\n({when})", xlabel="layer", ylabel="layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(False)
        fig.colorbar(im, ax=ax, fraction=0.046, label="arccos(cos)/π")
    fig.tight_layout()
    return fig


def _gamma_sites(run: Run) -> tuple[str, list[str]]:
    """The output norms (B) if the layout has them, else its after-add (C), else its input (A) norms."""
    sites = set(run.probes.site[run.probes.metric == ProbeMetric.GAMMA_MEAN])
    for kind, pair in (
        ("output", ("attn_norms.output", "mlp_norms.output")),
        ("after-add", ("attn_norms.after_add", "mlp_norms.after_add")),
        ("input", ("attn_norms.input", "mlp_norms.input")),
    ):
        found = [s for s in pair if s in sites]
        if found:
            return kind, found
    return "", []


def fig_gamma(runs: list[Run], names: list[str]) -> MplFigure:
    fig, axes = _grid(len(runs), share=True)
    for ax, run, name in zip(axes, runs, names):
        kind, sites = _gamma_sites(run)
        for site in sites:
            tab = run.probe(site, ProbeMetric.GAMMA_MEAN)
            colors = plt.cm.plasma(np.linspace(0, 0.9, tab.shape[1]))
            style = "-" if site.startswith("attn") else "--"
            for c, layer in zip(colors, tab.columns):
                ax.plot(
                    tab.index,
                    tab[layer].to_numpy(dtype=float),
                    style,
                    color=c,
                    lw=1,
                    label=f"{site.split('_')[0]} L{layer}" if tab.shape[1] <= 8 else None,
                )
        if not sites:
            ax.text(0.5, 0.5, "no norms in this layout", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=f"{name}: {kind or 'no'} norm γ (mean) over training", xlabel="step", ylabel="mean γ")
        if sites and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2, title="solid attn, dashed mlp", title_fontsize=7)
        elif sites:  # too many layers to name: the colours' legend as a bar
            _depth_colorbar(fig, ax, run.probe(sites[0], ProbeMetric.GAMMA_MEAN).shape[1], "plasma", 0.9)
    fig.tight_layout()
    return fig


def fig_attention(runs: list[Run], names: list[str]) -> MplFigure:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run, name in zip(runs, names):
        tab = run.probe("attn", ProbeMetric.MAX_LOGIT)
        if tab.empty:
            continue
        top = tab.max(axis=1).to_numpy(dtype=float)
        ok = np.isfinite(top)
        (line,) = a.plot(tab.index[ok], top[ok], "o-", ms=3, label=name)
        finite = finite_steps(tab)
        if not finite:
            _not_drawn(b, name, "no probe with finite logits")
            continue
        when = _when(finite[-1], int(tab.index[-1]), run.summary.diverged_step)
        b.plot(
            tab.columns.astype(int),
            tab.loc[finite[-1]].to_numpy(dtype=float),
            "o-",
            ms=3,
            color=line.get_color(),
            label=f"{name} ({when})",
        )
    a.set(title="Attention: largest logit over layers", xlabel="step", ylabel="max q·k/√d")
    b.set(title="Attention: max logit by layer at the end", xlabel="block", ylabel="max q·k/√d")
    b.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(a, fontsize=8)
    _legend(b, fontsize=8)
    fig.tight_layout()
    return fig


def fig_expert_load(runs: list[Run], names: list[str]) -> MplFigure:
    """MoE routing over training: the busiest expert's load over the uniform share, per layer (1 is balanced)."""
    fig, axes = _grid(len(runs))
    for ax, run, name in zip(axes, runs, names):
        tab = run.probe("moe", ProbeMetric.LOAD_MAX_RATIO)
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


# The learnable scalars a layout may add, as (metric, site filter, label): one panel row per run
LEARNED = (
    ("alpha", None, "DyT α"),
    ("h_mean", None, "residual step h (mean)"),
    ("omega_mean", None, "Admin ω (mean)"),
    ("head_scale_mean", None, "head scale (mean)"),
)


def _learned_series(run: Run) -> list[tuple[str, str]]:
    """(metric, site) pairs of the learnable scalars this run's probes recorded."""
    p = run.probes
    if p.empty:
        return []
    have = p[p.metric.isin([m for m, _, _ in LEARNED])][["metric", "site"]].drop_duplicates()
    return sorted(map(tuple, have.to_numpy().tolist()))


def _has_learned(runs: list[Run]) -> bool:
    return any(_learned_series(run) for run in runs)


def fig_learned(runs: list[Run], names: list[str]) -> MplFigure:
    """The learnable scalars over training, one line per layer: DyT's alpha (Zhu et al.: it tracks 1/std of its
    input), ReZero's / LayerScale's h, Admin's omega, NormFormer's head scales."""
    labels = {m: lab for m, _, lab in LEARNED}
    fig, axes = _grid(len(runs))
    for ax, run, name in zip(axes, runs, names):
        series, values = _learned_series(run), []
        for metric, site in series:
            rows = run.probes[(run.probes.site == site) & (run.probes.metric == metric)]
            layers = sorted(rows.layer.dropna().unique().tolist()) or [None]  # None: a model-level norm
            colors = plt.cm.viridis(np.linspace(0, 0.9, len(layers)))
            style = "-" if site.startswith("attn") else "--" if site.startswith("mlp") else ":"
            for c, layer in zip(colors, layers):
                one = rows[rows.layer.isna()] if layer is None else rows[rows.layer == layer]
                y = one.value.to_numpy(dtype=float)
                values.extend(y.tolist())
                where = site if layer is None else f"{site} L{layer}"
                ax.plot(
                    one.step,
                    y,
                    style,
                    color=c,
                    lw=1,
                    label=f"{labels[metric]} {where}" if len(layers) * len(series) <= 10 else None,
                )
        finite = [v for v in values if math.isfinite(v)]
        if finite and min(finite) > 0 and max(finite) / min(finite) > 20:  # e.g. Admin's omegas: 1 then ~0.02
            ax.set_yscale("log")
        if not series:
            ax.text(0.5, 0.5, "no learnable scalars in this layout", ha="center", va="center", transform=ax.transAxes)
        title = ", ".join(sorted({labels[m] for m, _ in series})) or "learnable scalars"
        ax.set(title=f"{name}: {title}", xlabel="step", ylabel="value (viridis: shallow → deep)")
        if ax.get_legend_handles_labels()[
            0
        ]:  # below the panel: the lines start together and a legend inside hides them
            ax.legend(
                fontsize=6,
                ncol=2,
                loc="upper center",
                bbox_to_anchor=(0.5, -0.22),
                title="solid attn, dashed mlp, dotted other",
                title_fontsize=6,
            )
    fig.tight_layout()
    return fig


TIER_PANELS = (
    (ProbeMetric.STREAM_MAX, "stream's largest |x|", "log"),
    (ProbeMetric.GRAD_NORM, "gradient norm", "log"),
    (ProbeMetric.UPDATE_RATIO, "update / weight norm", "log"),
    (ProbeMetric.MAX_LOGIT, "largest attention logit (sampled)", "linear"),
)


def fig_layers_per_step(runs: list[Run], names: list[str]) -> MplFigure:
    """The per-step tier (layers.jsonl): each panel one metric, a line per layer (viridis: shallow to deep)."""
    # a metric no run recorded is no panel (e.g. a run without attention logits); a run lacking one says so
    panels = [p for p in TIER_PANELS if any(not run.layer_series(p[0]).empty for run in runs)] or list(TIER_PANELS)
    fig, axes = plt.subplots(len(runs), len(panels), figsize=(4.6 * len(panels), 3.2 * len(runs)), squeeze=False)
    for row, run, name in zip(axes, runs, names):
        for ax, (metric, label, scale) in zip(row, panels):
            tab = run.layer_series(metric)
            if tab.empty:
                ax.set_title(f"{name}: {label}")
                ax.text(0.5, 0.5, f"no {metric} in this run", ha="center", va="center", transform=ax.transAxes)
                continue
            colors = plt.cm.viridis(np.linspace(0, 1, max(len(tab.columns), 2)))
            for color, layer in zip(colors, tab.columns):
                ax.plot(tab.index, tab[layer], lw=0.8, color=color)
            positive = bool((tab.to_numpy() > 0).all())
            ax.set(title=f"{name}: {label}", xlabel="step", ylabel=label, yscale=scale if positive else "linear")
            _depth_colorbar(fig, ax, len(tab.columns))
    fig.tight_layout()
    return fig


def _has_layers(runs: list[Run]) -> bool:
    return any(not run.layers.empty for run in runs)


def _has_experts(runs: list[Run]) -> bool:
    return any(not run.probe("moe", ProbeMetric.LOAD_MAX_RATIO).empty for run in runs)


@dataclass(frozen=True)
class Figure:
    """One figure of the run report: its key (the PNG's name and the page anchor), title and drawing."""

    key: str
    title: str
    draw: Callable[[list[Run], list[str]], MplFigure]  # (runs, names) -> a matplotlib Figure
    needs_probes: bool = True  # drawn for the runs that recorded probes; left out when none did
    shown: Callable[[list[Run]], bool] = lambda runs: True  # whether the runs have what it draws


FIGURES: tuple[Figure, ...] = (
    Figure("loss", "Loss and gradient norm", fig_loss, needs_probes=False),
    Figure(
        "variance_by_depth",
        "Hidden-state variance by depth (Kim Fig. 1, 6)",
        lambda r, n: fig_depth(r, n, "var", "variance"),
    ),
    Figure(
        "mean_abs_by_depth",
        "Mean |h| by depth (Kan Fig. 1)",
        lambda r, n: fig_depth(r, n, ProbeMetric.MEAN_ABS, "mean |h|"),
    ),
    Figure("grad_by_layer", "Gradient norm by layer (Kim Fig. 7, Zhuo Fig. 5)", fig_grad_by_layer),
    Figure("top100_fp16", "Massive activations against the FP16 limit (Kim Fig. 11)", fig_top100),
    Figure(
        ProbeMetric.ANGULAR_DISTANCE,
        "Angular distance between layers at the last token (Gromov et al.; Kim Fig. 9, 39)",
        fig_angular,
    ),
    Figure("output_gamma", "Norm γ over training: output norms where the layout has them (Kim Fig. 39b)", fig_gamma),
    Figure("attention_logits", "Attention logits (QK-norm motivation)", fig_attention),
    Figure(
        "learned_scalars",
        "Learnable scalars over training: DyT α, ReZero/LayerScale h, Admin ω, head scales",
        fig_learned,
        shown=_has_learned,
    ),
    Figure("expert_load", "Expert load over training (MoE; Zhuo Sec. 4.3, OLMoE)", fig_expert_load, shown=_has_experts),
    Figure(
        "layers_per_step",
        "Every step, per layer: stream maximum, gradient norm, update/weight ratio, attention "
        "logit (the per-step tier)",
        fig_layers_per_step,
        needs_probes=False,
        shown=_has_layers,
    ),
)
