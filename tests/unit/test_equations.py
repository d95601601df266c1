"""Every preset's block equals its paper's equation, computed by hand with the same weights (float64).

The references below are written from the equations (Kim et al. eqs. 1-3, Zhuo et al. eqs. 8-11
and 41-52, DeepNorm, Mix-LN, Kan et al. 'LN off'), not from normlab's layout data.
"""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.layout import PRESETS
from normlab.model.norms import is_norm
from tests.reference import N, mha, rope, swiglu
from tests.unit.test_equations_2026 import EQUATIONS_2026  # Keel, SpanNorm, Attention Residuals: checked there

DT = torch.float64


def randomize_norms(model: torch.nn.Module, seed: int = 1) -> None:
    """Move every gamma/beta away from 1/0 so a missing or extra norm cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if is_norm(m) and getattr(m, "weight", None) is not None:
                noise = 0.3 * torch.randn(m.weight.shape, generator=g)
                # a centered gain stores w (from 0) and applies 1 + w: move w itself off 0
                m.weight.copy_(noise if getattr(m, "gain", "gamma") == "centered" else m.weight * (1 + noise))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
                if getattr(m, "self_scale", None) is not None:  # SeeDNorm's beta (from 0) and alpha (from 1)
                    m.self_scale.copy_(0.3 * torch.randn(m.self_scale.shape, generator=g))
                    m.dyn_gain.copy_(m.dyn_gain + 0.3 * torch.randn(m.dyn_gain.shape, generator=g))
                if getattr(m, "alpha", None) is not None:  # DyT's scalar, away from its initial 0.5
                    m.alpha.copy_(0.5 + 0.5 * torch.rand(m.alpha.shape, generator=g))
            # learned residual steps (off 0), Admin's omegas and head scales (off 1)
            for name in (
                "attn_h",
                "mlp_h",
                "attn_omega",
                "mlp_omega",
                "head_scale",
                "sinks",
                "attn_skip",
                "mlp_skip",
                "attn_gpas",
                "mlp_gpas",
            ):
                step = getattr(m, name, None)
                if isinstance(step, torch.nn.Parameter):
                    step.copy_(0.5 + torch.rand(step.shape, generator=g))
            for name in ("attn_eigen", "mlp_eigen", "sqk", "suv", "sz"):  # nGPT's scalings, off their starts
                p = getattr(m, name, None)
                if isinstance(p, torch.nn.Parameter):
                    p.copy_(p * (0.5 + torch.rand(p.shape, generator=g)))
            if hasattr(m, "last_res"):  # a hyper-connection: every static, dynamic and gating weight off its start
                for p in m.parameters(recurse=False):
                    p.add_(0.3 * torch.randn(p.shape, generator=g))


def assert_blocks_follow(model: torch.nn.Module, equation) -> None:
    """Norms moved off their init, then every block equals ``equation`` by hand on one input (float64)."""
    randomize_norms(model)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=DT)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            torch.testing.assert_close(block(x), equation(block, x, i, len(model.blocks)), rtol=1e-6, atol=1e-6)


# --- the equations, one function per form: (block, x, layer index, n_layers) -> block output ---


def A(b, x, inner="", span="head", qk_after_rope=False, weights=None):
    return mha(b.attn, x, inner, span, qk_after_rope=qk_after_rope, weights=weights)


def F(b, x, hidden_norm=False):
    return swiglu(b.mlp, x, hidden_norm)


def post(b, x, *_):  # Kim eq. 1: N(x + Module(x)), twice
    y = N(b.attn_norms.after_add, x + A(b, x))
    return N(b.mlp_norms.after_add, y + F(b, y))


def pre(b, x, *_):  # Kim eq. 2: x + Module(N(x))
    y = x + A(b, N(b.attn_norms.input, x))
    return y + F(b, N(b.mlp_norms.input, y))


def peri_with(inner="", span="head"):
    def peri(b, x, *_):  # Kim eq. 3: x + N(Module(N(x)))
        y = x + N(b.attn_norms.output, A(b, N(b.attn_norms.input, x), inner, span))
        return y + N(b.mlp_norms.output, F(b, N(b.mlp_norms.input, y)))

    return peri


def b_only(b, x, *_):  # Kim Table 5 'B': x + N(Module(x))
    y = x + N(b.attn_norms.output, A(b, x))
    return y + N(b.mlp_norms.output, F(b, y))


def a_plus_c(b, x, *_):  # Kim Table 5 'A + C': N(x + Module(N(x)))
    y = N(b.attn_norms.after_add, x + A(b, N(b.attn_norms.input, x)))
    return N(b.mlp_norms.after_add, y + F(b, N(b.mlp_norms.input, y)))


def olmo2(b, x, *_):  # Kim App. H: QK-norm (over all heads, OLMo 2) + output norm B
    y = x + N(b.attn_norms.output, A(b, x, "qk", "full"))
    return y + N(b.mlp_norms.output, F(b, y))


def zhuo(form: str, inner: str):
    """Zhuo App. E, eqs. 41-52, with # = ``inner``."""

    def eq(b, x, *_):
        if form == "#-post":  # eqs. 41-42
            y = A(b, x, inner) + x
            ny = N(b.mlp_norms.input, y)
            return F(b, ny) + ny
        if form == "#-pre":  # eqs. 43-44
            y = A(b, x, inner) + x
            return F(b, N(b.mlp_norms.input, y)) + y
        if form == "pre-#-post":  # eqs. 45-46
            y = A(b, N(b.attn_norms.input, x), inner) + x
            ny = N(b.mlp_norms.input, y)
            return F(b, ny) + ny
        if form == "pre-#-pre":  # eqs. 47-48
            y = A(b, N(b.attn_norms.input, x), inner) + x
            return F(b, N(b.mlp_norms.input, y)) + y
        if form == "pre-post":  # eqs. 49-50
            y = A(b, N(b.attn_norms.input, x)) + x
            ny = N(b.mlp_norms.input, y)
            return F(b, ny) + ny
        if form == "post-pre":  # eqs. 51-52
            nx = N(b.attn_norms.input, x)
            y = A(b, nx) + nx
            return F(b, N(b.mlp_norms.input, y)) + y
        raise AssertionError(form)

    return eq


