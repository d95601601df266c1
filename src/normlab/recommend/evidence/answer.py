"""The answer sized to its evidence: the effect against the user's own placement with an interval from
seeds (and what picking one candidate of many does to it), how sure the answer is, the recipe to train
with, and where the evidence ends (recommendation.json's `effect`, `confidence`, `recipe`, `domain`).

Effect. The winner's mean final loss over seeds at its best learning rate minus the user's placement's at
its own best, with Welch's 95% interval (unequal variances: t with the Welch-Satterthwaite degrees of
freedom; scipy.stats.t). One seed on either side measures no seed noise: no interval, said so.

Selection. The winner is the lowest of k candidates' best losses, each itself the lowest over the learning
rates tried: the minimum of noisy estimates is optimistic (the winner's curse). Under seed noise of
standard error se per candidate, the expected best of k equal candidates lies below their common mean
by se * E[max of k standard normals] (Blom's approximation Phi^-1((k - 0.375) / (k + 0.25)); Blom 1958);
`selection` reports that amount and the effect with it taken off.

Confidence. "provisional" while the evidence is thin (a round cut by the budget, one seed, no final round,
the winner tied within noise, fewer than two finished runs behind it, candidates not tried, proxies
shortened, a final round for fewer than all), else "supported"; `separable`
says whether the interval excludes zero. An answer that differs from an earlier call's says so
(`changed_from`).

Domain. The user's setting (precision, optimizer, width and depth against the proxy's, training tokens
where given) against what the transfer record measured (`transfer_record.json`: each comparison's proxy
and wider rung, or where an older record lacks their shapes, the recipes that made them).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import pandas as pd
from scipy import stats

from normlab.errors import ConfigError
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.planning.plan_record import Plan
from normlab.recommend.planning.shape import PROXY_WIDTH, UserModel
from normlab.recommend.stages.records import Confidence, StageRecord

LEVELS = ("provisional", "supported")


def expected_best_of(k: int) -> float:
    """E[max of k independent standard normals] (Blom's approximation; 0 for k <= 1)."""
    if k <= 1:
        return 0.0
    return NormalDist().inv_cdf((k - 0.375) / (k + 0.25))


def _losses(runs: pd.DataFrame, layout: str, lr: float | None) -> list[float]:
    if lr is None or not len(runs):
        return []
    cell = runs[(runs.layout == layout) & ((runs.lr - lr).abs() <= 1e-9 * lr) & (runs.status == "ok")]
    return [float(x) for x in pd.to_numeric(cell.final_loss, errors="coerce").dropna()]


def welch(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, list[float] | None]:
    """mean(a) - mean(b) and its Welch interval (None where a side has fewer than two values)."""
    d = sum(a) / len(a) - sum(b) / len(b)
    if len(a) < 2 or len(b) < 2:
        return d, None
    df = welch_df(a, b)
    if df == 0:  # identical losses over seeds: no spread measured, so no interval (a zero width would claim one)
        return d, None
    se = math.sqrt(pd.Series(a).var(ddof=1) / len(a) + pd.Series(b).var(ddof=1) / len(b))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    return d, [d - half, d + half]


def welch_df(a: list[float], b: list[float]) -> float:
    """The Welch-Satterthwaite degrees of freedom of mean(a) - mean(b) (0 under two values a side, or where
    neither side spreads)."""
    if len(a) < 2 or len(b) < 2:
        return 0.0
    va, vb = pd.Series(a).var(ddof=1) / len(a), pd.Series(b).var(ddof=1) / len(b)
    if va + vb == 0:
        return 0.0
    return float((va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)))


