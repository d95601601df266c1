"""The trainer: reproducibility, exact resume, crash-safe checkpoints, divergence, config errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from normlab.data import TokenData
from normlab.errors import ConfigError
from normlab.runs.checkpoint import list_checkpoints, load_checkpoint
from normlab.train import TrainConfig, TrainingFailed, train
from normlab.train import trainer as trainer_mod
from normlab.train.divergence import DivergenceMonitor, SpikeDetector
from normlab.train.optim import lr_at, param_groups
from tests.helpers import REPO, losses, rows, small


def test_same_seed_same_curve(corpus, tmp_path):
    train(small(corpus, tmp_path / "a"))
    train(small(corpus, tmp_path / "b"))
    train(small(corpus, tmp_path / "c", seed=1))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert losses(tmp_path / "a") != losses(tmp_path / "c")
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["status"] == "ok" and s["steps"] == 12 and s["tokens"] == 12 * 8 * 32
    assert s["final_val_loss"] is not None and s["final_loss"] < s["initial_loss"]
    # OLMo-core's spike score: 12 steps are shorter than its 128-step window, so no score, every step counted
    assert (s["spike_score"], s["spike_score_steps"], s["spike_score_window"]) == (None, 12, 128)


def test_a_cpu_run_flushes_subnormal_floats(corpus, tmp_path):
    """Subnormals take the CPU's slow path (a stalled bf16 Post-LN run: 3.6x): a CPU run flushes them to 0."""
    subnormal = lambda: torch.tensor([1e-39]).mul(1.0).item()
    torch.set_flush_denormal(False)
    try:
        assert subnormal() != 0.0
        train(small(corpus, tmp_path / "a", steps=2))
        assert subnormal() == 0.0
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("opt", [{}, {"optimizer": "muon", "lr": 0.02, "qk_clip": 0.05}], ids=["adamw", "muon+qk_clip"])
def test_resume_gives_the_identical_remaining_curve(corpus, tmp_path, monkeypatch, opt):
    full = small(corpus, tmp_path / "full", grad_accum=2, **opt)
    train(full)
    # Interrupt a second run after its step-6 checkpoint by failing inside step 8.
    real = TokenData.train_window

    def failing(self, step, *a, **k):
        if step == 8:
            raise KeyboardInterrupt("simulated interruption")
        return real(self, step, *a, **k)

    cut = small(corpus, tmp_path / "cut", grad_accum=2, ckpt_every=3, keep_last=2, **opt)
    monkeypatch.setattr(TokenData, "train_window", failing)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    monkeypatch.setattr(TokenData, "train_window", real)
    assert [p.name for p in list_checkpoints(cut.run.out)] == ["step_00000003.pt", "step_00000006.pt"]
    assert len(rows(cut.run.out)) == 8  # steps 0-7 were logged before the interruption
    train(cut)  # resumes from step 6; rows 6-7 are replayed, not duplicated
    a, b = rows(full.run.out), rows(cut.run.out)
    assert [r["step"] for r in b] == list(range(12))
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr", "tokens", "val_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    assert [p.name for p in list_checkpoints(cut.run.out)] == ["step_00000009.pt", "step_00000012.pt"]
    params = [
        load_checkpoint(run / "checkpoints" / "step_00000012.pt")["model"]
        for run in (tmp_path / "full", tmp_path / "cut")
    ]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])  # the weights bit for bit
    if opt:
        assert load_checkpoint(tmp_path / "cut" / "checkpoints" / "step_00000012.pt")["optimizer"]["muon"]["state"]
    if "qk_clip" in opt:
        s = json.loads((tmp_path / "cut" / "summary.json").read_text())
        assert (
            s["qk_clip"]["interventions"]
            == json.loads((tmp_path / "full" / "summary.json").read_text())["qk_clip"]["interventions"]
        )
        assert s["qk_clip"]["interventions"] > 0  # tau 0.05 is below this model's logits (about 0.1): the clip acted


