"""fp16 as the papers trained it: activations stored in fp16 (normlab.model.storage), and where a
diverged run first broke (normlab.diagnostics.forensics)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import normlab
from normlab.config.train import TrainConfig
from normlab.diagnostics.forensics import describe, first_break, gradient_break, site_of, tally
from normlab.model.storage import NO_STORAGE, Storage, for_run
from normlab.train import train
from tests.helpers import planted_overflow as _planted

FP16 = Storage(torch.float16)


def test_storage_rounds_to_fp16_exactly_and_overflows_past_65504():
    x = torch.tensor([1.0 + 2**-12, 65504.0, 65519.0, 65520.0, -70000.0, 1e-8, 3.0], dtype=torch.float32)
    y = FP16(x)
    assert y.dtype == torch.float32  # emulated: fp16's values, carried in the input's dtype
    assert torch.equal(y, x.half().float())
    assert y[0] == 1.0  # below fp16's resolution at 1 (2^-10): rounded away
    assert y[1] == 65504.0 and y[2] == 65504.0  # 65519 rounds down to the largest finite fp16
    assert y[3] == float("inf") and y[4] == float("-inf")  # 65520 and beyond: inf, as on the hardware
    assert y[5] == 0.0  # below fp16's smallest subnormal (6e-8): flushed
    assert torch.equal(FP16(y), y)  # idempotent
    assert NO_STORAGE(x) is x


def test_storage_rounds_the_backward_too():
    """The round trip's backward rounds the activation gradient to fp16, as fp16 training stores it."""
    x = torch.ones(3, requires_grad=True)
    (FP16(x) * torch.tensor([1e-8, 1e5, 0.5])).sum().backward()
    assert x.grad.tolist() == [0.0, float("inf"), 0.5]


def test_for_run_picks_exact_only_where_autocast_computes_in_the_storage_dtype():
    assert for_run("fp32", "fp32") is NO_STORAGE
    assert for_run("fp16", "fp16") == Storage(torch.float16, exact=True)
    assert for_run("fp32", "fp16") == Storage(torch.float16, exact=False)
    assert for_run("bf16", "bf16") == Storage(torch.bfloat16, exact=True)
    cfg = TrainConfig.of(precision="fp16")
    assert cfg.stored_dtype == "fp16" and cfg.loss_scaled  # auto: the papers' fp16 stores in fp16
    assert TrainConfig.of(precision="fp16", activation_dtype="fp32").stored_dtype == "fp32"  # autocast's fp32 stream
    assert TrainConfig.of(activation_dtype="fp16").loss_scaled  # fp16 storage alone needs loss scaling
    assert not TrainConfig.of(precision="bf16").loss_scaled
    with pytest.raises(Exception, match="activation_dtype"):
        TrainConfig.of(activation_dtype="fp8")


def test_a_stream_value_past_65504_is_inf_under_fp16_storage_and_harmless_in_fp32():
    tokens = torch.randint(0, 256, (2, 8))
    model = _planted()
    out = model(tokens, targets=tokens, return_hidden_states=True)
    assert torch.isfinite(out.loss)  # float32 stream: 8e4 is an ordinary number
    assert out.hidden_states[1].abs().max() == 8e4
    model.set_storage(FP16)
    out = model(tokens, targets=tokens, return_hidden_states=True)
    assert out.hidden_states[0].abs().max() == 4e4  # the embedding's 4e4 is representable
    assert torch.isinf(out.hidden_states[1]).all()  # block 0's output: 4e4 + 4e4 overflowed
    assert torch.isnan(out.loss)  # the final norm: inf / inf


def test_fp16_storage_matches_the_hand_rounded_pre_ln_block():
    """Pre-LN, attention off: x1 = r(x + r(r(F(r(N(x)))))) with r the fp16 rounding, computed by hand."""
    torch.manual_seed(1)
    model = normlab.build_model("pre", size="nano")
    x = torch.randn(2, 5, 32) * 300
    block = model.blocks[0]
    with torch.no_grad():
        block.attn.o_proj.weight.zero_()
    r = lambda t: t.half().float()
    n, mlp = block.mlp_norms.input, block.mlp
    hidden = r(mlp.act(mlp.gate_proj(r(n(r(x))))) * mlp.up_proj(r(n(r(x)))))
    expected = r(r(x) + r(mlp.down_proj(hidden)))
    model.set_storage(FP16)
    torch.testing.assert_close(block(r(x)), expected, rtol=0, atol=0)


