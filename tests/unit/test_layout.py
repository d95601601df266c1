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
    NormSpec,
    Skip,
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
        block=BlockLayout(
            attn=SublayerSites(input=True, output=True),
            attn_inner=AttentionInnerSites(k=True, context=True),
            mlp=SublayerSites(input=True, skip_normed=True),
        ),
        rules=(
            LayerRule(LayerRange(-2, None), "mlp", SublayerSites(after_add=True)),
            LayerRule(LayerRange(None, 1 / 3), "attn", SublayerSites()),
        ),
        embed_norm=True,
        norm="layer",
        inner_span="full",
        residual=Skip(h=0.3, alpha=1.7),
        freeze_output_gamma=True,
        embed_scale=True,
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
    assert resolve(PRESETS["deepnorm"].layout, 6).alpha == pytest.approx(12**0.25)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("perii", "unknown layout preset 'perii'. Did you mean peri"),
        ("attn=AX,mlp=A", "'X' is not a attn site; valid letters are 'qkvcgsABCS'"),
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
        ("pre,norm.X=dyt", "'X' is not a norm site; valid: attn.A"),
        ("pre,norm.A=batch", "norm must be one of rms"),
        ("pre,gain.A=half", "gain must be one of gamma"),
        ("pre,alpha0.A=-1", "alpha0 must be a finite number > 0"),
        ("pre,alpha0.A=0.5", "site attn.A: alpha0 is DyT's or Derf's initial alpha, and this site holds norm=rms"),
        ("pre,norm.A=scale,gain.A=none", "site attn.A: norm=scale has no per-channel gain"),
        ("pre,norm.B=dyt", "attn.B, mlp.B, which no layer of this layout turns on (on: attn.A, mlp.A, final)"),
        ("attn=HA,mlp=A", "'H' is not a attn site"),
        ("attn=A,mlp=gA", "'g' is not a mlp site"),
        ("pre,alpha=adm", "'adm' is not a number"),
        ("olmo2,qk-rope", "qk-rope normalizes each head's rotated q and k; it needs inner=head"),
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
    for must in [
        "post",
        "pre",
        "peri",
        "peri-noemb",
        "peri-frozen",
        "b",
        "a+c",
        "olmo2",
        "peri+qk",
        "gemma2",
        "hybrid",
        "hybrid*",
        "qkvc-post",
        "pre-kc-pre",
        "pre-post",
        "post-pre",
        "mix-ln",
        "deepnorm",
        "none",
    ]:
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


def test_per_site_kinds_gains_and_alpha0_round_trip_in_any_token_order():
    """norm./gain./alpha0. name sites (A/B/C/H for both sublayers); the canonical form groups equal values."""
    text = "peri+qk,norm.B=dyt,alpha0.attn.B=0.9,alpha0.mlp.B=0.2,norm.q+k=l2,gain.final=centered"
    lay = parse_layout(text)
    assert lay.norm_at("attn.B") == NormSpec("dyt", "gamma", 0.9) and lay.norm_at("mlp.B").alpha0 == 0.2
    assert lay.norm_at("q").kind == lay.norm_at("k").kind == "l2" and lay.norm_at("attn.A") == NormSpec(
        "layer", "gamma"
    )
    assert lay.norm_at("final") == NormSpec("layer", "centered")
    assert parse_layout(lay.to_string()) == lay
    assert "norm.B=dyt" in lay.to_string() and "norm.q+k=l2" in lay.to_string()
    # a kind set after its alpha0 is the same layout; a later token overrides an earlier one per field
    assert parse_layout("peri,alpha0.B=0.3,norm.B=dyt") == parse_layout("peri,norm.B=dyt,alpha0.B=0.3")
    assert parse_layout("peri,norm.B=dyt,norm.B=rms").norm_at("mlp.B") == NormSpec("rms", "gamma")
    # an explicit site kind stays when the layout-wide kind changes after it
    assert parse_layout("peri,norm.B=rms,norm=dyt").norm_at("attn.B").kind == "rms"
    # the layout-wide gain applies to the kinds that have one, not to a ScaleNorm site
    assert parse_layout("peri,gain=centered,norm.B=scale").norm_at("attn.B") == NormSpec("scale", "gamma")


def test_new_sites_round_trip_and_resolve():
    """H (MLP hidden norm), g (gate), s (head scale), qk-rope and alpha=admin, per layer too."""
    for text in (
        "attn=gsAB,mlp=AH,final,norm=layer",
        "pre,qk,qk-rope,gain.q+k=none",
        "post,alpha=admin",
        "pre,[0:1]attn=gA,[-1:]mlp=AH,norm.H=dyt",
    ):
        lay = parse_layout(text)
        lay.resolve(3)
        assert parse_layout(lay.to_string()) == lay, text
    blocks = parse_layout("pre,[0:1]attn=gA,[-1:]mlp=AH").resolve(3).blocks
    assert [b.attn_inner.gate for b in blocks] == [True, False, False]
    assert [b.mlp.hidden for b in blocks] == [False, False, True]
    assert "mlp.H" in parse_layout("pre,[-1:]mlp=AH").sites_on()


