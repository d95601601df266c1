"""recommend answers the user's question (issue 53): candidates made from the user's placement, the signals
that predict trouble in the ranking, the effect against the user's placement with its interval, how sure
the answer is, where the evidence ends, and a budget that never fails a finished run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pandas as pd
import pytest

from normlab.config.commands import RecommendConfig
from normlab.errors import ConfigError
from normlab.layout import as_layout
from normlab.model.config import ModelConfig
from normlab.recommend.evidence import answer, signals
from normlab.recommend.evidence.rank import Evidence, rank, unranked_if_unfinished
from normlab.recommend.planning import derived
from normlab.recommend.planning.inputs import choose
from normlab.recommend.planning.plan import cheap_order
from normlab.recommend.planning.shape import UserModel
from normlab.recommend.stages.records import StageRecord
from normlab.runs.files import RunDir
from tests.helpers import a_plan

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)


def _user(layout: str | None, config: ModelConfig = TINY) -> UserModel:
    return UserModel(config, "test", layout=layout)


# --- candidates from the user's model ------------------------------------------------------------------


def test_your_model_plus_output_norms_keeps_qk_norm_and_computes_x_plus_n_of_f():
    """Qwen3 + output norms: every block equals x + N_out(F(N_in(x))) with Q and K normed per head (Kim et
    al. 2025 eq. 3 with QK-norm), by hand with the same weights (tests/unit/test_equations.py)."""
    import normlab
    from tests.unit.test_equations import assert_blocks_follow, peri_with

    d = derived.derive("qwen3", "yours+out")
    assert d is not None and d.label == "your model (qwen3) + output norms" and not d.removes
    lay = as_layout(d.name)
    assert lay.block.attn_inner.q and lay.block.attn_inner.k and not lay.embed_norm and lay.final_norm
    model = normlab.build_model(d.name, "nano", seed=0).double()
    assert_blocks_follow(model, peri_with("qk"))


def test_changes_apply_where_they_can_and_presets_keep_their_names():
    assert derived.derive("pre", "yours+out").name == "peri-noemb"
    assert derived.derive("pre", "yours+out+emb").name == "peri"  # Pre-LN plus both is Peri-LN itself
    assert derived.derive("post", "yours+out") is None  # Post-LN normalizes after the add: no output norm site
    assert derived.derive("pre", "yours-qk") is None  # nothing to remove
    no_qk = derived.derive("qwen3", "yours-qk")
    assert no_qk is not None and no_qk.name == "pre" and no_qk.removes
    assert derived.dropped("qwen3", "peri") == ["QK-norm"]
    assert derived.dropped("qwen3", "attn=qkAB,mlp=AB,final") == []
    assert [d.label for d in derived.defaults("gemma2")] == ["your model (gemma2) + embedding norm"]


def test_default_candidates_start_with_the_users_model_and_its_changes_removals_last():
    choice = choose(RecommendConfig(), _user("qwen3"))
    plus_out = "attn=qkAB,mlp=AB,final"
    assert choice.names[:2] == ["qwen3", plus_out] and choice.labels[plus_out].endswith("+ output norms")
    assert choice.removals == ("pre",)  # qwen3 without QK-norm is Pre-LN
    first = tuple(n for n in choice.labels if n not in choice.removals)
    order, _ = cheap_order(choice.names, choice.current, first, choice.removals)
    assert order[:3] == ["qwen3", plus_out, "attn=qkAB,mlp=AB,emb,final"] and order[-1] == "pre"


def test_each_candidate_is_parsed_once_with_its_name_label_and_layout():
    """The choice carries its candidates as typed objects (name, label, layout), in the order of its names."""
    from normlab.recommend.planning.inputs import Candidate, has_streams, unbuildable

    choice = choose(RecommendConfig(), _user("qwen3"))
    assert [c.name for c in choice.candidates] == choice.names
    plus_out = choice.candidate("attn=qkAB,mlp=AB,final")
    assert plus_out.label == choice.labels[plus_out.name] and plus_out.label.endswith("+ output norms")
    assert plus_out.form == as_layout(plus_out.name).to_string() and choice.candidate("qwen3").label == ""
    assert has_streams(choice.candidates) and "pre-mhc" in choice.names  # the defaults hold a stream layout
    assert not has_streams([choice.candidate("qwen3")]) and has_streams([Candidate.of("pre-hc")])
    assert unbuildable(plus_out, _user("qwen3")) is None
    with pytest.raises(KeyError, match="not a candidate"):
        choice.candidate("not-a-layout")


def test_yours_names_in_candidates_and_their_refusals():
    choice = choose(RecommendConfig(candidates=("yours+out",)), _user("qwen3"))
    assert choice.names == ["qwen3", "attn=qkAB,mlp=AB,final"]
    with pytest.raises(ConfigError, match="does not say its placement"):
        choose(RecommendConfig(candidates=("yours+out",)), _user(None))
    with pytest.raises(ConfigError, match=r"unknown change 'yours\+foo'; valid: yours, yours\+out"):
        choose(RecommendConfig(candidates=("yours+foo",)), _user("qwen3"))


# --- the signals that predict trouble ------------------------------------------------------------------


def test_growth_is_the_log_fit_after_step_0_and_steps_to_limit_follow_it():
    """10, 20, 40 at steps 25, 50, 75: doubling every 25 steps = x16 per 100; from 40 to 256 takes
    25 * log2(6.4) = 66.95 steps. The init's value (3 at step 0) is not growth."""
    s = signals.fit([(0, 3.0), (25, 10.0), (50, 20.0), (75, 40.0)], limit=256.0)
    assert s is not None and s.first == 3.0 and s.last == 40.0
    assert s.growth == pytest.approx(16.0, rel=1e-9)
    assert s.steps_to_limit == pytest.approx(25 * math.log2(6.4), rel=1e-9)
    assert signals.fit([(0, 1.0)]) is None