def test_kill_during_checkpoint_write_leaves_a_loadable_checkpoint(corpus, tmp_path):
    """SIGKILL between writing the temp file and renaming it: the old checkpoint stays valid."""
    run = tmp_path / "run"
    train(small(corpus, run, steps=3))
    good = list_checkpoints(run)
    assert [p.name for p in good] == ["step_00000003.pt"]
    child = f"""
import os, time, sys
import normlab.io as io
real_fsync = os.fsync
def slow_fsync(fd):
    real_fsync(fd)
    print("written", flush=True)
    time.sleep(60)
io.os.fsync = slow_fsync
from normlab.runs.checkpoint import save_checkpoint
import torch
save_checkpoint({str(run)!r}, 4, {{"model": {{"w": torch.zeros(1000, 1000)}}}}, keep_last=2)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert [p.name for p in list_checkpoints(run)] == ["step_00000003.pt"]
    leftovers = [p.name for p in (run / "checkpoints").iterdir()]
    assert any(n.startswith(".step_00000004.pt.") and n.endswith(".tmp") for n in leftovers)
    ckpt = load_checkpoint(list_checkpoints(run)[-1])
    assert ckpt["step"] == 3 and "model" in ckpt
    # and the run resumes from it, clearing the dead write's temp file
    assert train(small(corpus, run, steps=3))["steps"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003.pt", "step_00000003.pt.sha256"]


def test_huge_lr_is_recorded_as_diverged_and_exits_cleanly(corpus, tmp_path):
    out = tmp_path / "boom"
    cmd = [
        sys.executable,
        "-m",
        "normlab",
        "train",
        "--data",
        str(corpus),
        "--size",
        "nano",
        "--layout",
        "none",
        "--lr",
        "1e4",
        "--grad-clip",
        "0",
        "--warmup",
        "0",
        "--steps",
        "30",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--out",
        str(out),
        "--no-progress",
        "--diverge-patience",
        "5",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0, res.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "diverged" and isinstance(s["diverged_step"], int) and s["diverged_step"] < 30
    assert "diverged at step" in res.stdout
    assert s["steps"] == s["diverged_step"] + 1


def test_nonfinite_policies():
    m = DivergenceMonitor()
    assert not m.check_finite(4, float("nan"), 1.0, "skip") and m.status == "ok" and m.skipped_steps == [4]
    assert not m.check_finite(5, 2.0, float("inf"), "stop")
    assert m.status == "diverged" and m.diverged_step == 5 and "gradient norm" in m.reason


def test_loss_rules():
    m = DivergenceMonitor(patience=3)
    for step, loss in enumerate([5.0, 5.1, 5.2, 4.0, 5.5, 5.6, 5.7]):
        m.update(step, loss, 1.0)
    assert m.diverged_step == 6 and "above its initial value 5.0000 for 3 steps" in m.reason
    f = DivergenceMonitor(patience=0, final_loss=2.0)
    for step in range(20):
        f.update(step, 3.0 - step * 0.01, 1.0)
    f.finish(20)
    assert f.diverged and "final loss" in f.reason


def _run_monitor(curve: list[float], unigram: float | None = 3.3, margin: float = 0.05) -> DivergenceMonitor:
    m = DivergenceMonitor(patience=0, unigram_loss=unigram, stall_margin=margin)
    for step, loss in enumerate(curve):
        m.update(step, loss, 1.0)
    m.finish(len(curve))
    return m


def test_stalled_rule():
    """Stalled: ends within 5% of the unigram loss U = 3.3 (0.165 nats) or above, and improved by less
    than a fifth of that (0.033) over the last quarter. 100 steps: the last quarter starts at step 75,
    judged on the mean of steps 65-74 against the mean of the last 10."""
    flat = [5.5 - 0.2 * i for i in range(11)] + [3.32 + 0.01 * (i % 3) for i in range(89)]  # 3.3 from step 11
    m = _run_monitor(flat)
    assert m.status == "stalled" and not m.diverged and "unigram loss 3.3000" in m.reason
    assert "last 25 steps" in m.reason and m.summary()["unigram_loss"] == 3.3
    # learned (2.5 by step 50), then fell back to U and sat there: stalled too
    relapse = [5.5 - 0.06 * i for i in range(50)] + [3.3] * 50
    assert _run_monitor(relapse).status == "stalled"
    # a slow run still descending towards U at the end (0.3 over the last quarter): short of budget, ok
    slow = [5.5 - 0.021 * i for i in range(100)]  # 3.42 at the end, 3.95 at step 75
    assert _run_monitor(slow).status == "ok" and _run_monitor(slow).reason is None
    # at U, improving 0.05 over the last quarter (more than 0.033): ok; 0.02: stalled
    assert _run_monitor([3.35] * 70 + [3.35 - 0.05 * i / 29 for i in range(30)]).status == "ok"
    assert _run_monitor([3.35] * 70 + [3.35 - 0.02 * i / 29 for i in range(30)]).status == "stalled"
    # learned past U: ok whatever the slope
    assert _run_monitor([5.5 - 0.03 * i for i in range(60)] + [2.2] * 40).status == "ok"
    # ends just beyond the margin (U - 0.165 - 0.01): ok
    assert _run_monitor([3.3 - 0.175] * 100).status == "ok"
    assert _run_monitor([3.3 - 0.155] * 100).status == "stalled"
    # the rule is off without a unigram loss, with margin 0, and for runs too short to judge
    assert _run_monitor(flat, unigram=None).status == "ok"
    assert _run_monitor(flat, margin=0).status == "ok"
    assert _run_monitor(flat[:19]).status == "ok"
    # a diverged run stays diverged
    d = DivergenceMonitor(patience=0, unigram_loss=3.3)
    for step, loss in enumerate(flat):
        d.update(step, loss, 1.0)
    d.check_finite(100, float("nan"), 1.0, "stop")
    d.finish(101)
    assert d.status == "diverged"
    # a resumed monitor judges the whole curve
    half = DivergenceMonitor(patience=0, unigram_loss=3.3)
    for step, loss in enumerate(flat[:50]):
        half.update(step, loss, 1.0)
    resumed = DivergenceMonitor(patience=0, unigram_loss=3.3)
    resumed.load_state_dict(half.state_dict())
    for step, loss in enumerate(flat[50:], start=50):
        resumed.update(step, loss, 1.0)
    resumed.finish(100)
    assert resumed.status == "stalled" and resumed.losses == flat


def test_unigram_entropy_by_hand():
    import numpy as np

    from normlab.data.dataset import unigram_entropy

    tokens = np.array([0, 1, 1, 2, 2, 2, 2, 5], dtype=np.uint16)
    p = [1 / 8, 2 / 8, 4 / 8, 1 / 8]
    expected = -sum(q * math.log(q) for q in p)
    assert unigram_entropy(tokens, 8) == pytest.approx(expected)
    assert unigram_entropy(tokens, 8, chunk=3) == pytest.approx(expected)  # counted across chunk edges
    assert unigram_entropy(np.zeros(10, dtype=np.uint16), 4) == 0.0


def test_a_run_that_only_learns_frequencies_is_stalled(tmp_path, capsys):
    """I.i.d. bytes have no context to learn: the best any model can do is the unigram loss, so the run
    ends there and is stalled, with the corpus's unigram entropy (computed here by hand) in its summary."""
    import random
    from collections import Counter

    rng = random.Random(0)
    text = "".join(rng.choices("abcdefgh", weights=[30, 20, 15, 10, 10, 8, 5, 2], k=20_000))
    corpus = tmp_path / "iid.txt"
    corpus.write_text(text)
    out = tmp_path / "run"
    from normlab.cli import main

    argv = [
        "train",
        "--data",
        str(corpus),
        "--size",
        "nano",
        "--layout",
        "pre",
        "--lr",
        "3e-2",
        "--steps",
        "80",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--out",
        str(out),
        "--no-progress",
        "--eval-every",
        "0",
        "--probe-every",
        "0",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0  # in this process: the verdict, not the process, is under test
    s = json.loads((out / "summary.json").read_text())
    train_text = text[: int(len(text) * 0.9)]  # the default split: the first 90% trains
    counts = Counter(train_text.encode())
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    assert s["unigram_loss"] == pytest.approx(entropy, abs=1e-3)
    assert s["status"] == "stalled", s
    assert abs(s["final_loss"] - entropy) < 0.05 * entropy
    printed = capsys.readouterr().out
    assert "stalled" in printed and "unigram loss" in printed


def test_spike_rules():
    d = SpikeDetector()
    vals = [1.0 + 0.01 * (i % 5) for i in range(40)]
    assert not any(d.update(v) for v in vals)
    assert d.update(1.5) and d.count == 1  # mean ~1.02, std ~0.014: 1.5 is > 6 std away
    m = DivergenceMonitor(patience=0)
    for step in range(128):
        m.update(step, 5.0, 1.0)
    flags = m.update(128, 60.0, 1.0)
    assert flags["megatron_spike"] and m.megatron_spikes == 1  # 60 > 10 x early max 5
    state = m.state_dict()
    m2 = DivergenceMonitor(patience=0)
    m2.load_state_dict(state)
    assert m2.state_dict() == state


def test_olmo_skip_rule_its_window_and_its_bound():
    """OLMo-core's SkipStepOptimizer rule by hand: |x - mean| > 6 sample std of the previous values, once
    max(20, window // 2) are known (this one included), either way; skipped spikes count with the non-finite
    skips against max_skipped; the window survives a checkpoint. The tier's per-layer rule fires on one layer."""
    import statistics

    from normlab.diagnostics.tier import TierSpikes
    from normlab.train.divergence import SkipRule

    m = DivergenceMonitor(patience=0, max_skipped=0.05, skip_rule=SkipRule(window=24, sigmas=6.0))
    losses = [2.0 + 0.01 * (i % 3) for i in range(19)]
    for step, loss in enumerate(losses):  # 19 values: below max(20, 12), never a spike
        assert m.check_spike(step, loss, 1.0, skip=True) is None
    window = losses  # all 19 (the window holds 24)
    mean, std = statistics.fmean(window), statistics.stdev(window)
    low = mean - 6.5 * std  # a drop counts too (|z|)
    got = m.check_spike(19, low, 1.0, skip=True)
    assert got["kinds"] == ["loss"] and got["z_loss"] == pytest.approx(6.5, rel=1e-9)
    assert m.spike_skipped_steps == [19] and m.status == "ok"  # 1 of 20 skipped: not more than 5%
    assert m.check_spike(20, 2.0, 50.0, skip=True)["kinds"] == ["grad_norm"]  # the gradient norm's own window
    assert m.status == "diverged" and "2 of 21 steps skipped for spikes (more than 5%)" in m.reason
    with pytest.raises(ConfigError, match="spike_window.*must be >= 20"):
        TrainConfig.of(spike_window=8)
    m2 = DivergenceMonitor(patience=0)
    m2.load_state_dict(m.state_dict())
    assert list(m2.skip_rule.losses) == list(m.skip_rule.losses) and m2.spike_skipped_steps == [19, 20]
    tier = TierSpikes(sigmas=6.0, window=16, min_history=4)
    rows = [{"grad_norm": [1.0 + 0.01 * (i % 2), 3.0]} for i in range(6)]
    assert not any(tier.check(r) for r in rows)
    h = [1.0 + 0.01 * (i % 2) for i in range(6)]
    assert tier.check({"grad_norm": [statistics.fmean(h) + 6.1 * statistics.pstdev(h), 3.0]}) == ["grad_norm[0]"]


def test_schedule_warmup_then_cosine():
    cfg = TrainConfig.of(steps=100, lr=1.0, warmup=0.1, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(99, cfg) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert lr_at(int(mid), cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))


def test_weight_decay_exclusions():
    import normlab

    model = normlab.build_model("peri", "nano", linear_bias=True)
    groups = param_groups(model, TrainConfig())
    decayed = {id(p) for p in groups[0]["params"]}
    assert id(model.blocks[0].attn.q_proj.weight) in decayed
    for p in (model.blocks[0].attn.q_proj.bias, model.blocks[0].attn_norms.output.weight, model.embed.weight):
        assert id(p) not in decayed
    all_decay = param_groups(model, TrainConfig.of(wd_exclude=""))
    assert len(all_decay[1]["params"]) == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains(corpus, tmp_path, precision):
    s = train(small(corpus, tmp_path / precision, precision=precision, steps=6))
    assert s["status"] == "ok" and s["final_loss"] < s["initial_loss"]
    if precision == "fp16":
        assert "loss_scale" in rows(tmp_path / precision)[0]


def test_sgd_and_zloss(corpus, tmp_path):
    s = train(small(corpus, tmp_path / "sgd", optimizer="sgd", lr=0.3, z_loss=1e-4, steps=6))
    assert s["status"] == "ok" and s["final_loss"] < s["initial_loss"]


def test_crash_is_recorded_as_failed(corpus, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(trainer_mod, "evaluate", broken)
    with pytest.raises(TrainingFailed, match="disk on fire"):
        train(small(corpus, tmp_path / "crash"))
    s = json.loads((tmp_path / "crash" / "summary.json").read_text())
    assert s["status"] == "failed" and "disk on fire" in s["reason"]


def test_never_overwrites_and_refuses_mismatched_resume(corpus, tmp_path):
    train(small(corpus, tmp_path / "r", steps=3))
    with pytest.raises(ConfigError, match=r"different settings \(lr: 0.003 -> 0.001\)"):
        train(small(corpus, tmp_path / "r", steps=3, lr=1e-3))
    with pytest.raises(ConfigError, match="already holds a run"):
        train(small(corpus, tmp_path / "r", steps=3, resume=False))
    # a preset whose definition changed under its name (as hybrid gained Zhuo's Megatron init) is refused
    cfg_path = tmp_path / "r" / "config.json"
    saved = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**saved, "layout": "attn=AB,mlp=AB,final"}))
    with pytest.raises(
        ConfigError,
        match=r"layout 'peri' = 'attn=AB,mlp=AB,final'; this normlab defines it as "
        r"'attn=AB,mlp=AB,emb,final'",
    ):
        train(small(corpus, tmp_path / "r", steps=3))


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(lr=-1.0), "lr must be > 0"),
        (dict(steps=0), "steps must be > 0, got 0"),
        (dict(warmup=1.5), "warmup must lie in [0, 1)"),
        (dict(precision="fp8"), "precision: 'fp8' is not valid; valid: auto, fp32, bf16, fp16"),
        (dict(batch_size=10, grad_accum=4), "divisible by grad_accum=4"),
        (dict(wd_exclude="norms,gains"), "unknown ['gains']"),
        (dict(model={"d_modle": 3}), "did you mean model.d_model"),
        (dict(lr=float("nan")), "lr: expected a finite number"),
        (dict(grad_clip=float("inf")), "grad_clip: expected a finite number"),
        (dict(beta1=1.5), "beta1 must lie in [0, 1)"),
        (dict(eps=-1.0), "eps must be > 0"),
        (dict(seed=2**70), "seed must lie in [0, 2^32)"),
        (dict(steps=True), "steps: expected an integer, got True"),
        (dict(compile="no"), "compile: expected true or false"),
        (dict(weight_decay="x"), "weight_decay: expected a number, got 'x'"),
        (dict(steps=8.0), "steps: expected an integer"),
        (dict(layout="perri"), "Did you mean peri"),
        (dict(layout="attn=A,[9:10]mlp=C", size="nano"), "does not fit 2 layers"),
    ],
)
def test_bad_config_values(kw, needle):
    with pytest.raises(ConfigError) as err:
        TrainConfig.of(**kw)
    assert needle in str(err.value)


