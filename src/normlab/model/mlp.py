"""The MLP sublayer: SwiGLU (Llama 3, Kim and Zhuo's models), and GELU / ReLU two-layer MLPs
(the ReLU form is the one Kim et al. Prop. 3.1 analyses: a = ReLU(x W1 + b1) W2 + b2), with an
optional norm on the hidden activation before W2 (NormFormer's FFN LN, layout site H)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.config import ModelConfig
from normlab.model.storage import NO_STORAGE, Storage

GATED = ("swiglu", "geglu-tanh")  # act(x W_gate) * (x W_up); geglu-tanh is Gemma's


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's "gelu_new")."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    store: Storage = NO_STORAGE  # the activation dtype of the hidden (normlab.model.storage)

    def __init__(self, cfg: ModelConfig, hidden_norm: nn.Module | None = None, ngpt: bool = False) -> None:
        super().__init__()
        # NormFormer's norm on the hidden activation (layout site H), nn.Identity where off
        self.hidden_norm = hidden_norm if hidden_norm is not None else nn.Identity()
        d, ff, bias = cfg.d_model, cfg.ffn_dim, cfg.linear_bias
        self.kind = cfg.mlp
        self.gate_proj = nn.Linear(d, ff, bias=bias) if cfg.mlp in GATED else None
        self.up_proj = nn.Linear(d, ff, bias=bias)
        self.down_proj = nn.Linear(ff, d, bias=bias)
        # nGPT's s_u, s_v (Loshchilov et al. 2024 eqs. 19-20; normlab.model.sphere): u, v scaled by suv * sqrt(d)
        self.suv = nn.Parameter(torch.ones(2 * ff)) if ngpt else None
        self.sqrt_d = d**0.5
        activations: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "swiglu": F.silu,
            "geglu-tanh": _gelu_tanh,
            "gelu": F.gelu,
            "gelu-tanh": _gelu_tanh,
            "relu": F.relu,
        }
        self.act = activations[cfg.mlp]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activation h fed to the last projection W2 (Kim Prop. 3.1's h), after the hidden norm H
        where the layout has one (NormFormer: W2 N(act(x W1)))."""
        if self.suv is not None:  # nGPT: u * SiLU(v), u = s_u sqrt(d) W_u h, v = s_v sqrt(d) W_v h (the authors' code)
            assert self.gate_proj is not None  # nGPT's MLP is SwiGLU (ModelConfig.layout_problem)
            s_u, s_v = (self.suv * self.sqrt_d).to(x.dtype).chunk(2)
            h = self.store(self.act(s_v * self.gate_proj(x)) * (s_u * self.up_proj(x)))
        elif self.gate_proj is not None:
            h = self.store(self.act(self.gate_proj(x)) * self.up_proj(x))
        else:
            h = self.store(self.act(self.up_proj(x)))
        return h if isinstance(self.hidden_norm, nn.Identity) else self.store(self.hidden_norm(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))
