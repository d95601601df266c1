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
LayerNorm Scaling, a residual scale h or a learned one (ReZero, LayerScale), after-add norms (Post-LN, C sites)
and HybridNorm's normed skip N(x) + F(N(x)) (both renormalize the stream every block, which the depth theory does
not model), and hyper-connections. A base shape wider or deeper than the model (m < 1 or r < 1) is refused too:
the transfer runs from the base to wider and deeper models, and below the base the factors would raise the
hidden matrices' learning rate (muP: x 1/m) and the branches (CompleteP: x r^-alpha) above SP's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from torch import nn

    from normlab.model.config import ModelConfig

PARAMETRIZATIONS: dict[str, str] = {
    "sp": "standard: the init scheme's stds and one learning rate, as every paper trained",
    "mup": "muP (Yang et al. 2022, Tensor Programs V): width transfer; base shape model.base_d_model",
    "completep": "CompleteP (Dey et al. 2025): muP and depth transfer, branches x (L/L_base)^-alpha",
}
# The numbers that depend on the configuration alone (the base shape, m and r, the forward's multipliers, the
# refusals) are ModelConfig's methods (normlab.model.config), which validates them when a config is made; this
# module holds what needs the model's parameters.


@dataclass(frozen=True)
class ParamScale:
    """One parameter's factors against SP: init std, learning rate, weight decay; and whether it is matrix-like
    (two width-infinite dimensions) and its fan-in width multiplier."""

    init: float = 1.0
    lr: float = 1.0
    weight_decay: float = 1.0
    matrix_like: bool = False
    fan_in_mult: float = 1.0


def base_model(model: nn.Module) -> nn.Module:
    """``model``'s base-width twin at its depth, on the meta device (its shapes only: no memory, no init)."""
    import torch

    with torch.device("meta"):
        return type(model)(cast("ModelConfig", model.config).base_config(), model.resolved)


def param_scales(
    model: nn.Module, muon_matrices: set[int] | None = None, muon_rule: str = "original"
) -> dict[str, ParamScale]:
    """Each parameter's factors against SP, by name: `mup.MuAdamW`'s width rule for Adam (and the AdamW half of
    Muon), Muon's own rule for ``muon_matrices`` (ids), CompleteP's depth factor on the blocks' parameters. The
    init factor is the width part only; `normlab.model.init` adds the scheme's ratio of base to actual std."""
    cfg = cast("ModelConfig", model.config)
    scales: dict[str, ParamScale] = {}
    if cfg.parametrization == "sp":
        return {name: ParamScale() for name, _ in model.named_parameters()}
    base = dict(base_model(model).named_parameters())
    r = cfg.depth_mult
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
