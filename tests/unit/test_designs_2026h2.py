"""Issue 67's norms by hand: GatedNorm (marin's grug MoE recipe) and TaperNorm (Kanavalau et al. 2026, arXiv
2602.10408), each against its formula written here in float64 with the module's own weights; their counts, weight
decay, schedule, calibration, fold-away and refusals."""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.config.train import TrainConfig
from normlab.hf.native import NativeExportError, to_native
from normlab.layout.norm_kinds import NORM_FACTS
from normlab.model import analytic_params, count_params
from normlab.model.norms import GatedNorm, TaperNorm, taper_gate
from normlab.model.taper_fold import TaperFoldError, fold_problems, fold_tapered
from normlab.recommend.frameworks.snippets import unsaid
from normlab.train.optim import param_groups
from normlab.train.taper import TaperHook

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _randomized(m: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.mark.parametrize("d, rank", [(12, 128), (16, 5)])
def test_gatednorm_is_rmsnorm_times_marins_low_rank_gate_in_float64(d, rank):
    norm = _randomized(GatedNorm(d, 1e-12, rank=rank).double())
    assert norm.rank == rank  # marin's 128 at every width: wider than d = 12 here, as marin builds it
    x = torch.randn(3, 5, d, dtype=torch.float64)
    y = norm.weight * x / _rms(x, 1e-12)
    hidden = y @ norm.gate_down.T
    want = y * torch.sigmoid((hidden * torch.sigmoid(hidden)) @ norm.gate_up.T)  # SiLU(h) = h sigmoid(h)
    # a d-term sum per entry (the mean, the two products): rounding grows at most with d
    torch.testing.assert_close(norm(x), want, rtol=8 * d * EPS64, atol=8 * d * EPS64)
    # the gate reads the normed y: GatedNorm(c x) = GatedNorm(x) as RMSNorm (eps 1e-12: its share is ~1e-12)
    torch.testing.assert_close(norm(1e3 * x), norm(x), rtol=1e-9, atol=1e-9)


def test_gatednorm_starts_as_marins_init_gate_near_one_half():
    norm = GatedNorm(64, 1e-6, rank=16)
    for w in (norm.gate_down, norm.gate_up):
        assert w.abs().max() <= 3 * GatedNorm.GATE_STD  # truncated at 3 std
        assert 0.5 * GatedNorm.GATE_STD < w.std() < 1.5 * GatedNorm.GATE_STD
    x = torch.randn(4, 64)
    ratio = norm(x) / (norm.weight * x / _rms(x, 1e-6))
    assert ((ratio - 0.5).abs() < 0.01).all()  # |logit| <= 16 * (0.06 * |SiLU|) ~ 1e-3 at std 0.02


def test_gatednorm_presets_are_marins_input_and_sandwich_forms():
    pre = normlab.build_model("pre-gatednorm", "nano", seed=0, vocab_size=64)
    sandwich = normlab.build_model("sandwich-gatednorm", "nano", seed=0, vocab_size=64)
    for model in (pre, sandwich):
        assert isinstance(model.embed_norm, GatedNorm) and isinstance(model.final_norm, GatedNorm)
        for block in model.blocks:
            assert isinstance(block.attn_norms.input, GatedNorm) and isinstance(block.mlp_norms.input, GatedNorm)
            assert not isinstance(block.attn_norms.output, GatedNorm)  # marin's sandwich: the MLP path only
    assert all(not isinstance(b.mlp_norms.output, GatedNorm) for b in pre.blocks)
    assert all(isinstance(b.mlp_norms.output, GatedNorm) for b in sandwich.blocks)


@pytest.mark.parametrize("rank", [128, 3])
def test_gatednorm_parameters_counted_at_every_rank(rank):
    model = normlab.build_model("sandwich-gatednorm", "nano", seed=0, vocab_size=64, gated_norm_rank=rank)
    d, r = model.config.d_model, rank  # no cap at the width (marin's code)
    n_norms = 2 + 3 * model.config.n_layers  # emb, final; per block attn.A, mlp.A, mlp.B
    gates = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_down", "gate_up")))
    assert gates == n_norms * 2 * d * r
    assert count_params(model) == analytic_params(model.config, model.resolved)
    assert NORM_FACTS["gatednorm"].param_count(d, rank=rank) == d + 2 * d * r


def test_gatednorms_matrices_decay_and_its_gain_does_not():
    model = normlab.build_model("pre-gatednorm", "nano", seed=0, vocab_size=64)
    decay, no_decay = ({id(p) for p in g["params"]} for g in param_groups(model, TrainConfig.of(weight_decay=0.1))[:2])
    for m in model.modules():
        if isinstance(m, GatedNorm):
            assert id(m.gate_down) in decay and id(m.gate_up) in decay
            assert id(m.weight) in no_decay


def test_gatednorm_and_tapernorm_are_refused_by_the_stock_classes_and_the_frameworks():
    for layout in ("pre-gatednorm", "pre-taper"):
        model = normlab.build_model(layout, "nano", seed=0, vocab_size=64)
        with pytest.raises(NativeExportError, match="GatedNorm" if "gated" in layout else "TaperNorm"):
            to_native(model, "llama")
    assert any("GatedNorm" in why for why in unsaid("torchtitan", "pre-gatednorm"))
    assert any("TaperNorm" in why for why in unsaid("litgpt", "pre-taper"))


@pytest.mark.parametrize("g", [1.0, 0.3, 0.0])
def test_tapernorm_blends_rmsnorm_and_its_fixed_scaling_in_float64(g):
    d = 10
    norm = _randomized(TaperNorm(d, 1e-6).double())
    norm.coeff.fill_(0.7)
    norm.set_gate(g)
    x = torch.randn(2, 7, d, dtype=torch.float64)
    want = g * norm.weight * x / _rms(x, 1e-6) + (1 - g) * 0.7 * norm.taper_weight * x
    torch.testing.assert_close(norm.eval()(x), want, rtol=8 * d * EPS64, atol=8 * d * EPS64)


def test_tapernorm_calibrates_c_as_the_least_squares_fit_from_its_running_means():
    d = 6
    norm = _randomized(TaperNorm(d, 1e-6).double()).train()
    a, b = torch.randn(4, d, dtype=torch.float64), 3 * torch.randn(4, d, dtype=torch.float64)

    def means(x):
        sq = ((x * norm.weight) ** 2).sum(-1)
        return (sq / _rms(x, 1e-6).squeeze(-1)).mean(), sq.mean()

    norm(a)
    norm(b)
    (na, da), (nb, db) = means(a), means(b)
    num, den = TaperNorm.EMA * na + (1 - TaperNorm.EMA) * nb, TaperNorm.EMA * da + (1 - TaperNorm.EMA) * db
    norm.calibrate()
    assert norm.coeff.item() == pytest.approx((num / den).item(), rel=64 * EPS64)
    assert torch.equal(norm.taper_weight, norm.weight)
    before = norm.ema_num.clone()
    norm(b)  # calibrated: the statistics stop
    assert torch.equal(norm.ema_num, before)


def test_the_taper_gate_is_one_then_a_half_cosine_then_zero():
    steps = 100
    s, e = TaperNorm.START * steps, TaperNorm.END * steps
    assert taper_gate(0, steps, TaperNorm.START, TaperNorm.END) == 1.0
    assert taper_gate(int(s), steps, TaperNorm.START, TaperNorm.END) == 1.0
    mid = (s + e) / 2
    assert taper_gate(int(mid), steps, TaperNorm.START, TaperNorm.END) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * (int(mid) - s) / (e - s)))
    )
    assert taper_gate(int(e), steps, TaperNorm.START, TaperNorm.END) == 0.0


