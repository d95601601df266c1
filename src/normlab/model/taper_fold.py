"""TaperNorm's fold-away (Kanavalau et al. 2026, arXiv 2602.10408): once the taper has ended (gate 0) an input
norm is the fixed map x -> c gamma~ * x, and every linear that reads it absorbs it exactly:

    W (c gamma~ * x) + b = (W diag(c gamma~)) x + b

`fold_tapered` does that for each tapered input norm (site A of attention or the MLP) of a dense model: it scales
the columns of the projections that read the normed input (attention's q, k, v and gate projections; the MLP's gate
and up projections) and puts `nn.Identity` at the site, so the folded model computes no per-token statistic there.
Where the folding would not be exact it refuses, saying why (`TaperFoldError`):

- a gate above 0: the map still divides by RMS(x), which no linear absorbs;
- a tapered output (B), after-add (C), hidden (H), inner (q k v c), embedding or final norm: what reads its output is
  the residual add, a softmax, another norm or the head, not only linears that read it alone (the final norm, kept
  as RMSNorm by `pre-taper`, anchors the logits' scale; the paper keeps it);
- a normed skip (HybridNorm's S): the residual reads the normed input too;
- a mixture of experts: its router and stacked experts are not folded here.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from normlab.model.norms import TaperNorm

# what reads each sublayer's normed input, by module path inside the sublayer's f
_READERS = {"attn": ("q_proj", "k_proj", "v_proj", "gate_proj"), "mlp": ("gate_proj", "up_proj")}


class TaperFoldError(ValueError):
    """A TaperNorm the fold cannot remove exactly (the message says which and why)."""


def _block(model: nn.Module, index: str) -> Any:
    """Block ``index`` of ``model`` (a NormLM's ``blocks``)."""
    return cast(nn.ModuleList, model.blocks)[int(index)]


def _tapers(model: nn.Module) -> list[tuple[str, TaperNorm]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TaperNorm)]


def fold_problems(model: nn.Module) -> list[str]:
    """Why ``model``'s TaperNorms cannot all be folded (empty: they can)."""
    out = []
    for name, norm in _tapers(model):
        parts = name.split(".")
        if float(norm.gate) != 0.0:
            out.append(f"{name}: its gate is {float(norm.gate):.4g}, not 0: it still divides by RMS(x)")
        elif not (len(parts) == 4 and parts[0] == "blocks" and parts[3] == "input"):
            out.append(f"{name}: not an input norm (A); what reads it is not only linears reading it alone")
        else:
            block = _block(model, parts[1])
            sub = parts[2].removesuffix("_norms")
            if getattr(block, parts[2]).skip_normed:
                out.append(f"{name}: the skip reads the normed input (S) too")
            elif sub == "mlp" and not hasattr(block.mlp, "up_proj"):
                out.append(f"{name}: a mixture of experts (its router and stacked experts are not folded)")
    return out


@torch.no_grad()
def fold_tapered(model: nn.Module) -> int:
    """Fold every tapered input TaperNorm of ``model`` into the projections that read it, in place; the number
    folded. Raises `TaperFoldError` (nothing changed) where any cannot be folded exactly (`fold_problems`)."""
    problems = fold_problems(model)
    if problems:
        raise TaperFoldError("cannot fold TaperNorm exactly: " + "; ".join(problems))
    folded = 0
    for name, norm in _tapers(model):
        _, index, site, _ = name.split(".")
        block = _block(model, index)
        sub = site.removesuffix("_norms")
        scale = (norm.coeff * norm.taper_weight).detach()
        for reader in _READERS[sub]:
            lin = getattr(getattr(block, sub), reader, None)
            if isinstance(lin, nn.Linear):
                lin.weight.mul_(scale.to(lin.weight.dtype))
        getattr(block, site).input = nn.Identity()
        folded += 1
    return folded
