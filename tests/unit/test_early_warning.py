"""Early warnings (issue 55 items 4-5): each detector on rows whose answer is worked out by hand, the live
hook in the loop's hook protocol, the injected faults, and the lead-time table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from normlab.config.train import TrainConfig
from normlab.diagnostics.early_warning import EarlyWarningHook, EarlyWarnings, replay
from normlab.diagnostics.hooks import StepHooks
from normlab.experiments.leadtime import RunOutcome, table
from normlab.train import faults


def _feed(precision: str, rows: list[tuple[dict, dict]]) -> EarlyWarnings:
    warn = EarlyWarnings(precision)
    for step, (tier, metrics) in enumerate(rows):
        warn.feed(step, tier, metrics)
    return warn


def test_stream_growth_warns_within_8x_of_fp16s_maximum_and_stays_silent_in_bf16():
    """The stream doubles every 2 steps from 100: 100 * 2^(t/2) first reaches 65504/8 = 8188 at t = 13
    (9051; t = 12 gives 6400)."""
    rows = [({"step": t, "stream_max": [1.0, 100 * 2 ** (t / 2)]}, {}) for t in range(20)]
    (alert,) = [a for a in _feed("fp16", rows).alerts if a.signal == "stream growth"]
    assert alert.step == 13 and alert.where == "stream layer 1" and "within 8x of fp16's 65,504" in alert.evidence
    assert not [a for a in _feed("bf16", rows).alerts if a.signal == "stream growth"]  # no overflow in reach


def test_logit_growth_takes_the_largest_head_and_warns_at_bf16s_limit_or_before_by_projection():
    """Heads (1, 1.5^t), bf16's limit 256: the fit speaks from t = 9 (10 rows, past 256/16), projects the limit
    within 50 steps on every row from there, and warns after 5 rows in a row, at t = 13 (194.6, before the
    limit at t = 14). A constant logit of 40 (a healthy Qwen3's size) never warns."""
    rows = [({"step": t, "max_logit": [[1.0, 1.5**t]]}, {}) for t in range(20)]
    (alert,) = [a for a in _feed("bf16", rows).alerts if a.signal == "logit growth"]
    assert alert.step == 13 and alert.where == "block 0" and alert.value == pytest.approx(1.5**13)
    assert "will reach bf16's 256" in alert.evidence
    fp16 = [a for a in _feed("fp16", rows).alerts if a.signal == "logit growth"]
    assert fp16 and fp16[0].step == 16  # 2048 / 16 = 128: the fit speaks from t = 12, 5 rows later t = 16
    calm = [({"step": t, "max_logit": [[40.0 + 0.1 * (t % 2)]]}, {}) for t in range(60)]
    assert not [a for a in _feed("bf16", calm).alerts if a.signal == "logit growth"]


def test_a_projected_growth_warns_before_the_headroom_does():
    """Doubling every 6 steps from 2^9: past 65504/16 from t = 18, projected within 50 steps from there (24
    steps left), so after 5 rows in a row it warns at t = 22, before 8x of the maximum (t = 24)."""
    rows = [({"step": t, "stream_max": [2 ** (9 + t / 6)]}, {}) for t in range(40)]
    alert = next(a for a in _feed("fp16", rows).alerts if a.signal == "stream growth")
    headroom_step = math.ceil(6 * (math.log2(65504 / 8) - 9))  # 2^(9 + t/6) >= 8188
    assert alert.step == 22 < headroom_step == 24 and "will reach fp16's 65,504 in ~" in alert.evidence
    assert "doubling every 6 steps" in alert.evidence


def test_spikes_follow_olmo_cores_rule_over_32_steps_and_fire_once():
    grads = [1.0 + 0.01 * (t % 3) for t in range(40)] + [5.0, 1.0, 6.0]
    warn = _feed("fp16", [({}, {"grad_norm": g, "loss": 2.0 + 0.01 * (t % 2)}) for t, g in enumerate(grads)])
    spikes = [a for a in warn.alerts if a.signal == "grad-norm spike"]
    assert [a.step for a in spikes] == [40] and spikes[0].value == 5.0
    assert not [a for a in warn.alerts if a.signal == "loss spike"]
    score = [a for a in warn.alerts if a.signal == "spike score"]
    assert score and score[0].step == 40 and score[0].value == pytest.approx(1 / 41)  # 1 of 41 steps > 2%


def test_the_live_hook_reads_the_tiers_row_after_the_step_and_the_loss_at_the_veto():
    seen = []
    tier = {}
    hook = EarlyWarningHook("bf16", lambda: tier, seen.append)
    hooks = StepHooks([hook])
    for step in range(12):
        tier.clear()
        tier.update({"step": step, "max_logit": [[2.0**step]]})
        hooks.pre_step(step)
        assert hooks.veto(step, 2.0, 1.0) is None  # the hook never vetoes
        hooks.post_step(step, True)
    # 2^8 = 256: bf16's limit; the head-logit rule (tau 800) would need 2^10, 2^11 and 2^12 (steps 10-12)
    assert [(a.signal, a.step) for a in seen] == [("logit growth", 8)]
    assert hooks.summary()["warnings"][0]["signal"] == "logit growth"


def test_faults_by_formula():
    cfg = TrainConfig.of(size="nano", steps=10).with_(
        {"run.fault": "lr_jump", "run.fault_step": 4, "run.fault_scale": 30.0}
    )
    assert [faults.lr_factor(s, cfg) for s in (3, 4, 9)] == [1.0, 30.0, 30.0]
    bad = cfg.with_({"run.fault": "corrupt_batch", "run.fault_scale": 2.0})
    x, y = torch.arange(12).reshape(2, 6), torch.arange(1, 13).reshape(2, 6)
    assert faults.corrupt(3, bad, x, y)[0] is x
    cx, cy = faults.corrupt(5, bad, x, y)
    assert (cx == 0).all() and (cy == 0).all() and faults.corrupt(6, bad, x, y)[0] is x  # steps 4 and 5


def test_logit_growth_multiplies_every_logit_by_the_scale_a_step():
    import normlab

    model = normlab.build_model("pre", "nano", seed=0)
    attn = model.blocks[0].attn
    x = torch.randn(3, model.blocks[0].attn.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    before = (attn.q_proj(x) @ attn.k_proj(x).T).detach()
    hook = faults.LogitGrowthHook(model, start=2, scale=1.21)
    hook.post_step(1, True)  # before the start: nothing
    assert torch.allclose(attn.q_proj(x) @ attn.k_proj(x).T, before)
    hook.post_step(2, True)
    torch.testing.assert_close((attn.q_proj(x) @ attn.k_proj(x).T).detach(), 1.21 * before, rtol=1e-5, atol=1e-6)


def test_lead_times_count_warnings_before_the_event_and_false_alarms_on_healthy_runs():
    runs = [
        RunOutcome(
            "a", "pre", "lr_jump", True, 100, "diverged", "diverged", 60, {"stream growth": 70, "loss spike": 100}
        ),
        RunOutcome(
            "b", "pre", "lr_jump", True, 90, "diverged", "diverged", 60, {"stream growth": 80, "grad-norm spike": 20}
        ),
        RunOutcome("c", "pre", "none", False, None, "", "ok", 0, {"stream growth": 10}),
        RunOutcome("d", "pre", "none", False, None, "", "ok", 0, {}),
    ]
    rows = {r["signal"]: r for r in table(runs) if r["layout"] == "pre"}
    s = rows["stream growth"]
    assert (s["events"], s["detected"], s["lead_median"], s["lead_min"], s["lead_max"]) == (2, 2, 20, 10, 30)
    assert (s["healthy"], s["false_alarms"]) == (4, 1)  # the two healthy runs and the two faulted ones
    assert rows["loss spike"]["detected"] == 0  # at the event's own step: late, no warning
    g = rows["grad-norm spike"]  # step 20, before the fault at 60: the fault cannot have caused it
    assert g["detected"] == 0 and g["false_alarms"] == 1


def test_a_run_with_an_lr_jump_writes_its_warnings_live(tmp_path, capsys):
    """nano, fp16 storage, lr 0.01 x 30 from step 34 (the spike rule's 32-step window full): the alerts on stderr,
    in warnings.jsonl and the summary, and `replay` over the run's files finds the same first alerts."""
    from normlab.cli import main

    out = tmp_path / "run"
    args = ["train", "--size", "nano", "--layout", "pre", "--steps", "44", "--lr", "0.01", "--out", str(out)]
    for kv in ("run.fault=lr_jump", "run.fault_step=34", "run.fault_scale=30", "activation_dtype=fp16", "eval_every=0"):
        args += ["--set", kv]
    assert main(args) == 0
    err = capsys.readouterr().err
    live = [json.loads(line) for line in (out / "warnings.jsonl").read_text().splitlines()]
    assert live and all(a["step"] >= 34 for a in live)  # nothing before the fault

    assert all(f"normlab warning at step {a['step']}: {a['signal']}" in err for a in live)
    summary = json.loads((out / "summary.json").read_text())
    assert [a["signal"] for a in summary["warnings"]] == [a["signal"] for a in live]
    assert [(a.signal, a.step) for a in replay(out)] == [(a["signal"], a["step"]) for a in live]


def test_micro_batches_carry_the_corrupted_batch():
    """The batches training reads (`trainer.micro_batches`) are the corrupted ones within the fault's steps."""
    from types import SimpleNamespace

    from normlab.train.trainer import micro_batches

    cfg = TrainConfig.of(size="nano", batch_size=4, seq_len=8).with_(
        {"run.fault": "corrupt_batch", "run.fault_step": 3, "run.fault_scale": 2.0}
    )
    window = lambda step, b, t, seed: torch.arange(b * (t + 1)).reshape(b, t + 1) + step
    state = SimpleNamespace(
        cfg=cfg,
        info=SimpleNamespace(world=1, rank=0, device=torch.device("cpu")),
        data=SimpleNamespace(train_window=window),
    )
    ((x, y),) = micro_batches(state, 2)
    assert x.unique().numel() > 1
    for step in (3, 4):
        ((x, y),) = micro_batches(state, step)
        assert (x == step).all() and (y == step).all()  # the batch's first token, everywhere
    assert micro_batches(state, 5)[0][0].unique().numel() > 1


@pytest.mark.slow  # two trainings; micro_batches' test above covers where the corruption enters (make test-all)
def test_a_corrupted_batch_reaches_training(tmp_path):
    """corrupt_batch at step 3 for one step: the loss differs there from the unfaulted twin's, not before."""
    from normlab.cli import main

    losses = {}
    for fault in ("none", "corrupt_batch"):
        out = tmp_path / fault
        args = ["train", "--size", "nano", "--layout", "pre", "--steps", "5", "--lr", "0.01", "--out", str(out)]
        for kv in (f"run.fault={fault}", "run.fault_step=3", "run.fault_scale=1", "eval_every=0", "probe_every=0"):
            args += ["--set", kv]
        assert main(args) == 0
        losses[fault] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses["none"][:3] == losses["corrupt_batch"][:3] and losses["none"][3] != losses["corrupt_batch"][3]


def test_the_loss_rise_rule_warns_from_the_second_step_and_on_a_non_finite_loss():
    """The start is the first finite loss (5.0 at step 0); 5.9 and 6.0 are within LOSS_RISE (1 nat) of it, 6.01
    is past it at step 3, long before any spike rule's 32-step window. It fires once; a NaN loss fires it."""
    from normlab.diagnostics.early_warning import LOSS_RISE

    warn = _feed("bf16", [({}, {"loss": v}) for v in (5.0, 5.9, 5.0 + LOSS_RISE, 6.01, 30.0)])
    (alert,) = warn.alerts
    assert (alert.signal, alert.step, alert.value) == ("loss rise", 3, 6.01)
    assert "1.01 nats above its start (5 at step 0" in alert.evidence
    nan = _feed("fp32", [({}, {"loss": v}) for v in (math.nan, 5.0, 4.0)]).alerts
    assert [(a.signal, a.step) for a in nan] == [("loss rise", 0)]
    calm = _feed("bf16", [({}, {"loss": 5.0 - 0.05 * t + 0.3 * (t % 2)}) for t in range(60)])
    assert not calm.alerts


@pytest.mark.parametrize(
    "precision, match",
    [("fp8", r"precision must be one of fp16, bf16, fp32 .* got 'fp8'$"), (16, r".* got 16$"), (None, r".* got None$")],
)
def test_early_warnings_refuse_a_precision_they_have_no_limits_for(precision, match):
    from normlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^EarlyWarnings: " + match):
        EarlyWarnings(precision)


@pytest.mark.parametrize(
    "step, tier, metrics, match",
    [
        (math.nan, {}, {}, r"the step must be a whole number >= 0, got nan$"),
        (-1, {}, {}, r"the step must be a whole number >= 0, got -1$"),
        ("3", {}, {}, r"the step must be a whole number >= 0, got '3'$"),
        (2.5, {}, {}, r"the step must be a whole number >= 0, got 2.5$"),
        (True, {}, {}, r".* got True$"),
        (4, {}, {}, r"step 4 does not come after the last step fed \(4\); steps must increase$"),
        (3, {}, {}, r"step 3 does not come after the last step fed \(4\)"),
        (5, {}, {"loss": "2.5"}, r"metrics\['loss'\] must be a number or None, got '2.5'$"),
        (5, {}, {"grad_norm": [1.0]}, r"metrics\['grad_norm'\] must be a number or None"),
        (5, [1.0], {}, r"tier must be a dict \(its row for the step, or \{\}\), got list$"),
        (5, {}, None, r"metrics must be a dict"),
        (5, {"stream_max": 3.0}, {}, r"tier\['stream_max'\] must be a list of numbers \(one per layer\), got 3.0$"),
        (5, {"stream_max": ["x"]}, {}, r"tier\['stream_max'\] must be a list of numbers"),
        (5, {"max_logit": [1.0, 2.0]}, {}, r"tier\['max_logit'\] must be a list of lists of numbers"),
        (5, {"update_ratio": {"0": 1.0}}, {}, r"tier\['update_ratio'\] must be a list of numbers"),
    ],
)
def test_early_warnings_refuse_steps_and_rows_they_cannot_read_in_one_line(step, tier, metrics, match):
    """As `TrainingMonitor.step` does: a ConfigError of one line, and the detectors as they were (step 4 fed, the
    next good step 5 still accepted)."""
    from normlab.errors import ConfigError

    warn = EarlyWarnings("fp16")
    warn.feed(4, {"stream_max": [1.0]}, {"loss": 2.0, "grad_norm": 1.0})
    with pytest.raises(ConfigError, match=r"^EarlyWarnings\.feed: " + match) as caught:
        warn.feed(step, tier, metrics)
    assert "\n" not in str(caught.value)
    assert warn.last_step == 4 and warn.rise.start == 2.0 and warn.feed(5, {"stream_max": [2.0]}, {"loss": 2.1}) == []


def test_replay_skips_rows_it_cannot_read_and_counts_them(tmp_path):
    """A hand-edited metrics.jsonl (a string loss, a step going backwards) replays its readable rows."""
    from normlab.diagnostics.early_warning import replayed

    rows = [{"step": 0, "loss": 5.0}, {"step": 1, "loss": "oops"}, {"step": 2, "loss": 7.0}, {"step": 1, "loss": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    warn = replayed(tmp_path, "bf16")
    assert warn.skipped_rows == 2 and [(a.signal, a.step) for a in warn.alerts] == [("loss rise", 2)]
