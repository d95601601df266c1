"""The QK spectral entropy: how many directions each attention head's query-key form spreads over, and over
how many the step's change to it spreads (issue 66; the precursor of Huang et al. 2026, arXiv 2606.28116).

Head h of a layer scores a query position x against a key position y by the bilinear form

    s_h(x, y) = x^T B_h y,   B_h = (W_q^h)^T W_k^h                                            (Q1)

(W_q^h, W_k^h: the head's d_head rows of the query and key projections, d_head x d_model; the rotary
rotation, the QK-norm and the 1/sqrt(d_head) scale left out: the form the weights carry). An optimizer step
changes it by

    B_h + dB_h = (W_q^h + dW_q^h)^T (W_k^h + dW_k^h)
               = B_h + [(dW_q^h)^T W_k^h + (W_q^h)^T dW_k^h] + (dW_q^h)^T dW_k^h              (Q2)

whose bracket is the first-order term T_h. Huang et al. monitor "the spectral entropy of a QK bilinear
decomposition, whose first-order term becomes abnormal before the loss fully collapses" (their abstract);
their paper's body, with its equation numbers, could not be retrieved here, so the entropy below is the
standard one, Roy & Vetterli 2007 ("The effective rank", EUSIPCO 2007, Sec. 2, Definition 1): of a
matrix's singular values sigma_1..sigma_r,

    p_i = sigma_i / sum_j sigma_j,    H = -sum_i p_i log p_i  (0 log 0 = 0)                   (Q3)

reported normalized, H / log r (r: the matrix's rank bound, d_head for B_h, 2 d_head for T_h, at most
d_model), in [0, 1]: 1 where every direction carries the same weight, 0 where one direction carries all.
A head whose form, or whose update, collapses onto a few directions (the low-rank attention of Qiu & Yao
2025, arXiv 2510.04212, that precedes low-precision attention's loss explosion) drops toward 0.

Cost: B_h's singular values are those of R_q R_k^T, where (W_q^h)^T = Q_q R_q and (W_k^h)^T = Q_k R_k are
thin QR factorizations (the orthonormal Q's drop out), so each head costs two QR's of a d_model x d_head
matrix and one d_head x d_head SVD; T_h is the same with [dW_q; W_q] and [W_k; dW_k] (2 d_head rows). At
gpu-126m (12 layers x 12 heads, d_model 768, d_head 64) that is 288 small batched factorizations per probe,
no forward pass and no data; the probe's one host read (its row) is its only synchronization, every
``every`` steps. `QKSpectrumHook` keeps the query and key weights before each probed step (2 d_model^2
floats per layer) and writes one row per probed step to qk_spectrum.jsonl:
``{"step": s, "qk_entropy": [[per head] per layer], "qk_update_entropy": [[per head] per layer]}``.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any

import torch
from torch import nn

from normlab.diagnostics.hooks import StepHook
from normlab.runs.metrics import Metric


def normalized_entropy(sigma: torch.Tensor, rank: int) -> torch.Tensor:
    """(Q3) over the last dimension: -sum p log p / log(rank), p = sigma / sum(sigma); 0 where the
    singular values are all zero or rank is 1 (one direction: no spread)."""
    s = sigma.clamp_min(0)
    total = s.sum(dim=-1, keepdim=True)
    p = s / total.clamp_min(torch.finfo(s.dtype).tiny)
    h = -(p * torch.log(p.clamp_min(torch.finfo(s.dtype).tiny))).sum(dim=-1)
    if rank <= 1:
        return torch.zeros_like(h)
    return torch.where(total.squeeze(-1) > 0, h / math.log(rank), torch.zeros_like(h))


def bilinear_singular_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The singular values of a^T b for a, b (..., k, d) (k rows each, batched over heads), through thin QR
    factorizations of a^T and b^T (module docstring): those of R_a R_b^T, min(k, d) of them."""
    ra = torch.linalg.qr(a.transpose(-2, -1), mode="r").R  # (..., min(k, d), k)
    rb = torch.linalg.qr(b.transpose(-2, -1), mode="r").R
    out: torch.Tensor = torch.linalg.svdvals(ra @ rb.transpose(-2, -1))
    return out


def head_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A projection's weight (heads * d_head, d_model) as (heads, d_head, d_model)."""
    return w.reshape(heads, -1, w.shape[-1])


