"""Kim et al. 2025, Proposition 3.1 (App. C): the gradient of the last MLP weight W2.

The setting of Props. C.1-C.3: one ReLU MLP sublayer whose output o is read directly as logits of
a cross-entropy loss L(o) = CE(softmax(o), y):

    Pre-LN  (C.1):  x~ = N(x), a = MLP(x~), o = x + a          dL/dW2_ij = h_i (p^_j - y_j)  (grows with ||h||)
    Peri-LN (C.2):  x~ = N(x), a = MLP(x~), o = x + N(a)       |dL/dW2_ij| <= 4 gamma sqrt(D) ||h|| / ||a||
    Post-LN (C.3):  a = MLP(x), o = N(x + a)                   |dL/dW2_ij| <= 4 gamma sqrt(D) ||h|| / ||x + a||

with h = ReLU(x~ W1 + b1), RMSNorm, gamma the (positive) norm scale. `last_mlp_gradient` measures
it per token; `bound` evaluates the right-hand side.

The proposition is per token: one token's loss, one token's h. `per_token` records it that way
inside a trained model. The last block's MLP output at position t reaches only the logits at t (no
attention follows it), so with the batch loss L = (1/n) sum_t l_t, dl_t/da_t = n dL/da_t exactly and
the token's own gradient is the outer product dl_t/dW2 = (n dL/da_t) h_t^T: its largest entry is
max|h_t| max|n dL/da_t| and its norm ||h_t|| ||n dL/da_t||. One backward gives every token's. A
batch gradient (the sum over tokens) mixes tokens of different ||h|| and signs, and cannot show the
regime the proposition is about: under Pre-LN ||dl_t/dW2|| = ||h_t|| ||p_t - y_t|| grows with ||h_t||
(slope 1 of log ||dl_t/dW2|| on log ||h_t|| across tokens), under an output norm it is bounded by
||h_t|| / ||a_t|| (scale-free: slope near 0).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from normlab.runs.metrics import ProbeMetric


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    return gamma * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def last_mlp_gradient(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    gamma: torch.Tensor,
    y: int,
    layout: str,
) -> dict[str, Any]:
    """For one token x (D,), weights W1 (D, H), W2 (H, D): the gradient dL/dW2 and the quantities
    of the proposition. ``layout`` is "pre", "peri" or "post"."""
    w2 = w2.detach().clone().requires_grad_(True)
    xt = rms_norm(x, gamma) if layout in ("pre", "peri") else x
    h = F.relu(xt @ w1 + b1)
    a = h @ w2 + b2
    if layout == "pre":
        o = x + a
    elif layout == "peri":
        o = x + rms_norm(a, gamma)
    elif layout == "post":
        o = rms_norm(x + a, gamma)
    else:
        raise ValueError(f"layout must be pre, peri or post, got {layout!r}")
    loss = F.cross_entropy(o[None], torch.tensor([y]))
    (grad,) = torch.autograd.grad(loss, w2)
    return {"grad": grad, "h": h.detach(), "a": a.detach(), "x_plus_a": (x + a).detach()}


def bound(gamma_max: float, d: int, h_norm: float, denom_norm: float) -> float:
    """4 gamma sqrt(D) ||h|| / ||a|| (Peri-LN) or / ||x + a|| (Post-LN)."""
    return 4.0 * gamma_max * math.sqrt(d) * h_norm / denom_norm


def _slope_corr(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Least-squares slope of y on x and Pearson's r (nan with fewer than 3 points or no spread)."""
    if x.numel() < 3:
        return math.nan, math.nan
    xc, yc = x - x.mean(), y - y.mean()
    sxx, syy = (xc * xc).sum(), (yc * yc).sum()
    if sxx <= 0:
        return math.nan, math.nan
    slope = ((xc * yc).sum() / sxx).item()
    corr = ((xc * yc).sum() / (sxx * syy).sqrt()).item() if syy > 0 else math.nan
    return slope, corr


@torch.no_grad()
def per_token(
    h: torch.Tensor, a: torch.Tensor, a_grad: torch.Tensor, valid: torch.Tensor, gamma_max: float | None = None
) -> dict[str, float]:
    """Prop. 3.1 per token for the last MLP of a model (see the module docstring).

    h: (..., H) the input of the last down projection; a: (..., D) its output (before any output
    norm); a_grad: dL/da for the batch-mean loss; valid: (...) bool, the tokens counted in the loss;
    gamma_max: the output norm's largest |gamma| if the MLP is output-normalized (then the bound is
    recorded), else None. Returns, over the valid tokens: ``tok_grad_max`` (the largest entry of any
    token's dl_t/dW2) and ``tok_grad_mean`` (its mean over tokens), ``tok_h_norm``, ``tok_a_norm``
    (means), ``grad_h_slope`` and ``grad_h_corr`` (log ||dl_t/dW2|| on log ||h_t||), and with an output
    norm ``tok_bound`` (mean of 4 gamma sqrt(D) ||h_t|| / ||a_t||) and ``tok_within_bound`` (the fraction
    of tokens whose largest entry is within their own bound).
    """
    h, a = h.detach().double()[valid], a.detach().double()[valid]
    g = a_grad.detach().double()[valid] * int(valid.sum())  # dl_t/da_t
    entry_max = h.abs().amax(-1) * g.abs().amax(-1)
    h_norm, a_norm = h.norm(dim=-1), a.norm(dim=-1)
    g_norm = h_norm * g.norm(dim=-1)
    keep = (h_norm > 0) & (g_norm > 0)
    slope, corr = _slope_corr(h_norm[keep].log(), g_norm[keep].log())
    out: dict[str, float] = {
        ProbeMetric.TOK_GRAD_MAX: entry_max.max().item() if entry_max.numel() else math.nan,
        ProbeMetric.TOK_GRAD_MEAN: entry_max.mean().item() if entry_max.numel() else math.nan,
        ProbeMetric.TOK_H_NORM: h_norm.mean().item() if h_norm.numel() else math.nan,
        ProbeMetric.TOK_A_NORM: a_norm.mean().item() if a_norm.numel() else math.nan,
        ProbeMetric.GRAD_H_SLOPE: slope,
        ProbeMetric.GRAD_H_CORR: corr,
    }
    if gamma_max is not None and entry_max.numel():
        tok_bound = 4.0 * gamma_max * math.sqrt(a.shape[-1]) * h_norm / a_norm.clamp_min(1e-30)
        out[ProbeMetric.TOK_BOUND] = tok_bound.mean().item()
        out[ProbeMetric.TOK_WITHIN_BOUND] = (entry_max <= tok_bound).double().mean().item()
    return out
