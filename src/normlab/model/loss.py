"""The language-model loss, optionally in chunks so the float32 logits of a batch never exist at once.

    loss = CE(softcap(Head(h)), y)  +  z_loss * mean(logsumexp(logits)^2)        z-loss: PaLM (Chowdhery et al. 2022)

CE is the mean over the tokens whose target is not -100; the z-loss term is the mean over every
position (as the unchunked form computes it). With a vocabulary of 32k-100k the logits dominate
activation memory: at Kim's 400M shape (batch 8 x 2048 tokens, vocabulary 32,768) the float32
logits alone are 2 GiB, plus their bf16 copy and the gradient. ``chunk`` tokens at a time, each
chunk's logits are computed, reduced to three sums and dropped; the backward recomputes them
(`torch.utils.checkpoint`), which costs one more head matmul per chunk: 2 d V FLOPs per token, about
2.5% of a 400M model's 6N. The result equals the unchunked loss up to float summation order (tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from normlab.model.storage import NO_STORAGE


def logits_of(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    softcap: float | None,
    store: Callable[[torch.Tensor], torch.Tensor] = NO_STORAGE,
) -> torch.Tensor:
    """Head(h), soft-capped as in Gemma 2 when ``softcap`` is set, stored in the activation dtype
    (fp16 logits past 65504 are inf: a site where fp16 training overflows)."""
    logits = store(head(h))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _chunk_sums(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    y: torch.Tensor,
    softcap: float | None,
    with_z: bool,
    store: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits_of(head, h, softcap, store).float()
    ce = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    z = logits.logsumexp(-1).pow(2).sum() if with_z else torch.zeros((), device=h.device)
    return ce, z


def lm_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    z_loss: float = 0.0,
    chunk: int = 0,
    store: Callable[[torch.Tensor], torch.Tensor] = NO_STORAGE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, logits) from the final normed stream ``h`` (B, T, d); logits is None when chunked.

    ``chunk`` > 0 and fewer than B*T tokens: chunked as in the module docstring; else one pass.
    """
    n = h.shape[0] * h.shape[1]
    if chunk <= 0 or n <= chunk:
        logits = logits_of(head, h, softcap, store)
        flat = logits.flatten(0, 1).float()
        loss = F.cross_entropy(flat, targets.flatten(), ignore_index=-100)
        if z_loss:
            loss = loss + z_loss * flat.logsumexp(-1).pow(2).mean()
        return loss, logits
    hs, ys = h.flatten(0, 1), targets.flatten()
    ce = z = torch.zeros((), device=h.device)
    for i in range(0, n, chunk):
        c, zc = checkpoint(
            _chunk_sums, head, hs[i : i + chunk], ys[i : i + chunk], softcap, bool(z_loss), store, use_reentrant=False
        )
        ce, z = ce + c, z + zc
    loss = ce / (ys != -100).sum()  # F.cross_entropy's mean: NaN when every target is ignored, as there
    if z_loss:
        loss = loss + z_loss * z / n
    return loss, None
