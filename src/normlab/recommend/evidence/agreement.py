"""The recipes' verdicts that a ranking can be checked against (docs/results.md, measured on the 2-core
VM in the recipes' own runs): pairs where one placement came out ahead of another, under the
precision the recipe stressed and at the learning rates it swept. `check` reads a recommendation
against every pair whose two candidates it ranked, twice:

- the ranking: is the recipe's better placement ranked above the worse one? (what the user is told);
- at the recipe's setting: at each learning rate both the recipe and this recommendation ran both
  placements, is the better one ahead there by the ranking's own rule (fewer diverged + stalled runs,
  then lower mean final loss)? Where no such learning rate exists (a placement that stalled at the
  stress round's 0.1 never reaches a final round's lower rates), the settings do not overlap and that
  is said instead of a verdict.

A disagreement is reported, never hidden, beside the recipe's own setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class Verdict:
    better: str
    worse: str
    precision: str  # fp16: under fp16 storage at the stress lr; bf16: over a learning-rate grid in float/bf16; any
    recipe: str
    evidence: str
    setting: str  # the recipe's learning rates and storage: a ranking made elsewhere may differ for that reason
    lrs: tuple[float, ...]  # the learning rates the recipe measured the pair at


VERDICTS: tuple[Verdict, ...] = (
    Verdict(
        "peri",
        "pre",
        "fp16",
        "stress-kim-fp16",
        "Pre-LN diverged on 4/5 seeds (MLP residual add, blocks 10-11), Peri-LN 0/5 with its largest activation at 106",
        "lr 0.1, fp16 storage, 12 layers",
        (0.1,),
    ),
    Verdict(
        "peri",
        "post",
        "fp16",
        "stress-kim-fp16",
        "Post-LN stalled at the unigram loss on 3/5 seeds, Peri-LN 0/5",
        "lr 0.1, fp16 storage, 12 layers",
        (0.1,),
    ),
    Verdict(
        "peri",
        "hybrid",
        "fp16",
        "stress-kim-fp16",
        "HybridNorm stalled on 3/5 seeds (largest activation 31,024), Peri-LN 0/5",
        "lr 0.1, fp16 storage, 12 layers",
        (0.1,),
    ),
    *(
        Verdict(
            "peri",
            worse,
            "fp16",
            "stress-residual-stream",
            f"{what} diverged on 3/3 seeds (steps {steps}), Peri-LN 0/3 (final loss 2.389 +- 0.014)",
            "lr 0.1, fp16 storage, 12 layers",
            (0.1,),
        )
        for worse, what, steps in (
            ("pre-gpas", "GPAS on Pre-LN", "14-26"),
            ("pre-lambda", "Pre-LN with learned skip/branch lambdas", "12-23"),
            ("pre-hc", "hyper-connections on Pre-LN (composite mixing gain 10.8-551)", "8-11"),
            ("pre-mhc", "mHC on Pre-LN (composite mixing gain held at 1.000)", "14-15"),
        )
    ),
    Verdict(
        "peri",
        "pre",
        "bf16",
        "kim-lr",
        "Peri-LN's loss was lowest at every learning rate",
        "lr 3e-4 ... 3e-2, float32, 6 layers",
        (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    ),
    Verdict(
        "pre",
        "post",
        "bf16",
        "kim-lr",
        "Post-LN stalled at the unigram loss at lr 1e-2 and 3e-2",
        "lr 3e-4 ... 3e-2, float32, 6 layers",
        (1e-2, 3e-2),
    ),
    Verdict(
        "pre-gate",
        "pre",
        "bf16",
        "gate-lr",
        "the gate lowered the loss at every lr; LR sensitivity 0.041 vs 0.125",
        "lr 3e-3 ... 3e-2, float32, 6 layers",
        (3e-3, 1e-2, 3e-2),
    ),
    Verdict(
        "hybrid",
        "pre",
        "bf16",
        "zhuo-placement",
        "HybridNorm 2.188 vs Pre-Norm 2.235 (2 seeds, the paper's inits)",
        "lr 3e-3 only, float32, 6 layers",
        (3e-3,),
    ),
    Verdict(
        "pre",
        "pre-dyt",
        "any",
        "dyt-lr",
        "DyT at every site stalled at the unigram loss at every lr and alpha0",
        "lr 3e-3 ... 3e-2, float32, 6 layers",
        (3e-3, 1e-2, 3e-2),
    ),
)


def cells(runs: pd.DataFrame) -> dict[str, dict[float, dict[str, Any]]]:
    """Per layout and learning rate, from a sweep table (`load_sweep`) folded over seeds by the sweep
    summary's own `cells`: finished runs, how many diverged or stalled, and the mean final loss of those
    that trained."""
    from normlab.experiments.summary import cells as grid_cells

    out: dict[str, dict[float, dict[str, Any]]] = {}
    for c in grid_cells(runs, ["layout", "lr", "seed"]).itertuples():
        finished = c.ok + c.stalled + c.diverged
        if finished:
            out.setdefault(c.layout, {})[float(c.lr)] = {
                "runs": finished,
                "failed": c.diverged + c.stalled,
                "loss": c.final_loss_mean,
            }
    return out


def _same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6)


def _ahead(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """`a` ahead of `b` at one learning rate, by the ranking's rule: a smaller share of failed runs, then
    (equal shares) a lower mean loss of the runs that trained (no loss: behind)."""
    fa, fb = a["failed"] / a["runs"], b["failed"] / b["runs"]
    if fa != fb:
        return bool(fa < fb)
    la, lb = (x if math.isfinite(x) else math.inf for x in (a["loss"], b["loss"]))
    return la < lb


def _cell_text(name: str, c: dict[str, Any]) -> str:
    failed = f", {c['failed']}/{c['runs']} failed" if c["failed"] else ""
    return f"{name} {c['loss']:.3f}{failed}" if math.isfinite(c["loss"]) else f"{name} {c['failed']}/{c['runs']} failed"


def at_setting(v: Verdict, by_lr: dict[str, dict[float, dict[str, Any]]]) -> tuple[bool | None, str]:
    """Whether the verdict holds here at the learning rates it was measured at and both placements ran
    (None: no such learning rate), with the comparison in words."""
    a, b = by_lr.get(v.better, {}), by_lr.get(v.worse, {})
    shared = sorted(lr for lr in a if any(_same_lr(lr, x) for x in v.lrs) and lr in b)
    if not shared:
        ran = "; ".join(
            f"{n} at lr {', '.join(f'{x:g}' for x in sorted(c)) or 'none'}" for n, c in ((v.better, a), (v.worse, b))
        )
        return None, f"not comparable: no run of both at the recipe's lr ({ran})"
    held = [_ahead(a[lr], b[lr]) for lr in shared]
    words = "; ".join(f"lr {lr:g}: {_cell_text(v.better, a[lr])} vs {_cell_text(v.worse, b[lr])}" for lr in shared)
    return all(held), words


def check(
    ranks: dict[str, int], precision: str, by_lr: dict[str, dict[float, dict[str, Any]]] | None = None
) -> list[dict[str, Any]]:
    """Each recipe verdict whose two placements both have a rank (layout label -> rank): whether the
    ranking agrees, and (given `by_lr`, from `cells`) whether the verdict holds at the recipe's setting."""
    out = []
    for v in VERDICTS:
        if v.precision not in ("any", precision) or v.better not in ranks or v.worse not in ranks:
            continue
        row = {
            "recipe": v.recipe,
            "claim": f"{v.better} ahead of {v.worse}",
            "evidence": v.evidence,
            "setting": v.setting,
            "ranks": f"{v.better} #{ranks[v.better]}, {v.worse} #{ranks[v.worse]}",
            "agrees": ranks[v.better] < ranks[v.worse],
        }
        if by_lr is not None:
            row["agrees_at_setting"], row["at_setting"] = at_setting(v, by_lr)
        out.append(row)
    return out


def summary(checks: list[dict[str, Any]]) -> str:
    """One line: how many verdicts the ranking agrees with, and how many hold where the settings overlap."""
    if not checks:
        return "No recipe verdict covers two of these candidates."
    agree = sum(c["agrees"] for c in checks)
    text = f"The ranking agrees with {agree} of {len(checks)} recipe verdict(s) it covers"
    overlap = [c for c in checks if c.get("agrees_at_setting") is not None]
    if any("agrees_at_setting" in c for c in checks):
        held = sum(c["agrees_at_setting"] for c in overlap)
        text += (
            f"; where the settings overlap (a learning rate the recipe measured, both placements run there) "
            f"{held} of {len(overlap)} hold"
            + (f", {len(checks) - len(overlap)} not comparable" if len(overlap) < len(checks) else "")
        )
    return text + "."