def _probe_run(tmp_path, logits, acts):
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    rows = []
    for step, (lg, act) in enumerate(zip(logits, acts)):
        rows += [
            {"step": 25 * step, "layer": 0, "site": "attn", "metric": "max_logit", "value": lg / 2},
            {"step": 25 * step, "layer": 1, "site": "attn", "metric": "max_logit", "value": lg},
            {"step": 25 * step, "layer": None, "site": "global", "metric": "max_abs", "value": act},
        ]
    run.probes_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_logit_past_256_is_at_risk_in_bf16_not_in_fp16_and_fp16_activations_near_overflow_are(tmp_path):
    """bf16's q.k carries ~2^-8 relative error: past 256 more than a nat; fp16's 2^-11: past 2048. fp16's
    activations within 8x of 65504 (8188) are at risk; bf16 has no overflow in reach."""
    run = _probe_run(tmp_path, [57.0, 300.0, 1218.0], [10.0, 100.0, 9000.0])
    bf16 = signals.run_signals(run, "bf16")
    assert bf16.logit is not None and bf16.logit.last == 1218.0 and bf16.logit.first == 57.0  # max over layers
    assert bf16.at_risk and "past 256" in bf16.risk and "activation" not in bf16.risk
    fp16 = signals.run_signals(run, "fp16")
    assert fp16.at_risk and "logit" not in fp16.risk and "within 8x of fp16's 65,504" in fp16.risk
    calm = signals.run_signals(_probe_run(tmp_path / "b", [5.0, 6.0, 7.0], [1.0, 2.0, 3.0]), "bf16")
    assert not calm.at_risk and calm.risk == ""


def _row(layout: str, **kw) -> Evidence:
    base = dict(screen="stable", screen_detail="", runs=2, finished=2, best_lr=0.01, best_loss=2.0)
    return Evidence(layout=layout, **{**base, **kw})


def test_runs_at_risk_rank_after_failures_and_before_loss():
    risky = _row("peri", best_loss=1.90, at_risk=1)  # trains lower, but one run's logits passed the limit
    calm = _row("qwen3", best_loss=2.10)
    failed = _row("pre", best_loss=1.5, diverged=1)
    assert [r.layout for r in rank([risky, failed, calm])] == ["qwen3", "peri", "pre"]


def test_in_a_tie_the_users_placement_stays_first():
    mine, other = _row("qwen3", best_loss=2.005), _row("peri", best_loss=2.0)
    assert [r.layout for r in rank([other, mine])] == ["peri", "qwen3"]
    assert [r.layout for r in rank([other, mine], prefer="qwen3")] == ["qwen3", "peri"]


def test_a_candidate_with_no_finished_run_is_not_ranked_and_not_failed():
    row = unranked_if_unfinished(_row("qwen3", finished=0, cut=1))
    assert row.status == "not trained" and "1 stopped by the budget" in row.why
    assert rank([row, _row("peri")])[0].layout == "peri" and row.rank is None


