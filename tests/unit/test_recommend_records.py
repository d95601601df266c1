"""recommend's typed records against the files as written before they were typed: tests/golden/recommend_records.json
holds plan.json, screen.json and recommendation.json of a recommend run (and plans with a verify stage and a
ladder) as the dict-based code wrote them; each record read with `from_json` and written with `to_json` gives the
identical dict, and the records read by attribute what the dicts held by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from normlab.recommend.planning.plan_record import LadderPlan, Plan, VerifyStagePlan
from normlab.recommend.stages.records import (
    Confidence,
    FinalRecord,
    PlanRecord,
    Recommendation,
    ScreenRecord,
    StageRecord,
    StressRecord,
)

GOLDEN = json.loads((Path(__file__).parents[1] / "golden" / "recommend_records.json").read_text())


@pytest.mark.parametrize("key", ["plan_with_verify", "plan_with_ladder"])
def test_a_plan_as_written_reads_back_to_the_identical_dict(key):
    saved = GOLDEN[key]
    p = Plan.from_json(saved)
    assert p.to_json() == saved
    assert json.dumps(p.to_json(), sort_keys=True) == json.dumps(saved, sort_keys=True)  # what the file holds
    if saved["verify"]:
        assert isinstance(p.verify, VerifyStagePlan) and p.verify.k == saved["verify"]["k"]
        assert p.verify.predicted_s == saved["verify"]["predicted_s"] == p.predicted["verify"]
    if saved["ladder"]:
        assert isinstance(p.ladder, LadderPlan) and p.ladder.widths == saved["ladder"]["widths"]
        assert p.ladder.steps == saved["ladder"]["steps"]


def test_plan_json_its_plan_and_rounds_read_back_to_the_identical_dicts():
    saved = GOLDEN["plan_json"]
    p = Plan.from_json(saved["plan"])
    assert p.to_json() == saved["plan"] and p.verify is None and p.ladder is None
    assert [StageRecord.from_json(r).to_json() for r in saved["rounds"]] == saved["rounds"]
    first = StageRecord.from_json(saved["rounds"][0])
    assert (first.stage, first.planned) == (saved["rounds"][0]["stage"], saved["rounds"][0]["planned"])


def test_an_older_plan_lacking_a_field_takes_its_default_and_unknown_keys_are_dropped():
    saved = {k: v for k, v in GOLDEN["plan_json"]["plan"].items() if k not in ("ladder", "verify", "optimizer")}
    p = Plan.from_json({**saved, "retired_key": 1})
    assert p.ladder is None and p.verify is None and p.optimizer == "adamw"
    assert p.to_json() == {**saved, "ladder": None, "verify": None, "optimizer": "adamw"}


def test_screen_json_reads_back_to_the_identical_dict_and_grows_by_one_result():
    saved = GOLDEN["screen_json"]
    s = ScreenRecord.from_json(saved)
    assert s.to_json() == saved and not s.skipped
    assert s.width == saved["width"] and set(s.results) == set(saved["results"])
    name = next(iter(s.results))
    grown = s.with_result("another", s.results[name])
    assert set(grown.results) == {*s.results, "another"} and set(s.results) == set(saved["results"])  # s unchanged
    quick = ScreenRecord(0, 16, skipped=True)  # --quick: no screen; the record --quick held as a dict
    assert quick.to_json() == {"width": 0, "n_layers": 16, "results": {}, "skipped": True}


@pytest.mark.parametrize("key", ["recommendation_json", "quick_recommendation_json"])
def test_recommendation_json_reads_back_to_the_identical_dict(key):
    saved = GOLDEN[key]
    r = Recommendation.from_json(saved, text="words")
    assert r.to_json() == saved
    assert json.dumps(r.to_json(), sort_keys=True) == json.dumps(saved, sort_keys=True)
    assert r.as_result() == {**saved, "text": "words"}
    assert r.plan.stress.lr == saved["plan"]["stress"]["lr"] and r.plan.final.lrs == saved["plan"]["final"]["lrs"]
    assert r.plan.screen_width == saved["plan"]["screen_width"] and r.confidence.level == saved["confidence"]["level"]
    assert [x.finished for x in r.rounds] == [x["finished"] for x in saved["rounds"]]


def test_the_sub_records_read_back_to_the_identical_dicts():
    rec = GOLDEN["recommendation_json"]
    assert PlanRecord.from_json(rec["plan"]).to_json() == rec["plan"]
    assert StressRecord.from_json(rec["plan"]["stress"]).to_json() == rec["plan"]["stress"]
    assert FinalRecord.from_json(rec["plan"]["final"]).to_json() == rec["plan"]["final"]
    assert Confidence.from_json(rec["confidence"]).to_json() == rec["confidence"]
    # a final round that never ran writes no "edges" key
    assert FinalRecord.from_json(GOLDEN["final_without_edges"]).to_json() == GOLDEN["final_without_edges"]
    assert "edges" not in GOLDEN["final_without_edges"]


def test_an_older_recommendation_lacking_the_later_keys_reads_them_as_their_defaults():
    later = ("effect", "recipe", "domain", "changed_from", "dropped", "labels", "verdict")
    saved = {k: v for k, v in GOLDEN["recommendation_json"].items() if k not in later}
    r = Recommendation.from_json(saved)
    got = (r.effect, r.recipe, r.domain, r.changed_from, r.dropped, r.labels, r.verdict)
    assert got == ({}, {}, {}, None, [], {}, {})
    with pytest.raises(KeyError):  # a key every recommendation.json holds is not made up
        Recommendation.from_json({k: v for k, v in saved.items() if k != "winner"})
