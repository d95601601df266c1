"""The statistics the papers plot, as pure functions of tensors.

- hidden-state mean |h|, entry-wise variance and RMS (Kim Figs. 1, 6, 14, 15; Kan Fig. 1);
- top-k absolute activations, max, median, max/median ratio (Sun et al. 2024 "massive activations")
  and the headroom to the FP16 maximum 65504 (Kim Fig. 11);
- angular distance between hidden states, arccos(cos) / pi averaged over tokens (Kim Figs. 9, 39);
- attention max logit and entropy per head (the QK-norm motivation, Wortsman et al. 2024);
- the attention-sink mass per head, the mean attention on the first token (Xiao et al. 2024; Gu et al. 2025,
  "When Attention Sink Emerges": a head is a sink head when that mass exceeds 0.3, their epsilon);
- activation kurtosis, E[(x - mu)^4] / Var(x)^2 over a tensor's entries (3 for a Gaussian; massive
  activations make it large: Bondarenko et al. 2023, He et al. 2024 "outlier features").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from normlab.runs.metrics import ProbeMetric

FP16_MAX = 65504.0
# a value within this factor of its storage maximum counts as headed for overflow: the transfer study's failure
# predictor (normlab.experiments.transfer), recommend's runs at risk and the early warnings share it
OVERFLOW_HEADROOM = 8.0
# precision -> (the attention logit its stored q and k resolve to about a nat: 1 / their relative error, a heuristic
# bound; the largest activation it stores, inf where no overflow is in reach):
# normlab.recommend.evidence.signals explains it
PRECISION_LIMITS: dict[str, tuple[float, float]] = {
    "fp16": (2.0**11, FP16_MAX),
    "bf16": (2.0**8, math.inf),
    "fp32": (2.0**24, math.inf),
}


def log_growth(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of log value against step over (step, log value) points: the growth rate per step
    (exp(100 x slope) per 100 steps); None with fewer than two distinct steps."""
    steps = [s for s, _ in points]
    if len(points) < 2 or max(steps) == min(steps):
        return None
    n = len(points)
    ms, ml = sum(steps) / n, sum(x for _, x in points) / n
    return sum((s - ms) * (x - ml) for s, x in points) / sum((s - ms) ** 2 for s in steps)


def hidden_stats(x: torch.Tensor) -> dict[str, float]:
    x = x.detach().float()
    a = x.abs()
    med = a.flatten().median().item()
    mx = a.max().item()
    return {
        ProbeMetric.MEAN_ABS: a.mean().item(),
        ProbeMetric.VAR: x.var().item(),
        ProbeMetric.RMS: x.pow(2).mean().sqrt().item(),
        ProbeMetric.MAX_ABS: mx,
        ProbeMetric.MEDIAN_ABS: med,
        ProbeMetric.MAX_MEDIAN_RATIO: mx / med if med > 0 else math.inf,
    }


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """||after - before|| / ||before|| (Frobenius): the relative size of one optimizer step on a weight, whatever
    the optimizer (AdamW's is about lr sqrt(numel) / ||W|| once its moments settle; Muon's lr' sqrt(min(A, B)) /
    ||W||, its orthogonalized update having singular values near 1); inf for a zero weight."""
    norm = before.float().norm().item()
    return (after.float() - before.float()).norm().item() / norm if norm > 0 else math.inf


def top_k_abs(tensors: list[torch.Tensor], k: int = 100) -> torch.Tensor:
    """The k largest absolute values over all the tensors, descending."""
    flat = torch.cat([t.detach().float().abs().flatten() for t in tensors])
    return flat.topk(min(k, flat.numel())).values


def fp16_headroom(max_abs: float) -> float:
    """How many times the largest activation fits under FP16's maximum (< 1: it would overflow)."""
    return FP16_MAX / max_abs if max_abs > 0 else math.inf


ANGULAR_TOKENS = ("last", "all")


