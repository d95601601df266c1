"""The evidence behind a recommendation and the ranking rule, one row per candidate.

Each candidate's row holds its screen verdict (Kan et al.'s four steps at the user's depth) and what
its proxy runs showed: divergences and stalls over every run (learning rates x seeds), the largest
activation the probes saw, where the first overflow was, the best learning rate with its loss (mean
± std over seeds), and Wortsman et al.'s LR sensitivity over the learning rates swept.

The rule, in this order (`rank`):
1. fewer failures: diverged + stalled runs over finished runs (what the user came to avoid);
2. fewer runs at risk over finished runs: trained to the end, but with the largest attention logit past
   what the user's precision resolves, or (fp16) the largest activation within 8x of the overflow
   (`normlab.recommend.evidence.signals`: what fails next at scale, Dehghani et al. 2023, Wortsman et al. 2023);
3. lower best loss; two losses closer than the larger of their seed std and `NOISE_FLOOR` are a tie,
   and within a tie
4. the user's own placement comes first (a change needs evidence beyond noise), then the screen's
   verdict (stable, caution, unstable) decides, then the lower expected loss over the
   learning rates swept (Wortsman et al. 2024: E_lr[min(L, L_0)], the best loss plus the LR
   sensitivity; a diverged run counts as the initial loss L_0). The sensitivity alone would not do: a
   placement that barely learns at any rate is flat, and its small sensitivity would put it ahead of
   a tied one that trains far lower at most rates.
Candidates whose runs did not all finish (the budget ran out) are ranked on what finished, marked; one
with no finished run is not ranked (a run the budget stopped is neither a failure nor evidence).

What the screen rules out before training (`ruled_out`), at the user's depth with the weights as
initialized (stress s = 1): non-finite hidden states or Jacobians, a stream already past the FP16
maximum under fp16, or a hidden-state variance that grows exponentially with depth. Its other
findings (ill-posed, growth with the weight scale) are predictions the proxy runs test: they order
the candidates, and break ties. (The Jacobians' product over depth is not a criterion: each norm's
Jacobian scales as 1 / RMS of its input, so at init, with a stream of RMS 0.02, the product is large
for every layout: 2e6 to 9e6 at 12 layers for Peri- and Pre-LN alike.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

import pandas as pd

from normlab.diagnostics.stats import FP16_MAX

NOISE_FLOOR = 0.01  # nats: below this two proxy losses are not told apart (a single seed has no std)
VERDICT_ORDER = {"stable": 0, "caution": 1, "unstable": 2}


class ScreenSummary(TypedDict):
    """A candidate's screen as screen.json keeps it (`screen_summary`)."""

    verdict: str
    wellposedness: str
    forward: str
    backward: str
    final_rms: float
    sensitivity_product: float
    shape_var: str
    finite: bool
    seconds: float
    n_layers: int
    d_model: int


def screen_summary(result: dict[str, Any]) -> ScreenSummary:
    """The part of a `screen_layout` result that the recommendation keeps (screen.json)."""
    low = result["stresses"][min(result["stresses"], key=float)]
    values = [*low["mean_abs"], *low["var"], low["sensitivity_product"], result["verdict"]["sensitivity_ratio"]]
    return ScreenSummary(
        verdict=result["verdict"]["overall"],
        wellposedness=result["wellposedness"]["verdict"],
        forward=result["verdict"]["forward"],
        backward=result["verdict"]["backward"],
        final_rms=low["rms"][-1],
        sensitivity_product=low["sensitivity_product"],
        shape_var=low["shape_var"]["shape"],
        finite=all(math.isfinite(v) for v in values),
        seconds=result["seconds"],
        n_layers=result["n_layers"],
        d_model=result["d_model"],
    )


def ruled_out(screen: ScreenSummary, precision: str) -> str | None:
    """Why the screen alone rules a candidate out, or None."""
    if not screen["finite"]:
        return "non-finite hidden states or Jacobians at initialization"
    if precision == "fp16" and screen["final_rms"] > FP16_MAX:
        return f"its stream's RMS at initialization ({screen['final_rms']:.3g}) is already past the FP16 maximum"
    if screen["shape_var"] == "exponential":
        return "its hidden-state variance grows exponentially with depth at initialization, before any training"
    return None


