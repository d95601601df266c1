"""Mixture of experts (OLMoE's routing, Zhuo et al. Sec. 4.3): the sublayer against its formula,
the two dispatches agreeing, the auxiliary losses by hand, counts, and training with two layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import normlab
from normlab.diagnostics.probes import Probes
from normlab.errors import ConfigError
from normlab.model import analytic_params, count_params
from normlab.model.config import ModelConfig
from normlab.model.moe import MoE
from normlab.train import train
from normlab.train.mfu import flops_per_token
from tests.helpers import rows, small

CFG = ModelConfig(d_model=16, n_layers=1, n_heads=2, n_experts=4, moe_top_k=2, expert_d_ff=24)


def _moe(cfg: ModelConfig = CFG, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def by_hand(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum over the top-k experts of p_e * SwiGLU_e(x), token by token; and the weighted aux loss."""
    E, k = moe.n_experts, moe.top_k
    logits = x @ moe.router.weight.T
    p = logits.softmax(-1)
    out = torch.zeros_like(x)
    counts = torch.zeros(E)
    for t in range(x.shape[0]):
        top = p[t].argsort(descending=True)[:k]
        for e in top.tolist():
            w = moe.experts
            out[t] += p[t, e] * ((F.silu(x[t] @ w.gate_proj[e]) * (x[t] @ w.up_proj[e])) @ w.down_proj[e])
            counts[e] += 1
    f = counts / (x.shape[0] * k)
    lb = E * (f * p.mean(0)).sum()
    z = logits.logsumexp(-1).pow(2).mean()
    return out, moe.aux_coef * lb + moe.z_coef * z


@pytest.mark.parametrize("dispatch", ["loop", "sorted"])
def test_moe_equals_its_formula(dispatch):
    moe = _moe(CFG.with_(moe_dispatch=dispatch))
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    want, aux = by_hand(moe, x)
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-6)
    assert moe.aux.item() == pytest.approx(aux.item(), rel=1e-5)
    assert moe.load.sum().item() == pytest.approx(1.0) and len(moe.load) == 4


def test_sorted_and_loop_dispatch_agree_with_gradients():
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    a, b = _moe(CFG.with_(moe_dispatch="loop")), _moe(CFG.with_(moe_dispatch="sorted"))
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad((ya.pow(2).sum() + a.aux), [x, *a.parameters()])
    gb = torch.autograd.grad((yb.pow(2).sum() + b.aux), [x, *b.parameters()])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6)
    assert a.router.weight.grad is None and ga[1].abs().sum() > 0  # the router learns (through p_e and the aux loss)


def test_uniform_routing_gives_a_balance_loss_of_one():
    moe = _moe(CFG.with_(moe_aux_coef=1.0, moe_z_coef=0.0))
    with torch.no_grad():
        moe.router.weight.zero_()  # every expert equally likely: P_e = 1/E
    moe(torch.randn(8, 16))
    # ties go to the same k experts, so f is not uniform: L = E * sum f_e / E = sum f_e = 1 all the same
    assert moe.aux.item() == pytest.approx(1.0)


def test_shared_expert_is_added_for_every_token():
    cfg = CFG.with_(moe_shared_expert=True)
    moe = _moe(cfg)
    x = torch.randn(5, 16)
    routed, _ = by_hand(moe, x)
    torch.testing.assert_close(moe(x), routed + moe.shared(x), rtol=1e-5, atol=1e-6)


def test_counts_total_and_active():
    m = normlab.build_model("pre", "moe-micro", seed=0)
    c, a = count_params(m), analytic_params(m.config, m.resolved)
    assert c == a
    per_expert = 3 * 64 * 128
    assert c.total - c.active == 6 * (8 - 2) * per_expert
    dense_ffn = 6 * 2 * per_expert  # the k experts a token uses
    assert (
        flops_per_token(m, 32)
        == 6
        * (
            sum(
                p.numel()
                for n, p in m.named_parameters()
                if n.endswith(("proj.weight", "router.weight", "lm_head.weight"))
            )
            + dense_ffn
        )
        + 12 * 6 * 4 * 16 * 32
    )
    with torch.device("meta"):
        big = normlab.build_model("hybrid*", "zhuo-moe-1b-7b")
    c = count_params(big)
    assert 6.8e9 < c.total < 7.0e9 and 1.25e9 < c.active < 1.35e9  # Zhuo Table 6 / OLMoE: 6.9B total, 1.3B active


