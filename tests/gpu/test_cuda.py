"""On a CUDA machine: the same behaviour on the GPU (skipped cleanly on CPU-only machines).

These run where the suite runs on a GPU (the device tool's H100); the CPU tests cover the same
behaviour on every machine. Each comparison is made able to fail: tolerances are relative to outputs
of order one, gradients are compared too, and a control (an all-zero output, a perturbed model)
is shown to fail the same check. `NORMLAB_GPU_TESTS_ON=cpu pytest tests/gpu` runs the tests that do
not need CUDA's own kernels on the CPU, a dry run of their logic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab.model import build_model
from normlab.train import train
from tests.helpers import rows, small

DEV = os.environ.get("NORMLAB_GPU_TESTS_ON", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own kernels or dtypes")
REPO = Path(__file__).resolve().parents[2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: meaningful whatever the scale of b (an absolute tolerance passes zeros)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


CHECK = r"""
import warnings, torch
warnings.simplefilter("error")
from normlab.model import build_model
for layout in ["peri", "hybrid*", "peri+qk", "olmo2", "post"]:
    for dtype in (torch.bfloat16, torch.float16):
        m = build_model(layout, "nano", seed=0).cuda()
        x = torch.randint(0, 256, (2, 16), device="cuda")
        with torch.autocast("cuda", dtype=dtype):
            loss = m(x, targets=x).loss
        loss.backward()
print("clean")
"""


@cuda_only
def test_no_dtype_mismatch_warning_on_cuda():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}  # the machine's own CUDA and library paths kept
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr[-2000:]


@cuda_only
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_trains_on_cuda_with_mfu(corpus, tmp_path, precision):
    s = train(small(corpus, tmp_path / precision, device="cuda", precision=precision, steps=12, probe_every=6))
    assert s["status"] == "ok" and s["device"].startswith("cuda") and s["final_loss"] < s["initial_loss"]
    name = torch.cuda.get_device_name()
    if any(k in name for k in ("H100", "H200", "A100")) and "NVL" not in name:
        assert isinstance(s["mfu"], float) and 0 < s["mfu"] < 1 and "mfu" in rows(tmp_path / precision)[-1]


@cuda_only
def test_fp16_overflows_are_skipped_on_cuda(corpus, tmp_path):
    s = train(small(corpus, tmp_path / "o", device="cuda", precision="fp16", loss_scale_init=2.0**24, steps=24))
    assert s["status"] == "ok" and s["overflow_steps"]


def test_chunked_loss_and_checkpointing_on_cuda():
    """Loss and every gradient of the lean forward (activation checkpointing, chunked loss) against the
    plain one; a control with one weight perturbed fails the same check."""

    def grads(m, lean):
        m.zero_grad()
        m.activation_checkpointing = lean
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = m(x, targets=x, loss_chunk=32 if lean else 0).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])

    m = build_model("peri", "nano", seed=0).to(DEV).train()
    x = torch.randint(0, 256, (4, 64), device=DEV)
    (whole, g_whole), (lean, g_lean) = grads(m, False), grads(m, True)
    assert abs(float(lean) - float(whole)) < 1e-3 * float(whole) and rel_err(g_lean, g_whole) < 2e-2
    with torch.no_grad():
        m.blocks[0].mlp.down_proj.weight.mul_(3.0)  # the control: another model
    assert rel_err(grads(m, True)[1], g_whole) > 0.1


@cuda_only
def test_grouped_and_looped_moe_dispatch_agree_on_cuda():
    """The grouped expert product (one bf16 kernel on sm_90/sm_100) against the looped one, both under the
    same bf16 autocast so that both route every token to the same experts: outputs of order one and the
    experts' gradients through the grouped product's backward. (Against a float32 loop the router's logits
    differ, a near-tie token changes experts, and the outputs differed by 0.055 on an H200, 2026-11-26.)"""
    from normlab.model.config import ModelConfig
    from normlab.model.moe import MoE, _grouped_dtype

    cfg = ModelConfig(d_model=64, n_layers=1, n_heads=2, n_experts=8, moe_top_k=2, expert_d_ff=128)
    torch.manual_seed(0)
    a = MoE(cfg.with_(moe_dispatch="sorted")).cuda()
    b = MoE(cfg.with_(moe_dispatch="loop")).cuda()
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.3)  # outputs of order one, not 1e-3: a relative check means something
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(a.route(x.flatten(0, 1))[3], b.route(x.flatten(0, 1))[3])  # the same experts
        ya, yb = a(x), b(x)
        assert _grouped_dtype(x.bfloat16()) is not None or torch.cuda.get_device_capability()[0] not in (9, 10)
    assert ya.float().abs().max() > 0.1 and rel_err(ya, yb) < 2e-2
    assert rel_err(torch.zeros_like(yb), yb) == pytest.approx(1.0)  # the control an absolute tolerance missed
    (ya.float().square().mean() + a.aux).backward()
    (yb.float().square().mean() + b.aux).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert rel_err(pa.grad, pb.grad) < 5e-2, name


def test_compiled_step_follows_eager():
    """torch.compile of the whole model: loss and gradients as eager (the GPU's default is compiled)."""
    torch.manual_seed(0)
    m = build_model("peri", "nano", seed=0).to(DEV)
    x = torch.randint(0, 256, (2, 32), device=DEV)

    def step(f):
        m.zero_grad()
        loss = f(x, targets=x).loss
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in m.parameters()])

    eager, compiled = step(m), step(torch.compile(m))
    assert abs(compiled[0] - eager[0]) < 1e-4 * eager[0] and rel_err(compiled[1], eager[1]) < 1e-3