def hybrid_star(b, x, layer, n_layers):  # Zhuo eqs. 10-11 for the first block, 8-9 after
    if layer == 0:
        y = A(b, N(b.attn_norms.input, x), "qkv") + x  # eq. 10
        return F(b, N(b.mlp_norms.input, y)) + y  # eq. 11
    return zhuo("#-post", "qkv")(b, x)


def mix_ln(b, x, layer, n_layers):  # Li et al. 2025: Post-LN for layer < floor(0.25 L), Pre-LN after
    return post(b, x) if layer < math.floor(0.25 * n_layers) else pre(b, x)


def deepnorm(b, x, layer, n_layers):  # Wang et al. 2022: N(alpha x + G(x)), alpha = (2N)^(1/4)
    alpha = (2 * n_layers) ** 0.25
    y = N(b.attn_norms.after_add, alpha * x + A(b, x))
    return N(b.mlp_norms.after_add, alpha * y + F(b, y))


def no_norm(b, x, *_):  # Kan et al. Table 1 'LN off'
    y = x + A(b, x)
    return y + F(b, y)


def rezero(b, x):  # Bachlechner et al. 2021, eq. 5: x + a F(x), a one learned scalar per residual branch
    y = x + b.attn_h * A(b, x)
    return y + b.mlp_h * F(b, y)


def layerscale(b, x):  # Touvron et al. 2021, eq. 3 on Pre-LN: x + diag(lambda) F(N(x))
    y = x + b.attn_h * A(b, N(b.attn_norms.input, x))
    return y + b.mlp_h * F(b, N(b.mlp_norms.input, y))


def silu(a):
    return a / (1 + torch.exp(-a))


def gpas(b, x):  # Chen et al. 2025 (GPAS) on Pre-LN: y = x + F(N(x)); x' = y - SiLU(a) sg(y), forward (1 - SiLU(a)) y
    y = x + A(b, N(b.attn_norms.input, x))
    y = y - silu(b.attn_gpas) * y
    z = y + F(b, N(b.mlp_norms.input, y))
    return z - silu(b.mlp_gpas) * z


def lambdas(b, x):  # modded-nanogpt residual lambdas on Pre-LN: x' = lambda_skip x + lambda_branch F(N(x))
    y = b.attn_skip * x + b.attn_h * A(b, N(b.attn_norms.input, x))
    return b.mlp_skip * y + b.mlp_h * F(b, N(b.mlp_norms.input, y))


def _hc_weights(c, H):  # Zhu et al. 2025 eqs. 5-8: A_m, A_r, B, static + s tanh(norm(H) W), norm per stream
    Hbar = H / torch.sqrt(H.pow(2).mean(-1, keepdim=True) + 1e-6)
    Am = c.scale_a * torch.tanh(torch.einsum("btjd,d->btj", Hbar, c.dynamic_pre)) + c.static_pre
    Ar = c.scale_a * torch.tanh(torch.einsum("btjd,dk->btjk", Hbar, c.dynamic_res)) + c.static_res
    B = c.scale_b * torch.tanh(torch.einsum("btjd,d->btj", Hbar, c.dynamic_post)) + c.static_post
    return Am, Ar, B


def _sinkhorn_by_hand(M, iters=20):  # Xie et al. 2025 eq. 9: M_t = T_r(T_c(M_{t-1})), entry by entry
    M = M.clone()
    n = M.shape[-1]
    for _ in range(iters):
        for j in range(n):
            M[..., :, j] = M[..., :, j] / M[..., :, j].sum(-1, keepdim=True)
        for i in range(n):
            M[..., i, :] = M[..., i, :] / M[..., i, :].sum(-1, keepdim=True)
    return M


def _mhc_weights(c, H):  # Xie et al. 2025 eqs. 7-8: from x~ = RMSNorm(vec(H)) (no gain)
    n = H.shape[-2]
    v = H.flatten(-2)
    v = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    phi_pre, phi_post, phi_res = c.phi[:, :n], c.phi[:, n : 2 * n], c.phi[:, 2 * n :]
    b_pre, b_post, b_res = c.bias[:n], c.bias[n : 2 * n], c.bias[2 * n :].reshape(n, n)
    pre = torch.sigmoid(c.gates[0] * (v @ phi_pre) + b_pre)
    post = 2 * torch.sigmoid(c.gates[1] * (v @ phi_post) + b_post)
    res = _sinkhorn_by_hand(torch.exp(c.gates[2] * (v @ phi_res).unflatten(-1, (n, n)) + b_res))
    return pre, res, post


