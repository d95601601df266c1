"""Parametrizations: how init scales, per-parameter learning rates and the forward's multipliers change with
width and depth, so that a small proxy's best learning rate carries to a wider or deeper model.

- `sp`: nothing changes: the scheme's own stds and one learning rate (normlab's default, every paper's).
- `mup` (Yang et al. 2022, Tensor Programs V, Table 3; PyPI `mup` 1.0.0): hidden matrices get init std /
  sqrt(m_in), Adam lr / m_in and weight decay x m_in; logits are W (h / m) with W's std held at the base's;
  attention's q.k is scaled sqrt(d_head,base) / d_head (muP's 1/d law, equal to SP at the base).
- `completep` (Dey et al. 2025, CompleteP, arXiv 2505.01618, Table 1; the authors' EleutherAI/nanoGPT-mup,
  branch completep): muP, and each residual branch times r^-alpha (alpha = 1 by default), the blocks' parameters'
  Adam lr x r^(alpha - 1), AdamW's epsilon x m^-1 r^-alpha; init independent of depth.

Every multiplier is 1 at the base shape (`base_d_model`, `base_n_layers`; none: the model's own), so a proxy
trained at its base shape is the SP model, and the learning rate found there is the one to use at m, r > 1.

Which parameters are "hidden matrices" is decided as `mup.set_base_shapes` decides it: the model is compared
with its base model (same depth, base width; built on the meta device), parameter by parameter; a dimension
that differs is infinite. Two infinite dimensions: matrix-like (init / sqrt(fan-in mult), lr / fan-in mult, weight
decay x fan-in mult, as `mup.MuAdamW`); one or none: vector-like (embeddings, the head, gains, biases: unchanged).
tests/unit/test_parametrization.py checks these numbers against `mup` 1.0.0 itself.

The mup package's one difference: with tied embeddings its `MuSharedReadout` multiplies the shared matrix by
sqrt(m) at init (it converts an SP readout init); normlab draws the embedding at its base std (muP's input
weights, constant in width) and only divides the logits' input by m.

Muon (torch.optim.Muon): its orthogonalized update has unit singular values and its "original" lr rule scales
each matrix by sqrt(max(1, fan_out / fan_in)), a ratio width leaves fixed, so the spectral condition of muP
(Yang, Simon & Bernstein 2023) holds with no width factor on Muon's matrices; under "match_rms_adamw" (lr x 0.2
sqrt(max(A, B)), Adam's update RMS) Muon's matrices take Adam's 1/m. The AdamW half of MuonAdamW (embeddings, head,
gains) follows the vector-like rule.

Placements: a norm gain is vector-like (lr unchanged). Peri-LN's output norm N_B(f(u)) returns unit-RMS updates
whatever the branch's scale, so muP's init and lr on the branch's matrices change what the branch computes but
not the size of the update; CompleteP's r^-alpha on N_B's output is what sets the update's size there (its gain,
learned, can grow it back). Refused, with the reason (`problem`): nGPT (its own scales s_qk, s_uv, s_z and
eigen learning rates set every width factor; the stream lives on the sphere), and under CompleteP the layouts
that already scale the residual with depth or renormalize it after the add: DeepNorm/Admin's skip scale alpha,
LayerNorm Scaling, a residual scale h or a learned one (ReZero, LayerScale), after-add norms (Post-LN, C sites:
the stream is renormalized every block, which the depth theory does not model), and hyper-connections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from normlab.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from normlab.layout.sites import ResolvedLayout
    from normlab.model.config import ModelConfig

PARAMETRIZATIONS: dict[str, str] = {
    "sp": "standard: the init scheme's stds and one learning rate, as every paper trained",
    "mup": "muP (Yang et al. 2022, Tensor Programs V): width transfer; base shape model.base_d_model",
    "completep": "CompleteP (Dey et al. 2025): muP and depth transfer, branches x (L/L_base)^-alpha",
}


def width_mult(cfg: ModelConfig) -> float:
    """m = d_model / base_d_model (1 under SP or without a base width)."""
    if cfg.parametrization == "sp" or cfg.base_d_model is None:
        return 1.0
    return cfg.d_model / cfg.base_d_model


def depth_mult(cfg: ModelConfig) -> float:
    """r = n_layers / base_n_layers (1 unless CompleteP with a base depth)."""
    if cfg.parametrization != "completep" or cfg.base_n_layers is None:
        return 1.0
    return cfg.n_layers / cfg.base_n_layers


def _scaled(value: int, num: int, den: int, what: str) -> int:
    if (value * num) % den:
        raise ConfigError(
            f"the base shape is not a whole model: {what} {value} x {num}/{den} is not an integer; choose "
            f"model.base_d_model so that d_model / base_d_model divides {what}"
        )
    return value * num // den


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The base-width model of ``cfg`` at its own depth: d_model, the MLP's and experts' widths scaled by
    1/m; the heads' width scaled when it follows d_model, else (an explicit d_head, as Qwen 3's) the head count."""
    if cfg.parametrization == "sp" or cfg.base_d_model is None or cfg.base_d_model == cfg.d_model:
        return cfg
    b, d = cfg.base_d_model, cfg.d_model
    changes: dict[str, int | None] = {"d_model": b, "d_ff": _scaled(cfg.ffn_dim, b, d, "the MLP width d_ff")}
    if cfg.expert_d_ff is not None:
        changes["expert_d_ff"] = _scaled(cfg.expert_d_ff, b, d, "expert_d_ff")
    if cfg.d_head is not None:
        changes["n_heads"] = _scaled(cfg.n_heads, b, d, "n_heads")
        if cfg.n_kv_heads is not None:
            changes["n_kv_heads"] = _scaled(cfg.n_kv_heads, b, d, "n_kv_heads")
    return cfg.with_(**changes)


