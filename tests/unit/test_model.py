"""Model behaviour: causality, GQA, hidden states, capture points, configuration errors."""

import pytest
import torch

import normlab
from normlab.errors import ConfigError
from normlab.model import ModelConfig


@pytest.mark.parametrize("name", ["pre", "peri", "hybrid*", "olmo2", "post"])
def test_causal(name):
    """Changing token t never changes logits before t."""
    model = normlab.build_model(name, "nano", seed=0).double()
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_gqa_with_all_kv_heads_is_mha():
    mha = normlab.build_model("pre", "nano", seed=0)
    gqa = normlab.build_model("pre", "nano", seed=0, n_kv_heads=2)  # n_heads = 2
    tokens = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(mha(tokens).logits, gqa(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["pre", "hybrid"])
def test_gqa_equals_mha_with_repeated_kv_weights(name):
    """GQA with 2 KV heads for 4 query heads = MHA whose K/V heads are copies per group."""
    gqa = normlab.build_model(name, "nano", seed=0, d_model=32, n_heads=4, n_kv_heads=2).double()
    mha = normlab.build_model(name, "nano", seed=1, d_model=32, n_heads=4).double()
    sd = gqa.state_dict()
    hd = 8
    for key, value in list(sd.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            sd[key] = value.view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(gqa(tokens).logits, mha(tokens).logits)


def test_hidden_states():
    model = normlab.build_model("peri", "nano", seed=0)
    tokens = torch.randint(0, 256, (2, 6))
    out = model(tokens, return_hidden_states=True)
    assert len(out.hidden_states) == model.config.n_layers + 1
    assert all(h.shape == (2, 6, 32) for h in out.hidden_states)
    torch.testing.assert_close(model.lm_head(model.final_norm(out.hidden_states[-1])), out.logits)
    torch.testing.assert_close(model.embed_norm(model.embed(tokens)), out.hidden_states[0])
    assert model(tokens).hidden_states is None


def test_capture_points_see_the_residual_update():
    """A hook on blocks.i.attn_update sees exactly what is added to the stream."""
    model = normlab.build_model("peri,h=0.5", "nano", seed=0)
    seen = {}
    names = [
        "blocks.1.attn_update",
        "blocks.1.resid_mid",
        "blocks.1.mlp_update",
        "blocks.1.resid_post",
        "blocks.0.resid_post",
        "blocks.1.attn.q",
        "blocks.1.attn_norms.output",
    ]
    mods = dict(model.named_modules())
    for n in names:
        mods[n].register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o))
    model(torch.randint(0, 256, (1, 5)))
    torch.testing.assert_close(seen["blocks.1.resid_mid"], seen["blocks.0.resid_post"] + seen["blocks.1.attn_update"])
    torch.testing.assert_close(seen["blocks.1.resid_post"], seen["blocks.1.resid_mid"] + seen["blocks.1.mlp_update"])
    torch.testing.assert_close(seen["blocks.1.attn_update"], 0.5 * seen["blocks.1.attn_norms.output"])
    assert seen["blocks.1.attn.q"].shape == (1, 2, 5, 16)


def test_module_paths_identical_across_layouts():
    paths = {
        n: [k for k, _ in normlab.build_model(n, "nano").named_modules()]
        for n in ("post", "pre", "peri", "hybrid*", "none")
    }
    first = next(iter(paths.values()))
    assert all(p == first for p in paths.values())


@pytest.mark.parametrize("mlp", ["gelu", "relu"])
def test_two_layer_mlps(mlp):
    model = normlab.build_model("pre", "nano", mlp=mlp)
    assert model.blocks[0].mlp.gate_proj is None
    x = torch.randn(1, 3, 32)
    m = model.blocks[0].mlp
    act = torch.nn.functional.gelu if mlp == "gelu" else torch.relu
    torch.testing.assert_close(m(x), act(x @ m.up_proj.weight.T) @ m.down_proj.weight.T)


