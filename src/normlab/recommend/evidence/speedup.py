"""Effective speedup: the compute the user's placement needs to reach a candidate's loss, per unit of the
candidate's compute, after what the candidate costs per step (recommendation.json's `effect.speedup`).

This is the unit marin promotes architecture changes in (marin-community/marin: "effective speedup", issue
4993: a sandwich norm at 0.83x failed its gate). At the proxy both sides train the same tokens T, so

    speedup = T_base(L_cand) / T  x  t_step(base) / t_step(cand)          (1)

T_base(L) is read off the baseline's own loss-over-tokens curve: the mean of its seeds' training losses
(each smoothed over `SMOOTH` steps, as the runs' final loss is their last 10 steps' mean), fitted from
`FIT_FROM` of the run onward by a saturating power law

    L(t) = E + A t^(-alpha),   A > 0, 0 < alpha <= 2, E >= 0                (2)

(Kaplan et al. 2020 eq. 1.4's form in data; scipy.optimize.curve_fit) and inverted:
T_base(L) = (A / (L - E))^(1/alpha). A candidate better than the baseline needs the fit beyond T: it is
read up to `EXTRAPOLATE` x T, past that (or below the fit's floor E) the speedup is a lower bound (">= x2.00");
a candidate worse than the baseline's loss at `FIT_FROM` x T lies before the fitted range: an upper bound
("<= x0.25").
The step-time ratio of (1) is the norm tax measured at the user's width (`normlab.recommend.evidence.tax`).

Anchoring: the candidate's loss is placed at L_fit(T) + d, d = mean(cand) - mean(base) of the runs' final
losses, so a candidate equal to the baseline has a token ratio of exactly 1 whatever the fit's residual at T.

Interval: the ends of the 95% interval of d over seeds mapped through the same
monotone curve, each then divided by the tax interval's matching end (the worse end with the worse end: a
conservative combination of two independent intervals); the interval of d is Student's t with the seed noise
pooled over every finished cell of the grid (`pooled_interval`) where that has more degrees of freedom than
Welch's on the two cells alone (`answer.welch`; two seeds a side leave it one or two); an end that reached a
bound is said as one
(`interval_bounded`). The fit's own uncertainty is not in it. One seed on a side measures no seed noise: no
interval, said so with the budget that would buy it.

Caveat stated with every figure: the curve is one run's, under its cosine schedule. A loss read mid-run lies
above what a run annealed at that length reaches, so T_base(L) read mid-run overstates the baseline's tokens:
a speedup below 1 (read mid-run) is at most that, i.e. the candidate is at least that much slower; a speedup
above 1 reads the fit beyond T, whose tail follows the run's annealed end.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric

SMOOTH = 10  # steps in the moving mean of the training loss (the runs' final loss is their last 10 steps' mean)
FIT_FROM = 0.25  # the fit starts a quarter into the run: past the warm-up (10%) and the first fast drop
EXTRAPOLATE = 2.0  # the baseline's fitted curve is read at most this far beyond the tokens it trained
LEVEL = 0.95


@dataclass(frozen=True)
class Curve:
    """Eq. (2) fitted to a loss-over-tokens curve: its parameters, the tokens trained, its value there."""

    e: float
    a: float
    alpha: float
    tokens: float  # T: the last point fitted
    at_end: float  # L_fit(T)
    rmse: float  # the fit's root-mean-square residual over the points fitted

    def loss(self, t: float) -> float:
        return float(self.e + self.a * t ** (-self.alpha))

    def tokens_for(self, target: float) -> float:
        """T(L) (eq. 2 inverted); inf where `target` is at or below the floor E."""
        if target <= self.e:
            return math.inf
        return float((self.a / (target - self.e)) ** (1.0 / self.alpha))


def smoothed_curve(rows: list[dict[str, Any]], window: int = SMOOTH) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss) of the training rows with a finite loss, the loss as a trailing mean over `window` steps."""
    pts = [
        (float(r[Metric.TOKENS]), float(r[Metric.LOSS]))
        for r in rows
        if Metric.LOSS in r
        and Metric.TOKENS in r
        and isinstance(r[Metric.LOSS], int | float)
        and math.isfinite(r[Metric.LOSS])
    ]
    if not pts:
        return np.zeros(0), np.zeros(0)
    t, y = (np.array(c) for c in zip(*pts))
    c = np.cumsum(np.insert(y, 0, 0.0))
    n = np.minimum(np.arange(1, len(y) + 1), window)
    return t, (c[1:] - c[np.arange(1, len(y) + 1) - n]) / n