def hyper(b, x, mix):  # Pre-LN sublayers connected by HC (x' = A_r^T H + B^T F(A_m^T H)) or mHC (H_res, H_post, H_pre)
    n = b.attn_hc.n
    H = x.unflatten(-1, (n, -1))
    for conn, norm, f in (
        (b.attn_hc, b.attn_norms.input, lambda u: A(b, u)),
        (b.mlp_hc, b.mlp_norms.input, lambda u: F(b, u)),
    ):
        if mix == "hc":
            Am, Ar, B = _hc_weights(conn, H)
            out = f(N(norm, torch.einsum("btj,btjd->btd", Am, H)))
            H = torch.einsum("btjk,btjd->btkd", Ar, H) + B[..., None] * out[..., None, :]
        else:
            pre, res, post = _mhc_weights(conn, H)
            out = f(N(norm, torch.einsum("btj,btjd->btd", pre, H)))
            H = torch.einsum("btij,btjd->btid", res, H) + post[..., None] * out[..., None, :]
    return H.flatten(-2)


def _unit(v, eps=1e-6):  # nGPT's Norm: v / ||v|| (normlab's L2 norm: eps 1e-6 inside the root)
    return v / torch.sqrt((v * v).sum(-1, keepdim=True) + eps)


def ngpt(b, x):  # Loshchilov et al. 2024: h <- Norm(h + a_A (Norm(Attn(h)) - h)), h <- Norm(h + a_M (Norm(MLP(h)) - h))
    d = x.shape[-1]
    at, mlp = b.attn, b.mlp
    B, T, _ = x.shape
    H, hd = at.n_heads, at.head_dim

    def attention(h):  # eqs. 15-16: q = s_qk Norm(RoPE(W_q h)), k likewise; softmax(q k^T sqrt(d_k)) v W_o
        heads = lambda w: (h @ w.T).view(B, T, H, hd).transpose(1, 2)
        s_qk = (at.sqk * math.sqrt(d)).view(1, H, 1, hd)
        q, k, v = (
            s_qk * _unit(rope(heads(at.q_proj.weight), 10_000.0)),
            s_qk * _unit(rope(heads(at.k_proj.weight), 10_000.0)),
            heads(at.v_proj.weight),
        )
        logits = (q @ k.transpose(-1, -2)) * math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        p = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        return (p @ v).transpose(1, 2).reshape(B, T, H * hd) @ at.o_proj.weight.T

    def ffn(h):  # eqs. 19-20 as the authors' code: u, v times s sqrt(d); W_down (u * SiLU(v))
        s_u, s_v = (mlp.suv * math.sqrt(d)).chunk(2)
        u, v = s_u * (h @ mlp.up_proj.weight.T), s_v * (h @ mlp.gate_proj.weight.T)
        return (u * torch.nn.functional.silu(v)) @ mlp.down_proj.weight.T

    a_A = (b.attn_eigen * 0.05 * math.sqrt(d)).abs()  # a = |a_stored a_init / a_scale|, a_scale = 1/sqrt(d)
    a_M = (b.mlp_eigen * 0.05 * math.sqrt(d)).abs()
    h = _unit(x + a_A * (_unit(attention(x)) - x))
    return _unit(h + a_M * (_unit(ffn(h)) - h))


def lns(b, x, i):  # Sun et al. 2025, eq. 6: x + F(N(x) / sqrt(l)), l = i + 1
    s = 1 / math.sqrt(i + 1)
    y = x + A(b, s * N(b.attn_norms.input, x))
    return y + F(b, s * N(b.mlp_norms.input, y))


def admin(b, x):  # Liu et al. 2020, eq. 7: x_i = N(x_{i-1} * omega_i + f_i(x_{i-1})), Post-LN
    y = N(b.attn_norms.after_add, b.attn_omega * x + A(b, x))
    return N(b.mlp_norms.after_add, b.mlp_omega * y + F(b, y))


def normformer(b, x):  # Shleifer et al. 2021: x + N(HeadScale-MHA(N(x))), x + W2 N(act(W1 N(x)))
    y = x + N(b.attn_norms.output, A(b, N(b.attn_norms.input, x), "s"))
    return y + F(b, N(b.mlp_norms.input, y), hidden_norm=True)


def sub_ln(b, x):  # Wang et al. 2022 (Magneto): x + W_O N(Attn(N(x))), x + W2 N(act(W1 N(x)))
    y = x + A(b, N(b.attn_norms.input, x), "c", "full")
    return y + F(b, N(b.mlp_norms.input, y), hidden_norm=True)


def pre_gate(b, x):  # Qiu et al. 2025, eq. 5 (G1): Y * sigmoid(X W_theta), X = N(x) the attention's input
    y = x + A(b, N(b.attn_norms.input, x), "g")
    return y + F(b, N(b.mlp_norms.input, y))


def llama4_qk(b, x):  # Llama 4: q, k normalized per head after RoPE
    y = x + A(b, N(b.attn_norms.input, x), "qk", qk_after_rope=True)
    return y + F(b, N(b.mlp_norms.input, y))


