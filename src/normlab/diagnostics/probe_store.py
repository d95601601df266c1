"""Run directories as data: the probe rows a run writes, and `load_run` to read a run back (through
`normlab.runs.files.RunDir`).

``probes.jsonl`` holds one JSON object per row: ``{"step", "layer", "site", "metric", "value"}``
(layer is null for model-level rows; see `normlab.diagnostics.probes` for every site and metric).
`load_run(path)` returns a `Run` with pandas DataFrames: ``metrics`` (one row per optimizer step),
``probes`` (the tidy rows), ``layers`` (the per-step tier, ``layers.jsonl``, as tidy rows step, layer, head,
metric, value) and the ``config`` and ``summary`` dictionaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from normlab.io import truncate_jsonl
from normlab.runs.files import RunDir
from normlab.runs.summary import RunSummary

if TYPE_CHECKING:
    import pandas as pd
# pandas is imported where a run is read, not here: a training run writes probe rows through this module
# and never needs it (0.4 s at every start of a run)

TIER_COLUMNS = ["step", "layer", "head", "metric", "value"]


class ProbeRow(TypedDict):
    """One row of probes.jsonl: a metric of a site at a layer (None: model-level) and a step
    (`normlab.diagnostics.probes` lists every site and metric)."""

    step: int
    layer: int | None
    site: str
    metric: str
    value: float


def _no_tier() -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(columns=TIER_COLUMNS)


class ProbeWriter:
    """Appends probe rows; on resume, rows at or after the resumed step are dropped first."""

    def __init__(self, path: Path, start_step: int) -> None:
        self.path = path
        truncate_jsonl(path, start_step)
        self.file = path.open("a", buffering=1)

    def write(self, rows: list[ProbeRow]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in rows))

    def close(self) -> None:
        self.file.close()


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: RunSummary  # summary.json (RunSummary() where the run wrote none)
    metrics: pd.DataFrame
    probes: pd.DataFrame
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # eval.json (normlab eval), {} if not evaluated
    layers: pd.DataFrame = field(default_factory=_no_tier)

    def layer_series(self, metric: str) -> pd.DataFrame:
        """One metric of the per-step tier as a step x layer table (a per-head metric: its maximum over heads)."""
        df = self.layers[self.layers.metric == metric]
        return df.pivot_table(index="step", columns="layer", values="value", aggfunc="max") if len(df) else df

    @property
    def name(self) -> str:
        cfg = self.config.get("config", {})  # a run's TrainConfig (nested) or a monitor's record (flat)
        return cfg.get("layout") or (cfg.get("model") or {}).get("layout") or self.path.name

    def probe(self, site: str, metric: str) -> pd.DataFrame:
        """Rows of one site and metric as a step x layer table."""
        df = self.probes[(self.probes.site == site) & (self.probes.metric == metric)]
        return df.pivot_table(index="step", columns="layer", values="value", dropna=False) if len(df) else df


def load_run(path: str | Path) -> Run:
    import pandas as pd

    run = RunDir(path)
    if not run.has_metrics():
        raise FileNotFoundError(f"{run.path} is not a normlab run directory (no {run.metrics_file.name})")
    metrics = pd.DataFrame(run.metrics())
    probes = pd.DataFrame(run.probes(), columns=["step", "layer", "site", "metric", "value"])
    probes["layer"] = probes["layer"].astype("Int64")
    return Run(
        path=run.path,
        config=run.record() or {},
        summary=run.read_summary() or RunSummary(),
        metrics=metrics,
        probes=probes,
        evals=run.evals(),
        layers=tier_rows(run.layers()),
    )


def tier_rows(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """layers.jsonl (one row per step, each metric a list by layer; per-head metrics a list of lists) as tidy
    rows step, layer, head (None for a per-layer metric), metric, value: the form `Run.layers` holds."""
    import pandas as pd

    out: list[tuple[Any, int, int | None, str, float]] = []  # TIER_COLUMNS
    for r in rows:
        step = r.get("step")
        for metric, values in r.items():
            if metric == "step" or not isinstance(values, list):
                continue
            for layer, v in enumerate(values):
                if isinstance(v, list):
                    out += [(step, layer, h, metric, x) for h, x in enumerate(v) if isinstance(x, (int, float))]
                elif isinstance(v, (int, float)):
                    out.append((step, layer, None, metric, v))
    return pd.DataFrame(out, columns=TIER_COLUMNS)
