"""Norms against the tutorial article's worked example and their formulas."""

import math

import torch

from normlab.model.norms import make_norm


def test_layernorm_worked_example():
    """Article: [3, 1, -1, 5] -> mean 2, variance 5 -> [0.45, -0.45, -1.34, 1.34]."""
    ln = make_norm("layer", 4, eps=1e-5)
    out = ln(torch.tensor([[3.0, 1.0, -1.0, 5.0]]))
    assert torch.equal(out.round(decimals=2), torch.tensor([[0.45, -0.45, -1.34, 1.34]]))
    exact = torch.tensor([1.0, -1.0, -3.0, 3.0]) / math.sqrt(5.0 + 1e-5)
    torch.testing.assert_close(out[0], exact)
    assert abs(out.sum().item()) < 1e-6


def test_rmsnorm_worked_example():
    """Article: RMSNorm rescales [3, 1, -1, 5] by its RMS sqrt(9) = 3, keeps the mean, output RMS 1."""
    rms = make_norm("rms", 4, eps=1e-6)
    out = rms(torch.tensor([[3.0, 1.0, -1.0, 5.0]]))
    torch.testing.assert_close(out[0], torch.tensor([3.0, 1.0, -1.0, 5.0]) / math.sqrt(9.0 + 1e-6))
    torch.testing.assert_close(out.pow(2).mean().sqrt(), torch.tensor(1.0))
    assert out.mean().item() != 0.0


def test_layernorm_without_bias_and_frozen_gamma():
    ln = make_norm("layer", 8, eps=1e-5, bias=False, frozen_gamma=True)
    assert ln.bias is None and not ln.weight.requires_grad
    assert [n for n, p in ln.named_parameters() if p.requires_grad] == []