def qwen3(b, x):  # Qwen3: Pre-LN, N(Q) and N(K) per head before RoPE
    y = x + A(b, N(b.attn_norms.input, x), "qk")
    return y + F(b, N(b.mlp_norms.input, y))


def sandwich_mlp(b, x):  # marin issue 4993: x + N(F(N(x))) on the MLP only, x + Attn(N(x)) before it
    y = x + A(b, N(b.attn_norms.input, x))
    return y + N(b.mlp_norms.output, F(b, N(b.mlp_norms.input, y)))


EQUATIONS = {
    "admin": lambda b, x, *_: admin(b, x),
    "normformer": lambda b, x, *_: normformer(b, x),
    "sub-ln": lambda b, x, *_: sub_ln(b, x),
    "pre-gate": lambda b, x, *_: pre_gate(b, x),
    "llama4-qk": lambda b, x, *_: llama4_qk(b, x),
    "qwen3": lambda b, x, *_: qwen3(b, x),
    "gemma3": peri_with("qk"),  # Kim eq. 3 with QK-norm; N's gain is 1 + w (tests/reference.py gain())
    "post": post,
    "pre": pre,
    "peri": peri_with(),
    "peri-noemb": peri_with(),
    "peri-frozen": peri_with(),
    "b": b_only,
    "a+c": a_plus_c,
    "olmo2": olmo2,
    "peri+qk": peri_with("qk"),
    "gemma2": peri_with(),
    "hybrid": zhuo("#-post", "qkv"),  # eqs. 8-9: QKV-Post
    "hybrid*": hybrid_star,
    "pre-post": zhuo("pre-post", ""),
    "post-pre": zhuo("post-pre", ""),
    "mix-ln": mix_ln,
    "deepnorm": deepnorm,
    "none": no_norm,
    "pre-dyt": pre,  # Zhu et al. 2025: Kim eq. 2 with N = DyT (tests/reference.py writes DyT out)
    "pre-scale": pre,  # Nguyen & Salazar 2019: Kim eq. 2 with N = ScaleNorm
    "pre-derf": pre,  # Chen et al. 2025: Kim eq. 2 with N = Derf (tests/reference.py writes Derf out)
    "peri-derf": peri_with(),  # Kim eq. 3 with N = Derf
    "pre-seednorm": pre,  # Cai et al. 2025: Kim eq. 2 with N = SeeDNorm (tests/reference.py writes it out)
    "pre-ssrms": pre,  # Park et al. 2025: Kim eq. 2 with N = s x / RMS(x), one s (reference.py's gain broadcasts)
    "rezero": lambda b, x, *_: rezero(b, x),
    "pre-layerscale": lambda b, x, *_: layerscale(b, x),
    "pre-lns": lambda b, x, i, n: lns(b, x, i),
    "pre-gpas": lambda b, x, *_: gpas(b, x),
    "pre-lambda": lambda b, x, *_: lambdas(b, x),
    "ngpt": lambda b, x, *_: ngpt(b, x),
    "pre-hc": lambda b, x, *_: hyper(b, x, "hc"),
    "pre-mhc": lambda b, x, *_: hyper(b, x, "mhc"),
    "pre-gatednorm": pre,  # marin's grug MoE: Kim eq. 2 with N = GatedNorm (tests/reference.py writes it out)
    "sandwich-gatednorm": lambda b, x, *_: sandwich_mlp(b, x),  # marin issue 4993
    "pre-taper": pre,  # Kanavalau et al. 2026: Kim eq. 2 with N = TaperNorm (at its gate; reference.py)
}
for _inner in ("qkvc", "qkv", "qkc", "qk", "kv", "kc"):
    EQUATIONS[f"{_inner}-post"] = zhuo("#-post", _inner)
    EQUATIONS[f"{_inner}-pre"] = zhuo("#-pre", _inner)
    EQUATIONS[f"pre-{_inner}-post"] = zhuo("pre-#-post", _inner)
    EQUATIONS[f"pre-{_inner}-pre"] = zhuo("pre-#-pre", _inner)


def test_every_preset_has_an_equation():
    assert set(EQUATIONS) | set(EQUATIONS_2026) == set(PRESETS)


@pytest.mark.parametrize("name", [p for p in PRESETS if p not in EQUATIONS_2026])
def test_block_matches_paper_equation(name):
    # 8 layers so Mix-LN has floor(0.25 * 8) = 2 Post-LN layers and HybridNorm* a distinct first block.
    # nGPT's s_qk scales q and k alike: one key head per query head
    model = normlab.build_model(
        name, "nano", seed=0, n_layers=8, n_kv_heads=2 if PRESETS[name].layout.ngpt else 1, d_model=32, n_heads=2
    )
    model.double()
    randomize_norms(model)
    # n residual streams (hyper-connections) enter a block side by side: (B, T, n * d)
    x = torch.randn(2, 7, 32 * PRESETS[name].layout.streams, generator=torch.Generator().manual_seed(0), dtype=DT)
    if PRESETS[name].layout.ngpt:  # nGPT's stream is a unit vector (its blocks' outputs, its embedding rows)
        x = x / x.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            expected = EQUATIONS[name](block, x, i, len(model.blocks))
            torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6, msg=f"{name} block {i}")