# --- the answer sized to its evidence ------------------------------------------------------------------


def test_welch_interval_by_hand():
    """a = 1, 2, 3 and b = 2, 3, 4: d = -1, se^2 = 1/3 + 1/3, Welch df = (2/3)^2 / (2 (1/3)^2 / 2) = 4,
    t(0.975, 4) = 2.7764451: half-width 2.7764451 * sqrt(2/3) = 2.2669."""
    d, iv = answer.welch([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert d == pytest.approx(-1.0)
    assert iv == pytest.approx([-1 - 2.7764451 * math.sqrt(2 / 3), -1 + 2.7764451 * math.sqrt(2 / 3)], rel=1e-6)
    assert answer.welch([1.0], [2.0, 3.0]) == (-1.5, None)


def test_blom_is_close_to_the_exact_expected_best_of_k():
    """E[max of 2 standard normals] = 1/sqrt(pi) = 0.5642; of 6: 1.2672 (tables of normal order statistics)."""
    assert answer.expected_best_of(1) == 0.0
    assert answer.expected_best_of(2) == pytest.approx(1 / math.sqrt(math.pi), abs=0.03)
    assert answer.expected_best_of(6) == pytest.approx(1.2672, abs=0.03)


def _runs(rows):
    return pd.DataFrame(rows, columns=["layout", "lr", "seed", "status", "final_loss"])


def test_effect_against_the_users_placement_with_interval_and_selection():
    runs = _runs(
        [("mine", 0.01, s, "ok", v) for s, v in enumerate([2.10, 2.12, 2.14])]
        + [("new", 0.03, s, "ok", v) for s, v in enumerate([2.00, 2.02, 2.04])]
        + [("new", 0.01, 0, "ok", 3.0)]
    )
    ranked = rank([_row("new", best_lr=0.03, best_loss=2.02), _row("mine", best_lr=0.01, best_loss=2.12)])
    eff = answer.effect(runs, ranked, "mine", n_lrs=2)
    assert eff["status"] == "measured" and eff["baseline"] == "mine" and eff["candidate"] == "new"
    assert eff["difference"] == pytest.approx(-0.10) and eff["seeds"] == [3, 3]
    half = 2.7764451 * math.sqrt(2 * 0.0004 / 3)  # std 0.02 on both sides, Welch df 4
    assert eff["interval"] == pytest.approx([-0.10 - half, -0.10 + half], rel=1e-5)
    sel = eff["selection"]
    assert sel["picked_from"] == 2 and sel["optimism"] == pytest.approx(
        0.02 / math.sqrt(3) * answer.expected_best_of(2)
    )
    p = a_plan(finalists=2, seeds=[0, 1, 2], order=["new", "mine"], screened=["new", "mine"])
    conf = answer.confidence(ranked, [StageRecord("final", 60, 60, 6, 6)], p, eff)
    assert conf.level == "supported" and conf.separable is True and conf.seeds == 3 and conf.not_tried == 0
    cut = answer.confidence(ranked, [StageRecord("final", 60, 60, 6, 4)], p, eff)
    assert cut.level == "provisional" and "the budget cut the final round: 4 of 6" in cut.why[0]
    assert answer.effect(runs, ranked, None, 2)["status"] == "no baseline"


def test_domain_says_where_the_users_setting_leaves_the_record():
    record = {
        "comparisons": [
            {
                "proxy": "p",
                "other": "o",
                "proxy_shape": {
                    "d_model": 64,
                    "n_layers": 6,
                    "tokens": 307200,
                    "precision": "fp16",
                    "optimizer": "adamw",
                },
                "other_shape": {
                    "d_model": 128,
                    "n_layers": 6,
                    "tokens": 1228800,
                    "precision": "fp16",
                    "optimizer": "adamw",
                },
            }
        ]
    }
    qwen = _user("qwen3", TINY.with_(d_model=2048, n_layers=28, n_heads=16))
    dom = answer.domain(qwen, "bf16", "muon", 12, record)
    assert not dom["inside_record"]
    said = " | ".join(dom["differences"])
    assert "yours bf16, measured fp16" in said and "yours muon, measured adamw" in said
    assert "32x the proxy's" in said and "measured up to 2x" in said and "28 layers" in said
    near = _user("pre", TINY.with_(d_model=128, n_layers=6))
    assert answer.domain(near, "fp16", "adamw", 6, record)["inside_record"]
    assert answer.domain(near, "fp16", "adamw", 6, {})["inside_record"] is False  # nothing measured


def test_an_answer_that_differs_from_an_earlier_call_says_so():
    answers = [{"call": 1, "winner": "peri", "confidence": "provisional"}]
    assert answer.changed_from(answers, "qwen3") == answers[0]
    assert answer.changed_from(answers, "peri") is None and answer.changed_from([], "peri") is None


# --- the budget never fails a finished run -------------------------------------------------------------


def test_the_deadline_waits_for_a_run_in_its_closing_evaluation_and_stops_one_still_training(tmp_path, monkeypatch):
    """Two runs at the deadline: one has logged the step before its last (training its last step or in its
    closing evaluation: it ends by itself 2 s later), one is at step 2 of 5. The first is not killed (its
    process ends on its own, so no 'time budget' reason); the second is stopped and says where."""
    from normlab.experiments import runner
    from normlab.experiments.sweep import SweepConfig
    from normlab.runs.files import SweepDir
    from normlab.runs.store import SweepStore

    def fake(root, run_id, threads, gpu=None, cuda=False):
        folder = SweepDir(root).run(run_id).path
        folder.mkdir(parents=True, exist_ok=True)
        seed0 = run_id.startswith("seed0") or "seed0" in run_id
        last = 3 if seed0 else 1  # the trainer logs the last step (4) only after its closing evaluation
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(last + 1)))
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({2 if seed0 else 600})"])

    monkeypatch.setattr(runner, "_spawn", fake)
    sweep = SweepConfig(name="closing", base={"size": "nano", "steps": 5}, grid={"seed": [0, 1]})
    t0 = time.time()
    runner.run_sweep(
        sweep,
        tmp_path / "s",
        workers=2,
        log=lambda *a, **k: None,
        deadline=runner.Deadline(start_by=t0 + 3600, stop_at=t0),
    )
    rows = {r["run_id"]: r for r in SweepStore(tmp_path / "s" / "sweep.db").rows()}
    closing = next(r for k, r in rows.items() if "seed0" in k)
    training = next(r for k, r in rows.items() if "seed1" in k)
    assert "time budget" not in (closing["reason"] or "")
    assert training["status"] == "failed" and "time budget at step 2 of 5" in training["reason"]


