"""Layouts as data: string form round trips, rules, and errors that name the fix."""

import pytest

import normlab
from normlab.layout import (
    PRESETS,
    AttentionInnerSites,
    BlockLayout,
    LayerRange,
    LayerRule,
    Layout,
    LayoutError,
    SublayerSites,
    parse_layout,
    resolve,
)


@pytest.mark.parametrize("name", list(PRESETS), ids=list(PRESETS))
def test_string_form_round_trips(name):
    layout = PRESETS[name].layout
    text = layout.to_string()
    assert parse_layout(text) == layout
    assert parse_layout(text).to_string() == text
    assert parse_layout(name) == layout and parse_layout(name).name == name


def test_round_trip_of_a_custom_layout():
    custom = Layout(
        block=BlockLayout(attn=SublayerSites(input=True, output=True), attn_inner=AttentionInnerSites(k=True, context=True),
                          mlp=SublayerSites(input=True, skip_normed=True)),
        rules=(LayerRule(LayerRange(-2, None), "mlp", SublayerSites(after_add=True)),
               LayerRule(LayerRange(None, 1 / 3), "attn", SublayerSites())),
        embed_norm=True, norm="layer", inner_span="full", h=0.3, alpha=1.7, freeze_output_gamma=True, embed_scale=True,
        init="megatron",
    )
    text = custom.to_string()
    assert parse_layout(text) == custom
    assert text.startswith("attn=kcAB,mlp=AS,[-2:]mlp=C,[:0.3333333333333333]attn=kc,emb")


def test_modifiers_on_a_preset():
    lay = parse_layout("peri,h=0.5,-emb,norm=layer")
    assert lay.h == 0.5 and not lay.embed_norm and lay.norm == "layer" and lay.final_norm
    assert lay.name is None and lay.label == lay.to_string()
    qk = parse_layout("hybrid*,qk")  # QK-norm is already part of QKV: unchanged
    assert qk == PRESETS["hybrid*"].layout
    pre_qk = parse_layout("pre,qk")
    assert pre_qk.block.attn_inner == AttentionInnerSites(q=True, k=True)
    assert parse_layout("attn=A,mlp=A,[:25%]attn=C") == parse_layout("attn=A,mlp=A,[:0.25]attn=C")


def test_mix_ln_resolves_with_floor():
    for n_layers, n_post in [(4, 1), (8, 2), (10, 2), (3, 0)]:
        blocks = resolve(PRESETS["mix-ln"].layout, n_layers).blocks
        assert [b.attn.after_add for b in blocks] == [True] * n_post + [False] * (n_layers - n_post)
        assert [b.mlp.input for b in blocks] == [False] * n_post + [True] * (n_layers - n_post)


def test_hybrid_star_first_block_only():
    blocks = PRESETS["hybrid*"].layout.resolve(4).blocks
    assert blocks[0].attn == SublayerSites(input=True) and blocks[0].mlp == SublayerSites(input=True)
    assert all(b.mlp == SublayerSites(input=True, skip_normed=True) and b.attn == SublayerSites() for b in blocks[1:])
    assert all(b.attn_inner == AttentionInnerSites(q=True, k=True, v=True) for b in blocks)


def test_deepnorm_alpha():
    assert resolve(PRESETS["deepnorm"].layout, 6).alpha == pytest.approx(12 ** 0.25)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("perii", "unknown layout preset 'perii'. Did you mean peri"),
        ("attn=AX,mlp=A", "'X' is not a attn site; valid letters are 'qkvcABCS'"),
        ("attn=AA,mlp=A", "site 'A' is given twice"),
        ("attn=A,mlp=q", "'q' is not a mlp site"),
        ("attn=S,mlp=A", "needs the input norm (A) too"),
        ("pre,h=-1", "h must be a finite number > 0"),
        ("pre,h=abc", "'abc' is not a number"),
        ("pre,alpha=-1", "alpha must be a finite number > 0"),
        ("pre,norm=batch", "norm must be one of rms, layer"),
        ("pre,frozen-out", "has no B site"),
        ("pre,colour=red", "unknown layout token 'colour=red'"),
        ("pre,,final", "empty token"),
        ("", "empty layout"),
        ("attn=A,[0:x]mlp=C", "'x' is not a layer index"),
        ("attn=A,[0:1]ffn=C", "a layer rule is [a:b]attn=LETTERS"),
    ],
)
def test_bad_layout_strings_are_explained(text, needle):
    with pytest.raises(LayoutError) as err:
        parse_layout(text)
    assert needle in str(err.value)


def test_overlapping_rules_conflict():
    lay = parse_layout("attn=A,mlp=A,[0:2]mlp=C,[1:3]mlp=B")
    with pytest.raises(LayoutError, match="layer 1 mlp: claimed by both rule \\[0:2\\] and rule \\[1:3\\]"):
        resolve(lay, 4)
    # attn and mlp rules on the same layers do not conflict
    resolve(parse_layout("attn=A,mlp=A,[0:2]mlp=C,[0:2]attn=C"), 4)


def test_rule_outside_the_model():
    with pytest.raises(LayoutError, match="outside the model's 4 layers"):
        resolve(parse_layout("attn=A,mlp=A,[2:9]mlp=C"), 4)
    with pytest.raises(LayoutError, match="must lie in \\[0, 1\\]"):
        parse_layout("attn=A,mlp=A,[:150%]mlp=C")


def test_build_model_accepts_all_layout_forms():
    obj = PRESETS["peri"].layout
    for form in ("peri", "attn=AB,mlp=AB,emb,final", obj):
        assert normlab.build_model(form, "nano").layout == obj
    with pytest.raises(LayoutError, match="not int"):
        normlab.build_model(3, "nano")


def test_layouts_lists_presets():
    names = normlab.layouts()
    for must in ["post", "pre", "peri", "peri-noemb", "peri-frozen", "b", "a+c", "olmo2", "peri+qk", "gemma2",
                 "hybrid", "hybrid*", "qkvc-post", "pre-kc-pre", "pre-post", "post-pre", "mix-ln", "deepnorm", "none"]:
        assert must in names
    assert len([n for n in names if n.endswith(("-post", "-pre")) and n not in ("pre-post", "post-pre")]) == 24


def test_a_fixed_zero_step_is_refused_and_a_learned_one_round_trips():
    """h=0 removes every update unless h is learned from 0 (ReZero); the flags round-trip in either order."""
    with pytest.raises(LayoutError, match="h-scalar"):
        parse_layout("pre,h=0").resolve(2)
    for text in ("attn=-,mlp=-,h=0,h-scalar", "attn=-,mlp=-,h-scalar,h=0", "pre,h=0.1,h-channel", "pre,lns"):
        layout = parse_layout(text)
        layout.resolve(2)
        assert parse_layout(layout.to_string()) == layout
    assert parse_layout("rezero") == parse_layout("attn=-,mlp=-,h=0,h-scalar")