def test_the_taper_hook_sets_every_gate_from_the_step_and_calibrates_once_at_the_start():
    model = normlab.build_model("pre-taper", "nano", seed=0, vocab_size=64)
    hook = TaperHook.for_model(model, steps=20)
    assert hook is not None and len(hook.norms) == 2 * model.config.n_layers  # the final norm stays RMSNorm
    assert TaperHook.for_model(normlab.build_model("pre", "nano", seed=0, vocab_size=64), 20) is None
    model.train()
    model(torch.randint(0, 64, (2, 8)))  # statistics while the gate is 1
    hook.pre_step(5)
    assert all(float(n.gate) == 1.0 and not bool(n.calibrated) for n in hook.norms)
    hook.pre_step(10)
    assert all(0.0 < float(n.gate) < 1.0 and bool(n.calibrated) for n in hook.norms)
    assert all(float(n.coeff) != 1.0 for n in hook.norms)
    hook.pre_step(15)
    assert all(float(n.gate) == 0.0 for n in hook.norms)


def _tapered(layout: str = "pre-taper") -> torch.nn.Module:
    model = normlab.build_model(layout, "nano", seed=0, vocab_size=64).eval()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, TaperNorm):
            m.set_gate(0.0)
            m.coeff.fill_(0.5 + torch.rand(1, generator=g).item())
            with torch.no_grad():
                m.taper_weight.copy_(0.5 + torch.rand(m.taper_weight.shape, generator=g))
    return model