def effect(runs: pd.DataFrame, ranked: list[Evidence], current: str | None, n_lrs: int) -> dict[str, Any]:
    """recommendation.json's `effect` (module doc)."""
    live = [r for r in ranked if r.rank is not None]
    if not live:
        return {"status": "no winner"}
    w = live[0]
    base = next((r for r in ranked if r.layout == current), None) if current else None
    if base is None or base.rank is None:
        why = "your model file does not name its placement" if current is None else f"{current} did not train"
        return {"status": "no baseline", "why": why, "candidate": w.layout}
    a, b = _losses(runs, w.layout, w.best_lr), _losses(runs, base.layout, base.best_lr)
    if not a or not b:
        return {"status": "no baseline", "why": "no finished run at a best learning rate", "candidate": w.layout}
    d, interval = welch(a, b)
    out: dict[str, Any] = {
        "status": "same" if w.layout == base.layout else "measured",
        "baseline": base.layout,
        "candidate": w.layout,
        "baseline_loss": sum(b) / len(b),
        "candidate_loss": sum(a) / len(a),
        "difference": d,
        "interval": interval,
        "level": 0.95,
        "seeds": [len(a), len(b)],
        "method": "Welch's t over seeds, each at its best learning rate"
        if interval is not None
        else "one seed on a side (or no spread over seeds): no seed noise measured, so no interval; a larger "
        "--budget buys a second seed next (the plan's growth: normlab.recommend.planning.plan)",
    }
    k = len(live)
    spread = [pd.Series(x).std(ddof=1) for x in (a, b) if len(x) >= 2]
    if w.layout != base.layout and spread:
        se = (sum(spread) / len(spread)) / math.sqrt(min(len(a), len(b)))
        bias = se * expected_best_of(k)
        out["selection"] = {
            "picked_from": k,
            "learning_rates": n_lrs,
            "optimism": bias,
            "difference_corrected": d + bias,
            "words": f"picked as the best of {k} candidates: its loss is optimistic by about {bias:.3f} nats (the "
            f"expected best of {k} draws of seed noise, se {se:.3f}; picking each one's best of {n_lrs} learning rates "
            f"is not counted); the difference with that taken off: {d + bias:+.3f}",
        }
    return out


def confidence(ranked: list[Evidence], rounds: list[StageRecord], plan: Plan, eff: dict[str, Any]) -> Confidence:
    """recommendation.json's `confidence` (module doc)."""
    live = [r for r in ranked if r.rank is not None]
    thin: list[str] = []
    cut_rounds = [r for r in rounds if r.stage != "screen" and r.finished < r.planned]
    for r in cut_rounds:
        thin.append(f"the budget cut the {r.stage} round: {r.finished} of {r.planned} runs finished")
    if not plan.finalists:
        thin.append("no final round: one run per candidate")
    if len(plan.seeds) < 2:
        thin.append("one seed: no seed noise measured")
    if live and live[0].finished < 2:
        thin.append(f"{live[0].shown} has {live[0].finished} finished run")
    if len(live) > 1 and live[1].tie:
        thin.append(f"tied within noise with {live[1].shown}")
    not_tried = len(plan.order) - len(plan.screened)
    if not_tried:
        thin.append(f"{not_tried} candidate(s) not tried")
    cuts = " ".join(plan.cut)
    if "proxies of" in cuts and "steps (asked" in cuts:
        thin.append("proxies shortened")
    if plan.finalists and plan.finalists < len(plan.screened):
        thin.append(f"a final round for {plan.finalists} of {len(plan.screened)}")
    interval = eff.get("interval")
    return Confidence(
        level="provisional" if thin else "supported",
        why=thin,
        runs={r.layout: r.finished for r in live},
        seeds=len(plan.seeds),
        not_tried=not_tried,
        separable=None if interval is None else (interval[1] < 0 or interval[0] > 0),
    )