@pytest.mark.parametrize("name", ["peri", "gemma2", "pre", "post", "pre-dyt", "pre-scale"])
def test_model_level_norms(name):
    """logits = W_head N_final(x_L), x_0 = N_emb(scale * E[tokens]) (Kim Sec. 3.3; Gemma's sqrt(d))."""
    model = normlab.build_model(name, "nano", seed=0)
    model.double()
    randomize_norms(model)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    lay = PRESETS[name].layout
    with torch.no_grad():
        x = model.embed.weight[tokens] * (math.sqrt(32) if lay.embed_scale else 1.0)
        if lay.embed_norm:
            x = N(model.embed_norm, x)
        for block in model.blocks:
            x = block(x)
        if lay.final_norm:
            x = N(model.final_norm, x)
        torch.testing.assert_close(model(tokens).logits, x @ model.lm_head.weight.T, rtol=1e-6, atol=1e-6)


def test_residual_scale_h():
    """Kan et al. Sec. 5: X_{l+1/2} = X_l + h Attn(X_l), here on Peri-LN."""
    model = normlab.build_model("peri,h=0.25", "nano", seed=0).double()
    randomize_norms(model)
    b, x = model.blocks[0], torch.randn(1, 5, 32, dtype=DT)
    with torch.no_grad():
        y = x + 0.25 * N(b.attn_norms.output, A(b, N(b.attn_norms.input, x)))
        expected = y + 0.25 * N(b.mlp_norms.output, F(b, N(b.mlp_norms.input, y)))
        torch.testing.assert_close(b(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["dyt", "derf", "scale", "l2", "seednorm", "gatednorm", "taper"])
def test_every_norm_kind_at_every_site_matches_its_formula(kind):
    """A kind applies at every site a layout turns on: Peri-LN with QK-norm in that kind, block and
    model-level norms, each against the kind's formula written out in tests/reference.py."""
    model = normlab.build_model(f"peri+qk,norm={kind}", "nano", seed=0, n_kv_heads=1, d_model=32, n_heads=2).double()
    assert_blocks_follow(model, peri_with("qk"))
    sizes = {
        "dyt": 2 * 32 + 1,
        "derf": 2 * 32 + 2,
        "scale": 1,
        "l2": 0,  # gamma, beta, alpha (Derf: + s) / g / -
        "seednorm": 3 * 32,
        "gatednorm": 32 + 2 * 32 * 128,  # gamma, W_down, W_up at marin's rank 128, wider than d = 32
        "taper": 2 * 32,  # gamma, gamma~
    }  # SeeDNorm: gamma, alpha, beta
    assert sum(p.numel() for p in model.blocks[0].attn_norms.input.parameters()) == sizes[kind]


def test_dyt_bounds_its_output_whatever_the_input_scale():
    """DyT squashes (|y| <= |gamma| + |beta| per entry) where RMSNorm rescales: a 1e4 input stays bounded."""
    from normlab.model.norms import DyT

    d = DyT(16, alpha0=0.5).double()
    with torch.no_grad():
        d.weight.uniform_(-2, 2)
        d.bias.uniform_(-1, 1)
    x = 1e4 * torch.randn(3, 16, dtype=DT)
    assert (d(x).abs() <= d.weight.abs() + d.bias.abs() + 1e-12).all()
    assert (
        d.alpha.item() == 0.5 and normlab.build_model("pre-dyt", "nano", dyt_alpha=2.0).final_norm.alpha.item() == 2.0
    )


@pytest.mark.parametrize(
    "kind,gain",
    [
        ("rms", "centered"),
        ("rms", "none"),
        ("layer", "centered"),
        ("layer", "none"),
        ("dyt", "centered"),
        ("dyt", "none"),
        ("derf", "centered"),
        ("rms", "scalar"),
        ("layer", "scalar"),
        ("dyt", "scalar"),
        ("derf", "scalar"),
    ],
)
def test_gains_at_every_site_match_their_formula(kind, gain):
    """gain=none drops gamma (LayerNorm its beta too); gain=centered stores w from 0 and applies 1 + w
    (weight decay then pulls the gain toward 1); gain=scalar is one learned number from 1 for every channel
    (single-scale RMSNorm; LayerNorm without beta): Peri-LN with QK-norm against the formulas by hand."""
    model = normlab.build_model(
        f"peri+qk,norm={kind},gain={gain}", "nano", seed=0, n_kv_heads=1, d_model=32, n_heads=2
    ).double()
    norm = model.blocks[0].attn_norms.input
    start = {"centered": 0.0, "scalar": 1.0}.get(gain)  # centered: w starts at 0; scalar: s at 1
    assert (norm.weight is None) if gain == "none" else bool((norm.weight == start).all())
    if gain == "scalar":
        assert norm.weight.shape == (1,) and (kind != "layer" or norm.bias is None)
    assert_blocks_follow(model, peri_with("qk"))


def test_single_scale_rmsnorm_is_one_number_times_x_over_rms():
    """pre-ssrms (Outlier-Safe Pre-Training's single-scale RMSNorm): s * x / sqrt(mean(x^2) + eps) with one
    learned s per norm, written out here with a planted s; a per-channel gain with every entry s is the same."""
    model = normlab.build_model("pre-ssrms", "nano", seed=0).double()
    norm = model.blocks[0].attn_norms.input
    with torch.no_grad():
        norm.weight.fill_(1.7)
    x = torch.randn(2, 3, model.config.d_model, dtype=DT)
    by_hand = 1.7 * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(norm(x), by_hand, rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in norm.parameters()) == 1


def test_derf_is_gamma_erf_of_alpha_x_plus_s_plus_beta():
    """Derf (Chen et al. 2025) with planted alpha, s, gamma, beta against math.erf entry by entry (no torch.erf),
    and its output in DyT's box |y| <= |gamma| + |beta| for a 1e4 input."""
    from normlab.model.norms import Derf

    d = Derf(4, alpha0=0.5).double()
    assert d.alpha.item() == 0.5 and d.shift.item() == 0.0  # the authors' init: alpha0, s = 0
    with torch.no_grad():
        d.alpha.fill_(0.8)
        d.shift.fill_(-0.3)
        d.weight.copy_(torch.tensor([1.5, -0.5, 2.0, 1.0], dtype=DT))
        d.bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.3], dtype=DT))
    x = torch.tensor([[0.0, 1.0, -2.0, 0.5]], dtype=DT)
    expected = [
        [g * math.erf(0.8 * v - 0.3) + b for v, g, b in zip(row, (1.5, -0.5, 2.0, 1.0), (0.1, 0.0, -0.2, 0.3))]
        for row in x.tolist()
    ]
    torch.testing.assert_close(d(x), torch.tensor(expected, dtype=DT), rtol=1e-12, atol=1e-12)
    big = 1e4 * torch.randn(3, 4, dtype=DT)
    assert (d(big).abs() <= d.weight.abs() + d.bias.abs() + 1e-12).all()


