"""`normlab data prepare`: text, JSONL or a local Hugging Face `datasets` folder -> token files.

    OUT/
    ├── train.bin        token ids (uint16 below 65,536 ids, else uint32), nanoGPT's format
    ├── val.bin          the last ``val_fraction`` of the documents (``val_split="tail"``), or the
    │                    documents whose text's SHA-256 falls in the first ``val_fraction`` of its
    │                    range (``"hash"``: a fixed sample from every part of a corpus); whole
    │                    documents either way, so validation measures text the model never saw
    ├── tokenizer.json   the tokenizer (a trained BPE or the given tokenizer.json; none for bytes)
    └── meta.json        tokenizer, vocab size, end-of-text id, dtype, documents and tokens per split,
                         source, SHA-256 of each .bin

Documents are tokenized one by one with the tokenizer's end-of-text id between consecutive
documents, exactly as `load_data` joins them, so ``--data OUT`` trains on the same stream as
``--data SOURCE``, only without tokenizing again. OUT is written whole or not at all (`normlab.io.staged_folder`:
a hidden sibling folder, renamed to OUT once complete; a prepare killed mid-way leaves no OUT, and the next one
removes what it left); an existing OUT with files in it is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from normlab.config.commands import VAL_SPLITS
from normlab.data.documents import document_ids, document_source, load_bin
from normlab.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from normlab.errors import DataError
from normlab.io import atomic_write_bytes, atomic_write_json, check_writable, staged_folder

META = "meta.json"


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file() and (path / "train.bin").is_file()


def _documents(src: Path, text_field: str) -> tuple[list[Path], Iterable[str]]:
    """(files a BPE may be trained on, the documents in order): a datasets folder's rows, else what
    `load_data` reads (`document_source`)."""
    if src.is_dir() and (
        (src / "dataset_info.json").is_file() or (src / "dataset_dict.json").is_file() or (src / "state.json").is_file()
    ):
        return [], _hf_dataset_texts(src, text_field)
    files, docs = document_source(src, text_field)
    return files, docs()


def _hf_dataset_texts(src: Path, field: str) -> Iterator[str]:
    """The ``field`` of every record of a folder written by `datasets`' save_to_disk (every split, in
    sorted split order for a DatasetDict)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{src} is a Hugging Face datasets folder: pip install datasets to read it") from None
    ds = datasets.load_from_disk(str(src))
    parts = [ds[k] for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [ds]
    for part in parts:
        if field not in part.column_names:
            raise DataError(f"{src}: no column {field!r} (columns: {', '.join(part.column_names)}); use --text-field")
        for text in part[field]:
            if isinstance(text, str) and text.strip():
                yield text


def hashed_to_val(text: str, val_fraction: float) -> bool:
    """The "hash" split: a document is held out when its text's SHA-256 falls in the first
    ``val_fraction`` of the hash range (independent of order; the same document always lands the same)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < val_fraction * 2.0**64


def prepare(
    source: str | Path,
    out: str | Path,
    tokenizer: str = "bytes",
    text_field: str = "text",
    val_fraction: float = 0.1,
    val_split: str = "tail",
) -> dict[str, Any]:
    """Tokenize ``source`` into ``out`` (see the module docstring); returns meta.json's content."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if val_split not in VAL_SPLITS:
        raise DataError(f"val_split must be one of {', '.join(VAL_SPLITS)}, got {val_split!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(
            f"{out} {'is a file' if not out.is_dir() else 'is not empty'}; nothing there is overwritten: "
            "give a new or empty folder"
        )
    check_writable(out, "the data folder")  # read-only storage: before the tokenizer is trained
    src = Path(source)  # a corpus name is resolved by the caller (normlab.data.corpora.source_path)
    if not src.exists():
        raise DataError(
            f"{src} does not exist; give a text file, a folder of text files, a .jsonl or a datasets "
            "folder (save_to_disk)"
        )
    files, docs = _documents(src, text_field)
    if tokenizer.startswith("bpe:") and not files:
        raise DataError("a BPE is trained on text files; for a datasets folder give a trained tokenizer.json or bytes")
    tok = load_tokenizer(tokenizer, files)
    texts = list(docs)
    if len(texts) < 2:
        raise DataError(
            f"{src} holds {len(texts)} document(s); a document-level split needs at least 2 "
            "(several files, JSONL records or dataset rows)"
        )
    if val_split == "hash":
        held = [hashed_to_val(t, val_fraction) for t in texts]
        if all(held) or not any(held):
            raise DataError(
                f"the hashed split of {len(texts)} documents at {val_fraction} leaves one side empty; "
                "use more documents, another --val-fraction, or --val-split tail"
            )
        parts = ([t for t, h in zip(texts, held) if not h], [t for t, h in zip(texts, held) if h])
    else:
        n_val = max(1, round(len(texts) * val_fraction))
        parts = (texts[: len(texts) - n_val], texts[len(texts) - n_val :])
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    meta: dict[str, Any] = {
        "source": str(src),
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "eos_token": tok.eos_token,
        "dtype": np.dtype(dtype).name,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "val_split": val_split,
    }
    with staged_folder(out, "data") as staging:  # whole or not at all: a killed prepare leaves no OUT to refuse
        for split, part in zip(("train", "val"), parts):
            n_tokens, digest = _write_tokens(staging / f"{split}.bin", tok, part, dtype)
            meta[split] = {"documents": len(part), "tokens": n_tokens, "sha256": digest}
        if hasattr(tok, "to_json"):
            atomic_write_bytes(staging / "tokenizer.json", tok.to_json().encode())
        atomic_write_json(staging / META, meta)
    return meta


def _write_tokens(path: Path, tok: Tokenizer, texts: list[str], dtype: type) -> tuple[int, str]:
    """Stream the documents' tokens (end-of-text between documents) into ``path``, atomically."""
    tmp = path.with_suffix(".bin.tmp")
    h, n = hashlib.sha256(), 0
    with tmp.open("wb") as f:
        for ids in document_ids(tok, texts):
            data = np.asarray(ids, dtype=dtype).tobytes()
            f.write(data)
            h.update(data)
            n += len(ids)
        f.flush()
    tmp.replace(path)
    return n, h.hexdigest()


def load_prepared(path: Path) -> tuple[np.ndarray, np.ndarray, Tokenizer | None, dict[str, Any]]:
    """(train ids, val ids, tokenizer, meta) of a prepared folder, memory-mapped."""
    try:
        meta = json.loads((path / META).read_text())
        vocab, dtype = int(meta["vocab_size"]), str(meta["dtype"])
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise DataError(f"{path / META} is not a normlab data prepare file ({err}); prepare the folder again") from None
    if not (path / "val.bin").is_file():
        raise DataError(f"{path} has train.bin but no val.bin; prepare the folder again")
    train, val = load_bin(path / "train.bin", dtype, vocab), load_bin(path / "val.bin", dtype, vocab)
    tok = (
        load_tokenizer(str(path / "tokenizer.json"))
        if (path / "tokenizer.json").is_file()
        else ByteTokenizer()
        if meta.get("tokenizer") == "bytes"
        else None
    )
    return train, val, tok, meta


def prepared_line(meta: dict[str, Any], out: str) -> str:
    """What `normlab data prepare` wrote, in one line."""
    return (
        f"{meta['source']} -> {out}: {meta['train']['documents']:,} + {meta['val']['documents']:,} documents, "
        f"{meta['train']['tokens']:,} train + {meta['val']['tokens']:,} val tokens ({meta['dtype']}), tokenizer "
        f"{meta['tokenizer']} (vocab {meta['vocab_size']}, end-of-text id {meta['eos_id']}); train with --data {out}"
    )