# every layout option, as a key and a value: the grammar's KEY=VALUE tokens and its on/off tokens
LAYOUT_OPTIONS_GIVEN = [
    ("alpha", "admin"),
    ("alpha", "deepnorm"),
    ("alpha", "0.5"),
    ("h", "0.5"),
    ("h", "1"),
    ("norm", "dyt"),
    ("norm", "layer"),
    ("init", "deepnorm"),
    ("init", "none"),
    ("inner", "full"),
    ("gain", "centered"),
    ("norm.B", "dyt"),
    ("norm.q+k", "l2"),
    ("gain.q+k", "none"),
    ("alpha0.mlp.A", "0.3"),
    ("attn", "AC"),
    ("mlp", "B"),
    ("[0:1]mlp", "A"),
    ("emb", "true"),
    ("final", "false"),
    ("qk", "true"),
    ("lns", "true"),
    ("h-scalar", "true"),
    ("h-channel", "true"),
    ("frozen-out", "true"),
    ("emb-scale", "true"),
    ("qk-rope", "true"),
]


@pytest.mark.parametrize("key,value", LAYOUT_OPTIONS_GIVEN, ids=[f"{k}={v}" for k, v in LAYOUT_OPTIONS_GIVEN])
def test_a_layout_option_has_one_answer_through_every_entry_point(key, value, tmp_path):
    """--layout 'peri,TOKEN', --set layout.KEY=VALUE, a TOML [layout] table and a sweep grid axis layout.KEY all
    read the option with the layout grammar: one Layout, one label (issue 37: layout.alpha=admin was refused)."""
    from normlab.cli import build_parser
    from normlab.config.overrides import train_config as train_config_from_args
    from normlab.experiments.sweep import SweepConfig

    base = "peri,norm=dyt" if key.startswith("alpha0") else "peri,qk" if ".q+k" in key else "peri"
    token = {"true": key, "false": "-final"}.get(value, f"{key}={value}")  # the string form, written by hand
    parse = build_parser().parse_args
    by_string = train_config_from_args(parse(["train", "--layout", f"{base},{token}"])).model.layout
    by_set = train_config_from_args(parse(["train", "--layout", base, "--set", f"layout.{key}={value}"])).model.layout
    toml = tmp_path / "run.toml"
    literal = value if value in ("true", "false") or value.replace(".", "").isdigit() else f'"{value}"'
    toml.write_text(f'[model]\nlayout = "{base}"\n[layout]\n"{key}" = {literal}\n')
    by_toml = train_config_from_args(parse(["train", "--config", str(toml)])).model.layout
    grid = {"layout": [base], f"layout.{key}": [{"true": True, "false": False}.get(value, value)]}
    spec = SweepConfig(name="one", base={"size": "nano"}, grid=grid).expand()[0]
    by_grid = spec.train_config("unused").model.layout
    assert by_string == by_set == by_toml == by_grid
    assert by_set.name == by_toml.name == f"{base},{token}"


def test_residual_stream_tokens_round_trip_and_refuse_what_they_replace():
    lay = parse_layout("peri,skip-scalar,gpas,h-scalar")
    assert (lay.skip_learned, lay.gpas) == (True, True) and parse_layout(lay.to_string()) == lay
    assert parse_layout("pre-gpas,-gpas") == PRESETS["pre"].layout
    hc = parse_layout("attn=AB,mlp=AH,final,streams=8,mix=mhc,lns")
    assert (hc.streams, hc.stream_mix) == (8, "mhc") and parse_layout(hc.to_string()) == hc
    from normlab.layout.spec import edit_layout

    assert edit_layout("pre", {"streams": 4, "mix": "mhc"}) == PRESETS["pre-mhc"].layout
    for text, words in (
        ("post,streams=4", r"norm after the add \(C\)"),
        ("hybrid,streams=2", "skip from the normed"),
        ("deepnorm,attn=A,mlp=A,streams=2", "skip scale alpha"),
        ("pre-gpas,streams=4", "gpas"),
        ("pre-lambda,streams=4", "skip-scalar"),
        ("pre,mix=mhc", "give streams=N"),
        ("pre,streams=four", "whole number"),
        ("pre,streams=17", "from 1 to 16"),
        ("pre,streams=4,mix=sinkhorn", "mix must be one of hc, mhc"),
    ):
        with pytest.raises(LayoutError, match=words):
            parse_layout(text)