def attention_scale(cfg: ModelConfig, head_dim: int) -> float | None:
    """The q.k scale: None (SDPA's 1/sqrt(d_head)) or Gemma's attn_scale^-1/2 under SP; muP's 1/d_head law,
    equal to SP's scale at the base head width: s_base * d_head,base / d_head."""
    sp = cfg.attn_scale**-0.5 if cfg.attn_scale is not None else None
    if width_mult(cfg) == 1.0:
        return sp
    base = base_config(cfg).head_dim
    if base == head_dim:
        return sp
    s_base = sp if sp is not None else base**-0.5
    return s_base * base / head_dim


def output_multiplier(cfg: ModelConfig) -> float:
    """muP's readout: logits = W (h / m) (the `mup` package's MuReadout, output_mult 1)."""
    return 1.0 / width_mult(cfg)


def branch_multiplier(cfg: ModelConfig) -> float:
    """CompleteP's residual branch multiplier r^-alpha (Dey et al. 2025, eq. 2: x + L^-alpha F(x), relative to
    the base depth)."""
    return depth_mult(cfg) ** -cfg.completep_alpha


def adam_eps_multiplier(cfg: ModelConfig) -> float:
    """CompleteP's AdamW epsilon: eps x m^-1 x r^-alpha (the authors' nanoGPT-mup, branch completep); 1 otherwise."""
    if cfg.parametrization != "completep":
        return 1.0
    return 1.0 / width_mult(cfg) * depth_mult(cfg) ** -cfg.completep_alpha


def problem(cfg: ModelConfig, resolved: ResolvedLayout) -> str | None:
    """Why this parametrization does not combine with this layout, or None."""
    if cfg.parametrization == "sp":
        return None
    layout = resolved.layout
    if layout.ngpt:
        return (
            f"parametrization={cfg.parametrization} does not combine with ngpt: nGPT sets its own width factors "
            "(s_qk, s_uv, s_z and the eigen learning rates) and keeps the stream on the sphere; use parametrization=sp"
        )
    if cfg.parametrization != "completep":
        return None
    reasons = []
    if layout.alpha != 1.0:
        reasons.append(f"a skip scale alpha={layout.alpha} (DeepNorm/Admin scale the residual with depth already)")
    if layout.ln_scaling:
        reasons.append("LayerNorm Scaling (a 1/sqrt(l) depth scale already)")
    if layout.h != 1.0 or layout.h_learned is not None:
        reasons.append("a residual scale h (fixed or learned: ReZero, LayerScale) beside CompleteP's own")
    if layout.streams > 1:
        reasons.append("hyper-connections (their mixing maps, not one residual sum)")
    if any(s.after_add for b in resolved.blocks for s in (b.attn, b.mlp)):
        reasons.append("after-add norms (C: the stream is renormalized every block, which CompleteP does not model)")
    if reasons:
        return (
            "parametrization=completep scales each residual branch by (L/L_base)^-alpha and does not combine with "
            + "; ".join(reasons)
            + "; use parametrization=mup (width only) or a pre-norm layout"
        )
    return None


@dataclass(frozen=True)
class ParamScale:
    """One parameter's factors against SP: init std, learning rate, weight decay; and whether it is matrix-like
    (two width-infinite dimensions) and its fan-in width multiplier."""

    init: float = 1.0
    lr: float = 1.0
    weight_decay: float = 1.0
    matrix_like: bool = False
    fan_in_mult: float = 1.0


def base_model(cfg: ModelConfig, resolved: ResolvedLayout) -> nn.Module:
    """The base-width model at this depth on the meta device (its shapes only: no memory, no init)."""
    import torch

    from normlab.model.lm import NormLM

    with torch.device("meta"):
        return NormLM(base_config(cfg), resolved)


def param_scales(
    model: nn.Module, muon_matrices: set[int] | None = None, muon_rule: str = "original"
) -> dict[str, ParamScale]:
    """Each parameter's factors against SP, by name: `mup.MuAdamW`'s width rule for Adam (and the AdamW half of
    Muon), Muon's own rule for ``muon_matrices`` (ids), CompleteP's depth factor on the blocks' parameters. The
    init factor is the width part only; `normlab.model.init` adds the scheme's ratio of base to actual std."""
    cfg = model.config
    scales: dict[str, ParamScale] = {}
    if cfg.parametrization == "sp":
        return {name: ParamScale() for name, _ in model.named_parameters()}
    base = dict(base_model(cfg, model.resolved).named_parameters())
    r = depth_mult(cfg)
    depth_lr = r ** (cfg.completep_alpha - 1.0) if cfg.parametrization == "completep" else 1.0
    muon = muon_matrices or set()
    for name, p in model.named_parameters():
        shape, b = tuple(p.shape), tuple(base[name].shape)
        inf = [i for i, (x, y) in enumerate(zip(shape, b)) if x != y]
        matrix = len(inf) >= 2
        # mup's InfShape: the width multiplier of the last infinite dimension (a Linear's fan-in)
        mult = shape[inf[-1]] / b[inf[-1]] if inf else 1.0
        hidden = name.startswith("blocks.")
        lr = depth_lr if hidden else 1.0
        wd = 1.0
        if matrix:
            if id(p) in muon and muon_rule == "original":
                pass  # Muon's own sqrt(fan_out / fan_in): width-invariant (module docstring)
            else:
                lr, wd = lr / mult, wd * mult
        scales[name] = ParamScale(
            init=mult**-0.5 if matrix else 1.0, lr=lr, weight_decay=wd, matrix_like=matrix, fan_in_mult=mult
        )
    return scales
