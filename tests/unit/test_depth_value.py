"""Depth-Attention (normlab.model.depth_value, arXiv 2606.05014's abstract): each layer's value first mixed, at its
own position, over the earlier layers' stored (mixed) values and its own, by a softmax of the group's mean query
against their keys; the sequence attention then reads the mixed values. Written out here token by token."""

from __future__ import annotations

import json

import pytest
import torch

import normlab
from normlab.cli import main
from normlab.errors import LayoutError
from normlab.hf.export import exact_native
from normlab.layout import as_layout
from normlab.model.attention import Attention
from normlab.model.build import count_params
from normlab.model.config import ModelConfig
from normlab.model.depth_value import DepthValueAttention, depth_value_flops
from normlab.model.describe import describe

F64 = torch.float64
TOL = 1e3 * torch.finfo(F64).eps  # float64 sums of a few dozen products and two softmaxes per layer
# RoPE's cos/sin tables are float32 (normlab.model.rope): R_t^T R_t = I to float32 rounding, so the rotation cancels
# from a depth logit to a few float32 epsilons of |q||k| s (order 1 here), and so the weights and mixed values
ROPE_TOL = 16 * torch.finfo(torch.float32).eps

# GQA (4 query heads, 2 key-value heads); learned positions: no RoPE (the RoPE test below has it)
CFG = dict(d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, position="learned", max_seq_len=16)


def _layer(cfg: ModelConfig, layer_idx: int) -> Attention:
    lay = as_layout("pre")
    torch.manual_seed(0)
    attn = Attention(cfg, lay.resolve(cfg.n_layers).blocks[0].attn_inner, lay, layer_idx=layer_idx).to(F64)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return attn


def _mix_by_hand(qd, k, v, earlier):
    """v~ (B, Hkv, T, d): per key-value head g and token t, softmax over [k_0,t .. k_{l-1},t, k_t] of the group's
    mean query qd (B, H, T, d) / sqrt(d), on [v~_0,t .. v~_{l-1},t, v_t]."""
    b, heads, t, hd = qd.shape
    hkv = k.shape[1]
    group = heads // hkv
    out = torch.zeros_like(v)
    for bi in range(b):
        for g in range(hkv):
            for ti in range(t):
                qbar = sum(qd[bi, g * group + i, ti] for i in range(group)) / group
                keys = torch.stack([kj[bi, g, ti] for kj, _ in earlier] + [k[bi, g, ti]])
                vals = torch.stack([vj[bi, g, ti] for _, vj in earlier] + [v[bi, g, ti]])
                out[bi, g, ti] = torch.softmax(keys @ qbar / hd**0.5, dim=0) @ vals
    return out