def test_config_round_trips_through_command_line_and_toml(tmp_path):
    from normlab.cli import build_parser
    from normlab.config.overrides import train_config as train_config_from_args

    cfg = TrainConfig.of(
        layout="hybrid*",
        lr=1e-3,
        min_lr=None,
        steps=7,
        compile=True,
        resume=False,
        model={"n_layers": 3, "mlp": "relu"},
        diverge_final_loss=4.5,
    )
    args = build_parser().parse_args(["train", *cfg.to_args()])
    assert train_config_from_args(args) == cfg
    toml = tmp_path / "c.toml"
    toml.write_text('layout = "pre"\nlr = 0.002\nsteps = 50\n[model]\nn_layers = 4\n')
    args = build_parser().parse_args(["train", "--config", str(toml), "--steps", "9", "--model", "d_model=64"])
    got = train_config_from_args(args)
    assert (got.model.layout_label, got.optim.lr, got.optim.steps, got.model.options) == (
        "pre",
        0.002,
        9,
        {"n_layers": 4, "d_model": 64},
    )
    from normlab.layout import parse_layout

    assert got.model.layout == parse_layout("pre")
    toml.write_text('layuot = "pre"\n')
    with pytest.raises(ConfigError, match="did you mean layout"):
        TrainConfig.from_toml(toml)


