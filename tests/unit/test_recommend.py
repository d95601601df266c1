"""`normlab recommend`'s parts: reading the user's model, the proxy shapes, the budget plan, the ranking
rule, the recipe checks and the winner's settings in other code bases."""

import json
import math

import pytest

from normlab.errors import ConfigError
from normlab.experiments.runner import prepare
from normlab.experiments.summary import load_sweep
from normlab.experiments.sweep import SweepConfig
from normlab.model.config import SIZES, ModelConfig
from normlab.recommend.evidence import agreement
from normlab.recommend.evidence.rank import Evidence, evidence_from_grid, rank, ruled_out
from normlab.recommend.frameworks.snippets import settings_for
from normlab.recommend.planning import plan, work
from normlab.recommend.planning.shape import proxy_shape, read_user_model, screen_shape
from tests.helpers import a_plan, a_recommendation

LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


# --- the user's model -----------------------------------------------------------------------------


def test_reads_a_llama_config_json_through_its_adapter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    user = read_user_model(str(tmp_path))  # the folder, or the file
    c = user.config
    assert (c.n_layers, c.d_model, c.n_heads, c.kv_heads, c.ffn_dim, c.vocab_size) == (12, 256, 8, 2, 688, 32000)
    assert c.mlp == "swiglu" and not c.tie_embeddings
    assert user.layout == "pre" and user.precision == "fp16"  # Llama is Pre-LN; torch_dtype float16
    assert read_user_model(str(tmp_path / "config.json")).config == c


