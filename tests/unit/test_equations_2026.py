"""The 2026 residual forms against their papers' equations, by hand with the same weights (float64).

Keel (Chen & Wei 2026, arXiv 2601.19895): x_{l+1} = LN(alpha x_l + F_l(LN(x_l))), alpha = L, the number of
sublayers. SpanNorm (Wang et al. 2026, arXiv 2601.22580, eqs. 5-8 as read from a third-party adaptation): y = N(x +
Attn(x)); x' = N(x + FFN(y)), the first block's attention reading N(x). Attention Residuals (Kimi Team 2026, arXiv
2603.15031, eqs. 2-6): h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i over the embedding and the blocks' sums, written
below as the paper's lists of blocks and partial sums (its Fig. 2), not normlab's slots. Also: their parameter
counts, weight-decay groups and the layouts they refuse.
"""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.config.train import TrainConfig, apply_settings
from normlab.layout import PRESETS, LayoutError, parse_layout
from normlab.model import analytic_params, count_params
from normlab.train.optim import param_groups
from tests.reference import N, mha, swiglu

DT = torch.float64


def _randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Every norm gain off 1 and every pseudo-query off 0, so a missing or extra term cannot go unnoticed."""
    from tests.unit.test_equations import randomize_norms

    randomize_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("depth.query"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def A(b, x):
    return mha(b.attn, x, "")


def F(b, x):
    return swiglu(b.mlp, x)


def keel(b, x, layer, n_layers):  # x' = N(alpha x + F(N(x))), alpha = L = 2 n_layers sublayers, twice
    alpha = 2.0 * n_layers
    y = N(b.attn_norms.after_add, alpha * x + A(b, N(b.attn_norms.input, x)))
    return N(b.mlp_norms.after_add, alpha * y + F(b, N(b.mlp_norms.input, y)))


def spannorm(b, x, layer, n_layers):  # y = N(x + Attn(x)) (first block: Attn(N(x))); x' = N(x + FFN(y))
    a_in = N(b.attn_norms.input, x) if layer == 0 else x
    y = N(b.attn_norms.after_add, x + A(b, a_in))
    return N(b.mlp_norms.after_add, x + F(b, y))


# the presets whose equations this file checks (tests/unit/test_equations.py checks every other)
# siamese: two streams in and out of a block, checked by hand in tests/unit/test_siamese.py
EQUATIONS_2026 = {"keel": keel, "spannorm": spannorm, "attnres": None, "attnres-full": None, "siamese": None}


@pytest.mark.parametrize("name", ["keel", "spannorm"])
def test_block_matches_paper_equation(name):
    model = normlab.build_model(name, "nano", seed=0, n_layers=8, d_model=32, n_heads=2, n_kv_heads=1).double()
    _randomize(model)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=DT)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            expected = EQUATIONS_2026[name](block, x, i, 8)
            torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6, msg=f"{name} block {i}")


def test_keel_has_no_final_norm_and_its_alpha_is_the_number_of_sublayers():
    model = normlab.build_model("keel", "nano", seed=0, n_layers=5)
    assert model.resolved.alpha == 10.0 and not model.layout.final_norm
    assert parse_layout("keel,alpha=3.0").resolve(5).alpha == 3.0  # an explicit alpha overrides it


def test_spannorm_init_scales_the_output_projections_by_one_over_sqrt_depth():
    """Its variance-bounding scale as built: W_O and W_down drawn with std 0.02 / sqrt(L), the rest 0.02."""
    model = normlab.build_model("spannorm", "nano", seed=0, n_layers=8, d_model=64, n_heads=4)
    out = torch.cat([w.flatten() for b in model.blocks for w in (b.attn.o_proj.weight, b.mlp.down_proj.weight)])
    q = torch.cat([b.attn.q_proj.weight.flatten() for b in model.blocks])
    assert out.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)
    assert q.std().item() == pytest.approx(0.02, rel=0.03)


# --- Attention Residuals, written as the paper's lists (Fig. 2), independent of normlab's slots ---


def _read(depth, sources):
    """Eqs. 2-4: softmax over i of w . RMSNorm(v_i), the key norm's gain included; the weighted sum of the v_i."""
    w, gamma, eps = depth.query, depth.key_norm.weight, depth.key_norm.eps
    keys = [gamma * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) for v in sources]
    logits = torch.stack([(k * w).sum(-1) for k in keys])  # (m, B, T)
    weights = torch.softmax(logits, dim=0)
    return sum(weights[i].unsqueeze(-1) * v for i, v in enumerate(sources))


