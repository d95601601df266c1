"""Mixed precision: norms on the fused path under autocast, and fp16 training through loss-scaler overflows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab.model import build_model
from normlab.model.norms import make_norm
from normlab.train import train
from normlab.train.divergence import DivergenceMonitor
from tests.helpers import PATIENCE_S, rows, small

REPO = Path(__file__).resolve().parents[2]


def rms_formula(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return gamma.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ln_formula(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return gamma.double() * (x - mu) / torch.sqrt(var + eps) + beta.double()


@pytest.mark.parametrize("compute", ["input", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_under_autocast_match_their_formula_in_the_input_dtype(compute, dtype):
    torch.manual_seed(0)
    rms, ln = make_norm("rms", 64, 1e-6, compute=compute), make_norm("layer", 64, 1e-5, compute=compute)
    with torch.no_grad():
        for p in (*rms.parameters(), *ln.parameters()):
            p.uniform_(0.5, 1.5)
    x32 = torch.randn(8, 64) * 3
    x = x32.to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        y_rms, y_ln = rms(x), ln(x)
    assert y_rms.dtype == dtype and y_ln.dtype == dtype  # no float32 copy of the stream comes out
    # bf16 keeps 8 bits of mantissa: the output is the formula rounded once or twice (rel ~ 2^-8)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y_rms.double(), rms_formula(x, rms.weight, 1e-6), **tol)
    torch.testing.assert_close(y_ln.double(), ln_formula(x, ln.weight, ln.bias, 1e-5), **tol)


@pytest.mark.parametrize("compute", ["input", "fp32"])
def test_norms_in_float32_are_torchs_modules_exactly(compute):
    torch.manual_seed(0)
    ours, theirs = make_norm("rms", 16, 1e-6, compute=compute), torch.nn.RMSNorm(16, eps=1e-6)
    ln, ln_ref = make_norm("layer", 16, 1e-5, compute=compute), torch.nn.LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        for a, b in ((ours, theirs), (ln, ln_ref)):
            for p, q in zip(a.parameters(), b.parameters()):
                p.uniform_(0.5, 1.5)
                q.copy_(p)
    x = torch.randn(4, 16)
    assert torch.equal(ours(x), theirs(x)) and torch.equal(ln(x), ln_ref(x))
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]


def test_gradients_reach_the_float32_gammas_under_autocast():
    norm = make_norm("rms", 8, 1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    assert norm.weight.dtype == torch.float32 and norm.weight.grad is not None
    assert norm.weight.grad.dtype == torch.float32 and norm.weight.grad.abs().sum() > 0


WARNING_CHECK = r"""
import sys, warnings, torch
warnings.simplefilter("error")   # any warning fails the process (the dtype warning is a one-time C++ warning)
from normlab.model import build_model
from normlab.model.norms import make_norm
control = sys.argv[1] == "control"
for layout in ["peri", "hybrid*", "peri+qk", "olmo2", "qkvc-pre", "post", "peri-frozen", "pre,norm=layer"]:
    for dtype in (torch.bfloat16, torch.float16):
        m = build_model(layout, "nano", seed=0)
        if control:  # torch's own module, as normlab used it: the warning must show
            m.blocks[0].attn_norms.output = torch.nn.RMSNorm(32)  # gets o_proj's bf16 output
        x = torch.randint(0, 256, (2, 16))
        with torch.autocast("cpu", dtype=dtype):
            loss = m(x, targets=x).loss
        loss.backward()