def test_reads_the_language_model_of_a_multimodal_config_and_unknown_types_by_field_names(tmp_path):
    nested = {"model_type": "llava", "torch_dtype": "bfloat16", "text_config": {**LLAMA, "torch_dtype": None}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    user = read_user_model(str(tmp_path / "config.json"))
    assert user.config.n_layers == 12 and user.layout == "pre" and user.precision == "bf16"
    assert any("text_config" in n for n in user.notes)
    neox = {
        "model_type": "gpt_neox",
        "num_hidden_layers": 6,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 50432,
        "hidden_act": "gelu",
        "tie_word_embeddings": False,
    }
    (tmp_path / "neox.json").write_text(json.dumps(neox))
    user = read_user_model(str(tmp_path / "neox.json"))
    assert (user.config.n_layers, user.config.d_model, user.config.ffn_dim, user.config.mlp) == (6, 128, 512, "gelu")
    assert user.layout is None and any("placement unknown" in n for n in user.notes)


def test_reads_size_presets_and_toml(tmp_path):
    assert read_user_model("kim-400m").config == SIZES["kim-400m"]
    (tmp_path / "m.toml").write_text('size = "micro"\nlayout = "peri"\n[model]\nn_layers = 24\n')
    user = read_user_model(str(tmp_path / "m.toml"))
    assert user.config.n_layers == 24 and user.config.d_model == 64 and user.layout == "peri"


@pytest.mark.parametrize(
    "content,name,match",
    [
        ('{"model_type": "x", "hidden_size": 64}', "config.json", "no n_layers, n_heads found"),
        ("not json", "config.json", "config.json is not JSON"),
        ('size = "micro"\nlayout = "perri"\n', "m.toml", "perri"),
        ('size = "micro"\nwidth = 3\n', "m.toml", "unknown key"),
    ],
)
def test_bad_model_files_say_what_is_wrong(tmp_path, content, name, match):
    (tmp_path / name).write_text(content)
    with pytest.raises((ConfigError, ValueError), match=match):
        read_user_model(str(tmp_path / name))


def test_unknown_model_names_the_valid_forms():
    with pytest.raises(ConfigError, match="size preset, a .toml file or a config.json; valid size presets: nano"):
        read_user_model("llama-7b")


def test_a_config_with_vocab_size_0_is_refused_in_one_line_without_transformers_warnings(tmp_path, capfd):
    """Issue 63 item 12: transformers warns on the token ids past a vocabulary of 0 while it builds the config;
    the refusal is normlab's one line alone."""
    from normlab.cli import main

    body = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(body))
    assert main(["recommend", str(tmp_path / "config.json"), "--out", str(tmp_path / "r")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab_size" in err[0] and not (tmp_path / "r").exists()


def test_tokens_in_e_notation_are_the_integer_they_name_and_fractions_are_refused():
    """Issue 63 item 11: `--tokens 2e11`, the help's own example, is an integer; 2.5e0 names none."""
    from normlab.config.commands import RecommendConfig
    from normlab.settings import check_leaf, leaves

    leaf = leaves(RecommendConfig)["tokens"]
    assert check_leaf(leaf, "2e11", from_text=True) == 200_000_000_000
    assert check_leaf(leaf, "1.5e3", from_text=True) == 1500 and check_leaf(leaf, "12", from_text=True) == 12
    for bad in ("2.5e0", "1e-3", "nan", "inf", "1e999999999", "two"):
        with pytest.raises(ConfigError, match="expected an integer"):
            check_leaf(leaf, bad, from_text=True)
    with pytest.raises(ConfigError, match="must be > 0"):
        check_leaf(leaf, "0e5", from_text=True)


def test_proxy_keeps_the_users_ratios_and_the_screen_their_shape():
    user = ModelConfig(
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        vocab_size=128256,
        mlp="geglu-tanh",
        logit_softcap=30.0,
        tie_embeddings=True,
    )
    p = ModelConfig(**proxy_shape(user, 12))
    assert (p.d_model, p.n_layers, p.n_heads, p.head_dim) == (64, 12, 4, 16)
    assert p.ffn_dim / p.d_model == user.ffn_dim / user.d_model  # 4.0 kept
    assert p.n_heads // p.kv_heads == user.n_heads // user.kv_heads  # the GQA ratio 4 kept
    assert p.mlp == "geglu-tanh" and p.logit_softcap == 30.0 and p.tie_embeddings and p.vocab_size == 256
    s = ModelConfig(**screen_shape(user, 2048, 64))
    assert s.with_(vocab_size=user.vocab_size, max_seq_len=user.max_seq_len) == user  # the user's own shape
    s = ModelConfig(**screen_shape(user, 256, 64))
    assert (s.n_layers, s.d_model, s.head_dim, s.ffn_dim) == (16, 256, 64, 1024)  # scaled: depth, head width kept


# --- the cost model and the plan ------------------------------------------------------------------


def test_counted_work_is_the_palm_count_of_the_built_model_and_the_norm_sites():
    """F = tokens x (6 N + 12 L H Q T) with N the model's own matrix weights (mfu.flops_per_token on the
    built model); E: Peri-LN's norm elements per token exceed Pre-LN's by its two output norms per layer
    and the embedding norm (d each)."""
    from normlab.model import build_model
    from normlab.train.mfu import flops_per_token

    cfg = ModelConfig(**proxy_shape(ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=688), 4))
    for layout in ("pre", "peri", "pre-gate"):
        model = build_model(layout, "micro", seed=0, **cfg.to_dict())
        f, _ = work.step_work(cfg, layout, tokens=10, seq=128)
        assert f == 10 * flops_per_token(model, 128)
    _, e_pre = work.step_work(cfg, "pre", tokens=1)
    _, e_peri = work.step_work(cfg, "peri", tokens=1)
    assert e_pre == cfg.d_model * (2 * 4 + 1) and e_peri - e_pre == cfg.d_model * (2 * 4 + 1)


def test_calibration_fit_recovers_planted_rates_and_predicts_runs_and_screens():
    from normlab.recommend.planning import cost

    c0, c_flop, c_norm, s0, s_layer, s_flop = 0.01, 2e-11, 3e-9, 0.1, 0.3, 4e-9
    ref = cost.REFERENCE_SHAPE
    step = lambda n, lay: (
        c0
        + c_flop * work.step_work(ref.with_(n_layers=n), lay)[0]
        + c_norm * work.step_work(ref.with_(n_layers=n), lay)[1]
    )
    scr = lambda w, n: s0 + n * (s_layer + s_flop * work.block_work(cost._screen_shape(w, n)))
    cal = cost.fit(step(2, "pre"), step(6, "pre"), step(6, "peri"), scr(64, 1), scr(64, 3), scr(256, 1))
    for got, want in zip(
        (cal.c0, cal.c_flop, cal.c_norm, cal.s0, cal.s_layer, cal.s_flop), (c0, c_flop, c_norm, s0, s_layer, s_flop)
    ):
        assert got == pytest.approx(want, rel=1e-6)
    user = ModelConfig(**proxy_shape(ModelConfig(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192), 12))
    f, e = work.step_work(user, "peri")
    assert cal.run_seconds(user, "peri", 150) == pytest.approx(
        cost.RUN_OVERHEAD_S * cal.speed + cost.STEP_FACTOR * 150 * (c0 + c_flop * f + c_norm * e)
    )
    assert cal.speed == pytest.approx(step(12, "peri") / cost.REFERENCE_STEP_S)
    noisy = cost.fit(0.2, 0.1, 0.1, 1.0, 0.5, 0.5)  # a slower short model: rates clamped at zero, never negative
    assert min(noisy.c_flop, noisy.c_norm, noisy.s_layer, noisy.s_flop) == 0.0


def test_calibration_is_measured_once_per_machine_and_read_from_the_cache(monkeypatch):
    """The calibration and the stream rates are measured once and cached, in two files (the stream rates with the
    timings they come from); one cached without stream rates keeps its rates and gets those alone."""
    from dataclasses import replace

    from normlab.recommend.planning import cost

    planted = cost.Calibration(0.01, 1e-11, 0.0, 0.1, 0.2, 0.0, seconds=3.0, key=cost.machine_key(1))
    calls, stream_calls = [], []
    monkeypatch.setattr(cost, "measure", lambda threads=1: calls.append(threads) or planted)
    streams = (0.2, {"hc": 0.4, "mhc": 0.6})  # Pre-LN's 6-layer step and each mix's, timed together
    monkeypatch.setattr(
        cost, "measure_streams", lambda threads=1, mixes=cost.STREAM_MIXES: stream_calls.append(threads) or streams
    )
    want = cost.with_stream_rates(planted, *streams)
    alone, cached = cost.calibration(1, log=lambda *a: None, streams=False)  # no candidate with streams
    assert alone == planted and not cached and calls == [1] and not stream_calls
    first, cached = cost.calibration(1, log=lambda *a: None)
    assert first == want and cached and calls == [1] and stream_calls == [1]
    assert "c_stream" not in json.loads(cost.cache_file(cost.machine_key(1)).read_text())
    again, cached = cost.calibration(1, log=lambda *a: None)
    assert again == want and cached and calls == [1] and stream_calls == [1]  # not measured again
    assert cost.machine_key(1) != cost.machine_key(2)  # the thread count is part of the key
    cost.stream_cache_file(cost.machine_key(1)).unlink()  # a calibration cached before the stream rates
    said = []
    third, cached = cost.calibration(1, log=said.append)
    assert third == want and cached and calls == [1] and stream_calls == [1, 1] and "step rates of hc, mhc" in said[0]
    assert replace(third, c_stream={}) == planted


def test_hyper_connections_are_priced_per_stream_element_at_their_calibrated_rates():
    """S = tokens x 2 L x n x d; a mix's rate is its 6-layer step's share beyond Pre-LN's, times the calibration's
    own Pre-LN step, over S: a stream rate measured on a loaded machine (both steps 3x slower) is the same."""
    from normlab.recommend.planning import cost

    cal = cost.Calibration(0.01, 2e-11, 3e-9, 0.1, 0.2, 0.0, seconds=1.0)
    six = cost.REFERENCE_SHAPE.with_(n_layers=6)
    s6 = 16 * 128 * 2 * 6 * 4 * 64
    assert work.stream_work(six, "pre-mhc") == ("mhc", float(s6)) and work.stream_work(six, "pre") == ("", 0.0)
    rated = cost.with_stream_rates(cal, 0.3, {"hc": 0.6, "mhc": 0.9})
    pre6 = cal.step_seconds(six, "pre")
    assert rated.c_stream["hc"] == pytest.approx(pre6 * (0.6 / 0.3 - 1) / s6)
    assert rated.c_stream["mhc"] == pytest.approx(pre6 * (0.9 / 0.3 - 1) / s6)
    assert cost.with_stream_rates(cal, 0.9, {"hc": 1.8, "mhc": 2.7}).c_stream == pytest.approx(rated.c_stream)
    proxy = ModelConfig(**proxy_shape(LLAMA_1B, 12))
    s12 = 16 * 128 * 2 * 12 * 4 * 64
    for layout, mix in (("pre-hc", "hc"), ("pre-mhc", "mhc"), ("pre,streams=2,mix=mhc", "mhc")):
        n = 2 if "streams=2" in layout else 4
        assert rated.step_seconds(proxy, layout) == pytest.approx(
            rated.step_seconds(proxy, "pre") + rated.c_stream[mix] * s12 * n / 4
        )
    assert rated.step_seconds(proxy, "peri") == cal.step_seconds(proxy, "peri")  # one stream: as before


def test_makespan_deals_the_longest_runs_first():
    from normlab.recommend.planning.cost import makespan

    assert makespan([2, 3, 2, 3, 2], 2) == 7  # 3 | 3, then 2 to each (5 | 5), then the last 2: 7
    assert makespan([5, 1, 1, 1, 1, 1], 2) == 5 and makespan([4], 3) == 4 and makespan([], 2) == 0.0


def _flat(step_s=0.275, screen_s=5.0):
    """A planted calibration: every training step `step_s`, every screen `screen_s` (speed 1 at 0.275)."""
    from normlab.recommend.planning.cost import Calibration

    return Calibration(c0=step_s, c_flop=0.0, c_norm=0.0, s0=screen_s, s_layer=0.0, s_flop=0.0, seconds=1.0)


LLAMA_1B = ModelConfig(
    d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256, tie_embeddings=True
)
SIX = ["pre", "peri", "post", "olmo2", "deepnorm", "qwen3", "hybrid", "pre-gate"]


def test_the_plan_from_numbers_a_small_budget_buys_a_smaller_answer():
    """Each run 8 + 150 x 0.275 = 49.25 s, each screen 5 s, each training round 20 s beyond its runs, 2 workers,
    reserves 30 s: a budget of B s leaves (B - 30) x 0.85 to fill. At 6 min (280.5 s): 6 candidates (30 s of
    screens, a stress round of 3 waves, 147.75 + 20 s) and a final round of 2 finalists at a second lr (1 wave,
    49.25 + 20 s): 267 s; a third finalist (2 waves: 98.5 + 20 s, 316.25 s in all) does not fit."""
    run = 8 + 150 * 0.275
    p = plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 6 * 60, 2, 150)
    assert p.screened == ["pre", "peri", "post", "qwen3", "olmo2", "deepnorm"]  # the cheap screen's order
    assert (p.depth, p.steps, p.finalists, p.lrs, p.seeds, p.extend, p.screen_width) == (
        12,
        150,
        2,
        [0.01, 0.1],
        [0],
        False,
        64,
    )
    assert p.predicted["stress"] == pytest.approx(3 * run + 20) and p.predicted["final"] == pytest.approx(run + 20)
    assert p.predicted["total"] == pytest.approx(30 + 3 * run + 20 + run + 20 + 30)
    assert any("6 of 8 candidates" in c and "hybrid, pre-gate" in c for c in p.cut)
    # the budget that buys the interval: 2 finalists x 2 lrs x 2 seeds (3 more runs each: 3 waves) beside the same
    # screen and stress round, (30 + 3 x 49.25 + 20 + 3 x 49.25 + 20) / 0.85 + 30 = 460 s: 8 min
    assert "one seed: no seed noise measured (--budget 8 buys a second seed of each finalist)" in p.cut
    assert "proxies 12 layers deep (yours: 16)" in p.cut
    # the same inputs, the same plan (nothing reads the clock)
    assert plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 6 * 60, 2, 150) == p
    # 200 s (144.5 s to fill): a final round does not fit (15 + 2 x 49.25 + 20 + 49.25 + 20 = 202.75 s), a
    # fourth candidate does (20 + 2 x 49.25 + 20 = 138.5 s), a fifth does not (25 + 3 x 49.25 + 20)
    small = plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 200, 2, 150)
    assert (small.screened, small.finalists, small.lrs) == (["pre", "peri", "post", "qwen3"], 0, [0.1])
    assert "no final round: one run per candidate, at the stress learning rate only" in small.cut
    # a large budget: every candidate, every finalist, the edge lrs, the user's depth, 4 lrs, 3 seeds
    big = plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 600 * 60, 2, 150)
    assert (len(big.screened), big.finalists, big.depth, big.lrs, big.seeds, big.extend) == (
        8,
        8,
        16,
        [3e-3, 1e-2, 3e-2, 1e-1],
        [0, 1, 2],
        True,
    )
    assert big.screen_width == 1024 and big.cut == ["the screen at width 1024 (yours: 2048)"]  # 2048: 8 GiB in float64


def test_the_plan_counts_what_the_call_used_before_it():
    """Issue 63 item 5: the budget's clock runs from the command's start; the plan counts the seconds used before
    it (imports, measuring this machine) in place of the startup's reserve: a 15-minute budget 5 minutes in is
    planned as 10 minutes and a startup reserve would be, and its total (what `predicted ... of 15` says) holds
    the 5 minutes used. Speed 1 here: the reserves are 10 s (startup) and 20 s (report)."""
    used = 300.0
    late = plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 15 * 60, 2, 150, used_s=used)
    same = plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 15 * 60 - used + plan.STARTUP_RESERVE_S, 2, 150)
    stages = [k for k in late.predicted if k not in ("reserves", "used", "total")]  # screen, stress, final, ...
    assert {k: late.predicted[k] for k in stages} == {k: same.predicted[k] for k in stages}
    assert (late.screened, late.finalists, late.lrs, late.seeds) == (
        same.screened,
        same.finalists,
        same.lrs,
        same.seeds,
    )
    assert late.predicted["used"] == used and late.predicted["reserves"] == plan.REPORT_RESERVE_S
    assert late.predicted["total"] == pytest.approx(sum(late.predicted[k] for k in stages) + 20 + used)
    assert late.predicted["total"] <= 15 * 60
    fresh = plan.make_plan(SIX, "pre", LLAMA_1B, _flat(), 15 * 60, 2, 150)
    assert fresh.predicted["used"] == 0 and fresh.predicted["reserves"] == 30  # nothing said: the startup's reserve


def test_only_the_stream_mixes_the_plan_runs_are_measured(monkeypatch):
    """Issue 63 item 5: the hyper-connections' step rates are measured only for a mix among the candidates the
    plan trains, each at most once (priced until then at the reference VM's ratios): a 3-minute budget trains
    neither (nothing measured); 10 minutes, pre-hc: hc alone; 15 minutes, pre-mhc too: mhc alone (hc cached)."""
    from normlab.config.commands import RecommendConfig
    from normlab.recommend.planning import cost
    from normlab.recommend.planning.inputs import choose
    from normlab.recommend.stages import pipeline as stages

    planted = replace_key(_flat(), cost.machine_key(1))
    path = cost.cache_file(cost.machine_key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in planted.to_dict().items() if k != "c_stream"}))
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        cost,
        "measure_streams",
        lambda threads=1, mixes=(), cap_s=0: asked.append(mixes) or (0.1, dict.fromkeys(mixes, 0.2)),
    )
    monkeypatch.setattr(cost, "measure", lambda threads=1: pytest.fail("the cached calibration is measured again"))
    user = read_user_model("micro")
    screened = {}
    for minutes in (3, 10, 15):
        cfg = RecommendConfig(candidates=("pre", "peri", "post", "pre-hc", "pre-mhc"), budget=minutes, workers=2)
        p = stages._new_plan(user, cfg, {}, choose(cfg, user), minutes * 60, 2, lambda *a: None)
        screened[minutes] = p.screened
    assert screened[3] == ["peri", "post", "pre"] and screened[10] == ["peri", "post", "pre", "pre-hc"]
    assert "pre-mhc" in screened[15] and asked == [("hc",), ("mhc",)]
    assert json.loads(cost.stream_cache_file(cost.machine_key(1)).read_text())["ratio"] == {"hc": 2.0, "mhc": 2.0}


def replace_key(cal, key):
    from dataclasses import replace

    return replace(cal, key=key)


def test_a_tight_budget_buys_shallower_then_shorter_proxies_and_below_that_is_refused_with_the_least_budget():
    """Steps cost c_flop x F only; the smallest answer at depth d and s steps needs (3 s of screens + two
    runs back to back + the round's 20 s) / 0.85 + 30 s of reserves; a budget just above each need buys that floor."""
    from normlab.recommend.planning.cost import REFERENCE_SHAPE, Calibration
    from normlab.recommend.planning.work import step_work

    cal = Calibration(
        c0=0.0,
        c_flop=0.275 / step_work(REFERENCE_SHAPE, "pre")[0],
        c_norm=0.0,
        s0=1.0,
        s_layer=0.0,
        s_flop=0.0,
        seconds=1.0,
    )
    user = REFERENCE_SHAPE.with_(n_layers=16)
    need = lambda d, st: (3 + 2 * cal.run_seconds(ModelConfig(**proxy_shape(user, d)), "pre", st) + 20) / 0.85 + 30
    for d, st in ((12, 150), (8, 150), (6, 150), (6, 100)):
        p = plan.make_plan(["pre", "peri", "post"], "pre", user, cal, need(d, st) + 0.5, 2, 150)
        assert (p.depth, p.steps, p.finalists) == (d, st, 0)
    assert any(c == "proxies of 100 steps (asked: 150)" for c in p.cut)
    with pytest.raises(plan.BudgetTooSmall) as err:
        plan.make_plan(["pre", "peri", "post"], "pre", user, cal, need(6, 100) - 0.5, 2, 150)
    assert err.value.minutes == math.ceil(need(6, 100) / 60 * 10) / 10
    assert f"give --budget {err.value.minutes:g} or more" in str(err.value) and "fewer --candidates" not in str(
        err.value
    )
    with pytest.raises(plan.BudgetTooSmall, match="fewer --steps"):  # --steps given: it is the user's to cut
        plan.make_plan(["pre", "peri", "post"], "pre", user, cal, 60, 2, 150, steps_fixed=True)


def test_fixed_lrs_seeds_and_depth_are_kept():
    p = plan.make_plan(
        SIX, "pre", LLAMA_1B, _flat(), 60 * 60, 2, 150, stress_lr=0.5, lrs=(0.05, 0.5), seeds=(3,), depth=12
    )
    assert p.lrs == [0.05, 0.5] and p.seeds == [3] and p.depth == 12 and not p.extend


def test_shapes_too_large_to_screen_or_train_are_refused_from_counted_memory():
    deep = LLAMA_1B.with_(n_layers=10_000)
    with pytest.raises(ConfigError, match="screen's model at your depth 10000 needs .* GiB even at width 64"):
        plan.make_plan(SIX, "pre", deep, _flat(), 120, 2, 150)
    wide = LLAMA_1B.with_(d_ff=10_000_000)
    with pytest.raises(ConfigError, match="GiB"):
        plan.make_plan(SIX, "pre", wide, _flat(), 120, 2, 150)


def test_cheap_screen_order_and_the_learning_rate_ladder():
    order, family = plan.cheap_order(["pre", "peri", "post", "olmo2", "deepnorm", "qwen3", "hybrid"], "pre")
    assert order == ["pre", "peri", "post", "qwen3", "olmo2", "deepnorm", "hybrid"]
    assert (family["peri"], family["post"], family["pre"]) == ("bounded", "tangential", "unbounded")
    assert (
        plan.next_lr(0.01, up=False) == 3e-3
        and plan.next_lr(0.1, up=True) == 0.3
        and plan.next_lr(1.0, up=True) is None
    )
    assert plan.finalists_from(["a", "b", "c", "d"], 2, "d") == ["a", "d"] and plan.finalists_from(
        ["a", "b"], 2, None
    ) == ["a", "b"]


def test_issue_42s_candidates_come_after_the_others_so_a_small_budget_keeps_its_answer():
    """Within each of the cheap screen's families the order given is the order tried: the defaults' first 7 are
    those of the 15 before issue 42's placements, and hyper-connections (the dearest to train) come last."""
    from normlab.config.commands import RECOMMEND_CANDIDATES

    before = RECOMMEND_CANDIDATES[: RECOMMEND_CANDIDATES.index("peri-derf")]
    now, _ = plan.cheap_order(list(RECOMMEND_CANDIDATES), "pre")
    assert len(before) == 15 and now[:7] == plan.cheap_order(list(before), "pre")[0][:7]
    assert now[-2:] == ["pre-hc", "pre-mhc"]
    p = plan.make_plan(list(RECOMMEND_CANDIDATES), "pre", LLAMA_1B, _flat(), 6 * 60, 2, 150)
    assert p.screened == ["pre", "peri", "post", "hybrid", "olmo2", "deepnorm"]


def test_default_candidates_the_model_cannot_take_are_left_out_and_given_ones_refused(tmp_path):
    """nGPT needs one key per query head: on a grouped-query model it is left out of the defaults with the reason
    (a note), and refused in one line when given; on a model with as many key/value heads it stays."""
    from dataclasses import replace

    from normlab.config.commands import RECOMMEND_CANDIDATES, RecommendConfig
    from normlab.recommend.planning.inputs import choose_candidates

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))  # 8 query heads, 2 key/value heads
    user = read_user_model(str(tmp_path / "config.json"))
    names, current, unfit = choose_candidates(RecommendConfig(), user)
    assert current == "pre" and list(unfit) == ["ngpt"] and "n_kv_heads = n_heads" in unfit["ngpt"]
    # the presets, and first the changes to the user's Pre-LN (+ output norms: peri-noemb; + both: peri itself)
    assert names == ["pre", "peri-noemb"] + [n for n in RECOMMEND_CANDIDATES if n not in ("ngpt", "pre")]
    with pytest.raises(ConfigError, match=r"--candidates: ngpt cannot be built for your model \(ngpt is built for"):
        choose_candidates(RecommendConfig(candidates=("peri", "ngpt")), user)
    mha = replace(user, config=user.config.with_(n_kv_heads=8))
    assert choose_candidates(RecommendConfig(candidates=("peri", "ngpt")), mha) == (["pre", "peri", "ngpt"], "pre", {})


# --- the ranking --------------------------------------------------------------------------------------


def _row(name, screen="caution", diverged=0, stalled=0, finished=4, loss=2.5, std=0.005, sens=0.1):
    return Evidence(
        layout=name,
        screen=screen,
        screen_detail="",
        finished=finished,
        diverged=diverged,
        stalled=stalled,
        best_loss=loss,
        best_loss_std=std,
        lr_sensitivity=sens,
        expected_loss=loss + sens,
    )


def test_rank_failures_first_then_loss_ties_within_noise_by_screen_then_expected_loss():
    rows = [
        _row("pre", "unstable", diverged=2, loss=2.2),  # the lowest loss, but 2/4 failed
        _row("hybrid", "unstable", loss=2.300, std=0.02),
        _row("peri", "stable", loss=2.310),  # within hybrid's 0.02 std: a tie, the screen prefers peri
        _row("qk", "caution", loss=2.35, std=0.001),  # 0.05 behind: not a tie
        _row("rezero", "caution", stalled=1, loss=2.1),
        _row("none", "caution"),
    ]
    rows[-1].status, rows[-1].why = "ruled out", "x"
    ranked = rank(rows)
    assert [r.layout for r in ranked] == ["peri", "hybrid", "qk", "rezero", "pre", "none"]
    assert [r.rank for r in ranked] == [1, 2, 3, 4, 5, None]
    assert ranked[1].tie and not ranked[0].tie and not ranked[2].tie
    a, b = _row("a", loss=2.300, sens=0.3), _row("b", loss=2.305, sens=0.1)  # same verdict: the expected loss
    assert [r.layout for r in rank([a, b])] == ["b", "a"]  # over the lrs decides: 2.405 against 2.6
    # tied within b's 0.39 seed std; a barely learns at any lr (flat: the smaller sensitivity, 0.01 against
    # 0.15), b trains lower at every lr: the expected loss puts b first (2.99 against 3.12)
    flat, noisy = _row("a", loss=3.11, std=0.04, sens=0.01), _row("b", loss=2.84, std=0.39, sens=0.15)
    assert [r.layout for r in rank([flat, noisy])] == ["b", "a"] and rank([flat, noisy])[1].tie
    c, d = _row("c", loss=2.300, std=0.001), _row("d", loss=2.3101, std=0.001)  # 0.0101 > the 0.01 floor
    assert [r.layout for r in rank([d, c])] == ["c", "d"] and not rank([d, c])[1].tie


def test_ruled_out_by_the_screen():
    ok = {"finite": True, "final_rms": 3.0, "shape_var": "linear", "sensitivity_product": 5e6}
    assert ruled_out(ok, "fp16") is None  # a large Jacobian product at init is not a criterion
    assert "non-finite" in ruled_out({**ok, "finite": False}, "bf16")
    assert (
        "FP16 maximum" in ruled_out({**ok, "final_rms": 7e4}, "fp16")
        and ruled_out({**ok, "final_rms": 7e4}, "bf16") is None
    )
    assert "exponentially" in ruled_out({**ok, "shape_var": "exponential"}, "bf16")


def test_evidence_from_a_grid_counts_and_best_lr(tmp_path):
    sweep = SweepConfig(
        name="g", base={"size": "nano"}, grid={"layout": ["pre", "peri"], "lr": [0.01, 0.1], "seed": [0, 1]}
    )
    store, specs = prepare(sweep, tmp_path / "g")
    losses = {
        ("pre", 0.01): [2.5, 2.7],
        ("pre", 0.1): [None, 3.0],
        ("peri", 0.01): [2.4, 2.6],
        ("peri", 0.1): [2.3, 2.5],
    }
    for s in specs:
        loss = losses[(s.axes["layout"], s.axes["lr"])][s.axes["seed"]]
        status = "diverged" if loss is None else ("stalled" if loss == 3.0 else "ok")
        store.record(
            s.run_id,
            {
                "status": status,
                "final_loss": loss,
                "initial_loss": 5.5,
                "steps": 10,
                "max_activation": 70000.0 if loss is None else 50.0,
            },
        )
    df, _ = load_sweep(tmp_path / "g")
    ev = evidence_from_grid(df, {"pre": 4, "peri": 4})
    assert (ev["pre"]["diverged"], ev["pre"]["stalled"], ev["pre"]["finished"]) == (1, 1, 4)
    assert ev["pre"]["best_lr"] == 0.01 and ev["pre"]["best_loss"] == pytest.approx(2.6)
    assert ev["pre"]["best_loss_std"] == pytest.approx(math.sqrt(0.02))  # (2.5, 2.7), ddof 1
    assert ev["pre"]["max_activation"] == 70000.0 and ev["peri"]["best_lr"] == 0.1
    # Wortsman: E_lr[min(loss, loss_0)] - min_lr; a diverged run counts as loss_0 = 5.5
    assert ev["pre"]["lr_sensitivity"] == pytest.approx(((2.6 + (5.5 + 3.0) / 2) / 2) - 2.6)
    assert (
        list(ev["pre"]["loss_by_lr"]) == ["0.01", "0.1"]
        and "1/2 diverged, 1/2 stalled" in ev["pre"]["loss_by_lr"]["0.1"]
    )


def test_recipe_checks_agree_or_say_not():
    checks = agreement.check({"peri": 1, "pre": 2, "pre-dyt": 3, "hybrid": 4}, "fp16")
    by = {(c["recipe"], c["claim"]): c["agrees"] for c in checks}
    assert by[("stress-kim-fp16", "peri ahead of pre")] and by[("dyt-lr", "pre ahead of pre-dyt")]
    assert by[("stress-kim-fp16", "peri ahead of hybrid")]
    assert ("kim-lr", "peri ahead of pre") not in by  # a bf16 verdict, not checked under fp16
    assert not agreement.check({"peri": 2, "pre": 1}, "fp16")[0]["agrees"]
    streams = agreement.check({"peri": 1, "pre-mhc": 2, "pre-hc": 3, "pre-gpas": 4, "pre-lambda": 5}, "fp16")
    assert {c["claim"] for c in streams if c["recipe"] == "stress-residual-stream" and c["agrees"]} == {
        f"peri ahead of {n}" for n in ("pre-gpas", "pre-lambda", "pre-hc", "pre-mhc")
    }
    assert not agreement.check({"peri": 1, "pre-mhc": 2}, "bf16")  # measured under fp16 only


def test_recipe_checks_compare_at_the_recipes_learning_rates_or_say_the_settings_do_not_overlap():
    """bf16 verdicts: hybrid ahead of pre (zhuo-placement, lr 3e-3), pre-gate ahead of pre (gate-lr,
    3e-3 ... 3e-2). Hybrid stalled at 0.1 and ran nowhere else: not comparable; the gate is ahead at
    1e-2 (where both ran) but not at 3e-2, where it diverged once: does not hold."""
    import pandas as pd

    rows = [
        ("pre", 0.01, 0, "ok", 2.50),
        ("pre", 0.01, 1, "ok", 2.70),
        ("pre", 0.03, 0, "ok", 2.60),
        ("pre", 0.1, 0, "ok", 3.0),
        ("pre-gate", 0.01, 0, "ok", 2.40),
        ("pre-gate", 0.01, 1, "stalled", 3.32),
        ("pre-gate", 0.03, 0, "diverged", None),
        ("pre-gate", 0.1, 0, "ok", 2.9),
        ("hybrid", 0.1, 0, "stalled", 3.32),
        ("peri", 0.1, 0, "pending", None),
    ]
    runs = pd.DataFrame(rows, columns=["layout", "lr", "seed", "status", "final_loss"]).assign(
        final_val_loss=None, max_activation=None, first_break=None
    )  # the other columns of a sweep table
    cells = agreement.cells(runs)
    assert cells["pre"][0.01] == {"runs": 2, "failed": 0, "loss": pytest.approx(2.6)}
    assert cells["pre-gate"][0.01] == {"runs": 2, "failed": 1, "loss": pytest.approx(2.86)}  # the stall's loss counts
    assert "peri" not in cells  # nothing finished
    checks = {c["recipe"]: c for c in agreement.check({"pre-gate": 1, "pre": 2, "hybrid": 3}, "bf16", cells)}
    zhuo = checks["zhuo-placement"]
    assert not zhuo["agrees"] and zhuo["agrees_at_setting"] is None
    assert (
        zhuo["at_setting"]
        == "not comparable: no run of both at the recipe's lr (hybrid at lr 0.1; pre at lr 0.01, 0.03, 0.1)"
    )
    gate = checks["gate-lr"]  # ranked ahead, but at 1e-2 one of its two runs stalled (1/2 failed vs 0/2): behind
    assert gate["agrees"] and gate["agrees_at_setting"] is False
    assert (
        gate["at_setting"]
        == "lr 0.01: pre-gate 2.860, 1/2 failed vs pre 2.600; lr 0.03: pre-gate 1/1 failed vs pre 2.600"
    )
    line = agreement.summary(list(checks.values()))
    assert line.startswith("The ranking agrees with 1 of 2") and "0 of 1 hold, 1 not comparable" in line
    ok = pd.DataFrame(
        [("pre-gate", 0.01, 0, "ok", 2.4, None, None, None), ("pre", 0.01, 0, "ok", 2.5, None, None, None)],
        columns=runs.columns,
    )
    assert agreement.check({"pre-gate": 1, "pre": 2}, "bf16", agreement.cells(ok))[0]["agrees_at_setting"] is True


# --- the winner's settings elsewhere --------------------------------------------------------------


def test_settings_in_other_code_bases_or_the_nearest_with_the_difference():
    cfg = SIZES["micro"]
    peri = settings_for("peri", cfg)
    assert "peri_norm" in peri["OLMo-core"]["settings"] and "embedding_norm" in peri["OLMo-core"]["settings"]
    lit = peri["litgpt"]  # its settings give the output norms; the embedding norm comes as a patch
    assert not lit["expressible"] and lit["patch"] and "EmbeddingNormBlock" in lit["code"]
    assert not peri["transformers"]["expressible"] and "--arch normlab" in peri["transformers"]["settings"]
    pre = settings_for("attn=A,mlp=A,final", cfg)  # the string form is matched too
    assert pre["transformers"]["expressible"] and "LlamaForCausalLM" in pre["transformers"]["settings"]
    assert "Qwen2" not in pre["transformers"]["settings"]  # its q/k/v biases are not this model's
    assert pre["torchtitan"]["expressible"] and pre["normlab"]["settings"].startswith("--layout pre")
    olmo2 = settings_for("olmo2", cfg)
    assert "norm_1=False" in olmo2["litgpt"]["settings"] and "reordered_norm" in olmo2["OLMo-core"]["settings"]
    gate = settings_for("pre-gate", cfg)
    assert "elementwise" in gate["OLMo-core"]["settings"] and "nearest: pre (lacks gate)" in gate["litgpt"]["settings"]
    assert not any(v["expressible"] for k, v in settings_for("hybrid", cfg).items() if k != "normlab")


def test_issue_42s_placements_say_why_no_other_code_base_states_them():
    """No snippet for hyper-connections, mHC, GPAS, the lambdas, Derf, SeeDNorm, single-scale RMSNorm or nGPT:
    each code base's entry names the part it cannot state and why (OLMo-core's own nGPT normalizes q and k over
    all heads; transformers' mHC lives in DeepSeek-V4 only), beside the nearest placement and what differs."""
    cfg = SIZES["micro"]
    parts = {
        "pre-hc": ("several residual streams", "streams"),
        "pre-mhc": ("several residual streams", "stream_mix"),
        "pre-gpas": ("GPAS", "gpas"),
        "pre-lambda": ("learned skip scalars", "skip_learned"),
        "pre-derf": ("Derf", "norm"),
        "peri-derf": ("Derf", "norm"),
        "pre-seednorm": ("SeeDNorm", "norm"),
        "pre-ssrms": ("single-scale norms", "gain"),
        "ngpt": ("nGPT", "ngpt"),
    }
    for layout, (part, differs) in parts.items():
        for fw, entry in settings_for(layout, cfg).items():
            if fw == "normlab":
                continue
            assert not entry["expressible"] and entry["code"] is None, (layout, fw)
            assert f"({part}" in entry["settings"] and "nearest: " in entry["settings"], (layout, fw)
            assert differs in entry["settings"].split("nearest: ")[1], (layout, fw)
    hc = settings_for("pre-hc", cfg)
    assert (
        "DeepseekV4ForCausalLM" in hc["transformers"]["settings"] and "one residual stream" in hc["litgpt"]["settings"]
    )
    ngpt = settings_for("ngpt", cfg)
    assert "over all heads at once" in ngpt["OLMo-core"]["settings"]
    assert "no normalized (nGPT) model" in ngpt["torchtitan"]["settings"]
    assert "(" not in settings_for("hybrid", cfg)["litgpt"]["settings"].split("nearest")[0]  # no such part: no reason


def test_every_snippet_that_can_be_emitted_is_built_by_a_test():
    """A (placement, code base) pair with a snippet is shipped only if tests/frameworks builds it in the library."""
    from normlab.recommend.frameworks.snippets import PLACEMENTS, snippet
    from tests.frameworks.cases import TESTED

    emitted = {(layout, fw) for layout, fws in PLACEMENTS.items() for fw in fws}
    assert emitted == set(TESTED) and len(TESTED) == len(set(TESTED))
    cfg = SIZES["micro"]
    for layout, fw in emitted:
        code = snippet(fw, layout, cfg)
        compile(code, f"<{fw} {layout}>", "exec")  # Python as printed
        assert "model = " in code and f"{cfg.norm_eps!r}" in code  # the eps stated, never the library's default
    for fw in ("OLMo-core", "torchtitan", "litgpt"):  # placements with no snippet say so and give no code
        entry = settings_for("hybrid", cfg)[fw]
        assert not entry["expressible"] and entry["code"] is None


def test_snippets_state_the_defaults_that_change_the_function():
    cfg = SIZES["micro"].with_(n_kv_heads=2, rope_theta=500_000.0, tie_embeddings=True)
    lit = settings_for("gemma3", cfg)["litgpt"]["code"]
    for stated in (
        "rotary_percentage=1.0",
        "bias=False",
        "norm_eps=1e-06",
        "name='Gemma-",
        "norm_qk_type='default'",
        "scale_embeddings=True",
        "n_query_groups=2",
        "rope_base=500000",
        "padded_vocab_size=256",
        "model.lm_head.weight = model.transformer.wte.weight",
        "m.weight.data.zero_()",
    ):
        assert stated in lit, stated
    assert "name='normlab-pre'" in settings_for("pre", cfg)["litgpt"]["code"]  # no 1 + w gain
    olmo = settings_for("olmo2", cfg)["OLMo-core"]
    assert "LayerNormType.rms, eps=1e-06, bias=False" in olmo["code"] and "use_head_qk_norm=False" in olmo["code"]
    assert "```python\n" + olmo["code"] in olmo["settings"]
    for layout in ("qwen3", "pre-gate"):  # every OLMo-core block states its layer_norm
        assert "layer_norm=norm" in settings_for(layout, cfg)["OLMo-core"]["code"]
    assert "embed_scale=64 ** 0.5" in settings_for("gemma2", cfg)["OLMo-core"]["code"]
    titan = settings_for("qwen3", cfg)["torchtitan"]["code"]
    assert "Qwen3Model.Config(" in titan and "qk_norm=norm(16)" in titan and "enable_weight_tying=True" in titan
    assert "Llama3Model.Config(" in settings_for("pre", cfg)["torchtitan"]["code"]
    zhuo = settings_for("pre-qk-pre", cfg)["litgpt"]["code"]  # qwen3's function, Zhuo et al.'s init
    assert zhuo.startswith('# pre-qk-pre: the function of "qwen3"; its init (megatron) is not among these settings')
    odd = settings_for("pre", cfg.with_(mlp="relu"))
    assert "NOT stated here (litgpt has no setting for it): mlp=relu" in odd["litgpt"]["code"]
    assert "options it cannot state: mlp=relu" in odd["litgpt"]["settings"]


LIBRARIES = ("OLMo-core", "torchtitan", "litgpt")


def test_snippets_say_muPs_multipliers_are_not_stated():
    """A muP model's logits are W (h / m) and its q.k scale sqrt(d_base) / d_head; CompleteP's branches x r^-alpha:
    none of the three libraries has them, so each snippet lists them, with their numbers, as NOT stated (before:
    silent, its logits 0.87-1.06 off). SP says nothing of it."""
    mup = ModelConfig(d_model=64, n_heads=4, n_layers=2, parametrization="mup", base_d_model=32)
    scale = 8**-0.5 * 8 / 16  # head width 16 on a base of 8: s_base d_base / d_head
    for layout in ("pre", "qwen3"):
        for fw in LIBRARIES:
            entry = settings_for(layout, mup)[fw]
            if entry["code"] is None:
                continue
            header = [line for line in entry["code"].splitlines() if line.startswith("# NOT stated here")]
            assert len(header) == 1 and f"({fw} has no setting for it): parametrization=mup" in header[0], fw
            assert "1/m = 0.5" in header[0] and f"q.k scale {scale:.6g}" in header[0] and "SP's 0.25" in header[0]
            assert "learning rate for an SP model at your width" in header[0]
            sp = settings_for(layout, mup.with_(parametrization="sp", base_d_model=None))[fw]["code"]
            assert "parametrization" not in sp
    deep = mup.with_(parametrization="completep", n_layers=4, base_n_layers=2)
    assert "each residual branch x 0.5 (CompleteP" in settings_for("pre", deep)["OLMo-core"]["code"]


def test_snippets_list_the_configs_scaled_rope_as_not_stated():
    """A Llama 3 config's rope_scaling (rope_type llama3) is read as not modelled; every snippet and patch then says
    it is not stated (normlab does not compute it), where before it was silently absent."""
    tf = pytest.importorskip("transformers")
    del tf
    import tempfile
    from pathlib import Path

    from normlab.recommend.planning.shape import read_user_model

    llama3 = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(llama3))
        user = read_user_model(str(path))
    assert any("rope_type 'llama3'" in u for u in user.unmodelled) and user.layout == "pre"
    for layout in ("pre", "peri"):  # a snippet, and patches (torchtitan, litgpt)
        said = settings_for(layout, user.config, base_layout="pre", unmodelled=user.unmodelled)
        for fw in LIBRARIES:
            code = said[fw]["code"]
            assert "# NOT stated here (your config has it; normlab does not compute it" in code, (layout, fw)
            assert "rope_type 'llama3'" in code and "rope_type 'llama3'" in said[fw]["settings"].split("```")[0]
        assert "rope_type" not in settings_for(layout, user.config, base_layout="pre")["OLMo-core"]["code"]


def test_gemmas_attn_scale_is_flagged_only_where_it_changes_the_function():
    """query_pre_attn_scalar = head_dim (every real Gemma 3) is the libraries' own 1/sqrt(head_dim): not flagged;
    another value is."""
    gemma = ModelConfig(d_model=64, n_heads=4, n_layers=2, d_head=32, mlp="geglu-tanh", attn_scale=32.0)
    assert "NOT stated" not in settings_for("gemma3", gemma)["OLMo-core"]["code"]
    assert (
        "NOT stated here (OLMo-core has no setting for it): attn_scale=24.0"
        in (settings_for("gemma3", gemma.with_(attn_scale=24.0))["OLMo-core"]["code"])
    )
    assert "attn_scale" not in settings_for("pre", gemma.with_(mlp="swiglu"))["torchtitan"]["code"]
    assert "attn_scale=24.0" in settings_for("pre", gemma.with_(mlp="swiglu", attn_scale=24.0))["torchtitan"]["code"]


def test_litgpts_patch_says_its_entry_points_do_not_open_its_checkpoints():
    """litgpt generate/chat/evaluate/finetune build GPT(config) and load strictly: the embedding norm's weight is an
    unexpected key there, and the printed patch says so."""
    code = settings_for("peri", ModelConfig(), base_layout="pre")["litgpt"]["code"]
    said = " ".join(line.removeprefix("# ") for line in code.splitlines() if line.startswith("# "))
    assert "litgpt generate, chat and finetune build GPT(config) and load it strictly" in said
    assert "litgpt evaluate converts it to Hugging Face first" in said
    assert "unexpected key transformer.h.0.embedding_norm.weight" in said and "before model.load_state_dict" in said
    titan = settings_for("peri", ModelConfig(), base_layout="pre")["torchtitan"]["code"]
    assert "litgpt generate" not in titan


def test_the_current_placement_is_a_baseline_only_where_the_stress_round_left_it_out():
    from normlab.recommend.evidence.rank import baseline_of

    order = ["peri", "olmo2", "pre-gate", "pre"]
    assert baseline_of("pre", ["peri", "pre"], order) == "pre"  # it displaced olmo2: ranked by its stress run
    assert baseline_of("olmo2", ["peri", "olmo2"], order) is None  # among the best on its own
    assert baseline_of("pre", ["peri", "olmo2", "pre-gate", "pre"], order) is None  # everyone is a finalist
    assert baseline_of(None, ["peri"], order) is None and baseline_of("pre", [], order) is None


def test_stress_order_reads_the_stress_runs_only_and_ranks_later_divergence_higher():
    import pandas as pd

    from normlab.recommend.stages.rounds import stress_order

    rows = [
        ("pre", 0.01, 0, "ok", 2.3, 150),
        ("pre", 0.1, 0, "diverged", 2.9, 20),  # its final-round run first
        ("pre-lns", 0.1, 0, "diverged", 3.4, 79),
        ("post", 0.1, 0, "stalled", 3.32, 150),
        ("peri", 0.1, 0, "ok", 2.45, 150),
        ("peri", 0.1, 1, "ok", 2.40, 150),
        ("hybrid", 0.1, 0, "ok", 2.6, 150),
    ]
    runs = pd.DataFrame(rows, columns=["layout", "lr", "seed", "status", "final_loss", "step"])
    screen = {n: {"verdict": "stable"} for n in ("pre", "pre-lns", "post", "peri", "hybrid")}
    # ok by loss, then stalled, then diverged by how long they held (pre-lns to step 79, pre to 20), whatever
    # their last finite losses (2.9 against 3.4) and the final round's runs (pre at 0.01: 2.3)
    assert stress_order(runs, screen, list(screen), 0.1, 0) == ["peri", "hybrid", "post", "pre-lns", "pre"]


def test_the_reason_names_what_put_the_winner_first_and_where_the_current_placement_stands():
    from normlab.recommend.report.explain import reason

    peri, gate = _row("peri", "stable", loss=2.400, std=0.03), _row("pre-gate", "unstable", loss=2.410, std=0.014)
    pre = _row("pre", "unstable", loss=2.775, std=0.12)
    tail = _row("pre-layerscale", "unstable", finished=1, loss=3.099)
    tail.status = "stress round only"
    pre.status, pre.why = (
        "baseline",
        "ranked by its stress run, #7 of 15 there; in the final round as your current placement",
    )
    ranked = rank([peri, gate, tail, pre])  # the two ranked by the rule; the tail is ordered by the caller
    for i, r in enumerate([tail, pre], 3):
        r.rank = i
    ranked = [r for r in ranked if r.status == "ranked"] + [tail, pre]
    text = reason(a_recommendation(current="pre"), ranked)
    assert text.startswith("Ranked first: **peri**; screen: stable.")
    assert (
        "Next: pre-gate (0/4 failed, best loss 2.4100 ± 0.0140); peri ranks above it in a tie on loss within seed "
        "noise, broken by the screen's verdict." in text
    )
    assert (
        "Your current placement pre ranks #4 (ranked by its stress run, #7 of 15 there; in the final round as "
        "your current placement): 0/4 failed, best loss 2.7750 ± 0.1200." in text
    )


def test_a_verdict_short_of_stable_gives_its_reason():
    from normlab.recommend.evidence.rank import screen_reason

    row = {"verdict": "caution", "wellposedness": "well-posed", "backward": "mild (x1.15)"}
    assert screen_reason(row) == (
        "well-posed, but its block Jacobians are not invariant to the weight stress (backward: mild (x1.15))"
    )
    assert (
        screen_reason({**row, "wellposedness": "degenerate (tangential)", "backward": "grows with s (x1.40)"})
        == "degenerate (tangential), and its block Jacobians grows with s (x1.40)"
    )
    from normlab.recommend.report.explain import reason

    w = _row("peri", "caution", loss=2.4)
    w.screen_why = screen_reason(row)
    assert "screen: caution (well-posed, but its block Jacobians" in reason(a_recommendation(current=None), rank([w]))


def test_the_small_sample_caveat_quotes_the_runs_at_hand():
    from normlab.recommend.report.explain import small_samples

    ranked = rank(
        [
            _row("peri", finished=4),
            _row("pre", diverged=2, finished=4, loss=2.3),
            _row("post", stalled=1, finished=4, loss=2.9),
        ]
    )
    assert small_samples(ranked) == (
        "Failure counts over a few runs are small samples: peri's 0/4 failed against "
        "pre's 2/4 here is evidence, not proof."
    )
    same = rank([_row("a", finished=1), _row("b", finished=1, loss=2.9)])
    assert "both failed 0/1 here" in small_samples(same)


