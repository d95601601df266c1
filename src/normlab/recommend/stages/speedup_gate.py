"""The leader's effective speedup against the user's placement, for the conclusion (`stage_conclude`): its norm
tax at the user's shape (`tax`), the speedup at the proxy's width and at each of the ladder's rungs with the trend's
projection (`speedup`, `ladder`), and the gate's verdict (`gate`)."""

from __future__ import annotations

import time
from typing import Any

from normlab.layout import as_layout
from normlab.model.params import analytic_params
from normlab.recommend.evidence import gate, ladder, speedup, tax
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.planning.shape import PROXY_WIDTH
from normlab.recommend.stages.context import Context
from normlab.runs.outcome import FINISHED

TAX_TURNS_S = 40.0  # the eager tax's turns may take this long beyond its first five (a narrower interval)
COMPILED_MIN_S = 150.0  # the compiled tax is timed only with this much of the budget left (its compilation)


def norm_tax(ctx: Context, base: str, cand: str) -> dict[str, Any]:
    """The leader's norm tax against the user's placement at the user's shape (`normlab.recommend.evidence.tax`),
    eager and, where the budget leaves room for its compilation (or a cache holds it), compiled, within what
    is left of the budget; the compiled figure where measured (what a compiled run pays), else the eager one;
    where neither can be timed, why."""
    ctx.log(f"{ctx.clock.stamp()} norm tax: {ctx.labels.get(cand) or cand} against {base} at your width")
    end = ctx.clock.stop_at  # the report's reserve is left for the files still to write
    by_mode: dict[str, Any] = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled" and not ctx.cfg.tax_compiled:
            by_mode[mode] = {"value": None, "why": "not asked (--no-tax-compiled)"}
            continue
        if (
            mode == "compiled"
            and end - time.time() < COMPILED_MIN_S
            and not tax.is_cached(ctx.user.config, base, cand, mode)
        ):
            by_mode[mode] = {
                "value": None,
                "why": f"not timed: less than {COMPILED_MIN_S:g} s of the budget left "
                "for its compilation (benchmarks/norm_tax.py --compile times it)",
            }
            continue
        try:
            timing = tax.TaxTiming(mode=mode, deadline=end, extra_s=TAX_TURNS_S)
            by_mode[mode] = tax.measure(ctx.user.config, base, cand, timing).to_dict()
        except tax.TaxSkipped as e:
            by_mode[mode] = {"value": None, "interval": None, "why": str(e)}
    chosen = by_mode["compiled"] if by_mode["compiled"].get("value") is not None else by_mode["eager"]
    return {**chosen, "by_mode": {m: {k: v for k, v in t.items() if k != "by_mode"} for m, t in by_mode.items()}}


def with_ladder(ctx: Context, sp: dict[str, Any], base: Evidence, lead: Evidence, tx: dict[str, Any]) -> None:
    """The speedup at each of the ladder's rungs (the proxy's among them), the trend over compute and its
    projection to the user's scale (`normlab.recommend.evidence.ladder`), and ladder.png; into `sp`."""
    assert ctx.found.runs is not None and ctx.plan.ladder is not None
    assert base.best_lr is not None and lead.best_lr is not None
    rungs = []
    proxy = dict(
        sp["by_scale"][0], compute=speedup.cell_compute(ctx.found.runs, ctx.folder.grid.path, base.layout, base.best_lr)
    )
    for w in sorted({PROXY_WIDTH, *(int(x) for x in ctx.plan.ladder.steps)}):
        if w == PROXY_WIDTH:
            rungs.append({**proxy, "bound": sp.get("bound")})
            continue
        runs = speedup.gathered([ctx.folder.ladder(w, lr).path for lr in sorted({base.best_lr, lead.best_lr})])
        if runs is None:
            rungs.append({"width": w, "value": None, "why": "not trained"})
            continue
        # what each side's runs did at this rung: the gate counts a failure at any rung
        # (normlab.recommend.evidence.gate)
        did = {
            n: {
                "failed": int(runs[runs.layout == n].status.isin(("diverged", "stalled")).sum()),
                "finished": int(runs[runs.layout == n].status.isin(FINISHED).sum()),
            }
            for n in (base.layout, lead.layout)
        }
        one = speedup.for_pair(runs, ctx.folder.path, base, lead, tx, w, ctx.plan.depth)
        compute = speedup.cell_compute(runs, ctx.folder.path, base.layout, base.best_lr)
        rungs.append(
            {
                "width": w,
                "depth": ctx.plan.depth,
                "tokens": one.get("by_scale", [{}])[0].get("tokens"),
                "compute": compute,
                "value": one.get("value"),
                "interval": one.get("interval"),
                "interval_bounded": one.get("interval_bounded"),
                "bound": one.get("bound"),
                "seeds": one.get("seeds"),
                "why": one.get("why"),
                "runs": did,
            }
        )
    sp["by_scale"] = rungs
    n = analytic_params(ctx.user.config, as_layout(base.layout).resolve(ctx.user.config.n_layers)).non_embedding
    scale, how = ladder.user_compute(ctx.user.config, n, ctx.cfg.tokens)
    usable = [r for r in rungs if r.get("compute")]
    sp["projection"] = {**ladder.fit(usable, scale), "tokens": how}
    # the gate reads the widest rung: its speedup and interval, or why there is none; and a failure at any rung
    widest = rungs[-1]
    sp["largest_rung"] = {
        "width": widest["width"],
        "value": widest.get("value"),
        "interval": widest.get("interval"),
        "bound": widest.get("bound"),
        "interval_bounded": widest.get("interval_bounded"),
        "why": widest.get("why") or (None if widest.get("interval") else "no interval at the widest rung"),
        "ladder_failures": {
            n: sum((r.get("runs") or {}).get(n, {}).get("failed", 0) for r in rungs) for n in (base.layout, lead.layout)
        },
    }
    try:
        ladder.figure(ctx.folder.ladder_figure, usable, sp["projection"])
    except (ValueError, RuntimeError) as e:  # a figure never costs the answer
        ctx.log(f"  ladder.png not drawn: {e}")


def gated_speedup(ctx: Context, ranked: list[Evidence]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The leader's effective speedup against the user's placement (with its norm tax) and the gate's verdict."""
    assert ctx.found.runs is not None
    base = next((r for r in ranked if r.layout == ctx.current), None) if ctx.current else None
    lead = gate.leader(ranked, ctx.current)
    sp: dict[str, Any] | None = None
    if base is not None and lead is not None:
        t0 = time.time()
        tx = norm_tax(ctx, base.layout, lead.layout)  # the placement's cost, whatever its runs did
        if base.best_lr is not None and lead.best_lr is not None:
            sp = speedup.for_pair(ctx.found.runs, ctx.folder.grid.path, base, lead, tx, PROXY_WIDTH, ctx.plan.depth)
            if ctx.found.ladder is not None:
                with_ladder(ctx, sp, base, lead, tx)
        else:
            who = base.layout if base.best_lr is None else lead.layout
            sp = {"baseline": base.layout, "candidate": lead.layout, "value": None, "interval": None, "tax": tx}
            sp["why"] = f"{who} finished no run: no loss to reach"
        sp["tax_seconds"] = time.time() - t0
    gated = sp
    if sp and sp.get("largest_rung"):  # the gate reads the ladder's widest rung (normlab.recommend.evidence.gate)
        gated = {**sp, **sp["largest_rung"]}
    return sp, gate.verdict(ranked, ctx.current, gated)