print("clean")
"""


def _run_check(arg: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WARNING_CHECK, arg],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_no_dtype_mismatch_warning_at_any_norm_site_under_autocast():
    """Every norm site (input/output/after-add, QK/V/context, embedding and final; RMS and Layer)
    under bf16 and fp16 autocast, forward and backward, in a fresh process: not one warning."""
    res = _run_check("normlab")
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr[-2000:]
    control = _run_check("control")  # the check can fail: torch's RMSNorm with a float32 weight warns
    assert control.returncode != 0 and "Mismatch dtype between input and weight" in control.stderr


def test_model_loss_under_bf16_autocast_is_close_to_float32():
    m = build_model("peri", "nano", seed=0)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = m(x, targets=x).loss.item()
    for compute in ("input", "fp32"):
        mc = build_model("peri", "nano", seed=0, norm_compute=compute)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = mc(x, targets=x).loss.item()
        assert got == pytest.approx(ref, rel=1e-2)


# --- fp16: overflows while the loss scaler calibrates are skipped steps, not divergence -----------


def test_fp16_trains_through_scaler_overflows(corpus, tmp_path):
    """A scale of 2^24 overflows the fp16 gradients at first: the scaler halves it on each overflow
    until they fit. Those steps are skipped (counted), the run is ok and learns; before, the first
    overflow was recorded as divergence at step 0."""
    run = tmp_path / "fp16"
    s = train(small(corpus, run, precision="fp16", loss_scale_init=2.0**24, steps=24, eval_every=12))
    r = rows(run)
    over = [x["step"] for x in r if x.get("overflow")]
    assert s["status"] == "ok" and over and s["overflow_steps"] == over and s["skipped_steps"] == []
    assert all(math.isfinite(x["loss"]) for x in r)
    # each overflow halves the scale; the scale logged is the one after the step's update
    scales = [x["loss_scale"] for x in r]
    for prev, x in zip([2.0**24] + scales, r):
        assert x["loss_scale"] == (prev / 2 if x.get("overflow") else prev)
    assert s["final_loss"] < s["initial_loss"] - 0.5


def test_overflowed_step_leaves_the_weights_untouched(corpus, tmp_path):
    from normlab.runs.start import Start
    from normlab.train import distributed
    from normlab.train.trainer import build_state, open_records, train_step

    cfg = small(corpus, tmp_path / "w", precision="fp16", loss_scale_init=2.0**40, probe_every=0)
    state = build_state(cfg, distributed.setup("cpu"), Start())
    open_records(state)  # the run's hooks: the divergence hook decides whether the step's update is applied
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    row = train_step(state)
    state.close()
    assert row.get("overflow") and row["loss_scale"] == 2.0**39 and math.isfinite(row["loss"])
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert not state.opt.state  # AdamW never stepped: no moments were made


def test_fp16_diverges_when_overflows_persist_or_the_scale_collapses(corpus, tmp_path):
    s = train(small(corpus, tmp_path / "streak", precision="fp16", loss_scale_init=2.0**60, max_overflow_streak=5))
    assert s["status"] == "diverged" and s["diverged_step"] == 5 and "6 consecutive steps" in s["reason"]
    s = train(small(corpus, tmp_path / "floor", precision="fp16", loss_scale_init=2.0**24, min_loss_scale=2.0**23))
    assert (
        s["status"] == "diverged"
        and s["diverged_step"] == 1
        and "collapsed to 4.1943e+06, below min_loss_scale=8.38861e+06" in s["reason"]
    )


def test_fp16_non_finite_loss_is_still_divergence():
    m = DivergenceMonitor()
    assert not m.check_finite(3, 2.0, math.inf, "stop", scaled=True)  # overflow: skipped, not diverged
    assert m.status == "ok" and m.overflow_steps == [3] and m.overflow_streak == 1
    assert m.check_finite(4, 2.0, 1.0, "stop", scaled=True) and m.overflow_streak == 0
    assert not m.check_finite(5, math.inf, math.inf, "stop", scaled=True)  # the forward overflowed
    assert m.status == "diverged" and "non-finite loss" in m.reason
    # bf16/fp32 (no scaler) keep the old rule: non-finite gradients are divergence
    m = DivergenceMonitor()
    assert not m.check_finite(0, 2.0, math.inf, "stop") and m.diverged and m.overflow_steps == []


def test_overflow_counters_survive_resume():
    m = DivergenceMonitor()
    m.check_finite(0, 2.0, math.nan, "stop", scaled=True)
    m2 = DivergenceMonitor()
    m2.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert m2.overflow_steps == [0] and m2.overflow_streak == 1
    old = m.state_dict()
    del old["overflow_steps"], old["overflow_streak"]  # a checkpoint written before these counters
    DivergenceMonitor().load_state_dict(old)


def test_a_hooks_refusal_of_a_finite_fp16_step_is_a_skip_not_an_overflow(corpus, tmp_path):
    """Under fp16's scaler a refused step with a finite loss is an overflow only where its gradient norm is not
    finite; a user's hook refusing a finite step (StepHook.admit) skips it, and the monitor counts no overflow."""
    from normlab.diagnostics.hooks import StepHook

    class Refuse(StepHook):
        def admit(self, step, loss, grad_norm, scaled):
            return step != 1

    cfg = small(corpus, tmp_path / "r", precision="fp16", steps=3, probe_every=0)
    s = train(cfg, log=lambda *a: None, hooks=[Refuse()])
    r = rows(tmp_path / "r")
    assert math.isfinite(r[1]["loss"]) and math.isfinite(r[1]["grad_norm"])
    assert r[1].get("skipped") and not r[1].get("overflow") and s["overflow_steps"] == []
