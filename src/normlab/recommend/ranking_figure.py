"""The ranking's figure on recommend's page: per candidate by rank, the share of runs that failed and ended
at risk, the largest activation and the largest attention logit, each against the precision's limit
(drawn only where the precision has one; a panel only where some candidate has a value).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from normlab.pages import figure_html
from normlab.recommend.rank import Evidence
from normlab.runs.files import RecommendDir


def ranking_figure(folder: RecommendDir, live: list[Evidence], precision: str = "fp16") -> str:
    """The ranking's figure (failures, largest activations by rank) as a page section."""
    from normlab.recommend.signals import limits as precision_limits

    acts = [r.max_activation if math.isfinite(r.max_activation) else float("nan") for r in live]
    logits = [r.logit_peak if math.isfinite(r.logit_peak) else float("nan") for r in live]
    panels = ["failures"] + [
        k for k, v in (("activation", acts), ("logit", logits)) if any(math.isfinite(x) for x in v)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 2, 0.4 * len(live) + 1.8), squeeze=False)
    y = list(range(len(live)))
    logit_limit, act_limit = precision_limits(precision)
    for ax, panel in zip(axes[0], panels):
        ax.invert_yaxis()
        if panel == "failures":
            fail = [(r.diverged + r.stalled) / r.finished if r.finished else 0 for r in live]
            risk = [r.at_risk / r.finished if r.finished else 0 for r in live]
            ax.barh(y, fail, color="tab:red", alpha=0.8, label="diverged or stalled")
            ax.barh(y, risk, left=fail, color="tab:orange", alpha=0.8, label="at risk")
            for yi, r in zip(y, live):
                ax.text(
                    0.01,
                    yi,
                    f"{r.diverged} div, {r.stalled} stalled, {r.at_risk} at risk of {r.finished}",
                    va="center",
                    fontsize=8,
                )
            ax.set_yticks(y, [f"#{r.rank} {r.name}"[:60] for r in live], fontsize=8)
            ax.set_xlim(0, 1)
            ax.set_xlabel("fraction of finished runs")
            ax.legend(fontsize=7, loc="lower right")
            continue
        values, limit = (acts, act_limit) if panel == "activation" else (logits, logit_limit)
        ax.barh(y, values, color="tab:blue" if panel == "activation" else "tab:purple", alpha=0.8)
        ax.set_xscale("log")
        ax.set_yticks(y, [""] * len(y))
        what = "largest activation (probes)" if panel == "activation" else "largest attention logit (probes)"
        if math.isfinite(limit):
            ax.axvline(limit, ls="--", color="tab:orange", lw=1)
            what += f"; dashed: {precision}'s " + ("maximum" if panel == "activation" else "1-nat resolution")
        ax.set_xlabel(what, fontsize=8)
    fig.tight_layout()
    return figure_html(fig, folder.path, "ranking", "Failures, runs at risk, activations and attention logits by rank")


__all__ = ["ranking_figure"]
