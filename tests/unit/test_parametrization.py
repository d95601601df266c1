"""muP and CompleteP (normlab.model.parametrization): the per-parameter numbers against the reference `mup` 1.0.0,
and the forward's multipliers against an SP model whose weights carry them by hand."""

from __future__ import annotations

import math

import pytest
import torch

from normlab.config.train import TrainConfig, apply_settings
from normlab.errors import ConfigError, LayoutError
from normlab.model.build import build_model
from normlab.model.parametrization import param_scales
from normlab.train.optim import make_optimizer

mup = pytest.importorskip("mup")

BASE, WIDE = 32, 128  # m = 4; nano's 2 heads, so the head width goes 16 -> 64


def _cfg(**settings) -> TrainConfig:
    return apply_settings(TrainConfig(), {"size": "nano", "lr": 1e-2, "weight_decay": 0.1, **settings}, "test")


def _mup_cfg(layout: str = "peri", **settings) -> TrainConfig:
    return _cfg(
        layout=layout,
        **{"model.parametrization": "mup", "model.base_d_model": BASE, "model.d_model": WIDE, **settings},
    )


def _groups_by_param(opt) -> dict[int, tuple[float, float]]:
    """(lr factor, weight decay) of each parameter, as the optimizer's groups hold them."""
    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            out[id(p)] = (g.get("lr_ratio", g.get("lr")), g["weight_decay"])
    return out


