"""The trainer's speed plumbing: one host read-back per step, fused optimizers, MFU, device choice."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from normlab.errors import ConfigError
from normlab.model import build_model
from normlab.runs.start import Start
from normlab.train import distributed, train
from normlab.train.mfu import PEAK_TFLOPS, device_model, flops_per_token, peak_flops
from normlab.train.optim import make_optimizer
from normlab.train.trainer import build_state, speed_summary, train_step
from tests.helpers import rows, small


def count_readbacks(monkeypatch) -> list[str]:
    """Record every tensor -> Python read-back (the calls that make a CPU wait for a GPU), except
    those of torch's CPU optimizers (`.item()` on their step counters: the fused CUDA kernels have
    none) and of the data sampler (host tensors, before the batch goes to the device)."""
    calls: list[str] = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            caller = sys._getframe(1).f_code.co_filename
            if f"torch{os.sep}optim{os.sep}" not in caller and f"normlab{os.sep}data{os.sep}" not in caller:
                calls.append(f"{_name} in {Path(caller).name}:{sys._getframe(1).f_lineno}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


@pytest.mark.parametrize("precision,expected", [("fp32", 1), ("bf16", 1), ("fp16", 2)])
def test_one_readback_per_step(corpus, tmp_path, monkeypatch, precision, expected):
    """Four micro-batches, clipping, z-loss: one read-back (loss and grad norm together); fp16 one more
    (the loss scale). The trainer before this change read back 5 (one loss per micro-batch + the norm)."""
    cfg = small(corpus, tmp_path / "r", grad_accum=4, z_loss=1e-4, probe_every=0, precision=precision)
    state = build_state(cfg, distributed.setup("cpu"), Start())
    train_step(state)  # warm-up (lazy optimizer state)
    calls = count_readbacks(monkeypatch)
    state.step = 1
    train_step(state)
    assert len(calls) == expected, calls


@pytest.mark.parametrize("size", ["nano", "tiny"])
def test_a_generated_token_reads_back_once_whatever_the_depth(monkeypatch, size):
    """A decoding step with given positions (what generate() runs per token): the positions are checked
    once per forward (on a GPU asynchronously, with no read at all), not in every layer's RoPE, which
    read the maximum back once per layer (2 reads at nano's 2 layers, 4 at tiny's, 25 per token at 12)."""
    from normlab.model.decoding import Decoding

    model = build_model("peri", size, seed=0).eval()
    tokens, positions = torch.tensor([[7, 8]]), torch.tensor([[5, 6]])
    calls = count_readbacks(monkeypatch)
    with torch.no_grad():
        model(tokens, decoding=Decoding(positions, None))
    assert len(calls) == 1 and "decoding.py" in calls[0], calls  # the CPU check; on CUDA _assert_async
    top = model.config.max_seq_len
    with pytest.raises(ValueError, match=f"position {top} is beyond max_seq_len={top}"):
        model(tokens, decoding=Decoding(torch.tensor([[5, top]]), None))


def test_moe_counts_experts_on_the_device_without_bincount(monkeypatch):
    """torch.bincount sizes its output from the data, so on CUDA it reads the maximum back (two syncs per
    call) and breaks torch.compile's graph: the router's counts are a scatter-add into fixed bins."""
    from normlab.model.moe import expert_counts

    ids = torch.tensor([[0, 3], [3, 1], [1, 3]])
    assert expert_counts(ids, 5).tolist() == torch.bincount(ids.flatten(), minlength=5).tolist() == [1, 2, 0, 3, 0]
    used = []
    real = torch.bincount
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: used.append(1) or real(*a, **k))
    model = build_model("pre", "moe-micro", seed=0)
    model(torch.randint(0, 256, (2, 16))).logits.sum().backward()
    assert not used
    torch.bincount(ids.flatten())  # the spy itself works
    assert used == [1]


def test_fused_optimizers_when_asked():
    m = build_model("peri", "nano", seed=0)
    cfg = small("x", "y")
    assert make_optimizer(m, cfg, fused=True).defaults["fused"] is True
    assert not make_optimizer(m, cfg).defaults["fused"]
    sgd = small("x", "y", optimizer="sgd")
    assert make_optimizer(m, sgd, fused=True).defaults["fused"] is True


def test_flops_per_token_is_6n_plus_attention_by_hand():
    m = build_model("pre", "nano", seed=0, n_kv_heads=1, d_ff=48, vocab_size=300)
    d, L, H, Q, kv, ff, V, T = 32, 2, 2, 16, 1, 48, 300, 64
    per_layer = d * H * Q + 2 * d * kv * Q + H * Q * d + 3 * d * ff  # q, k, v (GQA), o; SwiGLU's three
    n = L * per_layer + V * d  # + the LM head (a product); the embedding lookup is not
    assert flops_per_token(m, T) == 6 * n + 12 * L * H * Q * T
    tied = build_model("pre", "nano", seed=0, tie_embeddings=True)
    untied = build_model("pre", "nano", seed=0)
    assert flops_per_token(tied, T) == flops_per_token(untied, T)  # the head is one product either way


def test_peak_table_and_device_names():
    assert device_model("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert device_model("NVIDIA H100 PCIe") == "H100 PCIe"
    assert device_model("NVIDIA H200") == "H200"
    assert device_model("NVIDIA A100-SXM4-80GB") == "A100"
    assert device_model("NVIDIA H100 NVL") == "H100 NVL" and device_model("NVIDIA H200 NVL") == "H200 NVL"
    assert PEAK_TFLOPS["H200 NVL"][0] < PEAK_TFLOPS["H200"][0]  # not the SXM part's peak
    assert device_model("NVIDIA GeForce RTX 4090") is None
    assert PEAK_TFLOPS["H100 SXM"][0] == 989.4
    assert peak_flops(torch.device("cpu"), "bf16") is None


def test_mfu_in_rows_and_summary(corpus, tmp_path, monkeypatch):
    s = train(small(corpus, tmp_path / "cpu", steps=10, probe_every=0))
    r = rows(tmp_path / "cpu")
    assert s["mfu"] == "unknown" and "mfu" not in r[0] and s["devices"] == 1 and s["device"] == "cpu"
    # what the figures ran on: the architecture, the machine's cores, the threads torch used
    assert s["device_name"].startswith(f"{platform.machine()}, {os.cpu_count()} cores, ")
    assert s["device_name"].endswith((" thread", " threads")) and "cuda" not in s["device_name"].lower()
    assert s["tok_per_s_per_device"] == s["tok_per_s"] > 0
    assert all(x["tok_per_s_per_device"] == x["tok_per_s"] for x in r)
    # with a known peak: MFU = tok/s per device x FLOPs per token / peak, the median after warm-up
    monkeypatch.setattr("normlab.train.trainer.peak_flops", lambda *a: 1e9)
    s = train(small(corpus, tmp_path / "peak", steps=10, probe_every=0))
    r = rows(tmp_path / "peak")
    for x in r:
        assert x["mfu"] == pytest.approx(x["tok_per_s"] * s["flops_per_token"] / 1e9)
    assert s["mfu"] == pytest.approx(s["tok_per_s"] * s["flops_per_token"] / 1e9)


def test_speed_summary_skips_warmup():
    class S:  # the two fields speed_summary reads
        info = distributed.DistInfo(world=2)
        flops_per_token, peak_flops = 100, 1e6

    rs = [{"tok_per_s": 1.0}] + [{"tok_per_s": 1000.0}] * 9  # step 0 compiles
    out = speed_summary(rs, S())
    assert out["tok_per_s"] == 1000.0 and out["tok_per_s_per_device"] == 500.0
    assert out["mfu"] == pytest.approx(500.0 * 100 / 1e6)


def test_device_auto_under_torchrun_picks_local_rank(monkeypatch):
    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: picked.append(i))
    assert distributed.pick_device("auto", local_rank=1) == torch.device("cuda", 1) and picked == [1]
    with pytest.raises(ConfigError, match="local rank 2 needs cuda:2, but this machine has 2 GPU"):
        distributed.pick_device("auto", local_rank=2)
    assert distributed.pick_device("cpu", local_rank=5) == torch.device("cpu")


def test_tf32_through_fp32_precision():
    """The deprecated allow_tf32 flags are not used; fp32_precision is set both ways."""
    from normlab.train.trainer import set_tf32

    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        set_tf32(False)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
        set_tf32(True)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


class _FakeCuda:
    """A CPU tensor that reports itself as CUDA, for the kernel-choice rules (no arithmetic is done)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.is_cuda, self.dtype, self.device = True, dtype, "cuda:0"


def test_gqa_repeats_kv_heads_where_sdpa_would_fall_to_its_math_kernel():
    from normlab.model.attention import expand_kv_heads

    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    assert expand_kv_heads(_FakeCuda(torch.float32), None)  # flash runs no float32
    assert expand_kv_heads(_FakeCuda(torch.bfloat16), mask)  # nor an explicit mask
    assert not expand_kv_heads(_FakeCuda(torch.bfloat16), None)  # flash with enable_gqa: nothing to repeat
    assert not expand_kv_heads(torch.zeros(1), mask)  # CPU: enable_gqa costs nothing
    # the repeated heads compute what enable_gqa computes
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(fused, repeated)


def test_grouped_product_only_where_it_is_one_kernel(monkeypatch):
    """torch's grouped product is one CUTLASS kernel on sm_90 and sm_100 only; on sm_120 (and older parts)
    it loops with the offsets read back to the host, so the dispatch does not choose it there."""
    from normlab.model import moe

    x = _FakeCuda(torch.bfloat16)
    for major, chosen in ((8, None), (9, torch.bfloat16), (10, torch.bfloat16), (12, None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert moe._grouped_dtype(x) == chosen, major
