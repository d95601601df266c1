"""Instruction data for supervised fine-tuning: JSONL prompt/response pairs, loss on responses only.

Each record `{"prompt": ..., "response": ...}` becomes the tokens of prompt + response, truncated
to seq_len + 1 and right-padded; the targets are the next tokens with every position whose target
is a prompt token or padding set to -100 (cross-entropy's ignore index). So the loss, and every
gradient, comes from response tokens only (the SFT stage of Kim et al. Table 1). Batches are drawn
as in pre-training: a pure function of (seed, step), so SFT runs resume exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from normlab.data.corpus import DataError
from normlab.data.tokenizer import Tokenizer
from normlab.io import jsonl_records

IGNORE = -100


@dataclass(frozen=True)
class Examples:
    """Fixed-length examples: inputs (N, seq_len) and masked targets (N, seq_len)."""

    inputs: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def response_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


def encode_pair(tok: Tokenizer, prompt: str, response: str, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of length seq_len; targets are -100 where the next token is prompt or padding.
    The response ends with the end-of-text token (learned, so that generation stops there); padding
    is the same token, never a target."""
    p, r = tok.encode(prompt), tok.encode(response) + [tok.eos_id]
    pad_id = tok.eos_id
    ids = (p + r)[: seq_len + 1]
    is_response = ([False] * len(p) + [True] * len(r))[: seq_len + 1]
    pad = seq_len + 1 - len(ids)
    ids, is_response = ids + [pad_id] * pad, is_response + [False] * pad
    x = np.asarray(ids[:-1], dtype=np.int64)
    y = np.where(np.asarray(is_response[1:]), np.asarray(ids[1:], dtype=np.int64), IGNORE)
    return x, y


def load_sft(
    path: Path,
    tok: Tokenizer,
    seq_len: int,
    val_fraction: float,
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> tuple[Examples, Examples]:
    """Train and validation examples (the last ``val_fraction`` of the records are validation)."""
    if not path.is_file():
        raise DataError(f"SFT data {path} is not a regular file; give a .jsonl file of prompt/response records")
    rows = []
    for n, rec in jsonl_records(path):  # streamed; a record over io.MAX_RECORD_BYTES is refused unread
        if not isinstance(rec, dict):
            raise DataError(
                f"{path}:{n}: an SFT record is a JSON object with string fields {prompt_field!r} and "
                f"{response_field!r}; found a {type(rec).__name__}"
            )
        if not isinstance(rec.get(prompt_field), str) or not isinstance(rec.get(response_field), str):
            raise DataError(
                f"{path}:{n}: an SFT record needs string fields {prompt_field!r} and {response_field!r}; "
                f"found {sorted(rec)}"
            )
        x, y = encode_pair(tok, rec[prompt_field], rec[response_field], seq_len)
        if (y != IGNORE).any():  # a record whose response was truncated away teaches nothing
            rows.append((x, y))
    n_val = max(1, int(len(rows) * val_fraction))
    if len(rows) - n_val < 1:
        raise DataError(
            f"{path} has {len(rows)} usable SFT records (with a response token within seq_len={seq_len}): "
            "too few to split into train and validation"
        )
    x, y = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    cut = len(rows) - n_val
    return Examples(x[:cut], y[:cut]), Examples(x[cut:], y[cut:])


@dataclass(frozen=True)
class SFTData:
    """The SFT counterpart of `TokenData`: the same interface the trainer uses."""

    train: Examples
    val: Examples
    vocab_size: int
    tokenizer: Tokenizer
    source: str

    def describe(self) -> str:
        return (
            f"{self.source} (SFT): {len(self.train):,} train + {len(self.val):,} val examples, "
            f"{self.train.response_tokens:,} train response tokens, vocab {self.vocab_size}"
        )

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sft_batch_at(self.train, step, batch_size, seed)

    def val_windows(self, n_batches: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return sft_val_batches(self.val, n_batches, batch_size)

    def unigram_loss(self) -> None:
        """No stalled rule for SFT: it starts from a trained model, far below any unigram loss."""
        return None


def load_sft_data(
    path: str,
    tokenizer: str,
    seq_len: int,
    val_fraction: float,
    prompt_field: str,
    response_field: str,
    vocab_size: int | None = None,
) -> SFTData:
    from normlab.data.tokenizer import load_tokenizer

    src = Path(path)
    if src.suffix != ".jsonl" or not src.is_file():
        raise DataError(
            f"SFT data must be a .jsonl file of {{{prompt_field!r}: ..., {response_field!r}: ...}} records; got {path}"
        )
    if tokenizer.startswith("bpe:"):
        raise DataError(
            "SFT continues a trained model: use its tokenizer (bytes, or the tokenizer.json it was trained with)"
        )
    tok = load_tokenizer(tokenizer)
    train, val = load_sft(src, tok, seq_len, val_fraction, prompt_field, response_field)
    vocab = max(tok.vocab_size, vocab_size or 0)
    return SFTData(train, val, vocab, tok, str(src))


def sft_batch_at(ex: Examples, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randint(0, len(ex), (batch_size,), generator=g).numpy()
    return torch.from_numpy(ex.inputs[idx]), torch.from_numpy(ex.targets[idx])


def sft_val_batches(ex: Examples, n_batches: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = min(len(ex), n_batches * batch_size)
    x, y = torch.from_numpy(ex.inputs[:n]), torch.from_numpy(ex.targets[:n])
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
