"""What the stages of a recommendation share: the folder, the budget's clock, the workers, the log, an
executor for the proxies' sweeps, the plan, plan.json's record of each call, and what the stages found
so far (`Findings`).

A stage (`normlab.recommend.stages.pipeline.Stage`) says what it costs (the plan's predicted seconds), whether it has
nothing left to add to this call (`done`), and runs, reading what the stages before it found from `Findings` and
adding its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from normlab.config.commands import RecommendConfig
from normlab.experiments import runner
from normlab.experiments.summary import load_sweep
from normlab.experiments.sweep import SweepConfig, _slug
from normlab.io import atomic_write_json
from normlab.recommend.planning.plan import REPORT_RESERVE_S
from normlab.recommend.planning.plan_record import Plan
from normlab.recommend.planning.shape import UserModel
from normlab.recommend.stages.records import FinalRecord, Recommendation, ScreenRecord, StageRecord
from normlab.runs.files import RecommendDir


def minutes(seconds: float) -> str:
    """Seconds as the output writes them: "1.5 min"."""
    return f"{seconds / 60:.1f} min"


@dataclass(frozen=True)
class BudgetClock:
    """The budget counted from the command's start `t0`: nothing runs past `stop_at`, which leaves the
    report's reserve."""

    t0: float
    budget_s: float

    @property
    def stop_at(self) -> float:
        return self.t0 + self.budget_s - REPORT_RESERVE_S

    def used_minutes(self) -> float:
        return (time.time() - self.t0) / 60

    def stamp(self) -> str:
        """ "[used of budget min]", as each stage's first line shows it."""
        return f"[{self.used_minutes():.1f} of {self.budget_s / 60:g} min]"


@dataclass(frozen=True)
class SweepExecutor:
    """Runs the proxies' sweeps on `workers` under the budget's deadline, and reads back what they hold."""

    workers: int
    log: Callable[[str], Any]
    stop_at: float
    short: dict[str, str] = field(default_factory=dict)  # a change's string form -> its name (`Context.short`)

    def run(self, sweep: SweepConfig, path: Path, start_by: float) -> pd.DataFrame:
        """Run (or resume) `sweep` in `path`: no run starts after `start_by`, none runs past `stop_at`;
        returns every run the folder holds (`load_sweep`). Its lines name a change to the user's placement as
        the output does (`yours+emb_lr0.1_seed0-...`); the run folders keep their ids (resumable)."""
        deadline = runner.Deadline(start_by=start_by, stop_at=self.stop_at)
        runner.run_sweep(sweep, path, workers=self.workers, log=self._named, deadline=deadline)
        return self.runs(path)

    def _named(self, line: str) -> Any:
        """`line` with each change's run-id prefix (its string form's slug) replaced by its name."""
        for layout, name in self.short.items():
            line = line.replace(f"{_slug(layout)}_", f"{name}_")
        return self.log(line)

    @staticmethod
    def runs(path: Path) -> pd.DataFrame:
        runs, _ = load_sweep(path)
        return runs


@dataclass
class Findings:
    """What the stages found, in order: the screen's record and what it ruled out, the candidates left,
    the grid's runs, the stress round's order, the final round's record and the ladder's."""

    screen: ScreenRecord | None = None  # None: not screened yet
    out_by_screen: dict[str, str] = field(default_factory=dict)
    alive: list[str] = field(default_factory=list)
    runs: pd.DataFrame | None = None
    order: list[str] = field(default_factory=list)
    final: FinalRecord | None = None
    ladder: dict[str, Any] | None = None  # the ladder stage's record (normlab.recommend.stages.ladder); None: none ran
    verified: dict[str, Any] = field(default_factory=lambda: {"status": "not asked"})  # the verify stage's record
    result: Recommendation | None = None  # the conclusion as last written
    concluded: dict[str, Any] | None = None  # the verify record `result` was concluded with
    summarized: bool = False  # the grid's summary written and the calibration refreshed from its runs


@dataclass
class Context:
    """One recommend call's shared state (module doc); `saved`: plan.json's contents, written by `mark`."""

    folder: RecommendDir
    user: UserModel
    cfg: RecommendConfig
    precision: str
    extra: dict[str, Any]
    candidates: list[str]
    current: str | None
    base: dict[str, Any]  # the proxy runs' settings (`inputs.proxy_settings`)
    clock: BudgetClock
    sweeps: SweepExecutor
    plan: Plan
    saved: dict[str, Any]
    rounds: list[StageRecord] = field(default_factory=list)  # this call's stages (a resumed call counts its own)
    found: Findings = field(default_factory=Findings)
    labels: dict[str, str] = field(default_factory=dict)  # candidates made from the user's placement -> their words
    short: dict[str, str] = field(default_factory=dict)  # a change's string form -> its name (`yours+emb`)

    def name(self, layout: str) -> str:
        """What the output calls a candidate: its change's name (`yours+emb`) where it is a change to the user's
        placement written as a string form, else the layout's own name."""
        return self.short.get(layout, layout)

    def names(self, layouts: list[str]) -> str:
        return ", ".join(map(self.name, layouts))

    @property
    def log(self) -> Callable[[str], Any]:
        return self.sweeps.log

    @property
    def workers(self) -> int:
        return self.sweeps.workers

    @property
    def calls(self) -> list[float]:
        """Each call's minutes, kept at every stage: a resumed call adds to them."""
        calls: list[float] = self.saved.setdefault("call_minutes", [])
        return calls

    def start_call(self) -> None:
        """This call's entry in plan.json: its minutes, its stages, the plan it follows."""
        self.saved["plan"] = self.plan.to_json()
        self.calls.append(0.0)
        self.mark()

    def mark(self) -> None:
        """plan.json written with this call's minutes and stages so far."""
        self.calls[-1] = self.clock.used_minutes()
        self.saved["rounds"] = [r.to_json() for r in self.rounds]
        atomic_write_json(self.folder.plan_file, self.saved)

    def record(self, stage: StageRecord) -> StageRecord:
        self.rounds.append(stage)
        return stage

    def one_run_s(self) -> float:
        """About one proxy run's seconds (the stress round's prediction over its waves): no round starts a
        run later than this before the deadline."""
        return self.plan.predicted["stress"] / max(1, math.ceil(len(self.found.alive) / self.workers))


def stage_record(
    name: str, predicted: float, started: float, runs: pd.DataFrame, layouts: list[str], planned: int
) -> StageRecord:
    """A training stage's record: predicted and actual seconds, runs planned and finished (of `layouts`)."""
    mine = runs[runs.layout.isin(layouts)] if len(runs) else runs
    finished = int(mine.status.isin(("ok", "stalled", "diverged")).sum()) if len(mine) else 0
    return StageRecord(name, predicted, time.time() - started, planned, min(finished, planned))
