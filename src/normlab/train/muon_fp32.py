"""Muon's orthogonalization in float32: ``optim.muon_ns_dtype = "fp32"``.

torch.optim.Muon orthogonalizes each matrix's momentum with Jordan et al.'s quintic Newton-Schulz iteration
(Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"), always in bfloat16::

    X_0 = G / max(||G||_F, eps)   (transposed first when G has more rows than columns)
    X_{k+1} = a X_k + (b A_k + c A_k^2) X_k,   A_k = X_k X_k^T,   (a, b, c) = (3.4445, -4.7750, 2.0315)

On a GPU the bf16 products run on the tensor cores. A CPU without bf16 instructions emulates them: a 256 x 1024
matrix's iteration measured 33x slower in bf16 than in float32 on the 2-core AMD EPYC VM (130 ms against 4 ms per
pair of products), which made a Muon step at d 256 take 21 s where AdamW's took 1.7 s. ``fp32`` runs the same
iteration in float32: each singular value s of X_0 becomes p^k(s), p(s) = a s + b s^3 + c s^5, as in bf16, only
without bf16's rounding (a relative 2^-8 per product). torch exposes no dtype option, so the step swaps torch's
function (``torch.optim._muon._zeropower_via_newtonschulz``) for this one for its duration and restores it; the
default stays torch's bf16 (``bf16``), the numbers every earlier Muon run recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.optim._muon as torch_muon

from normlab.errors import ConfigError

_TORCH_NAME = "_zeropower_via_newtonschulz"


def orthogonalize_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of the module docstring in float32, with torch's signature; returns a
    float32 tensor of ``grad``'s shape (torch's returns bf16; the parameter update casts either)."""
    a, b, c = ns_coefficients
    x = grad.float()
    wide = x.size(0) > x.size(1)
    if wide:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


@contextmanager
def newton_schulz_in_float32() -> Iterator[None]:
    """For the duration: torch.optim.Muon orthogonalizes in float32 (`orthogonalize_fp32`)."""
    original = getattr(torch_muon, _TORCH_NAME, None)
    if original is None:
        raise ConfigError(
            f"optim.muon_ns_dtype: fp32 needs torch.optim._muon.{_TORCH_NAME}, which torch {torch.__version__} "
            "does not have; valid: bf16 (torch's own)"
        )
    setattr(torch_muon, _TORCH_NAME, orthogonalize_fp32)
    try:
        yield
    finally:
        setattr(torch_muon, _TORCH_NAME, original)
