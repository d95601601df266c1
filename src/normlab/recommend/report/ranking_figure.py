"""The ranking's figure on recommend's page: per candidate, in the ranking's order, what its runs did (counts of
runs: diverged or stalled, ended at risk, trained to the end, stopped by the budget or not finished), and the
largest activation and the largest attention logit on a logarithmic axis (said on the axis), each against the
precision's limit (drawn only where the precision has one; a panel only where some candidate has a value).

A candidate is drawn where it has runs: the ranked ones, and one whose runs the budget stopped before any
finished (labelled "not ranked"), so a ranked candidate's bar stands beside what its rivals' runs did.
"""

from __future__ import annotations

import math
import textwrap

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from normlab.pages import figure_html
from normlab.recommend.evidence.rank import Evidence
from normlab.runs.files import RecommendDir

LABEL_WIDTH = 34  # characters a row label's line holds (longer labels wrap onto more lines, never cut)


def row_label(r: Evidence) -> str:
    """A row's label: its rank (or "not ranked") and its name (a change's name where it has one), wrapped."""
    head = f"#{r.rank}" if r.rank is not None else "not ranked:"
    return "\n".join(textwrap.wrap(f"{head} {r.name}", LABEL_WIDTH, break_on_hyphens=False)) or head


def outcome_counts(r: Evidence) -> dict[str, int]:
    """What `r`'s runs did, counted: diverged or stalled, at risk (trained to the end), trained to the end with
    no risk, and not finished (stopped by the budget, crashed, or not run yet)."""
    failed = r.diverged + r.stalled
    at_risk = min(r.at_risk, max(0, r.finished - failed))
    return {
        "diverged or stalled": failed,
        "at risk": at_risk,
        "trained": max(0, r.finished - failed - at_risk),
        "not finished": max(0, r.runs - r.finished) if r.runs else r.unfinished,
    }


COLORS = {"diverged or stalled": "tab:red", "at risk": "tab:orange", "trained": "tab:green", "not finished": "0.75"}


def ranking_figure(folder: RecommendDir, rows: list[Evidence], precision: str = "fp16") -> str:
    """The ranking's figure (module doc) as a page section; `rows`: the candidates with runs, in rank order."""
    from normlab.recommend.evidence.signals import limits as precision_limits

    acts = [r.max_activation if math.isfinite(r.max_activation) else float("nan") for r in rows]
    logits = [r.logit_peak if math.isfinite(r.logit_peak) else float("nan") for r in rows]
    panels = ["runs"] + [k for k, v in (("activation", acts), ("logit", logits)) if any(math.isfinite(x) for x in v)]
    labels = [row_label(r) for r in rows]
    lines = sum(max(1, label.count("\n") + 1) for label in labels)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels) + 3, 0.3 * lines + 0.25 * len(rows) + 1.8), squeeze=False
    )
    y = list(range(len(rows)))
    logit_limit, act_limit = precision_limits(precision)
    for i, (ax, panel) in enumerate(zip(axes[0], panels)):
        ax.set_yticks(y, labels if i == 0 else [""] * len(y), fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)  # the ranking's order, top down
        if panel == "runs":
            counts = [outcome_counts(r) for r in rows]
            left = [0.0] * len(rows)
            for what, color in COLORS.items():
                widths = [c[what] for c in counts]
                if any(widths):
                    ax.barh(y, widths, left=left, color=color, alpha=0.85, label=what)
                left = [a + b for a, b in zip(left, widths)]
            for yi, c in zip(y, counts):
                said = ", ".join(f"{n} {what}" for what, n in c.items() if n)
                ax.text(0.05, yi, said or "no runs", va="center", fontsize=7)
            ax.set_xlim(0, max(1.0, max(left) * 1.05))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # runs are counted
            ax.set_xlabel("runs, by what they did")
            ax.legend(fontsize=7, loc="lower right")
            continue
        values, limit = (acts, act_limit) if panel == "activation" else (logits, logit_limit)
        ax.barh(y, values, color="tab:blue" if panel == "activation" else "tab:purple", alpha=0.8)
        ax.set_xscale("log")
        what = "largest activation (probes)" if panel == "activation" else "largest attention logit (probes)"
        what += ", log scale"
        if math.isfinite(limit):
            ax.axvline(limit, ls="--", color="tab:orange", lw=1)
            what += f"; dashed: {precision}'s " + ("maximum" if panel == "activation" else "1-nat resolution")
        ax.set_xlabel(what, fontsize=8)
    fig.tight_layout()
    return figure_html(fig, folder.path, "ranking", "What each candidate's runs did, activations and attention logits")


__all__ = ["outcome_counts", "ranking_figure", "row_label"]
