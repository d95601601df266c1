"""Tokenizers: raw bytes, a byte-level BPE trained with Hugging Face `tokenizers` and cached, or
any tokenizer saved as ``tokenizer.json`` in a local directory (a Hugging Face checkpoint's).

Spec strings: ``bytes`` | ``bpe:VOCAB`` (e.g. ``bpe:4096``) | a path to a directory or file.

Every tokenizer has an end-of-text token (``eos_id``), written between documents in the token data
and set as bos/eos/pad in exports, so that generation stops and evaluation harnesses have a prefix:

- bytes: byte 0 (NUL) is reserved as end-of-text, so the vocabulary stays 256 and every other byte
  is its own id; text with a NUL byte is refused (text files never hold one);
- a BPE we train: ``<|endoftext|>`` is the trainer's first special token, id 0;
- a local tokenizer.json: its own end-of-text token if it has one (GPT-2's ``<|endoftext|>``,
  Llama's ``</s>`` / ``<|end_of_text|>``, ...), else ``<|endoftext|>`` is added after its vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from normlab.data.corpus import DataError, cache_dir
from normlab.io import read_json, read_utf8

EOT = "<|endoftext|>"
# end-of-text tokens of well-known tokenizers, in the order they are looked for
KNOWN_EOS = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int  # the end-of-text token: between documents, bos/eos/pad in exports
    eos_token: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train (nanoGPT's char-level habit)."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0  # NUL, reserved as end-of-text
    eos_token = EOT

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        nul = data.find(0)
        if nul >= 0:
            raise DataError(f"text has a NUL byte at offset {nul}: the byte tokenizer reserves byte 0 as end-of-text")
        return list(data)

    def decode(self, ids: list[int]) -> str:
        """Bytes as UTF-8; the end-of-text id as ``<|endoftext|>``."""
        parts = bytes(ids).split(b"\x00")
        return self.eos_token.join(p.decode("utf-8", errors="replace") for p in parts)


class HFTokenizer:
    """A `tokenizers.Tokenizer` (BPE we trained, or a local tokenizer.json)."""

    def __init__(self, tok, name: str) -> None:  # noqa: ANN001 - tokenizers.Tokenizer
        self._tok, self.name = tok, name
        self.eos_token = _find_or_add_eos(tok)
        self.eos_id = tok.token_to_id(self.eos_token)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _find_or_add_eos(tok) -> str:  # noqa: ANN001 - tokenizers.Tokenizer
    """The tokenizer's end-of-text token; ``<|endoftext|>`` added as a special token if it has none."""
    from tokenizers import AddedToken

    for name in KNOWN_EOS:
        if tok.token_to_id(name) is not None:
            return name
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    return EOT


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def train_bpe(files: list[Path], vocab_size: int) -> HFTokenizer:
    """Train (or load from cache) a byte-level BPE on ``files`` with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"a byte-level BPE needs vocab_size > 256 (the byte alphabet), got {vocab_size}")
    # "eot": the end-of-text token is id 0 (tokenizers trained before it existed had no special token)
    path = cache_dir() / "tokenizers" / f"bpe-eot-{vocab_size}-{_fingerprint(files)}.json"
    if path.exists():
        return HFTokenizer(Tokenizer.from_file(str(path)), f"bpe:{vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[EOT],
    )
    try:
        tok.train([str(f) for f in files], trainer)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception (e.g. not UTF-8)
        for f in files:
            read_utf8(f)  # the file it could not read, named with the offset
        raise DataError(
            f"training a BPE on {len(files)} file(s) failed: {' '.join(str(err).split())[:200]}; give UTF-8 text files"
        ) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return HFTokenizer(tok, f"bpe:{vocab_size}")


# text with what trips a tokenizer: letters beyond its vocabulary, digits, accents, CJK, an emoji, tabs
PROBE_TEXT = "The quick brown fox, 1905: na\u00efve \u00fcber \u6f22\u5b57 \U0001f642\n\tdef f(x): return x"


def read_tokenizer_json(file: Path):  # noqa: ANN201 - tokenizers.Tokenizer
    """A tokenizer.json as a `tokenizers.Tokenizer`, or a DataError: the one rule for a tokenizer file
    normlab did not write (`--tokenizer`, `doctor`, `scan`). It must be UTF-8 JSON nested a few levels,
    a tokenizer the library reads, and encode text (a vocabulary without its own unknown token cannot)."""
    from tokenizers import Tokenizer

    read_json(file)
    valid = "give bytes, bpe:VOCAB, or a tokenizer.json written by tokenizers/transformers"
    try:
        loaded = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise DataError(
            f"{file} is not a Hugging Face tokenizer.json ({' '.join(str(err).split())[:200]}); {valid}"
        ) from None
    try:
        loaded.encode(PROBE_TEXT)
    except Exception as err:  # noqa: BLE001 - e.g. "WordLevel error: Missing [UNK] token from the vocabulary"
        raise DataError(
            f"{file} cannot encode text ({' '.join(str(err).split())[:200]}); a tokenizer's vocabulary "
            f"holds the unknown token it names; {valid}"
        ) from None
    return loaded


def load_tokenizer(spec: str, corpus_files: list[Path] | None = None) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise DataError(f"tokenizer {spec!r}: expected bpe:VOCAB_SIZE, e.g. bpe:4096") from None
        if not corpus_files:
            raise DataError("a BPE tokenizer is trained on text files; this data source has none")
        return train_bpe(corpus_files, vocab)
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file():
        return HFTokenizer(read_tokenizer_json(file), str(path))
    raise DataError(
        f"unknown tokenizer {spec!r}: valid are 'bytes', 'bpe:VOCAB' (e.g. bpe:4096), or a local "
        "directory/file with a Hugging Face tokenizer.json"
    )