def test_kv_cache_decoding_equals_recomputing_the_prefix():
    """Token by token with transformers' DynamicCache against the whole sequence at once, on the device:
    each position's logits agree; a cache that forgot a step (the control) does not."""
    transformers = pytest.importorskip("transformers")
    from normlab.model.decoding import make_decoding

    m = build_model("peri", "nano", seed=0).to(DEV).eval()
    x = torch.randint(0, 256, (2, 12), device=DEV)
    with torch.no_grad():
        full = m(x).logits
        cache = transformers.DynamicCache()
        steps = [m(x[:, :4], decoding=make_decoding(2, 4, x.device, cache=cache)).logits]
        for i in range(4, 12):
            steps.append(m(x[:, i : i + 1], decoding=make_decoding(2, 1, x.device, cache=cache)).logits)
        assert rel_err(torch.cat(steps, dim=1), full) < 1e-4
        stale = transformers.DynamicCache()
        m(x[:, :4], decoding=make_decoding(2, 4, x.device, cache=stale))
        skipped = m(x[:, 5:6], decoding=make_decoding(2, 1, x.device, cache=stale)).logits  # token 4 never seen
        assert rel_err(skipped, full[:, 5:6]) > 1e-2


@cuda_only
def test_true_fp16_on_cuda_stores_the_stream_in_fp16_and_overflows_past_65504():
    """precision fp16 with fp16 storage on CUDA is exact: the residual add itself runs in fp16."""
    from normlab.model.storage import Storage, for_run
    from tests.helpers import planted_overflow as _planted

    model = _planted().cuda()
    model.set_storage(for_run("fp16", "fp16"))
    tokens = torch.randint(0, 256, (2, 8), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(tokens, targets=tokens, return_hidden_states=True)
    assert out.hidden_states[0].dtype == torch.float16 and out.hidden_states[0].abs().max() == 4e4
    assert torch.isinf(out.hidden_states[1]).all() and torch.isnan(out.loss)
    # a trained-looking model: the GPU's fp16 and the CPU's emulation agree to fp16 resolution
    peri = build_model("peri", "nano", seed=0)
    x = torch.randint(0, 256, (2, 16))
    peri.set_storage(Storage(torch.float16))
    cpu = float(peri(x, targets=x).loss)
    peri = peri.cuda()
    peri.set_storage(for_run("fp16", "fp16"))
    with torch.autocast("cuda", dtype=torch.float16):
        gpu = float(peri(x.cuda(), targets=x.cuda()).loss)
    assert abs(cpu - gpu) < 5e-3


@cuda_only
def test_fp16_run_on_cuda_diverges_with_its_first_overflow(corpus, tmp_path):
    s = train(
        small(
            corpus,
            tmp_path / "f",
            device="cuda",
            precision="fp16",
            layout="pre",
            steps=4,
            probe_every=2,
            **{"model.init_std": 3000.0, "model.init": "normal"},
        )
    )
    assert s["status"] == "diverged" and s["activation_dtype"] == "fp16"
    assert s["forensics"]["forward"]["kind"] == "overflow" and s["first_break"].startswith(("block", "embedding"))


@cuda_only
def test_the_memory_plan_bounds_what_the_allocator_held(corpus, tmp_path):
    """The plan (activations measured on the CPU, scaled) against the GPU's own peak: the peak stays under
    the planned total and above the plan without its overhead allowance by no more than half."""
    s = train(
        small(
            corpus,
            tmp_path / "m",
            device="cuda",
            size="micro-deep",
            precision="bf16",
            batch_size=16,
            seq_len=128,
            steps=4,
            probe_every=0,
        )
    )
    mem = s["memory"]
    assert mem["max_allocated_gib"] <= mem["planned_gib"], mem
    assert mem["max_allocated_gib"] >= 0.5 * (mem["planned_gib"] - 1.0), mem  # 1 GiB: the plan's overhead
