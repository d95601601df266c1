"""The records a recommendation keeps, typed: what a stage predicted and did (`StageRecord`), what the
final round ran (`FinalRecord`) and the recommendation itself (`Recommendation`). The plan is
`normlab.recommend.planning.plan.Plan`. Each turns into JSON only where it is written to the folder (plan.json's
"rounds", recommendation.json), with the same keys and values the folder has always held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StageRecord:
    """One stage of one call: predicted and actual seconds, runs (or screens) planned and finished."""

    stage: str
    predicted_s: float
    actual_s: float
    planned: int
    finished: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FinalRecord:
    """The final round as run: its finalists, learning rates and seeds, the finalists whose best learning
    rate was at an edge (-> the next one beyond it; None where no final round ran) and those extended."""

    finalists: list[str]
    lrs: list[float]
    seeds: list[int]
    extended: dict[str, float] = field(default_factory=dict)
    edges: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.edges is None:
            del out["edges"]
        return out


@dataclass
class Recommendation:
    """recommendation.json (and `text`: recommendation.md)."""

    model: str
    notes: list[str]
    precision: str
    current: str | None
    winner: str | None
    ranking: list[dict[str, Any]]
    recipe_checks: list[dict[str, Any]]
    settings: dict[str, Any]
    limits: list[str]
    optimizer: str
    verify: dict[str, Any]
    transfer_record: dict[str, Any]
    plan: dict[str, Any]
    rounds: list[dict[str, Any]]
    movement: list[str]
    minutes: float
    budget_minutes: float
    call_minutes: list[float]
    files: dict[str, str]
    text: str = ""
    # the answer sized to its evidence (normlab.recommend.evidence.answer): how sure, how large against the user's
    # placement, what to train with, where the evidence ends, and an earlier call's different answer
    confidence: dict[str, Any] = field(default_factory=dict)
    effect: dict[str, Any] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)
    domain: dict[str, Any] = field(default_factory=dict)
    changed_from: dict[str, Any] | None = None
    dropped: list[str] = field(default_factory=list)  # what the winner takes away from the user's placement
    labels: dict[str, str] = field(default_factory=dict)  # candidates made from the user's placement
    verdict: dict[str, Any] = field(default_factory=dict)  # the gate's decision (normlab.recommend.evidence.gate)

    def to_dict(self) -> dict[str, Any]:
        """recommendation.json's contents (the text is recommendation.md)."""
        out = asdict(self)
        del out["text"]
        return out

    def as_result(self) -> dict[str, Any]:
        """What `recommend` returns: recommendation.json's contents and the text."""
        return {**self.to_dict(), "text": self.text}
