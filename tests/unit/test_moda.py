"""Mixture-of-depths attention (normlab.model.moda): one softmax over the causal sequence keys and the earlier layers'
keys at the query's own position, written out here token by token as the authors' naive reference does; the first
layer is plain attention; a whole model reads what its earlier layers wrote; no parameters are added."""

from __future__ import annotations

import json

import pytest
import torch

import normlab
from normlab.cli import main
from normlab.hf.export import exact_native
from normlab.layout import as_layout
from normlab.model.attention import Attention
from normlab.model.build import count_params
from normlab.model.config import ModelConfig
from normlab.model.moda import DepthKVAttention, depth_flops

F64 = torch.float64
TOL = 1e3 * torch.finfo(F64).eps  # float64 sums of a few dozen products and one softmax


def _layer(cfg: ModelConfig, layer_idx: int, seed: int = 0) -> Attention:
    lay = as_layout("pre")
    torch.manual_seed(seed)
    attn = Attention(cfg, lay.resolve(cfg.n_layers).blocks[0].attn_inner, lay, layer_idx=layer_idx).to(F64)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return attn


# GQA (4 query heads, 2 key-value heads); learned positions: no RoPE, whose rotation drops out of depth logits anyway
CFG = dict(d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, position="learned", max_seq_len=16)


def _joint_softmax_by_hand(q, k, v, depth) -> torch.Tensor:
    """(B, T, H d): for each query token t of head h, one softmax over its key head's k_j (j <= t) and every depth
    key at t, the same weights on the values; q (B, H, T, d), k, v and each depth pair (B, Hkv, T, d)."""
    b, heads, t, hd = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(b, t, heads, hd, dtype=q.dtype)
    for bi in range(b):
        for h in range(heads):
            g = h // group
            for ti in range(t):
                keys = torch.cat([k[bi, g, : ti + 1], torch.stack([kd[bi, g, ti] for kd, _ in depth])])
                vals = torch.cat([v[bi, g, : ti + 1], torch.stack([vd[bi, g, ti] for _, vd in depth])])
                w = torch.softmax(keys @ q[bi, h, ti] / hd**0.5, dim=0)
                out[bi, ti, h] = w @ vals
    return out.reshape(b, t, heads * hd)


def test_depth_attention_is_one_softmax_over_sequence_and_depth_keys():
    """o_t = sum_{j<=t} p_j V_j + sum_{i<l} p'_i V_i,t, (p, p') one softmax of q_t . [K_j ; K_i,t] / sqrt(d), query
    head h reading key head h // 2; then W_O (Zhu et al. 2026 Sec. 2.2, Fig. 1)."""
    cfg = ModelConfig(**CFG, attention="moda")
    a = _layer(cfg, layer_idx=2)
    assert isinstance(a, DepthKVAttention)
    b, t, hd = 2, 5, 4
    depth = [(torch.randn(b, 2, t, hd, dtype=F64), torch.randn(b, 2, t, hd, dtype=F64)) for _ in range(2)]
    a.depth.entries = list(depth)  # what layers 0 and 1 wrote in this forward
    x = torch.randn(b, t, 16, dtype=F64)
    q = (x @ a.q_proj.weight.T).view(b, t, 4, hd).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(b, t, 2, hd).transpose(1, 2)
    v = (x @ a.v_proj.weight.T).view(b, t, 2, hd).transpose(1, 2)
    want = _joint_softmax_by_hand(q, k, v, depth) @ a.o_proj.weight.T
    torch.testing.assert_close(a(x), want, rtol=TOL, atol=TOL)
    assert a.depth.entries == []  # the last layer empties the store: nothing held past the forward


def test_first_layer_is_plain_attention_and_no_parameters_are_added():
    mha, moda = _layer(ModelConfig(**CFG), 0), _layer(ModelConfig(**CFG, attention="moda"), 0)
    x = torch.randn(2, 6, 16, dtype=F64)
    torch.testing.assert_close(moda(x), mha(x), rtol=TOL, atol=TOL)
    assert count_params(normlab.build_model("pre", "nano", attention="moda")) == count_params(
        normlab.build_model("pre", "nano")
    )


def test_a_model_reads_its_earlier_layers_keys():
    """Same weights, MoDA against MHA: layer 0 agrees, later layers (which see depth keys) do not; and the store
    the layers share is one object, empty after the forward."""
    torch.manual_seed(0)
    moda = normlab.build_model("post", "nano", attention="moda", seed=0).to(F64)
    mha = normlab.build_model("post", "nano", seed=0).to(F64)
    mha.load_state_dict(moda.state_dict())
    tokens = torch.randint(0, 256, (2, 12))
    assert not torch.allclose(moda(tokens).logits, mha(tokens).logits)
    stores = {id(blk.attn.depth) for blk in moda.blocks}
    assert len(stores) == 1 and moda.blocks[0].attn.depth.entries == []


