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


def _gamma(n: int, unit: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the worst-case relative error of an n-term dot product (and, n = 2 more,
    of torch.addmm's scaling and sum) in a floating-point format of unit roundoff u (Accuracy and Stability of
    Numerical Algorithms, 2002, Sec. 3.5)."""
    return n * unit / (1 - n * unit)


def _newton_schulz_error_bound(s: torch.Tensor, cols: int, unit: float, steps: int = 5) -> float:
    """A first-order worst-case bound on ||computed - exact||_F for `orthogonalize_fp32` on a (len(s) x cols)
    matrix with singular values ``s``, every operation rounded with unit roundoff ``unit``.

    Two parts per iteration k, with X_k's singular values x_k known exactly (p maps each; X_0 = G / ||G||_F):
    - the error it adds, delta_k, from gamma_n bounds on each matmul in Frobenius norms: the Gram matrix
      A = X X^T (inner dimension cols), B = b A + c A A (inner len(s), plus the scaling and the sum: gamma_{n+2}),
      X' = a X + B X (the same), each also carrying the error of its inputs;
    - the growth of the error it receives: the map X -> p(X) = a X + b X X^T X + c (X X^T)^2 X acts on a
      perturbation, in X's singular bases, by divided differences of the odd polynomial p between +-x_i and
      +-x_j (and 0), each at most L_k = max |p'(t)| over |t| <= max x_k (mean value theorem); p'(t) = a + 3 b t^2
      + 5 c t^4 peaks at t = 0, at the interval's end, or where p'' = 0 (t^2 = -3b / (10c)).
    e_{k+1} = L_k e_k + delta_k, from e_0 = the input's rounding (G to float32, its norm, the division). L_k is
    3.4 to 3.8 here (the smallest singular value grows 3.4x per iteration, which is Newton-Schulz's purpose),
    so five iterations multiply the first one's error by ~150: the tolerance is this bound, not the last digit
    of float32."""
    a, b, c = ABC
    x = s / s.norm()
    error = 2 * unit + _gamma(x.numel() * cols, unit)  # the cast, the Frobenius norm, the division
    crit = math.sqrt(-3 * b / (10 * c))
    for _ in range(steps):
        f, top = x.norm().item(), x.max().item()  # ||X_k||_F, ||X_k||_2
        gram = (x**4).sum().sqrt().item()  # ||X X^T||_F
        poly = ((b * x**2 + c * x**4) ** 2).sum().sqrt().item()  # ||b A + c A A||_F
        e_gram = _gamma(cols, unit) * f**2
        e_b = (abs(b) + 2 * abs(c) * gram) * e_gram + _gamma(x.numel() + 2, unit) * (abs(b) * gram + abs(c) * gram**2)
        delta = f * e_b + _gamma(x.numel() + 2, unit) * (abs(a) + poly) * f
        slope = max(abs(a + 3 * b * t**2 + 5 * c * t**4) for t in (0.0, top, min(crit, top)))
        error = slope * error + delta
        x = a * x + b * x**3 + c * x**5
    return error


def test_singular_values_follow_the_quintic_polynomial():
    # G = U diag(s) V^T: every iteration maps each singular value of X_0 = G / ||G||_F through
    # p(s) = a s + b s^3 + c s^5 and keeps U and V, so the result is U diag(p^k(s / ||s||)) V^T
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(9, 6, dtype=torch.float64))
    s = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.05, 0.01], dtype=torch.float64)
    g = u @ torch.diag(s) @ v.T  # (6, 9): wide

    def quintic(steps: int) -> torch.Tensor:
        x = s / s.norm()
        for _ in range(steps):
            x = ABC[0] * x + ABC[1] * x**3 + ABC[2] * x**5
        return u @ torch.diag(x) @ v.T

    want = quintic(5)
    tol = _newton_schulz_error_bound(s, 9, 2.0**-24)  # float32's unit roundoff: eps / 2
    got = muon_fp32.orthogonalize_fp32(g, ABC, 5, 1e-7)
    assert got.dtype == torch.float32
    assert (got.double() - want).norm() <= tol
    # a tall matrix runs on its transpose, as torch's does: the same polynomial, transposed back
    assert (muon_fp32.orthogonalize_fp32(g.T, ABC, 5, 1e-7).double() - want.T).norm() <= tol
    # the bound (~6e-3) still tells float32 from bf16 (torch's own iteration) and from a step more or less
    bf16 = torch_muon._zeropower_via_newtonschulz(g.float(), ABC, 5, 1e-7).double()
    assert min((bf16 - want).norm(), (quintic(4) - want).norm(), (quintic(6) - want).norm()) > 5 * tol


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
