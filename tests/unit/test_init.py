"""Initialization schemes: the drawn weights have the stds the papers specify."""

import math

import pytest
import torch

import normlab
from normlab.layout import deepnorm_beta

D, L = 256, 4


def build(scheme, layout="pre"):
    return normlab.build_model(layout, "nano", seed=0, d_model=D, n_heads=4, n_layers=L, init=scheme, d_ff=1024)


@pytest.mark.parametrize(
    "scheme, std",
    [
        ("normal", 0.02),
        ("he", math.sqrt(2 / D)),
        ("lecun", math.sqrt(1 / D)),
        ("10/d", math.sqrt(10 / D)),
        ("1/10d", math.sqrt(1 / (10 * D))),
    ],
)
def test_variance_schemes(scheme, std):
    m = build(scheme)
    for w in (m.blocks[0].attn.q_proj.weight, m.blocks[-1].mlp.down_proj.weight, m.embed.weight):
        assert w.std().item() == pytest.approx(std, rel=0.03)


def test_truncated_normal_and_output_scaling():
    base = 1 / math.sqrt(2.5 * D)
    trunc = build("trunc-normal").blocks[1]
    # a normal truncated at +-3 std has std 0.9866 of the untruncated one
    assert trunc.attn.q_proj.weight.std().item() == pytest.approx(0.9866 * base, rel=0.03)
    assert trunc.mlp.up_proj.weight.abs().max().item() <= 3 * base
    meg = build("megatron")
    for blk in meg.blocks:
        assert blk.attn.o_proj.weight.std().item() == pytest.approx(0.9866 * base / math.sqrt(2 * L), rel=0.04)
        assert blk.attn.q_proj.weight.std().item() == pytest.approx(0.9866 * base, rel=0.03)
    ds = build("depth-scaled")
    for layer, blk in enumerate(ds.blocks, start=1):
        assert blk.mlp.down_proj.weight.std().item() == pytest.approx(0.9866 * base / math.sqrt(2 * layer), rel=0.04)


def test_xavier():
    m = build("xavier")
    w = m.blocks[0].mlp.up_proj.weight  # fan_in 256, fan_out 1024
    assert w.std().item() == pytest.approx(math.sqrt(2 / (D + 1024)), rel=0.03)


def test_deepnorm_beta_on_v_o_ffn_only():
    m = normlab.build_model("deepnorm", "nano", seed=0, d_model=D, n_heads=4, n_layers=L, d_ff=1024)
    assert m.init_scheme == "deepnorm"
    beta = deepnorm_beta(L)
    assert beta == pytest.approx((8 * L) ** -0.25)
    a, f = m.blocks[0].attn, m.blocks[0].mlp
    xav_sq = math.sqrt(2 / (2 * D))
    assert a.q_proj.weight.std().item() == pytest.approx(xav_sq, rel=0.03)
    assert a.v_proj.weight.std().item() == pytest.approx(beta * xav_sq, rel=0.03)
    assert a.o_proj.weight.std().item() == pytest.approx(beta * xav_sq, rel=0.03)
    assert f.down_proj.weight.std().item() == pytest.approx(beta * math.sqrt(2 / (D + 1024)), rel=0.03)


def test_norms_start_at_identity_and_seed_reproduces():
    a, b = build("normal", "peri"), build("normal", "peri")
    assert torch.equal(a.blocks[0].attn_norms.output.weight, torch.ones(D))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
