"""The one number per task that tables show, from a model's evaluation results.

The results (``eval.json``, read and written through `normlab.runs.files.RunDir`) sit beside the
model (a run directory, or an export folder): ``{task: {"metrics": {name: value}, "stderr": {name:
value}, "n", "num_fewshot", "limit", "step", "checkpoint", "lm_eval", "evaluated_at", ...}}``, one
entry per lm-eval task or group, merged over invocations.
"""

from __future__ import annotations

# The metric a table shows for a task, in order of preference: accuracy (lm-eval's first metric of a
# multiple-choice task; acc_norm stays in eval.json and the report), exact match, bits per byte.
HEADLINE = ("acc", "acc_norm", "exact_match", "bits_per_byte", "word_perplexity")


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
