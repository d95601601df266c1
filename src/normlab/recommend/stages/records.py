"""The records a recommendation keeps, typed: the screen's (`ScreenRecord`: screen.json), what a stage
predicted and did (`StageRecord`), what the final round ran (`FinalRecord`), what the plan was and what its
rounds ran (`PlanRecord`, with the stress round's `StressRecord`), how sure the answer is (`Confidence`:
`normlab.recommend.evidence.answer.confidence`) and the recommendation itself (`Recommendation`). The plan is
`normlab.recommend.planning.plan_record.Plan`. Each is a frozen dataclass that turns into JSON only where it is
written to the folder (`to_json`: plan.json's "rounds", screen.json, recommendation.json) and back where a folder
is read (`from_json`), with the keys and values the folder has always held: `from_json(d).to_json() == d` for a
record as written.

What stays a JSON mapping inside them, and why: each candidate's screen (`rank.ScreenSummary`, a TypedDict:
the entry screen.json holds, built and read as one), the ranking's rows (`rank.Evidence.to_dict`: its
non-finite numbers are written as null, so a row does not turn back into the `Evidence` it came from), and
the sub-records other modules own and word (`effect`, `recipe`, `domain`: `evidence.answer`; `verdict`:
`evidence.gate`; `verify`: `stages.verify`; `settings`: `frameworks.snippets`; the transfer record).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from normlab.recommend.evidence.rank import ScreenSummary
from normlab.recommend.planning.plan_record import LadderPlan


@dataclass(frozen=True)
class ScreenRecord:
    """screen.json: the screen's width and depth, each candidate's screen by name (`rank.ScreenSummary`), and
    the predicted seconds of one; `skipped`: no screen (--quick; its key is written only where True, as
    `predicted_seconds_each` only where set)."""

    width: int
    n_layers: int
    results: dict[str, ScreenSummary] = field(default_factory=dict)
    predicted_seconds_each: float | None = None
    skipped: bool = False

    def with_result(self, name: str, result: ScreenSummary) -> ScreenRecord:
        """This record with `name`'s screen added."""
        return replace(self, results={**self.results, name: result})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"width": self.width, "n_layers": self.n_layers, "results": dict(self.results)}
        if self.predicted_seconds_each is not None:
            out["predicted_seconds_each"] = self.predicted_seconds_each
        if self.skipped:
            out["skipped"] = True
        return out

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> ScreenRecord:
        return cls(
            width=saved["width"],
            n_layers=saved["n_layers"],
            results=dict(saved.get("results") or {}),
            predicted_seconds_each=saved.get("predicted_seconds_each"),
            skipped=bool(saved.get("skipped", False)),
        )


@dataclass(frozen=True)
class StageRecord:
    """One stage of one call (plan.json's "rounds"): `stage` (screen, stress, final, extend, ladder, verify),
    `predicted_s` and `actual_s` seconds, runs (or screens) `planned` and `finished`."""

    stage: str
    predicted_s: float
    actual_s: float
    planned: int
    finished: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> StageRecord:
        return cls(saved["stage"], saved["predicted_s"], saved["actual_s"], saved["planned"], saved["finished"])


@dataclass(frozen=True)
class FinalRecord:
    """The final round as run: its `finalists`, `lrs` and `seeds`, the finalists whose best learning rate was at
    an edge (`edges`: -> the next one beyond it; None where no final round ran, and then no key) and those
    `extended`."""

    finalists: list[str]
    lrs: list[float]
    seeds: list[int]
    extended: dict[str, float] = field(default_factory=dict)
    edges: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.edges is None:
            del out["edges"]
        return out

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> FinalRecord:
        return cls(
            list(saved["finalists"]),
            list(saved["lrs"]),
            list(saved["seeds"]),
            dict(saved.get("extended") or {}),
            saved.get("edges"),
        )


@dataclass(frozen=True)
class StressRecord:
    """The stress round as planned: the proxies' `depth` (`depth_fixed`: set by --depth), its `candidates` in
    the order it ranked them, and its learning rate `lr`."""

    depth: int
    depth_fixed: bool
    candidates: list[str]
    lr: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> StressRecord:
        return cls(saved["depth"], saved["depth_fixed"], list(saved["candidates"]), saved["lr"])


