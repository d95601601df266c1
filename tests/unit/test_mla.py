"""Multi-head latent attention (normlab.model.mla): DeepSeek-V2's eqs. 9-19 written out here with the module's weights,
its reduction to multi-head attention, the query/key learning-rate groups, the refusals, and a short training run."""

from __future__ import annotations

import json

import pytest
import torch

import normlab
from normlab.cli import main
from normlab.config.train import TrainConfig
from normlab.errors import LayoutError
from normlab.hf.export import exact_native
from normlab.layout import as_layout
from normlab.model.attention import Attention
from normlab.model.config import ModelConfig
from normlab.model.mla import LatentAttention
from normlab.train.optim import param_groups

F64 = torch.float64
# float64 sums of a few dozen products and one softmax: a few hundred ulps at most
TOL = 1e3 * torch.finfo(F64).eps


def _layer(cfg: ModelConfig, layout: str) -> Attention:
    lay = as_layout(layout)
    block = lay.resolve(cfg.n_layers).blocks[0]
    torch.manual_seed(0)
    attn = Attention(cfg, block.attn_inner, lay, layer_idx=0).to(F64)
    with torch.no_grad():
        for p in attn.parameters():  # gains away from 1 so that a dropped gain shows
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0))
    return attn


def _rms(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gain


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split RoPE over x's last dimension at positions 0..T-1 (x: (..., T, r)), angles in float64."""
    t, r = x.shape[-2], x.shape[-1]
    inv = theta ** -(torch.arange(0, r, 2, dtype=F64) / r)
    ang = torch.arange(t, dtype=F64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : r // 2], x[..., r // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _exact_rope_tables(attn: LatentAttention) -> None:
    """The module's (float32) RoPE tables replaced by float64 ones, so the comparison is at float64's precision."""
    rot = attn.rotary
    r = rot.head_dim
    inv = rot.theta ** -(torch.arange(0, r, 2, dtype=F64) / r)
    ang = torch.arange(rot.max_seq_len, dtype=F64)[:, None] * inv[None]
    rot.cos, rot.sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def test_mla_equals_deepseek_v2_eqs_9_to_19_with_qk_norm():
    """q and k latents, decoupled RoPE, latent norms (Sec. 3.1.2), per-head QK RMSNorm before RoPE (qwen3's q, k
    sites), causal softmax at 1/sqrt(d_h + d_h^R), W^O: each written here from the module's own weights."""
    cfg = ModelConfig(
        d_model=16, n_layers=1, n_heads=2, attention="mla", kv_lora_rank=6, q_lora_rank=5, qk_rope_head_dim=4,
        qk_nope_head_dim=6, v_head_dim=3, max_seq_len=16,
    )  # fmt: skip
    a = _layer(cfg, "qwen3")
    assert isinstance(a, LatentAttention)
    _exact_rope_tables(a)
    b, t, h, nope, r = 2, 7, 2, 6, 4
    x = torch.randn(b, t, 16, dtype=F64)
    eps = cfg.norm_eps
    c_q = _rms(x @ a.q_down.weight.T, a.q_latent_norm.weight, eps)  # eq. 12 + latent norm
    c_kv = _rms(x @ a.kv_down.weight.T, a.kv_latent_norm.weight, eps)  # eq. 9 + latent norm
    q_c = (c_q @ a.q_proj.weight.T).view(b, t, h, nope)  # eq. 13
    q_r = (c_q @ a.q_rope.weight.T).view(b, t, h, r)  # eq. 14 (before RoPE)
    k_c = (c_kv @ a.k_proj.weight.T).view(b, t, h, nope)  # eq. 10
    v = (c_kv @ a.v_proj.weight.T).view(b, t, h, 3)  # eq. 11
    k_r = (x @ a.k_rope.weight.T).view(b, t, 1, r).expand(b, t, h, r)  # eq. 15 (before RoPE), shared by heads
    q = _rms(torch.cat([q_c, q_r], -1), a.q_norm.weight, eps).transpose(1, 2)  # eq. 16, QK-norm per head
    k = _rms(torch.cat([k_c, k_r], -1), a.k_norm.weight, eps).transpose(1, 2)  # eq. 17
    q = torch.cat([q[..., :nope], _rope(q[..., nope:], cfg.rope_theta)], -1)
    k = torch.cat([k[..., :nope], _rope(k[..., nope:], cfg.rope_theta)], -1)
    scores = q @ k.transpose(-2, -1) / (nope + r) ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = torch.softmax(scores, -1) @ v.transpose(1, 2)  # eq. 18
    want = o.transpose(1, 2).reshape(b, t, h * 3) @ a.o_proj.weight.T  # eq. 19
    got = a(x)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_full_rank_mla_without_rope_part_or_latent_norm_is_multi_head_attention():
    """d_c = n_h d_h, W^DKV = I, no query latent, d_h^R = 0, no latent norms: W^K = W^UK, W^V = W^UV, and MLA
    computes MHA with the same W_Q, W_K, W_V, W_O (no RoPE in either: learned positions)."""
    base = dict(d_model=16, n_layers=1, n_heads=4, position="learned", max_seq_len=16)
    mha = _layer(ModelConfig(**base), "pre")
    mla = _layer(ModelConfig(**base, attention="mla", kv_lora_rank=16, mla_latent_norm=False), "pre")
    with torch.no_grad():
        mla.kv_down.weight.copy_(torch.eye(16, dtype=F64))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(mla, name).weight.copy_(getattr(mha, name).weight)
    x = torch.randn(3, 9, 16, dtype=F64)
    torch.testing.assert_close(mla(x), mha(x), rtol=TOL, atol=TOL)
    # and a latent below full rank is not MHA with these weights (the test above can fail)
    low = _layer(ModelConfig(**base, attention="mla", kv_lora_rank=8, mla_latent_norm=False), "pre")
    assert not torch.allclose(low(x), mha(x))


def _named_groups(model, cfg) -> dict[float, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[float, set[str]] = {}
    for g in param_groups(model, cfg):
        out.setdefault(g.get("lr_ratio", 1.0), set()).update(names[id(p)] for p in g["params"])
    return out


def test_query_and_key_projections_get_their_own_learning_rates():
    """q_lr_mult: W^DQ, W^UQ, W^QR of every layer; k_lr_mult: W^UK, W^KR; W^DKV, W^UV and the rest at 1."""
    model = normlab.build_model(
        "qwen3", "nano", attention="mla", q_lora_rank=8, qk_rope_head_dim=4, q_lr_mult=0.5, k_lr_mult=2.0
    )
    groups = _named_groups(model, TrainConfig.of(weight_decay=0.1))
    n = model.config.n_layers
    assert groups[0.5] == {f"blocks.{i}.attn.{w}.weight" for i in range(n) for w in ("q_down", "q_proj", "q_rope")}
    assert groups[2.0] == {f"blocks.{i}.attn.{w}.weight" for i in range(n) for w in ("k_proj", "k_rope")}
    assert "blocks.0.attn.kv_down.weight" in groups[1.0] and "blocks.0.attn.v_proj.weight" in groups[1.0]
    # MHA: q_proj and k_proj; at 1 and 1 the groups are as without the setting
    mha = normlab.build_model("pre", "nano", q_lr_mult=3.0)
    assert _named_groups(mha, TrainConfig.of())[3.0] == {f"blocks.{i}.attn.q_proj.weight" for i in range(n)}
    assert set(_named_groups(normlab.build_model("pre", "nano"), TrainConfig.of())) == {1.0}
    # under Muon the query/key matrices are Muon's: its groups carry the same multipliers
    from normlab.train.optim import make_optimizer

    opt = make_optimizer(model, TrainConfig.of(optimizer="muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {g["lr_ratio"]: {names[id(p)] for p in g["params"]} for g in opt.muon.param_groups}
    assert muon[0.5] == groups[0.5] and muon[2.0] == groups[2.0]


def test_mla_refuses_what_it_does_not_build_and_native_export():
    with pytest.raises(LayoutError, match="attention=mla"):
        normlab.build_model("pre-gate", "nano", attention="mla")
    assert "llama" in exact_native(normlab.build_model("pre", "nano"))
    assert exact_native(normlab.build_model("pre", "nano", attention="mla")) == []


def test_mla_qk_config_trains_from_the_cli(corpus, tmp_path):
    """The documented mla-qk config: Qwen 3's QK-normed Pre-LN with attention=mla, a few steps."""
    out = tmp_path / "run"
    args = ["train", "--layout", "qwen3", "--size", "nano", "--data", str(corpus), "--steps", "4"]
    args += ["--seq-len", "32", "--batch-size", "4", "--out", str(out), "--set", "eval_every=0"]
    args += ["--set", "model.attention=mla", "--set", "model.kv_lora_rank=16", "--set", "model.qk_rope_head_dim=4"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < 6.0  # finite and below a uniform byte's ln 256 = 5.55 plus slack


def test_mla_as_transformers_deepseek_v3_gives_the_same_logits():
    """transformers' own DeepseekV3ForCausalLM with normlab's weights (every one placed), with and without a query
    latent, gains perturbed from 1; float32 logits within float32 rounding of the sums (as tests/frameworks)."""
    pytest.importorskip("transformers")
    from normlab.hf.deepseek import deepseek_v3_problem, to_deepseek_v3

    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    for q_rank in (None, 8):
        model = normlab.build_model(
            "pre", "nano", attention="mla", kv_lora_rank=12, q_lora_rank=q_rank, qk_rope_head_dim=4,
            qk_nope_head_dim=6, v_head_dim=5, seed=0,
        )  # fmt: skip
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        hf = to_deepseek_v3(model)
        torch.testing.assert_close(hf(tokens).logits, model(tokens).logits, atol=1e-5, rtol=1e-5)
    qk = normlab.build_model("qwen3", "nano", attention="mla", qk_rope_head_dim=4)
    assert "layout" in str(deepseek_v3_problem(qk))
    eps = normlab.build_model("pre", "nano", attention="mla", qk_rope_head_dim=4, norm_eps=1e-5)
    assert "norm_eps" in str(deepseek_v3_problem(eps))


def test_parameter_counts_analytic_equal_measured():
    """`normlab show`'s analytic count (no model built) equals the built model's, across MLA's options; and one
    layer by hand: d 32, 2 heads, d_c 12, d_c' 8, d_h 6, d_h^R 4, v 5, QK-norm (qwen3's q, k sites on d_h + d_h^R)."""
    from normlab.model import analytic_params, count_params
    from normlab.model.params import analytic_matrices
    from normlab.train.optim import muon_matrices

    shape = dict(attention="mla", kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5)
    for layout, extra in (
        ("pre", {}),
        ("qwen3", {"q_lora_rank": 8}),
        ("pre", {"mla_latent_norm": False, "qkv_bias": True}),
        ("peri", {"linear_bias": True, "q_lora_rank": 8}),
    ):
        m = normlab.build_model(layout, "nano", **shape, **extra)
        assert count_params(m) == analytic_params(m.config, m.resolved), (layout, extra)
        assert analytic_matrices(m.config, m.resolved) == sum(p.numel() for p in muon_matrices(m))
    m = normlab.build_model("qwen3", "nano", **shape, q_lora_rank=8)
    d, h = 32, 2
    by_hand = d * 8 + 8 + 8 * h * (6 + 4) + d * 12 + 12 + 12 * h * (6 + 5) + d * 4 + h * 5 * d + 2 * (6 + 4)
    assert sum(p.numel() for p in m.blocks[0].attn.parameters()) == by_hand == 1552


def _max_logits(model, x) -> torch.Tensor:
    """(H,) layer 1's largest causal logit per head over the batch, by hand from the tapped q and k."""
    seen = {}
    attn = model.blocks[1].attn
    hooks = [attn.q.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o.detach().double()))]
    hooks.append(attn.k.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o.detach().double())))
    model(x)
    for h in hooks:
        h.remove()
    s = seen["q"] @ seen["k"].transpose(-2, -1) / attn.head_dim**0.5
    t = s.shape[-1]
    return s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).amax(dim=(0, 2, 3))


def test_qk_clip_on_mla_scales_q_and_k_by_root_gamma_and_the_rope_query_by_gamma():
    """Kimi K2's MuonClip on MLA (arXiv 2507.20534 Sec. 2.1): head h's q^C and k^C rows by sqrt(gamma), its q^R rows
    by gamma, the shared k^R untouched: the same batch's largest logit of the clipped head becomes tau."""
    from normlab.train.qk_clip import QKClip

    torch.manual_seed(0)
    model = normlab.build_model("pre", "nano", n_heads=4, attention="mla", qk_rope_head_dim=4)
    attn = model.blocks[1].attn
    nope, r = attn.nope, attn.rope_dim
    with torch.no_grad():  # head 2 of layer 1 planted far above the others
        attn.q_proj.weight[2 * nope : 3 * nope] *= 30.0
        attn.q_rope.weight[2 * r : 3 * r] *= 30.0
    x = torch.randint(0, 256, (3, 24))
    s = _max_logits(model, x)
    tau = float(s[2] / 4)
    assert s[2] > tau and (s[[0, 1, 3]] < tau).all()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip = QKClip(model, tau)
    model(x)
    assert clip.apply() == 1
    gamma = tau / s[2].item()
    now = dict(model.named_parameters())
    for name, width, factor in (("q_proj", nope, gamma**0.5), ("k_proj", nope, gamma**0.5), ("q_rope", r, gamma)):
        key, rows = f"blocks.1.attn.{name}.weight", slice(2 * width, 3 * width)
        torch.testing.assert_close(now[key].detach()[rows], before[key][rows] * factor, rtol=1e-6, atol=0)
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    assert changed == [f"blocks.1.attn.{n}.weight" for n in ("k_proj", "q_proj", "q_rope")]  # k^R untouched
    assert _max_logits(model, x)[2].item() == pytest.approx(tau, rel=1e-5)


def test_show_names_the_attention_kind_and_the_projection_rates():
    from normlab.model.describe import describe

    text = describe("qwen3", "nano", attention="mla", kv_lora_rank=12, qk_rope_head_dim=4, k_lr_mult=0.5)
    assert "attention: MLA (DeepSeek-V2), latent d_c 12, query latent none, per head d_h 16 + RoPE d_h^R 4" in text
    assert "x 0.5 on the key ones" in text and "attention:" not in describe("qwen3", "nano")
