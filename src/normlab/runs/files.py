"""A run directory and a sweep folder on disk: the one module that knows their file names.

    RUN/                          (RunDir)
    ├── config.json               the resolved TrainConfig, the command that reproduces it, model/data facts
    ├── tokenizer.json            the trained or loaded BPE (byte runs need none)
    ├── metrics.jsonl             one row per optimizer step (and validation rows)
    ├── probes.jsonl              probe rows (normlab.diagnostics.probes)
    ├── layers.jsonl              the per-step tier: one row per tier step, per-layer lists (normlab.diagnostics.tier)
    ├── spikes.jsonl, spikes/     each loss or gradient spike: its verdict, rerun and saved batch (step_N.pt)
    ├── summary.json              status, reason and step, final losses, speed, forensics
    ├── eval.json                 lm-eval results (normlab eval), with eval_log.txt and eval_samples/
    ├── tensorboard/              with --tensorboard
    ├── checkpoints/              step_XXXXXXXX.pt (+ .sha256) or step_XXXXXXXX.dcp/ (normlab.runs.checkpoint)
    └── .lock                     held while a process trains the run (normlab.runs.start)

    SWEEP/                        (SweepDir)
    ├── sweep.db                  the store: one row per run (normlab.runs.store)
    ├── sweep.toml                the resolved sweep
    ├── runs/RUN_ID/              one RunDir per grid point
    ├── logs/RUN_ID.log           a local worker's output (logs/jobs/: a scheduler's jobs, submitit's files)
    ├── summary.md, *.csv, *.png  normlab summarize
    └── report.html, report/      the sweep's and the runs' reports

    RECOMMENDATION/               (RecommendDir, normlab recommend)
    ├── plan.json                 its inputs and both rounds' plans (a resumed recommendation reuses them)
    ├── screen.json               the screen's width and each candidate's verdict
    ├── grid/                     one SweepDir for the stress round and the final round
    ├── recommendation.md, .json  the ranking, the evidence, the checks, the settings, the limits
    └── report.html, ranking.png  the same as a page

Every reader and writer of these files goes through `RunDir`, `SweepDir` and `RecommendDir`; nothing else in the
package spells a file name. Reads are tolerant where a run may be mid-write or from an older normlab
(a missing or torn JSON file reads as None); writes are atomic (`normlab.io`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normlab.errors import ConfigError, DataError
from normlab.io import atomic_write_bytes, atomic_write_json, read_jsonl

if TYPE_CHECKING:
    from normlab.runs.summary import RunSummary

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
PROBES = "probes.jsonl"
LAYERS = "layers.jsonl"
SPIKES = "spikes.jsonl"
SPIKE_BATCHES = "spikes"
SUMMARY = "summary.json"
EVALS = "eval.json"
EVAL_LOG = "eval_log.txt"
EVAL_SAMPLES = "eval_samples"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
LOCK = ".lock"

STORE = "sweep.db"
SWEEP_FILE = "sweep.toml"
SWEEP_RUNS = "runs"
SWEEP_LOGS = "logs"
JOBS = "jobs"  # under logs/: submitit's folder (job scripts, logs, pickles)
SWEEP_SUMMARY = "summary.md"
SWEEP_REPORT = "report.html"
RECOMMEND_PLAN = "plan.json"
RECOMMEND_SCREEN = "screen.json"
RECOMMEND_GRID = "grid"
RECOMMEND_VERIFY = "verify"  # the verify stage's sweep: the best k at a wider width
RECOMMENDATION = "recommendation"  # .md and .json
REPORT_DIR = "report"
# What `sweep.run_id` makes: axis slugs and a hash. An id read back from a store is used as a folder
# name under SWEEP/runs, so anything else (a path separator, "..") is refused, not followed.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}")


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from disk; None when the file is missing, torn or not an object (a foreign file nested
    past Python's recursion limit included: its own reader, e.g. normlab.hf.folder, says what is wrong)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class RunDir:
    """One run's folder (`normlab train --out`, or SWEEP/runs/ID)."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    # -- where each file lives --
    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def tokenizer_file(self) -> Path:
        return self.path / TOKENIZER

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    @property
    def probes_file(self) -> Path:
        return self.path / PROBES

    @property
    def layers_file(self) -> Path:
        return self.path / LAYERS

    @property
    def spikes_file(self) -> Path:
        return self.path / SPIKES

    @property
    def warnings_file(self) -> Path:
        """The early warnings' alerts as they fired (`normlab.diagnostics.early_warning`), one JSON line each."""
        return self.path / "warnings.jsonl"

    def spike_batch_file(self, step: int) -> Path:
        return self.path / SPIKE_BATCHES / f"step_{step}.pt"

    @property
    def summary_file(self) -> Path:
        return self.path / SUMMARY

    @property
    def evals_file(self) -> Path:
        return self.path / EVALS

    @property
    def eval_log_file(self) -> Path:
        return self.path / EVAL_LOG

    def eval_samples_file(self, task: str) -> Path:
        return self.path / EVAL_SAMPLES / f"{task}.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK

    # -- what it is --
    def is_run(self) -> bool:
        """A normlab run: its config.json was written by normlab train (whether or not it logged a step)."""
        data = self.record() or {}
        return bool(data) and isinstance(data.get("config"), dict) and "normlab" in (data.get("versions") or {})

    def has_metrics(self) -> bool:
        return self.metrics_file.is_file()

    def has_checkpoints(self) -> bool:
        return self.checkpoints.is_dir()

    def is_export_like(self) -> bool:
        """A folder with a config.json but no run's metrics: a transformers model folder (or an export)."""
        return self.config_file.is_file() and not self.metrics_file.exists()

    # -- reading --
    def record(self) -> dict[str, Any] | None:
        """config.json as written: {"config": edge form, "command", "layout", "params", "data", "tokenizer", ...}."""
        return read_json(self.config_file)

    def train_config(self):  # noqa: ANN201 - TrainConfig | None
        """The TrainConfig the run was written with (None if it holds no readable one)."""
        from normlab.config import TrainConfig

        cfg = (self.record() or {}).get("config")
        if not isinstance(cfg, dict):
            return None
        try:
            return TrainConfig.from_dict(cfg, source=str(self.config_file))
        except ConfigError:
            return None

    def summary(self) -> dict[str, Any] | None:
        return read_json(self.summary_file)

    def read_summary(self) -> RunSummary | None:
        """summary.json as a typed record (None: the run has none yet)."""
        from normlab.runs.summary import RunSummary

        data = self.summary()
        return RunSummary.from_json(data) if isinstance(data, dict) else None

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_file)

    def probes(self) -> list[dict[str, Any]]:
        return read_jsonl(self.probes_file)

    def layers(self) -> list[dict[str, Any]]:
        """The per-step tier's rows (``layers.jsonl``): one per tier step (run.layer_stats_every), each metric a list
        by layer."""
        return read_jsonl(self.layers_file)

    def spikes(self) -> list[dict[str, Any]]:
        return read_jsonl(self.spikes_file)

    def probe_series(self, site: str, metric: str, layer: int | None = None) -> list[tuple[int, float]]:
        """(step, value) of one site and metric, without pandas (summaries of many runs)."""
        return [
            (r["step"], r["value"])
            for r in self.probes()
            if r.get("site") == site and r.get("metric") == metric and r.get("layer") == layer
        ]

    def evals(self) -> dict[str, dict]:
        """eval.json ({} if the run was never evaluated); a torn file is named, not ignored."""
        if not self.evals_file.is_file():
            return {}
        try:
            data = json.loads(self.evals_file.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{self.evals_file} is not valid JSON ({err.msg}); delete it and evaluate again") from None
        return data if isinstance(data, dict) else {}

    def predates_end_of_text(self) -> bool:
        """Runs record their tokenizer's facts (end-of-text id included) in config.json since it existed."""
        data = self.record()
        return data is not None and "tokenizer" not in data

    def check_logged(self) -> list[dict[str, Any]]:
        """The metrics rows of a run that has logged steps; a ConfigError naming the folder otherwise."""
        if not self.has_metrics():
            raise ConfigError(
                f"{self.path} is not a normlab run directory (no {METRICS}); give directories written by normlab train"
            )
        rows = self.metrics()
        if not rows:
            raise ConfigError(f"{self.metrics_file} has no readable rows (the run has not logged a step yet)")
        for i, row in enumerate(rows):
            step, loss = row.get("step"), row.get("loss")
            if not isinstance(step, int) or isinstance(step, bool) or not isinstance(loss, (int, float, type(None))):
                raise ConfigError(
                    f"{self.metrics_file} row {i + 1} is not a normlab metrics row (step {step!r}, "
                    f"loss {str(loss)[:40]!r}); give directories written by normlab train"
                )
        return rows

    # -- writing (atomic) --
    def write_record(self, record: dict[str, Any]) -> None:
        atomic_write_json(self.config_file, record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_json(self.summary_file, summary)

    def write_tokenizer(self, text: str) -> None:
        atomic_write_bytes(self.tokenizer_file, text.encode())

    def write_evals(self, evals: dict[str, dict]) -> None:
        atomic_write_json(self.evals_file, evals)


def check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise ConfigError(
            f"sweep store holds an invalid run id {str(run_id)[:80]!r}: ids are letters, digits and "
            "._+=- (what normlab sweep writes); the store was edited or is not normlab's"
        )
    return run_id


@dataclass(frozen=True)
class SweepDir:
    """A sweep's folder (`normlab sweep`, `normlab compare`): its store, its resolved file, its runs."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def store_file(self) -> Path:
        return self.path / STORE

    @property
    def sweep_file(self) -> Path:
        return self.path / SWEEP_FILE

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK

    @property
    def report_dir(self) -> Path:
        return self.path / REPORT_DIR

    @property
    def logs_dir(self) -> Path:
        return self.path / SWEEP_LOGS

    def log_file(self, run_id: Any) -> Path:
        """Where a local worker's stdout and stderr go."""
        return self.logs_dir / f"{check_run_id(run_id)}.log"

    @property
    def jobs_dir(self) -> Path:
        """submitit's folder for a scheduler's jobs: their scripts, output and result files (logs/jobs/JOB_ID_*)."""
        return self.logs_dir / JOBS

    def is_sweep(self) -> bool:
        return self.store_file.is_file()

    def run(self, run_id: Any) -> RunDir:
        """SWEEP/runs/RUN_ID for a checked id: never a folder outside the sweep."""
        return RunDir(self.path / SWEEP_RUNS / check_run_id(run_id))

    def run_folders(self) -> list[RunDir]:
        """The run folders under SWEEP/runs that hold a normlab run (what a lost store is rebuilt from), by name."""
        root = self.path / SWEEP_RUNS
        found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [RunDir(root / name) for name in found if RUN_ID.fullmatch(name) and RunDir(root / name).is_run()]


@dataclass(frozen=True)
class RecommendDir:
    """A recommendation's folder (`normlab recommend`): its plan, its screen, its grid, its conclusions."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def plan_file(self) -> Path:
        return self.path / RECOMMEND_PLAN

    @property
    def screen_file(self) -> Path:
        return self.path / RECOMMEND_SCREEN

    @property
    def grid(self) -> SweepDir:
        return SweepDir(self.path / RECOMMEND_GRID)

    @property
    def verify(self) -> SweepDir:
        return SweepDir(self.path / RECOMMEND_VERIFY)

    def ladder(self, width: int, lr: float) -> SweepDir:
        """The ladder's sweep at `width` for the candidates whose best learning rate is `lr`."""
        return SweepDir(self.path / "ladder" / f"w{width}-lr{lr:g}")

    @property
    def ladder_figure(self) -> Path:
        return self.path / "ladder.png"

    @property
    def markdown_file(self) -> Path:
        return self.path / f"{RECOMMENDATION}.md"

    @property
    def json_file(self) -> Path:
        return self.path / f"{RECOMMENDATION}.json"

    @property
    def report_file(self) -> Path:
        return self.path / SWEEP_REPORT

    @property
    def lock_file(self) -> Path:
        """Held for a whole recommend call: a second call on the folder is refused, its records intact."""
        return self.path / LOCK

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        """A JSON file of the folder ({} while it does not exist yet)."""
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}

    def grid_files(self) -> str:
        """The grid's summary and report, as the recommendation names them."""
        return f"{RECOMMEND_GRID}/{SWEEP_SUMMARY} and {RECOMMEND_GRID}/{SWEEP_REPORT}"
