"""The norms a site can hold, as they run under mixed precision, and the capture point `Tap`.

    RMSNorm(x)   = gamma * x / sqrt(mean(x^2) + eps)                  Zhang & Sennrich 2019
    LayerNorm(x) = gamma * (x - mean(x)) / sqrt(var(x) + eps) + beta  Ba et al. 2016
    DyT(x)       = gamma * tanh(alpha * x) + beta, alpha a learned scalar   Zhu et al. 2025, eq. (1)
    Derf(x)      = gamma * erf(alpha * x + s) + beta, alpha and s learned scalars   Chen et al. 2025
                   ("Stronger Normalization-Free Transformers", arXiv 2512.10938; the authors' Dynamic_erf)
    ScaleNorm(x) = g * x / sqrt(sum(x^2) + eps), g a learned scalar (sqrt(d) at init)  Nguyen & Salazar 2019
    L2Norm(x)    = x / sqrt(sum(x^2) + eps), no parameters
    SeeDNorm(x)  = (tanh(x . beta) alpha + gamma) * x / sqrt(mean(x^2) + eps), beta, alpha per channel
                   Cai et al. 2025 (SeeDNorm: Self-Rescaled Dynamic Normalization, arXiv 2510.22777), eq. 3
    GatedNorm(x) = y * sigmoid(SiLU(y W_down) W_up), y = RMSNorm(x), W_down d x r, W_up r x d (r = rank, as set)
                   marin's grug MoE recipe (experiments/grug/moe/model.py: RMSNorm, then GatedNorm.__call__)
    TaperNorm(x) = g * RMSNorm(x) + (1 - g) * c * gamma~ * x, g a global gate from 1 to 0 on the training step's
                   schedule, c calibrated at the taper's start (Kanavalau et al. 2026, arXiv 2602.10408)

DyT is not a normalization (no statistic of x): it squashes each entry, so its output is bounded by
|gamma| + |beta| entry by entry whatever the input's scale, where RMSNorm's output has RMS |gamma|; Derf
squashes with erf after a learned shift, bounded the same way. ScaleNorm and L2 fix the output's norm
(g, 1) with one scalar or none instead of a gain per channel.

Gains (``gain=``): gamma (one per channel, from 1), none, centered (w from 0 applied as 1 + w), or scalar
(one learned number from 1 for every channel: Outlier-Safe Pre-Training's single-scale RMSNorm, Park et
al. 2025, arXiv 2506.19697). A LayerNorm without a per-channel gain has no beta either (torch's
elementwise_affine=False), for none and scalar alike.

Both are torch's modules (`nn.RMSNorm`, `nn.LayerNorm`: the same parameters and state-dict keys)
with one change, the dtype they compute in. Under autocast the weights stay float32 while the
activations are bf16/fp16, and torch's fused kernels refuse mixed dtypes: `rms_norm` falls back
to an unfused composite ("Mismatch dtype between input and weight ... Cannot dispatch to fused
implementation") and CUDA autocast runs `layer_norm` in float32. ``compute`` picks one of two
documented paths, both fused, for every norm site:

- ``"input"`` (default): gamma and beta are cast to the input's dtype and the fused kernel runs
  in it (the kernels accumulate the mean and variance in float32 internally), output in the
  input's dtype. One read and one write of the activation in bf16.
- ``"fp32"``: the input is upcast, normalized and scaled in float32, and cast back, the
  float32-compute-then-cast of Hugging Face's LlamaRMSNorm. Costs the two casts' traffic.

Without autocast (float32 activations and weights) both are exactly torch's modules. Autocast is
switched off inside the norm so the dtype is the one chosen here on every device (CUDA autocast
would otherwise promote LayerNorm to float32, CPU autocast would not). `benchmarks/norm_kernels.py`
measures both paths. A site that is off holds `nn.Identity()`, so module paths are the same under
every layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from normlab.layout.norm_kinds import GATED_NORM_RANK, NORM_FACTS
from normlab.layout.sites import NormKind, NormSpec
from normlab.model.config import NORM_COMPUTE, ModelConfig

NormCompute = Literal["input", "fp32"]


def _cast(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if p is None else p.to(dtype)


def _outside_autocast(norm, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a bound _norm
    """``norm(x)`` with autocast off, entered only where autocast is on (eager overhead elsewhere: none)."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return norm(x)
    return norm(x)


