"""Attention Residuals: the residual sum replaced by softmax attention over depth (Kimi Team 2026, arXiv 2603.15031).

A layout with ``attn_res`` replaces the unit-weight sum of Pre-LN, h_l = h_1 + sum_{i<l} f_i(h_i), by a learned,
input-dependent mix of the earlier outputs (Sec. 3.1; a "layer" l is one sublayer, attention or MLP: "we treat
each self-attention or MLP as an individual layer")::

    h_l = sum_{i=0}^{l-1} alpha_{i->l} v_i                                           (eqs. 1, 4)
    alpha_{i->l} = phi(q_l, k_i) / sum_j phi(q_l, k_j),  phi(q, k) = exp(q^T RMSNorm(k))      (eq. 2)
    q_l = w_l (a learned vector per sublayer, from 0),  k_i = v_i,  v_0 = h_1, v_i = f_i(h_i)  (eq. 3)

f_l(h_l) = h * N_B(F(N_A(h_l))) is the sublayer's update (its norm sites as in any layout). Block AttnRes (Sec. 3.2)
sums the outputs of each block of S sublayers, b_n = sum_{j in B_n} f_j(h_j) (eq. 5), with b_0 = h_1 the embedding;
the i-th sublayer of block n attends over [b_0, .., b_{n-1}] when i = 1 and over [b_0, .., b_{n-1}, b_n^{i-1}] after
(eq. 6), b_n^{i-1} its block's partial sum so far. Full AttnRes is S = 1 (every output its own source). "The final
output layer aggregates all N block representations": one more pseudo-query and key norm read every source before
the final norm (Fig. 2's code applies block_attn_res to the blocks and the last partial sum before ``self.norm``).
The pseudo-queries start at 0, so every read starts as the uniform average of its sources (Sec. 5: "all
pseudo-query vectors must be initialized to zero"); each key norm is an RMSNorm with its own gain (Sec. 5: "one
RMSNorm and one pseudo-query vector per layer").

The state carried from block to block is the sources side by side, (B, T, K * d) with K = 1 + ceil(2L / S) slots:
slot 0 the embedding, slot n block n's (partial) sum, zero until its block starts; every reader of "the stream"
(probes, screen, per-step tier, forensics, ``hidden_states``) sees all of them, as with hyper-connections
(normlab.model.streams). A sublayer reads a softmax over its first m slots (`DepthAttention`) and adds its update
to its block's slot (`add_to_slot`). Each read keeps its last weights, detached, (B, T, m), for the probes.
"""

from __future__ import annotations

import torch
from torch import nn

from normlab.model.norms import RMSNorm


def block_of(sublayer: int, size: int) -> tuple[int, int]:
    """Sublayer ``sublayer`` (0-based over the 2L sublayers: 2 l attention, 2 l + 1 MLP)'s block n (from 1) and its
    position i in that block (from 1), for blocks of ``size`` sublayers."""
    return sublayer // size + 1, sublayer % size + 1


def n_sources(sublayer: int, size: int) -> int:
    """How many slots the sublayer reads (eq. 6): b_0 .. b_{n-1}, and b_n^{i-1} unless it opens block n."""
    n, i = block_of(sublayer, size)
    return n if i == 1 else n + 1


def n_slots(n_layers: int, size: int) -> int:
    """The slots the state holds: the embedding and ceil(2L / S) blocks."""
    return 1 + -(-2 * n_layers // size)


def add_to_slot(state: torch.Tensor, update: torch.Tensor, slot: int) -> torch.Tensor:
    """The state with ``update`` (B, T, d) added to slot ``slot``: b_n^i = b_n^{i-1} + f(h) (eq. 5's sum)."""
    d = update.shape[-1]
    lo, hi = slot * d, (slot + 1) * d
    return torch.cat([state[..., :lo], state[..., lo:hi] + update, state[..., hi:]], dim=-1)


def first_state(x: torch.Tensor, slots: int) -> torch.Tensor:
    """The state entering block 0: b_0 = the embedding (after its scale and norm), every other slot zero."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], (slots - 1) * x.shape[-1])], dim=-1)


class DepthAttention(nn.Module):
    """One read of Attention Residuals: h = sum_i softmax_i(w . RMSNorm(v_i)) v_i over the first ``sources`` slots
    of the state (eqs. 2-4); ``slot``: the block its sublayer's update is added to (None for the final read)."""

    def __init__(self, d: int, eps: float, sources: int, slot: int | None = None, compute: str = "input") -> None:
        super().__init__()
        self.d, self.sources, self.slot = d, sources, slot
        self.query = nn.Parameter(torch.zeros(d))  # w_l, the pseudo-query
        self.key_norm = RMSNorm(d, eps, compute)  # type: ignore[arg-type]
        self.last_weights: torch.Tensor | None = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.query.zero_()
        self.key_norm.reset_parameters()

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        v = state[..., : self.sources * self.d].unflatten(-1, (self.sources, self.d))  # (B, T, m, d)
        logits = self.key_norm(v) @ self.query.to(v.dtype)  # (B, T, m): w . RMSNorm(v_i)
        weights = torch.softmax(logits.float(), dim=-1).to(v.dtype)
        self.last_weights = weights.detach()
        return (weights.unsqueeze(-2) @ v).squeeze(-2)

    def extra_repr(self) -> str:
        return f"d={self.d}, sources={self.sources}, slot={self.slot}"
