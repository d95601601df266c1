"""On a CUDA machine: the same behaviour on the GPU (skipped cleanly on CPU-only machines).

These run where the suite runs on a GPU (the device tool's H100); the CPU tests above cover the
same behaviour on every machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab.model import build_model
from normlab.model.loss import lm_loss
from normlab.train import train
from tests.helpers import rows, small

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPO = Path(__file__).resolve().parents[2]

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


def test_no_dtype_mismatch_warning_on_cuda():
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_trains_on_cuda_with_mfu(corpus, tmp_path, precision):
    s = train(small(corpus, tmp_path / precision, device="cuda", precision=precision, steps=12, probe_every=6))
    assert s["status"] == "ok" and s["device"].startswith("cuda") and s["final_loss"] < s["initial_loss"]
    name = torch.cuda.get_device_name()
    if any(k in name for k in ("H100", "H200", "A100")) and "NVL" not in name:
        assert isinstance(s["mfu"], float) and 0 < s["mfu"] < 1 and "mfu" in rows(tmp_path / precision)[-1]


def test_fp16_overflows_are_skipped_on_cuda(corpus, tmp_path):
    s = train(small(corpus, tmp_path / "o", device="cuda", precision="fp16", loss_scale_init=2.0**24, steps=24))
    assert s["status"] == "ok" and s["overflow_steps"]


def test_chunked_loss_and_checkpointing_on_cuda():
    m = build_model("peri", "nano", seed=0).cuda()
    x = torch.randint(0, 256, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        whole = m(x, targets=x).loss
        m.activation_checkpointing = True
        lean = m(x, targets=x, loss_chunk=32).loss
    assert lean.item() == pytest.approx(whole.item(), rel=1e-3)
    h = torch.randn(2, 8, 32, device="cuda")
    loss, logits = lm_loss(m.lm_head, h, x[:2, :8], chunk=4)
    assert logits is None and torch.isfinite(loss)


def test_grouped_and_looped_moe_dispatch_agree_on_cuda():
    from normlab.model.config import ModelConfig
    from normlab.model.moe import MoE

    cfg = ModelConfig(d_model=64, n_layers=1, n_heads=2, n_experts=8, moe_top_k=2, expert_d_ff=128)
    torch.manual_seed(0)
    a = MoE(cfg.with_(moe_dispatch="sorted")).cuda()
    b = MoE(cfg.with_(moe_dispatch="loop")).cuda()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # the grouped product's path on compute capability 9+
        ya, yb = a(x), b(x)
    torch.testing.assert_close(ya.float(), yb.float(), rtol=2e-2, atol=2e-2)


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


def test_fp16_run_on_cuda_diverges_with_its_first_overflow(corpus, tmp_path):
    s = train(small(corpus, tmp_path / "f", device="cuda", precision="fp16", layout="pre", steps=4, probe_every=2,
                    **{"model.init_std": 3000.0, "model.init": "normal"}))
    assert s["status"] == "diverged" and s["activation_dtype"] == "fp16"
    assert s["forensics"]["forward"]["kind"] == "overflow" and s["first_break"].startswith(("block", "embedding"))