def lr_transfer(record: dict[str, Any], parametrization: str, optimizer: str | None = None) -> dict[str, Any] | None:
    """What the transfer record measured of the learning-rate optimum under ``parametrization``: per reach (the
    wider or deeper rung against the proxy) the factors it moved (`normlab.experiments.lr_optimum`: the vertex of
    the loss in log lr) and the bounds where a grid's end left it open, in words; None where the record holds no
    such comparison. ``optimizer``: only the comparisons trained with it (an optimizer's rates are its own: Muon's
    optimum is not AdamW's)."""
    by_reach: dict[str, tuple[list[float], list[str]]] = {}
    for c in record.get("comparisons") or []:
        ps, os_ = c.get("proxy_shape") or {}, c.get("other_shape") or {}
        if c.get("parametrization") != parametrization or not c.get("lr_optimum"):
            continue
        if optimizer is not None and os_.get("optimizer", "adamw") != optimizer:  # another optimizer's rates
            continue
        reach = ", ".join(
            f"{os_[k] / ps[k]:g}x {word}"
            for k, word in (("d_model", "width"), ("n_layers", "depth"))
            if ps.get(k) and os_.get(k) and os_[k] != ps[k]
        )
        moves, bounds = by_reach.setdefault(reach or "the same shape", ([], []))
        for layout, m in c["lr_optimum"].items():
            if m.get("kind") == "measured":
                moves.append(float(m["factor"]))
            elif m.get("kind"):
                bounds.append(f"{layout} {m['kind']} x{float(m['factor']):.2f}")
    if not by_reach:
        return None
    parts = []
    for reach, (moves, bounds) in sorted(by_reach.items()):
        span = [f"x{min(moves):.2f} to x{max(moves):.2f}" if len(moves) > 1 else f"x{moves[0]:.2f}"] if moves else []
        parts.append(f"{reach}: " + ", ".join(span + bounds))
    return {
        "parametrization": parametrization,
        "moved": {reach: sorted(moves) for reach, (moves, _) in by_reach.items()},
        "bounds": [b for _, bounds in by_reach.values() for b in bounds],
        "words": f"the optimum under {parametrization}"
        + (f" with {optimizer}" if optimizer else "")
        + " in the transfer record moved "
        + "; ".join(parts)
        + " (CPU rungs, one seed each)",
    }


def recipe(
    winner: Evidence | None,
    label: str = "",
    optimizer: str = "adamw",
    record: dict[str, Any] | None = None,
    width: int | None = None,
) -> dict[str, Any]:
    """recommendation.json's `recipe`: the layout, the proxy's best learning rate, and the parametrization
    that carries it to the user's width (muP from the proxy's width: at its base width muP is SP, so the
    proxy's learning rate is muP's base learning rate; `normlab.model.parametrization`); with the user's
    ``width``, `sp`: the rates for an SP model in a library without muP (`sp_rates`)."""
    if winner is None:
        return {}
    if optimizer == "sgd":  # muP's SGD rule is not built: the rate is SP's, measured at the proxy's width only
        return {
            "layout": winner.layout,
            "label": label or winner.label,
            "lr": winner.best_lr,
            "parametrization": "sp",
            "words": f"--layout {winner.layout!r}; lr {winner.best_lr}"
            + (" (the only learning rate tried: not an optimum)" if len(winner.loss_by_lr) == 1 else "")
            + f" at the proxy's width {PROXY_WIDTH} under SGD in "
            "standard parametrization: it does not carry to your width (the transfer study: the best rate fell 3x "
            "from width 64 to 128 in SP; docs/results.md)",
        }
    moved = lr_transfer(record or {}, "mup", optimizer)
    # one learning rate tried: the rate the evidence is at, not an optimum (nothing was compared)
    only = " (the only learning rate tried: not an optimum)" if len(winner.loss_by_lr) == 1 else ""
    words = (
        f"--layout {winner.layout!r}; lr {winner.best_lr:g}{only} at the proxy's width {PROXY_WIDTH}: train with "
        f"--set model.parametrization=mup --set model.base_d_model={PROXY_WIDTH} so that it is the base learning "
        "rate muP carries to your width (Yang et al. 2022); in standard parametrization it does not carry"
        if winner.best_lr is not None
        else f"--layout {winner.layout!r}; no best learning rate measured"
    )
    if moved is not None and winner.best_lr is not None:
        sp = lr_transfer(record or {}, "sp", optimizer)
        words += f" ({moved['words']}" + (f"; {sp['words']}" if sp else "") + "; the proxy's grid is 3x apart)"
    in_sp = sp_rates(winner.best_lr, width, optimizer) if winner.best_lr is not None and width else None
    if in_sp is not None:
        words += f". {in_sp['words']}"
    return {
        "layout": winner.layout,
        "label": label or winner.label,
        "lr": winner.best_lr,
        "parametrization": "mup",
        "base_d_model": PROXY_WIDTH,
        "lr_transfer": moved,
        "sp": in_sp,
        "words": words,
    }


