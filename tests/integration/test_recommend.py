"""`normlab recommend` end to end on a nano model, its resume, its refusals, and the sweep deadline
it runs under."""

import json
import time

import pytest

from normlab.cli import main
from normlab.experiments.runner import Deadline, run_sweep
from normlab.experiments.sweep import SweepConfig
from normlab.runs.store import SweepStore

QUIET = lambda *a, **k: None


@pytest.fixture(autouse=True)
def planted_calibration():
    """This machine's calibration, planted in the (per-test) cache: a step 2 ms plus 20 ps a FLOP, a
    screen 50 ms a layer. The plans below follow from these numbers, never from the clock."""
    from normlab.recommend.planning import cost

    cal = cost.Calibration(c0=0.002, c_flop=2e-11, c_norm=0.0, s0=0.05, s_layer=0.05, s_flop=0.0, seconds=1.0)
    path = cost.cache_file(cost.machine_key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in cal.to_dict().items() if k != "c_stream"}))
    cost.stream_cache_file(cost.machine_key(1)).write_text(json.dumps({"c_stream": {"hc": 1e-9, "mhc": 2e-9}}))
    return cal


def _args(corpus, out, *more):
    return [
        "recommend",
        "nano",
        "--candidates",
        "pre,peri",
        "--precision",
        "fp16",
        "--steps",
        "8",
        "--lrs",
        "0.01,0.1",
        "--seeds",
        "0",
        "--set",
        f"data={corpus}",
        "--set",
        "seq_len=32",
        "--set",
        "batch_size=4",
        "--workers",
        "2",
        "--no-tax-compiled",  # its compilation (30-100 s on a CPU) is tests/unit/test_speedup.py's
        "--out",
        str(out),
        *more,
    ]