def test_the_verify_stage_trains_in_mup_from_the_proxys_width_and_the_recipe_names_it():
    """Wider than the proxy the runs are muP with base width 64 (at the base muP is SP: the proxies are
    unchanged), so the proxy's learning rate is the one muP carries; SGD has no muP rule built: SP, said."""
    from normlab.recommend.planning.inputs import proxy_settings

    user = _user("qwen3")
    assert "model.parametrization" not in proxy_settings(user, 2, "bf16", {}, "adamw")
    wide = proxy_settings(user, 2, "bf16", {}, "muon", width=128)
    assert wide["model.parametrization"] == "mup" and wide["model.base_d_model"] == 64
    assert "model.parametrization" not in proxy_settings(user, 2, "bf16", {}, "sgd", width=128)
    w = _row("peri", best_lr=0.01)
    assert answer.recipe(w)["parametrization"] == "mup" and "model.base_d_model=64" in answer.recipe(w)["words"]
    assert answer.recipe(w, optimizer="sgd")["parametrization"] == "sp"


def test_the_recipe_gives_an_sp_models_learning_rate_for_libraries_without_mup():
    """None of OLMo-core, torchtitan, litgpt has muP: the recipe gives the SP model's rate at the user's width from
    muP's Adam rule (hidden matrices and, without the 1/m readout, the head: base x 64 / width; embeddings and
    gains at base), says so plainly, and that muP itself is normlab's only. Muon's matrices keep the base rate."""
    w = _row("peri", best_lr=0.01)
    rec = answer.recipe(w, width=2048)
    assert rec["sp"]["lr"] == pytest.approx(0.01 * 64 / 2048, rel=1e-12) and rec["sp"]["vector_lr"] == 0.01
    assert rec["sp"]["libraries"] == ["OLMo-core", "torchtitan", "litgpt"] and rec["sp"]["width"] == 2048
    said = rec["sp"]["words"]
    assert said.startswith("For your SP model in ai2-olmo-core 3.0.0, torchtitan 0.3.0, litgpt 0.5.13")
    assert "muP itself is normlab's only" in said and f"lr {0.01 * 64 / 2048:.3g} at width 2048" in said
    assert "embeddings and norm gains at 0.01" in said and said in rec["words"]
    assert "model.parametrization=mup" in rec["words"]  # the normlab recipe is still said first
    narrow = answer.recipe(w, width=32)["sp"]  # narrower than the proxy: the rate rises by the same rule
    assert narrow["lr"] == pytest.approx(0.02, rel=1e-12)
    assert answer.recipe(w, optimizer="muon", width=2048)["sp"]["lr"] == 0.01
    assert answer.recipe(w)["sp"] is None and "sp" not in answer.recipe(w, optimizer="sgd", width=2048)
    assert answer.recipe(_row("peri", best_lr=None), width=2048)["sp"] is None


