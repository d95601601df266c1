"""Loaders for normlab's local lm-evaluation-harness tasks: the JSONL files beside this file, read
without a dataset hub (lm-eval's `custom_dataset`), so the tasks work from any directory offline."""

import json
import re
from pathlib import Path

HERE = Path(__file__).parent


def _load(name):
    import datasets

    rows = [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def next_line(**_):
    return _load("next_line")


def speaker(**_):
    return _load("speaker")


def passages(**_):
    return _load("passages")


def passage_results(doc, results):
    """Rolling log-likelihood -> word and byte perplexity, bits per byte (wikitext's definitions)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    n_bytes = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }
