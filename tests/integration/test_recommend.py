"""`normlab recommend` end to end on a nano model, its resume, its refusals, and the sweep deadline
it runs under."""

import json
import time

import pytest

from normlab.cli import main
from normlab.experiments.runner import Deadline, run_sweep
from normlab.experiments.sweep import SweepConfig
from normlab.runs.store import SweepStore

QUIET = lambda *a, **k: None  # noqa: E731


def _args(corpus, out, *more):
    return ["recommend", "nano", "--candidates", "pre,peri", "--precision", "fp16", "--steps", "8", "--lrs", "0.01,0.1",
            "--seeds", "0", "--set", f"data={corpus}", "--set", "seq_len=32", "--set", "batch_size=4", "--workers", "2",
            "--out", str(out), *more]


def test_recommend_ranks_with_evidence_resumes_and_refuses_changed_inputs(corpus, tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(_args(corpus, out)) == 0
    text = capsys.readouterr().out
    assert "1/3 screen" in text and "2/3 stress round" in text and "3/3 final round" in text  # the stages, with the clock
    assert "; 1 left, ETA " in text  # the screen's progress in a log, where no bar is drawn
    assert "of 15 min]" in text and "2 runs at lr 0.1, seed 0, 2 layers (your depth)" in text
    rec = json.loads((out / "recommendation.json").read_text())
    ranking = {r["layout"]: r for r in rec["ranking"]}
    assert set(ranking) == {"pre", "peri"} and sorted(r["rank"] for r in rec["ranking"]) == [1, 2]
    for r in rec["ranking"]:  # both finalists: the stress run and the second lr
        assert r["status"] == "ranked" and r["runs"] == 2 and r["finished"] + r["unfinished"] == 2
        assert r["screen"] in ("stable", "caution", "unstable") and set(r["loss_by_lr"]) <= {"0.01", "0.1"}
    assert rec["winner"] == rec["ranking"][0]["layout"] and set(rec["settings"]) == {
        "normlab", "transformers", "OLMo-core", "torchtitan", "litgpt"}
    assert any("Width: the proxies are 64 wide" in x for x in rec["limits"])
    assert any("8 steps of 4 x 32 byte tokens" in x for x in rec["limits"])  # the runs' own settings, stated
    (check,) = rec["recipe_checks"]  # stress-kim-fp16's peri ahead of pre, compared at its lr 0.1 where both ran
    assert check["claim"] == "peri ahead of pre" and check["at_setting"].startswith("lr 0.1: peri ")
    assert check["agrees_at_setting"] in (True, False) and check["agrees"] == (ranking["peri"]["rank"] == 1)
    md = (out / "recommendation.md").read_text()
    assert "## Evidence (ranked)" in md and "where the settings overlap" in md and "## What the proxy can and cannot tell" in md and "Recommended: **" in md
    assert (out / "report.html").is_file() and (out / "grid" / "summary.md").is_file()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["stress"]["depth"] == 2 and plan["final"]["lrs"] == [0.01, 0.1] and plan["final"]["seeds"] == [0]

    assert main(_args(corpus, out)) == 0  # the same command again: nothing is retrained
    again = capsys.readouterr().out
    assert "4 runs, 4 done, 0 to run" in again and json.loads((out / "recommendation.json").read_text())["ranking"] == \
        rec["ranking"]
    calls = json.loads((out / "plan.json").read_text())["call_minutes"]  # both calls' time, the first's kept
    assert len(calls) == 2 and calls[0] == pytest.approx(rec["minutes"], abs=0.1) and calls[1] < calls[0]
    assert f"min over 2 calls ({calls[0]:.1f}, " in (out / "recommendation.md").read_text()

    assert main(_args(corpus, out, "--steps", "9")) == 2  # another input: refused, nothing touched
    assert "other inputs (changed: base)" in capsys.readouterr().err


def test_a_budget_too_small_is_refused_with_the_budget_that_would_do(corpus, tmp_path, capsys):
    assert main(_args(corpus, tmp_path / "r", "--budget", "0.5")) == 2  # the screen fits, the proxy runs do not
    err = capsys.readouterr().err
    assert "give --budget" in err and "what is done so far is kept" in err
    assert main(["recommend", "nano", "--candidates", "pre,perri", "--out", str(tmp_path / "x")]) == 2
    assert "perri" in capsys.readouterr().err


def test_sweep_deadline_leaves_unstarted_runs_pending_and_stops_running_ones(corpus, tmp_path):
    base = dict(data=str(corpus), size="nano", seq_len=32, batch_size=4, eval_every=0, eval_batches=1, probe_every=0)
    late = SweepConfig(name="late", base={**base, "steps": 5}, grid={"seed": [0, 1]})
    counts = run_sweep(late, tmp_path / "late", workers=1, log=QUIET,
                       deadline=Deadline(start_by=time.time() - 1, stop_at=time.time() + 60))
    assert {k: v for k, v in counts.items() if v} == {"pending": 2}
    long = SweepConfig(name="long", base={**base, "steps": 100_000}, grid={"seed": [0]})
    t0 = time.time()
    run_sweep(long, tmp_path / "long", workers=1, log=QUIET, deadline=Deadline(start_by=t0 + 60, stop_at=t0 + 3))
    assert time.time() - t0 < 30
    row = SweepStore(tmp_path / "long" / "sweep.db").rows()[0]
    assert row["status"] == "failed" and "time budget" in row["reason"]


@pytest.mark.parametrize("flag", ["lr=0.1", "layout=peri"])
def test_settings_recommend_decides_are_refused(tmp_path, capsys, flag):
    assert main(["recommend", "nano", "--set", flag, "--out", str(tmp_path / "x")]) == 2
    assert "decided by recommend" in capsys.readouterr().err


def test_a_screen_that_cannot_fit_is_refused_before_it_runs(tmp_path, capsys):
    """The calibration screen takes a second; 15 candidates' screens take far more than a fifth of a
    0.02-minute budget: refused at once with the budget that would do, before any screen or run."""
    model = tmp_path / "deep.toml"
    model.write_text('size = "micro"\n[model]\nn_layers = 8\n')
    assert main(["recommend", str(model), "--budget", "0.02", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "screening 15 candidates at your depth 8 needs about" in err and "give --budget" in err
    assert not (tmp_path / "r" / "grid").exists()