def test_exact_mode_under_autocast_keeps_the_stream_in_fp16():
    """CPU autocast fp16 with fp16 storage: the stream *is* fp16 (the residual add runs in fp16)."""
    model = _planted()
    model.set_storage(Storage(torch.float16, exact=True))
    tokens = torch.randint(0, 256, (2, 8))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(tokens, targets=tokens, return_hidden_states=True)
    assert out.hidden_states[0].dtype == torch.float16 and out.hidden_states[1].dtype == torch.float16
    assert torch.isinf(out.hidden_states[1]).all() and torch.isnan(out.loss)
    # outside autocast the exact storage rounds instead (a probe pass): same values, float32 tensors
    out = model(tokens, targets=tokens, return_hidden_states=True)
    assert out.hidden_states[1].dtype == torch.float32 and torch.isinf(out.hidden_states[1]).all()


def test_exact_and_emulated_fp16_agree_on_a_trained_model():
    torch.manual_seed(0)
    model = normlab.build_model("peri", size="nano")
    tokens = torch.randint(0, 256, (2, 16))
    model.set_storage(Storage(torch.float16))
    emulated = model(tokens, targets=tokens).loss
    model.set_storage(Storage(torch.float16, exact=True))
    with torch.autocast("cpu", dtype=torch.float16):
        exact = model(tokens, targets=tokens).loss
    assert abs(float(emulated.detach()) - float(exact.detach())) < 2e-3


def test_forensics_names_the_residual_add_that_overflowed():
    model = _planted()
    model.set_storage(FP16)
    tokens = torch.randint(0, 256, (2, 8))
    found = first_break(model, [(tokens, tokens)])
    fwd = found["forward"]
    assert fwd["module"] == "blocks.0.mlp_norms.after_add (input)" and fwd["site"] == "MLP residual add"
    assert fwd["layer"] == 0 and fwd["kind"] == "overflow" and fwd["nonfinite"] == fwd["of"] == 2 * 8 * 32
    assert fwd["before"] == 4e4  # the stream and the update, each 4e4, both representable
    assert site_of(found) == "block 0: MLP residual add"
    assert "past 6.55e+04 (fp16)" in describe(found) and "4e+04" in describe(found)
    assert found["dtype"] == "fp16" and found["limit"] == 65504.0


def test_forensics_in_fp32_reports_the_largest_activation():
    model = _planted()
    tokens = torch.randint(0, 256, (2, 8))
    found = first_break(model, [(tokens, tokens)])
    assert found["forward"] is None
    # 4e4 (embedding) + 4e4 (block 0's MLP) + 4e4 (block 1's MLP): 1.2e5, harmless in float32
    assert found["largest"] == {
        "value": 1.2e5,
        "module": "blocks.1.mlp_norms.after_add",
        "layer": 1,
        "site": "MLP residual add",
    }
    assert describe(found) == "forward finite (largest |x| 1.2e+05 at block 1 MLP residual add)"


def test_forensics_finds_an_overflow_inside_the_mlp_before_peri_lns_output_norm():
    """Peri-LN normalizes what enters the stream, not what the MLP computes: a hidden past 65504 breaks it."""
    torch.manual_seed(0)
    model = normlab.build_model("peri", size="nano")
    with torch.no_grad():
        model.blocks[1].mlp.up_proj.weight.mul_(3e4)
        model.blocks[1].mlp.gate_proj.weight.mul_(3e4)
    model.set_storage(FP16)
    tokens = torch.randint(0, 256, (2, 8))
    found = first_break(model, [(tokens, tokens)])
    assert site_of(found) == "block 1: MLP hidden"