def form_entropy(wq: torch.Tensor, wk: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """(heads,): each head's normalized spectral entropy of B_h (Q1, Q3); a key head shared by a group of
    query heads (grouped-query attention) pairs with each of them."""
    q = head_rows(wq.double(), heads)
    k = head_rows(wk.double(), kv_heads).repeat_interleave(heads // kv_heads, dim=0)
    return normalized_entropy(bilinear_singular_values(q, k), min(q.shape[-2], q.shape[-1]))


def update_entropy(
    wq: torch.Tensor, wk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, heads: int, kv_heads: int
) -> torch.Tensor:
    """(heads,): each head's normalized spectral entropy of the first-order term T_h of (Q2), for the weights
    before the step (wq, wk) and the step's change (dq, dk): T_h = [dW_q; W_q]^T [W_k; dW_k]."""
    rep = heads // kv_heads
    q = head_rows(wq.double(), heads)
    k = head_rows(wk.double(), kv_heads).repeat_interleave(rep, dim=0)
    dqh = head_rows(dq.double(), heads)
    dkh = head_rows(dk.double(), kv_heads).repeat_interleave(rep, dim=0)
    a, b = torch.cat([dqh, q], dim=-2), torch.cat([k, dkh], dim=-2)
    return normalized_entropy(bilinear_singular_values(a, b), min(a.shape[-2], a.shape[-1]))


Heads = tuple[nn.Linear, nn.Linear, int, int]  # an attention layer's q_proj, k_proj, n_heads, n_kv_heads


def attention_layers(model: nn.Module) -> list[Heads]:
    """The model's attention modules with per-head query and key projections (``q_proj``, ``k_proj``,
    ``n_heads``, ``n_kv_heads``), in the order the model holds them; others (no such projections) are
    left out."""
    return [
        (m.q_proj, m.k_proj, m.n_heads, m.n_kv_heads)  # type: ignore[misc]  # checked below
        for m in model.modules()
        if isinstance(getattr(m, "q_proj", None), nn.Linear)
        and isinstance(getattr(m, "k_proj", None), nn.Linear)
        and isinstance(getattr(m, "n_heads", None), int)
        and isinstance(getattr(m, "n_kv_heads", None), int)
    ]


class QKSpectrum:
    """The QK spectral entropy of a model's attention layers: `keep` the query and key weights before a step,
    `read` after it: the form's entropy (Q1) per head per layer and, where kept, the step's first-order
    term's (Q2), both normalized (Q3)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = attention_layers(model)
        self.before: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def keep(self) -> None:
        self.before = [(q.weight.detach().clone(), k.weight.detach().clone()) for q, k, _, _ in self.layers]

    def read(self) -> dict[str, Any]:
        form, update = [], []
        with torch.no_grad():
            for i, (q, k, heads, kv) in enumerate(self.layers):
                wq, wk = q.weight.detach(), k.weight.detach()
                form.append(form_entropy(wq, wk, heads, kv))
                if self.before is not None:
                    q0, k0 = self.before[i]
                    update.append(update_entropy(q0, k0, wq - q0, wk - k0, heads, kv))
        self.before = None
        row: dict[str, Any] = {"qk_entropy": [_rounded(t) for t in form]}  # one host read per tensor, per probe
        if update:
            row["qk_update_entropy"] = [_rounded(t) for t in update]
        return row


def _rounded(t: torch.Tensor) -> list[float | None]:
    return [round(v, 6) if math.isfinite(v) else None for v in t.float().tolist()]


class QKSpectrumHook(StepHook):
    """The QK spectral entropy every ``every`` steps (`QKSpectrum`): the weights kept before the step, the row
    after it (to ``log``, qk_spectrum.jsonl, on the main rank), kept as ``last`` for the early warnings. Its
    post_step runs after the tier's and before the early warnings' (priority between theirs)."""

    priority = 22

    def __init__(self, spectrum: QKSpectrum, log: IO[str] | None, every: int) -> None:
        self.spectrum, self.log, self.every = spectrum, log, every
        self.last: dict[str, Any] = {}

    def pre_step(self, step: int) -> None:
        if step % self.every == 0 and self.spectrum.layers:
            self.spectrum.keep()

    def post_step(self, step: int, applied: bool) -> None:
        if step % self.every != 0 or not self.spectrum.layers:
            return
        row = self.spectrum.read()
        if not applied:  # a skipped step changed nothing: no first-order term to speak of
            row.pop("qk_update_entropy", None)
        self.last = {Metric.STEP: step, **row}
        if self.log is not None:
            self.log.write(json.dumps(self.last) + "\n")

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


__all__ = [
    "QKSpectrum",
    "QKSpectrumHook",
    "attention_layers",
    "bilinear_singular_values",
    "form_entropy",
    "normalized_entropy",
    "update_entropy",
]
