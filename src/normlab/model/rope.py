"""Rotary position embedding (Su et al. 2021) in the Llama / Hugging Face "rotate half" convention.

Written here because torch has no RoPE op; the convention matches transformers' Llama so that
exported weights give identical logits.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables(None)
        self.cos: torch.Tensor
        self.sin: torch.Tensor  # on the default device (meta when transformers builds the model)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        ar = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        inv_freq = 1.0 / (self.theta ** (ar / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
        return angles.cos().float(), angles.sin().float()

    def reset_tables(self) -> None:
        """Recompute the (non-persistent) tables, e.g. after a model was built on the meta device."""
        self.cos, self.sin = self._tables(self.cos.device if self.cos.device.type != "meta" else torch.device("cpu"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x of shape (B, H, T, head_dim), at positions 0..T-1 or at ``positions`` (B, T)."""
        if positions is None:
            t = x.shape[-2]
            if t > self.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds max_seq_len={self.max_seq_len}")
            cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        else:  # the model checked the positions once (normlab.model.decoding.check_positions)
            cos, sin = self.cos[positions][:, None].to(x.dtype), self.sin[positions][:, None].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