def mean_curve(run_dirs: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The seeds' smoothed curves averaged on their common tokens (runs of one cell train the same tokens)."""
    curves = [smoothed_curve(RunDir(p).metrics()) for p in run_dirs]
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return np.zeros(0), np.zeros(0)
    # aligned on the tokens every seed reached with a finite loss (a dropped row shifts no seed)
    common = sorted(set.intersection(*(set(c[0].tolist()) for c in curves)))
    at = [dict(zip(c[0].tolist(), c[1].tolist())) for c in curves]
    return np.array(common), np.array([np.mean([a[t] for a in at]) for t in common])


def fit_curve(tokens: np.ndarray, loss: np.ndarray, fit_from: float = FIT_FROM) -> Curve | None:
    """Eq. (2) fitted to the points from `fit_from` of the tokens onward (None where fewer than 5 points or
    the fit does not converge)."""
    from scipy.optimize import curve_fit

    keep = tokens >= fit_from * tokens[-1] if len(tokens) else tokens.astype(bool)
    t, y = tokens[keep], loss[keep]
    if len(t) < 5 or not np.all(np.isfinite(y)):
        return None
    scale = float(t[-1])  # fit in t / T: parameters of order 1

    def f(x: np.ndarray, e: float, a: float, alpha: float) -> np.ndarray:
        return e + a * x ** (-alpha)

    lo = float(y.min())
    start = (0.5 * lo, max(float(y[0] - 0.5 * lo), 1e-3), 0.5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (e, a, alpha), _ = curve_fit(
                f, t / scale, y, p0=start, bounds=([0.0, 1e-9, 1e-3], [lo, np.inf, 2.0]), maxfev=20000
            )
    except (RuntimeError, ValueError):
        return None
    a_abs = float(a) * scale ** float(alpha)  # A in tokens: a (t/T)^-alpha = a T^alpha t^-alpha
    resid = y - f(t / scale, e, a, alpha)
    curve = Curve(float(e), a_abs, float(alpha), float(t[-1]), 0.0, float(np.sqrt(np.mean(resid**2))))
    return Curve(curve.e, curve.a, curve.alpha, curve.tokens, curve.loss(curve.tokens), curve.rmse)


def token_ratio(curve: Curve, difference: float, extrapolate: float = EXTRAPOLATE) -> tuple[float, str | None]:
    """T_base(L_fit(T) + d) / T and which bound it is: "lower" past `extrapolate` x T or below the floor (the
    value `extrapolate`), "upper" before the fitted range (`FIT_FROM` x T: the value `FIT_FROM`), else None."""
    t = curve.tokens_for(curve.at_end + difference)
    r = t / curve.tokens
    if r > extrapolate:
        return extrapolate, "lower"
    if r < FIT_FROM:
        return FIT_FROM, "upper"
    return r, None


def speedup(
    curve: Curve,
    difference: float,
    interval: list[float] | None,
    tax: float,
    tax_interval: list[float] | None,
    extrapolate: float = EXTRAPOLATE,
) -> dict[str, Any]:
    """Eq. (1) and its interval (module doc). `difference`: mean(cand) - mean(base) final loss; `tax`: the
    candidate's step time over the baseline's, minus 1."""
    r, bound = token_ratio(curve, difference, extrapolate)
    value = r / (1.0 + tax)
    out: dict[str, Any] = {"value": value, "token_ratio": r, "bound": bound}
    if interval is None:
        out["interval"] = None
        return out
    t_lo, t_hi = tax_interval if tax_interval is not None else (tax, tax)
    # a higher loss difference means fewer baseline tokens: the interval's upper end gives the speedup's lower
    r_lo, b_lo = token_ratio(curve, interval[1], extrapolate)
    r_hi, b_hi = token_ratio(curve, interval[0], extrapolate)
    out["interval"] = [r_lo / (1.0 + t_hi), r_hi / (1.0 + t_lo)]
    out["interval_bounded"] = [b_lo, b_hi]  # an end that reached a bound ("lower" / "upper") is itself one
    return out


def words(s: dict[str, Any]) -> str:
    """ "x1.12 [1.04, 1.21] of compute at the proxy, after a 3.1% slower step" """
    if s.get("value") is None:
        return str(s.get("why", "no speedup measured"))
    v = s["value"]
    text = {"lower": ">= ", "upper": "<= "}.get(s.get("bound") or "", "") + f"x{v:.2f}"
    iv = s.get("interval")
    if iv is not None:
        ends = s.get("interval_bounded") or [None, None]
        lo = ("<= " if ends[0] == "upper" else "") + f"{iv[0]:.2f}"
        hi = (">= " if ends[1] == "lower" else "") + f"{iv[1]:.2f}"
        text += f" [{lo}, {hi}]"
    else:
        text += " (no interval: one seed on a side)"
    text += f" of compute at width {s['width']}, the ladder's widest" if s.get("width") else " of compute at the proxy"
    tax = s.get("tax") or {}
    if tax.get("value") is not None:
        pct = 100 * tax["value"]
        how = "slower" if pct >= 0 else "faster"
        text += f", after a {abs(pct):.1f}% {how} step ({tax.get('mode', 'eager')}, {tax.get('device', '?')})"
    return text


def cell_dirs(runs: Any, grid: Path, layout: str, lr: float) -> list[Path]:
    """The run folders of a finished cell (layout at lr, status ok), in seed order."""
    cell = runs[(runs.layout == layout) & ((runs.lr - lr).abs() <= 1e-9 * lr) & (runs.status == "ok")]
    cell = cell.sort_values("seed")
    if "run_dir" in cell:  # runs gathered from several sweeps (the ladder's) name their folders
        return [Path(p) for p in cell.run_dir]
    return [grid / "runs" / str(r) for r in cell.run_id]


def gathered(folders: list[Path]) -> pd.DataFrame | None:
    """The runs of several sweep folders (the ladder's at one width, the held-out rung's: one per learning
    rate) in one table, each naming its own folder (`run_dir`, read by `cell_dirs`); None where none holds a
    store."""
    from normlab.experiments.summary import load_sweep
    from normlab.runs.files import SweepDir

    frames = []
    for folder in folders:
        if SweepDir(folder).store_file.is_file():
            df, _ = load_sweep(folder)
            frames.append(df.assign(run_dir=[str(folder / "runs" / str(r)) for r in df.run_id]))
    return pd.concat(frames, ignore_index=True) if frames else None


def pooled_interval(runs: Any, a: list[float], b: list[float], level: float = LEVEL) -> tuple[list[float], int] | None:
    """mean(a) - mean(b)'s interval with the seed noise pooled over every finished cell (layout x learning rate)
    of `runs` with two or more seeds: s^2 = sum over cells of sum (x - cell mean)^2 / sum (n - 1), Student's t
    with sum (n - 1) degrees of freedom (the within-cell mean square of a two-way layout). Two seeds a cell
    leave Welch one or two degrees of freedom (t = 12.7 to 4.3); the grid's cells share the proxy and the
    data, so their seed noise is one quantity. None where the pool has no degree of freedom or no spread."""
    from scipy import stats

    ok = runs[runs.status == "ok"]
    ss, df = 0.0, 0
    for _, cell in ok.groupby(["layout", "lr"]):
        x = np.asarray(pd.to_numeric(cell.final_loss, errors="coerce"), dtype=float)
        x = x[np.isfinite(x)]
        if len(x) >= 2:
            ss += float(((x - x.mean()) ** 2).sum())
            df += len(x) - 1
    if df == 0 or ss == 0:
        return None
    d = sum(a) / len(a) - sum(b) / len(b)
    half = float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(ss / df * (1 / len(a) + 1 / len(b)))
    return [d - half, d + half], df


def cell_compute(runs: Any, grid: Path, layout: str, lr: float) -> float | None:
    """The FLOPs of the cell's first finished run (summary.json's flops_per_token x tokens)."""
    dirs = cell_dirs(runs, grid, layout, lr)
    s = RunDir(dirs[0]).read_summary() if dirs else None
    if s is None or not s.flops_per_token or not s.tokens:
        return None
    return float(s.flops_per_token) * float(s.tokens)


def for_pair(
    runs: Any, grid: Path, base: Any, cand: Any, tax: dict[str, Any] | None, width: int, depth: int
) -> dict[str, Any]:
    """recommendation.json's `effect.speedup` for `cand` against `base` (two `rank.Evidence` rows, each at its
    best learning rate) from the proxy grid's runs (`runs`: the grid's runs table), with its rung."""
    from normlab.recommend.evidence.answer import _losses, welch, welch_df

    out: dict[str, Any] = {"baseline": base.layout, "candidate": cand.layout, "tax": tax, "level": LEVEL}
    out["method"] = (
        "eq. (1) of normlab.recommend.evidence.speedup: the tokens your placement needs to reach the candidate's "
        "final loss "
        "on its own loss-over-tokens curve (mean over seeds, fitted as E + A t^-alpha from a quarter of the run, "
        f"read at most {EXTRAPOLATE:g}x beyond the tokens trained, else a bound), over the candidate's tokens, "
        "divided by 1 + the norm tax; interval: the ends of the 95% interval of the final-loss difference over "
        "seeds (the seed noise pooled over the grid's finished cells where that has more degrees of freedom than "
        "Welch's on the two cells: `noise`) mapped through that curve, each divided by the tax interval's "
        "matching end. One run's curve under a cosine schedule: read mid-run its loss lies above an annealed "
        "run's, so a speedup below 1 is at most that"
    )
    if base.best_lr is None or cand.best_lr is None:
        who = base.layout if base.best_lr is None else cand.layout
        return {**out, "value": None, "interval": None, "why": f"{who} finished no run"}
    a, b = _losses(runs, cand.layout, cand.best_lr), _losses(runs, base.layout, base.best_lr)
    dirs = cell_dirs(runs, grid, base.layout, base.best_lr)
    if not a or not b or not dirs:
        return {**out, "value": None, "interval": None, "why": "no finished run at a best learning rate"}
    d, interval = welch(a, b)
    pooled = pooled_interval(runs, a, b)
    if pooled is not None and (interval is None or pooled[1] > welch_df(a, b)):
        interval, out["noise"] = pooled[0], f"pooled over the finished cells' seeds ({pooled[1]} degrees of freedom)"
    else:
        out["noise"] = "Welch's, from the two cells' own seeds" if interval is not None else None
    tokens, loss = mean_curve(dirs)
    curve = fit_curve(tokens, loss)
    if curve is None:
        return {**out, "value": None, "interval": None, "why": "your placement's loss curve could not be fitted"}
    t = (tax or {}).get("value")
    s = speedup(curve, d, interval, t or 0.0, (tax or {}).get("interval"))
    if t is None:
        s["why_tax"] = "the norm tax was not measured: the speedup is in tokens alone"
    seeds = [len(a), len(b)]
    rung = {
        "width": width,
        "depth": depth,
        "tokens": float(curve.tokens),
        "value": s["value"],
        "interval": s.get("interval"),
        "seeds": seeds,
    }
    curve_said = {"e": curve.e, "a": curve.a, "alpha": curve.alpha, "tokens": curve.tokens, "rmse": curve.rmse}
    out.update(s, difference=d, seeds=seeds, curve=curve_said, by_scale=[rung])
    out["projection"] = {
        "scale": None,
        "value": None,
        "interval": None,
        "why": "one rung (the proxy): a trend over scale needs three or more rungs; this answer holds at the proxy",
    }
    if interval is None:
        out["why_interval"] = "one seed on a side: no seed noise measured, so no interval; " + (
            "a second seed of both sides comes first in a larger --budget (or run the same command again)"
        )
    return out