def test_gradient_break_lists_parameters_deepest_first():
    model = normlab.build_model("pre", size="nano")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.blocks[0].mlp.up_proj.weight.grad[0, 0] = float("nan")
    model.blocks[1].attn.q_proj.weight.grad[0, 0] = float("inf")
    assert gradient_break(model) == ["blocks.1.attn.q_proj.weight", "blocks.0.mlp.up_proj.weight"]


def test_tally_groups_breaks_by_site():
    sites = ["block 11: MLP residual add", "block 9: MLP residual add", None, "logits", "block 3: MLP hidden"]
    assert tally(sites) == "MLP residual add x2 (blocks 9, 11); logits x1; MLP hidden x1 (block 3)"
    # a sweep's table holds NaN where a diverged run has no forward break (its fp16 loss scale collapsed)
    assert tally([float("nan"), "block 4: MLP input norm (A)", float("nan")]) == "MLP input norm (A) x1 (block 4)"


def _run(corpus, out, **kw):
    base = dict(
        data=str(corpus),
        size="nano",
        layout="pre",
        seq_len=32,
        batch_size=8,
        steps=6,
        lr=3e-3,
        eval_every=0,
        eval_batches=1,
        probe_every=3,
        out=str(out),
        progress=False,
        device="cpu",
    )
    return TrainConfig.of(**{**base, **kw})


def test_a_run_whose_stream_passes_65504_diverges_in_fp16_and_trains_in_fp32(corpus, tmp_path):
    """Init std 300: the embedding alone is in the thousands, Pre-LN's stream passes 65504 by the last
    blocks. fp16 storage: diverged at step 0 with the site; fp32: the same run trains."""
    big = {"model.init_std": 3000.0, "model.init": "normal"}
    s16 = train(_run(corpus, tmp_path / "fp16", activation_dtype="fp16", **big))
    assert s16["status"] == "diverged" and s16["diverged_step"] == 0
    assert s16["activation_dtype"] == "fp16" and "non-finite loss" in s16["reason"]
    assert s16["first_break"] is not None and s16["forensics"]["forward"]["kind"] == "overflow"
    assert s16["forensics"]["step"] == 0 and s16["max_activation"] > 1000
    s32 = train(_run(corpus, tmp_path / "fp32", **big))
    assert s32["status"] != "diverged" and s32["forensics"] is None and s32["first_break"] is None
    assert s32["max_activation"] > 65504  # the same activations, harmless in float32
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "normlab",
            "train",
            "--data",
            str(corpus),
            "--size",
            "nano",
            "--seq-len",
            "32",
            "--batch-size",
            "8",
            "--steps",
            "4",
            "--probe-every",
            "0",
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
            "--no-progress",
            "--device",
            "cpu",
            "--activation-dtype",
            "fp16",
            "--set",
            "model.init_std=3000",
            "--set",
            "model.init=normal",
            "--layout",
            "pre",
            "--out",
            str(tmp_path / "cli"),
        ],
        capture_output=True,
        text=True,
    )
    last = cli.stdout.strip().splitlines()[-1]
    assert cli.returncode == 0 and "diverged at step 0" in last and "first broke at block" in last, cli.stderr


def test_the_report_opens_with_a_reading_of_the_runs(corpus, tmp_path):
    from normlab.diagnostics.run_report import make_report

    big = {"model.init_std": 3000.0, "model.init": "normal"}
    train(_run(corpus, tmp_path / "pre", activation_dtype="fp16", **big))
    train(_run(corpus, tmp_path / "peri", layout="peri", activation_dtype="fp16"))
    index = make_report([tmp_path / "pre", tmp_path / "peri"], tmp_path / "report")
    page = index.read_text()
    reading = page[page.index('id="reading"') : page.index('id="summary"')]
    assert "pre diverged at step 0 (fp16 activations): first broke at block" in reading
    assert "Trained to the end: peri." in reading
    assert "(then overflowed)" in reading and "x below 65504" in reading
    assert "Hidden-state variance" not in reading  # pre's stream was never finite: no step to compare at
    from normlab.diagnostics.probe_store import load_run
    from normlab.diagnostics.run_report import reading_lines

    train(_run(corpus, tmp_path / "pre32", probe_every=3))
    runs = [load_run(tmp_path / "peri"), load_run(tmp_path / "pre32")]
    var = [line for line in reading_lines(runs, ["peri", "pre"]) if line.startswith("Hidden-state variance")]
    last = {name: float(runs[i].probe("stream", "var").loc[6].iloc[-1]) for i, name in enumerate(["peri", "pre"])}
    assert var == [
        "Hidden-state variance at the last layer, step 6 (the last probe where every run was finite): "
        + "; ".join(f"{n} {v:,.4g}" for n, v in sorted(last.items(), key=lambda p: -p[1]))
        + "."
    ]


