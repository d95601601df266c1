"""Loaders for normlab's local lm-evaluation-harness tasks: the JSONL files beside this file, read
without a dataset hub (lm-eval's `custom_dataset`), so the tasks work from any directory offline."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

HERE = Path(__file__).parent


def _load(name: str) -> datasets.DatasetDict:
    import datasets

    rows = [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def next_line(**_: Any) -> datasets.DatasetDict:
    return _load("next_line")


def speaker(**_: Any) -> datasets.DatasetDict:
    return _load("speaker")


def passages(**_: Any) -> datasets.DatasetDict:
    return _load("passages")


def passage_results(doc: dict[str, Any], results: list[float]) -> dict[str, tuple[float, int]]:
    """Rolling log-likelihood -> word and byte perplexity, bits per byte (wikitext's definitions)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    n_bytes = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }
