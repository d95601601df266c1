"""Effective speedup (normlab.recommend.evidence.speedup), the norm tax (normlab.recommend.evidence.tax) and the gate
(normlab.recommend.evidence.gate), each against formulas written here."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from normlab.model.config import get_size
from normlab.recommend.evidence import answer, gate, speedup, tax
from normlab.recommend.evidence.rank import Evidence

EPS64 = np.finfo(np.float64).eps


def _curve(e=1.5, a=40.0, alpha=0.5, tokens=1e4):
    c = speedup.Curve(e, a, alpha, tokens, 0.0, 0.0)
    return speedup.Curve(e, a, alpha, tokens, c.loss(tokens), 0.0)


def test_the_power_law_is_inverted_exactly():
    c = _curve()
    for t in (10.0, 1e3, 1e4, 3e5):
        # T(L(t)) = t: a few roundings in a power and a root
        assert c.tokens_for(c.loss(t)) == pytest.approx(t, rel=64 * EPS64)
    assert c.tokens_for(c.e) == math.inf and c.tokens_for(c.e - 1) == math.inf


def test_the_fit_recovers_an_exact_power_law():
    t = np.linspace(1e3, 1e5, 150)
    e, a, alpha = 1.2, 60.0, 0.45
    c = speedup.fit_curve(t, e + a * t ** (-alpha))
    assert c is not None
    # curve_fit's own stopping tolerances (1e-8 relative in the residual) bound the recovery far below 1e-3
    assert (c.e, c.a, c.alpha) == pytest.approx((e, a, alpha), rel=1e-3)
    assert c.tokens == t[-1] and c.at_end == pytest.approx(e + a * t[-1] ** (-alpha), rel=1e-9)
    assert c.rmse < 1e-6
    assert speedup.fit_curve(t[:3], t[:3]) is None  # too few points


def test_smoothed_curve_is_a_trailing_mean_of_the_finite_losses():
    rows = [{"step": i, "tokens": 10 * (i + 1), "loss": float(i)} for i in range(6)]
    rows.insert(2, {"step": 99, "tokens": 1, "loss": float("nan")})
    rows.append({"step": 6, "val_loss": 3.0})
    t, y = speedup.smoothed_curve(rows, window=3)
    assert list(t) == [10, 20, 30, 40, 50, 60]
    assert list(y) == pytest.approx([0, 0.5, 1, 2, 3, 4])


def test_the_speedup_is_the_baselines_tokens_to_the_candidates_loss_over_its_own_after_the_tax():
    c = _curve()
    d = c.loss(5e3) - c.at_end  # a worse candidate: the baseline reached its loss at half the tokens
    s = speedup.speedup(c, d, [d - 0.01, d + 0.01], 0.10, [0.05, 0.15])
    assert s["token_ratio"] == pytest.approx(0.5, rel=1e-9) and s["value"] == pytest.approx(0.5 / 1.10, rel=1e-9)
    lo = c.tokens_for(c.at_end + d + 0.01) / 1e4 / 1.15  # the worse loss end with the dearer tax end
    hi = c.tokens_for(c.at_end + d - 0.01) / 1e4 / 1.05
    assert s["interval"] == pytest.approx([lo, hi], rel=1e-9) and lo < s["value"] < hi
    same = speedup.speedup(c, 0.0, None, 0.0, None)
    assert same["value"] == pytest.approx(1.0, rel=64 * EPS64) and same["interval"] is None
    better = speedup.speedup(c, c.loss(1.5e4) - c.at_end, None, 0.0, None)  # within the 2x extrapolation
    assert better["value"] == pytest.approx(1.5, rel=1e-9) and better["bound"] is None
    slow = speedup.speedup(c, c.loss(1e3) - c.at_end, [0.0, 2.0], 0.0, None)  # before a quarter of T: an upper bound
    assert slow["bound"] == "upper" and slow["value"] == speedup.FIT_FROM and slow["interval_bounded"][0] == "upper"
    assert speedup.words(slow).startswith("<= x0.25 [<= 0.25, 1.00]")
    far = speedup.speedup(c, c.loss(1e6) - c.at_end, None, 0.02, None)  # past 2x: a lower bound
    assert far["bound"] == "lower" and far["value"] == pytest.approx(2.0 / 1.02, rel=1e-12)
    assert speedup.words({**far, "tax": {"value": 0.02, "mode": "eager", "device": "cpu"}}).startswith(">= x1.96")


def _write_run(grid, run_id, losses, tokens_per_step=100):
    d = grid / "runs" / run_id
    d.mkdir(parents=True)
    rows = [{"step": i, "loss": x, "tokens": tokens_per_step * (i + 1)} for i, x in enumerate(losses)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_for_pair_reads_the_baselines_curve_and_welchs_interval(tmp_path):
    steps = np.arange(1, 101) * 100.0
    law = lambda t, shift: 1.0 + 30.0 * t ** (-0.5) + shift
    rows = []
    for seed, (bs, cs) in enumerate(((0.0, -0.02), (0.004, -0.016))):
        for layout, shift in (("pre", bs), ("peri", cs)):
            rid = f"{layout}-{seed}"
            losses = list(law(steps, shift))
            _write_run(tmp_path, rid, losses)
            final = sum(losses[-10:]) / 10
            rows.append(
                {"run_id": rid, "layout": layout, "lr": 0.01, "seed": seed, "status": "ok", "final_loss": final}
            )
    runs = pd.DataFrame(rows)
    base = Evidence("pre", "stable", "", finished=2, best_lr=0.01)
    cand = Evidence("peri", "stable", "", finished=2, best_lr=0.01)
    t = {"value": 0.03, "interval": [0.02, 0.04], "mode": "eager", "device": "cpu"}
    s = speedup.for_pair(runs, tmp_path, base, cand, t, 64, 8)
    a = list(runs[runs.layout == "peri"].final_loss)
    b = list(runs[runs.layout == "pre"].final_loss)
    d = np.mean(a) - np.mean(b)
    assert s["difference"] == pytest.approx(d, rel=1e-12) and s["seeds"] == [2, 2]
    assert s["value"] > 1 and len(s["interval"]) == 2 and s["interval"][0] < s["value"] < s["interval"][1]
    # against the law itself: the baseline reaches the candidate's loss, law(T) + d, at t = ((law(T) - 1 + d) / 30)^-2.
    # The runs' losses are the law exactly, but the curve read is the trailing mean of 10 steps, which lags the law
    # by about 4.5 steps (450 of 10,000 tokens): the fitted slope at T, and so t / T, within a few percent
    t_law = ((1.0 + 30.0 * 1e4**-0.5 + d - 1.0) / 30.0) ** -2
    assert d == pytest.approx(-0.02, abs=1e-12) and s["value"] == pytest.approx(t_law / 1e4 / 1.03, rel=2e-2)
    assert s["by_scale"][0]["width"] == 64 and s["projection"]["value"] is None and s["tax"] is t
    one = speedup.for_pair(runs[runs.seed == 0], tmp_path, base, cand, t, 64, 8)
    assert one["interval"] is None and "second seed" in one["why_interval"]


def test_the_tax_is_the_geometric_mean_ratio_with_students_interval_over_the_turns_log_ratios():
    ratios = [1.02, 1.05, 1.03, 1.08, 1.01]
    value, iv = tax.ratio_stats(ratios)
    logs = np.log(ratios)
    half = stats.t.ppf(0.975, 4) * logs.std(ddof=1) / math.sqrt(5)
    assert value == pytest.approx(math.exp(logs.mean()) - 1, rel=1e-12)
    # two levels of timing (a busy machine): the point from the same mean as the interval, so inside it
    v2, iv2 = tax.ratio_stats([1.05] * 8 + [1.00] * 7)
    assert iv2[0] <= v2 <= iv2[1]
    assert iv == pytest.approx([math.exp(logs.mean() - half) - 1, math.exp(logs.mean() + half) - 1], rel=1e-12)
    assert tax.ratio_stats([1.1]) == (pytest.approx(0.1), None)


def test_the_tax_is_timed_at_the_users_shape_named_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    cfg = get_size("nano").with_(max_seq_len=4096)
    t = tax.measure(cfg, "pre", "peri", tax.TaxTiming(turns=3))
    assert t.device_type == "cpu" and t.bound == "lower" and "cores" in t.device and t.turns == 3
    assert t.shape["d_model"] == cfg.d_model and t.shape["tokens"] == tax.CPU_TOKENS and t.shape["user_seq_len"] == 4096
    assert math.isfinite(t.value) and t.interval[0] <= t.interval[1] and not t.cached
    again = tax.measure(cfg, "pre", "peri", tax.TaxTiming(turns=3))
    assert again.cached and again.value == t.value  # read back, not timed again
    other = tax.measure(cfg.with_(d_model=cfg.d_model * 2), "pre", "peri", tax.TaxTiming(turns=2))
    assert not other.cached  # another shape is another key
    assert "lower bound for a GPU" in tax.words(t.to_dict())
    assert tax.is_cached(cfg, "pre", "peri", "eager") and not tax.is_cached(cfg, "pre", "peri", "compiled")
    longer = tax.measure(cfg, "pre", "qwen3", tax.TaxTiming(turns=2, extra_s=60.0, use_cache=False))
    assert longer.turns == tax.MAX_TURNS  # a tiny block: every extra turn fits in the 60 s
    with pytest.raises(tax.TaxSkipped, match="too large"):
        tax.measure(cfg.with_(d_model=16384, d_ff=65536, n_heads=128), "pre", "peri")


@pytest.mark.slow  # torch.compile of two blocks (30-100 s on a CPU); the eager test above times the same code path
def test_the_compiled_tax_is_timed_under_torch_compile_and_cached_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    cfg = get_size("nano")
    t = tax.measure(cfg, "pre", "peri", tax.TaxTiming(mode="compiled", turns=2))
    assert t.mode == "compiled" and t.turns == 2 and math.isfinite(t.value)
    assert tax.is_cached(cfg, "pre", "peri", "compiled") and not tax.is_cached(cfg, "pre", "peri", "eager")


def _ev(name, finished=2, diverged=0, stalled=0, at_risk=0, best_lr=0.01, runs=2, unfinished=0, rank=1):
    return Evidence(
        name,
        "stable",
        "",
        runs=runs,
        finished=finished,
        diverged=diverged,
        stalled=stalled,
        at_risk=at_risk,
        best_lr=best_lr,
        unfinished=unfinished,
        rank=rank,
    )


def test_the_gate_changes_only_on_a_lower_bound_above_one_or_a_baseline_that_never_trained():
    pre, peri = _ev("pre", rank=2), _ev("peri")
    fast = {"value": 1.2, "interval": [1.05, 1.4]}
    assert gate.verdict([peri, pre], "pre", fast)["decision"] == "change"
    assert gate.verdict([peri, pre], "pre", fast)["gate"] == "speedup"
    v = gate.verdict([peri, pre], "pre", {"value": 1.1, "interval": [0.97, 1.25]})
    assert v["decision"] == "keep" and "does not exceed 1" in v["why"]
    v = gate.verdict([peri, pre], "pre", {"value": 1.3, "interval": None})
    assert v["decision"] == "keep" and "no interval" in v["why"] and "second seed" in v["next"]
    risky = _ev("peri", at_risk=2)
    v = gate.verdict([risky, pre], "pre", fast)
    assert v["decision"] == "keep" and "at risk more often" in v["why"]
    # the user's placement never trained, the change did: a change for stability
    failed = _ev("pre", diverged=2, best_lr=None, rank=2)
    v = gate.verdict([peri, failed], "pre", {"value": None})
    assert (v["decision"], v["gate"]) == ("change", "stability")
    # a failed baseline beside a candidate the budget stopped: no answer yet, never "keep yours"
    stopped = _ev("peri", finished=0, best_lr=None, unfinished=2, rank=None)
    failed_first = _ev("pre", finished=1, diverged=1, runs=1, best_lr=None, rank=1)
    v = gate.verdict([failed_first, stopped], "pre", None)
    assert v["decision"] == "no answer yet" and "same command again" in v["next"]
    assert gate.headline(v, "", None).startswith("**No answer yet**")
    # the user's placement stopped by the budget (no finished run) beside a trained leader: no answer, never a change
    stopped_base = _ev("pre", finished=0, best_lr=None, unfinished=2, rank=None)
    assert gate.verdict([peri, stopped_base], "pre", None)["decision"] == "no answer yet"
    # failed where it finished, but a run still stopped: not yet a verdict
    half = _ev("pre", finished=1, diverged=1, unfinished=1, best_lr=None, rank=2)
    assert gate.verdict([peri, half], "pre", None)["decision"] == "no answer yet"
    # neither trained anywhere: no answer, with the learning rates to lower
    both = _ev("peri", diverged=2, best_lr=None)
    v = gate.verdict([both, failed], "pre", None)
    assert v["decision"] == "no answer yet" and "--lrs" in v["why"]
    # the leader failed on the ladder's rungs more often than yours: keep, whatever the speedup
    v = gate.verdict([peri, pre], "pre", {**fast, "ladder_failures": {"peri": 2, "pre": 0}})
    assert v["decision"] == "keep" and "ladder's rungs 2 failed" in v["why"]
    # no placement named: the ranking's first, ungated
    assert gate.verdict([peri, pre], None, None)["decision"] == "recommend"


def test_the_ladders_projection_is_ols_on_log_log_with_students_prediction_interval():
    from normlab.recommend.evidence import ladder

    compute = [1e12, 8e12, 6.4e13]
    values = [1.05, 1.10, 1.12]
    rungs = [{"width": w, "compute": c, "value": v} for w, c, v in zip((32, 64, 128), compute, values)]
    x0 = 1e21
    p = ladder.fit(rungs, x0)
    x, y = np.log(compute), np.log(values)
    b, a = np.polyfit(x, y, 1)
    s = math.sqrt(((y - (a + b * x)) ** 2).sum() / 1)
    sxx = ((x - x.mean()) ** 2).sum()
    half = stats.t.ppf(0.975, 1) * s * math.sqrt(1 + 1 / 3 + (math.log(x0) - x.mean()) ** 2 / sxx)
    mid = a + b * math.log(x0)
    assert p["value"] == pytest.approx(math.exp(mid), rel=1e-9)
    assert p["interval"] == pytest.approx([math.exp(mid - half), math.exp(mid + half)], rel=1e-9)
    assert p["slope"] == pytest.approx(b, rel=1e-9) and p["degrees_of_freedom"] == 1
    # one degree of freedom (t = 12.7): the slope's interval holds 0, so the advantage "holds" as far as 3 rungs tell
    assert p["trend"] == "holds" and p["slope_interval"][0] < 0 < p["slope_interval"][1]
    exact = ladder.fit([{**r, "value": 1.1 * (r["compute"] / 1e12) ** 0.05} for r in rungs], x0)
    assert exact["trend"] == "grows" and exact["interval"][0] == pytest.approx(exact["value"], rel=1e-6)
    assert exact["crosses_1_at"] is None and exact["lower_bound_above_1"]
    # a rung past the extrapolation limit enters at its bound, and the projection is said to be of bounds
    bounded = ladder.fit(rungs[:2] + [{**rungs[2], "bound": "lower"}], x0)
    assert (
        bounded["bound"] == "lower" and bounded["bounds_at"] == [128] and bounded["value"] == pytest.approx(p["value"])
    )
    assert ladder.words(bounded).startswith("a lower bound")
    flat = ladder.fit([{**r, "value": 2.0, "bound": "lower"} for r in rungs], x0)  # all at the same bound
    assert flat["interval"] is None and "no spread" in flat["why"] and ladder.words(flat) == flat["why"]
    two = ladder.fit([*rungs[:2], {**rungs[2], "value": None}], x0)
    assert two["value"] is None and two["left_out"] == [128] and "three" in two["why"]
    assert ladder.rung_steps(128, 150) == 300 and ladder.rung_steps(32, 150) == 75 and ladder.off_proxy() == [32, 128]
    # the user's FLOPs on the rungs' definition: 6 x (the matrices + the head) + 12 L H Q T a token, x 20 N tokens
    llama = get_size("nano").with_(d_model=2048, n_layers=16, n_heads=32, vocab_size=128256, max_seq_len=131072)
    per_token = 6 * (1e9 + 128256 * 2048) + 12 * 16 * 32 * 64 * 4096
    flops, how = ladder.user_compute(llama, 1e9, None)
    assert flops == pytest.approx(per_token * 2e10, rel=1e-12) and "sequences of 4096" in how
    assert ladder.user_compute(llama, 1e9, 1e12)[0] == pytest.approx(per_token * 1e12, rel=1e-12)


def test_the_plan_buys_two_seeds_then_the_widest_ladder_that_fits_and_names_the_budgets_that_would():
    from normlab.model.config import ModelConfig
    from normlab.recommend.planning import plan
    from normlab.recommend.planning.cost import Calibration
    from normlab.recommend.planning.plan_record import Plan

    cal = Calibration(c0=0.275, c_flop=0.0, c_norm=0.0, s0=5.0, s_layer=0.0, s_flop=0.0, seconds=1.0)
    user = ModelConfig(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256)
    names = ["pre", "peri", "post", "qwen3", "olmo2", "deepnorm", "hybrid", "pre-gate"]
    small = plan.make_plan(names, "pre", user, cal, 8 * 60, 2, 150)
    assert small.seeds == [0, 1] and small.ladder is None
    said = next(c for c in small.cut if c.startswith("one rung (the proxy)"))
    # the narrow ladder's budget first, then the wide one's: "--budget N buys the ladder at widths 16, 32, 64,
    # --budget M at 32, 64, 128"
    narrow, wide = (int(x.split()[0]) for x in said.split("--budget ")[1:])
    assert "ladder at widths 16, 32, 64" in said and "ladder at widths 32, 64, 128" in said and narrow <= wide
    bought = plan.make_plan(names, "pre", user, cal, wide * 60, 2, 150)
    assert bought.ladder is not None and bought.ladder.steps == {"32": 75, "128": 300}
    assert bought.ladder.widths == [32, 64, 128]
    assert bought.predicted["ladder"] == pytest.approx(bought.ladder.predicted_s)
    assert not any(c.startswith("one rung") for c in bought.cut)
    cheap = plan.make_plan(names, "pre", user, cal, narrow * 60, 2, 150)
    assert cheap.ladder is not None and cheap.ladder.widths in ([16, 32, 64], [32, 64, 128])
    only = plan.make_plan(names, "pre", user, cal, wide * 60, 2, 150, ladders=(2,))  # --ladder narrow
    assert only.ladder is not None and only.ladder.widths == [16, 32, 64]
    assert plan.make_plan(names, "pre", user, cal, 600 * 60, 2, 150, ladders=()).ladder is None  # --ladder none
    quick = plan.make_plan(names, "pre", user, cal, 600 * 60, 2, 150, screen=False)
    assert quick.ladder is None  # the quick question is one rung
    assert Plan.from_json(bought.to_json()) == bought


def test_the_seed_noise_is_pooled_over_the_grids_finished_cells_when_that_has_more_degrees_of_freedom():
    rows = []
    losses = {("pre", 0.01): [2.0, 2.1], ("pre", 0.1): [2.5, 2.3], ("peri", 0.01): [1.9, 1.95], ("peri", 0.1): [2.2]}
    for (layout, lr), xs in losses.items():
        rows += [{"layout": layout, "lr": lr, "status": "ok", "final_loss": x} for x in xs]
    rows.append({"layout": "pre", "lr": 0.3, "status": "diverged", "final_loss": 9.0})  # not a finished cell
    runs = pd.DataFrame(rows)
    a, b = losses[("peri", 0.01)], losses[("pre", 0.01)]
    iv, df = speedup.pooled_interval(runs, a, b)
    # within-cell sum of squares over the cells with two seeds, (n - 1) each: 3 degrees of freedom
    ss = sum(((np.array(x) - np.mean(x)) ** 2).sum() for x in losses.values() if len(x) >= 2)
    half = stats.t.ppf(0.975, 3) * math.sqrt(ss / 3 * (1 / 2 + 1 / 2))
    d = np.mean(a) - np.mean(b)
    assert df == 3 and iv == pytest.approx([d - half, d + half], rel=1e-12)
    assert answer.welch_df(a, b) < df  # two seeds a side: Welch has at most 2
    assert speedup.pooled_interval(runs[runs.lr == 0.3], a, b) is None  # no cell with two finished seeds


def test_every_plan_with_a_final_round_carries_two_seeds_before_a_deeper_proxy():
    """Steps priced by their FLOPs (so depth costs): over budgets of 2-12 minutes, every plan that holds a final
    round holds its second seed, and the smallest budgets that buy them take shallower proxies first."""
    from normlab.recommend.planning import plan
    from normlab.recommend.planning.cost import REFERENCE_SHAPE, Calibration
    from normlab.recommend.planning.work import step_work

    c_flop = 0.275 / step_work(REFERENCE_SHAPE, "pre")[0]
    cal = Calibration(c0=0.0, c_flop=c_flop, c_norm=0.0, s0=1.0, s_layer=0.0, s_flop=0.0, seconds=1.0)
    user = REFERENCE_SHAPE.with_(n_layers=16)
    plans = []
    for quarter in range(8, 49):
        try:
            plans.append(plan.make_plan(["pre", "peri", "post", "hybrid"], "pre", user, cal, quarter * 15, 2, 150))
        except plan.BudgetTooSmall:
            continue
    with_final = [p for p in plans if p.finalists]
    assert with_final and all(p.seeds == [0, 1] for p in with_final)
    assert with_final[0].depth < 12  # the first budget with an interval bought it with a shallower proxy


def test_holdout_refuses_a_recommendation_lacking_a_key_in_one_line_and_writes_nothing(tmp_path):
    """A folder whose recommendation.json an older normlab wrote (no "optimizer" key): one line naming the key,
    before anything is made; the script's transfer record is the one the package ships."""
    import importlib.util
    from pathlib import Path

    from normlab.errors import ConfigError
    from normlab.recommend.evidence import holdout

    golden = json.loads((Path(__file__).parents[1] / "golden" / "recommend_records.json").read_text())
    rec = tmp_path / "rec"
    rec.mkdir()
    older = {k: v for k, v in golden["recommendation_json"].items() if k != "optimizer"}
    (rec / "recommendation.json").write_text(json.dumps(older))
    (rec / "plan.json").write_text(json.dumps(golden["plan_json"]))
    with pytest.raises(ConfigError) as err:
        holdout.holdout(rec, tmp_path / "held", log=lambda *a: None)
    assert "'optimizer'" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "held").exists()
    script = Path(__file__).resolve().parents[2] / "scripts" / "speedup_holdout.py"
    spec = importlib.util.spec_from_file_location("speedup_holdout", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.RECORD.is_file() and "speedup_projections" in json.loads(module.RECORD.read_text())
