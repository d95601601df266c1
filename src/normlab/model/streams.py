"""Hyper-connections: the residual stream widened to n parallel streams, mixed by learned connections.

A layout with ``streams=n`` (n > 1) carries n copies of the d-wide stream, H = (H_1 .. H_n) (stored as one
(B, T, n*d) tensor, streams side by side, so every reader of "the stream" sees all of them). Each sublayer F
(attention or MLP, with its norm sites A and B and its step h) reads one mix of the streams and writes its
output back into each, weighted, while the streams are mixed among themselves (Zhu et al. 2025, eq. 3;
Xie et al. 2025 eq. 3)::

    h_0 = sum_j pre_j H_j                     the branch input (width connection, A_m / H^pre)
    H'_i = sum_j res_ij H_j + post_i F(h_0)   (depth connection B / H^post; res = A_r^T / H^res)

The embedding enters as n copies (H_0 = (e, .., e)) and the last block's streams are summed before the
final norm (Zhu et al. Sec. 3: "the hidden vectors of the last layer are summed"). Two ways to compute the
connections, the layout's ``stream_mix``:

``hc``   Hyper-connections (Zhu et al., ICLR 2025, eqs. 5-8 and App. J Alg. 2), static + dynamic:
         Hbar = H_j / RMS(H_j) per stream (their norm(); its gain is folded into W, which it only rescales by row),
         A_m = s_a tanh(Hbar W_m) + A_m0,  A_r = s_a tanh(Hbar W_r) + A_r0,  B = s_b tanh(Hbar W_b) + B0,
         pre = A_m, res = A_r^T, post = B; at init A_m0 = e_(k mod n) for the k-th connection (eq. 14), A_r0 = I,
         B0 = 1, W = 0, s_a = s_b = 0.01 (the authors' and lucidrains/hyper-connections' starts): Pre-LN at init.
``mhc``  Manifold-constrained hyper-connections (Xie et al. 2025, DeepSeek, arXiv 2512.24880, eqs. 7-8):
         x~ = vec(H) / RMS(vec(H)) over all n*d channels (no gain),
         pre = sigmoid(a_pre x~ phi_pre + b_pre), post = 2 sigmoid(a_post x~ phi_post + b_post),
         res = SK(exp(a_res mat(x~ phi_res) + b_res)), SK the Sinkhorn-Knopp iteration M <- T_r(T_c(M)) run
         t_max = 20 times (columns, then rows, normalized to sum 1): res is doubly stochastic, so a product of
         them over depth is too and the composite mixing cannot amplify (gain <= 1 in both directions; the
         "Amax gain magnitude" mHC bounds, against ~3000 for unconstrained HC at 27B). At init phi ~ N(0, init_std)
         and b = 0 (transformers' DeepseekV4 _init_weights), the gating factors a = 0.01 (the paper's Table 5).
         transformers' DeepseekV4HyperConnection computes the same maps around DeepSeek-V4's MoE and compressed
         attention (with an eps on pre and comb), and collapses the last streams with a learned head, not a sum.

Each connection keeps its last mixing matrices (detached, per token) for the probes and the screen:
``last_res`` (B, T, n, n), ``last_pre`` and ``last_post`` (B, T, n).
"""

from __future__ import annotations

import torch
from torch import nn

SINKHORN_ITERS = 20  # Xie et al. 2025, t_max
GATE_INIT = 0.01  # Zhu et al.'s s_alpha, s_beta; Xie et al.'s alpha_pre/post/res


