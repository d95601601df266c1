"""Documents and token files as the data layer reads them: a source's documents in order (each text file of a
file or folder, each JSONL record), their ids joined with end-of-text between documents (GPT-2's convention, as
`normlab data prepare` writes them), and memory-mapped token files checked against the vocabulary.

Below `prepare` (which writes token files) and `dataset` (which trains on them); imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from normlab.data.tokenizer import Tokenizer
from normlab.errors import DataError
from normlab.io import jsonl_records, read_utf8

TEXT_SUFFIXES = (".txt", ".md", ".text")


def _read_text(path: Path) -> str:
    return read_utf8(path)


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"folder {path} has no text files ({', '.join(TEXT_SUFFIXES)})")
        return files
    return [path]


def _jsonl_texts(path: Path, field: str) -> list[str]:
    texts = []
    for n, record in jsonl_records(path):  # streamed; a record over io.MAX_RECORD_BYTES is refused unread
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DataError(f"{path} line {n} has no string field {field!r} (use --text-field to pick another)")
        texts.append(record[field])
    if not any(t.strip() for t in texts):
        raise DataError(f"{path} has no text in field {field!r}")
    return texts


def load_bin(path: Path, dtype: str, vocab_size: int | None) -> np.ndarray:
    """A memory-mapped pre-tokenized file; every id must lie below ``vocab_size``."""
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"token dtype must be uint16 or uint32, got {dtype!r}")
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"{path} is empty; expected {dtype} token ids")
    if size % itemsize:
        raise DataError(f"{path} has {size} bytes, not a whole number of {dtype} tokens; wrong --token-dtype?")
    arr = np.memmap(path, dtype=dtype, mode="r")
    if vocab_size is not None:
        top = int(arr.max())
        if top >= vocab_size:
            where = int(np.argmax(arr >= vocab_size))
            raise DataError(
                f"{path}: token id {top} (first bad id at position {where}) is beyond the vocabulary "
                f"of {vocab_size}; set --vocab-size to at least {top + 1}"
            )
    return arr


def document_source(src: Path, text_field: str) -> tuple[list[Path], Callable[[], Iterable[str]]]:
    """(the files a BPE may be trained on, a function giving the documents in order): each JSONL
    record, or each text file of a file or folder. The documents are read only when asked for."""
    if src.suffix == ".jsonl":
        return [src], lambda: _jsonl_texts(src, text_field)
    files = _text_files(src)
    return files, lambda: (_read_text(f) for f in files)


def document_ids(tok: Tokenizer, docs: Iterable[str]) -> Iterator[list[int]]:
    """Each document's tokens, preceded by ``tok.eos_id`` from the second document on: end-of-text
    between consecutive documents, not after the last (a one-document corpus tokenizes exactly as
    its text does)."""
    for n, doc in enumerate(docs):
        yield ([tok.eos_id] if n else []) + tok.encode(doc)


def join_documents(tok: Tokenizer, docs: Iterable[str]) -> list[int]:
    """The whole document stream as one list of ids (`document_ids`, concatenated)."""
    return [i for ids in document_ids(tok, docs) for i in ids]