def test_a_tapered_model_folds_into_its_projections_with_the_same_logits():
    model = _tapered()
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before = model(x).logits
        assert fold_tapered(model) == 2 * model.config.n_layers
        after = model(x).logits
    assert not any(isinstance(m, TaperNorm) for m in model.modules())
    # float32: each folded weight is one rounding from W diag(c gamma~); the logits pass two layers of d-term sums
    d = model.config.d_model
    scale = before.abs().max().item()
    torch.testing.assert_close(after, before, rtol=0, atol=4 * d * model.config.n_layers * EPS32 * scale)


def test_the_fold_refuses_where_it_would_not_be_exact_and_changes_nothing():
    early = _tapered()
    next(m for m in early.modules() if isinstance(m, TaperNorm)).set_gate(0.5)
    with pytest.raises(TaperFoldError, match="gate is 0.5"):
        fold_tapered(early)
    assert sum(isinstance(m, TaperNorm) for m in early.modules()) == 2 * early.config.n_layers
    peri = _tapered("peri,norm=taper")  # output (B), embedding and final TaperNorms: read by the add or the head
    problems = fold_problems(peri)
    assert any("output" in p and "not an input norm" in p for p in problems)
    assert any(p.startswith("final_norm") for p in problems) and any(p.startswith("embed_norm") for p in problems)
    skip = _tapered("hybrid*,norm=taper")
    assert any("skip reads the normed input" in p for p in fold_problems(skip))


def test_the_new_norms_are_default_candidates_after_issue_56s_and_buildable_for_a_grouped_query_model(tmp_path):
    """Issue 67's norms join recommend's defaults after issue 56's forms and before hyper-connections (a small budget
    keeps its answer; the cheap screen's order within a family is the order given), and a Llama-shaped model (grouped
    key/value heads) can take each of them."""
    import json

    from normlab.config.commands import RECOMMEND_CANDIDATES, RecommendConfig
    from normlab.recommend.planning import plan
    from normlab.recommend.planning.inputs import choose_candidates
    from normlab.recommend.planning.shape import read_user_model
    from tests.unit.test_recommend import LLAMA

    new = ["pre-gatednorm", "sandwich-gatednorm", "pre-taper"]
    at = RECOMMEND_CANDIDATES.index("attnres")
    assert list(RECOMMEND_CANDIDATES[at + 1 : at + 4]) == new
    order, _ = plan.cheap_order(list(RECOMMEND_CANDIDATES), "pre")
    assert order[-6:] == [*new, "siamese", "pre-hc", "pre-mhc"]
    llama = {k: v for k, v in LLAMA.items() if k not in ("tie_word_embeddings", "torch_dtype")}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    names, _, unfit = choose_candidates(RecommendConfig(), read_user_model(str(tmp_path / "config.json")))
    assert all(n in names and n not in unfit for n in new)


def test_a_tapering_model_follows_the_blend_at_every_site():
    """Peri-LN with QK-norm, every norm a TaperNorm mid-taper (g = 0.4, c and gamma~ off their starts): each block
    equals x + T(F(T(x))) with T the blend written out in tests/reference.py."""
    from tests.unit.test_equations import assert_blocks_follow, peri_with

    model = normlab.build_model("peri+qk,norm=taper", "nano", seed=0, n_kv_heads=1, d_model=32, n_heads=2).double()
    g = torch.Generator().manual_seed(2)
    for m in model.modules():
        if isinstance(m, TaperNorm):
            m.set_gate(0.4)
            m.coeff.fill_(0.8)
            with torch.no_grad():
                m.taper_weight.copy_(1 + 0.3 * torch.randn(m.taper_weight.shape, generator=g, dtype=torch.float64))
    assert_blocks_follow(model, peri_with("qk"))