def test_per_site_kinds_hold_their_own_norm_and_match_the_equation():
    """norm./gain./alpha0. per site: each site holds the module of its kind (DyT at B with its own alpha0,
    L2 on q and k, a centered final gain), and the block is still Kim eq. 3 with those norms by hand."""
    from normlab.model.norms import DyT, L2Norm

    text = "peri+qk,norm.B=dyt,alpha0.attn.B=0.9,alpha0.mlp.B=0.2,norm.q+k=l2,gain.final=centered"
    model = normlab.build_model(text, "nano", seed=0, n_kv_heads=1, d_model=32, n_heads=2).double()
    b = model.blocks[0]
    assert isinstance(b.attn_norms.output, DyT) and b.attn_norms.output.alpha.item() == pytest.approx(0.9)
    assert isinstance(b.mlp_norms.output, DyT) and b.mlp_norms.output.alpha.item() == pytest.approx(0.2)
    assert isinstance(b.attn_norms.input, torch.nn.LayerNorm) and isinstance(b.attn.q_norm, L2Norm)
    assert isinstance(b.attn.k_norm, L2Norm) and bool((model.final_norm.weight == 0).all())  # centered: w from 0
    assert_blocks_follow(model, peri_with("qk"))


def test_qk_norm_after_rope_is_its_own_site_only_with_a_gain():
    """N(RoPE(q)) with a per-channel gain differs from RoPE(N(q)); without a gain the two are equal, because
    RoPE rotates pairs of channels and so keeps each head's RMS (why Llama 4's gain-free norm can go after it)."""
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=DT)
    gained = normlab.build_model("pre,qk,qk-rope", "nano", seed=0, d_model=32, n_heads=2).double()
    randomize_norms(gained)
    b = gained.blocks[0]
    with torch.no_grad():
        after = b.attn(x)
        torch.testing.assert_close(after, A(b, x, "qk", qk_after_rope=True), rtol=1e-6, atol=1e-6)
        assert (after - A(b, x, "qk")).abs().max() > 1e-3  # the gain makes the order matter
    free = normlab.build_model("llama4-qk", "nano", seed=0, d_model=32, n_heads=2).double()
    b = free.blocks[0]
    with torch.no_grad():
        torch.testing.assert_close(b.attn(x), A(b, x, "qk"), rtol=1e-9, atol=1e-9)


def test_admin_profiles_omega_as_liu_et_al():
    """omega_1 = 1, omega_{i+1} = sqrt(Var[omega_i * x_i] + Var[f_i(x_i)]) over the sublayers in order (Liu et
    al. 2020 eq. 7 / Sec. 4.3 with the embedding as the first variance), recomputed here from the same tokens."""
    from normlab.model.admin import profile_admin

    model = normlab.build_model("admin", "nano", seed=0, n_layers=3, d_model=32, n_heads=2).double()
    omegas = profile_admin(model)  # the same pass build_model ran: deterministic tokens
    # after the first, each omega adds one update's variance: they grow with depth
    assert len(omegas) == 6 and omegas[0] == 1.0 and all(b > a for a, b in zip(omegas[1:], omegas[2:]))
    tokens = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    ratio, expected = 1.0, []
    with torch.no_grad():
        x = model.embed.weight[tokens]
        for b in model.blocks:
            for f, norm, omega in (
                (lambda u, b=b: A(b, u), b.attn_norms.after_add, b.attn_omega),
                (lambda u, b=b: F(b, u), b.mlp_norms.after_add, b.mlp_omega),
            ):
                expected.append(ratio)
                torch.testing.assert_close(omega, torch.full_like(omega, ratio), rtol=1e-9, atol=0)  # a learned vector
                update = f(x)
                ratio = math.sqrt(float((ratio * x).var()) + float(update.var()))
                x = N(norm, omega * x + update)
    assert omegas == pytest.approx(expected, rel=1e-9)
    assert model.blocks[0].attn_omega.requires_grad