def test_compiled_training_matches_eager(corpus, tmp_path):
    eager = train(small(corpus, tmp_path / "eager", steps=3, eval_every=0))
    comp = train(small(corpus, tmp_path / "compiled", steps=3, eval_every=0, compile=True))
    assert comp["status"] == "ok"
    for a, b in zip(losses(tmp_path / "eager"), losses(tmp_path / "compiled")):
        assert a == pytest.approx(b, abs=1e-4)
    assert comp["final_val_loss"] == pytest.approx(eager["final_val_loss"], abs=1e-4)


def test_final_checkpoint_without_optimizer_state_and_sweeps_keep_one(corpus, tmp_path):
    """keep_optimizer off: the last checkpoint holds the model only (the disk budget of a sweep), earlier
    ones keep the optimizer for resuming; a run killed after its final checkpoint still finishes."""
    from normlab.experiments.sweep import SweepConfig
    from normlab.runs.checkpoint import list_checkpoints, load_checkpoint
    from normlab.runs.files import RunDir

    cfg = small(corpus, tmp_path / "lean", steps=6, ckpt_every=3, keep_last=2, keep_optimizer=False)
    train(cfg)
    mid, last = list_checkpoints(cfg.run.out)
    assert "optimizer" in load_checkpoint(mid) and "optimizer" not in load_checkpoint(last)
    assert last.stat().st_size < 0.6 * mid.stat().st_size  # AdamW's two moments were two thirds of it
    RunDir(cfg.run.out).summary_file.unlink()  # killed between the final checkpoint and the summary
    assert train(cfg)["status"] == "ok"
    runs = SweepConfig(name="s", base={"size": "nano"}, grid={"seed": [0]}).expand()
    assert (runs[0].config.checkpointing.keep_last, runs[0].config.checkpointing.keep_optimizer) == (1, False)
    kept = SweepConfig(
        name="s", base={"size": "nano", "keep_optimizer": True}, grid={"seed": [0]}
    ).expand()  # keep_optimizer: not part of the id
    assert kept[0].config.checkpointing.keep_optimizer is True and kept[0].run_id == runs[0].run_id


