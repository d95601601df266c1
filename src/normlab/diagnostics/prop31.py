"""Kim et al. 2025, Proposition 3.1 (App. C): the gradient of the last MLP weight W2.

The setting of Props. C.1-C.3: one ReLU MLP sublayer whose output o is read directly as logits of
a cross-entropy loss L(o) = CE(softmax(o), y):

    Pre-LN  (C.1):  x~ = N(x), a = MLP(x~), o = x + a          dL/dW2_ij = h_i (p^_j - y_j)  (grows with ||h||)
    Peri-LN (C.2):  x~ = N(x), a = MLP(x~), o = x + N(a)       |dL/dW2_ij| <= 4 gamma sqrt(D) ||h|| / ||a||
    Post-LN (C.3):  a = MLP(x), o = N(x + a)                   |dL/dW2_ij| <= 4 gamma sqrt(D) ||h|| / ||x + a||

with h = ReLU(x~ W1 + b1), RMSNorm, gamma the (positive) norm scale. `last_mlp_gradient` measures
it per token; `bound` evaluates the right-hand side.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    return gamma * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def last_mlp_gradient(x, w1, b1, w2, b2, gamma, y: int, layout: str) -> dict:  # noqa: ANN001 - tensors
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