def gain_of(norm: nn.Module) -> torch.Tensor | None:
    """The gain a norm applies: its weight, plus 1 for a centered gain; None without one."""
    w = getattr(norm, "weight", None)
    return None if w is None else (w + 1.0 if getattr(norm, "offset", 0.0) else w)


def _per_channel(gain: str) -> bool:
    """Whether torch's module keeps its own per-channel weight (elementwise_affine) for this gain."""
    return gain in ("gamma", "centered")


class _Gain:
    """gain "gamma" (a weight from 1), "none" (no weight), "centered" (a weight w from 0, applied as 1 + w)
    or "scalar" (one weight from 1, broadcast over the channels)."""

    offset = 0.0

    def _set_gain(self, gain: str) -> None:
        if gain not in ("gamma", "none", "centered", "scalar"):
            raise ValueError(f"unknown gain {gain!r}; valid: gamma, none, centered, scalar")
        self.gain = gain
        self.offset = 1.0 if gain == "centered" else 0.0
        if gain == "scalar":
            self.weight = nn.Parameter(torch.ones(1))
        if gain == "centered":
            with torch.no_grad():
                self.weight.zero_()

    def _affine(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The scalar gain applied after torch's kernel normalized without one (other gains go into the kernel)."""
        return y * self.weight.to(dtype) if self.gain == "scalar" else y

    def _kernel_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.gain == "scalar" else _cast(gain_of(self), dtype)  # type: ignore[arg-type]

    def reset_parameters(self) -> None:
        super().reset_parameters()  # type: ignore[misc]
        if getattr(self, "gain", None) == "scalar":
            with torch.no_grad():
                self.weight.fill_(1.0)
        if getattr(self, "offset", 0.0) and self.weight is not None:
            with torch.no_grad():
                self.weight.zero_()


class RMSNorm(_Gain, nn.RMSNorm):
    """`nn.RMSNorm` computed in the input's dtype (fused) or in float32; see the module docstring."""

    def __init__(self, dim: int, eps: float, compute: NormCompute = "input", gain: str = "gamma") -> None:
        super().__init__(dim, eps=eps, elementwise_affine=_per_channel(gain))
        self.compute = compute
        self._set_gain(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _outside_autocast(self._norm, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.compute == "fp32" else x.dtype
        y = F.rms_norm(x.to(dtype), self.normalized_shape, self._kernel_weight(dtype), self.eps)
        return self._affine(y, dtype).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute={self.compute}"


class LayerNorm(_Gain, nn.LayerNorm):
    """`nn.LayerNorm` computed in the input's dtype (fused) or in float32; see the module docstring.
    Gain "none" has neither gamma nor beta (torch's elementwise_affine=False)."""

    def __init__(
        self, dim: int, eps: float, bias: bool = True, compute: NormCompute = "input", gain: str = "gamma"
    ) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=_per_channel(gain), bias=bias)
        self.compute = compute
        self._set_gain(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _outside_autocast(self._norm, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.compute == "fp32" else x.dtype
        y = F.layer_norm(
            x.to(dtype), self.normalized_shape, self._kernel_weight(dtype), _cast(self.bias, dtype), self.eps
        )
        return self._affine(y, dtype).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute={self.compute}"


class _Elementwise(nn.Module):
    """Shared by the norms written here: autocast off inside, computed in the input's dtype or float32."""

    compute: NormCompute = "input"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _outside_autocast(self._norm, x)

    def _dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.compute == "fp32" else x.dtype


class DyT(_Elementwise):
    """Dynamic Tanh (Zhu et al. 2025, "Transformers without Normalization", eq. 1):
    gamma * tanh(alpha * x) + beta, alpha one learned scalar (``alpha0`` at init), gamma and beta per
    channel (ones and zeros; gain "scalar": one gamma)."""

    def __init__(
        self, dim: int, alpha0: float = 0.5, bias: bool = True, compute: NormCompute = "input", gain: str = "gamma"
    ) -> None:
        super().__init__()
        self.alpha0, self.compute, self.gain = float(alpha0), compute, gain
        self.offset = 1.0 if gain == "centered" else 0.0
        self.alpha = nn.Parameter(torch.full((1,), self.alpha0))
        width = 1 if gain == "scalar" else dim
        self.weight = nn.Parameter(torch.full((width,), 1.0 - self.offset)) if gain != "none" else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(self.alpha0)
            if self.weight is not None:
                self.weight.fill_(1.0 - self.offset)
            if self.bias is not None:
                self.bias.zero_()

    # saturated: the squashing function passes less than SATURATED of a change in its input, relative to its slope
    # at 0 (tanh'(z) = 1 - tanh(z)^2 < 0.05 where |z| > atanh(sqrt(0.95)) = 2.178); the share of such inputs is what
    # predicts DyT's regime (arXiv 2604.23434: removing the norm helps at small token budgets, hurts at large)
    SATURATED = 0.05

    def _preact(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha.to(x.dtype) * x

    def _squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self._preact(x))

    def _relative_slope(self, z: torch.Tensor) -> torch.Tensor:
        """The squash's slope at ``z`` over its slope at 0: tanh'(z) = 1 - tanh(z)^2."""
        return 1 - torch.tanh(z) ** 2

    def saturated_share(self, x: torch.Tensor) -> torch.Tensor:
        """The share of ``x``'s entries whose squash is saturated (`SATURATED`), as a 0-dim tensor (no sync)."""
        return (self._relative_slope(self._preact(x.detach().float())) < self.SATURATED).float().mean()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype(x)
        y = self._squash(x.to(dtype))
        g = gain_of(self)
        y = y * g.to(dtype) if g is not None else y
        return (y + self.bias.to(dtype) if self.bias is not None else y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"alpha0={self.alpha0}, gain={self.gain}, bias={self.bias is not None}, compute={self.compute}"


class Derf(DyT):
    """Dynamic erf (Chen et al. 2025, "Stronger Normalization-Free Transformers", arXiv 2512.10938):
    gamma * erf(alpha * x + s) + beta, alpha and the shift s learned scalars (``alpha0`` and 0 at init, as
    the authors' Dynamic_erf), gamma and beta per channel as DyT's. erf's range is (-1, 1), as tanh's: the
    output lies in the same box |y_i| <= |gamma_i| + |beta_i|."""

    def __init__(
        self, dim: int, alpha0: float = 0.5, bias: bool = True, compute: NormCompute = "input", gain: str = "gamma"
    ) -> None:
        super().__init__(dim, alpha0, bias, compute, gain)
        self.shift = nn.Parameter(torch.zeros(1))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.shift.zero_()

    def _preact(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha.to(x.dtype) * x + self.shift.to(x.dtype)

    def _squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(self._preact(x))

    def _relative_slope(self, z: torch.Tensor) -> torch.Tensor:
        """erf'(z) / erf'(0) = exp(-z^2): saturated (below `SATURATED`) where |z| > sqrt(ln 20) = 1.731."""
        return torch.exp(-(z**2))


class ScaleNorm(_Elementwise):
    """ScaleNorm (Nguyen & Salazar 2019, eq. 3): g * x / ||x||, g one learned scalar, sqrt(d) at init."""

    def __init__(self, dim: int, eps: float, compute: NormCompute = "input") -> None:
        super().__init__()
        self.dim, self.eps, self.compute = dim, eps, compute
        self.weight = nn.Parameter(torch.full((1,), math.sqrt(dim)))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(math.sqrt(self.dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype(x)
        xd = x.to(dtype)
        inv = torch.rsqrt(xd.float().pow(2).sum(-1, keepdim=True) + self.eps).to(dtype)
        return (xd * inv * self.weight.to(dtype)).to(x.dtype)


class L2Norm(_Elementwise):
    """x / ||x|| over the last dimension, with no gain (a gain-free norm; QK-norm after RoPE in Llama 4)."""

    def __init__(self, eps: float, compute: NormCompute = "input") -> None:
        super().__init__()
        self.eps, self.compute = eps, compute

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype(x)
        xd = x.to(dtype)
        return (xd * torch.rsqrt(xd.float().pow(2).sum(-1, keepdim=True) + self.eps).to(dtype)).to(x.dtype)


class SeeDNorm(_Elementwise):
    """SeeDNorm (Cai et al. 2025, "SeeDNorm: Self-Rescaled Dynamic Normalization", arXiv 2510.22777, eq. 3):
    [tanh(x beta^T) alpha + gamma] * x / RMS(x), RMS(x) = sqrt(mean(x^2) + eps). x beta^T is one number per token
    from the raw input (so the input's norm reaches the output), tanh bounds it, alpha (per channel) turns it into a
    per-channel change of RMSNorm's static gain gamma. normlab starts beta at 0, alpha at 1 and gamma at 1: RMSNorm
    at init, with beta's gradient nonzero (the paper's own starts and its stabilizing measures are not built).
    Gains: gamma as RMSNorm's (``gain=``; none: gamma fixed at 1); alpha and beta are always per channel."""

    def __init__(self, dim: int, eps: float, compute: NormCompute = "input", gain: str = "gamma") -> None:
        super().__init__()
        self.eps, self.compute, self.gain = eps, compute, gain
        self.offset = 1.0 if gain == "centered" else 0.0
        width = 1 if gain == "scalar" else dim
        self.weight = nn.Parameter(torch.full((width,), 1.0 - self.offset)) if gain != "none" else None  # gamma
        self.self_scale = nn.Parameter(torch.zeros(dim))  # beta
        self.dyn_gain = nn.Parameter(torch.ones(dim))  # alpha

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0 - self.offset)
            self.self_scale.zero_()
            self.dyn_gain.fill_(1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype(x)
        xd = x.to(dtype)
        r = xd * torch.rsqrt(xd.float().pow(2).mean(-1, keepdim=True) + self.eps).to(dtype)
        g = gain_of(self)
        gain = torch.tanh(xd @ self.self_scale.to(dtype)).unsqueeze(-1) * self.dyn_gain.to(dtype)
        gain = gain + (g.to(dtype) if g is not None else 1.0)
        return (gain * r).to(x.dtype)

    def extra_repr(self) -> str:
        return f"gain={self.gain}, compute={self.compute}"


class GatedNorm(RMSNorm):
    """GatedNorm: RMSNorm, then a low-rank sigmoid gate on its output, as marin's grug MoE recipe computes it
    (marin-community/marin experiments/grug/moe/model.py: ``RMSNorm.__call__`` then ``GatedNorm.__call__``, applied as
    ``attn_gated_norm(rms_attn(x))`` in ``Block.attention_residual``; after Qiu et al. 2026, arXiv 2601.22966)::

        y = RMSNorm(x) = gamma * x / sqrt(mean(x^2) + eps)
        GatedNorm(x) = y * sigmoid(SiLU(y W_down) W_up)          W_down: d x r, W_up: r x d

    r = ``rank`` (marin: 128, at every width: below d = 128 the gate widens, as marin's code builds it). The gate
    reads the normed y, so GatedNorm(c x) = GatedNorm(x) as RMSNorm.
    gate_down and gate_up are stored as nn.Linear weights are, (out, in): y @ gate_down.T @ gate_up.T; both start
    truncated normal std 0.02 in [-3 std, 3 std] (marin's ``_init_weight`` with initializer_std 0.02), so the gate
    starts near sigmoid(0) = 1/2. They are matrices: they decay and Muon takes them in the blocks
    (``DECAYED``, normlab.train.optim), as marin's optimizer routes them with the matrices (marin issue 5750)."""

    DECAYED = ("gate_down", "gate_up")
    GATE_STD = 0.02

    def __init__(
        self, dim: int, eps: float, compute: NormCompute = "input", gain: str = "gamma", rank: int = GATED_NORM_RANK
    ) -> None:
        self.rank = int(rank)
        super().__init__(dim, eps, compute, gain)
        self.gate_down = nn.Parameter(torch.empty(self.rank, dim))
        self.gate_up = nn.Parameter(torch.empty(dim, self.rank))
        self._reset_gate()

    def _reset_gate(self) -> None:
        with torch.no_grad():
            for w in (self.gate_down, self.gate_up):
                nn.init.trunc_normal_(w, std=self.GATE_STD, a=-3 * self.GATE_STD, b=3 * self.GATE_STD)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "gate_down"):
            self._reset_gate()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = super()._norm(x)
        dtype = torch.float32 if self.compute == "fp32" else x.dtype
        yd = y.to(dtype)
        hidden = F.silu(F.linear(yd, self.gate_down.to(dtype)))
        return (yd * torch.sigmoid(F.linear(hidden, self.gate_up.to(dtype)))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}"


def taper_gate(step: int, steps: int, start: float, end: float) -> float:
    """TaperNorm's global gate at ``step`` of ``steps`` (Kanavalau et al. 2026): 1 until ``start * steps``, then a
    half cosine to 0 at ``end * steps``, 0 after: g = (1 + cos(pi (t - t0) / (t1 - t0))) / 2."""
    t0, t1 = start * steps, end * steps
    if step <= t0:
        return 1.0
    if step >= t1:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - t0) / (t1 - t0)))


class TaperNorm(_Elementwise):
    """TaperNorm, RMSNorm form (Kanavalau, Amo Alonso & Lall 2026, arXiv 2602.10408)::

        TaperNorm(x; g) = g * gamma * x / r(x) + (1 - g) * c * gamma~ * x,   r(x) = sqrt(mean(x^2) + eps)

    g is one gate for the whole model, set each step by the trainer (`TaperHook`, `taper_gate`): 1 during the gate
    warmup (exactly RMSNorm), while the module keeps exponential moving averages (decay ``EMA``) of
    E||gamma x||^2 / r(x) and E||gamma x||^2 over its training inputs; at the taper's start `calibrate` sets
    c = their ratio, the least-squares fit of c gamma x to gamma x / r(x), and gamma~ = gamma; then g falls by a half
    cosine to 0, after which the map is the fixed linear c gamma~ x and `normlab.model.taper_fold` folds it into the
    projections that read it. gamma~ (``taper_weight``) trains from the calibration on. The paper's text beyond its
    abstract was not retrievable here: these equations follow its abstract and two third-party readings of it
    (see docs/layouts.md); the schedule's fractions (``START``, ``END``) are normlab's."""

    gate: torch.Tensor  # buffers (register_buffer), saved with the weights
    coeff: torch.Tensor
    ema_num: torch.Tensor
    ema_den: torch.Tensor
    calibrated: torch.Tensor
    EMA = 0.99
    START, END = 0.25, 0.75  # fractions of the run's steps: the gate warmup's end and the taper's end

    def __init__(self, dim: int, eps: float, compute: NormCompute = "input") -> None:
        super().__init__()
        self.dim, self.eps, self.compute = dim, eps, compute
        self.weight = nn.Parameter(torch.ones(dim))  # gamma
        self.taper_weight = nn.Parameter(torch.ones(dim))  # gamma~
        for name, value in (("gate", 1.0), ("coeff", 1.0), ("ema_num", 0.0), ("ema_den", 0.0), ("calibrated", 0.0)):
            self.register_buffer(name, torch.tensor(value))
        # the gate and the calibration flag as Python values beside their buffers (which the checkpoint keeps): the
        # forward branches on them without reading a device tensor back (a host sync per norm on a GPU)
        self.gate_value, self.is_calibrated = 1.0, False
        self.register_load_state_dict_post_hook(lambda module, _keys: module.mirror())

    def mirror(self) -> None:
        """The Python values read again from the buffers (after a load)."""
        self.gate_value, self.is_calibrated = float(self.gate), bool(self.calibrated)

    def set_gate(self, g: float) -> None:
        """The gate for the coming step (`normlab.train.taper.TaperHook`)."""
        self.gate.fill_(g)
        self.gate_value = float(g)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.taper_weight.fill_(1.0)
            for name, value in (("gate", 1.0), ("coeff", 1.0), ("ema_num", 0.0), ("ema_den", 0.0)):
                getattr(self, name).fill_(value)
            self.calibrated.fill_(0.0)
        self.gate_value, self.is_calibrated = 1.0, False

    def _track(self, x: torch.Tensor, r: torch.Tensor) -> None:
        """One EMA step of the calibration's two means (first step: the means themselves)."""
        with torch.no_grad():
            wide = torch.promote_types(x.dtype, torch.float32)
            sq = (x.to(wide) * self.weight.to(wide)).pow(2).sum(-1)
            num, den = (sq / r.squeeze(-1).to(wide)).mean(), sq.mean()
            first = self.ema_den == 0
            a = torch.where(first, torch.zeros_like(num), torch.full_like(num, self.EMA))
            self.ema_num.copy_(a * self.ema_num + (1 - a) * num)
            self.ema_den.copy_(a * self.ema_den + (1 - a) * den)

    def calibrate(self) -> None:
        """c = EMA(||gamma x||^2 / r(x)) / EMA(||gamma x||^2) (1 without statistics), gamma~ = gamma."""
        with torch.no_grad():
            ok = self.ema_den > 0
            self.coeff.copy_(torch.where(ok, self.ema_num / self.ema_den.clamp_min(1e-30), torch.ones_like(self.coeff)))
            self.taper_weight.copy_(self.weight)
            self.calibrated.fill_(1.0)
        self.is_calibrated = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype(x)
        xd = x.to(dtype)
        g = self.gate_value
        if g == 0.0:
            return (xd * (self.coeff * self.taper_weight).to(dtype)).to(x.dtype)
        r = torch.sqrt(xd.to(torch.promote_types(xd.dtype, torch.float32)).pow(2).mean(-1, keepdim=True) + self.eps)
        if self.training and not self.is_calibrated:
            self._track(xd, r)
        normed = xd * (1.0 / r).to(dtype) * self.weight.to(dtype)
        if g == 1.0:
            return normed.to(x.dtype)
        scaled = xd * (self.coeff * self.taper_weight).to(dtype)
        return (g * normed + (1.0 - g) * scaled).to(x.dtype)

    def extra_repr(self) -> str:
        return f"gate={float(self.gate):.4g}, compute={self.compute}"


@dataclass(frozen=True)
class NormModule:
    """The torch module of one norm kind, registered by the kind's name beside its facts
    (normlab.layout.norm_kinds): its class and how to build it over ``dim`` channels from the model's eps, bias,
    compute, DyT/Derf alpha0 and the site's gain (arguments a kind does not take it ignores)."""

    cls: type[nn.Module]
    build: Callable[..., nn.Module]  # (dim, eps, bias, compute, alpha0, gain[, rank]) -> the module


# kind -> its module: one entry per row of NORM_KIND_FACTS (tests/unit/test_registries.py checks they agree)
NORM_MODULES: dict[str, NormModule] = {
    "rms": NormModule(RMSNorm, lambda dim, eps, bias, compute, alpha0, gain: RMSNorm(dim, eps, compute, gain)),
    "layer": NormModule(
        LayerNorm, lambda dim, eps, bias, compute, alpha0, gain: LayerNorm(dim, eps, bias, compute, gain)
    ),
    "dyt": NormModule(DyT, lambda dim, eps, bias, compute, alpha0, gain: DyT(dim, alpha0, bias, compute, gain)),
    "derf": NormModule(Derf, lambda dim, eps, bias, compute, alpha0, gain: Derf(dim, alpha0, bias, compute, gain)),
    "scale": NormModule(ScaleNorm, lambda dim, eps, bias, compute, alpha0, gain: ScaleNorm(dim, eps, compute)),
    "l2": NormModule(L2Norm, lambda dim, eps, bias, compute, alpha0, gain: L2Norm(eps, compute)),
    "seednorm": NormModule(SeeDNorm, lambda dim, eps, bias, compute, alpha0, gain: SeeDNorm(dim, eps, compute, gain)),
    "gatednorm": NormModule(
        GatedNorm,
        lambda dim, eps, bias, compute, alpha0, gain, rank=GATED_NORM_RANK: GatedNorm(dim, eps, compute, gain, rank),
    ),
    "taper": NormModule(TaperNorm, lambda dim, eps, bias, compute, alpha0, gain: TaperNorm(dim, eps, compute)),
}

# torch's own RMSNorm and LayerNorm (which normlab's subclass) count as norms too, wherever a model holds one
NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    dict.fromkeys((nn.RMSNorm, nn.LayerNorm, *(m.cls for m in NORM_MODULES.values())))
)


def is_norm(m: nn.Module) -> bool:
    """A norm module of any kind (what weight decay exclusion, probes, forensics and init look for)."""
    return isinstance(m, NORM_TYPES)


def make_norm(
    kind: NormKind,
    dim: int,
    eps: float,
    bias: bool = True,
    frozen_gamma: bool = False,
    compute: NormCompute = "input",
    dyt_alpha: float = 0.5,
    gain: str = "gamma",
) -> nn.Module:
    """A norm over the last dimension; ``frozen_gamma`` fixes gamma at 1 (Kim et al. Fig. 8)."""
    return _built(kind, (dim, eps, bias, compute, dyt_alpha, gain), frozen_gamma)


def _built(kind: NormKind, args: tuple, frozen_gamma: bool) -> nn.Module:
    """The kind's module from its builder's arguments (dim, eps, bias, compute, alpha0, gain[, rank])."""
    if args[3] not in NORM_COMPUTE:
        raise ValueError(f"unknown norm compute {args[3]!r}; valid: {', '.join(NORM_COMPUTE)}")
    if kind not in NORM_MODULES:
        raise ValueError(f"unknown norm kind {kind!r}; valid: {', '.join(NORM_MODULES)}")
    norm = NORM_MODULES[kind].build(*args)
    if frozen_gamma and getattr(norm, "weight", None) is not None:
        norm.weight.requires_grad_(False)
    return norm


def norm_kind_of(m: nn.Module) -> str | None:
    """The kind whose registered class ``m`` is exactly (None: not one of normlab's norm modules)."""
    return next((kind for kind, entry in NORM_MODULES.items() if type(m) is entry.cls), None)


def site_norm(on: bool, spec: NormSpec, dim: int, cfg: ModelConfig, frozen_gamma: bool = False) -> nn.Module:
    """The module at one norm site: ``spec``'s norm over ``dim`` channels with the model's eps, bias and
    compute (DyT's or Derf's alpha0 the site's own, else the model's ``dyt_alpha``; a gated kind's rank the model's
    ``gated_norm_rank``), or `nn.Identity` where it is off."""
    if not on:
        return nn.Identity()
    alpha0 = spec.alpha0 if spec.alpha0 is not None else cfg.dyt_alpha
    # ModelConfig checks norm_compute is one of NORM_COMPUTE
    args: tuple = (dim, cfg.norm_eps, cfg.norm_bias, cast(NormCompute, cfg.norm_compute), alpha0, spec.gain)
    if spec.kind in NORM_FACTS and any(size == "gate" for _, size in NORM_FACTS[spec.kind].params):
        args += (cfg.gated_norm_rank,)
    return _built(spec.kind, args, frozen_gamma)


class Tap(nn.Identity):
    """A named capture point: returns its input unchanged, so a forward hook on it sees exactly
    the tensor that flows there (e.g. ``blocks.3.attn_update``, the update added to the stream)."""