def test_what_ran_and_how_far_the_answer_could_move():
    from normlab.recommend.report.explain import movement
    from normlab.recommend.stages.records import FinalRecord, StageRecord

    peri, gate = _row("peri", "stable", loss=2.400, std=0.03), _row("pre-gate", "unstable", loss=2.410, std=0.014)
    ranked = rank([peri, gate, _row("pre", diverged=2, loss=2.7)])
    p = a_plan(finalists=3, seeds=[0], order=["pre", "peri", "pre-gate", "post"], screened=["pre", "peri", "pre-gate"])
    rounds = [StageRecord("stress", 120, 150, 3, 3), StageRecord("final", 60, 240, 6, 4)]
    final = FinalRecord(["pre", "peri", "pre-gate"], [0.01, 0.1], [0], edges={"peri": 3e-3})
    text = movement(ranked, p, final, rounds)
    assert text[0] == "The stress round ran in full: 3 of 3 runs (predicted 2.0 min, took 2.5)."
    assert text[1].startswith("The final round was cut by the budget: 4 of 6 runs finished")
    assert "peri is tied on loss within seed noise with pre-gate" in text[2]
    assert any(x.startswith("One seed") for x in text) and any("1 candidate(s) not tried (post)" in x for x in text)
    assert text[-1] == (
        "peri's best learning rate was the lowest tried (0.01): its optimum may lie beyond; 0.003 would "
        "be next (no room in this budget)."
    )


def test_muon_proxies_cost_their_newton_schulz_steps_in_the_plan():
    """A Muon step adds k (4 m^2 n + 2 m^3) FLOPs per m x n block matrix (m <= n), priced at the calibrated
    c_flop: the plan's run seconds grow by exactly steps x c_flop x that sum."""
    from normlab.model.config import ModelConfig
    from normlab.recommend.planning import cost
    from normlab.recommend.planning.shape import proxy_shape, read_user_model

    cal = cost.Calibration(c0=0.002, c_flop=2e-11, c_norm=0.0, s0=0.05, s_layer=0.05, s_flop=0.0, seconds=1.0)
    shape = ModelConfig(**proxy_shape(read_user_model("micro").config, 2))
    d, hd, h, kv, ff = shape.d_model, shape.head_dim, shape.n_heads, shape.kv_heads, shape.ffn_dim

    def ns(a, b):
        m, n = sorted((a, b))
        return 5 * (4 * m * m * n + 2 * m**3)

    per_block = ns(h * hd, d) + 2 * ns(kv * hd, d) + ns(d, h * hd) + 2 * ns(ff, d) + ns(d, ff)  # q, k, v, o; SwiGLU
    assert work.optimizer_work(shape, "pre", "muon") == 2 * per_block
    assert work.optimizer_work(shape, "pre", "adamw") == work.optimizer_work(shape, "pre", "sgd") == 0
    extra = cal.run_seconds(shape, "pre", 100, "muon") - cal.run_seconds(shape, "pre", 100, "adamw")
    assert extra == pytest.approx(100 * 2e-11 * 2 * per_block)


@pytest.mark.parametrize("moe", [False, True])
def test_the_counted_muon_matrices_are_those_muon_takes(moe):
    """work.muon_shapes (counted, nothing built) against train.optim.muon_matrices on each preset built on the
    meta device (Admin's profiling pass reads values: built on the CPU, tiny)."""
    import torch

    from normlab.layout import PRESETS
    from normlab.model import build_model
    from normlab.train.optim import muon_matrices

    over = dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64)
    if moe:
        over.update(n_experts=4, moe_top_k=2, moe_shared_expert=True)
    from normlab.errors import LayoutError

    for name in PRESETS:
        try:
            with torch.device("meta"):
                model = build_model(name, "nano", seed=0, **over)
        except LayoutError:  # e.g. an MLP hidden norm with experts: not a model
            continue
        except RuntimeError:
            model = build_model(name, "nano", seed=0, **over)
        got = sorted(
            tuple(p.shape[-2:]) if p.ndim == 2 else (p.shape[2], p.shape[1])
            for p in muon_matrices(model)
            for _ in range(p.shape[0] if p.ndim > 2 else 1)
        )
        assert sorted(work.muon_shapes(model.config, name)) == got, name


def test_a_verify_stage_is_counted_before_anything_runs_at_the_widest_width_that_fits():
    from normlab.recommend.planning import cost, plan
    from normlab.recommend.planning.shape import read_user_model

    cal = cost.Calibration(c0=0.002, c_flop=2e-11, c_norm=0.0, s0=0.05, s_layer=0.05, s_flop=0.0, seconds=1.0)
    user = read_user_model("kim-400m").config  # d 1024: widths 128 ... 1024
    big = plan.make_plan(["pre", "peri", "post", "olmo2"], None, user, cal, 1800, 2, 150, verify=True)
    v = big.verify
    assert v is not None and v.seed == big.seed0 and v.depth == big.depth and v.steps == big.steps
    assert v.k >= 2 and v.width in (128, 256, 512, 1024) and big.predicted["verify"] == v.predicted_s
    assert v.predicted_s == pytest.approx(
        plan.verify_seconds(big.screened, user, cal, 2, big.depth, big.steps, v.k, v.width)
    )
    assert big.predicted["total"] <= (1800 - big.predicted["reserves"]) * plan.FILL + big.predicted["reserves"]
    wider = [w for w in plan.verify_widths(user) if w > v.width]  # the next width would not have fit its share
    if wider:
        assert plan.verify_seconds(big.screened, user, cal, 2, big.depth, big.steps, 2, wider[0]) > v.predicted_s
    small = plan.make_plan(["pre", "peri", "post", "olmo2"], None, user, cal, 150, 2, 150, verify=True)
    assert small.verify is None and small.verify_note.startswith("--verify: this budget buys no verify stage")
    assert "recommending without it; --budget" in small.verify_note and "\n" not in small.verify_note
    assert plan.make_plan(["pre", "peri", "post", "olmo2"], None, user, cal, 150, 2, 150).verify_note == ""


def test_the_transfer_record_renders_what_is_there_and_says_not_yet_measured_when_empty():
    from normlab.recommend.report import explain as report

    shipped = report.transfer_record()
    assert shipped["study"].startswith("docs/results.md") and "status" in shipped
    (line,) = report.record_lines({"status": "in progress, 4 of 142 runs", "comparisons": []})
    assert "not yet measured (in progress, 4 of 142 runs" in line and "Transfer study" in line
    rec = {
        "status": "in progress, 40 of 142 runs",
        "comparisons": [
            {
                "proxy": "w64",
                "other": "w128",
                "placements": 4,
                "tau": 2 / 3,
                "p_value": 0.33,
                "top1": True,
                "top3": 2 / 3,
                "k": 3,
                "failures": {"predicted_and_seen": 1, "predicted_only": 2, "seen_only": 0, "neither": 9},
                "command": "normlab transfer w64 w128",
            }
        ],
    }
    head, body = report.record_lines(rec)
    assert "in progress, 40 of 142 runs" in head
    assert "tau +0.67 (p 0.33), top-1 agrees, top-3 2/3" in body and "predicted only 2" in body
    assert "`normlab transfer w64 w128`" in body and "fp16's maximum" not in body
    rec["comparisons"][0]["failures_with_headroom"] = {"predicted_and_seen": 2, "predicted_only": 2, "seen_only": 0}
    _, body = report.record_lines(rec)
    assert "within 8x of fp16's maximum as a predicted failure: predicted and seen 2, predicted only 2" in body


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_the_proxies_train_with_the_optimizer_asked_at_the_width_asked(optimizer):
    from normlab.recommend.planning.inputs import proxy_settings, proxy_sweep
    from normlab.recommend.planning.shape import read_user_model

    user = read_user_model("kim-400m")
    (spec,) = proxy_sweep(proxy_settings(user, 2, "fp16", {}, optimizer, width=256), ["pre"], [0.1], [0]).expand()
    cfg = spec.train_config("unused")
    assert cfg.optim.optimizer == optimizer and cfg.model.model_config().d_model == 256
    assert cfg.model.model_config().n_heads == 256 // 16  # heads of 16, as the proxies'