def angular_distance(a: torch.Tensor, b: torch.Tensor, tokens: str = "last") -> float:
    """arccos(cos(a, b)) / pi between two stream states of shape (..., T, d): 0 for identical
    directions, 0.5 orthogonal, 1 opposite. ``tokens="last"``: at the last token of each sequence,
    the definition of Gromov et al. 2024 that Kim et al. Fig. 9 cites (the mean over the batch);
    ``"all"``: the mean over every token."""
    if tokens not in ANGULAR_TOKENS:
        raise ValueError(f"unknown tokens {tokens!r}; valid: {', '.join(ANGULAR_TOKENS)}")
    if tokens == "last":
        a, b = a[..., -1, :], b[..., -1, :]
    a, b = a.detach().double().reshape(-1, a.shape[-1]), b.detach().double().reshape(-1, b.shape[-1])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1.0, 1.0)
    return (torch.arccos(cos) / math.pi).mean().item()


def angular_matrix(states: list[torch.Tensor], tokens: str = "last") -> list[list[float]]:
    n = len(states)
    out = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            out[i][j] = out[j][i] = angular_distance(states[i], states[j], tokens)
    return out


def attention_stats(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> tuple[list[float], list[float]]:
    """Per head: the largest causal attention logit q.k * scale (1/sqrt(d) unless the model sets its own, as
    Gemma's query_pre_attn_scalar^-1/2) and the mean entropy (nats) of the attention rows (before any
    soft-cap). q: (B, H, T, d), k: (B, H_kv, T, d)."""
    q, k = q.detach().float(), k.detach().float()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    t = q.shape[-2]
    logits = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    masked = logits.masked_fill(~mask, float("-inf"))
    p = masked.softmax(-1)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)  # (B, H, T)
    max_logit = logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    return max_logit.tolist(), ent.mean(dim=(0, 2)).tolist()


SINK_THRESHOLD = 0.3  # Gu et al. 2025's epsilon: a head whose mean attention on the first token exceeds it


def sink_mass(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> list[float]:
    """Per head: the attention probability on the first token, averaged over the batch and the queries
    t >= 1 (query 0 sees only the first token), under plain causal softmax of q.k * scale (the logits of
    `attention_stats`). q: (B, H, T, d), k: (B, H_kv, T, d)."""
    q, k = q.detach().float(), k.detach().float()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    t = q.shape[-2]
    if t < 2:
        return [1.0] * q.shape[1]
    logits = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    return p[:, :, 1:, 0].mean(dim=(0, 2)).tolist()


def kurtosis(x: torch.Tensor) -> float:
    """E[(x - mu)^4] / Var(x)^2 over every entry (population moments, float64); 0 for a constant tensor."""
    x = x.detach().double().flatten()
    c = x - x.mean()
    var = c.pow(2).mean()
    return (c.pow(4).mean() / var.pow(2)).item() if var > 0 else 0.0


def massive_activations(tensors: list[torch.Tensor], k: int = 100) -> dict[str, float]:
    """Over all the tensors: the top-k band, max, median, max/median ratio and FP16 headroom."""
    top = top_k_abs(tensors, k)
    med = torch.cat([t.detach().float().abs().flatten() for t in tensors]).median().item()
    mx = top[0].item()
    return {
        ProbeMetric.TOP100_MAX: mx,
        ProbeMetric.TOP100_MIN: top[-1].item(),
        ProbeMetric.TOP100_MEAN: top.mean().item(),
        ProbeMetric.MAX_ABS: mx,
        ProbeMetric.MEDIAN_ABS: med,
        ProbeMetric.MAX_MEDIAN_RATIO: mx / med if med > 0 else math.inf,
        ProbeMetric.FP16_HEADROOM: fp16_headroom(mx),
    }


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| in float32, one pass over x (``x.abs().amax()`` writes |x| first): on CUDA the inf-norm (one
    kernel); on the CPU ``aminmax`` and max(max, -min), as the CPU's inf-norm kernel is about 50 times slower
    (1.7 ms against 0.03 ms for a micro block's 32 x 128 x 64 output, one thread). A NaN propagates in both."""
    x = x.detach()
    if x.device.type == "cuda":
        out: torch.Tensor = torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32)
        return out
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, -lo).float()