def test_a_token_budget_beyond_the_record_and_dyts_regime_are_said():
    from normlab.recommend.report.explain import transfer_record

    user = _user("pre")
    dom = answer.domain(user, "fp16", "adamw", 2, transfer_record(), tokens=2 * 10**11, winner="pre-dyt")
    said = " | ".join(dom["differences"])
    assert "tokens: yours 200,000,000,000, measured up to 1,228,800" in said and "arXiv 2604.23434" in said
    calm = answer.domain(user, "fp16", "adamw", 2, transfer_record(), tokens=2 * 10**11, winner="peri")
    assert "regime" not in " | ".join(calm["differences"])


def test_the_recipe_says_how_far_the_records_optimum_moved_under_its_parametrization():
    """The record's fitted optima (normlab.experiments.lr_optimum) per reach, measured factors and one-sided
    bounds kept apart; comparisons under another parametrization or without optima are not counted."""

    def comparison(param: str, other: dict[str, int], optimum: dict[str, dict[str, object]]) -> dict[str, object]:
        return {
            "parametrization": param,
            "proxy_shape": {"d_model": 64, "n_layers": 6},
            "other_shape": other,
            "lr_optimum": optimum,
        }

    record = {
        "comparisons": [
            comparison("mup", {"d_model": 256, "n_layers": 6}, {"pre": {"factor": 1.4, "kind": "measured"}}),
            comparison("mup", {"d_model": 256, "n_layers": 6}, {"peri": {"factor": 1.27, "kind": "measured"}}),
            comparison("sp", {"d_model": 256, "n_layers": 6}, {"peri": {"factor": 0.11, "kind": "at most"}}),
            comparison("sp", {"d_model": 64, "n_layers": 12}, {"pre": {"factor": 0.89, "kind": "measured"}}),
            {"parametrization": "mup", "proxy_shape": {}, "other_shape": {}},  # written before optima were kept
        ]
    }
    mup = answer.lr_transfer(record, "mup")
    assert mup is not None and mup["moved"] == {"4x width": [1.27, 1.4]} and mup["bounds"] == []
    assert "4x width: x1.27 to x1.40" in mup["words"]
    sp = answer.lr_transfer(record, "sp")
    assert sp is not None and sp["moved"] == {"4x width": [], "2x depth": [0.89]}
    assert sp["bounds"] == ["peri at most x0.11"] and "2x depth: x0.89; 4x width: peri at most x0.11" in sp["words"]
    assert answer.lr_transfer(record, "completep") is None
    words = answer.recipe(_row("peri", best_lr=0.01), record=record)["words"]
    assert "under mup with adamw in the transfer record moved 4x width: x1.27 to x1.40" in words
    assert "under sp with adamw" in words
    # an optimizer's rates are its own: a Muon comparison is not pooled with AdamW's, and the reverse
    muon = comparison("mup", {"d_model": 256, "n_layers": 6}, {"pre": {"factor": 0.3, "kind": "measured"}})
    muon["other_shape"]["optimizer"] = "muon"
    record["comparisons"].append(muon)
    adamw = answer.recipe(_row("peri", best_lr=0.01), record=record)["lr_transfer"]
    assert adamw["moved"] == {"4x width": [1.27, 1.4]}
    assert answer.recipe(_row("peri", best_lr=0.01), optimizer="muon", record=record)["lr_transfer"]["moved"] == {
        "4x width": [0.3]
    }
