"""A model's evaluation results on disk (``eval.json``), and the one number per task that tables show.

``eval.json`` sits beside the model (a run directory, or an export folder): ``{task: {"metrics":
{name: value}, "stderr": {name: value}, "n", "num_fewshot", "limit", "step", "checkpoint",
"lm_eval", "evaluated_at", ...}}``, one entry per lm-eval task or group, merged over invocations.
"""

from __future__ import annotations

import json
from pathlib import Path

from normlab.data.corpus import DataError

EVAL_FILE = "eval.json"
# The metric a table shows for a task, in order of preference: accuracy (lm-eval's first metric of a
# multiple-choice task; acc_norm stays in eval.json and the report), exact match, bits per byte.
HEADLINE = ("acc", "acc_norm", "exact_match", "bits_per_byte", "word_perplexity")


def load_evals(folder: str | Path) -> dict[str, dict]:
    """The folder's eval.json, {} if there is none."""
    path = Path(folder) / EVAL_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err.msg}); delete it and evaluate again") from None
    return data if isinstance(data, dict) else {}


def headline(metrics: dict[str, float]) -> str | None:
    for name in HEADLINE:
        if name in metrics:
            return name
    return next(iter(metrics), None)


def headline_scores(evals: dict[str, dict]) -> dict[str, float]:
    """{"task metric (n=N)": value} with each task's headline metric and the items it rests on, in task
    order (a score from ``--limit 20`` says so wherever it is shown)."""
    out = {}
    for task, entry in evals.items():
        metrics = entry.get("metrics") or {}
        name = headline(metrics)
        if name is not None:
            n = entry.get("n")
            out[f"{task} {name}" + (f" (n={n})" if isinstance(n, int) else "")] = float(metrics[name])
    return out
