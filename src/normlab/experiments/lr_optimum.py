"""Where a learning-rate sweep's optimum lies between its grid points, and how far it moved between two rungs.

A grid of rates 3x apart names the best rate only to within a factor of 3: two rungs whose true optima differ by
x1.3 can report best rates 3x apart (transfer-sp-w64 -> transfer-mup-w256, Pre-LN: 3e-3 -> 1e-2), and two whose
optima differ by x2.9 can report the same one. Learning-rate sweeps are read instead by a fit of the loss against
log lr near the minimum (the loss is close to a parabola in log lr around its optimum: Wortsman et al. 2024,
"Small-scale proxies for large-scale Transformer training instabilities", Fig. 1; the muP papers' transfer
figures, Yang et al. 2022, read the same curves). `optimum` fits the parabola through the grid's best cell and its
two neighbours (each the mean final loss over the cell's trained seeds, as `normlab.experiments.summary.lr_curves`)
and returns its vertex:

    x = log10 lr,  L(x) = a x^2 + b x + c through the three points,  x* = -b / (2 a),  lr* = 10^x*

Where the best cell is an end of the grid (or a neighbour failed on every seed) the optimum is not bracketed:
`optimum` returns the grid's best with ``bracketed`` False, and a shift computed from it is a bound, said so. Three
points determine the parabola exactly, so the fit has no residual to give an interval; its uncertainty is the
seeds' spread at those cells (`normlab transfer` prints both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from normlab.experiments.summary import LR


@dataclass(frozen=True)
class Optimum:
    """One placement's optimum in one sweep: ``lr`` (the vertex, or the grid's best where not bracketed),
    ``grid_lr`` (the best grid rate) and ``edge``: None where the grid brackets it, else "low" or "high" (the
    true optimum lies at or below / at or above ``lr``)."""

    lr: float
    grid_lr: float
    edge: str | None = None

    @property
    def bracketed(self) -> bool:
        return self.edge is None

    def to_json(self) -> dict[str, float | str | None]:
        return {"lr": self.lr, "grid_lr": self.grid_lr, "edge": self.edge}


def vertex(points: list[tuple[float, float]]) -> float:
    """The lr at the vertex of the parabola in log10 lr through three (lr, loss) points, the middle one lowest."""
    (x0, y0), (x1, y1), (x2, y2) = ((math.log10(lr), loss) for lr, loss in points)
    # the parabola's vertex from divided differences: x* = (x0 + x1) / 2 - f[x0, x1] / (2 f[x0, x1, x2])
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    curvature = (d12 - d01) / (x2 - x0)
    if curvature <= 0:  # not a minimum (a flat or concave triple): the middle point is the best we know
        return points[1][0]
    return 10 ** ((x0 + x1) / 2 - d01 / (2 * curvature))


def optimum(curve: pd.DataFrame, grid: list[float] | None = None) -> Optimum | None:
    """The optimum of one placement's curve (`lr_curves` rows: lr and final_loss_mean; NaN where every seed
    failed) on ``grid``, every rate the sweep ran (default: the curve's own; a rate with no finished run, crashed
    or pending, then counts as a neighbour that did not train, so it leaves the optimum open instead of widening
    the bracket); None where no cell trained."""
    trained = curve.dropna(subset=["final_loss_mean"]).sort_values(LR)
    if not len(trained):
        return None
    lrs = sorted({float(v) for v in (grid if grid is not None else curve[LR])})
    best = trained.loc[trained.final_loss_mean.idxmin()]
    grid_lr = float(best[LR])
    i = next(j for j, v in enumerate(lrs) if math.isclose(v, grid_lr, rel_tol=1e-9))
    loss = {float(r[LR]): float(r.final_loss_mean) for _, r in trained.iterrows()}
    if i == 0 or lrs[i - 1] not in loss:  # nothing trained below it: the optimum may lie lower
        return Optimum(grid_lr, grid_lr, "low")
    if i == len(lrs) - 1 or lrs[i + 1] not in loss:
        return Optimum(grid_lr, grid_lr, "high")
    points = [(lr, loss[lr]) for lr in (lrs[i - 1], grid_lr, lrs[i + 1])]
    return Optimum(vertex(points), grid_lr)


def optima(curves: pd.DataFrame, grids: dict[str, list[float]] | None = None) -> dict[str, Optimum]:
    """Each placement's optimum in a sweep (`lr_curves` over layout, lr and seed), on its grid in ``grids`` (every
    rate it ran, finished or not; default: the rates in ``curves``)."""
    if curves.empty:
        return {}
    found = {
        str(layout): optimum(g, (grids or {}).get(str(layout))) for layout, g in curves.groupby("layout", sort=False)
    }
    return {k: v for k, v in found.items() if v is not None}


def shift(proxy: Optimum, other: Optimum) -> dict[str, float | str | None]:
    """How far the optimum moved from the proxy to the other rung: ``factor`` = lr*(other) / lr*(proxy), and
    ``kind``: "measured" (both bracketed); "at most" / "at least" where an unbracketed end bounds the factor from
    one side (the other rung's optimum at or below its lowest trained rate: the factor is at most this; at or
    above its highest: at least; the proxy's the other way round); None where the two bounds point opposite ways."""
    factor = other.lr / proxy.lr
    # +1: the true factor may be larger than the one computed, -1: smaller, 0: exact
    sides = {{None: 0, "low": -1, "high": +1}[other.edge], {None: 0, "low": +1, "high": -1}[proxy.edge]} - {0}
    kind = "measured" if not sides else ("at least" if sides == {1} else "at most" if sides == {-1} else None)
    return {"factor": factor, "kind": kind}
