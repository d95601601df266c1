"""The routed mixture-of-experts feed-forward sublayer (OLMoE, Muennighoff et al. 2024; Zhuo et al. 2025 Sec. 4.3).

    p = softmax(x W_r)                          router probabilities over E experts (softmax first)
    S = top-k(p)                                the k chosen experts; their weights p_e are not renormalized
    MoE(x) = sum_{e in S} p_e * E_e(x)  [+ E_shared(x)]        E_e: a SwiGLU MLP of width expert_d_ff

Auxiliary losses (OLMoE Sec. 2, their coefficients by default):
    load balancing  L_LB = E * sum_e f_e * P_e,  f_e = share of the T*k assignments routed to e,
                                                  P_e = mean router probability of e over the T tokens
                    (1 when routing is uniform; Switch Transformer's form, with top-k)
    router z-loss   L_Z  = mean over tokens of logsumexp(x W_r)^2

No token dropping (no capacity limit): every token reaches its k experts. The sublayer sits where
the dense MLP sits, so the layout's norm sites around it are unchanged: every placement applies.

Dispatch: ``loop`` runs each expert on the tokens that chose it (a boolean mask per expert);
``sorted`` sorts the (token, expert) assignments by expert and runs one contiguous segment per expert,
with torch's grouped matrix product (`torch._grouped_mm`, CUDA bf16) where it exists, else one
product per segment. The two agree to float rounding (tested); ``auto`` takes ``sorted``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.config import ModelConfig


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, on the device. `torch.bincount` would size its output from the data and so
    read the maximum back to the host (two syncs per call on CUDA) and break `torch.compile`'s graph;
    a scatter-add into a fixed number of bins does neither."""
    flat = ids.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


class Experts(nn.Module):
    """E SwiGLU MLPs with their weights stacked: gate/up (E, d, f), down (E, f, d)."""

    def __init__(self, n: int, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, d, f))
        self.up_proj = nn.Parameter(torch.empty(n, d, f))
        self.down_proj = nn.Parameter(torch.empty(n, f, d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02^2), a usable default; `normlab.model.init.init_weights` applies the model's scheme."""
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(w, std=0.02)

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x (n, d); under autocast the products run in its dtype."""
        return (F.silu(x @ self.gate_proj[e]) * (x @ self.up_proj[e])) @ self.down_proj[e]


def _grouped_dtype(x: torch.Tensor) -> torch.dtype | None:
    """bf16 where torch's grouped product runs as one kernel (CUDA sm_90 or sm_100, bf16), else None. Its
    CUTLASS kernels are built for those two only: elsewhere (sm_120 included) torch falls back to a loop
    that reads the offsets back to the host, and the looped dispatch here is as good."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)[0] in (9, 10)):
        return None
    bf16 = x.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    )
    return torch.bfloat16 if bf16 else None


class MoE(nn.Module):
    """The routed feed-forward sublayer; after a forward, ``aux`` holds its weighted auxiliary loss,
    ``load`` the share of assignments per expert and ``entropy`` the mean router entropy (last call)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.expert_ffn_dim
        self.n_experts, self.top_k, self.dispatch = cfg.n_experts, cfg.moe_top_k, cfg.moe_dispatch
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.router = nn.Linear(d, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, d, f)
        self.shared: MLP | None = None
        if cfg.moe_shared_expert:
            from normlab.model.mlp import MLP

            self.shared = MLP(cfg.with_(d_ff=f, mlp="swiglu", n_experts=0))
        self.aux: torch.Tensor | None = None
        self.load: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None  # mean router entropy over the tokens (nats)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits (T, E), probabilities (T, E), top-k weights (T, k), top-k expert ids (T, k)) for tokens x (T, d)."""
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return logits, probs, weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, probs, weights, ids = self.route(flat)
        mode = "sorted" if self.dispatch == "auto" else self.dispatch
        y = (self._sorted if mode == "sorted" else self._loop)(flat, weights, ids)
        if self.shared is not None:
            y = y + self.shared(flat)
        load = expert_counts(ids, self.n_experts).float() / ids.numel()  # f_e
        self.load = load.detach()
        self.entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().detach()
        lb = self.n_experts * (load * probs.mean(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        self.aux = self.aux_coef * lb + self.z_coef * z
        return y.reshape(shape).to(x.dtype)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
        for e in range(self.n_experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                ye = self.experts.one(e, x[token]).float() * weights[token, slot, None]
                out.index_add_(0, token, ye)
        return out

    def _sorted(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        token = order // self.top_k  # the token of each assignment, grouped by expert
        xs = x[token]
        counts = expert_counts(flat_ids, self.n_experts)
        dtype = _grouped_dtype(xs)
        if dtype is not None:  # one kernel per product for all experts, no host sync
            offs = counts.cumsum(0).to(torch.int32)
            w, xb = self.experts, xs.to(dtype)
            g = torch._grouped_mm(xb, w.gate_proj.to(dtype), offs=offs)
            u = torch._grouped_mm(xb, w.up_proj.to(dtype), offs=offs)
            ys = torch._grouped_mm(F.silu(g) * u, w.down_proj.to(dtype), offs=offs).float()
        else:
            # one product per expert segment: the segment bounds are read once (a host sync)
            bounds = [0, *counts.cumsum(0).tolist()]
            parts = [
                self.experts.one(e, xs[bounds[e] : bounds[e + 1]]).float()
                for e in range(self.n_experts)
                if bounds[e + 1] > bounds[e]
            ]
            ys = torch.cat(parts) if parts else xs.new_zeros(0, x.shape[1], dtype=torch.float32)
        ys = ys * weights.flatten()[order, None]
        return torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32).index_add_(0, token, ys)
