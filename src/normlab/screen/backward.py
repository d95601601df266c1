"""Step 3: backward stability -- each block's local sensitivity ||dX_{l+1}/dX_l||_2.

The spectral norm of the block's Jacobian at its actual input, by power iteration on J^T J with
forward- and reverse-mode autograd (`torch.func.jvp`, `torch.func.vjp`); attention runs on SDPA's
math kernel here because forward-mode AD needs composite ops. Kan Prop. 7: under Pre-LN,
J = I + dF/dX grows with the activation scale; Prop. 8: under Peri-LN the output norm's Jacobian
scales as 1/s and cancels the module's s, so the sensitivity is invariant.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from normlab.model.lm import NormLM


def block_sensitivity(block: nn.Module, x: torch.Tensor, iters: int = 20, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(x.shape, generator=g, dtype=x.dtype)
    v = v / v.norm()
    sigma = 0.0
    with sdpa_kernel(SDPBackend.MATH):
        vjp_fn = torch.func.vjp(block, x)[1]
        for _ in range(iters):
            jv = torch.func.jvp(block, (x,), (v,))[1]
            sigma = jv.norm().item()
            (u,) = vjp_fn(jv)
            norm = u.norm()
            if norm == 0:
                return 0.0
            v = u / norm
    return sigma


@torch.no_grad()
def _inputs(model: NormLM, x0: torch.Tensor) -> list[torch.Tensor]:
    _, hidden = model.run_blocks(x0, return_hidden_states=True)
    assert hidden is not None  # asked for
    return hidden[:-1]


def sensitivities(model: NormLM, x0: torch.Tensor, iters: int = 20) -> list[float]:
    """||J_l||_2 for every block l, each at the input it sees in the forward pass from x0."""
    return [block_sensitivity(b, x, iters) for b, x in zip(model.block_list(), _inputs(model, x0))]
