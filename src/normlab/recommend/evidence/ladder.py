"""The ladder: the effective speedup of the leader against the user's placement at three proxy scales, its
trend over compute, and its projection to the user's scale (recommendation.json's `effect.speedup.by_scale`
and `.projection`; ladder.png).

Rungs. Widths 32, 64, 128 (`LADDERS`: 4x from the narrowest to the widest; where the budget does not hold
them, 16, 32, 64, whose rungs cost a fraction of a proxy run): the proxy's own width (its final round's
cells, reused) and the two others, trained under muP with the proxy's width as the base shape
(`inputs.proxy_settings`), so each candidate's best learning rate at the proxy is the one muP carries to
every rung (Yang et al. 2022; normlab's record: the optimum moved x1.27-1.50 over 4x width). Tokens grow with
width (steps x width / the proxy's, at least half the proxy's): the compute of a rung grows as width^3, not
as Chinchilla's width^4 (tokens in proportion to parameters would make the widest rung 16x the proxy's tokens,
beyond a 20-minute budget on two cores; said in the answer). Depth stays the proxy's: the user's
depth-to-width ratio cannot be followed at widths of tens (a 2048-wide, 16-layer model has a ratio of 1/128).

Trend. Ordinary least squares of y = ln(speedup) on x = ln(compute) over the rungs with a finite speedup
(a bound is left out and said), and the prediction interval at x0 (Student's t with n - 2 degrees of
freedom; e.g. Montgomery, Peck and Vining, "Introduction to Linear Regression Analysis", eq. 2.45):

    y0 = a + b x0 +- t(n-2) s sqrt(1 + 1/n + (x0 - xbar)^2 / Sxx),   s^2 = SSE / (n - 2)

The slope's own interval says whether the advantage grows (b > 0), shrinks (b < 0) or holds (the interval
holds 0) with scale; the compute at which the prediction interval's lower end crosses 1 is found on a grid of
x. Three rungs leave one degree of freedom (t = 12.7): the projection's interval is wide, and says so.
A rung whose speedup is a bound (past the curve's extrapolation limit) enters the fit at its bound and the
projection is said to be of bounds (`bound`: "lower" where every such rung is a lower bound: the projection is
then itself at least that).
Compute: the runs' own FLOPs (summary.json's flops_per_token x tokens: 6 x the matrices' weights + the
attention's 12 L H Q T a token); the user's on the same definition at its shape (sequences up to `USER_SEQ`)
times D, the tokens given to recommend (`--tokens`), else 20 N (Hoffmann et al. 2022). A rung with no speedup
(a side that did not train) is left out of the fit and named (`left_out`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from normlab.recommend.planning.shape import PROXY_WIDTH

# the ladders a plan may buy, the widest first (the proxy's width among each): where the one reaching 2x above the
# proxy does not fit the budget, the one ending at the proxy does (its rungs cost a fraction of a proxy run)
LADDERS = ((32, 64, 128), (16, 32, 64))
WIDTHS = LADDERS[0]
LEVEL = 0.95
CHINCHILLA = 20.0  # tokens per parameter where the user gave none (Hoffmann et al. 2022)


def rung_steps(width: int, steps: int) -> int:
    """A rung's steps: the proxy's, in proportion to its width (tokens grow with width), and at least half the
    proxy's: at 38 steps the narrow ladder's width-16 rung stalled at the unigram loss on both sides of a Llama
    comparison (docs/results.md, "Speedup projections"), a rung that measures nothing."""
    return max(8, steps // 2, round(steps * width / PROXY_WIDTH))


def off_proxy(widths: tuple[int, ...] = WIDTHS) -> list[int]:
    """The rungs the ladder trains (the proxy's width is the final round's)."""
    return [w for w in widths if w != PROXY_WIDTH]


def fit(rungs: list[dict[str, Any]], x0: float, level: float = LEVEL) -> dict[str, Any]:
    """The trend and the projection at compute `x0` (module doc) over `rungs` ({compute, value, bound})."""
    from scipy import stats

    use = [r for r in rungs if r.get("value") and r["value"] > 0]
    left = [r["width"] for r in rungs if r not in use]
    out: dict[str, Any] = {"scale": x0, "rungs_used": len(use), "left_out": left}
    kinds = {r["bound"] for r in use if r.get("bound")}
    if kinds:  # a rung past the extrapolation limit enters at its bound: the projection is then of bounds, said so
        out["bound"] = kinds.pop() if len(kinds) == 1 else "mixed"
        out["bounds_at"] = [r["width"] for r in use if r.get("bound")]
    if len(use) < 3:
        return {
            **out,
            "value": None,
            "interval": None,
            "why": f"{len(use)} rung(s) with a measured speedup: a trend with an interval needs three",
        }
    x = np.log([r["compute"] for r in use])
    y = np.log([r["value"] for r in use])
    n = len(x)
    xbar, sxx = x.mean(), float(((x - x.mean()) ** 2).sum())
    b = float(((x - xbar) * (y - y.mean())).sum() / sxx)
    a = float(y.mean() - b * xbar)
    sse = float(((y - (a + b * x)) ** 2).sum())
    if sse == 0.0 and out.get("bound"):  # every rung at the same bound: nothing to fit a spread to
        why = f"every rung's speedup is at its {out['bound']} bound (x{math.exp(a):.2f}): no spread to fit a trend to"
        return {**out, "value": float(math.exp(a)), "interval": None, "why": why}
    s = math.sqrt(sse / (n - 2))
    t = float(stats.t.ppf(0.5 + level / 2, n - 2))

    def band(c: float) -> tuple[float, float, float]:
        lx = math.log(c)
        half = t * s * math.sqrt(1 + 1 / n + (lx - xbar) ** 2 / sxx)
        mid = a + b * lx
        return math.exp(mid), math.exp(mid - half), math.exp(mid + half)

    mid, lo, hi = band(x0)
    half_b = t * s / math.sqrt(sxx)
    trend = "grows" if b - half_b > 0 else "shrinks" if b + half_b < 0 else "holds"
    # from the widest rung up to 10x the user's compute: where the prediction interval's lower end crosses 1
    grid = np.exp(np.linspace(x.max(), max(math.log(x0), x.max()) + math.log(10), 400))
    above = [band(float(c))[1] > 1 for c in grid]
    crosses = next((float(c) for c, up, prev in zip(grid[1:], above[1:], above[:-1]) if up != prev), None)
    return {
        **out,
        "value": mid,
        "interval": [lo, hi],
        "slope": b,
        "slope_interval": [b - half_b, b + half_b],
        "trend": trend,
        "lower_bound_above_1": above[0],  # at the widest rung
        "lower_bound_above_1_at_scale": lo > 1,
        "beyond_widest": x0 / float(np.exp(x.max())),  # how far the projection reaches past the widest rung
        "crosses_1_at": crosses,
        "degrees_of_freedom": n - 2,
        "method": "OLS of ln(speedup) on ln(compute) over the rungs, Student's t prediction interval (ladder.py)",
    }


USER_SEQ = 4096  # the user's sequence length where the config's is longer (the attention term of the FLOPs)


def user_compute(cfg: Any, non_embedding_params: float, tokens: float | None) -> tuple[float, str]:
    """The user's run's FLOPs on the rungs' own definition (`normlab.train.mfu.flops_per_token`: 6 x the
    matrices' weights, the head among them, + 12 L H Q T for the attention), times D: `tokens`, else 20 a
    parameter (Hoffmann et al. 2022); and how D was chosen."""
    seq = min(int(cfg.max_seq_len), USER_SEQ)
    per_token = 6.0 * (non_embedding_params + cfg.vocab_size * cfg.d_model)
    per_token += 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq
    if tokens:
        return per_token * tokens, f"{tokens:.3g} tokens (--tokens), sequences of {seq}"
    d = CHINCHILLA * non_embedding_params
    how = f"{d:.3g} tokens (20 per parameter, Hoffmann et al. 2022; --tokens sets it), sequences of {seq}"
    return per_token * d, how


def words(proj: dict[str, Any]) -> str:
    """The projection in a sentence."""
    if proj.get("value") is None or proj.get("interval") is None:
        return str(proj.get("why", "no projection"))
    lo, hi = proj["interval"]
    of = {"lower": "a lower bound (rungs past the 2x extrapolation limit enter at it): ", "upper": "an upper bound: "}
    text = of.get(proj.get("bound") or "", "a projection of bounds: " if proj.get("bound") else "") + (
        f"projected to your scale ({proj['scale']:.3g} FLOPs): x{proj['value']:.2f} [{lo:.2f}, {hi:.2f}] "
        f"({proj['degrees_of_freedom']} degree(s) of freedom, {proj['beyond_widest']:.2g}x the widest rung's compute: "
        f"an extrapolation over {math.log10(max(proj['beyond_widest'], 1.0)):.1f} orders of magnitude); the "
        f"advantage {proj['trend']} with scale "
        f"(slope {proj['slope']:+.3f} [{proj['slope_interval'][0]:+.3f}, {proj['slope_interval'][1]:+.3f}] in "
        "ln speedup per ln compute)"
    )
    if proj.get("crosses_1_at"):
        side = "rises above" if not proj["lower_bound_above_1"] else "falls to"
        text += f"; its lower bound {side} 1 at about {proj['crosses_1_at']:.3g} FLOPs"
    else:
        where = "above" if proj["lower_bound_above_1"] else "at or below"
        text += f"; its lower bound stays {where} 1 from the widest rung to 10x your scale"
    return text


def figure(path: Path, rungs: list[dict[str, Any]], proj: dict[str, Any]) -> None:
    """ladder.png: each rung's speedup with its interval against compute (log-log), the fit and its
    prediction band out to the user's scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in rungs:
        if r.get("value"):
            iv = r.get("interval") or [r["value"], r["value"]]
            ax.errorbar(
                r["compute"],
                r["value"],
                yerr=[[max(0.0, r["value"] - iv[0])], [max(0.0, iv[1] - r["value"])]],
                fmt={"lower": "^", "upper": "v"}.get(r.get("bound") or "", "o"),
                color="C0",
                capsize=3,
            )
            ax.annotate(f"d {r['width']}", (r["compute"], r["value"]), textcoords="offset points", xytext=(5, 5))
    if proj.get("interval") is not None:
        xs = np.exp(np.linspace(math.log(min(r["compute"] for r in rungs)), math.log(proj["scale"]), 100))
        ax.plot(xs, np.exp(proj["slope"] * (np.log(xs) - math.log(proj["scale"])) + math.log(proj["value"])), "C1-")
        lo, hi = proj["interval"]
        yerr = [[max(0.0, proj["value"] - lo)], [max(0.0, hi - proj["value"])]]
        ax.errorbar(proj["scale"], proj["value"], yerr=yerr, fmt="s", color="C1")
        ax.annotate("your scale", (proj["scale"], proj["value"]), textcoords="offset points", xytext=(-60, 8))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute of the run (FLOPs, log scale)")
    ax.set_ylabel("effective speedup (log scale)")
    ax.set_title("Effective speedup against scale: the ladder's rungs and the projection")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