def _causal_by_hand(q, k, v):
    """(B, T, H d): softmax over j <= t of q_h,t . k_g,j / sqrt(d) on v_g,j, query head h reading key head g."""
    b, heads, t, hd = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(b, t, heads, hd, dtype=q.dtype)
    for bi in range(b):
        for h in range(heads):
            for ti in range(t):
                w = torch.softmax(k[bi, h // group, : ti + 1] @ q[bi, h, ti] / hd**0.5, dim=0)
                out[bi, ti, h] = w @ v[bi, h // group, : ti + 1]
    return out.reshape(b, t, heads * hd)


def test_value_is_mixed_over_depth_then_attended_over_the_sequence():
    """Layer 2 with two earlier entries: v~ = sum_j softmax_j(q^g . k_j / sqrt(d)) v~_j over j = 0, 1 and itself,
    q^g the mean of the group's two query heads; then causal attention with v~; then W_O. What it stores for the
    later layers is (k, v~)."""
    a = _layer(ModelConfig(**CFG, attention="depth_value"), layer_idx=2)
    assert isinstance(a, DepthValueAttention)
    b, t, hd = 2, 5, 4
    earlier = [(torch.randn(b, 2, t, hd, dtype=F64), torch.randn(b, 2, t, hd, dtype=F64)) for _ in range(2)]
    a.depth.entries = list(earlier)  # what layers 0 and 1 wrote in this forward
    x = torch.randn(b, t, 16, dtype=F64)
    q = (x @ a.q_proj.weight.T).view(b, t, 4, hd).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(b, t, 2, hd).transpose(1, 2)
    v = (x @ a.v_proj.weight.T).view(b, t, 2, hd).transpose(1, 2)
    mixed = _mix_by_hand(q, k, v, earlier)
    want = _causal_by_hand(q, k, mixed) @ a.o_proj.weight.T
    torch.testing.assert_close(a(x), want, rtol=TOL, atol=TOL)
    assert len(a.depth.entries) == 3  # layer 2 of 4 wrote its keys and mixed values for layer 3
    torch.testing.assert_close(a.depth.entries[2][0], k, rtol=TOL, atol=TOL)
    torch.testing.assert_close(a.depth.entries[2][1], mixed, rtol=TOL, atol=TOL)
    assert not torch.allclose(mixed, v)


def test_a_model_mixes_the_stored_values_and_rope_drops_out_of_the_depth_logits():
    """A 3-layer RoPE model with one key-value head for two query heads, written out from its weights: the depth
    logits from the unrotated q and k (at one position RoPE's rotation cancels), layer 2 reading layer 1's mixed
    value (not its v), the sequence attention from the rotated q and k; each layer's context tap must match."""
    model = normlab.build_model("pre", "nano", n_layers=3, n_kv_heads=1, attention="depth_value", seed=0).to(F64)
    inputs, contexts = {}, {}
    for i, blk in enumerate(model.blocks):
        blk.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        blk.attn.context.register_forward_hook(lambda m, a, o, i=i: contexts.__setitem__(i, o))
    model(torch.randint(0, 256, (2, 7)))
    assert len({id(blk.attn.depth) for blk in model.blocks}) == 1 and model.blocks[0].attn.depth.entries == []
    stored = []
    for i, blk in enumerate(model.blocks):
        a, x = blk.attn, inputs[i]
        b, t, _ = x.shape
        q = (x @ a.q_proj.weight.T).view(b, t, 2, 16).transpose(1, 2)
        k = (x @ a.k_proj.weight.T).view(b, t, 1, 16).transpose(1, 2)
        v = (x @ a.v_proj.weight.T).view(b, t, 1, 16).transpose(1, 2)
        mixed = _mix_by_hand(q, k, v, stored)  # unrotated q, k
        stored.append((k, mixed))
        want = _causal_by_hand(a._rotate(q, None), a._rotate(k, None), mixed)
        torch.testing.assert_close(contexts[i], want, rtol=ROPE_TOL, atol=ROPE_TOL)


def test_first_layer_is_plain_attention_and_no_parameters_are_added():
    mha, dv = _layer(ModelConfig(**CFG), 0), _layer(ModelConfig(**CFG, attention="depth_value"), 0)
    x = torch.randn(2, 6, 16, dtype=F64)
    torch.testing.assert_close(dv(x), mha(x), rtol=TOL, atol=TOL)
    for opts in ({}, {"n_kv_heads": 1}):
        with_dv = normlab.build_model("pre", "micro", attention="depth_value", **opts)
        assert count_params(with_dv) == count_params(normlab.build_model("pre", "micro", **opts))


def test_a_later_token_does_not_change_an_earlier_tokens_output():
    model = normlab.build_model("post", "nano", n_layers=3, attention="depth_value", seed=0).to(F64)
    x = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 6] = (x[0, 6] + 1) % 256
    with torch.no_grad():
        lx, ly = model(x).logits, model(y).logits
    torch.testing.assert_close(lx[:, :6], ly[:, :6], rtol=0, atol=0)
    assert not torch.allclose(lx[:, 6:], ly[:, 6:])


@pytest.mark.parametrize("layout", ["pre", "post", "peri", "pre,softmax=sink"])
def test_every_layers_value_projection_learns_under_each_layout(layout):
    """The layer's own value is one of its depth entries: every W_V gets a gradient; the model differs from MHA
    with the same weights (the sequence softmax is the layout's, a sink too)."""
    model = normlab.build_model(layout, "nano", n_layers=3, attention="depth_value", seed=0)
    mha = normlab.build_model(layout, "nano", n_layers=3, seed=0)
    mha.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(tokens, targets=tokens)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(blk.attn.v_proj.weight.grad.abs().sum() > 0 for blk in model.blocks)
    assert not torch.allclose(out.logits, mha(tokens).logits)


def test_activation_checkpointing_keeps_the_gradients():
    """The layers share the forward's depth entries, so blocks are not recomputed (a recompute would read an
    emptied store): the gradients with checkpointing on equal those without."""
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for ckpt in (False, True):
        model = normlab.build_model("pre", "nano", n_layers=3, attention="depth_value", seed=0).to(F64).train()
        model.activation_checkpointing = ckpt
        model(tokens, targets=tokens).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=TOL, atol=TOL)


def test_depth_flops_and_refusals():
    cfg = ModelConfig(d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, attention="depth_value")
    # layers 1..5: l + 1 logits and l + 1 value terms, 2 d each, per key-value head, plus the group mean (H - H_k) d
    per_token = sum(4 * (layer + 1) * 2 * 16 + 2 * 16 for layer in range(1, 6))
    assert depth_value_flops(cfg, 64) == per_token * 64 == 174_080
    assert depth_value_flops(ModelConfig(d_model=64, n_layers=6, n_heads=4), 64) == 0
    with pytest.raises(LayoutError, match="attention=depth_value"):
        normlab.build_model("pre-gate", "nano", attention="depth_value")
    assert exact_native(normlab.build_model("pre", "nano", attention="depth_value")) == []
    assert "attention: Depth-Attention" in describe("post", "nano", attention="depth_value")  # `normlab show`


def test_the_normlab_class_exports_it_and_loads_with_its_own_code(tmp_path):
    """No native class computes it; `export` writes the normlab class, whose bundled code computes the same logits."""
    transformers = pytest.importorskip("transformers")
    from normlab.hf.export import export
    from normlab.hf.native import NativeExportError

    model = normlab.build_model("post", "nano", attention="depth_value", seed=0)
    with pytest.raises(NativeExportError, match="attention=depth_value has no llama counterpart"):
        export(normlab.build_model("pre", "nano", attention="depth_value"), tmp_path / "llama", arch="llama")
    assert not (tmp_path / "llama").exists()  # refused before anything is written
    out, arch, _ = export(model, tmp_path / "dv")
    assert arch == "normlab"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    tokens = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(hf(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_post_depth_value_trains_from_the_cli(corpus, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--layout", "post", "--size", "nano", "--data", str(corpus), "--steps", "4", "--seq-len", "32"]
    args += ["--batch-size", "4", "--out", str(out), "--set", "eval_every=0", "--set", "probe_every=2"]
    assert main([*args, "--set", "model.attention=depth_value"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < 6.0  # finite, near a uniform byte's ln 256 = 5.55 after 4 steps