def test_config_errors():
    with pytest.raises(ConfigError, match="moe_top_k must lie in"):
        CFG.with_(moe_top_k=5)
    with pytest.raises(ConfigError, match="moe_dispatch: .fast. is not valid; valid: auto, sorted, loop"):
        CFG.with_(moe_dispatch="fast")
    with pytest.raises(ConfigError, match="SwiGLU"):
        CFG.with_(mlp="relu")


@pytest.mark.long
def test_moe_trains_with_pre_and_hybrid_star_with_routing_in_probes_and_metrics(corpus, tmp_path):
    for layout in ("pre", "hybrid*"):
        run = tmp_path / layout.replace("*", "star")
        s = train(small(corpus, run, size="moe-micro", layout=layout, steps=20, probe_every=10, eval_every=10))
        r = rows(run)
        assert s["status"] == "ok" and s["final_loss"] < s["initial_loss"] - 0.5
        assert all(0 < x["moe_aux_loss"] < 1 for x in r)
        probes = [p for p in (run / "probes.jsonl").read_text().splitlines()]
        assert any('"moe.expert7"' in p and '"load"' in p for p in probes)
        assert any('"router_entropy"' in p for p in probes)
    from normlab.diagnostics.run_report import make_report

    page = make_report([tmp_path / "pre", tmp_path / "hybridstar"], tmp_path / "report").read_text()
    assert "Expert load over training" in page and (tmp_path / "report" / "expert_load.png").is_file()


def test_probes_on_a_moe_model_skip_prop31_only():
    m = normlab.build_model("peri", "moe-micro", seed=0)
    x = torch.randint(0, 256, (2, 16))
    got = Probes(m, (x, x)).record(0)
    sites = {r["site"] for r in got}
    assert "prop31" not in sites and "moe" in sites and "stream" in sites
    loads = [r["value"] for r in got if r["site"].startswith("moe.expert") and r["layer"] == 0]
    assert len(loads) == 8 and sum(loads) == pytest.approx(1.0)


def test_export_keeps_a_moe_model_in_the_normlab_class_and_refuses_native(tmp_path):
    pytest.importorskip("transformers")
    from normlab.hf import from_hf, save_hf, save_native
    from normlab.hf.native import NativeExportError

    m = normlab.build_model("hybrid*", "moe-micro", seed=0)
    with pytest.raises(NativeExportError, match="mixture-of-experts model has no exact llama counterpart"):
        save_native(m, tmp_path / "n", "llama")
    save_hf(m, tmp_path / "h")
    x = torch.randint(0, 256, (1, 12))
    torch.testing.assert_close(from_hf(tmp_path / "h")(x).logits, m(x).logits)


def test_the_screen_stresses_the_experts_output_projections():
    from normlab.screen.forward import stressed

    m = normlab.build_model("pre", "moe-micro", seed=0, moe_shared_expert=True)
    out, all_ = stressed(m, 8.0, "output"), stressed(m, 8.0, "all")
    b, bo, ba = m.blocks[0].mlp, out.blocks[0].mlp, all_.blocks[0].mlp
    torch.testing.assert_close(bo.experts.down_proj, 8 * b.experts.down_proj)
    torch.testing.assert_close(bo.shared.down_proj.weight, 8 * b.shared.down_proj.weight)
    assert torch.equal(bo.experts.up_proj, b.experts.up_proj) and torch.equal(bo.router.weight, b.router.weight)
    torch.testing.assert_close(ba.experts.gate_proj, 8 * b.experts.gate_proj)
    torch.testing.assert_close(ba.router.weight, 8 * b.router.weight)