def test_depth_flops_and_refusals():
    cfg = ModelConfig(d_model=64, n_layers=6, n_heads=4, attention="moda")
    # sum over layers l = 0..5 of l depth logits and l depth values, 2 d FLOPs each, per head and token
    assert depth_flops(cfg, 64) == sum(4 * layer * 4 * 16 * 64 for layer in range(6)) == 245_760
    assert depth_flops(ModelConfig(d_model=64, n_layers=6, n_heads=4), 64) == 0
    with pytest.raises(normlab.errors.LayoutError, match="attention=moda"):
        normlab.build_model("pre,softmax=sink", "nano", attention="moda")
    assert exact_native(normlab.build_model("pre", "nano", attention="moda")) == []


def test_post_moda_trains_from_the_cli(corpus, tmp_path):
    """The documented post-moda config (Post-LN, attention=moda), a few steps with the probes on."""
    out = tmp_path / "run"
    args = ["train", "--layout", "post", "--size", "nano", "--data", str(corpus), "--steps", "4", "--seq-len", "32"]
    args += ["--batch-size", "4", "--out", str(out), "--set", "eval_every=0", "--set", "probe_every=2"]
    assert main([*args, "--set", "model.attention=moda"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < 6.0  # finite, near a uniform byte's ln 256 = 5.55 after 4 steps


@pytest.mark.parametrize(("kind", "layout"), [("moda", "post"), ("mla", "qwen3")])
def test_the_normlab_class_exports_moda_and_mla_and_loads_with_its_own_code(kind, layout, tmp_path):
    """No native class computes them (refused above); `export` writes the normlab class, whose bundled code (one
    file, torch and transformers only) computes the same logits."""
    transformers = pytest.importorskip("transformers")
    from normlab.hf.export import export

    model = normlab.build_model(layout, "nano", attention=kind, seed=0)
    out, arch, _ = export(model, tmp_path / kind)
    assert arch == "normlab"
    assert "from normlab" not in (out / "modeling_normlab.py").read_text()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    tokens = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(hf(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_ffn_depth_keys_are_the_ffn_input_projected():
    """moda_ffn_kv (Table 3 row 4): layer 1 reads layer 0's attention k, v and W_K^F u, W_V^F u, u the input layer
    0's MLP read, in one softmax with its own sequence keys; the count grows by 2 d (H_k d) per layer but the last."""
    opts = dict(attention="moda", position="learned", n_kv_heads=1, moda_ffn_kv=True)
    model = normlab.build_model("post", "nano", seed=0, **opts).to(F64)
    seen = {}

    def keep(name):
        return lambda m, a, o: seen.__setitem__(name, o.detach())

    b0, b1 = model.blocks[0], model.blocks[1]
    hooks = [b0.attn.k.register_forward_hook(keep("k0")), b0.attn.v.register_forward_hook(keep("v0"))]
    hooks += [b1.attn.q.register_forward_hook(keep("q1")), b1.attn.k.register_forward_hook(keep("k1"))]
    hooks += [b1.attn.v.register_forward_hook(keep("v1")), b1.attn.context.register_forward_hook(keep("c1"))]
    hooks.append(b0.mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("u0", a[0].detach())))
    model(torch.randint(0, 256, (2, 7)))
    for h in hooks:
        h.remove()
    a0, hd = b0.attn, b0.attn.head_dim
    u = seen["u0"]
    kf = (u @ a0.ffn_k.weight.T).view(2, 7, 1, hd).transpose(1, 2)
    vf = (u @ a0.ffn_v.weight.T).view(2, 7, 1, hd).transpose(1, 2)
    want = _joint_softmax_by_hand(seen["q1"], seen["k1"], seen["v1"], [(seen["k0"], seen["v0"]), (kf, vf)])
    torch.testing.assert_close(seen["c1"], want, rtol=TOL, atol=TOL)
    assert b1.attn.ffn_k is None  # the last layer's FFN has no later reader
    plain = normlab.build_model("post", "nano", **{**opts, "moda_ffn_kv": False})
    grown = count_params(model).total - count_params(plain).total
    assert grown == (2 - 1) * 2 * 32 * 1 * 16 == 1024
    assert count_params(model) == normlab.model.analytic_params(model.config, model.resolved)