def test_device_decides_precision_and_compile_where_left_to_it(corpus, tmp_path):
    """precision auto and compile none: bf16 and compiled on CUDA, fp32 and eager on the CPU (as before);
    what the run chose is in its summary and its config.json."""
    from normlab.runs.files import RunDir

    cfg = TrainConfig()
    assert (cfg.run.precision, cfg.run.compile) == ("auto", None)
    cuda = cfg.for_device("cuda")
    assert (cuda.run.precision, cuda.run.compile) == ("bf16", True)
    assert cfg.for_device("cuda", bf16=False).run.precision == "fp32"  # a GPU without bf16
    cpu = cfg.for_device("cpu")
    assert (cpu.run.precision, cpu.run.compile) == ("fp32", False)
    mine = TrainConfig.of(precision="fp16", compile=False).for_device("cuda")
    assert (mine.run.precision, mine.run.compile) == ("fp16", False)  # what the user said stands
    s = train(small(corpus, tmp_path / "auto", steps=3))
    assert (s["precision"], s["compiled"]) == ("fp32", False)
    assert RunDir(tmp_path / "auto").record()["config"]["run"]["precision"] == "fp32"


def test_learned_scales_are_not_weight_decayed():
    """ReZero's h, Admin's omega and NormFormer's head scales start away from 0 or must be free to: weight decay
    toward 0 would fight them, so they go with the norms' gains; the gate's projection is a weight and decays."""
    import normlab

    model = normlab.build_model("normformer,attn=gsAB,alpha=admin,h-channel", "nano")
    decayed = {id(p) for p in param_groups(model, TrainConfig())[0]["params"]}
    b = model.blocks[1]
    for p in (b.attn_h, b.mlp_h, b.attn_omega, b.mlp_omega, b.attn.head_scale, b.mlp.hidden_norm.weight):
        assert id(p) not in decayed
    assert id(b.attn.gate_proj.weight) in decayed