@dataclass(frozen=True)
class PlanRecord:
    """recommendation.json's "plan": what the plan was and what the rounds ran. `screen_width` is the screen's
    (0: none ran); `depth`, `cut`, `predicted`, `screened`, `order` and `ladder` the plan's
    (`normlab.recommend.planning.plan_record.Plan`); `stress` and `final` the rounds'."""

    screen_width: int
    depth: int
    stress: StressRecord
    final: FinalRecord
    cut: list[str]
    predicted: dict[str, float]
    screened: list[str]
    order: list[str]
    ladder: LadderPlan | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "screen_width": self.screen_width,
            "depth": self.depth,
            "stress": self.stress.to_json(),
            "final": self.final.to_json(),
            "cut": list(self.cut),
            "predicted": dict(self.predicted),
            "screened": list(self.screened),
            "order": list(self.order),
            "ladder": self.ladder.to_json() if self.ladder else None,
        }

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> PlanRecord:
        return cls(
            screen_width=saved["screen_width"],
            depth=saved["depth"],
            stress=StressRecord.from_json(saved["stress"]),
            final=FinalRecord.from_json(saved["final"]),
            cut=list(saved["cut"]),
            predicted=dict(saved["predicted"]),
            screened=list(saved["screened"]),
            order=list(saved["order"]),
            ladder=LadderPlan.from_json(saved["ladder"]) if saved.get("ladder") else None,
        )


@dataclass(frozen=True)
class Confidence:
    """recommendation.json's `confidence`: its `level` (`answer.LEVELS`) and `why` it is provisional, the
    finished `runs` behind each ranked candidate, the `seeds` of the plan (or that the winner ran:
    `normlab.recommend.evidence.rows.seeds_that_ran`), the candidates `not_tried`, and whether the effect's
    interval excludes zero (`separable`; None: no interval)."""

    level: str
    why: list[str]
    runs: dict[str, int]
    seeds: int
    not_tried: int
    separable: bool | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> Confidence:
        return cls(
            saved["level"],
            list(saved["why"]),
            dict(saved["runs"]),
            saved["seeds"],
            saved["not_tried"],
            saved["separable"],
        )


# recommendation.json's keys held as JSON as they are (the module doc says why); `_LATER`: those an older file may
# lack, read as their defaults
_AS_JSON = (
    "model", "notes", "precision", "current", "winner", "ranking", "recipe_checks", "settings", "limits", "optimizer",
    "verify", "transfer_record", "movement", "minutes", "budget_minutes", "call_minutes", "files", "effect",
    "recipe", "domain", "changed_from", "dropped", "labels", "verdict",
)  # fmt: skip
_LATER: dict[str, Callable[[], Any]] = {
    "effect": dict, "recipe": dict, "domain": dict, "changed_from": lambda: None, "dropped": list, "labels": dict,
    "verdict": dict,
}  # fmt: skip


@dataclass(frozen=True)
class Recommendation:
    """recommendation.json (and `text`: recommendation.md). Its fields are its keys: the user's `model` in words
    and its `notes`, the `precision`, the `current` placement and the `winner` (None: nothing ranked), the
    `ranking` (one row per candidate), the `recipe_checks`, the winner's `settings` in the code bases, the
    proxy's `limits` in words, the proxies' `optimizer`, the `verify` stage's record, the `transfer_record` it
    was read against, the `plan` (`PlanRecord`) and this call's `rounds`, the `movement` (what ran, how far the
    answer could move), this call's `minutes`, `budget_minutes` and every call's `call_minutes`, the `files`;
    the answer sized to its evidence (`normlab.recommend.evidence.answer`): `confidence`, `effect`, `recipe`,
    `domain`, `changed_from` (an earlier call's different answer); what the winner takes away from the user's
    placement (`dropped`), the candidates made from it (`labels`) and the gate's decision (`verdict`:
    `normlab.recommend.evidence.gate`)."""

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
    plan: PlanRecord
    rounds: list[StageRecord]
    movement: list[str]
    minutes: float
    budget_minutes: float
    call_minutes: list[float]
    files: dict[str, str]
    confidence: Confidence | None = None  # None: not sized (written as {})
    effect: dict[str, Any] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)
    domain: dict[str, Any] = field(default_factory=dict)
    changed_from: dict[str, Any] | None = None
    dropped: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    verdict: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        """recommendation.json's contents (the text is recommendation.md)."""
        out = copy.deepcopy({k: getattr(self, k) for k in _AS_JSON})  # the caller's to change, not the record's
        return {
            **out,
            "plan": self.plan.to_json(),
            "rounds": [r.to_json() for r in self.rounds],
            "confidence": self.confidence.to_json() if self.confidence else {},
        }

    @classmethod
    def from_json(cls, saved: Mapping[str, Any], text: str = "") -> Recommendation:
        """The recommendation a folder's recommendation.json holds (`text`: its recommendation.md); a key an older
        file lacks (`_LATER`) takes its default."""
        return cls(
            **{k: saved[k] if k in saved or k not in _LATER else _LATER[k]() for k in _AS_JSON},
            plan=PlanRecord.from_json(saved["plan"]),
            rounds=[StageRecord.from_json(r) for r in saved["rounds"]],
            confidence=Confidence.from_json(saved["confidence"]) if saved.get("confidence") else None,
            text=text,
        )

    def as_result(self) -> dict[str, Any]:
        """What `recommend` returns: recommendation.json's contents and the text."""
        return {**self.to_json(), "text": self.text}
