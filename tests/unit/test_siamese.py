"""SiameseNorm (arXiv 2602.08064) as one residual variant and one class: its equations by hand in float64 (as the
authors' code writes them: deit-model-siamesenorm.py), its parameters, weight decay, refusals and probes."""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.config.train import TrainConfig
from normlab.diagnostics.probes import Probes
from normlab.hf.native import residual_refusal
from normlab.layout import LayoutError, parse_layout
from normlab.layout.residual import Siamese
from normlab.model.params import analytic_params, count_params
from normlab.recommend.frameworks.snippets import unsaid
from normlab.train.optim import param_groups
from tests.reference import N, mha, swiglu
from tests.unit.test_equations import randomize_norms

DT = torch.float64
# float64 throughout, except RoPE's cos/sin tables, which normlab keeps in float32 (model/rope.py) where the reference
# computes them in float64: float32's eps bounds what that rotation changes in q and k, and through them the output
TOL = torch.finfo(torch.float32).eps


def _siamese(n_layers: int = 3) -> torch.nn.Module:
    model = normlab.build_model("siamese", "nano", seed=0, n_layers=n_layers).double()
    randomize_norms(model)  # every gain off 1, so a missing or swapped norm cannot go unnoticed
    with torch.no_grad():
        for m in model.modules():
            for name in ("attn_xnorm", "attn_ynorm", "mlp_xnorm", "mlp_ynorm", "final_xnorm", "final_ynorm"):
                norm = getattr(m, name, None)
                if norm is not None:
                    norm.weight.mul_(
                        1 + 0.3 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(7))
                    )
    return model


def siamese_block(b, x: torch.Tensor, y: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' Block.forward (deit-model-siamesenorm.py) with normlab's sublayers, c = sqrt(2 (l + 1))."""
    c = math.sqrt(2 * (layer + 1))
    x = N(b.attn_xnorm, x)  # x = post_norm1(x)
    z = mha(b.attn, N(b.attn_norms.input, x + N(b.attn_ynorm, y)), "")  # z = attn(input_norm1(x + pre_norm1(y)))
    x, y = x + z / c, y + z
    x = N(b.mlp_xnorm, x)  # x = post_norm2(x)
    z = swiglu(b.mlp, N(b.mlp_norms.input, x + N(b.mlp_ynorm, y)))
    return x + z / c, y + z


def test_every_block_and_the_logits_follow_the_equations_by_hand():
    model = _siamese()
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x = y = model.embed.weight[tokens]  # y = x.clone(): both streams start as the embedding
        for i, b in enumerate(model.blocks):
            got = b(torch.cat([x, y], dim=-1))
            x, y = siamese_block(b, x, y, i)
            torch.testing.assert_close(got, torch.cat([x, y], dim=-1), rtol=TOL, atol=TOL, msg=f"block {i}")
        # final_norm(pre_norm(x) + post_norm(y)): one norm per stream, their sum, the layout's final norm
        h = N(model.final_norm, N(model.final_xnorm, x) + N(model.final_ynorm, y))
        torch.testing.assert_close(model(tokens).logits, h @ model.lm_head.weight.T, rtol=TOL, atol=TOL)


def test_its_parameters_are_four_norms_per_block_and_two_for_the_output():
    for layers in (2, 5):
        pre = normlab.build_model("pre", "nano", seed=0, n_layers=layers)
        siam = normlab.build_model("siamese", "nano", seed=0, n_layers=layers)
        assert count_params(siam) == analytic_params(siam.config, siam.resolved)
        d = siam.config.d_model  # RMSNorm: one gain of d per norm
        assert count_params(siam).non_embedding - count_params(pre).non_embedding == (4 * layers + 2) * d


def test_its_norms_are_not_weight_decayed():
    model = normlab.build_model("siamese", "nano", seed=0)
    groups = param_groups(model, TrainConfig.of(weight_decay=0.1))
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    names = ("xnorm", "ynorm")
    theirs = [p for n, p in model.named_parameters() if any(k in n for k in names)]
    assert len(theirs) == 4 * 2 + 2 and not {id(p) for p in theirs} & decayed
    assert id(model.blocks[0].attn.q_proj.weight) in decayed  # the shared sublayers' matrices decay as ever


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("siamese,h=0.5", "siamese is SiameseNorm's two streams.*this layout has h$"),
        ("siamese,streams=2", "streams=2"),
        ("post,siamese", "a norm after the add"),
        ("hybrid,siamese", "skip from the normed input"),
    ],
)
def test_what_siamesenorm_gives_nothing_to_act_on_is_refused(text, words):
    with pytest.raises(LayoutError, match=words):
        parse_layout(text)
    with pytest.raises(LayoutError, match="takes no h"):
        Siamese(h=0.5)


def test_export_and_framework_snippets_refuse_it_with_the_reason():
    lay = parse_layout("siamese")
    assert "SiameseNorm's two streams" in str(residual_refusal(lay, "llama"))
    assert "--arch normlab" in str(residual_refusal(lay, "llama"))
    for framework in ("OLMo-core", "torchtitan", "litgpt", "nanochat"):
        assert any("one residual stream" in line for line in unsaid(framework, "siamese")), framework


def test_the_probes_read_each_stream():
    model = normlab.build_model("siamese", "nano", seed=0)
    batch = (torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9)))
    rows = {(r["layer"], r["site"], r["metric"]): r["value"] for r in Probes(model, batch).record(0)}
    assert rows[(0, "stream0", "rms")] == rows[(0, "stream1", "rms")]  # both the embedding at the start
    # after block 0: X was normalized (RMS about 1 with gains at 1) plus a small update; Y is the raw sum
    assert rows[(1, "stream0", "rms")] == pytest.approx(1.0, abs=0.2) and rows[(1, "stream1", "rms")] < 0.5
    assert not any(site == "hc" for _, site, _ in rows)  # no mixing: SiameseNorm's streams are not mixed