def attnres_logits(model, tokens, size):
    """Eq. 6 with blocks of ``size`` sublayers: block reps [b_0 = embedding, b_1, ...] and the current block's partial
    sum; the i-th sublayer of block n reads [b_0 .. b_{n-1}] when i = 1, else also b_n^{i-1}; f = F(N_A(h))."""
    done, partial, k = [model.embed.weight[tokens]], None, 0
    for b in model.blocks:
        for depth, norms, f in ((b.attn_depth, b.attn_norms, A), (b.mlp_depth, b.mlp_norms, F)):
            if k % size == 0 and partial is not None:  # a new block opens: the last one is complete
                done, partial = done + [partial], None
            h = _read(depth, done + ([partial] if partial is not None else []))
            out = f(b, N(norms.input, h))
            partial = out if partial is None else partial + out
            k += 1
    h = _read(model.final_depth, done + [partial])  # "the final output layer aggregates all N block representations"
    return N(model.final_norm, h) @ model.lm_head.weight.T


@pytest.mark.parametrize(
    ("layout", "n_layers", "size"),
    [
        ("attnres", 8, 2),  # the preset: 8 blocks of 16 sublayers' 2
        ("pre,attnres=2", 5, 5),  # 2 blocks of 5 sublayers: the second opens at layer 2's MLP
        ("pre,attnres=3", 4, 3),  # ceil(8 / 3) = 3: the last block holds the remaining 2
        ("attnres-full", 3, 1),  # every sublayer's output its own source (eqs. 1-4)
    ],
)
def test_attention_residual_model_matches_the_paper_by_hand(layout, n_layers, size):
    model = normlab.build_model(layout, "nano", seed=0, n_layers=n_layers).double()
    assert model.resolved.attn_res_size == size
    _randomize(model)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, attnres_logits(model, tokens, size), rtol=1e-6, atol=1e-6)


def test_attention_residuals_start_as_the_uniform_average_of_their_sources():
    """Sec. 5: pseudo-queries from 0, so every read is the plain mean at init (Full AttnRes: (1/l) sum_i v_i)."""
    model = normlab.build_model("attnres-full", "nano", seed=0, n_layers=2).double()
    assert all(p.abs().max() == 0 for n, p in model.named_parameters() if n.endswith("depth.query"))
    tokens = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens)
        b = model.blocks[1]
        for depth, m in ((b.attn_depth, 3), (b.mlp_depth, 4), (model.final_depth, 5)):
            assert depth.sources == m
            torch.testing.assert_close(depth.last_weights, torch.full_like(depth.last_weights, 1 / m))


def test_attention_residual_state_holds_the_embedding_then_the_block_sums():
    """hidden_states: slot 0 the embedding, slot n block n's sum of updates (the attn_update, mlp_update taps)."""
    model = normlab.build_model("pre,attnres=2", "nano", seed=0, n_layers=2).double()  # 2 blocks of 2 sublayers
    tokens = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    updates = []
    hooks = [
        getattr(b, name).register_forward_hook(lambda _m, _i, out: updates.append(out))
        for b in model.blocks
        for name in ("attn_update", "mlp_update")
    ]
    with torch.no_grad():
        last = model(tokens, return_hidden_states=True).hidden_states[-1].unflatten(-1, (3, 32))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(last[..., 0, :], model.embed.weight[tokens])
    torch.testing.assert_close(last[..., 1, :], updates[0] + updates[1])
    torch.testing.assert_close(last[..., 2, :], updates[2] + updates[3])