def sp_rates(base_lr: float, width: int, optimizer: str = "adamw") -> dict[str, Any]:
    """The learning rates a standard-parametrization model of width ``width`` takes from muP's transfer of the
    proxy's ``base_lr`` (muP's base width `PROXY_WIDTH`), for the libraries that have no muP (OLMo-core,
    torchtitan, litgpt: `normlab.recommend.frameworks.settings.PINS`).

    muP under Adam (Yang et al. 2022, Tensor Programs V, Table 3; `normlab.model.parametrization`): a hidden matrix
    trains at base_lr / m, m = width / base width; the embedding, biases and norm gains at base_lr. Without muP's
    1/m on the logits (SP has none), the head is a hidden matrix in that table's SP-form (Table 8's output weights:
    lr / fan_in), so it takes base_lr / m as well. Under Muon its matrices' update is width-invariant (its own
    sqrt(fan_out / fan_in) rule): they keep base_lr; the AdamW half's head takes / m. What SP cannot carry (muP's
    init scales, its 1/d_head attention scale) is said: the rates are muP's, the transfer guarantee is not."""
    from normlab.recommend.frameworks.settings import PINS

    m = width / PROXY_WIDTH
    hidden = base_lr / m
    libraries = ", ".join(pin.replace("==", " ") for pin in PINS.values())
    if optimizer == "muon":
        matrices, how = base_lr, "Muon's own update is width-invariant: its matrices keep the base rate"
        rest = f"the AdamW half's head at its rate x {PROXY_WIDTH}/{width}, embeddings and norm gains at its rate"
    else:
        matrices, how = (
            hidden,
            f"muP's Adam rate for hidden matrices and the head: base {base_lr:g} x {PROXY_WIDTH}/{width}",
        )
        rest = (
            f"embeddings and norm gains at {base_lr:g} where the library takes parameter groups (muP's rate for them)"
        )
    return {
        "width": width,
        "lr": matrices,
        "vector_lr": base_lr,
        "width_mult": m,
        "libraries": list(PINS),
        "words": f"For your SP model in {libraries} (none has muP; muP itself is normlab's only): lr {matrices:.3g} at "
        f"width {width} ({how}); {rest}. SP keeps its own init and 1/sqrt(d_head) attention scale, which muP changes: "
        "these are muP's rates at your width, not its transfer guarantee",
    }


def _recipe_shape(name: str) -> dict[str, Any] | None:
    """A transfer rung's shape from the recipe that made it (for records written before shapes were kept)."""
    from normlab.experiments.recipes import load_recipe
    from normlab.experiments.transfer import config_scale, shape_of

    try:
        spec = load_recipe(name).expand()[0]
    except (ConfigError, OSError, KeyError, ValueError):  # a recipe renamed since: no shape, said as unknown
        return None
    return shape_of(config_scale(spec.train_config("unused")))


