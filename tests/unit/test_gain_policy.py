"""The gain's own policy (arXiv 2605.26895, "Negligible in size, significant in effect"): weight decay and learning
rate per site kind, input norms (they feed a linear map: A, H, q, k, v, c, final) against output norms (after a
sublayer or the add: B, C, emb). Groups checked by parameter name, and the decay checked on an AdamW step."""

from __future__ import annotations

import pytest
import torch

import normlab
from normlab.config.train import TrainConfig
from normlab.errors import ConfigError
from normlab.layout.sites import GAIN_KINDS, NORM_SITES
from normlab.train.optim import make_optimizer, param_groups, set_lr


def _names(model, params) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def _by_kind(model, cfg) -> dict[str, dict]:
    return {g.get("gains", str(g["weight_decay"])): g for g in param_groups(model, cfg)}


def test_every_norm_site_is_one_kind():
    assert sorted(GAIN_KINDS["input"] + GAIN_KINDS["output"]) == sorted(NORM_SITES)


def test_unset_the_groups_are_as_before():
    model = normlab.build_model("peri", "nano")
    groups = param_groups(model, TrainConfig.of(weight_decay=0.1))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all("gains" not in g for g in groups)


def test_peri_gains_split_into_input_and_output_norms_each_with_its_decay_and_lr():
    """Peri-LN, 2 layers: input gains = both sublayers' A and the final norm; output = both B and the embedding norm."""
    model = normlab.build_model("peri", "nano")
    cfg = TrainConfig.of(weight_decay=0.1, wd_input_gains=1.0, wd_output_gains=0.0, lr_output_gains=0.5)
    kinds = _by_kind(model, cfg)
    layers = range(2)
    assert _names(model, kinds["input"]["params"]) == {
        *(f"blocks.{i}.{s}_norms.input.weight" for i in layers for s in ("attn", "mlp")),
        "final_norm.weight",
    }
    assert _names(model, kinds["output"]["params"]) == {
        *(f"blocks.{i}.{s}_norms.output.weight" for i in layers for s in ("attn", "mlp")),
        "embed_norm.weight",
    }
    assert (kinds["input"]["weight_decay"], kinds["input"]["lr_ratio"]) == (0.1, 1.0)
    assert (kinds["output"]["weight_decay"], kinds["output"]["lr_ratio"]) == (0.0, 0.5)
    # the rest keep wd_exclude's rule: no norm gain left in the decayed or the excluded group
    assert not any("norm" in n for n in _names(model, kinds["0.1"]["params"]))
    assert not any("norm" in n for n in _names(model, kinds["0.0"]["params"]))


def test_sites_inside_attention_the_mlp_and_after_the_add_have_their_kind():
    """q, k (QK-norm), v, c and H are input norms; C (Post-LN's after-add) an output norm; LayerNorm's betas stay
    with wd_exclude."""
    model = normlab.build_model("attn=qkvcC,mlp=CH,norm=layer", "nano", n_layers=1)
    kinds = _by_kind(model, TrainConfig.of(wd_input_gains=0.5, wd_output_gains=2.0, weight_decay=0.1))
    assert _names(model, kinds["input"]["params"]) == {
        "blocks.0.attn.q_norm.weight",
        "blocks.0.attn.k_norm.weight",
        "blocks.0.attn.v_norm.weight",
        "blocks.0.attn.context_norm.weight",
        "blocks.0.mlp.hidden_norm.weight",
    }
    assert _names(model, kinds["output"]["params"]) == {
        "blocks.0.attn_norms.after_add.weight",
        "blocks.0.mlp_norms.after_add.weight",
    }
    assert kinds["input"]["weight_decay"] == pytest.approx(0.05) and kinds["output"]["weight_decay"] == 0.2
    assert "blocks.0.attn.q_norm.bias" in _names(model, kinds["0.0"]["params"])


@pytest.mark.parametrize(("exclude", "expected"), [("norms,biases,embeddings", 0.0), ("", 0.1)])
def test_an_lr_alone_keeps_the_decay_wd_exclude_gives_norms(exclude, expected):
    model = normlab.build_model("pre", "nano")
    kinds = _by_kind(model, TrainConfig.of(weight_decay=0.1, wd_exclude=exclude, lr_input_gains=3.0))
    assert kinds["input"]["weight_decay"] == expected and kinds["input"]["lr_ratio"] == 3.0
    assert "output" not in kinds  # Pre-LN has no output norm


def test_one_adamw_step_decays_the_input_gains_and_leaves_the_output_gains():
    """With zero gradients AdamW's step is the decay alone: gamma <- gamma (1 - lr_group wd_group)."""
    model = normlab.build_model("peri", "nano")
    cfg = TrainConfig.of(lr=0.01, weight_decay=0.1, wd_input_gains=1.0, wd_output_gains=0.0, lr_input_gains=2.0)
    opt = make_optimizer(model, cfg)
    set_lr(opt, 0.01)
    a, b = model.blocks[0].attn_norms.input.weight, model.blocks[0].attn_norms.output.weight
    with torch.no_grad():
        a.fill_(1.5), b.fill_(1.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(a, torch.full_like(a, 1.5 * (1 - 0.02 * 0.1)))
    torch.testing.assert_close(b, torch.full_like(b, 1.5))


def test_muon_and_sgd_runs_carry_the_multipliers():
    model = normlab.build_model("peri", "nano")
    muon = make_optimizer(model, TrainConfig.of(optimizer="muon", lr=0.02, muon_adamw_lr=0.004, lr_output_gains=0.25))
    set_lr(muon, 0.02)
    out = [g for g in muon.adamw.param_groups if g.get("gains") == "output"]
    assert len(out) == 1 and out[0]["lr"] == pytest.approx(0.004 * 0.25)
    sgd = make_optimizer(model, TrainConfig.of(optimizer="sgd", lr=0.1, lr_input_gains=0.5))
    set_lr(sgd, 0.1)
    assert [g["lr"] for g in sgd.param_groups if g.get("gains") == "input"] == pytest.approx([0.05])


def test_mup_splits_keep_the_gain_groups():
    """Under muP the gains are vector-like (factor 1): each policy group keeps its ratio and decay."""
    cfg = TrainConfig.of(
        layout="peri",
        **{"model.parametrization": "mup", "model.base_d_model": 32, "model.d_model": 64},
        size="nano",
        weight_decay=0.1,
        wd_output_gains=1.0,
        lr_output_gains=0.5,
    )
    model = normlab.build_model("peri", "nano", parametrization="mup", base_d_model=32, d_model=64)
    groups = [g for g in param_groups(model, cfg) if g.get("gains") == "output"]
    assert len(groups) == 1 and (groups[0]["lr_ratio"], groups[0]["weight_decay"]) == (0.5, 0.1)


@pytest.mark.parametrize("bad", [{"wd_input_gains": -1.0}, {"lr_output_gains": 0.0}])
def test_bad_values_are_one_line_config_errors(bad):
    with pytest.raises(ConfigError, match="gains"):
        TrainConfig.of(**bad)


def test_the_settings_read_from_text_and_are_identity():
    cfg = TrainConfig().with_({"optim.wd_input_gains": "0.5", "lr_output_gains": "2"}, from_text=True)
    assert (cfg.optim.wd_input_gains, cfg.optim.lr_output_gains) == (0.5, 2.0)
    assert cfg.identity_diff(TrainConfig()) == ["wd_input_gains", "lr_output_gains"]