def screen_reason(screen: ScreenSummary) -> str:
    """Why the screen's verdict is what it is, from the two findings that decide it
    (`normlab.screen.screen`): stable needs every sublayer bounded and block Jacobians invariant to the
    weight stress s; unstable is ill-posed with Jacobians that grow with s; anything else is caution."""
    wp, back, verdict = screen["wellposedness"], screen["backward"], screen["verdict"]
    if verdict == "stable":
        return f"{wp}, and its block Jacobians are {back}"
    if verdict == "unstable":
        return f"{wp}, and its block Jacobians {back}"
    if wp.startswith("well-posed"):
        return f"well-posed, but its block Jacobians are not invariant to the weight stress (backward: {back})"
    if back.startswith("grows"):
        return f"{wp}, and its block Jacobians {back}"
    return f"{wp}, though its block Jacobians do not grow with the weight stress (backward: {back})"


@dataclass
class Evidence:
    """One candidate's row of the evidence table."""

    layout: str
    screen: str  # the screen's overall verdict
    screen_detail: str
    runs: int = 0  # planned
    finished: int = 0
    diverged: int = 0
    stalled: int = 0
    unfinished: int = 0  # crashed or stopped at the budget
    max_activation: float = math.nan
    first_break: str = ""
    best_lr: float | None = None
    best_loss: float = math.nan
    best_loss_std: float = math.nan
    lr_sensitivity: float = math.nan
    expected_loss: float = math.nan  # Wortsman's E_lr[min(L, L_0)] over the swept lrs = best (capped) + sensitivity
    loss_by_lr: dict[str, str] = field(default_factory=dict)
    # the signals that predict trouble (normlab.recommend.evidence.signals), over the finished runs: how many ended at
    # risk and why (the first reason), the largest attention logit at the best learning rate (first and last
    # probe, growth per 100 steps, steps to the precision's limit at that growth), its largest over every
    # run, the largest activation's growth at the best learning rate, and the largest logit per learning rate
    at_risk: int = 0
    risk: str = ""
    logit_first: float = math.nan
    logit_last: float = math.nan
    logit_growth: float = math.nan
    logit_steps_to_limit: float = math.nan
    logit_peak: float = math.nan
    act_growth: float = math.nan
    logit_by_lr: dict[str, str] = field(default_factory=dict)
    label: str = ""  # a candidate made from the user's placement: "your model (qwen3) + output norms"
    short: str = ""  # its change's name where its layout is a string form: "yours+out" (`derived.short_names`)
    cut: int = 0  # runs the budget stopped before their last step (not failures: the next call continues them)
    rank: int | None = None
    tie: bool = False  # within noise of the candidate ranked above
    screen_why: str = ""  # why the screen gave its verdict (`screen_reason`)
    status: str = (
        "ranked"  # ranked | stress round only | baseline (`recommend.stage_conclude`) | ruled out | not trained
    )
    why: str = ""  # for ruled out / not trained

    @property
    def failures(self) -> float:
        return (self.diverged + self.stalled) / self.finished if self.finished else math.inf

    @property
    def risk_share(self) -> float:
        return self.at_risk / self.finished if self.finished else math.inf

    @property
    def name(self) -> str:
        """The layout (its change's name where it has one: `short`) with its label where it is a change to the
        user's placement."""
        return f"{self.shown} ({self.label})" if self.label else self.shown

    @property
    def shown(self) -> str:
        """What the output calls it: its change's name (`short`) where it has one, else the layout."""
        return self.short or self.layout

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def evidence_from_grid(runs: pd.DataFrame, planned: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per layout, the grid's numbers (runs: `load_sweep`'s table with layout, lr and seed axes)."""
    from normlab.diagnostics.forensics import tally
    from normlab.experiments.summary import lr_curves, lr_sensitivity

    axes = ["layout", "lr", "seed"]
    curves = lr_curves(runs, axes)
    sens = lr_sensitivity(curves, axes)
    out: dict[str, dict[str, Any]] = {}
    for layout, n in planned.items():
        g = runs[runs.layout == layout]
        finished = g[g.status.isin(("ok", "stalled", "diverged"))]
        peak = pd.to_numeric(g.max_activation, errors="coerce").dropna()
        row: dict[str, Any] = {
            "runs": n,
            "finished": len(finished),
            "diverged": int((g.status == "diverged").sum()),
            "stalled": int((g.status == "stalled").sum()),
            "unfinished": n - len(finished),
            "max_activation": float(peak.max()) if len(peak) else math.nan,
            "first_break": tally(list(g[g.status == "diverged"].first_break)),
            "cut": int(g.reason.fillna("").astype(str).str.contains("time budget").sum()) if "reason" in g else 0,
        }
        if "at_risk" in g:  # the signals (normlab.recommend.evidence.signals.with_signals)
            row["at_risk"] = int(g.at_risk.fillna(False).astype(bool).sum())
            row["risk"] = next((str(x) for x in g.risk if x), "")
            peak = pd.to_numeric(finished.logit_last, errors="coerce").dropna()
            row["logit_peak"] = float(peak.max()) if len(peak) else math.nan
        c = curves[curves.layout == layout] if len(curves) else curves
        s = sens[sens.layout == layout] if len(sens) else sens
        if len(s):
            best = s.iloc[0]
            row.update(
                best_lr=None if best.best_lr is None or pd.isna(best.best_lr) else float(best.best_lr),
                best_loss=float(best.best_final_loss),
                lr_sensitivity=float(best.lr_sensitivity),
                expected_loss=float(best.expected_capped_loss),
            )
            at_best = c[c.lr == row["best_lr"]]
            if len(at_best):
                row["best_loss_std"] = float(at_best.final_loss_std.iloc[0])
            best_runs = finished[(finished.lr - (row["best_lr"] or 0)).abs() <= 1e-9 * (row["best_lr"] or 1)]
            if "logit_last" in g and len(best_runs):
                first = best_runs.sort_values("seed").iloc[0]
                for k in ("logit_first", "logit_last", "logit_growth", "logit_steps_to_limit", "act_growth"):
                    row[k] = float(first[k]) if pd.notna(first[k]) else math.nan
        if "logit_last" in g:
            for lr, cell in finished.groupby("lr"):
                top = pd.to_numeric(cell.logit_last, errors="coerce").dropna()
                if len(top):
                    row.setdefault("logit_by_lr", {})[f"{lr:g}"] = f"{top.max():,.4g}"
        for r in c.sort_values("lr").itertuples() if len(c) else ():
            notes = [
                f"{x} {what}"
                for x, what in ((r.divergences, "diverged"), (r.stalls, "stalled"))
                if not x.startswith("0/")
            ]
            value = "-" if math.isnan(r.final_loss_mean) else f"{r.final_loss_mean:.3f}"
            row.setdefault("loss_by_lr", {})[f"{r.lr:g}"] = value + (f" ({', '.join(notes)})" if notes else "")
        out[layout] = row
    return out


def unranked_if_unfinished(row: Evidence) -> Evidence:
    """A candidate with no finished run is not ranked: a run the budget stopped is no failure (issue 53: a
    complete run cut in its closing evaluation was ranked below layouts that never ran), and no evidence
    either; the row says how many the budget stopped and that the same command continues them."""
    if row.status in ("ranked", "stress round only", "baseline") and not row.finished:
        row.status = "not trained"
        row.why = "no run finished" + (
            f" ({row.cut} stopped by the budget before their last step: the same command continues them)"
            if row.cut
            else ""
        )
    return row


def baseline_of(current: str | None, finalists: list[str], order: list[str]) -> str | None:
    """The user's placement where it is a finalist only as the baseline: the final round takes the best
    len(finalists) of the stress round's `order` with the current placement swapped in for the last of
    them. Such a finalist is ranked with those it displaced, by its stress run (`normlab.recommend.stages.conclude`)."""
    if current is None or current not in finalists or current not in order:
        return None
    return current if order.index(current) >= len(finalists) else None


def _noise(a: Evidence, b: Evidence) -> float:
    stds = [s for s in (a.best_loss_std, b.best_loss_std) if math.isfinite(s)]
    return max([NOISE_FLOOR, *stds])


def rank(rows: list[Evidence], prefer: str | None = None) -> list[Evidence]:
    """The ranked candidates first (rule in the module doc), then those ruled out or not trained; within a tie
    `prefer` (the user's placement) comes first: a change needs evidence beyond noise."""
    ranked = [r for r in rows if r.status == "ranked"]

    def loss(r: Evidence) -> float:
        return r.best_loss if math.isfinite(r.best_loss) else math.inf

    ranked.sort(key=lambda r: (r.failures, r.risk_share, loss(r)))
    out: list[Evidence] = []
    i = 0
    while i < len(ranked):  # groups: same failures and runs at risk, losses within noise of the group's best
        group = [ranked[i]]
        j = i + 1
        while (
            j < len(ranked)
            and ranked[j].failures == ranked[i].failures
            and ranked[j].risk_share == ranked[i].risk_share
            and abs(loss(ranked[j]) - loss(ranked[i])) <= _noise(ranked[i], ranked[j])
        ):
            group.append(ranked[j])
            j += 1
        group.sort(
            key=lambda r: (
                r.layout != prefer,
                VERDICT_ORDER.get(r.screen, 3),
                r.expected_loss if math.isfinite(r.expected_loss) else math.inf,
                loss(r),
            )
        )
        for k, r in enumerate(group):
            r.tie = k > 0
        out += group
        i = j
    for n, r in enumerate(out, 1):
        r.rank = n
    return out + [r for r in rows if r.status != "ranked"]