def measured(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each comparison of the transfer record as (proxy shape, other shape)."""
    out = []
    for c in record.get("comparisons") or []:
        proxy = c.get("proxy_shape") or _recipe_shape(str(c.get("proxy")))
        other = c.get("other_shape") or _recipe_shape(str(c.get("other")))
        if proxy and other:
            out.append({"proxy": proxy, "other": other, "name": f"{c.get('proxy')} -> {c.get('other')}"})
    return out


def _elementwise(layout: str | None) -> bool:
    """Whether a layout normalizes with an element-wise squash somewhere: a kind whose facts say point-wise
    (normlab.layout.norm_kinds: DyT, Derf)."""
    if layout is None:
        return False
    from normlab.layout import as_layout
    from normlab.layout.norm_kinds import NORM_FACTS

    lay = as_layout(layout)
    return any(NORM_FACTS[lay.norm_at(s).kind].pointwise for s in lay.sites_on())


def domain(
    user: UserModel,
    precision: str,
    optimizer: str,
    proxy_depth: int,
    record: dict[str, Any],
    tokens: int | None = None,
    winner: str | None = None,
) -> dict[str, Any]:
    """recommendation.json's `domain` (module doc): `inside_record` and the `differences` in words."""
    pairs = measured(record)
    c = user.config
    yours = {
        "precision": precision,
        "optimizer": optimizer,
        "width_ratio": c.d_model / PROXY_WIDTH,
        "depth_ratio": c.n_layers / proxy_depth,
        "d_model": c.d_model,
        "n_layers": c.n_layers,
        "tokens": tokens,
    }
    if not pairs:
        return {
            "inside_record": False,
            "differences": ["the transfer record measured nothing yet: no evidence that the proxies' order holds"],
            "yours": yours,
            "measured": [],
        }
    precisions = sorted({str(p[s]["precision"]) for p in pairs for s in ("proxy", "other")})
    optimizers = sorted({str(p[s]["optimizer"]) for p in pairs for s in ("proxy", "other")})
    width = max(p["other"]["d_model"] / p["proxy"]["d_model"] for p in pairs)
    depth = max(p["other"]["n_layers"] / p["proxy"]["n_layers"] for p in pairs)
    tok = max(p["other"]["tokens"] / p["proxy"]["tokens"] for p in pairs)
    diffs = []
    if precision not in precisions:
        diffs.append(f"precision: yours {precision}, measured {', '.join(precisions)}")
    if optimizer not in optimizers:
        diffs.append(f"optimizer: yours {optimizer}, measured {', '.join(optimizers)}")
    if yours["width_ratio"] > width:
        diffs.append(
            f"width: yours is {yours['width_ratio']:g}x the proxy's ({c.d_model} against {PROXY_WIDTH}), measured "
            f"up to {width:g}x"
        )
    if yours["depth_ratio"] > depth:
        diffs.append(
            f"depth: yours is {c.n_layers} layers, {yours['depth_ratio']:.3g}x the proxies' {proxy_depth}; the record "
            + ("compared rungs of one depth" if depth == 1 else f"measured up to {depth:g}x")
        )
    most = max(p["other"]["tokens"] for p in pairs)
    if tokens and tokens > most:
        diffs.append(f"tokens: yours {tokens:,}, measured up to {most:,} ({tok:g}x the proxy's)")
    if tokens and tokens > most and _elementwise(winner):
        diffs.append(
            f"regime: {winner} replaces norms with an element-wise squash (DyT/Derf), which helps at small token "
            "budgets and hurts at large ones as more of its inputs saturate (arXiv 2604.23434); the proxies trained "
            f"{pairs[0]['proxy']['tokens']:,} tokens, yours {tokens:,}: the probes' saturated_share of the proxy runs "
            "says how far into saturation they went"
        )
    return {
        "inside_record": not diffs,
        "differences": diffs,
        "tokens_note": f"the record's runs trained at most {most:,} tokens ({tok:g}x the proxy's): none measures "
        "failures that take days to build",
        "yours": yours,
        "measured": [
            {"comparison": p["name"], "width": p["other"]["d_model"] / p["proxy"]["d_model"], **p["other"]}
            for p in pairs
        ],
    }


def changed_from(answers: list[dict[str, Any]], winner: str | None) -> dict[str, Any] | None:
    """The earlier call's answer where it differs from this one (plan.json keeps each call's), else None."""
    earlier = [a for a in answers if a.get("winner")]
    if not earlier or earlier[-1]["winner"] == winner:
        return None
    return earlier[-1]


__all__ = [
    "LEVELS",
    "changed_from",
    "confidence",
    "domain",
    "effect",
    "expected_best_of",
    "recipe",
    "sp_rates",
    "welch",
]