def test_what_a_refusal_says_is_what_happened():
    """Issue 63 item 7: --quick has no screen, so its budget refusal says no "screened" and a stress round the
    budget stopped says what the stress round took, not "the screen took"; the machine is said slower than its
    calibration only where a stage took longer than predicted; the confidence's seeds are those that ran."""
    from types import SimpleNamespace

    import pandas as pd

    from normlab.recommend.evidence.rows import seeds_that_ran
    from normlab.recommend.stages.records import Confidence, StageRecord
    from normlab.recommend.stages.rounds import _why_none

    with pytest.raises(plan.BudgetTooSmall) as err:
        plan.make_plan(["pre", "peri"], "pre", LLAMA_1B, _flat(), 60, 2, 150, screen=False, used_s=12.0)
    text = str(err.value)
    assert "screen" not in text.split("(priced with")[0].replace("no screen (--quick)", "")
    assert "2 candidates trained at 6 layers, 100 steps, each with a second seed" in text
    assert "0.2 min were used before the plan" in text
    with pytest.raises(plan.BudgetTooSmall) as err:
        plan.make_plan(["pre", "peri"], "pre", LLAMA_1B, _flat(), 60, 2, 150)
    assert "2 candidates screened at your depth 16" in str(err.value)

    stopped = {"status": "failed", "reason": "stopped at the end of the time budget at step 3 of 150; the next ..."}
    runs = pd.DataFrame([{"layout": "pre", **stopped}, {"layout": "peri", **stopped}])
    quick = SimpleNamespace(found=SimpleNamespace(alive=["pre", "peri"]), rounds=[StageRecord("stress", 60, 90, 2, 0)])
    assert _why_none(quick, runs) == (
        "the budget ran out before any run finished; the stress round 1.5 min, predicted 1.0 min; this machine ran "
        "slower than its calibration (loaded?)"
    )
    fast = SimpleNamespace(
        found=quick.found, rounds=[StageRecord("screen", 60, 30, 2, 2), StageRecord("stress", 60, 50, 2, 0)]
    )
    assert "screen took 0.5 min" in _why_none(fast, runs) and "slower" not in _why_none(fast, runs)

    conf = Confidence("supported", [], {"pre": 1}, seeds=2, not_tried=0, separable=None)
    winner = Evidence(layout="pre", screen="", screen_detail="")
    grid = pd.DataFrame(
        [
            {"layout": "pre", "seed": 0, "status": "ok"},
            {"layout": "pre", "seed": 1, **stopped},
            {"layout": "peri", "seed": 1, "status": "ok"},
        ]
    )
    got = seeds_that_ran(conf, grid, winner)
    assert got.seeds == 1 and got.level == "provisional" and got.why[0].startswith("one seed")
    both = pd.concat([grid, pd.DataFrame([{"layout": "pre", "seed": 1, "status": "diverged"}])])
    assert seeds_that_ran(conf, both, winner) == conf  # a diverged run ran its seed


def test_quick_suggests_and_defaults_to_the_changes_that_apply(tmp_path, capsys):
    """Issue 63 item 8: a model with output norms already (Gemma 3) is not offered yours+out: --quick's default is
    the first change that applies (yours+emb), and a change given that does not apply is refused in one line
    naming those that do; a placement no change applies to (Peri-LN) is asked for a layout other than its own."""
    from normlab.cli import main
    from normlab.config.commands import RecommendConfig
    from normlab.recommend.planning import derived
    from normlab.recommend.planning.inputs import choose

    assert derived.applicable("gemma3") == ["yours+emb", "yours-qk"] and derived.applicable("peri") == []
    assert derived.quick_default("gemma3") == ("yours+emb",) and derived.quick_default("pre") == ("yours+out",)
    assert derived.quick_default("peri") == () and derived.quick_default("olmo2") == ("yours+emb",)
    gemma = tmp_path / "gemma.toml"
    gemma.write_text('size = "nano"\nlayout = "gemma3"\n')
    user = read_user_model(str(gemma))
    choice = choose(RecommendConfig(quick=True), user)
    plus_emb = derived.derive("gemma3", "yours+emb").name
    assert choice.names == ["gemma3", plus_emb] and choice.short == {plus_emb: "yours+emb"}
    assert choice.name(plus_emb) == "yours+emb" and choice.name("gemma3") == "gemma3"
    given = choose(RecommendConfig(quick=True, candidates=("yours+out",)), user)
    assert given.names == ["gemma3"] and given.inapplicable == ("yours+out",)
    assert main(["recommend", str(gemma), "--quick", "--candidates", "yours+out", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "yours+out does not apply to your placement gemma3" in err
    assert "changes that apply to it: yours+emb, yours-qk; or a layout" in err and not (tmp_path / "r").exists()
    peri = tmp_path / "peri.toml"
    peri.write_text('size = "nano"\nlayout = "peri"\n')
    assert main(["recommend", str(peri), "--quick", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no yours+... change applies to peri: a layout, e.g. pre" in err and "yours+out" not in err


def test_changes_are_named_not_written_as_layout_strings():
    """Issue 63 item 9: a change to the user's placement written as a string form is called by its change's name
    in the ranking, in the sweeps' run lines (the run folders keep their ids) and in the code headers; a
    learning rate that is the only one tried is said as such in the table and the recipe."""
    from normlab.model.config import SIZES
    from normlab.recommend.evidence import answer
    from normlab.recommend.frameworks.snippets import settings_for
    from normlab.recommend.planning import derived
    from normlab.recommend.stages.context import SweepExecutor

    plus_emb = derived.derive("gemma3", "yours+emb").name
    assert derived.short_names("gemma3", ["gemma3", plus_emb]) == {plus_emb: "yours+emb"}
    assert derived.short_names("pre", ["pre", "peri-noemb"]) == {}  # a preset keeps its own name
    w = Evidence(layout=plus_emb, screen="", screen_detail="", label="your model (gemma3) + embedding norm")
    w.short, w.best_lr, w.loss_by_lr = "yours+emb", 0.1, {"0.1": "4.5"}
    assert w.name == "yours+emb (your model (gemma3) + embedding norm)" and w.shown == "yours+emb"
    q_emb, label = derived.derive("qwen3", "yours+emb").name, "your model (qwen3) + embedding norm"
    plain = settings_for(q_emb, SIZES["micro"], "qwen3")
    said_named = settings_for(q_emb, SIZES["micro"], "qwen3", named=("yours+emb", label))
    header = f'# normlab layout yours+emb ({label}): "{q_emb}"'
    for fw in ("OLMo-core", "torchtitan", "litgpt"):  # the header named, the code as it was
        assert header in said_named[fw]["code"], fw
        assert said_named[fw]["code"].replace(header, f'# normlab layout "{q_emb}"') == plain[fw]["code"], fw
    assert "lr 0.1 (the only learning rate tried: not an optimum) at the proxy's width" in answer.recipe(w)["words"]
    w.loss_by_lr = {"0.01": "4.6", "0.1": "4.5"}
    assert "not an optimum" not in answer.recipe(w)["words"]
    said: list[str] = []
    executor = SweepExecutor(1, said.append, 0.0, short={plus_emb: "yours+emb"})
    slug = "attn-qkAB-mlp-AB-emb-final-gain-centered"
    executor._named(f"[2/2] {slug}_lr0.1_seed0-f3dd0b4c: ok")
    assert said == ["[2/2] yours+emb_lr0.1_seed0-f3dd0b4c: ok"]


def test_the_ranking_figure_draws_what_each_candidates_runs_did(tmp_path, monkeypatch):
    """Issue 63 item 10: #1 pre with its one run diverged is drawn so, beside "+ output norms" whose run the budget
    stopped (not ranked, drawn as not finished, never as a failure); row labels wrap, never cut, and stay inside
    the figure; the activation axis says it is logarithmic."""
    from normlab.recommend.report import ranking_figure as rf
    from normlab.runs.files import RecommendDir

    pre = Evidence(layout="pre", screen="", screen_detail="", runs=1, finished=1, diverged=1, rank=1)
    pre.max_activation = 7e4
    out = Evidence(layout="peri-noemb", screen="", screen_detail="", runs=1, unfinished=1, cut=1)
    out.label = "your model (pre) + output norms, a label long enough to need more than one line of the figure"
    assert rf.outcome_counts(pre) == {"diverged or stalled": 1, "at risk": 0, "trained": 0, "not finished": 0}
    assert rf.outcome_counts(out) == {"diverged or stalled": 0, "at risk": 0, "trained": 0, "not finished": 1}
    figures = []
    monkeypatch.setattr(rf, "figure_html", lambda fig, *a: figures.append(fig) or "")
    rf.ranking_figure(RecommendDir(tmp_path), [pre, out], "fp16")
    fig = figures[0]
    runs_ax, act_ax = fig.axes
    labels = [t.get_text() for t in runs_ax.get_yticklabels()]
    assert labels[0] == "#1 pre" and labels[1].replace("\n", " ") == f"not ranked: {out.name}"
    assert all(len(line) <= rf.LABEL_WIDTH for line in labels[1].split("\n"))
    fig.canvas.draw()
    width = fig.bbox.width
    for t in runs_ax.get_yticklabels():
        box = t.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= width  # inside the figure: not cut
    assert act_ax.get_xscale() == "log" and "log scale" in act_ax.get_xlabel()
    texts = [t.get_text() for t in runs_ax.texts]
    assert texts == ["1 diverged or stalled", "1 not finished"]
    import matplotlib.pyplot as plt

    plt.close(fig)