@pytest.mark.parametrize("layout", ["pre", "peri", "qwen3"])
def test_learning_rates_weight_decay_and_init_match_the_mup_package(layout):
    """mup.set_base_shapes against the SP model at the base width, then MuAdamW over the same two groups
    (decayed, not): every parameter's learning rate and weight decay equal normlab's; the init factor is mup.init's
    (width_mult^-1/2 on matrix-like weights, 1 elsewhere); the readout's divisor is MuReadout's width_mult."""
    cfg = _mup_cfg(layout)
    model = build_model(cfg.model.layout, cfg.model.config, seed=0)
    base = build_model(cfg.model.layout, "nano", seed=0, d_model=BASE)
    # do_assert=False: normlab's head is an nn.Linear whose input the model divides by m, which is MuReadout's
    # forward (checked below), not the MuReadout class mup's assertion looks for
    mup.set_base_shapes(model, base, rescale_params=False, do_assert=False)
    ours = _groups_by_param(make_optimizer(model, cfg))
    # the same two groups (decayed, not) as SP forms them, from the SP model of this shape, by name
    sp_cfg = _cfg(layout=layout, **{"model.d_model": WIDE})
    sp_model = build_model(sp_cfg.model.layout, sp_cfg.model.config, seed=0)
    names = {id(p): n for n, p in sp_model.named_parameters()}
    mine = dict(model.named_parameters())
    groups = [
        {"params": [mine[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
        for g in make_optimizer(sp_model, sp_cfg).param_groups
    ]
    ref = mup.MuAdamW(groups, lr=1e-2)
    theirs = {id(p): (g["lr"] / 1e-2, g["weight_decay"]) for g in ref.param_groups for p in g["params"]}
    scales = param_scales(model)
    matrix_like = 0
    for name, p in model.named_parameters():
        assert ours[id(p)] == pytest.approx(theirs[id(p)], rel=1e-12), name
        inf = p.infshape
        expected = inf.width_mult() ** -0.5 if inf.ninf() == 2 else 1.0
        assert scales[name].init == pytest.approx(expected, rel=1e-12), name
        matrix_like += inf.ninf() == 2
    assert matrix_like >= 6  # q, k, v, o, the MLP's three per block: the test compared real factors
    assert model.output_mult == pytest.approx(1.0 / model.lm_head.weight.infshape.width_mult())


def test_init_stds_follow_the_base_shape():
    """normal (std 0.02) under muP at m = 4: hidden matrices 0.02 / 2, the embedding and the head 0.02 (the base's);
    He (std sqrt(2/d)): hidden matrices sqrt(2/d) as under SP (He is already muP's hidden init), the embedding and
    the head at the base's sqrt(2/32)."""
    cfg = _mup_cfg("pre", **{"model.init": "normal"})
    m = build_model(cfg.model.layout, cfg.model.config, seed=0)
    assert m.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.01, rel=0.03)
    assert m.blocks[0].mlp.down_proj.weight.std().item() == pytest.approx(0.01, rel=0.03)
    assert m.embed.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert m.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.03)
    he = build_model("pre", "nano", seed=0, **_mup_model(init="he"))
    assert he.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(math.sqrt(2 / WIDE), rel=0.03)
    assert he.embed.weight.std().item() == pytest.approx(math.sqrt(2 / BASE), rel=0.03)


def _mup_model(**kw):
    return {"parametrization": "mup", "base_d_model": BASE, "d_model": WIDE, **kw}


def test_at_the_base_shape_mup_and_completep_are_sp():
    """Every multiplier is 1 at the base shape: the same seed gives the same weights and logits."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    sp = build_model("peri", "nano", seed=3)
    for kw in (dict(parametrization="mup"), dict(parametrization="completep", base_d_model=32, base_n_layers=2)):
        other = build_model("peri", "nano", seed=3, **kw)
        torch.testing.assert_close(other(tokens).logits, sp(tokens).logits, rtol=0, atol=0)


def test_the_forward_multipliers_equal_an_sp_model_with_them_in_its_weights():
    """CompleteP, Pre-LN, m = 4, r = 2: x' = x + F(N(x)) / 2 per sublayer, attention q.k x sqrt(16) / 64 and
    logits W (h / 4). The SP model of the same shape with q_proj x (sqrt(16)/64) / 64^-1/2, o_proj and down_proj
    x 1/2 and the head x 1/4 computes the same logits (float64)."""
    kw = dict(parametrization="completep", base_d_model=BASE, base_n_layers=2, d_model=WIDE, n_layers=4)
    cp = build_model("pre", "nano", seed=1, **kw).double()
    sp = build_model("pre", "nano", seed=2, d_model=WIDE, n_layers=4).double()
    sp.load_state_dict(cp.state_dict())
    q_factor = (math.sqrt(16) / 64) / 64**-0.5
    with torch.no_grad():
        for blk in sp.blocks:
            blk.attn.q_proj.weight.mul_(q_factor)
            blk.attn.o_proj.weight.mul_(0.5)
            blk.mlp.down_proj.weight.mul_(0.5)
        sp.lm_head.weight.mul_(0.25)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cp(tokens).logits, sp(tokens).logits, rtol=1e-12, atol=1e-12)
    assert [b.branch for b in cp.blocks] == [0.5] * 4


def test_completep_learning_rates_and_epsilon():
    """alpha = 1: depth leaves Adam's learning rates as they are (r^(alpha-1) = 1) and multiplies AdamW's epsilon
    by m^-1 r^-1; alpha = 0.5: the blocks' parameters take r^-1/2 on top of muP's width factor."""
    settings = {
        "model.parametrization": "completep",
        "model.base_d_model": BASE,
        "model.d_model": WIDE,
        "model.base_n_layers": 2,
        "model.n_layers": 8,
    }
    cfg = _cfg(layout="pre", **settings)
    model = build_model(cfg.model.layout, cfg.model.config, seed=0)
    opt = make_optimizer(model, cfg)
    assert opt.defaults["eps"] == pytest.approx(cfg.optim.eps / 4 / 4)
    half = _cfg(layout="pre", **settings, **{"model.completep_alpha": 0.5})
    model = build_model(half.model.layout, half.model.config, seed=0)
    lr = _groups_by_param(make_optimizer(model, half))
    assert lr[id(model.blocks[0].attn.q_proj.weight)][0] == pytest.approx(0.25 * 4**-0.5)
    assert lr[id(model.blocks[0].attn_norms.input.weight)][0] == pytest.approx(4**-0.5)
    assert lr[id(model.embed.weight)][0] == pytest.approx(1.0)


def test_muon_matrices_follow_muons_own_rule():
    """Under Muon's "original" rule the hidden matrices keep the peak lr (its sqrt(fan_out/fan_in) is width
    invariant); under "match_rms_adamw" (Adam's update RMS) they take Adam's 1/m, with weight decay x m."""
    for rule, lr_f, wd_f in (("original", 1.0, 1.0), ("match_rms_adamw", 0.25, 4.0)):
        cfg = _mup_cfg("pre", optimizer="muon", muon_adjust_lr=rule)
        model = build_model(cfg.model.layout, cfg.model.config, seed=0)
        got = _groups_by_param(make_optimizer(model, cfg))[id(model.blocks[0].attn.q_proj.weight)]
        assert got == pytest.approx((lr_f, 0.1 * wd_f)), rule


@pytest.mark.parametrize(
    ("settings", "error", "says"),
    [
        ({"layout": "ngpt", "model.parametrization": "mup"}, ConfigError, "ngpt"),
        ({"layout": "post", "model.parametrization": "completep"}, ConfigError, "after-add norms"),
        ({"layout": "deepnorm", "model.parametrization": "completep"}, ConfigError, "skip scale alpha"),
        ({"model.base_d_model": 16}, ConfigError, "parametrization=mup or completep"),
        ({"model.parametrization": "mup", "model.base_n_layers": 1}, ConfigError, "CompleteP's base depth"),
        ({"model.parametrization": "mup", "model.d_head": 16, "model.base_d_model": 24}, ConfigError, "not a whole"),
        ({"model.parametrization": "mup", "optimizer": "sgd"}, ConfigError, "SGD"),
        # issue 63 item 19: outside the range the parametrization transfers over (m, r >= 1), and HybridNorm
        ({"model.parametrization": "mup", "model.base_d_model": 4096}, ConfigError, r"multiplied by 128, far outside"),
        ({"model.parametrization": "completep", "model.base_n_layers": 64}, ConfigError, r"deeper than the model"),
        ({"layout": "hybrid", "model.parametrization": "completep"}, ConfigError, r"normed skip \(HybridNorm"),
        ({"layout": "hybrid*", "model.parametrization": "completep"}, ConfigError, r"normed skip"),
    ],
)
def test_combinations_that_do_not_fit_are_refused_with_the_reason(settings, error, says):
    with pytest.raises((error, LayoutError), match=says):
        cfg = _cfg(**settings)
        build_model(cfg.model.layout, cfg.model.config)


def test_a_base_shape_equal_to_the_model_is_its_edge_of_validity():
    """m = r = 1 is accepted (SP exactly), so is a base up to 4x wider than the model (the ladder's narrow rungs);
    one wider than that, or deeper than the model, is refused in one line."""
    cfg = _cfg(**{"model.parametrization": "completep"})
    c = cfg.model.config
    ok = _cfg(
        **{"model.parametrization": "completep", "model.base_d_model": c.d_model, "model.base_n_layers": c.n_layers}
    )
    assert ok.model.config.width_mult == 1.0 and ok.model.config.depth_mult == 1.0
    quarter = _cfg(**{"model.parametrization": "mup", "model.base_d_model": c.d_model * 4})
    assert quarter.model.config.width_mult == 0.25
    for key, value in (("model.base_d_model", c.d_model * 8), ("model.base_n_layers", c.n_layers + 1)):
        with pytest.raises(ConfigError) as caught:
            _cfg(**{"model.parametrization": "completep", key: value})
        assert "\n" not in str(caught.value) and "at most" in str(caught.value)
