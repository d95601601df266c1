"""What an incremental or padded forward adds to plain causal attention: positions, a mask, a KV cache.

Training runs full, unpadded windows: causal attention with SDPA's ``is_causal`` and positions
0..T-1, and nothing here is used. Generation and batched evaluation (transformers' ``generate``,
lm-evaluation-harness) need three more things, computed once per forward by `make_decoding` and
passed to every attention layer:

- positions (B, T): where each new token sits in its own sequence. With left padding, the first real
  token is position 0 (``cumsum(attention_mask) - 1``, as transformers' Llama does), so a padded
  row computes exactly what the unpadded sequence computes;
- a boolean mask (B, 1, T, past + T), True where a query may attend: key j <= query i (causal over
  the cached and new keys) and key j is not padding. Every query also sees itself, so a padding
  query's row is never empty (its output is discarded; an empty row would give NaN);
- a cache with ``update(k, v, layer_idx) -> (all keys, all values)`` (transformers' `DynamicCache`
  has exactly this method): keys are stored after RoPE, so cached keys are never rotated again.

The mask is None when plain attention is exact: no padding and either no past (``is_causal``) or
a single query (it sees every key), so unpadded decoding keeps the fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def check_positions(positions: torch.Tensor, max_seq_len: int) -> None:
    """Refuse positions at or past ``max_seq_len`` (the RoPE tables and learned positions end there).

    Checked once per forward, by the model, not in every layer. On a GPU the check is asserted on the
    device (`torch._assert_async`): reading the maximum back would make the host wait for the GPU at
    every generated token. On a CPU, where a read costs nothing, the error names the position.
    """
    if not positions.numel():
        return
    if positions.device.type == "cpu":
        top = int(positions.max())
        if top >= max_seq_len:
            raise ValueError(f"position {top} is beyond max_seq_len={max_seq_len}")
    else:
        torch._assert_async(positions.max() < max_seq_len, f"a position is beyond max_seq_len={max_seq_len}")


@dataclass
class Decoding:
    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor | None  # (B or 1, 1, T, past + T) bool; None: causal when past == 0, else all keys
    cache: Any = None  # update(k, v, layer_idx) -> (k_all, v_all); None: nothing is kept
    past: int = 0  # tokens already in the cache


def make_decoding(
    batch: int,
    t: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    positions: torch.Tensor | None = None,
) -> Decoding:
    """The `Decoding` of a forward over ``t`` new tokens per row.

    ``attention_mask``: transformers' 2-D mask (B, past + t), 1 for real tokens and 0 for padding,
    covering the cached tokens too. ``positions``: (B, t), if the caller has them (``position_ids``);
    else from the mask, else past..past+t-1.
    """
    past = int(cache.get_seq_length()) if cache is not None else 0
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, past + t):
            raise ValueError(
                f"attention_mask must be (batch, past + new tokens) = ({batch}, {past + t}), "
                f"got {tuple(attention_mask.shape)}"
            )
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    if positions is None:
        if attention_mask is not None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        else:
            positions = torch.arange(past, past + t, device=device).expand(batch, t)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (past == 0 or t == 1):
        return Decoding(positions.to(device), None, cache, past)
    query = torch.arange(past, past + t, device=device)[:, None]
    key = torch.arange(past + t, device=device)[None, :]
    mask = (key <= query)[None, None]
    if padded and attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :]
    mask = mask | (key == query)[None, None]
    return Decoding(positions.to(device), mask, cache, past)
