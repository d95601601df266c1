"""Run directories as data: probe rows on disk, and `load_run` to read a run back.

``probes.jsonl`` holds one JSON object per row: ``{"step", "layer", "site", "metric", "value"}``
(layer is null for model-level rows; see `normlab.diagnostics.probes` for every site and metric).
`load_run(path)` returns a `Run` with pandas DataFrames: ``metrics`` (one row per optimizer step),
``probes`` (the tidy rows) and the ``config`` and ``summary`` dictionaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from normlab.evaluation.results import load_evals
from normlab.io import read_jsonl, truncate_jsonl


class ProbeWriter:
    """Appends probe rows; on resume, rows at or after the resumed step are dropped first."""

    def __init__(self, path: Path, start_step: int) -> None:
        self.path = path
        truncate_jsonl(path, start_step)
        self.file = path.open("a", buffering=1)

    def write(self, rows: list[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in rows))

    def close(self) -> None:
        self.file.close()


def probe_series(path: Path, site: str, metric: str, layer: int | None = None) -> list[tuple[int, float]]:
    """(step, value) of one site and metric from a probes.jsonl, without pandas (summaries of many runs)."""
    return [(r["step"], r["value"]) for r in read_jsonl(path)
            if r.get("site") == site and r.get("metric") == metric and r.get("layer") == layer]


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: pd.DataFrame
    probes: pd.DataFrame
    evals: dict[str, dict] = field(default_factory=dict)  # eval.json (normlab eval), {} if not evaluated

    @property
    def name(self) -> str:
        cfg = self.config.get("config", {})
        return cfg.get("layout") or self.path.name

    def probe(self, site: str, metric: str) -> pd.DataFrame:
        """Rows of one site and metric as a step x layer table."""
        df = self.probes[(self.probes.site == site) & (self.probes.metric == metric)]
        return df.pivot_table(index="step", columns="layer", values="value", dropna=False) if len(df) else df


def load_run(path: str | Path) -> Run:
    p = Path(path)
    if not (p / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{p} is not a normlab run directory (no metrics.jsonl)")
    config = json.loads((p / "config.json").read_text()) if (p / "config.json").exists() else {}
    summary = json.loads((p / "summary.json").read_text()) if (p / "summary.json").exists() else {}
    metrics = pd.DataFrame(read_jsonl(p / "metrics.jsonl"))
    probes = pd.DataFrame(read_jsonl(p / "probes.jsonl"), columns=["step", "layer", "site", "metric", "value"])
    probes["layer"] = probes["layer"].astype("Int64")
    return Run(path=p, config=config, summary=summary, metrics=metrics, probes=probes, evals=load_evals(p))
