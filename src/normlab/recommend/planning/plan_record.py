"""The plan's record (plan.json's "plan"), made by `normlab.recommend.planning.plan`: every number of a
recommendation's work, fixed before it starts (`Plan`), with its verify stage (`VerifyStagePlan`) and its ladder
(`LadderPlan`). Frozen dataclasses, read by attribute; `to_json` and `from_json` keep the keys and values
plan.json has always held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class VerifyStagePlan:
    """plan.json's "verify": the verify stage's best `k` of the ranking trained again at `width`, at the proxies'
    `depth` and `steps`, with `seed`; `predicted_s` its seconds."""

    k: int
    width: int
    depth: int
    steps: int
    seed: int
    predicted_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> VerifyStagePlan:
        return cls(saved["k"], saved["width"], saved["depth"], saved["steps"], saved["seed"], saved["predicted_s"])


@dataclass(frozen=True)
class LadderPlan:
    """plan.json's "ladder" (`normlab.recommend.evidence.ladder`): its rungs' `widths` (the proxy's among them),
    the `steps` of each rung beside the proxy (keyed by its width as a string, as JSON keys are) and their
    `predicted_s` seconds."""

    widths: list[int]
    steps: dict[str, int]
    predicted_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> LadderPlan:
        return cls(list(saved["widths"]), dict(saved["steps"]), saved["predicted_s"])


@dataclass(frozen=True)
class Plan:
    """Every number of a recommendation's work, fixed before it starts (plan.json's "plan": its keys are these
    fields' names; `verify` and `ladder` are written as their own records' JSON, or null)."""

    order: list[str]  # every candidate, in the cheap screen's order
    screened: list[str]  # the first len(screened) of `order`: screened, then trained in the stress round
    screen_width: int
    depth: int
    steps: int
    stress_lr: float
    seed0: int
    finalists: int  # how many the final round takes (0: none)
    lrs: list[float]  # the final round's learning rates (the stress lr among them)
    seeds: list[int]
    extend: bool  # one learning rate beyond the edge for finalists whose best is at one
    predicted: dict[str, float]  # seconds by stage: screen, stress, final, extend, reserves, total
    budget_s: float
    workers: int
    cut: list[str] = field(default_factory=list)  # what the budget left out of the fullest answer, in words
    optimizer: str = "adamw"  # what the proxies train with
    verify: VerifyStagePlan | None = None  # the verify stage (None: none)
    verify_note: str = ""  # why a verify stage asked for is not in the plan (one line), else ""
    screen: bool = True  # False: the quick question, no screen (`normlab.recommend.stages.screen`)
    # the ladder (normlab.recommend.evidence.ladder): the rungs it trains beside the proxy; None: one rung (the proxy)
    ladder: LadderPlan | None = None

    def to_json(self) -> dict[str, Any]:
        """plan.json's "plan"."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["predicted"] = dict(self.predicted)
        out["verify"] = self.verify.to_json() if self.verify else None
        out["ladder"] = self.ladder.to_json() if self.ladder else None
        return {k: list(v) if isinstance(v, list) else v for k, v in out.items()}

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> Plan:
        """The plan a folder's plan.json holds (its fields; one an older folder lacks takes its default)."""
        names = {f.name for f in fields(cls)}
        got = {k: v for k, v in saved.items() if k in names}
        got["verify"] = VerifyStagePlan.from_json(got["verify"]) if got.get("verify") else None
        got["ladder"] = LadderPlan.from_json(got["ladder"]) if got.get("ladder") else None
        return cls(**got)
