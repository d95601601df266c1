"""The recipes' verdicts that a ranking can be checked against (docs/results.md, measured on the 2-core
VM in the recipes' own runs): pairs where one placement came out ahead of another, under the
precision the recipe stressed. `check` reads a ranking against every pair whose two candidates it
ranked, and says where it agrees and where not; a disagreement is reported, never hidden, beside the
recipe's own setting (its learning rates above all: a placement that wins at lr 3e-3 may stall at the
stress round's 0.1, and then never reaches the final round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    better: str
    worse: str
    precision: str  # fp16: under fp16 storage at the stress lr; bf16: over a learning-rate grid in float/bf16; any
    recipe: str
    evidence: str
    setting: str  # the recipe's learning rates and storage: a ranking made elsewhere may differ for that reason


VERDICTS: tuple[Verdict, ...] = (
    Verdict("peri", "pre", "fp16", "stress-kim-fp16", "Pre-LN diverged on 4/5 seeds (MLP residual add, blocks 10-11), "
            "Peri-LN 0/5 with its largest activation at 106", "lr 0.1, fp16 storage, 12 layers"),
    Verdict("peri", "post", "fp16", "stress-kim-fp16", "Post-LN stalled at the unigram loss on 3/5 seeds, Peri-LN 0/5",
            "lr 0.1, fp16 storage, 12 layers"),
    Verdict("peri", "hybrid", "fp16", "stress-kim-fp16", "HybridNorm stalled on 3/5 seeds (largest activation 31,024), "
            "Peri-LN 0/5", "lr 0.1, fp16 storage, 12 layers"),
    Verdict("peri", "pre", "bf16", "kim-lr", "Peri-LN's loss was lowest at every learning rate",
            "lr 3e-4 ... 3e-2, float32, 6 layers"),
    Verdict("pre", "post", "bf16", "kim-lr", "Post-LN stalled at the unigram loss at lr 1e-2 and 3e-2",
            "lr 3e-4 ... 3e-2, float32, 6 layers"),
    Verdict("pre-gate", "pre", "bf16", "gate-lr", "the gate lowered the loss at every lr; LR sensitivity 0.041 vs 0.125",
            "lr 3e-3 ... 3e-2, float32, 6 layers"),
    Verdict("hybrid", "pre", "bf16", "zhuo-placement", "HybridNorm 2.188 vs Pre-Norm 2.235 (2 seeds, the paper's inits)",
            "lr 3e-3 only, float32, 6 layers"),
    Verdict("pre", "pre-dyt", "any", "dyt-lr", "DyT at every site stalled at the unigram loss at every lr and alpha0",
            "lr 3e-3 ... 3e-2, float32, 6 layers"),
)


def check(ranks: dict[str, int], precision: str) -> list[dict[str, Any]]:
    """Each recipe verdict whose two placements both have a rank (layout label -> rank): agree or not."""
    out = []
    for v in VERDICTS:
        if v.precision not in ("any", precision) or v.better not in ranks or v.worse not in ranks:
            continue
        out.append({"recipe": v.recipe, "claim": f"{v.better} ahead of {v.worse}", "evidence": v.evidence,
                    "setting": v.setting,
                    "ranks": f"{v.better} #{ranks[v.better]}, {v.worse} #{ranks[v.worse]}",
                    "agrees": ranks[v.better] < ranks[v.worse]})
    return out
