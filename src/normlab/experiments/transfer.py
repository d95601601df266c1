"""Does a proxy's ranking transfer? Two sweeps over the same placements (layout x lr x seed), a narrow
one (the proxy) and a wider or longer one, each ranked by one rule, then compared.

The rule (`rank_sweep`) is the training evidence of `normlab.recommend.evidence.rank`: fewer failed runs
(diverged + stalled, over the runs finished), then the lower best loss (the mean final loss over seeds
at the candidate's best learning rate), then the lower expected loss over the learning rates
(Wortsman et al. 2024's E_lr[min(L, L_0)]). The screen's verdict, recommend's tie-break, is left out:
it does not depend on the width, so it would order ties the same way in both sweeps and inflate the
agreement. Both sweeps are ranked on the learning rates they share (a proxy that also ran lr 0.1 is not
ranked on failures the wider sweep never had the chance to show), unless `lrs="all"`.

The comparison (`compare`) over the placements ranked in both:
- Kendall's tau-b between the two orders (`scipy.stats.kendalltau`; Kendall 1938, 1945), with its p-value;
- top-1 agreement (the same placement first) and top-3 agreement (|top3(proxy) & top3(other)| / 3);
- pairs ordered oppositely where both sweeps separate them beyond noise (their failure counts differ, or
  their best losses differ by more than the larger seed std, at least `NOISE_FLOOR`, as in recommend);
- failures predicted vs seen, per (placement, lr) cell: a cell failed where any of its seeds diverged
  or stalled; predicted = failed in the proxy, seen = failed in the other sweep;
- where the proxy stored its activations in fp16, the same tally with a second predictor (`warned_cells`):
  a proxy cell also predicts a failure when a seed's largest activation came within `HEADROOM` (8x) of
  the fp16 maximum, 65,504. Why: a stream that grows with width crosses the maximum at the user's width
  before the proxy's does. Pre-LN at lr 3e-2 trained on both proxy seeds at d 64 and overflowed at the
  wider rung twice (docs/results.md, 2026-11-26): on the CPU (6 layers, d 128) after 8,172-9,360 at the
  proxy, on an H200 (16 layers, d 256) after 14-16 thousand; from d 64 to d 128 the largest activations
  that stayed finite grew about 7x. The factor 8 was chosen on those two comparisons (4 missed the CPU one,
  16 flagged a cell that trained), so it is a hypothesis until comparisons it was not fitted on test it.

`normlab transfer PROXY OTHER...` prints `report(...)`: each sweep's scale (width, depth, parameters,
tokens = steps x batch x sequence), the two rankings side by side and the agreement table. Runs still
pending count as nothing; the header says how many of each sweep's runs have finished.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from normlab.diagnostics.stats import FP16_MAX, OVERFLOW_HEADROOM
from normlab.errors import ConfigError
from normlab.experiments.lr_optimum import Optimum, optima, shift
from normlab.experiments.summary import LR, load_sweep, lr_curves, lr_sensitivity
from normlab.runs.outcome import FINISHED

if TYPE_CHECKING:
    from normlab.config.train import TrainConfig

HEADROOM = OVERFLOW_HEADROOM  # a proxy run within this factor of its storage maximum warns of a failure at width
NOISE_FLOOR = 0.01  # nats: recommend's (normlab.recommend.evidence.rank.NOISE_FLOOR); below it two losses are a tie
FAILED = ("diverged", "stalled")
AXES = ["layout", LR, "seed"]


def _same_lr(values: pd.Series, lrs: list[float]) -> pd.Series:
    return values.apply(lambda v: any(math.isclose(float(v), x, rel_tol=1e-9) for x in lrs))


def _lrs_of(runs: pd.DataFrame) -> list[float]:
    return sorted({float(v) for v in runs[LR]}) if len(runs) else []


def shared_lrs(a: pd.DataFrame, b: pd.DataFrame) -> list[float]:
    """The learning rates both sweeps ran (to relative 1e-9)."""
    return [x for x in _lrs_of(a) if any(math.isclose(x, y, rel_tol=1e-9) for y in _lrs_of(b))]


def rank_sweep(runs: pd.DataFrame, lrs: list[float] | None = None) -> pd.DataFrame:
    """One row per placement with a finished run, best first: runs, finished, failed, failure rate, best
    lr, best loss ± std over seeds, expected loss, rank (1 = best). `runs`: `load_sweep`'s table with
    layout, lr and seed axes; `lrs`: only these learning rates (None: all)."""
    missing = [a for a in AXES if a not in runs.columns]
    if missing:
        raise ConfigError(
            f"a transfer sweep needs the grid axes layout, lr and seed; this one lacks {', '.join(missing)}"
        )
    if lrs is not None:
        runs = runs[_same_lr(runs[LR], lrs)] if len(runs) else runs
    curves = lr_curves(runs, AXES)
    sens = lr_sensitivity(curves, AXES)
    rows = []
    for layout, g in runs.groupby("layout", sort=False):
        done = g[g.status.isin(FINISHED)]
        if not len(done):
            continue
        failed = int(done.status.isin(FAILED).sum())
        row: dict[str, Any] = {
            "layout": layout,
            "runs": len(g),
            "finished": len(done),
            "failed": failed,
            "failure_rate": failed / len(done),
            "best_lr": None,
            "best_loss": math.nan,
            "best_loss_std": math.nan,
            "expected_loss": math.nan,
        }
        s = sens[sens.layout == layout] if len(sens) else sens
        if len(s) and s.best_lr.iloc[0] is not None and not pd.isna(s.best_lr.iloc[0]):
            best_lr = float(s.best_lr.iloc[0])
            at_best = curves[(curves.layout == layout) & _same_lr(curves[LR], [best_lr])]
            row.update(
                best_lr=best_lr,
                best_loss=float(s.best_final_loss.iloc[0]),
                best_loss_std=float(at_best.final_loss_std.iloc[0]),
                expected_loss=float(s.expected_capped_loss.iloc[0]),
            )
        elif len(s):
            row["expected_loss"] = float(s.expected_capped_loss.iloc[0])
        rows.append(row)
    columns = [
        "layout",
        "runs",
        "finished",
        "failed",
        "failure_rate",
        "best_lr",
        "best_loss",
        "best_loss_std",
        "expected_loss",
        "rank",
    ]
    if not rows:
        return pd.DataFrame(columns=columns)
    table = pd.DataFrame(rows)
    big = lambda col: table[col].fillna(math.inf)
    table = table.assign(_loss=big("best_loss"), _exp=big("expected_loss"))
    table = table.sort_values(["failure_rate", "_loss", "_exp", "layout"], kind="stable").drop(
        columns=["_loss", "_exp"]
    )
    table["rank"] = range(1, len(table) + 1)
    return table.reset_index(drop=True)[columns]


def failure_cells(runs: pd.DataFrame, lrs: list[float] | None = None) -> dict[tuple[str, float], tuple[int, int]]:
    """(layout, lr) -> (seeds failed, seeds finished), for the cells with a finished run."""
    done = runs[runs.status.isin(FINISHED)] if len(runs) else runs
    if lrs is not None and len(done):
        done = done[_same_lr(done[LR], lrs)]
    return (
        {
            (layout, float(lr)): (int(g.status.isin(FAILED).sum()), len(g))
            for (layout, lr), g in done.groupby(["layout", LR], sort=True)
        }
        if len(done)
        else {}
    )


def warned_cells(
    runs: pd.DataFrame, storage_max: float, lrs: list[float] | None = None
) -> dict[tuple[str, float], tuple[int, int]]:
    """`failure_cells` with a finished seed counted as failed also when its largest activation reached
    ``storage_max / HEADROOM`` (the fp16 headroom predictor; see the module docstring)."""
    if not len(runs) or "max_activation" not in runs.columns:
        return failure_cells(runs, lrs)
    warn = runs.status.isin(FINISHED) & (runs.max_activation.fillna(0) >= storage_max / HEADROOM)
    flagged = runs.assign(status=runs.status.where(~warn, "diverged"))  # a warned seed counts as failed
    return failure_cells(flagged, lrs)


def _decided(a: pd.Series, b: pd.Series) -> bool:
    """Whether one sweep tells placements a and b apart beyond noise (recommend's rule)."""
    if a.failure_rate != b.failure_rate:
        return True
    if not (math.isfinite(a.best_loss) and math.isfinite(b.best_loss)):
        return math.isfinite(a.best_loss) != math.isfinite(b.best_loss)
    stds = [s for s in (a.best_loss_std, b.best_loss_std) if math.isfinite(s)]
    return abs(a.best_loss - b.best_loss) > max([NOISE_FLOOR, *stds])


@dataclass
class Agreement:
    """How the other sweep's ranking agrees with the proxy's, over the placements ranked in both."""

    proxy_order: list[str]  # the placements ranked in both sweeps, in each one's order
    other_order: list[str]
    lrs: list[float] | None  # the learning rates ranked (None: each sweep's own)
    tau: float = math.nan
    p_value: float = math.nan
    top1: bool | None = None
    top3: float = math.nan  # overlap fraction of the two top-k, k = min(3, placements)
    k: int = 0
    discordant: list[tuple[str, str]] = field(default_factory=list)  # ordered oppositely
    discordant_beyond_noise: list[tuple[str, str]] = field(
        default_factory=list
    )  # ... and separated beyond noise in both
    failures: dict[str, int] = field(default_factory=dict)  # predicted_and_seen, predicted_only, seen_only, neither
    cells_disagreeing: list[str] = field(default_factory=list)  # "layout @ lr: proxy k/n, other k/n"
    failures_with_headroom: dict[str, int] | None = None  # the same, failed or within HEADROOM of fp16 (fp16 only)

    @property
    def layouts(self) -> list[str]:
        return self.proxy_order

    @property
    def pairs(self) -> int:
        return len(self.layouts) * (len(self.layouts) - 1) // 2


def order_agreement(proxy_order: list[str], other_order: list[str], lrs: list[float] | None = None) -> Agreement:
    """Kendall's tau-b, its p-value, top-1 and top-3 agreement between two orders of the same placements
    (`normlab recommend --verify` compares its ranking with the wider runs' through this)."""
    from scipy.stats import kendalltau

    pa, pb = list(proxy_order), list(other_order)
    if set(pa) != set(pb):
        raise ValueError(f"two orders of different placements: {pa} and {pb}")
    out = Agreement(proxy_order=pa, other_order=pb, lrs=lrs)
    if len(pa) >= 2:
        pos_b = {x: i for i, x in enumerate(pb)}
        result = kendalltau(list(range(len(pa))), [pos_b[x] for x in pa])
        out.tau, out.p_value = float(result.statistic), float(result.pvalue)
    if pa:
        out.top1 = pa[0] == pb[0]
        out.k = min(3, len(pa))
        out.top3 = len(set(pa[: out.k]) & set(pb[: out.k])) / out.k
    out.discordant = [(x, y) for i, x in enumerate(pa) for y in pa[i + 1 :] if pb.index(x) > pb.index(y)]
    return out


def failure_tally(
    cells_a: dict[tuple[str, float], tuple[int, int]],
    cells_b: dict[tuple[str, float], tuple[int, int]],
) -> tuple[dict[str, int], list[str]]:
    """Failures predicted (a cell failed in `cells_a`) vs seen (in `cells_b`), over the cells both hold
    (`failure_cells`): the four counts, and the cells where they disagree in words."""
    tally = {"predicted_and_seen": 0, "predicted_only": 0, "seen_only": 0, "neither": 0}
    disagree = []
    for cell in sorted(set(cells_a) & set(cells_b)):
        predicted, seen = cells_a[cell][0] > 0, cells_b[cell][0] > 0
        key = (
            ("predicted_and_seen" if seen else "predicted_only") if predicted else ("seen_only" if seen else "neither")
        )
        tally[key] += 1
        if predicted != seen:
            disagree.append(
                f"{cell[0]} @ lr {cell[1]:g}: proxy {cells_a[cell][0]}/{cells_a[cell][1]} "
                f"failed, other {cells_b[cell][0]}/{cells_b[cell][1]}"
            )
    return tally, disagree


def compare(
    proxy: pd.DataFrame, other: pd.DataFrame, lrs: str = "common", storage_max: float | None = None
) -> Agreement:
    """`proxy` and `other`: `load_sweep` tables (layout x lr x seed). `lrs`: "common" ranks both on the
    learning rates they share; "all" ranks each on all it ran (failures are compared on the shared ones).
    `storage_max`: the proxy's activation storage maximum where it is fp16 (65504), which adds the
    headroom predictor's tally (`warned_cells`)."""
    if lrs not in ("common", "all"):
        raise ValueError(f"lrs must be 'common' or 'all', got {lrs!r}")
    common = shared_lrs(proxy, other)
    chosen = common if lrs == "common" else None
    a, b = rank_sweep(proxy, chosen), rank_sweep(other, chosen)
    both = [x for x in a.layout if x in set(b.layout)]
    a_sub = a[a.layout.isin(both)].reset_index(drop=True)
    b_sub = b[b.layout.isin(both)].reset_index(drop=True)
    out = order_agreement(list(a_sub.layout), list(b_sub.layout), chosen)
    row_a = {r.layout: r for r in a_sub.itertuples(index=False)}
    row_b = {r.layout: r for r in b_sub.itertuples(index=False)}
    out.discordant_beyond_noise = [
        (x, y)
        for x, y in out.discordant  # the proxy puts x ahead of y
        if _decided(row_a[x], row_a[y]) and _decided(row_b[x], row_b[y])
    ]
    out.failures, out.cells_disagreeing = failure_tally(failure_cells(proxy, common), failure_cells(other, common))
    if storage_max is not None:
        warned = warned_cells(proxy, storage_max, common)
        out.failures_with_headroom = failure_tally(warned, failure_cells(other, common))[0]
    return out


def sweep_scale(path: str | Path) -> dict[str, Any]:
    """A sweep's scale from its first run's config: width, depth, parameters (analytic, of its first
    placement), steps, tokens per run (steps x batch x sequence), how many runs have finished, and the
    storage maximum where its activations are stored in fp16 (65504, else None: no headroom predictor)."""
    from normlab.runs.files import SweepDir
    from normlab.runs.store import open_store

    sweep = SweepDir(Path(path))
    rows = open_store(sweep, readonly=True).rows()  # a reader: sweeps on read-only storage compare too
    if not rows:
        return {"runs": 0, "finished": 0, "storage_max": None}
    done = [r for r in rows if r["status"] in FINISHED]
    devices, unnamed = run_devices(sweep, done)
    return {
        "runs": len(rows),
        "finished": len(done),
        "devices": devices,
        "unnamed_runs": unnamed,
        **config_scale(rows[0]["config"]),
    }


def run_devices(sweep: Any, rows: list[dict[str, Any]]) -> tuple[list[str], int]:
    """The devices the finished runs trained on, by name (each run's summary.json `device_name`), sorted, and how
    many of the runs name none (trained before summaries named their device): a rung's figures with the device
    named, whichever lease ran them, and never a name stretched over runs it does not cover."""
    names, unnamed = set(), 0
    for r in rows:
        summary = sweep.run(r["run_id"]).read_summary()
        if summary is not None and summary.device_name is not None:
            names.add(summary.device_name)
        else:
            unnamed += 1
    return sorted(names), unnamed


def config_scale(cfg: TrainConfig) -> dict[str, Any]:
    """A run config's scale (`sweep_scale`'s keys past the run counts)."""
    from normlab.model.params import analytic_params

    model = cfg.model.model_config()
    params = analytic_params(model.with_(vocab_size=cfg.expected_vocab), cfg.model.resolved).total
    tokens = cfg.optim.steps * cfg.data.batch_size * cfg.data.seq_len
    return {
        "d_model": model.d_model,
        "n_layers": model.n_layers,
        "params": params,
        "steps": cfg.optim.steps,
        "tokens": tokens,
        "storage_max": FP16_MAX if cfg.stored_dtype == "fp16" else None,
        # what the rung trained under, for recommend's "where the evidence ends" (normlab.model.parametrization)
        "parametrization": model.parametrization,
        "base_d_model": model.base_d_model,
        "base_n_layers": model.base_n_layers,
        "precision": cfg.stored_dtype,
        "optimizer": cfg.optim.optimizer,
    }


def shape_of(scale: dict[str, Any]) -> dict[str, Any]:
    """A rung's shape as the transfer record keeps it: width, depth, tokens per run, and what it trained under."""
    keys = ("d_model", "n_layers", "tokens", "parametrization", "precision", "optimizer")
    shape = {k: scale.get(k) for k in keys}
    if scale.get("devices"):  # where the rung ran (absent where no run named it), and how many runs did not say
        shape["devices"] = scale["devices"]
        if scale.get("unnamed_runs"):
            shape["unnamed_runs"] = scale["unnamed_runs"]
    return shape


def best_lrs(runs: pd.DataFrame, lrs: list[float] | None = None) -> dict[str, float | None]:
    """Each placement's best learning rate in a sweep (the lowest mean final loss over seeds among its
    non-failed cells, as `rank_sweep` ranks; None where every cell failed)."""
    table = rank_sweep(runs, lrs)
    return {
        r.layout: (None if r.best_lr is None or pd.isna(r.best_lr) else float(r.best_lr)) for r in table.itertuples()
    }


def lr_optima(runs: pd.DataFrame) -> dict[str, Optimum]:
    """Each placement's learning-rate optimum over every rate the sweep ran (`normlab.experiments.lr_optimum`)."""
    if not len(runs):
        return {}
    grids = {str(k): [float(v) for v in g[LR]] for k, g in runs.groupby("layout", sort=False)}  # `optimum` sorts
    return optima(lr_curves(runs, AXES), grids)


def optimum_shifts(proxy: pd.DataFrame, other: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per placement in both sweeps: the proxy's and the other rung's optimum and the factor between them."""
    a, b = lr_optima(proxy), lr_optima(other)
    return {x: {"proxy": a[x].to_json(), "other": b[x].to_json(), **shift(a[x], b[x])} for x in a if x in b}


def _shift_words(layout: str, s: dict[str, Any]) -> str:
    def rate(o: dict[str, Any]) -> str:
        return f"{o['lr']:.2g}" + ("" if o["edge"] is None else f" ({o['edge']} end of the grid)")

    kind = {"measured": "", "at least": "at least ", "at most": "at most "}.get(s["kind"], "unbounded: ")
    return f"{layout} {rate(s['proxy'])} -> {rate(s['other'])} ({kind}x{s['factor']:.2f})"


def _fmt_loss(r: pd.Series) -> str:
    loss, std = float(r.best_loss), float(r.best_loss_std)
    if not math.isfinite(loss):
        return "-"
    return f"{loss:.3f}" + (f" ± {std:.3f}" if math.isfinite(std) else "") + f" @ {r.best_lr:g}"


def _scale_words(name: str, s: dict[str, Any]) -> str:
    if not s.get("runs"):
        return f"{name}: no runs"
    return (
        f"{name}: d {s['d_model']}, {s['n_layers']} layers, {s['params'] / 1e6:.2f}M params, {s['steps']} steps "
        f"({s['tokens']:,} tokens a run); {s['finished']} of {s['runs']} runs finished"
        + (f" on {' + '.join(s['devices'])}" if s.get("devices") else "")
        + (f" ({s['unnamed_runs']} of them name no device)" if s.get("devices") and s.get("unnamed_runs") else "")
    )


def _tally(f: dict[str, int]) -> str:
    return f" {f['predicted_and_seen']} / {f['predicted_only']} / {f['seen_only']} / {f['neither']} |"


def report(proxy_dir: str | Path, others: Sequence[str | Path], lrs: str = "common") -> str:
    """The comparison as markdown: each sweep's scale, the rankings side by side, the agreement table."""
    proxy_dir = Path(proxy_dir)
    proxy, _ = load_sweep(proxy_dir)
    scale = sweep_scale(proxy_dir)
    limit = scale["storage_max"]
    lines = [
        "# Transfer: does the proxy's ranking hold?",
        "",
        f"- proxy: {_scale_words(proxy_dir.name, scale)}",
    ]
    results = []
    for path in map(Path, others):
        other, _ = load_sweep(path)
        lines.append(f"- {_scale_words(path.name, sweep_scale(path))}")
        results.append((path.name, other, compare(proxy, other, lrs, limit)))
    lines += [
        "",
        "Ranked by failed runs (diverged + stalled) first, then best loss (mean over seeds at the best lr), "
        "then expected loss over the lrs; "
        + (
            "on the learning rates both sweeps ran."
            if lrs == "common"
            else "each sweep on all the learning rates it ran."
        ),
        "",
    ]
    headroom = f"with fp16 headroom < {HEADROOM:g}x also predicting" if limit is not None else ""
    summary = [
        "| against | placements | Kendall tau (p) | top-1 | top-3 | discordant pairs (beyond noise) | "
        "failures: predicted & seen / predicted only / seen only / neither |" + (f" {headroom} |" if headroom else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if headroom else ""),
    ]
    for name, other, agree in results:
        a = rank_sweep(proxy, agree.lrs).set_index("layout")
        b = rank_sweep(other, agree.lrs).set_index("layout")
        lr_words = (
            "each its own"
            if agree.lrs is None
            else ", ".join(f"{x:g}" for x in agree.lrs) or "none shared: give --lrs all to rank each on its own"
        )
        lines += [
            f"## proxy vs {name} (lrs {lr_words})",
            "",
            "| placement | proxy rank | proxy failed | proxy best loss | rank | failed | best loss |",
            "|---|---|---|---|---|---|---|",
        ]
        for x in agree.layouts:
            ra, rb = a.loc[x], b.loc[x]
            lines.append(
                f"| {x} | {int(ra['rank'])} | {int(ra.failed)}/{int(ra.finished)} | {_fmt_loss(ra)} | "
                f"{int(rb['rank'])} | {int(rb.failed)}/{int(rb.finished)} | {_fmt_loss(rb)} |"
            )
        if agree.cells_disagreeing:
            lines += ["", "Failures that disagree: " + "; ".join(agree.cells_disagreeing) + "."]
        moved = optimum_shifts(proxy, other)
        if moved:
            lines += [
                "",
                "Learning-rate optimum, proxy -> this rung (the vertex of a parabola in log lr through each sweep's "
                "best rate and its neighbours, over all the rates each ran): "
                + "; ".join(_shift_words(x, m) for x, m in moved.items())
                + ".",
            ]
        lines.append("")
        tau = "-" if math.isnan(agree.tau) else f"{agree.tau:+.2f} ({agree.p_value:.2f})"
        top1 = "-" if agree.top1 is None else ("yes" if agree.top1 else "no")
        top3 = "-" if math.isnan(agree.top3) else f"{round(agree.top3 * agree.k)}/{agree.k}"
        summary.append(
            f"| {name} | {len(agree.layouts)} | {tau} | {top1} | {top3} | {len(agree.discordant)}/{agree.pairs} "
            f"({len(agree.discordant_beyond_noise)}) |"
            + _tally(agree.failures)
            + (_tally(agree.failures_with_headroom) if agree.failures_with_headroom is not None else "")
        )
    return "\n".join(lines + ["## Agreement", "", *summary, ""])


def record(
    path: str | Path, proxy_dir: str | Path, others: Sequence[str | Path], lrs: str = "common"
) -> dict[str, Any]:
    """Write (or update) a transfer record at `path`: per (proxy, other) pair the agreement numbers and the
    command that produced them, and the study's status ("in progress, N of M runs" while runs are pending).
    `normlab recommend`'s report renders the copy shipped in the package
    (normlab/recommend/evidence/transfer_record.json)."""
    import json
    import shlex

    from normlab.io import atomic_write_json

    path = Path(path)
    old: dict[str, Any] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        if not isinstance(old, dict) or not isinstance(old.get("comparisons"), list):
            raise ConfigError(f"--record {path} exists and is not a transfer record; give a new file or a record")
    proxy_dir = Path(proxy_dir)
    proxy, _ = load_sweep(proxy_dir)
    kept = {(c["proxy"], c["other"]): c for c in old.get("comparisons", [])}
    scales = {proxy_dir.name: sweep_scale(proxy_dir)}
    limit = scales[proxy_dir.name]["storage_max"]
    for other_dir in map(Path, others):
        other, _ = load_sweep(other_dir)
        scales[other_dir.name] = sweep_scale(other_dir)
        a = compare(proxy, other, lrs, limit)
        finite = lambda x: None if x is None or (isinstance(x, float) and math.isnan(x)) else x
        kept[proxy_dir.name, other_dir.name] = {
            "proxy": proxy_dir.name,
            "other": other_dir.name,
            "placements": len(a.layouts),
            "tau": finite(a.tau),
            "p_value": finite(a.p_value),
            "top1": a.top1,
            "top3": finite(a.top3),
            "k": a.k,
            "failures": a.failures,
            "failures_with_headroom": a.failures_with_headroom,
            "discordant_beyond_noise": [list(x) for x in a.discordant_beyond_noise],
            # the parametrization the wider rung trained under (the proxy at its base shape is SP whatever it
            # names), both rungs' shapes, and each placement's best learning rate over all the rates each ran
            "parametrization": scales[other_dir.name].get("parametrization", "sp"),
            "proxy_shape": shape_of(scales[proxy_dir.name]),
            "other_shape": shape_of(scales[other_dir.name]),
            "best_lr": {"proxy": best_lrs(proxy), "other": best_lrs(other)},
            # where between the grid's rates the optimum lies at each rung, and the factor it moved
            "lr_optimum": optimum_shifts(proxy, other),
            "finished": {
                n: [scales[n].get("finished", 0), scales[n].get("runs", 0)] for n in (proxy_dir.name, other_dir.name)
            },
            "command": "normlab transfer "
            + " ".join(shlex.quote(str(x)) for x in [proxy_dir, *others])
            + ("" if lrs == "common" else f" --lrs {lrs}"),
        }
    comparisons = sorted(kept.values(), key=lambda c: (c["proxy"], c["other"]))
    counts: dict[str, list[int]] = {}
    for c in comparisons:
        counts.update(c["finished"])
    done, total = sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())
    out = {
        **{k: v for k, v in old.items() if k not in ("comparisons", "status")},
        "status": "complete" if done == total and total else f"in progress, {done} of {total} runs",
        "comparisons": comparisons,
    }
    atomic_write_json(path, out)
    return out


__all__ = [
    "Agreement",
    "compare",
    "failure_cells",
    "failure_tally",
    "order_agreement",
    "rank_sweep",
    "record",
    "report",
    "shared_lrs",
    "sweep_scale",
    "warned_cells",
]
