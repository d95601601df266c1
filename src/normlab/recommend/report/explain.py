"""The recommendation as words and a page: the reason for the winner with its numbers, the evidence
table, the recipe checks, the winner's settings elsewhere, and what the proxy can and cannot tell
(recommendation.md, and report.html with the ranking figure).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normlab.config.commands import RECOMMEND_BASE
from normlab.experiments.transfer import HEADROOM
from normlab.recommend.evidence import agreement, gate, ladder, speedup, tax
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.evidence.signals import precision_words
from normlab.recommend.planning.shape import PROXY_WIDTH, UserModel

if TYPE_CHECKING:  # the records the words are read from (`normlab.recommend.stages.records`), by attribute
    from normlab.recommend.planning.plan_record import Plan
    from normlab.recommend.stages.records import FinalRecord, Recommendation, ScreenRecord, StageRecord, StressRecord


def limits(
    user: UserModel,
    precision: str,
    stress: StressRecord,
    screen: ScreenRecord,
    extra: dict[str, Any],
    ranked: list[Evidence] | None = None,
) -> list[str]:
    """What the proxy scaled down, and what that can and cannot predict, in plain words."""
    c = user.config

    def setting(key: str) -> Any:
        return extra.get(key, RECOMMEND_BASE.get(key))

    out = [
        f"Width: the proxies are {PROXY_WIDTH} wide in heads of 16 (yours: {c.d_model}, heads of {c.head_dim}); "
        f"the FFN ratio ({c.ffn_dim / c.d_model:.2f}), query-to-kv ratio, MLP kind and soft-capping are yours. "
        "Width changes the size of activations and the learning rate that is stable (muP): the proxies rank "
        "placements by how they fail, not at your learning rate; take the best lr as a relative signal only.",
        f"Depth: {stress.depth} layers"
        + (
            " (yours)."
            if stress.depth == c.n_layers
            else f" (yours: {c.n_layers}; "
            f"{'set by --depth' if stress.depth_fixed else 'cut to fit the budget'}"
            "). Pre-LN's growth "
            "compounds with depth, so at your depth its failure comes sooner, "
            "not later."
        ),
        "Screen: none (--quick): the candidates given went straight to training."
        if screen.skipped
        else f"Screen: at your depth and width {screen.width}"
        + (" (yours)." if screen.width >= c.d_model else f" (yours: {c.d_model}; scaled down for time)."),
        f"Training: {setting('steps')} steps of {setting('batch_size')} x {setting('seq_len')} byte tokens "
        f"(vocabulary 256; yours {c.vocab_size:,}) on {extra.get('data', 'the default corpus (Shakespeare)')}, "
        "no weight decay, learning rates far above a large model's: stress settings chosen to make the papers' "
        "failures happen in minutes. They predict which placements fail under a large learning rate and "
        + ("fp16 storage (the stream passing 65504), " if precision == "fp16" else "bf16 storage, ")
        + "and which train to a lower loss early; they cannot predict the loss gap after billions of tokens, "
        "nor failures that take days to build (slow logit growth, rare loss spikes).",
        small_samples(ranked or []),
    ]
    out.append(precision_words(precision))
    if user.config.n_experts:
        out.append("Mixture of experts: proxied as a dense MLP; the router's own instabilities are not tested.")
    return out


def small_samples(ranked: list[Evidence]) -> str:
    """The caveat on failure counts, with the counts of the runs at hand: the winner against the candidate
    that failed most often among those ranked."""
    live = [r for r in ranked if r.rank is not None and r.finished]
    if len(live) < 2:
        return "Failure counts need more than one candidate trained to compare."
    w = live[0]
    worst = max(live[1:], key=lambda r: ((r.diverged + r.stalled) / r.finished, r.finished))
    a, b = f"{w.diverged + w.stalled}/{w.finished}", f"{worst.diverged + worst.stalled}/{worst.finished}"
    if a == b:
        return (
            f"Failure counts over a few runs are small samples: {w.shown} and {worst.shown} both failed {a} "
            "here; they do not separate on failures."
        )
    return (
        f"Failure counts over a few runs are small samples: {w.shown}'s {a} failed against {worst.shown}'s {b} "
        f"here is evidence, not proof"
        + (" (one run each: a single outcome)." if max(w.finished, worst.finished) == 1 else ".")
    )


def transfer_record() -> dict[str, Any]:
    """The transfer study's record shipped in the package (`normlab transfer ... --record`), {} if unreadable."""
    try:
        data = json.loads((Path(__file__).parent.parent / "evidence" / "transfer_record.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _said(tally: dict[str, int]) -> str:
    """A failure tally (`experiments.transfer.failure_tally`) in words."""
    return (
        f"predicted and seen {tally.get('predicted_and_seen', 0)}, predicted only {tally.get('predicted_only', 0)}, "
        f"seen only {tally.get('seen_only', 0)}"
    )


def record_lines(rec: dict[str, Any]) -> list[str]:
    """The transfer study's record in words: one line per comparison, or "not yet measured"."""
    link = 'docs/results.md, "Transfer study"'
    comps = rec.get("comparisons") or []
    if not comps:
        status = rec.get("status", "no record")
        return [f"How often the proxies' order held at larger width: not yet measured ({status}; {link})."]
    out = [f"The transfer study ({link}), {rec.get('status', '')}:"]
    for c in comps:
        tau = "-" if c.get("tau") is None else f"{c['tau']:+.2f} (p {c['p_value']:.2f})"
        top1 = "-" if c.get("top1") is None else ("agrees" if c["top1"] else "differs")
        top3 = "-" if c.get("top3") is None else f"{round(c['top3'] * c['k'])}/{c['k']}"
        h = c.get("failures_with_headroom")
        headroom = (
            f"; counting a proxy run within {HEADROOM:g}x of fp16's maximum as a predicted failure: {_said(h)}"
            if h
            else ""
        )
        out.append(
            f"{c['proxy']} against {c['other']}: {c['placements']} placements, Kendall's tau {tau}, "
            f"top-1 {top1}, top-3 {top3}; failures {_said(c.get('failures') or {})}{headroom} "
            f"(`{c['command']}`)."
        )
    return out


def verify_lines(v: dict[str, Any]) -> list[str]:
    """The verify stage's outcome in words (empty where it was not asked for)."""
    status = v.get("status", "not asked")
    if status == "not asked":
        return []
    if status == "done":
        return [v["words"]] + (
            [f"Failures that disagree: {'; '.join(v['failures_disagreeing'])}."]
            if v.get("failures_disagreeing")
            else []
        )
    if status == "pending":
        return ["The verify stage has not finished: run the same command again to complete it."]
    return [f"No verify: {v.get('why')}"]


def movement(ranked: list[Evidence], p: Plan, final: FinalRecord, rounds: list[StageRecord]) -> list[str]:
    """Which rounds ran, and how far the answer could move where the budget cut or a tie decided."""
    out = []
    for r in rounds:
        if r.stage == "screen":
            continue
        what = {
            "stress": "stress round",
            "final": "final round",
            "extend": "edge learning rates",
            "verify": "verify stage",
            "ladder": "ladder",
        }[r.stage]
        if r.finished < r.planned:
            out.append(
                f"The {what} was cut by the budget: {r.finished} of {r.planned} runs finished (predicted "
                f"{r.predicted_s / 60:.1f} min, took {r.actual_s / 60:.1f}: the machine was slower than "
                "calibrated). Run the same command again to finish it: the ranking may change."
            )
        else:
            out.append(
                f"The {what} ran in full: {r.finished} of {r.planned} runs (predicted "
                f"{r.predicted_s / 60:.1f} min, took {r.actual_s / 60:.1f})."
            )
    if not p.finalists:
        out.append(
            "No final round in this budget: the order rests on one run per candidate at the stress learning "
            "rate; a candidate that fails there may train at a lower rate."
        )
    live = [r for r in ranked if r.rank is not None]
    if live:
        tied = []
        for e in live[1:]:
            if not e.tie or e.status != "ranked":
                break
            tied.append(e.shown)
        if tied:
            out.append(
                f"{live[0].shown} is tied on loss within seed noise with {', '.join(tied)}: your placement's "
                "standing, the screen's verdict or the expected loss over the learning rates broke the tie, and more "
                "seeds could reorder them."
            )
        if len(p.seeds) < 2 and p.finalists:
            out.append(
                "One seed: no seed noise was measured, so losses within 0.01 count as tied and larger gaps may "
                "still be noise."
            )
    unseen = len(p.order) - len(p.screened)
    if unseen:
        out.append(
            f"{unseen} candidate(s) not tried ({', '.join(p.order[len(p.screened) :])}): any of them could "
            "rank first; a larger --budget tries them."
        )
    for n, x in (final.edges or {}).items():
        lrs = final.lrs
        side = "lowest" if x < min(lrs) else "highest"
        done = n in final.extended
        out.append(
            f"{n}'s best learning rate was the {side} tried ({min(lrs) if side == 'lowest' else max(lrs):g}): "
            + (
                f"the range was extended to {x:g} for it."
                if done
                else f"its optimum may lie beyond; {x:g} would be next (no room in this budget)."
            )
        )
    return out


def _best_lr(r: Evidence) -> str:
    """The table's best lr: "-" where none, "0.1 (only one tried)" where it is the only one (not an optimum)."""
    if r.best_lr is None:
        return "-"
    return f"{r.best_lr:g}" + (" (only one tried)" if len(r.loss_by_lr) == 1 else "")


def fmt_loss(r: Evidence) -> str:
    if not math.isfinite(r.best_loss):
        return "-"
    return f"{r.best_loss:.4f}" + (f" ± {r.best_loss_std:.4f}" if math.isfinite(r.best_loss_std) else "")


def sensitivity_words(r: Evidence) -> str:
    """LR sensitivity, where more than one learning rate was swept."""
    return "-" if not math.isfinite(r.lr_sensitivity) or len(r.loss_by_lr) < 2 else f"{r.lr_sensitivity:.3f}"


def yes_no(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "**no**"


def _table(ranked: list[Evidence]) -> str:
    head = (
        "rank",
        "layout",
        "screen",
        "diverged",
        "stalled",
        "at risk",
        "attention logit at best lr",
        "largest logit by lr",
        "largest activation",
        "first overflow",
        "best lr",
        "best loss",
        "LR sensitivity",
        "loss by lr",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ranked:
        if r.status in ("ruled out", "not trained"):
            lines.append(f"| - | {r.name} | {r.screen} | {r.status}: {r.why} |" + " |" * (len(head) - 4))
            continue
        rank_cell = (
            f"{r.rank}" + (" (tie)" if r.tie else "") + {"stress round only": "*", "baseline": "†"}.get(r.status, "")
        )
        act = "-" if not math.isfinite(r.max_activation) else f"{r.max_activation:,.4g}"
        sens = sensitivity_words(r)
        by_lr = "; ".join(f"{lr}: {v}" for lr, v in r.loss_by_lr.items()) or "-"
        logit = logit_words(r) if math.isfinite(r.logit_last) else "-"
        by_logit = "; ".join(f"{lr}: {v}" for lr, v in r.logit_by_lr.items()) or "-"
        lines.append(
            f"| {rank_cell} | {r.name} | {r.screen} | {r.diverged}/{r.finished} | {r.stalled}/{r.finished} | "
            f"{r.at_risk}/{r.finished} | {logit} | {by_logit} | "
            f"{act} | {r.first_break or '-'} | {_best_lr(r)} | "
            f"{fmt_loss(r)} | {sens} | {by_lr} |"
        )
    return "\n".join(lines) + "\n"


def reason(result: Recommendation, ranked: list[Evidence]) -> str:
    """`reasons` in one paragraph (the report page's)."""
    return " ".join(reasons(result, ranked))


def reasons(result: Recommendation, ranked: list[Evidence]) -> list[str]:
    """The ranking's first and why, a sentence or two each with its numbers: how sure (`_head`), what it showed
    (`_winner_parts`), an earlier answer it changes and what it takes away, why it ranks above the next, your
    placement's standing, the effect against it, and where the evidence ends."""
    live = [r for r in ranked if r.rank is not None]
    if not live:
        return ["No candidate trained: nothing to recommend."]
    w = live[0]
    cur = next((r for r in ranked if r.layout == result.current), None)
    out = [_head(result, w, cur) + ": " + "; ".join(_winner_parts(w, result.precision)) + "."]
    if changed := _changed_words(result).strip():
        out.append(changed)
    if result.dropped:
        out.append(f"It takes away your {', '.join(result.dropped)}: " + _dropped_evidence(w, cur) + ".")
    if w.diverged + w.stalled:
        out.append(
            "Even the best candidate failed on some runs: the stress is beyond what any of these placements "
            "holds at every learning rate; read the learning rates at which it trained."
        )
    if len(live) > 1:
        r2 = live[1]
        out.append(
            f"Next: {r2.name} ({r2.diverged + r2.stalled}/{r2.finished} failed, best loss {fmt_loss(r2)}"
            + (f", largest attention logit {logit_words(r2)}" if math.isfinite(r2.logit_last) else "")
            + f"); {w.shown} ranks above it {_why_above(result, w, r2)}."
        )
    if current := _current_words(result, w, cur).strip():
        out.append(current)
    eff = result.effect
    if words := effect_words(eff).strip():
        out.append(words)
    separable = result.confidence is not None and result.confidence.separable
    if eff.get("status") == "measured" and eff.get("interval") and not separable:
        out.append("The difference in loss from your placement is within seed noise.")
    dom = result.domain
    if dom and not dom.get("inside_record"):
        out.append("Outside what the transfer record measured: " + "; ".join(dom.get("differences") or []) + ".")
    return out


def headline(result: Recommendation, ranked: list[Evidence]) -> list[str]:
    """recommendation.md's opening: one line (the gate's verdict, its size, how sure), then the reasons as a
    short list."""
    v = result.verdict
    sp = result.effect.get("speedup") or {}
    lines = []
    if v:
        level = result.confidence.level if result.confidence else None
        # the gate's own figure: the ladder's widest rung where one ran, else the proxy's
        gated = {**sp, **sp["largest_rung"]} if (sp.get("largest_rung") or {}).get("interval") else sp
        said = speedup.words(gated) if gated.get("value") is not None and v.get("gate") == "speedup" else ""
        lines += [gate.headline(v, said, level if v["decision"] != "no answer yet" else None), ""]
        if v.get("gate") == "stability" or (v["decision"] == "keep" and sp.get("value") is not None):
            lines += (
                [f"- effective speedup of {_shown(result, sp.get('candidate'))}: {speedup.words(sp)}"] if sp else []
            )
    return lines + [f"- {x}" for x in reasons(result, ranked)]


def _head(result: Recommendation, w: Evidence, cur: Evidence | None) -> str:
    """ "Recommended (provisional: why; the runs behind each side, the seeds; what the budget cut)" """
    conf = result.confidence
    if conf is None:
        return "Ranked first"
    behind = f"{w.finished} finished run(s) behind it" + (
        f", {cur.finished} behind your {cur.layout}" if cur is not None and cur is not w and cur.finished else ""
    )
    cuts = [c.split(" (")[0].split(":")[0] for c in result.plan.cut]
    bits = [*conf.why, f"{behind}, {conf.seeds} seed(s)"]
    if cuts:
        bits.append("the budget cut: " + ", ".join(cuts))
    return f"Ranked first ({conf.level}: {'; '.join(bits)})"


def _winner_parts(w: Evidence, precision: str) -> list[str]:
    """What the winner's runs showed: failures and loss, runs at risk, logits, activations, the screen."""
    label = f" ({w.label})" if w.label else ""
    parts = [
        f"**{w.shown}**{label}: {w.diverged + w.stalled}/{w.finished} runs diverged or stalled, best loss "
        f"{fmt_loss(w)} at lr {w.best_lr:g}"
        if w.best_lr is not None
        else f"**{w.shown}**{label}"
    ]
    if w.at_risk:
        parts.append(f"{w.at_risk}/{w.finished} runs at risk ({w.risk})")
    if math.isfinite(w.logit_last):
        parts.append(f"largest attention logit {logit_words(w)}")
    if math.isfinite(w.max_activation) and precision == "fp16":
        below = w.max_activation < 65504
        parts.append(
            f"largest activation {w.max_activation:,.4g} "
            + (
                f"({65504 / w.max_activation:,.0f}x below the FP16 maximum)"
                if below
                else "(past the FP16 maximum 65,504)"
            )
        )
    elif math.isfinite(w.max_activation):
        parts.append(f"largest activation {w.max_activation:,.4g} ({precision}: no overflow in reach)")
    if w.screen != "not screened":
        parts.append(f"screen: {w.screen}" + (f" ({w.screen_why})" if w.screen_why and w.screen != "stable" else ""))
    return parts


def _changed_words(result: Recommendation) -> str:
    """An earlier call's different answer, with the finished runs behind each."""
    changed = result.changed_from
    if not changed:
        return ""
    earlier, now = changed.get("runs"), sum(result.confidence.runs.values()) if result.confidence else 0
    return (
        f" This differs from an earlier call's answer, {changed['winner']} ({changed.get('confidence', '')}"
        + (f", on {earlier} finished runs" if earlier is not None else "")
        + f"); this one rests on {now} finished runs."
    )


def _why_above(result: Recommendation, w: Evidence, r2: Evidence) -> str:
    """Why the winner ranks above the next: the criterion that decided (`rank.rank`'s order)."""
    if r2.status in ("stress round only", "baseline"):  # ranked by the stress round, not the rule
        if w.status != "ranked":
            return "on the stress round, where it did better at the stress lr"
        return "on the final round's evidence; the stress round put it ahead"
    if r2.tie:
        if w.layout == result.current:
            return "in a tie on loss within seed noise, broken by being your placement (a change needs evidence)"
        if r2.screen != w.screen:
            return "in a tie on loss within seed noise, broken by the screen's verdict"
        return (
            "in a tie on loss within seed noise, broken by the expected loss over the learning rates "
            f"({w.expected_loss:.3f} vs {r2.expected_loss:.3f}: best loss + LR sensitivity)"
        )
    if r2.failures > w.failures:
        return "on fewer failures"
    if r2.risk_share > w.risk_share:
        return f"on fewer runs at risk ({r2.shown}: {r2.at_risk}/{r2.finished}, {r2.risk})"
    return "on a lower best loss"


def _current_words(result: Recommendation, w: Evidence, cur: Evidence | None) -> str:
    """The user's placement's standing."""
    name = result.current
    if name and name == w.layout:
        return " That is your current placement."
    if not name or cur is None or cur.rank is None:
        return ""
    how = f" ({cur.why})" if cur.status == "baseline" else ""
    return (
        f" Your current placement {name} ranks #{cur.rank}{how}: {cur.diverged + cur.stalled}/{cur.finished} failed, "
        f"best loss {fmt_loss(cur)}" + (f", first overflow at {cur.first_break}" if cur.first_break else "") + "."
    )


def logit_words(r: Evidence) -> str:
    """The winner's largest attention logit at its best learning rate, first probe to last, with its growth."""
    out = f"{r.logit_first:,.3g} -> {r.logit_last:,.4g} (x{r.logit_growth:.2g} / 100 steps"
    if math.isfinite(r.logit_steps_to_limit):
        out += f"; the precision's limit in ~{r.logit_steps_to_limit:,.0f} steps at that growth"
    return out + ")"


def _dropped_evidence(w: Evidence, current: Evidence | None) -> str:
    """The evidence for taking away what the user has: the two placements' failures, runs at risk, logits."""
    if current is None or current.rank is None:
        return "your placement did not train here, so these runs hold no evidence for removing it"
    said = (
        f"here {w.shown} failed {w.diverged + w.stalled}/{w.finished} with {w.at_risk} at risk against your "
        f"{current.shown}'s {current.diverged + current.stalled}/{current.finished} with {current.at_risk}"
    )
    if math.isfinite(w.logit_peak) and math.isfinite(current.logit_peak):
        said += f"; largest attention logit {w.logit_peak:,.4g} against {current.logit_peak:,.4g}"
    return said + " (proxy runs of minutes: removing a stabilizer you have needs more than this)"


def effect_words(eff: dict[str, Any]) -> str:
    """The effect against the user's placement in one sentence ("" where there is none)."""
    if eff.get("status") != "measured":
        return ""
    d, iv = eff["difference"], eff.get("interval")
    text = f" Against your placement {eff['baseline']}, at the proxy: {d:+.3f} nats of final training loss"
    if iv is not None:
        text += f" (95% interval {iv[0]:+.3f} to {iv[1]:+.3f}, {eff['seeds'][0]} and {eff['seeds'][1]} seeds)"
    else:
        text += " (one seed on a side: no interval)"
    sel = eff.get("selection")
    if sel:
        text += f"; {sel['words']}"
    return text + "."


def _time(result: Recommendation) -> str:
    """This call's minutes against the budget; for a resumed recommendation, every call's too."""
    budget = f"{result.budget_minutes:g}"
    calls = result.call_minutes or [result.minutes]
    if len(calls) == 1:
        return f"{result.minutes:.1f} of {budget} min"
    return (
        f"{sum(calls):.1f} min over {len(calls)} calls ({', '.join(f'{m:.1f}' for m in calls)}; the budget is "
        f"{budget} min a call)"
    )


def _shown(result: Recommendation, layout: Any) -> Any:
    """A candidate as the output calls it: a change to your placement by its name (the ranking's `short`)."""
    return next((r["short"] for r in result.ranking if r.get("layout") == layout and r.get("short")), layout)


def markdown(result: Recommendation, ranked: list[Evidence]) -> str:
    p = result.plan
    shown = {r.layout: r.shown for r in ranked}  # a change to your placement by its name (`Evidence.shown`)
    lines = [
        "# normlab recommend",
        "",
        f"- model: {result.model}",
        f"- precision: {result.precision}",
        f"- time: {_time(result)}",
        f"- optimizer: {result.optimizer}",
        f"- proxy: {p.depth} layers x d {PROXY_WIDTH}; stress round {len(p.stress.candidates)} runs; final "
        f"round: {', '.join(shown.get(n, n) for n in p.final.finalists) or 'none'}"
        + (
            f" x lr {', '.join(f'{x:g}' for x in p.final.lrs)} x {len(p.final.seeds)} seeds"
            if p.final.finalists
            else ""
        ),
    ]
    lines += [f"- the budget bought: {c}" for c in p.cut]
    lines += [f"- note: {n}" for n in result.notes]
    lines += [
        "",
        *headline(result, ranked),
        "",
        "## Evidence (ranked)",
        "",
        "Rank: fewer diverged + stalled runs first; then fewer runs at risk (trained to the end with the largest "
        "attention logit past what your precision resolves, or under fp16 the largest activation within 8x of "
        "the overflow: "
        + precision_words(result.precision)
        + "); then lower best loss, losses within seed noise (or 0.01) "
        "tied and ordered with your placement first, then by the screen's verdict, then the expected loss over "
        "the learning rates (best loss + LR sensitivity, Wortsman et al.). * = trained in the stress round only "
        "(one run at the stress lr), ranked after the finalists in that round's order (trained to the end by loss, "
        "then stalled, then diverged by the step it diverged at: a few steps apart is noise, read these as three "
        "groups); † = your current placement, in the final round as the baseline though the stress round did not "
        "put it among the best: ranked with those it displaced, by its stress run, its final runs shown.",
        "",
        _table(ranked),
    ]
    lines += answer_lines(result)
    if result.recipe_checks:
        lines += [
            "## Against the recipes' verdicts",
            "",
            agreement.summary(result.recipe_checks),
            "",
            "| recipe | verdict there | its setting | ranked here | ranking agrees | at its setting, here | holds |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c['recipe']} | {c['claim']}: {c['evidence']} | {c['setting']} | {c['ranks']} | "
            f"{yes_no(c['agrees'])} | {c.get('at_setting', '-')} | {yes_no(c.get('agrees_at_setting'))} |"
            for c in result.recipe_checks
        ]
        lines.append("")
    if result.settings:
        lines += [f"## {result.winner} in your code base", ""]
        lines += [f"- **{k}**: {v['settings']}" for k, v in result.settings.items()]
        lines.append("")
    if verify_lines(result.verify):
        lines += ["## Did the order hold at a larger width? (--verify)", ""]
        lines += [f"- {x}" for x in verify_lines(result.verify)] + [""]
    lines += (
        ["## How often the proxies have been right", ""]
        + [f"- {x}" for x in record_lines(result.transfer_record)]
        + [""]
    )
    if result.movement:
        lines += ["## What ran, and how far the answer could move", ""] + [f"- {x}" for x in result.movement] + [""]
    lines += ["## What the proxy can and cannot tell", ""] + [f"- {x}" for x in result.limits]
    files = result.files
    lines += [
        "",
        f"Files: {files['grid']} (every run, the U-curves, the largest activations), "
        f"{files['screen']}, {files['plan']}, {files['json']}.",
    ]
    return "\n".join(lines) + "\n"


ANSWER_TITLE = "How sure, how large, and where the evidence ends"


def answer_items(result: Recommendation) -> list[str]:
    """The answer's confidence, effect, recipe and domain, one item each (the words in **bold** where the
    markdown stresses them)."""
    conf, eff, rec, dom = result.confidence, result.effect, result.recipe, result.domain
    out = []
    if conf:
        runs = ", ".join(f"{k} {v}" for k, v in conf.runs.items())
        out.append(
            f"confidence: **{conf.level}**"
            + (f" ({'; '.join(conf.why)})" if conf.why else "")
            + f"; finished runs behind each: {runs or 'none'}; seeds: {conf.seeds}"
            + (f"; {conf.not_tried} candidate(s) not tried" if conf.not_tried else "")
        )
    sp = eff.get("speedup") or {}
    if sp:
        out.append(
            f"effective speedup of {_shown(result, sp.get('candidate'))} against your {sp.get('baseline')}: "
            + speedup_item(sp)
        )
    if eff.get("status") == "measured":
        out.append("effect:" + effect_words(eff))
    elif eff:
        out.append(f"effect: {eff.get('why') or eff.get('status')}")
    if rec:
        out.append(f"recipe: {rec['words']}")
    if dom:
        where = "inside" if dom.get("inside_record") else "**outside**"
        out.append(
            f"domain: {where} what the transfer record measured"
            + (f": {'; '.join(dom['differences'])}" if dom.get("differences") else "")
            + (f"; {dom['tokens_note']}" if dom.get("tokens_note") else "")
        )
    return out


def speedup_item(sp: dict[str, Any]) -> str:
    """The speedup with its interval, rung, projection and tax, in words."""
    text = speedup.words(sp)
    for key in ("why_interval", "why_tax"):
        if sp.get(key):
            text += f"; {sp[key]}"
    t = sp.get("tax") or {}
    if t.get("value") is not None:
        text += f"; norm tax {tax.words(t)}" + (" (cached)" if t.get("cached") else "")
    elif t.get("why"):
        text += f"; norm tax not measured: {t['why']}"
    for mode, other in (t.get("by_mode") or {}).items():
        if mode != t.get("mode"):
            text += f"; {mode}: " + (tax.words(other) if other.get("value") is not None else other.get("why", "-"))
    rungs = sp.get("by_scale") or []
    if len(rungs) > 1:
        text += "; by scale: " + ", ".join(
            f"d {r['width']} "
            + (
                f"x{r['value']:.2f}"
                + (f" [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]" if r.get("interval") else "")
                if r.get("value") is not None
                else f"- ({r.get('why') or 'not measured'})"
            )
            for r in rungs
        )
    proj = sp.get("projection") or {}
    if proj.get("interval") is not None:
        text += f"; {ladder.words(proj)} (tokens at your scale: {proj.get('tokens')})"
    elif proj.get("why"):
        text += f"; at your scale: {proj['why']}"
    if sp.get("method"):
        text += f" (method: {sp['method']})"
    return text


def answer_lines(result: Recommendation) -> list[str]:
    """recommendation.md's section of `answer_items` (none where there is nothing to say)."""
    items = answer_items(result)
    return [f"## {ANSWER_TITLE}", "", *(f"- {x}" for x in items), ""] if items else []
