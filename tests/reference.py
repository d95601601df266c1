"""Hand-written functional references, independent of normlab's modules: they read the weights
of a built model and recompute from the papers' formulas, in float64."""

from __future__ import annotations

import math

import torch


def gain(mod):
    """gamma; 1 + w for a centered gain (stored w, from 0); 1 without a gain; a scalar gain's one number
    broadcasts over the channels."""
    if mod.weight is None:
        return 1.0
    return 1.0 + mod.weight if getattr(mod, "gain", "gamma") == "centered" else mod.weight


def rms_norm(mod, x: torch.Tensor) -> torch.Tensor:
    """gamma * x / sqrt(mean(x^2) + eps)."""
    return gain(mod) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps)


def layer_norm(mod, x: torch.Tensor) -> torch.Tensor:
    """gamma * (x - mu) / sqrt(var + eps) + beta (biased variance)."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = gain(mod) * (x - mu) / torch.sqrt(var + mod.eps)
    return y + mod.bias if mod.bias is not None else y


def N(mod, x: torch.Tensor) -> torch.Tensor:
    """Apply a norm module's weights by hand. Fails loudly if the site holds no norm."""
    if type(mod).__name__ == "GatedNorm":  # marin's grug MoE: y * sigmoid(SiLU(y W_down) W_up), y = RMSNorm(x)
        y = rms_norm(mod, x)
        h = y @ mod.gate_down.T
        return y * torch.sigmoid((h * torch.sigmoid(h)) @ mod.gate_up.T)
    if type(mod).__name__ == "TaperNorm":  # Kanavalau et al. 2026: g gamma x / RMS(x) + (1 - g) c gamma~ x
        g = float(mod.gate)
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps)
        return g * mod.weight * x / rms + (1 - g) * mod.coeff * mod.taper_weight * x
    if isinstance(mod, torch.nn.RMSNorm):
        return rms_norm(mod, x)
    if isinstance(mod, torch.nn.LayerNorm):
        return layer_norm(mod, x)
    name = type(mod).__name__
    if name == "DyT":  # Zhu et al. 2025, eq. 1: gamma * tanh(alpha * x) + beta
        return gain(mod) * torch.tanh(mod.alpha * x) + (mod.bias if mod.bias is not None else 0.0)
    if name == "Derf":  # Chen et al. 2025: gamma * erf(alpha * x + s) + beta
        return gain(mod) * torch.erf(mod.alpha * x + mod.shift) + (mod.bias if mod.bias is not None else 0.0)
    if name == "SeeDNorm":  # Cai et al. 2025, eq. 3: [tanh(x beta^T) alpha + gamma] * x / RMS(x)
        d = x.shape[-1]
        rms = torch.sqrt((x * x).sum(-1, keepdim=True) / d + mod.eps)
        s = torch.tanh((x * mod.self_scale).sum(-1, keepdim=True))
        return (s * mod.dyn_gain + gain(mod)) * x / rms
    if name == "ScaleNorm":  # Nguyen & Salazar 2019, eq. 3: g * x / ||x||
        return mod.weight * x / torch.sqrt((x * x).sum(-1, keepdim=True) + mod.eps)
    if name == "L2Norm":  # x / ||x||, no gain
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + mod.eps)
    raise AssertionError(f"expected a norm at this site, found {type(mod).__name__}")


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, rotate-half convention: pairs (i, i + d/2) rotated by angle pos * theta^(-2i/d)."""
    t, d = x.shape[-2], x.shape[-1]
    pos = torch.arange(t, dtype=torch.float64)
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos[:, None] * freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mha(
    attn,
    x: torch.Tensor,
    inner: str,
    span: str = "head",
    theta: float = 10_000.0,
    qk_after_rope: bool = False,
    weights=None,
) -> torch.Tensor:
    """Zhuo eqs. 7, 35-40: Concat_i attn_#(Q_i, K_i, V_i) W_O with # = the letters in ``inner`` (q k v c);
    ``g``: the context times sigmoid(x W_theta) (Qiu et al. 2025 eq. 5, G1, elementwise); ``s``: head i's
    context times gamma_i (NormFormer eq. 3); ``qk_after_rope``: N(RoPE(q)), N(RoPE(k)) (Llama 4); ``weights``:
    the logits' normalization in place of the softmax, given the logits and the causal mask."""
    b, t, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim

    def proj(lin, norm, heads, letter):
        y = x @ lin.weight.T
        if letter in inner and span == "full":
            y = N(norm, y)
        y = y.view(b, t, heads, hd)
        if letter in inner and span == "head":
            y = N(norm, y)
        return y.transpose(1, 2)

    if qk_after_rope:
        q = N(attn.q_norm, rope(proj(attn.q_proj, None, h, "-"), theta))
        k = N(attn.k_norm, rope(proj(attn.k_proj, None, kv, "-"), theta))
    else:
        q = rope(proj(attn.q_proj, attn.q_norm, h, "q"), theta)
        k = rope(proj(attn.k_proj, attn.k_norm, kv, "k"), theta)
    v = proj(attn.v_proj, attn.v_norm, kv, "v")
    k = k.repeat_interleave(h // kv, dim=1)
    v = v.repeat_interleave(h // kv, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    p = weights(logits, mask) if weights else torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    ctx = (p @ v).transpose(1, 2)  # (b, t, h, hd)
    if "g" in inner:
        ctx = ctx * torch.sigmoid(x @ attn.gate_proj.weight.T).view(b, t, h, hd)
    if "c" in inner and span == "head":
        ctx = N(attn.context_norm, ctx)
    ctx = ctx.reshape(b, t, h * hd)
    if "c" in inner and span == "full":
        ctx = N(attn.context_norm, ctx)
    if "s" in inner:
        ctx = (ctx.view(b, t, h, hd) * attn.head_scale[:, None]).reshape(b, t, h * hd)
    return ctx @ attn.o_proj.weight.T


def swiglu(mlp, x: torch.Tensor, hidden_norm: bool = False) -> torch.Tensor:
    """W_down (silu(W_gate x) * W_up x); with ``hidden_norm``, W_down N(silu(W_gate x) * W_up x) (NormFormer)."""
    hid = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
    return (N(mlp.hidden_norm, hid) if hidden_norm else hid) @ mlp.down_proj.weight.T
