"""Step 4: uncertainty -- how far apart the terminal hidden states of two input distributions end up.

Kan Theorem 6: for Peri-LN, W_p(outputs) <= C * W_p(inputs) + const; Pre-LN has no such bound. We
compare the stream entering block 0 for clean inputs with the same inputs plus Gaussian noise, and
the two terminal streams (before the final norm), as empirical distributions of token vectors.
The 2-Wasserstein distance between two equal-size point clouds with uniform weights is an optimal
assignment problem; scipy's `linear_sum_assignment` solves it exactly.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist

from normlab.model.lm import NormLM


def wasserstein2(a: np.ndarray, b: np.ndarray) -> float:
    """W_2 between the empirical distributions of the rows of ``a`` and ``b`` (same count, uniform)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim == 1:
        a, b = a[:, None], b[:, None]
    if a.shape != b.shape:
        raise ValueError(f"point clouds must have the same shape, got {a.shape} and {b.shape}")
    cost = cdist(a, b, metric="sqeuclidean")
    rows, cols = linear_sum_assignment(cost)
    return math.sqrt(cost[rows, cols].mean())


@torch.no_grad()
def amplification(model: NormLM, x0: torch.Tensor, noise: float, seed: int = 0) -> dict[str, float]:
    """W_2 of the inputs (x0 vs x0 + noise * RMS(x0) * N(0, 1)) and of the terminal states."""
    g = torch.Generator().manual_seed(seed + 1)
    x1 = x0 + noise * x0.pow(2).mean().sqrt() * torch.randn(x0.shape, generator=g, dtype=x0.dtype)
    out0, _ = model.run_blocks(x0)
    out1, _ = model.run_blocks(x1)
    d = x0.shape[-1]
    w_in = wasserstein2(x0.reshape(-1, d).numpy(), x1.reshape(-1, d).numpy())
    w_out = wasserstein2(out0.reshape(-1, d).numpy(), out1.reshape(-1, d).numpy())
    return {"w_in": w_in, "w_out": w_out, "ratio": w_out / w_in if w_in > 0 else math.inf}