def _sink(a):
    def weights(logits, mask):
        """exp(l_ij) / (exp(a_h) + sum_{j <= i} exp(l_ij))  (GPT-OSS; a = 0: Miller's softmax_1)"""
        e = torch.exp(logits) * mask
        return e / (torch.exp(torch.as_tensor(a, dtype=DT)).reshape(-1, 1, 1) + e.sum(-1, keepdim=True))

    return weights


def _softpick(logits, mask):
    """ReLU(e^l - 1) / sum_{j <= i} |e^l - 1|  (Zuhri et al. 2025, eq. 2)"""
    e = (torch.exp(logits) - 1) * mask
    return torch.relu(e) / e.abs().sum(-1, keepdim=True)


@pytest.mark.parametrize("kind", ["sink", "off-by-one", "softpick"])
def test_attention_softmax_variants_follow_their_formulas(kind):
    model = normlab.build_model(f"pre,qk,softmax={kind}", "nano", seed=0, d_model=32, n_heads=4, n_kv_heads=2).double()
    randomize_norms(model)  # QK-norm gains off 1 (logits of both signs and sizes), the sinks off 0
    b = model.blocks[0]
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=DT)
    weights = {"sink": lambda: _sink(b.attn.sinks), "off-by-one": lambda: _sink(0.0), "softpick": lambda: _softpick}[
        kind
    ]()
    with torch.no_grad():
        torch.testing.assert_close(b.attn(x), A(b, x, "qk", weights=weights), rtol=1e-6, atol=1e-8)
        assert (b.attn(x) - A(b, x, "qk")).abs().max() > 1e-3  # not the softmax
    if kind == "sink":
        assert b.attn.sinks.shape == (4,) and b.attn.sinks.requires_grad


def test_gpas_scales_the_stream_but_not_its_gradient():
    """GPAS (Chen et al. 2025, Sec. 3): x' = y - SiLU(a) sg(y). Forward (1 - SiLU(a)) y; dL/dy = dL/dx' (the
    subtracted copy carries no gradient); dL/da = -SiLU'(a) <dL/dx', y>, SiLU'(a) = s(a)(1 + a(1 - s(a)))."""
    model = normlab.build_model("pre-gpas", "nano", seed=0, n_layers=1).double()
    block = model.blocks[0]
    with torch.no_grad():
        block.attn_gpas.fill_(0.0)
        block.mlp_gpas.fill_(0.7)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0), dtype=DT, requires_grad=True)
    w = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1), dtype=DT)
    captured = {}
    hook = block.resid_mid.register_forward_hook(lambda m, i, o: captured.update(y=o))
    out = block(x)
    hook.remove()
    y = captured["y"]  # the stream after the attention sublayer (GPAS a = 0 there: the identity)
    z = y + F(block, N(block.mlp_norms.input, y))
    a = torch.tensor(0.7, dtype=DT)
    sig = torch.sigmoid(a)
    torch.testing.assert_close(out, (1 - silu(a)) * z)
    (out * w).sum().backward(retain_graph=True)
    dsilu = sig * (1 + a * (1 - sig))
    torch.testing.assert_close(block.mlp_gpas.grad, (-dsilu * (w * z).sum()).reshape(1))
    # the gradient reaching x equals the gradient of <w, z> with no scaling at all
    (gx,) = torch.autograd.grad((z * w).sum(), x)
    torch.testing.assert_close(x.grad, gx)


@pytest.mark.parametrize("name", ["pre-hc", "pre-mhc"])
def test_hyper_connection_model_expands_the_embedding_and_sums_the_last_streams(name):
    """Zhu et al. 2025 Sec. 3: H_0 = n copies of the embedding; logits = W_head N_final(sum_i H_L,i)."""
    model = normlab.build_model(name, "nano", seed=0).double()
    randomize_norms(model)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x = torch.cat([model.embed.weight[tokens]] * 4, dim=-1)
        for block in model.blocks:
            x = block(x)
        x = N(model.final_norm, sum(x.unflatten(-1, (4, 32)).unbind(-2)))
        torch.testing.assert_close(model(tokens).logits, x @ model.lm_head.weight.T, rtol=1e-6, atol=1e-6)


