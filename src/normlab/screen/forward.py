"""Step 2: forward stability -- hidden-state growth over depth under a weight stress s.

Stress ``s`` emulates weight growth during training. Mode ``output`` multiplies each module's output
projection (attention W_O, MLP W_down) by s, so every module output is exactly s times larger
(the activation scale of Kan Props. 7-8); mode ``all`` multiplies every attention and MLP weight by
s (sharper attention, and s^2-homogeneous ReLU MLPs). Growth over depth is fit as flat, linear,
quadratic or exponential, and output-normalized layouts are checked against Theorem 4's linear bound:
    mean|X_l| <= mean|X_0| + sum over the sublayers before l of h * (max|gamma_B| + max|beta_B|),
since an update on N_B's ellipsoid has RMS(y - beta) <= max|gamma| (Lemma 1) per token; for the other
kinds of B the per-sublayer term is the kind's own bound (`_mean_abs_bound`: DyT's box, ScaleNorm's and
L2's spheres).
"""

from __future__ import annotations

import copy
import math
from typing import cast

import numpy as np
import torch
from torch import nn

from normlab.config.commands import STRESS_MODES
from normlab.model.lm import NormLM
from normlab.model.mlp import MLP
from normlab.model.moe import MoE
from normlab.model.norms import L2Norm, ScaleNorm, gain_of


def stressed(model: NormLM, s: float, mode: str) -> NormLM:
    """A copy of ``model`` with its module weights scaled by ``s``."""
    if mode not in STRESS_MODES:
        raise ValueError(f"unknown stress mode {mode!r}; valid: {', '.join(STRESS_MODES)}")
    m = copy.deepcopy(model)
    with torch.no_grad():
        for block in m.block_list():
            experts = getattr(block.mlp, "experts", None)  # a MoE sublayer: its stacked expert matrices
            if mode == "output":
                targets: list[nn.Linear]
                if experts is None:
                    targets, tensors = [block.attn.o_proj, cast(MLP, block.mlp).down_proj], []
                else:  # every expert's output projection, the shared expert's too
                    moe = cast(MoE, block.mlp)
                    shared = [moe.shared.down_proj] if moe.shared is not None else []
                    targets, tensors = [block.attn.o_proj, *shared], [experts.down_proj]
            else:
                targets = [mod for mod in (*block.attn.modules(), *block.mlp.modules()) if isinstance(mod, nn.Linear)]
                tensors = [] if experts is None else [experts.gate_proj, experts.up_proj, experts.down_proj]
            for lin in targets:
                lin.weight.mul_(s)
                if lin.bias is not None:
                    lin.bias.mul_(s)
            for w in tensors:
                w.mul_(s)
    return m


def with_h(model: NormLM, h: float) -> NormLM:
    m = copy.deepcopy(model)
    for block in m.block_list():
        block.h = float(h)
    return m


@torch.no_grad()
def profile(hidden: list[torch.Tensor]) -> dict[str, list[float]]:
    """mean |h|, entry-wise variance and RMS of each stream state (embedding, then every block)."""
    return {
        "mean_abs": [h.abs().mean().item() for h in hidden],
        "var": [h.var().item() for h in hidden],
        "rms": [h.pow(2).mean().sqrt().item() for h in hidden],
    }


def fit_growth(values: list[float]) -> dict:
    """Classify y_l over depth l = 0..L as flat, linear, quadratic or exponential.

    Least-squares fits of a + b l, a + b l + c l^2, and a r^l (on log y); the relative RMS error of
    each picks the shape: exponential only when its error is clearly lowest and r > 1.05 per layer,
    quadratic only when it halves the linear error and its curvature is upward (accelerating) and
    matters over the depth. Fewer than four values (a model of one to three layers) fit every curve
    exactly, so they are called flat or linear only.
    """
    y = np.asarray(values, dtype=np.float64)
    depth = np.arange(len(y), dtype=np.float64)
    scale = max(float(np.abs(y).mean()), 1e-30)
    if (y.max() - y.min()) / scale < 0.1:
        return {"shape": "flat", "spread": float((y.max() - y.min()) / scale)}
    if len(y) < 4:
        return {"shape": "linear", "linear_slope": float(np.polyfit(depth, y, 1)[0]) if len(y) > 1 else 0.0}

    def err(pred: np.ndarray) -> float:
        return float(np.sqrt(np.mean((pred - y) ** 2)) / scale)

    lin = np.polyfit(depth, y, 1)
    quad = np.polyfit(depth, y, 2)
    e_lin, e_quad = err(np.polyval(lin, depth)), err(np.polyval(quad, depth))
    out = {"linear_slope": float(lin[0]), "err_linear": e_lin, "err_quadratic": e_quad}
    if np.all(y > 0):
        ex = np.polyfit(depth, np.log(y), 1)
        ratio = float(math.exp(ex[0]))
        e_exp = err(np.exp(np.polyval(ex, depth)))
        out.update(ratio_per_layer=ratio, err_exponential=e_exp)
        if ratio > 1.05 and e_exp < 0.7 * min(e_lin, e_quad):
            return {"shape": "exponential", **out}
    curvature = quad[0] * (len(y) - 1) ** 2
    # quadratic growth accelerates: a fit that bends down (Peri-LN's variance, 1, 3.0, 5.1, ..., 12.5,
    # a little under its line) is linear growth, not quadratic
    if e_quad < 0.5 * e_lin and curvature > 0.1 * (y.max() - y.min()):
        return {"shape": "quadratic", **out}
    return {"shape": "linear", **out}


def output_norm_bound(model: NormLM, mean_abs_x0: float) -> list[float]:
    """Theorem 4's bound on mean|X_l| for l = 0..L, from each output norm's bound on mean|u_i| (times h):
    max|gamma| + max|beta| for RMSNorm, LayerNorm and DyT (an RMS-1 vector has mean |entry| <= 1; DyT's
    entries are at most |gamma_i| + |beta_i|), |g| / sqrt(d) for ScaleNorm and 1 / sqrt(d) for L2 (norm |g|
    or 1 spread over d entries); a learned h counts with its current largest value."""
    bound, out = mean_abs_x0, [mean_abs_x0]
    for block in model.block_list():
        for norm, h in ((block.attn_norms.output, block.attn_h), (block.mlp_norms.output, block.mlp_h)):
            step = h.abs().max().item() if h is not None else block.h
            bound += step * _mean_abs_bound(norm, model.config.d_model)
        out.append(bound)
    return out


def _mean_abs_bound(norm: nn.Module, d: int) -> float:
    """The largest mean |entry| the norm's output over ``d`` channels can have, whatever its input."""
    if isinstance(norm, (ScaleNorm, L2Norm)):
        g = norm.weight.abs().item() if isinstance(norm, ScaleNorm) else 1.0
        return g / math.sqrt(d)
    gain, beta = gain_of(norm), getattr(norm, "bias", None)
    # SeeDNorm: its gain gamma + alpha tanh(x . beta) is at most max|gamma| + max|alpha| on an RMS-1 vector
    dyn = getattr(norm, "dyn_gain", None)
    return (
        (gain.abs().max().item() if gain is not None else 1.0)
        + (beta.abs().max().item() if beta is not None else 0.0)
        + (dyn.abs().max().item() if dyn is not None else 0.0)
    )
