"""Each candidate's evidence for the conclusion (`stage_conclude`): its screen verdict and runs, ranked by
`rank.rank` with the signals that predict trouble read first, and the confidence sized to the seeds that ran."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from normlab.recommend.evidence.rank import (
    Evidence,
    baseline_of,
    evidence_from_grid,
    rank,
    screen_reason,
    unranked_if_unfinished,
)
from normlab.recommend.evidence.signals import with_signals
from normlab.recommend.stages.context import Context
from normlab.recommend.stages.records import Confidence
from normlab.runs.outcome import FINISHED


def _unscreened(ctx: Context, name: str) -> Evidence:
    why = f"not tried in this budget (the cheap screen put it after the {len(ctx.plan.screened)} chosen)"
    return Evidence(layout=name, screen="not screened", screen_detail="", status="not trained", why=why)


def evidence(ctx: Context) -> list[Evidence]:
    """Each candidate's evidence row, ranked: the final round's ranked, then those the final round did not
    take (and a baseline finalist) in the stress round's order, then those ruled out or not trained."""
    found, order = ctx.found, ctx.found.order
    final, runs = found.final, found.runs
    assert final is not None and runs is not None
    finalists = final.finalists or order
    per_final = len(final.lrs) * len(final.seeds)
    extended = final.extended or {}
    planned = {
        n: (per_final + (len(final.seeds) if n in extended else 0)) if n in final.finalists else 1 for n in order
    }
    grid = evidence_from_grid(runs[runs.layout.isin(finalists)], {n: planned[n] for n in finalists})
    # the user's placement runs in the final round as the baseline even where the stress round did not put it
    # among the best; then it is ranked as those it displaced are, by its stress run, its final runs shown
    baseline = baseline_of(ctx.current, final.finalists, order)
    rows = []
    assert found.screen is not None
    skipped, screened = found.screen.skipped, found.screen.results  # skipped: --quick, no screen
    for n in ctx.candidates:
        if n not in screened and not (skipped and n in order):
            rows.append(_unscreened(ctx, n))
            continue
        if skipped:
            row = Evidence(layout=n, screen="not screened", screen_detail="")
        else:
            s = screened[n]
            detail = f"{s['wellposedness']}; forward {s['forward']}; backward {s['backward']}"
            row = Evidence(layout=n, screen=s["verdict"], screen_detail=detail, screen_why=screen_reason(s))
        row.label, row.short = ctx.labels.get(n, ""), ctx.short.get(n, "")
        if n in found.out_by_screen:
            row.status, row.why = "ruled out", f"by the screen: {found.out_by_screen[n]}"
        elif n not in finalists:
            one = evidence_from_grid(runs[runs.layout == n], {n: 1})[n]
            for k, v in one.items():
                setattr(row, k, v)
            row.status = "stress round only"
            status = runs[runs.layout == n].status
            row.why = f"{status.iloc[0] if len(status) else 'not run'} at lr {ctx.plan.stress_lr:g}"
        else:
            for k, v in grid[n].items():
                setattr(row, k, v)
            if n == baseline:
                row.status = "baseline"
                row.why = (
                    f"ranked by its stress run, #{order.index(n) + 1} of {len(order)} there; in the final "
                    "round as your current placement"
                )
        rows.append(unranked_if_unfinished(row))
    ranked = rank(rows, prefer=ctx.current)
    # the candidates the final round did not take (and a baseline finalist) follow, in the stress round's order
    tail = sorted(
        (r for r in ranked if r.status in ("stress round only", "baseline")), key=lambda r: order.index(r.layout)
    )
    head = [r for r in ranked if r.status == "ranked"]
    for i, r in enumerate(tail, len(head) + 1):
        r.rank = i
    return head + tail + [r for r in ranked if r.status in ("ruled out", "not trained")]


def seeds_that_ran(conf: Confidence, runs: pd.DataFrame, winner: Evidence | None) -> Confidence:
    """`answer.confidence` with its seeds those the winner's finished runs trained with, where fewer ran than the
    plan holds (the budget stopped the rest): "2 seed(s)" is never said of one; one seed is a reason it is
    provisional."""
    if winner is None or not len(runs):
        return conf
    mine = runs[(runs.layout == winner.layout) & runs.status.isin(FINISHED)]
    ran = int(mine.seed.nunique())
    if ran >= conf.seeds:
        return conf
    why = list(conf.why)
    if ran < 2 and not any(w.startswith("one seed") for w in why):
        why.append(f"one seed: no seed noise measured ({winner.layout}'s other seeds did not finish)")
    return replace(conf, seeds=ran, why=why, level="provisional")


def ranked_now(ctx: Context) -> list[Evidence]:
    """The evidence rows ranked from the grid's runs, their signals read first."""
    found = ctx.found
    assert found.runs is not None
    if "at_risk" not in found.runs:  # the signals that predict trouble, from each finished run's probes
        found.runs = with_signals(found.runs, ctx.folder.grid, ctx.precision)
    return evidence(ctx)


def ranking(ctx: Context) -> tuple[list[Evidence], Evidence | None, dict[str, int]]:
    """The evidence ranked (`ranked_now`), its winner (None where nothing ranked) and the finished candidates'
    ranks (what the recipes' verdicts are checked against)."""
    ranked = ranked_now(ctx)
    ranks = {r.layout: r.rank for r in ranked if r.rank is not None and r.finished}
    return ranked, (ranked[0] if ranked and ranked[0].rank is not None else None), ranks