def sinkhorn(logits: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """Xie et al. 2025 eq. 9: M_0 = exp(logits) (shifted by its max, which SK's normalizations cancel), then
    ``iters`` times M <- T_r(T_c(M)), T_c and T_r dividing each column and each row by its sum."""
    m = (logits - logits.amax(dim=(-2, -1), keepdim=True)).exp()
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """Zhu et al. 2025's dynamic hyper-connection for one sublayer (see the module docstring)."""

    def __init__(self, n: int, d: int, index: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.n, self.index, self.eps = n, index, eps
        self.static_pre = nn.Parameter(torch.zeros(n))  # A_m0
        self.static_res = nn.Parameter(torch.zeros(n, n))  # A_r0
        self.static_post = nn.Parameter(torch.zeros(n))  # B0
        self.dynamic_pre = nn.Parameter(torch.zeros(d))  # W_m
        self.dynamic_res = nn.Parameter(torch.zeros(d, n))  # W_r
        self.dynamic_post = nn.Parameter(torch.zeros(d))  # W_b
        self.scale_a = nn.Parameter(torch.zeros(1))  # s_alpha
        self.scale_b = nn.Parameter(torch.zeros(1))  # s_beta
        self.last_res: torch.Tensor | None = None
        self.last_pre: torch.Tensor | None = None
        self.last_post: torch.Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        self.static_pre.zero_()
        self.static_pre[self.index % self.n] = 1.0
        self.static_res.copy_(torch.eye(self.n))
        self.static_post.fill_(1.0)
        for p in (self.dynamic_pre, self.dynamic_res, self.dynamic_post):
            p.zero_()
        self.scale_a.fill_(GATE_INIT)
        self.scale_b.fill_(GATE_INIT)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre (B, T, n), res (B, T, n, n) with H'_i = sum_j res_ij H_j, post (B, T, n) from H (B, T, n, d)."""
        hbar = _rms(streams, self.eps)
        pre = self.scale_a * torch.tanh(hbar @ self.dynamic_pre) + self.static_pre  # A_m, one per stream j
        a_r = self.scale_a * torch.tanh(hbar @ self.dynamic_res) + self.static_res  # A_r[j, k]: row j from stream j
        post = self.scale_b * torch.tanh(hbar @ self.dynamic_post) + self.static_post  # B
        return pre, a_r.transpose(-1, -2), post

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The branch input h_0 = sum_j pre_j H_j (B, T, d), and res and post for `depth`."""
        pre, res, post = self.weights(streams)
        self.last_pre, self.last_res, self.last_post = pre.detach(), res.detach(), post.detach()
        return (pre.unsqueeze(-1) * streams).sum(-2), res, post

    @staticmethod
    def depth(streams: torch.Tensor, res: torch.Tensor, post: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """H'_i = sum_j res_ij H_j + post_i * update."""
        return res @ streams + post.unsqueeze(-1) * update.unsqueeze(-2)


class ManifoldHyperConnection(HyperConnection):
    """Xie et al. 2025's mHC for one sublayer: res on the doubly stochastic matrices (see the module docstring)."""

    def __init__(self, n: int, d: int, index: int, eps: float = 1e-6) -> None:
        nn.Module.__init__(self)
        self.n, self.index, self.eps = n, index, eps
        self.phi = nn.Parameter(torch.zeros(n * d, n * n + 2 * n))  # phi_pre | phi_post | phi_res, side by side
        self.bias = nn.Parameter(torch.zeros(n * n + 2 * n))  # b_pre | b_post | b_res
        self.gates = nn.Parameter(torch.zeros(3))  # alpha_pre, alpha_post, alpha_res
        self.last_res = self.last_pre = self.last_post = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.phi, mean=0.0, std=std)
        self.bias.zero_()
        self.gates.fill_(GATE_INIT)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        x = _rms(streams.flatten(-2), self.eps) @ self.phi  # x~ phi, (B, T, n^2 + 2n)
        a = self.gates
        pre_w, post_w, res_w = x.split([n, n, n * n], dim=-1)
        pre_b, post_b, res_b = self.bias.split([n, n, n * n])
        pre = torch.sigmoid(a[0] * pre_w + pre_b)
        post = 2 * torch.sigmoid(a[1] * post_w + post_b)
        res = sinkhorn(a[2] * res_w.unflatten(-1, (n, n)) + res_b.view(n, n))
        return pre, res, post


CONNECTIONS: dict[str, type[HyperConnection]] = {"hc": HyperConnection, "mhc": ManifoldHyperConnection}


def connection(kind: str, n: int, d: int, index: int) -> HyperConnection:
    """The connection of sublayer ``index`` (2 l for layer l's attention, 2 l + 1 for its MLP)."""
    return CONNECTIONS[kind](n, d, index)


def composite_gain(mixes: list[torch.Tensor]) -> dict[str, list[float]]:
    """The composite mixing P_l = res_l ... res_1 after each connection l, per token, and its gain as Xie et al.
    2025 Sec. 3.1 / Fig. 3 measure it: forward, the largest absolute row sum of P (max_i sum_j |P_ij|, how much
    a stream can be amplified); backward, the largest absolute column sum (the gradient's). The maximum over
    tokens; 1 for every l when each res is doubly stochastic."""
    forward, backward, prod = [], [], None
    for res in mixes:
        prod = res if prod is None else res @ prod
        forward.append(prod.abs().sum(-1).amax().item())
        backward.append(prod.abs().sum(-2).amax().item())
    return {"forward": forward, "backward": backward}