def test_recommend_ranks_with_evidence_resumes_and_refuses_changed_inputs(corpus, tmp_path, capsys):
    """Also --verify that the budget cannot buy (a model no wider than the proxy: nothing to verify at): the plan
    says so in one line before anything runs and the recommendation goes on without it; asked again with another
    budget on the finished folder, verifying is all that is asked: refused, one line, exit 2, nothing touched."""
    out = tmp_path / "rec"
    note = "--verify: your model (d 32) is no wider than the proxies; there is no wider width to verify at"
    args = _args(corpus, out, "--verify")
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.index(note) < text.index("1/3 screen")
    assert f"- No verify: {note}" in (out / "recommendation.md").read_text()
    assert json.loads((out / "recommendation.json").read_text())["verify"] == {"status": "not bought", "why": note}
    assert not (out / "verify").exists()
    assert "0/3 plan" in text and "1/3 screen" in text and "2/3 stress round" in text and "3/3 final round" in text
    assert "(cached calibration)" in text and "; 1 left, ETA " in text  # the planted one: nothing timed
    assert "of 15 min]" in text and "2 runs at lr 0.1, seed 0, 2 layers (your depth)" in text
    assert "screen done in" in text and "(predicted 0.0 min)" in text  # each stage: predicted and actual
    rec = json.loads((out / "recommendation.json").read_text())
    ranking = {r["layout"]: r for r in rec["ranking"]}
    assert set(ranking) == {"pre", "peri"} and sorted(r["rank"] for r in rec["ranking"]) == [1, 2]
    for r in rec["ranking"]:  # both finalists: the stress run and the second lr (--lrs fixed: no extension)
        assert r["status"] == "ranked" and r["runs"] == 2 and r["finished"] + r["unfinished"] == 2
        assert r["screen"] in ("stable", "caution", "unstable") and set(r["loss_by_lr"]) <= {"0.01", "0.1"}
    assert rec["winner"] == rec["ranking"][0]["layout"] and set(rec["settings"]) == {
        "normlab",
        "transformers",
        "OLMo-core",
        "torchtitan",
        "litgpt",
    }
    assert any("Width: the proxies are 64 wide" in x for x in rec["limits"])
    assert any("8 steps of 4 x 32 byte tokens" in x for x in rec["limits"])  # the runs' own settings, stated
    a, b = rec["ranking"]  # the caveat counts the runs at hand, not a fixed sentence
    counts = [f"{r['diverged'] + r['stalled']}/{r['finished']}" for r in (a, b)]
    assert any(f"{a['layout']}" in x and counts[0] in x and "small samples" in x for x in rec["limits"])
    assert [r["stage"] for r in rec["rounds"]] == ["screen", "stress", "final"]
    assert all(r["finished"] == r["planned"] for r in rec["rounds"])
    assert any(x.startswith("The final round ran in full: 4 of 4 runs") for x in rec["movement"])
    (check,) = rec["recipe_checks"]  # stress-kim-fp16's peri ahead of pre, compared at its lr 0.1 where both ran
    assert check["claim"] == "peri ahead of pre" and check["at_setting"].startswith("lr 0.1: peri ")
    assert check["agrees_at_setting"] in (True, False) and check["agrees"] == (ranking["peri"]["rank"] == 1)
    md = (out / "recommendation.md").read_text()
    assert (
        "## Evidence (ranked)" in md
        and "where the settings overlap" in md
        and "## What the proxy can and cannot tell" in md
    )
    assert "## What ran, and how far the answer could move" in md and "Ranked first (provisional: " in md
    # the answer sized to its evidence (issue 53): one seed is thin; no placement named, so no effect to measure
    conf = rec["confidence"]
    assert conf["level"] == "provisional" and "one seed: no seed noise measured" in conf["why"]
    assert rec["effect"]["status"] == "no baseline" and rec["recipe"]["layout"] == rec["winner"]
    assert rec["domain"]["inside_record"] in (True, False) and "differences" in rec["domain"]
    if a["screen"] != "stable":  # a verdict short of stable says why
        assert f"screen: {a['screen']} (" in md
    assert (out / "report.html").is_file() and (out / "grid" / "summary.md").is_file()
    plan = json.loads((out / "plan.json").read_text())["plan"]
    assert plan["depth"] == 2 and plan["lrs"] == [0.01, 0.1] and plan["seeds"] == [0] and plan["finalists"] == 2
    assert plan["screened"] == ["peri", "pre"] and plan["predicted"]["total"] > 0  # the cheap order: bounded first

    assert main(args) == 0  # the same command again: nothing is retrained
    again = capsys.readouterr().out
    assert note in again
    assert (
        "4 runs, 4 done, 0 to run" in again
        and json.loads((out / "recommendation.json").read_text())["ranking"] == rec["ranking"]
    )
    assert json.loads((out / "plan.json").read_text())["plan"] == plan  # the first call's plan, reused
    calls = json.loads((out / "plan.json").read_text())["call_minutes"]  # both calls' time, the first's kept
    assert len(calls) == 2 and calls[0] == pytest.approx(rec["minutes"], abs=0.1) and calls[1] > 0
    assert f"min over 2 calls ({calls[0]:.1f}, " in (out / "recommendation.md").read_text()

    before = (out / "recommendation.json").read_bytes()
    assert main([*args, "--budget", "30"]) == 2  # verify alone, on a done folder
    err = capsys.readouterr().err.strip()
    assert err.endswith(note) and len(err.splitlines()) == 1
    assert (out / "recommendation.json").read_bytes() == before

    assert main([*args, "--steps", "9"]) == 2  # another input: refused, nothing touched
    assert "other inputs (changed: base)" in capsys.readouterr().err


def test_a_second_fresh_call_plans_the_same_grid(corpus, tmp_path, capsys):
    """Planned from counted work and the cached calibration: two folders, the same plan."""
    from normlab.recommend.planning import cost, plan
    from normlab.recommend.planning.shape import read_user_model

    cal, _ = cost.calibration(1, log=QUIET)
    user = read_user_model("micro")
    plans = [plan.make_plan(["pre", "peri", "post", "olmo2"], None, user.config, cal, 240, 2, 150) for _ in range(2)]
    assert plans[0] == plans[1] and plans[0].finalists >= 2


def _nothing_written(path):
    return not path.exists() or not any(path.iterdir())


