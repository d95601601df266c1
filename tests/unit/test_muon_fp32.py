"""Muon's Newton-Schulz iteration in float32 (optim.muon_ns_dtype = fp32): the singular values by the quintic
polynomial computed here, one step of the optimizer by its formula, torch's function restored after the step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.optim._muon as torch_muon

import normlab
from normlab.config.train import TrainConfig
from normlab.errors import ConfigError
from normlab.train import muon_fp32
from normlab.train.optim import make_optimizer

ABC = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Jordan et al.'s) coefficients


def test_singular_values_follow_the_quintic_polynomial():
    # G = U diag(s) V^T: every iteration maps each singular value of X_0 = G / ||G||_F through
    # p(s) = a s + b s^3 + c s^5 and keeps U and V, so the result is U diag(p^k(s / ||s||)) V^T
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(9, 6, dtype=torch.float64))
    s = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.05, 0.01], dtype=torch.float64)
    g = u @ torch.diag(s) @ v.T  # (6, 9): wide
    x = s / s.norm()
    for _ in range(5):
        x = ABC[0] * x + ABC[1] * x**3 + ABC[2] * x**5
    want = u @ torch.diag(x) @ v.T
    got = muon_fp32.orthogonalize_fp32(g, ABC, 5, 1e-7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    # a tall matrix runs on its transpose, as torch's does: the same polynomial, transposed back
    torch.testing.assert_close(muon_fp32.orthogonalize_fp32(g.T, ABC, 5, 1e-7).double(), want.T, rtol=0, atol=2e-6)


def test_fp32_agrees_with_torch_bf16_within_bf16_rounding():
    torch.manual_seed(1)
    g = torch.randn(64, 256)
    ours = muon_fp32.orthogonalize_fp32(g, ABC, 5, 1e-7)
    theirs = torch_muon._zeropower_via_newtonschulz(g, ABC, 5, 1e-7).float()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert 1e-4 < rel < 0.05  # not the same computation (bf16 rounds every product), the same result within it


def test_one_fp32_muon_step_is_the_formula():
    torch.manual_seed(0)
    model = normlab.build_model("peri", "nano")
    cfg = TrainConfig.of(
        optimizer="muon", lr=0.02, weight_decay=0.1, muon_ns_steps=3, muon_nesterov=False, muon_ns_dtype="fp32"
    )
    opt = make_optimizer(model, cfg)
    w = model.blocks[0].mlp.gate_proj.weight  # (128, 32): tall
    before = w.detach().clone()
    x = torch.randint(0, 256, (2, 16))
    model(x, targets=x).loss.backward()
    g = w.grad.double()
    opt.step()
    # by hand in float64: the momentum buffer (1 - 0.95) g, orthogonalized on its wide transpose
    m = ((1 - 0.95) * g).T
    m = m / m.norm()
    for _ in range(3):
        a = m @ m.T
        m = ABC[0] * m + (ABC[1] * a + ABC[2] * a @ a) @ m
    want = before.double() * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(128) * m.T  # match_rms_adamw
    torch.testing.assert_close(w.detach().double(), want, rtol=0, atol=2e-6)
    assert torch_muon._zeropower_via_newtonschulz is not muon_fp32.orthogonalize_fp32  # restored after the step


def test_bad_ns_dtype_is_refused():
    with pytest.raises(ConfigError, match="muon_ns_dtype"):
        TrainConfig.of(optimizer="muon", muon_ns_dtype="fp16")


def test_missing_torch_function_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delattr(torch_muon, "_zeropower_via_newtonschulz")
    with pytest.raises(ConfigError, match="valid: bf16"), muon_fp32.newton_schulz_in_float32():
        pass