def test_convert_a_pre_run_to_peri_then_train_from_it(corpus, tmp_path, capsys, monkeypatch):
    """The seeds' migration: keep every weight, add output norms (gamma 1) and the embedding norm; the KL of the
    next-token distributions is reported (> 0: the function changed); training continues with --init-from.
    A gamma -> centered gain change is exact (KL 0)."""
    from normlab.cli import main
    from normlab.runs.checkpoint import list_checkpoints, load_checkpoint
    from normlab.runs.convert import convert

    train(small(corpus, tmp_path / "pre", steps=8, layout="pre"))
    conv = convert(tmp_path / "pre", "peri", tmp_path / "peri0")
    assert conv.new and all("the mean RMS of what it normalizes" in v for v in conv.new.values())  # only norms
    assert (
        {".".join(k.split(".")[2:4]) for k in conv.new if k.startswith("blocks.")}
        == {"attn_norms.output", "mlp_norms.output"}
        and "embed_norm.weight" in conv.new
        and not conv.dropped
    )
    assert conv.kl > 0 and math.isfinite(conv.kl) and 0 <= conv.top1_agreement <= 1 and conv.tokens > 0
    unit = convert(tmp_path / "pre", "peri", tmp_path / "unit", match_scale=False)
    assert all("gamma = 1" in v for v in unit.new.values()) and unit.kl > conv.kl  # matched scales change less
    old = load_checkpoint(list_checkpoints(tmp_path / "pre")[-1])["model"]
    new = load_checkpoint(conv.checkpoint)["model"]
    assert torch.equal(new["blocks.1.mlp.down_proj.weight"], old["blocks.1.mlp.down_proj.weight"])
    s = train(small(corpus, tmp_path / "peri", steps=4, layout="peri", init_from=str(tmp_path / "peri0")))
    assert s["status"] == "ok" and s["initial_loss"] < math.log(256) - 0.3  # from the trained weights, not ln 256
    exact = convert(tmp_path / "pre", "pre,gain=centered", tmp_path / "centered")
    assert exact.kl == pytest.approx(0.0, abs=1e-12) and exact.top1_agreement == 1.0 and not exact.new
    assert exact.rewritten and set(exact.rewritten.values()) == {"gamma -> centered: w = gamma - 1"}
    assert main(["convert", str(tmp_path / "pre"), "--layout", "peri", "--out", str(tmp_path / "cli")]) == 0
    assert "KL(old || new)" in capsys.readouterr().out
    # no --out: a printed default, as train's; the "continue with" line is a whole command that runs as printed
    import shlex

    monkeypatch.chdir(tmp_path)
    assert main(["convert", "pre", "--layout", "peri"]) == 0
    out = capsys.readouterr().out
    assert "normlab convert: no --out given: the converted weights go to runs/pre-peri" in out
    command = shlex.split(out.split("continue with: ")[1].splitlines()[0])
    assert command[:2] == ["normlab", "train"] and "..." not in command
    assert (
        command[command.index("--size") + 1] == "nano" and command[command.index("--out") + 1] == "runs/pre-peri-train"
    )
    assert main(command[1:]) == 0 and "runs/pre-peri-train: ok" in capsys.readouterr().out
    # --init-from without --size: the source's recorded size and layout, not a tiny model's missing keys
    assert (
        main(
            [
                "train",
                "--init-from",
                "runs/pre-peri",
                "--data",
                str(corpus),
                "--steps",
                "2",
                "--seq-len",
                "32",
                "--batch-size",
                "8",
                "--eval-every",
                "0",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--init-from runs/pre-peri: its recorded shape (size=nano, layout=attn=AB,mlp=AB,emb,final)" in out
    assert "normlab train: no --out given: the run goes to runs/attn_AB_mlp_AB_emb_final-nano" in out


def test_convert_into_and_out_of_hyper_connections_and_refuse_ngpt(corpus, tmp_path, capsys):
    """A Pre-LN run moved to n streams carries n equal copies (HC at its static maps: A_m = e_k, A_r = I, B = 1)
    whose sum the final RMSNorm reads as it read the one stream: KL ~ 0 (the norm's eps aside); mHC's 0.01-gated
    maps move it little. Each connection parameter's start is stated; back to one stream they are dropped, and a
    changed stream count lists the reshaped ones as dropped. nGPT is refused in one line, nothing written."""
    from normlab.cli import main
    from normlab.errors import ConfigError as UserConfigError
    from normlab.runs.convert import convert

    train(small(corpus, tmp_path / "pre", steps=3, layout="pre", eval_every=0, probe_every=0))
    hc = convert(tmp_path / "pre", "pre-hc", tmp_path / "hc")
    assert hc.kl < 1e-6 and hc.top1_agreement == 1.0 and not hc.dropped
    assert hc.new["blocks.1.attn_hc.static_pre"].startswith("hyper-connection A_m0 = e_(k mod n)")
    assert hc.new["blocks.0.mlp_hc.scale_b"] == "hyper-connection scale s_beta = 0.01"
    mhc = convert(tmp_path / "pre", "pre-mhc", tmp_path / "mhc")
    assert mhc.kl < 1e-6 and mhc.new["blocks.0.attn_hc.gates"] == "mHC gating factors alpha = 0.01"
    train(small(corpus, tmp_path / "prehc", steps=3, layout="pre-hc", eval_every=0, probe_every=0))
    back = convert(tmp_path / "prehc", "pre", tmp_path / "back")
    assert not back.new and "blocks.0.attn_hc.static_res" in back.dropped and math.isfinite(back.kl)
    two = convert(tmp_path / "prehc", "pre,streams=2", tmp_path / "two")
    assert "blocks.0.attn_hc.static_res" in two.dropped and "blocks.0.attn_hc.static_res" in two.new
    for source, target in (("pre", "ngpt"), ("prehc", "ngpt")):
        with pytest.raises(UserConfigError, match="nGPT .* keeps every weight row on the unit sphere"):
            convert(tmp_path / source, target, tmp_path / f"{source}-ngpt")
        assert not (tmp_path / f"{source}-ngpt").exists()
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "pre"), "--layout", "ngpt", "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train it from the start" in err and not (tmp_path / "cli").exists()


def test_convert_layernorm_pre_ln_to_rmsnorm_exactly(corpus, tmp_path):
    """Jiang et al. 2023: a Pre-LN LayerNorm run becomes Pre-LN with RMSNorm input norms with the same function
    once the stream is re-centred and each beta moves into the next projections' biases (KL ~ 0, top-1 100%);
    without biases to take beta it is refused with the reason."""
    from normlab.errors import ConfigError as UserConfigError
    from normlab.runs.convert import convert

    train(small(corpus, tmp_path / "ln", steps=6, layout="pre,norm=layer", **{"model.linear_bias": True}))
    conv = convert(tmp_path / "ln", "pre,norm=layer,norm.A=rms", tmp_path / "rms")
    assert conv.kl < 1e-9 and conv.top1_agreement == 1.0 and not conv.new
    assert "blocks.0.attn.q_proj.bias" in conv.rewritten and "blocks.1.mlp_norms.input.bias" in conv.dropped
    unit = convert(tmp_path / "ln", "pre", tmp_path / "plain")  # the same kinds swapped without the rewrite
    assert unit.kl > 1e3 * max(conv.kl, 1e-12)  # swapping the kinds without the rewrite changes the function
    train(small(corpus, tmp_path / "nobias", steps=2, layout="pre,norm=layer"))
    with pytest.raises(UserConfigError, match="no exact LayerNorm -> RMSNorm rewrite.*biases"):
        convert(tmp_path / "nobias", "pre,norm=layer,norm.A=rms", tmp_path / "refused")


def test_an_expensive_save_stretches_the_default_checkpoint_interval(corpus, tmp_path, monkeypatch, capsys):
    """ckpt_every 0 on 40 steps: every 10 steps while saves are quick; a save of a second (planted on the
    schedule's clock, which ticks a millisecond a reading otherwise: steps of milliseconds, whatever this
    machine's speed) stretches the interval to its cap, half the run: the next checkpoints are at 30 and the end
    (a set ckpt_every never stretches: tests/unit/test_optim.py)."""
    from normlab.train import ckpt_schedule

    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]

    real = trainer_mod._save

    def slow(state):
        real(state)
        now[0] += 1.0

    monkeypatch.setattr(ckpt_schedule, "_clock", clock)
    monkeypatch.setattr(trainer_mod, "_save", slow)
    quick = small(corpus, tmp_path / "auto", steps=40, eval_every=0, probe_every=0, keep_last=10)
    assert train(quick)["status"] == "ok"
    names = [p.name for p in list_checkpoints(quick.run.out)]
    assert names == ["step_00000010.pt", "step_00000030.pt", "step_00000040.pt"]
    err = capsys.readouterr().err
    assert "checkpoints: a save took 1.0 s; every 20 steps from step 10 on" in err, err