@pytest.mark.parametrize(
    "more,needle",
    [
        (["--budget", "1e-9"], "cannot hold the smallest answer"),
        (["--candidates", "pre,peri,pre"], "'pre' is given twice; give each placement once"),
        (["--candidates", "pre;attn=A,mlp=A,final"], "'pre' and 'attn=A,mlp=A,final' are the same placement"),
        (["--depth", "100000"], "--depth 100000 is deeper than your model (2 layers)"),
        (["--set", "model.n_layers=1000000"], "--set model.n_layers=... is decided by recommend"),
        (["--set", "tokenizer=bpe:1000000000"], "--set tokenizer=... is decided by recommend"),
        (["--set", "data=/no/such/file.txt"], "data path /no/such/file.txt does not exist"),
        (["--set", "lr=0.1"], "--set lr=... is decided by recommend"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_is_screened_or_written(
    corpus, tmp_path, capsys, more, needle
):
    out = tmp_path / "r"
    args = ["recommend", "nano", "--candidates", "pre,peri", "--set", f"data={corpus}", "--out", str(out)]
    if "--candidates" in more:
        args = args[:2] + args[4:]
    assert main(args + more) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert _nothing_written(out)


def test_absurd_shapes_and_counts_are_refused_at_once_with_the_budget_that_would_do(tmp_path, capsys, monkeypatch):
    """At once: refused from counted work, before anything is screened, trained or measured (the calls are
    counted, not timed)."""
    from normlab.experiments import runner
    from normlab.recommend.planning import cost
    from normlab.recommend.stages import screen as stage_screen

    work: list[str] = []
    monkeypatch.setattr(stage_screen, "screen_candidates", lambda *a, **k: work.append("screen"))
    monkeypatch.setattr(runner, "run_sweep", lambda *a, **k: work.append("sweep"))
    monkeypatch.setattr(cost, "measure", lambda *a, **k: work.append("calibration"))
    deep, wide = tmp_path / "deep.toml", tmp_path / "wide.toml"
    deep.write_text('size = "tiny"\n[model]\nn_layers = 10000\n')
    wide.write_text('size = "tiny"\n[model]\nd_ff = 10000000\n')
    for model, needle in ((deep, "screen's model at your depth 10000 needs"), (wide, "GiB")):
        assert main(["recommend", str(model), "--budget", "2", "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1
    many = ";".join(f"peri,h={0.001 * (i + 1):.3f}" for i in range(300))  # 300 distinct placements
    assert main(["recommend", "micro", "--candidates", many, "--budget", "0.2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--budget 0.2 min cannot hold the smallest answer" in err and "give --budget" in err
    assert "fewer --candidates" not in err  # advice that can be followed
    assert work == [] and _nothing_written(tmp_path / "r")


def test_no_recommendation_from_nothing(corpus, tmp_path, capsys, monkeypatch):
    """Every proxy run fails (here: each run's process is refused at once): exit 2, one line, no
    recommendation written."""
    from normlab.experiments import runner

    def refuse(root, run_id, threads, gpu=None, cuda=False):
        import subprocess
        import sys

        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(runner, "_spawn", refuse)
    out = tmp_path / "rec"
    assert main(_args(corpus, out)) == 2
    err = capsys.readouterr().err.strip()
    assert "no candidate finished a run" in err and len(err.splitlines()) == 1
    assert not (out / "recommendation.md").exists() and not (out / "recommendation.json").exists()


def test_a_screen_the_budget_never_started_is_said_as_such(corpus, tmp_path, capsys, monkeypatch):
    """Issue 63 item 7: no screen started (the budget's time for it was spent before): the refusal says so with
    the minutes used, never "this machine ran 0x slower than its calibration"."""
    from normlab.recommend.stages import screen as stage_screen
    from normlab.recommend.stages.records import ScreenRecord

    monkeypatch.setattr(stage_screen, "screen_candidates", lambda *a, **k: ScreenRecord(width=64, n_layers=2))
    assert main(_args(corpus, tmp_path / "rec")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the budget ran out before the screen started: " in err
    assert "of 15 min were used before it" in err and "0x" not in err and "slower" not in err


def test_two_recommends_on_one_folder_the_second_is_refused_and_the_records_kept(corpus, tmp_path, capsys):
    from normlab.io import own_folder
    from normlab.runs.files import RecommendDir
    from normlab.runs.start import FolderLock

    out = tmp_path / "rec"
    own_folder(out, "recommend")
    held = FolderLock(RecommendDir(out).lock_file, wait=0, busy=str)  # another call, running
    try:
        assert main(_args(corpus, out)) == 2
        assert "another normlab recommend is running" in capsys.readouterr().err
        assert not (out / "plan.json").exists()
    finally:
        held.release()


def test_sweep_deadline_leaves_unstarted_runs_pending_and_stops_running_ones(corpus, tmp_path, monkeypatch):
    base = dict(data=str(corpus), size="nano", seq_len=32, batch_size=4, eval_every=0, eval_batches=1, probe_every=0)
    late = SweepConfig(name="late", base={**base, "steps": 5}, grid={"seed": [0, 1]})
    counts = run_sweep(
        late,
        tmp_path / "late",
        workers=1,
        log=QUIET,
        deadline=Deadline(start_by=time.time() - 1, stop_at=time.time() + 60),
    )
    assert {k: v for k, v in counts.items() if v} == {"pending": 2}
    long = SweepConfig(name="long", base={**base, "steps": 100_000}, grid={"seed": [0]})
    t0 = time.time()  # start_by an hour on: the run starts however slow the sweep's own start is
    said: list[str] = []
    run_sweep(
        long, tmp_path / "long", workers=1, log=said.append, deadline=Deadline(start_by=t0 + 3600, stop_at=t0 + 3)
    )
    row = SweepStore(tmp_path / "long" / "sweep.db").rows()[0]  # stopped, not trained to its 100,000th step
    assert row["status"] == "failed" and "time budget" in row["reason"]
    # issue 63 item 7: every summary says it as the ranking does, "stopped by the budget", never "failed"
    from normlab.experiments.summary import summarize
    from normlab.runs.outcome import describe

    assert said[-1] == "sweep long: 1 stopped by the budget" and describe(row).startswith(
        "stopped by the budget at step"
    )
    from normlab import pages

    drawn: dict[str, list[str]] = {}
    save = pages.figure_html

    def figure_html(fig, out, key, title):
        drawn[key] = [title, *(ax.get_title() for ax in fig.axes)]
        return save(fig, out, key, title)

    monkeypatch.setattr(pages, "figure_html", figure_html)
    summarize(tmp_path / "long")
    # issue 63 item 10: no cell trained to the end, so no empty "Loss by cell" chart beside the divergences
    assert drawn["cells"] == ["Divergences by cell (no cell trained to the end)", "Divergences and stalls (k/n)"]
    md = (tmp_path / "long" / "summary.md").read_text()
    assert "- runs: 1 (1 stopped by the budget)" in md and "| stopped by the budget |" in md
    assert "| failed |" not in md.split("## Diverged")[1]


@pytest.mark.parametrize("flag", ["lr=0.1", "layout=peri"])
def test_settings_recommend_decides_are_refused(tmp_path, capsys, flag):
    assert main(["recommend", "nano", "--set", flag, "--out", str(tmp_path / "x")]) == 2
    assert "decided by recommend" in capsys.readouterr().err


def _wide_model(tmp_path):
    """A 2-layer config.json 256 wide: the proxies are 64 wide, the verify stage can go to 128 or 256."""
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "intermediate_size": 512,
                "vocab_size": 256,
                "hidden_act": "silu",
                "tie_word_embeddings": True,
            }
        )
    )
    return path


@pytest.mark.long
def test_verify_trains_the_best_at_a_wider_width_and_says_whether_the_order_held(corpus, tmp_path, capsys):
    """--verify with --optimizer sgd: the plan counts the stage before anything runs; the best 2 train again at
    the widest width that fits, at the winner's best lr, and the recommendation says whether the order held,
    with Kendall's tau from the two orders (tau = +1 for the same order of 2, -1 for the reverse)."""
    out = tmp_path / "rec"
    args = _args(corpus, out, "--verify", "--optimizer", "sgd")
    args[1] = str(_wide_model(tmp_path))
    args[args.index("0.01,0.1")] = "0.1"  # one learning rate: no final round, the stress runs ranked (faster)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "optimizer sgd" in text and "\nverify [" in text and "(the winner's best)" in text
    plan = json.loads((out / "plan.json").read_text())["plan"]
    v = plan["verify"]
    assert plan["optimizer"] == "sgd" and v["k"] == 2 and v["width"] in (128, 256) and plan["predicted"]["verify"] > 0
    assert plan["predicted"]["total"] == pytest.approx(sum(x for k, x in plan["predicted"].items() if k != "total"))
    rec = json.loads((out / "recommendation.json").read_text())
    got = rec["verify"]
    assert rec["optimizer"] == "sgd" and got["status"] == "done" and got["width"] == v["width"]
    ranked = [r["layout"] for r in rec["ranking"] if r["rank"] is not None]
    assert got["proxy_order"] == ranked[:2] and sorted(got["verify_order"]) == sorted(ranked[:2])
    assert got["tau"] == (1.0 if got["verify_order"] == ranked[:2] else -1.0)
    assert got["held"] == (got["tau"] == 1.0) and got["top1"] == (got["verify_order"][0] == ranked[0])
    assert sum(got["failures"].values()) == 2  # one (layout, lr) cell each, both trained at the winner's best lr
    assert [r["stage"] for r in rec["rounds"]][-1] == "verify"
    from normlab.experiments.summary import load_sweep

    wide, _ = load_sweep(out / "verify")
    assert len(wide) == 2 and set(wide.layout) == set(ranked[:2]) and set(wide.lr) == {got["lr"]}
    md = (out / "recommendation.md").read_text()
    assert "## Did the order hold at a larger width? (--verify)" in md and got["words"] in md
    assert "- optimizer: sgd" in md and "## How often the proxies have been right" in md
    page = (out / "report.html").read_text()
    assert "Did the order hold at a larger width?" in page and "How often the proxies have been right" in page
    assert "<pre><code>" in page  # the winner's snippets, escaped, as code blocks


def test_an_unknown_optimizer_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: one line, exit 2
        main(["recommend", "nano", "--optimizer", "adam", "--out", str(tmp_path / "r")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "adam" in err and "adamw" in err and "muon" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()
    assert main(["recommend", "nano", "--set", "optimizer=muon", "--out", str(tmp_path / "r")]) == 2
    assert "give it through --optimizer" in capsys.readouterr().err


def test_quick_question_your_model_against_it_plus_output_norms(corpus, tmp_path, capsys):
    """--quick: the user's Qwen3-shaped model (QK-norm) against itself + output norms, no screen, two seeds:
    the answer states how sure it is, the effect against the user's placement with its interval, the recipe
    and where the evidence ends (bf16 is inside the record since its bf16 + Muon rung)."""
    model = tmp_path / "model.toml"
    model.write_text('size = "nano"\nlayout = "qwen3"\n')
    args = _args(corpus, tmp_path / "rec", "--quick")
    args[1] = str(model)
    args[args.index("--precision") + 1] = "bf16"
    args[args.index("--seeds") + 1] = "0,1"
    args[args.index("--lrs") + 1] = "0.1"
    del args[args.index("--candidates") : args.index("--candidates") + 2]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1/3 screen" in out and "none (--quick)" in out
    rec = json.loads((tmp_path / "rec" / "recommendation.json").read_text())
    plus_out = "attn=qkAB,mlp=AB,final"  # the user's QK-norm kept
    # issue 63 item 9: the progress lines name it yours+out, never by its string form; one lr is not an optimum
    progress = out.split("# normlab recommend")[0]
    assert "none (--quick): qwen3, yours+out go straight to training" in progress and plus_out not in progress
    assert "yours+out_lr0.1_seed0-" in progress and "attn-qkAB" not in progress
    assert {r["layout"]: r["short"] for r in rec["ranking"]} == {"qwen3": "", plus_out: "yours+out"}
    assert "lr 0.1 (the only learning rate tried: not an optimum) at the proxy's width" in rec["recipe"]["words"]
    assert [r["layout"] for r in rec["ranking"]] in (["qwen3", plus_out], [plus_out, "qwen3"])
    assert rec["labels"] == {plus_out: "your model (qwen3) + output norms"} and rec["dropped"] == []
    assert not (tmp_path / "rec" / "screen.json").exists()
    eff = rec["effect"]
    assert eff["baseline"] == "qwen3" and eff["seeds"] == [2, 2] and len(eff["interval"]) == 2
    assert eff["interval"][0] <= eff["difference"] <= eff["interval"][1]
    assert rec["confidence"]["level"] in ("provisional", "supported") and rec["confidence"]["seeds"] == 2
    assert rec["recipe"]["layout"] == rec["winner"] and rec["recipe"]["lr"] == 0.1
    assert rec["recipe"]["sp"]["lr"] == pytest.approx(0.1 * 64 / 32) and rec["recipe"]["sp"]["width"] == 32  # nano
    differences = rec["domain"]["differences"]
    assert not any("precision" in d for d in differences)  # bf16 measured (transfer-muon-bf16-*)
    assert rec["domain"]["inside_record"] == (not differences)
    md = (tmp_path / "rec" / "recommendation.md").read_text()
    proxy_line = next(line for line in md.splitlines() if line.startswith("- proxy:"))
    assert "yours+out" in proxy_line and plus_out not in proxy_line  # issue 63 item 9: by its name
    assert "effective speedup of " + plus_out not in md
    assert "Against your placement qwen3" in md or rec["winner"] == "qwen3"
    assert ("Outside what the transfer record measured" in md) == bool(differences) and "FP16 maximum" not in md
    for r in rec["ranking"]:  # the signals that predict trouble, per candidate
        assert r["logit_last"] is not None and r["logit_first"] is not None and r["at_risk"] >= 0
    # the answer in compute: the speedup of the change against the user's placement, with its interval and the norm
    # tax timed at the user's shape (nano's width) on this machine, and the gate's verdict leading the markdown
    sp = eff["speedup"]
    assert (sp["baseline"], sp["candidate"]) == ("qwen3", plus_out) and sp["seeds"] == [2, 2]
    assert sp["value"] > 0 and sp["interval"][0] <= sp["value"] <= sp["interval"][1]
    tax = sp["tax"]
    assert tax["device_type"] == "cpu" and tax["bound"] == "lower" and tax["shape"]["d_model"] == 32  # nano
    assert sp["by_scale"][0]["width"] == 64 and sp["projection"]["value"] is None
    assert rec["verdict"]["decision"] in ("change", "keep")
    lead = md.split("\n\n")[2]  # after the title and the inputs
    assert lead.startswith("**Change to" if rec["verdict"]["decision"] == "change" else "**Keep your qwen3**")


@pytest.mark.long
def test_the_ladder_trains_both_at_three_widths_and_projects_the_speedup(corpus, tmp_path, capsys):
    """A budget that buys the ladder: the user's placement and its rival trained again at widths 32 and 128
    (muP from the proxy's 64, tokens growing with width), the speedup at each rung, the trend and its projection
    to the user's scale with an interval, ladder.png, and the gate reading the largest rung."""
    model = tmp_path / "model.toml"
    model.write_text('size = "nano"\nlayout = "pre"\n')
    args = _args(corpus, tmp_path / "rec", "--budget", "60")
    args[1] = str(model)
    args[args.index("--seeds") + 1] = "0,1"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ladder [" in out and "ladder done" in out
    rec = json.loads((tmp_path / "rec" / "recommendation.json").read_text())
    plan_ = rec["plan"]
    assert rec["rounds"][-1]["stage"] == "ladder" and rec["rounds"][-1]["planned"] == 8
    sp = rec["effect"]["speedup"]
    assert [r["width"] for r in sp["by_scale"]] == [32, 64, 128]
    for r in sp["by_scale"]:
        assert r["compute"] > 0 and r["seeds"] == [2, 2]
    # compute grows with width: tokens x2 a rung (8 steps is the floor at 32) and the FLOPs a token with it
    assert sp["by_scale"][0]["compute"] < sp["by_scale"][1]["compute"] < sp["by_scale"][2]["compute"]
    proj = sp["projection"]
    if proj["value"] is not None:  # three finite rungs: an interval (a bound at a rung leaves it out, said)
        assert proj["interval"][0] <= proj["value"] <= proj["interval"][1] and proj["trend"] in (
            "grows",
            "holds",
            "shrinks",
        )
    else:
        assert proj["left_out"] and "three" in proj["why"]
    assert (tmp_path / "rec" / "ladder.png").stat().st_size > 0
    assert (tmp_path / "rec" / "ladder" / f"w128-lr{rec['ranking'][0]['best_lr']:g}").is_dir() or any(
        (tmp_path / "rec" / "ladder").iterdir()
    )
    widest = sp["largest_rung"]  # the gate reads the widest rung, with the failures counted over every rung
    assert widest["width"] == 128 and set(widest["ladder_failures"]) == {"pre", "peri"}
    assert widest["value"] == sp["by_scale"][2]["value"] and widest["interval"] == sp["by_scale"][2]["interval"]
    for r in sp["by_scale"][::2]:  # the rungs the ladder trained: what each side's runs did
        assert r["runs"]["pre"]["finished"] + r["runs"]["peri"]["finished"] == 4
    assert "by scale: d 32" in (tmp_path / "rec" / "recommendation.md").read_text()
    assert plan_["depth"] >= 1
    # the projection checked against a rung the ladder did not see: 2x its widest width, 4x that rung's tokens
    from normlab.recommend.evidence import holdout

    held = holdout.holdout(tmp_path / "rec", tmp_path / "held", workers=2, log=QUIET)
    assert held["heldout"]["width"] == 256 and held["heldout"]["steps"] == 4 * plan_["ladder"]["steps"]["128"]
    assert held["heldout"]["compute"] > sp["by_scale"][-1]["compute"]
    assert held["ladder"] == [32, 64, 128] and held["measured"]["seeds"] == [2, 2]
    if held["measured"]["value"] is not None and held["projected"]["interval"] is not None:
        lo, hi = held["projected"]["interval"]
        assert held["inside"] == (lo <= held["measured"]["value"] <= hi)
    assert "held-out d 256" in holdout.words(held) and (tmp_path / "held" / "holdout.json").is_file()