def test_mhc_mixing_matrix_is_doubly_stochastic_after_sinkhorn():
    """Xie et al. 2025: after t_max = 20 Sinkhorn-Knopp iterations (columns, then rows, last) H_res has no negative
    entry, rows summing to 1 exactly and columns to 1 up to the iteration's gap: under 1e-9 for logits of
    std 0.5, 7e-5 at std 1, 0.05 at std 3, the largest over 1000 4x4 matrices (mHC-lite's point, arXiv 2601.05732:
    20 iterations are not exact).
    Zhu et al.'s unconstrained A_r is not stochastic at all (its rows sum to anything)."""
    from normlab.model.streams import sinkhorn

    logits = 0.5 * torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0), dtype=DT)
    M = sinkhorn(logits)
    assert (M >= 0).all()
    torch.testing.assert_close(M.sum(-1), torch.ones(5, 4, dtype=DT), rtol=0, atol=1e-12)
    torch.testing.assert_close(M.sum(-2), torch.ones(5, 4, dtype=DT), rtol=0, atol=1e-9)
    wide = sinkhorn(3 * torch.randn(1000, 4, 4, generator=torch.Generator().manual_seed(0), dtype=DT))
    assert 1e-3 < (wide.sum(-2) - 1).abs().max() < 0.1  # over 1000 wide ones the gap is real, and small
    torch.testing.assert_close(M, _sinkhorn_by_hand(logits.exp()))
    model = normlab.build_model("pre-mhc", "nano", seed=0).double()
    randomize_norms(model)
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        model(x)
    for block in model.blocks:
        for conn in (block.attn_hc, block.mlp_hc):
            torch.testing.assert_close(conn.last_res.sum(-1), torch.ones(2, 9, 4, dtype=DT), rtol=0, atol=1e-9)
            torch.testing.assert_close(conn.last_res.sum(-2), torch.ones(2, 9, 4, dtype=DT), rtol=0, atol=1e-3)
    hc = normlab.build_model("pre-hc", "nano", seed=0).double()
    randomize_norms(hc)
    with torch.no_grad():
        hc(x)
    assert (hc.blocks[0].attn_hc.last_res.sum(-1) - 1).abs().max() > 0.1


def test_seednorm_is_rmsnorm_at_init_and_keeps_the_input_norm_after():
    """SeeDNorm (Cai et al. 2025) from beta = 0: tanh(0) = 0, so gamma x / RMS(x), RMSNorm exactly; once beta moves,
    x and 3x give different outputs (the input's norm reaches the output, through tanh(x . beta)), which RMSNorm's
    cannot; every gain and the per-site kind apply to it."""
    from normlab.model.norms import make_norm

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), dtype=DT)
    seed, rms = make_norm("seednorm", 32, 1e-12).double(), make_norm("rms", 32, 1e-12).double()
    torch.testing.assert_close(seed(x), rms(x))
    torch.testing.assert_close(rms(3 * x), rms(x))
    with torch.no_grad():
        seed.self_scale.fill_(0.1)
    assert not torch.allclose(seed(3 * x), seed(x))
    torch.testing.assert_close(seed(x), N(seed, x))
    for g in ("none", "centered", "scalar"):
        m = make_norm("seednorm", 32, 1e-6, gain=g).double()
        with torch.no_grad():
            m.self_scale.fill_(0.05)
        torch.testing.assert_close(m(x), N(m, x))
    site = normlab.build_model("pre,norm.final=seednorm,gain.final=scalar", "nano", seed=0)
    assert type(site.final_norm).__name__ == "SeeDNorm" and site.final_norm.weight.numel() == 1


def test_ngpt_model_reads_unit_embeddings_scales_logits_by_s_z_and_puts_weights_back_on_the_sphere():
    """nGPT (Loshchilov et al. 2024): at init every embedding row, head row, stream-reading matrix row and
    stream-writing matrix column has norm 1; logits = s_z * W_out h_L (no final norm: h_L is a unit vector); after an
    AdamW step (normlab's optimizer) the norms are 1 again, while the scalings (a, s_qk, s_uv, s_z) are not decayed
    or normalized."""
    from normlab.config.train import TrainConfig
    from normlab.train.optim import make_optimizer, param_groups

    model = normlab.build_model("ngpt", "nano", seed=0).double()
    randomize_norms(model)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x = model.embed.weight[tokens]
        torch.testing.assert_close(x.norm(dim=-1), torch.ones(2, 9, dtype=DT))
        for block in model.blocks:
            x = block(x)
        # on the sphere up to the L2 norm's eps: 1 / sqrt(1 + 1e-6)
        torch.testing.assert_close(x.norm(dim=-1), torch.ones(2, 9, dtype=DT), rtol=0, atol=1e-6)
        expected = (x @ model.lm_head.weight.T) * (model.sz * math.sqrt(32))
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-6, atol=1e-6)

    def unit_norms():
        b = model.blocks[1]
        return [
            model.embed.weight.norm(dim=1),
            model.lm_head.weight.norm(dim=1),
            b.attn.q_proj.weight.norm(dim=1),
            b.mlp.up_proj.weight.norm(dim=1),
            b.attn.o_proj.weight.norm(dim=0),
            b.mlp.down_proj.weight.norm(dim=0),
        ]

    cfg = TrainConfig().with_({"lr": 0.05, "weight_decay": 0.1})
    sz = model.sz.detach().clone()
    for optimizer in ("adamw", "muon"):  # Muon: the hook follows its step, after AdamW's
        opt = make_optimizer(model, cfg.with_({"optimizer": optimizer}))
        model.zero_grad()
        model(tokens, targets=tokens).loss.backward()
        opt.step()
        for n in unit_norms():
            torch.testing.assert_close(n, torch.ones_like(n))
    assert not torch.equal(model.sz.detach(), sz)  # trained, and no longer 1 / sqrt(d) each: not normalized
    decayed = {id(p) for p in param_groups(model, cfg)[0]["params"]}
    b = model.blocks[0]
    assert not {id(p) for p in (b.attn_eigen, b.mlp_eigen, b.attn.sqk, b.mlp.suv, model.sz)} & decayed