# --- parameters, weight decay, refusals ---


@pytest.mark.parametrize("n_layers", [1, 4])
def test_parameter_counts(n_layers):
    """Keel and SpanNorm add no parameter of their own (their norms are the sites'); Attention Residuals add a
    pseudo-query and a key-norm gain per sublayer and for the final read: 2 d (2 L + 1)."""
    d = 32

    def total(name):
        m = normlab.build_model(name, "nano", seed=0, n_layers=n_layers)
        assert count_params(m) == analytic_params(m.config, m.resolved), name
        return count_params(m).total

    assert total("keel") == total("a+c")
    assert total("spannorm") == total("post") + d  # the first block's attention input norm
    assert total("attnres") - total("pre") == 2 * d * (2 * n_layers + 1)
    assert total("attnres-full") == total("attnres")


def test_weight_decay_groups_of_the_new_parameters():
    """Pseudo-queries decay (they are weights, nn.Linear(d, 1) in the authors' code: toward the uniform start);
    the key norms' gains and Keel's and SpanNorm's norm gains do not (wd_exclude's norms)."""
    cfg = apply_settings(TrainConfig(), {"weight_decay": 0.1})
    for name in ("attnres", "keel", "spannorm"):
        model = normlab.build_model(name, "nano", seed=0)
        names = {id(p): n for n, p in model.named_parameters()}
        groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in param_groups(model, cfg)}
        assert set(groups) == {0.1, 0.0}
        queries = {n for n in names.values() if n.endswith("depth.query")}
        gains = {n for n in names.values() if "norm" in n}
        assert queries <= groups[0.1] and gains <= groups[0.0], name
        assert bool(queries) == (name == "attnres")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("post,attnres=8", "norm after the add"),
        ("pre,streams=4,attnres=8", "streams=4"),
        ("pre,alpha=keel,attnres=full", "skip scale alpha=keel"),
        ("pre,gpas,attnres=8", "gpas"),
        ("attn=A,mlp=AS,attnres=8", "normed input"),
        ("attn=C,mlp=CW,attnres=8", "block's input"),
        ("pre,attnres=0", "whole number of blocks"),
        ("pre,attnres=some", "whole number of blocks"),
        ("attn=CW,mlp=C", "'W' is not a attn site"),
        ("[0:1]attn=W", "'W' is not a attn site"),
        ("attn=A,mlp=ASW", "give one of them"),
        ("pre,streams=4,mlp=AW", "skip from the block's input"),
        ("pre,alpha=kell", "is not a number"),
    ],
)
def test_combinations_that_do_not_make_sense_are_refused_with_the_reason(text, match):
    with pytest.raises(LayoutError, match=match):
        parse_layout(text)


def test_the_whole_block_skip_is_an_mlp_site_in_the_data_too():
    from normlab.layout.sites import BlockLayout, LayerRange, LayerRule, SublayerSites

    span = SublayerSites(after_add=True, skip_block=True)
    with pytest.raises(LayoutError, match="MLP site only"):
        BlockLayout(attn=span)
    with pytest.raises(LayoutError, match="MLP site only"):
        LayerRule(LayerRange(0, 1), "attn", span)
    assert BlockLayout(mlp=span).mlp.skip_block


def test_string_forms_round_trip_and_undo():
    for name in EQUATIONS_2026:
        layout = PRESETS[name].layout
        assert parse_layout(layout.to_string()) == layout
    assert parse_layout("attnres,-attnres") == PRESETS["pre"].layout
    assert parse_layout("attnres,attnres=none") == PRESETS["pre"].layout
    assert parse_layout("pre,attnres=4").attn_res == 4


# --- the screen's verdicts ---