def test_summaries_count_first_breaks_and_old_stores_gain_the_columns(corpus, tmp_path):
    import sqlite3

    from normlab.experiments.summary import summarize
    from normlab.runs.store import SweepStore

    db = tmp_path / "old" / "sweep.db"
    db.parent.mkdir()
    with sqlite3.connect(db) as con:  # a store written before the forensics columns existed
        con.execute(
            "create table runs (run_id text primary key, idx integer not null, axes text not null, "
            "config text not null, status text not null default 'pending', step integer, reason text, "
            "initial_loss real, final_loss real, final_val_loss real, diverged_step integer, "
            "loss_spikes integer, grad_spikes integer, megatron_spikes integer, wall_time_s real, "
            "tokens integer, attempts integer not null default 0, worker text, started_at real, finished_at real)"
        )
    SweepStore(db)
    with sqlite3.connect(db) as con:
        cols = {row[1] for row in con.execute("pragma table_info(runs)")}
    assert {"max_activation", "first_break"} <= cols

    from normlab.experiments.runner import run_sweep
    from normlab.experiments.sweep import SweepConfig

    sweep = SweepConfig(
        name="t",
        base={
            "data": str(corpus),
            "size": "nano",
            "seq_len": 32,
            "batch_size": 8,
            "steps": 4,
            "eval_every": 0,
            "eval_batches": 1,
            "probe_every": 2,
            "activation_dtype": "fp16",
            "model.init": "normal",
            "device": "cpu",
        },
        grid={"layout": ["pre"], "model.init_std": [3000.0, 0.02]},
    )
    run_sweep(sweep, tmp_path / "sw", workers=1, log=lambda *a: None)
    out = summarize(tmp_path / "sw")
    md = Path(out["markdown"]).read_text()
    assert "max |x|" in md and "first overflow (diverged runs)" in md
    assert (tmp_path / "sw" / "top100_fp16.png").stat().st_size > 0  # Kim Fig. 11 per cell, every seed
    assert "top100_fp16" in (tmp_path / "sw" / "report.html").read_text()
    pre_big = out["cells"][(out["cells"].layout == "pre") & (out["cells"]["model.init_std"] == 3000.0)].iloc[0]
    assert pre_big.divergences == "1/1" and pre_big.first_breaks.endswith(")") and " x1 (block " in pre_big.first_breaks
    assert pre_big.max_activation > 1000
    pre_small = out["cells"][(out["cells"].layout == "pre") & (out["cells"]["model.init_std"] == 0.02)].iloc[0]
    assert pre_small.divergences == "0/1" and pre_small.first_breaks == "" and pre_small.max_activation < 100


def test_forensics_names_the_micro_batch_that_broke_first():
    """Only token 255's embedding is past 65504: the first micro-batch holding it breaks, at the embedding."""
    torch.manual_seed(0)
    model = normlab.build_model("pre", size="nano")
    with torch.no_grad():
        model.embed.weight[255].fill_(7e4)
    model.set_storage(FP16)
    clean = torch.randint(0, 255, (2, 8))
    hot = clean.clone()
    hot[1, 3] = 255
    found = first_break(model, [(clean, clean), (hot, hot), (hot, hot)])
    assert found["micro_batch"] == 1 and site_of(found) == "embedding"
    assert found["forward"]["nonfinite"] == 32  # one token's 32 coordinates
    assert first_break(model, [(clean, clean)])["forward"] is None