def test_tied_embeddings():
    model = normlab.build_model("pre", "nano", tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight


def test_frozen_output_gamma():
    model = normlab.build_model("peri-frozen", "nano")
    for b in model.blocks:
        for norms in (b.attn_norms, b.mlp_norms):
            assert not norms.output.weight.requires_grad and torch.all(norms.output.weight == 1)
            assert norms.input.weight.requires_grad


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (dict(d_model=30, n_heads=4), "does not divide d_model=30"),
        (dict(n_heads=4, n_kv_heads=3), "must divide n_heads=4"),
        (dict(mlp="geglu"), "valid: swiglu, geglu-tanh, gelu, gelu-tanh, relu"),
        (dict(n_layerz=3), "did you mean n_layers"),
        (dict(init="kaiming"), "valid: normal, xavier"),
        (dict(norm_eps=0.0), "norm_eps must be > 0"),
    ],
)
def test_bad_config_is_explained(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        normlab.build_model("pre", "nano", **overrides)


def test_unknown_size():
    with pytest.raises(ConfigError, match="Did you mean tiny"):
        normlab.build_model("pre", "tinny")


def test_sequence_too_long():
    model = normlab.build_model("pre", ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_learned_positions_and_tanh_gelu_by_hand():
    """GPT-2's pieces: y0 = E[tok] + P[pos] (no RoPE), and GELU's tanh form
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    import math

    model = normlab.build_model("pre,norm=layer", "nano", seed=0, position="learned", mlp="gelu-tanh", linear_bias=True)
    tokens = torch.randint(0, 256, (2, 9))
    y0 = model.embed_tokens(tokens)
    torch.testing.assert_close(y0, model.embed.weight[tokens] + model.pos_embed.weight[:9][None])
    assert model.blocks[0].attn.rotary is None
    mlp = model.blocks[0].mlp
    x = torch.randn(3, model.config.d_model)
    u = mlp.up_proj(x)
    gelu = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    torch.testing.assert_close(mlp(x), mlp.down_proj(gelu))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(ConfigError, match="valid: rope, learned"):
        normlab.build_model("pre", "nano", position="alibi")


def test_gemma_softcaps_and_attention_scale_by_hand():
    """Gemma 2: logits = c tanh(z / c); a huge attention cap is the plain (SDPA) path; attn_scale s
    scales scores by s^-1/2 (equal to head_dim: the default)."""
    tokens = torch.randint(0, 256, (2, 10))
    plain = normlab.build_model("gemma2", "nano", seed=0, mlp="geglu-tanh").eval()
    capped = normlab.build_model("gemma2", "nano", seed=0, mlp="geglu-tanh", logit_softcap=0.3).eval()
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        z = plain(tokens).logits
        torch.testing.assert_close(capped(tokens).logits, 0.3 * torch.tanh(z / 0.3))
        wide = normlab.build_model("gemma2", "nano", seed=0, mlp="geglu-tanh", attn_softcap=1e6).eval()
        wide.load_state_dict(plain.state_dict())
        torch.testing.assert_close(wide(tokens).logits, z, atol=1e-5, rtol=1e-5)  # manual path = SDPA path
        same = normlab.build_model(
            "gemma2", "nano", seed=0, mlp="geglu-tanh", attn_scale=float(plain.config.head_dim)
        ).eval()
        same.load_state_dict(plain.state_dict())
        torch.testing.assert_close(same(tokens).logits, z, atol=1e-6, rtol=1e-6)
        other = normlab.build_model("gemma2", "nano", seed=0, mlp="geglu-tanh", attn_scale=1.0).eval()
        other.load_state_dict(plain.state_dict())
        assert not torch.allclose(other(tokens).logits, z, atol=1e-4)


def test_the_mlp_hidden_norm_is_refused_for_moe_experts():
    """H sits inside a dense MLP; a MoE layer has one per expert, which is not built: refused by name. So is nGPT
    on grouped key/value heads (s_qk scales q and k alike); both are said from the data alone too
    (`ModelConfig.layout_problem`, what recommend reads), nothing built."""
    from normlab.layout import LayoutError, as_layout
    from normlab.model.config import SIZES

    with pytest.raises(LayoutError, match="hidden norm \\(H\\) is not built for MoE experts"):
        normlab.build_model("pre,mlp=AH", "moe-micro")
    with pytest.raises(LayoutError, match="ngpt is built for nGPT's model"):
        normlab.build_model("ngpt", "nano", n_heads=2, n_kv_heads=1)
    moe, gqa = SIZES["moe-micro"], SIZES["nano"].with_(n_heads=2, n_kv_heads=1)
    assert "hidden norm (H)" in moe.layout_problem(as_layout("pre,mlp=AH").resolve(moe.n_layers))
    assert "one key per query head" in gqa.layout_problem(as_layout("ngpt").resolve(gqa.n_layers))
    assert moe.layout_problem(as_layout("pre").resolve(moe.n_layers)) is None
    assert gqa.with_(n_kv_heads=2).layout_problem(as_layout("ngpt").resolve(gqa.n_layers)) is None


@pytest.mark.parametrize("name", list(normlab.PRESETS))
def test_every_preset_wires_every_parameter_into_the_loss(name):
    """One forward and backward per preset: every parameter (gates, head scales, omegas, steps, every norm
    kind's) gets a finite gradient, so none is built and then left out of the forward."""
    model = normlab.build_model(name, "nano", seed=0, n_layers=2)
    for m in model.modules():  # a TaperNorm mid-taper: both its branches in the forward (g = 1 or 0 drops one)
        if hasattr(m, "set_gate"):
            m.set_gate(0.5)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_probes_see_each_stream_and_each_mixing_of_a_hyper_connection_model():
    """n = 4 streams: stream{k} rows equal stream k's own statistics; each connection's res row/column sums are
    recorded (1 for mHC's doubly stochastic res, rows exactly); the composite gain of an mHC model stays 1."""
    from normlab.diagnostics.probes import Probes

    model = normlab.build_model("pre-mhc", "nano", seed=0)
    x = torch.randint(0, 256, (2, 8))
    rows = {(r["layer"], r["site"], r["metric"]): r["value"] for r in Probes(model, (x, x)).record(0)}
    with torch.no_grad():
        hidden = model(x, return_hidden_states=True).hidden_states
    for layer in (0, 2):
        for k in range(4):
            part = hidden[layer].unflatten(-1, (4, 32))[..., k, :]
            assert rows[(layer, f"stream{k}", "max_abs")] == pytest.approx(part.abs().max().item(), rel=1e-5)
    assert rows[(1, "mlp_hc", "res_row_sum_max")] == pytest.approx(1.0, abs=1e-5)
    assert rows[(1, "hc", "composite_gain_forward")] == pytest.approx(1.0, abs=1e-4)
    assert (0, "attn_hc", "pre_mean") in rows and (0, "stream", "rms") in rows