def test_screen_verdicts_name_what_carries_the_stream():
    """Keel and SpanNorm are judged by their C sites (tangential, as Post-LN), Attention Residuals on Pre-LN's sites
    stay unbounded in the weights (on Peri-LN's, bounded); each stream note says what the new path does."""
    from normlab.screen.wellposed import all_output_normalized, wellposedness

    def judged(text, n=8):
        return wellposedness(parse_layout(text).resolve(n))

    keel, span, attn = judged("keel"), judged("spannorm"), judged("attnres")
    assert keel["verdict"] == span["verdict"] == "degenerate (tangential)"
    assert "Keel's skip scale alpha = 2N" in keel["stream"] and "whole-block skip (W)" in span["stream"]
    assert attn["verdict"] == "ill-posed (unbounded)" and "8 blocks of 2 sublayers" in attn["stream"]
    assert "each sublayer's output its own source" in judged("attnres-full")["stream"]
    peri = parse_layout("peri,attnres=4").resolve(4)
    assert wellposedness(peri)["verdict"] == "well-posed" and not all_output_normalized(peri)


def test_the_screen_runs_on_the_wide_attention_residual_state():
    from normlab.config.commands import ScreenConfig
    from normlab.screen.screen import screen_layout

    small = ScreenConfig(
        model={"n_layers": 2, "d_model": 32, "n_heads": 2}, batch=1, seq_len=4, iters=2, stresses=(1.0, 4.0)
    )
    r = screen_layout("attnres", small)  # its first screen in a process pays torch.func's warm-up (test_screen's too)
    assert r["wellposedness"]["verdict"] == "ill-posed (unbounded)"
    assert all(len(row["mean_abs"]) == 3 and "thm4_bound" not in row for row in r["stresses"].values())


# --- export ---


@pytest.mark.parametrize("name", ["keel", "spannorm", "attnres"])
def test_native_export_refuses_with_the_reason(name):
    from normlab.hf.native import NativeExportError, _export_arch

    model = normlab.build_model(name, "nano", seed=0)
    what = {"keel": "Keel's skip scale", "spannorm": "whole-block skip", "attnres": "Attention Residuals"}[name]
    with pytest.raises(NativeExportError, match=f"{what}.*--arch normlab"):
        _export_arch(model, "llama")


def test_the_export_bundle_carries_the_depth_attention_module():
    """modeling_normlab.py (normlab's sources in one file, compiled when built) holds DepthAttention before the
    Block that uses it."""
    from normlab.hf.bundle import bundle_source

    text = bundle_source()
    assert text.index("class DepthAttention") < text.index("class Block(")


@pytest.mark.slow  # transformers' import and remote code (~10 s); the bundle test above covers the module's inclusion
def test_the_normlab_class_export_computes_attention_residuals(tmp_path):
    """The bundled modeling_normlab.py carries normlab.model.depth_attention: same logits, same greedy tokens."""
    transformers = pytest.importorskip("transformers")
    from normlab.hf.export import save_hf

    model = normlab.build_model("attnres", "nano", seed=0).eval()
    save_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    x = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits)
        ids = x
        for _ in range(3):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(hf.generate(x, max_new_tokens=3, do_sample=False), ids)  # with the KV cache


def test_completep_refuses_attention_residuals_and_mup_builds_them():
    with pytest.raises(LayoutError, match="Attention Residuals"):
        normlab.build_model("attnres", "nano", parametrization="completep", base_d_model=32, base_n_layers=1)
    model = normlab.build_model("attnres", "nano", parametrization="mup", base_d_model=16, d_model=32)
    assert all(p.abs().max() == 0 for n, p in model.named_parameters() if n.endswith("depth.query"))


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("keel", "Keel's skip scale"),
        ("spannorm", "SpanNorm's whole-block skip"),
        ("attnres", "Attention Residuals (softmax attention over depth)"),
    ],
)
def test_recommend_says_no_code_base_states_them_and_why(name, reason):
    from normlab.model.config import SIZES
    from normlab.recommend.frameworks.snippets import settings_for

    said = settings_for(name, SIZES["nano"])
    assert said["normlab"]["expressible"]
    for base in ("transformers", "OLMo-core", "torchtitan", "litgpt"):
        assert not said[base]["expressible"] and reason in said[base]["settings"], base
    if name == "keel":
        assert "scales the branch, not the skip" in said["OLMo-core"]["settings"]
