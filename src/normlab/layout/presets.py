"""Named layouts from the papers, each built from `Layout` data and citing its equation.

`PRESETS` maps a name to a `Preset` (layout, equation, source). The Zhuo et al. Appendix E family
is generated from its definition rather than written out 24 times.

Inits that are part of a paper's recipe travel with the layout (`Layout.init`, used when the model's
``init`` is "auto"): DeepNorm's beta-scaled Xavier (Wang et al. 2022), and Megatron init for every
HybridNorm-family layout, since Zhuo et al. Sec. 4.4 set "the default initialization method ... for
HybridNorm to Megatron initialization in all experiments" (Table 7: truncated normal, std
1/sqrt(2.5 d), output projections / sqrt(2L)). Their Pre-Norm baseline uses their "Normal" init
(``pre,init=trunc-normal``); the plain ``pre`` preset keeps Kim et al.'s N(0, 0.02) (Table 2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from normlab.layout.residual import ADMIN, ATTN_RES_FULL, DEEPNORM, KEEL, AttnRes, Siamese, Skip, Sphere, Streams
from normlab.layout.sites import (
    AttentionInnerSites,
    BlockLayout,
    LayerRange,
    LayerRule,
    Layout,
    SiteNorm,
    SublayerSites,
)

KIM = "Kim et al. 2025 (Peri-LN)"
ZHUO = "Zhuo et al. 2025 (HybridNorm)"
ZHUO_INIT = "megatron"  # Zhuo et al. Sec. 4.4 and Table 7: HybridNorm's init in all experiments
KAN = "Kan et al. 2025 (Stability under LN)"


@dataclass(frozen=True)
class Preset:
    name: str
    layout: Layout
    equation: str
    source: str


# The sublayer patterns every preset is built from.
NONE = SublayerSites()
PRE = SublayerSites(input=True)  # A:   x + f(N(x))
POST = SublayerSites(after_add=True)  # C:   N(x + f(x))
PERI = SublayerSites(input=True, output=True)  # A+B: x + N(f(N(x)))
OUT = SublayerSites(output=True)  # B:   x + N(f(x))
PRE_POST = SublayerSites(input=True, after_add=True)  # A+C: N(x + f(N(x)))
NORMED_SKIP = SublayerSites(input=True, skip_normed=True)  # N(x) + f(N(x)), Zhuo eq. 9
PERI_ATTN = PERI  # NormFormer's attention: x + N(MHA(N(x))) (its "post-attention LN" is Peri-LN's B)
PRE_HIDDEN = SublayerSites(input=True, hidden=True)  # x + W2 N(act(W1 N(x))), NormFormer / Sub-LN FFN
SPAN_MLP = SublayerSites(after_add=True, skip_block=True)  # C+W: N(x_block + FFN(y)), SpanNorm's whole-block skip

# Zhuo et al. Appendix E: which of Q, K, V, Context are normalized inside attention.
ZHUO_INNER = {
    "qkvc": AttentionInnerSites(q=True, k=True, v=True, context=True),  # eq. 37
    "qkv": AttentionInnerSites(q=True, k=True, v=True),  # eq. 7
    "qkc": AttentionInnerSites(q=True, k=True, context=True),  # eq. 38
    "qk": AttentionInnerSites(q=True, k=True),  # eq. 35
    "kv": AttentionInnerSites(k=True, v=True),  # eq. 36
    "kc": AttentionInnerSites(k=True, context=True),  # eq. 39
}
QK = ZHUO_INNER["qk"]
HEAD_SCALE = AttentionInnerSites(head_scale=True)  # NormFormer eq. 3
SUB_LN_ATTN = AttentionInnerSites(context=True)  # Sub-LN: N on the context before W_O
GATE = AttentionInnerSites(gate=True)  # Qiu et al. 2025, G1


_PRESET_NO_INNER = AttentionInnerSites()  # frozen: the plain attention, no inner norm


def _block(attn: SublayerSites, mlp: SublayerSites, inner: AttentionInnerSites = _PRESET_NO_INNER) -> BlockLayout:
    return BlockLayout(attn=attn, attn_inner=inner, mlp=mlp)


def _preset(name: str, layout: Layout, equation: str, source: str) -> Preset:
    return Preset(name=name, layout=replace(layout, name=name), equation=equation, source=source)


def _zhuo_family() -> list[Preset]:
    """#-Post, #-Pre, Pre-#-Post, Pre-#-Pre for # in Zhuo's six attention norms (eqs. 41-48)."""
    out = []
    for key, inner in ZHUO_INNER.items():
        hash_ = key.upper()
        forms = {
            f"{key}-post": (NONE, NORMED_SKIP, f"Y = MHA_{hash_}(X) + X; X' = FFN(N(Y)) + N(Y)", "41-42"),
            f"{key}-pre": (NONE, PRE, f"Y = MHA_{hash_}(X) + X; X' = FFN(N(Y)) + Y", "43-44"),
            f"pre-{key}-post": (PRE, NORMED_SKIP, f"Y = MHA_{hash_}(N(X)) + X; X' = FFN(N(Y)) + N(Y)", "45-46"),
            f"pre-{key}-pre": (PRE, PRE, f"Y = MHA_{hash_}(N(X)) + X; X' = FFN(N(Y)) + Y", "47-48"),
        }
        for name, (attn, mlp, eq, eqno) in forms.items():
            layout = Layout(block=_block(attn, mlp, inner), final_norm=True, init=ZHUO_INIT)
            out.append(_preset(name, layout, eq, f"{ZHUO}, App. E eqs. {eqno}"))
    return out


def _build() -> dict[str, Preset]:
    hybrid = Layout(block=_block(NONE, NORMED_SKIP, ZHUO_INNER["qkv"]), final_norm=True, init=ZHUO_INIT)
    first_block = LayerRange(0, 1)
    hybrid_star = replace(
        hybrid,
        rules=(
            LayerRule(first_block, "attn", PRE, ZHUO_INNER["qkv"]),
            LayerRule(first_block, "mlp", PRE),
        ),
    )
    peri = Layout(block=_block(PERI, PERI), embed_norm=True, final_norm=True)
    presets = [
        _preset("post", Layout(block=_block(POST, POST)), "x' = N(x + F(x))", f"{KIM}, eq. 1; Vaswani et al. 2017"),
        _preset(
            "pre",
            Layout(block=_block(PRE, PRE), final_norm=True),
            "x' = x + F(N(x)); final N",
            f"{KIM}, eq. 2; Llama 3",
        ),
        _preset(
            "peri", peri, "y0 = N(emb); x' = x + N(F(N(x))); final N", f"{KIM}, eq. 3 with Sec. 3.3 embedding norm"
        ),
        _preset(
            "peri-noemb",
            replace(peri, embed_norm=False),
            "x' = x + N(F(N(x))); final N",
            f"{KIM}, eq. 3, App. G.5 ablation",
        ),
        _preset(
            "peri-frozen",
            replace(peri, embed_norm=False, freeze_output_gamma=True),
            "x' = x + N_{gamma=1}(F(N(x))); final N; no embedding norm",
            f"{KIM}, Sec. 5.3 / Fig. 8 (embedding norm omitted there)",
        ),
        _preset(
            "b",
            Layout(block=_block(OUT, OUT), embed_norm=True, final_norm=True),
            "x' = x + N(F(x))",
            f"{KIM}, Table 5 (B only)",
        ),
        _preset("a+c", Layout(block=_block(PRE_POST, PRE_POST)), "x' = N(x + F(N(x)))", f"{KIM}, Table 5 (A + C)"),
        _preset(
            "olmo2",
            Layout(block=_block(OUT, OUT, QK), final_norm=True, inner_span="full"),
            "x' = x + N(F(x)), attention with N(Q), N(K) over all heads",
            f"{KIM}, App. H (OLMo2-style Peri-LN); OLMo et al. 2024",
        ),
        _preset(
            "peri+qk",
            replace(peri, block=_block(PERI, PERI, QK), norm="layer"),
            "x' = x + N(F_QK(N(x))), LayerNorm",
            f"{KIM}, Table 6 (LayerNorm, as in that experiment)",
        ),
        _preset(
            "gemma2",
            Layout(block=_block(PERI, PERI), final_norm=True, embed_scale=True),
            "y0 = sqrt(d) emb; x' = x + N(F(N(x))); final N",
            "Gemma Team 2024 (Gemma 2); Kim et al. 2025 Sec. 3.3",
        ),
        _preset("hybrid", hybrid, "Y = MHA_QKV(X) + X; X' = FFN(N(Y)) + N(Y)", f"{ZHUO}, eqs. 8-9"),
        _preset(
            "hybrid*",
            hybrid_star,
            "as hybrid; first block Y = MHA_QKV(N(X)) + X, X' = FFN(N(Y)) + Y",
            f"{ZHUO}, eqs. 10-11",
        ),
        *_zhuo_family(),
        _preset(
            "pre-post",
            Layout(block=_block(PRE, NORMED_SKIP), final_norm=True, init=ZHUO_INIT),
            "Y = MHA(N(X)) + X; X' = FFN(N(Y)) + N(Y)",
            f"{ZHUO}, App. E eqs. 49-50",
        ),
        _preset(
            "post-pre",
            Layout(block=_block(NORMED_SKIP, PRE), final_norm=True, init=ZHUO_INIT),
            "Y = MHA(N(X)) + N(X); X' = FFN(N(Y)) + Y",
            f"{ZHUO}, App. E eqs. 51-52",
        ),
        _preset(
            "mix-ln",
            Layout(
                block=_block(PRE, PRE),
                rules=(LayerRule(LayerRange(None, 0.25), "attn", POST), LayerRule(LayerRange(None, 0.25), "mlp", POST)),
                final_norm=True,
            ),
            "Post-LN in the first floor(0.25 L) layers, Pre-LN after",
            f"Li et al. 2025 (Mix-LN), baseline in {ZHUO}",
        ),
        _preset(
            "deepnorm",
            Layout(block=_block(POST, POST), residual=Skip(alpha=DEEPNORM), init="deepnorm"),
            "x' = N(alpha x + F(x)), alpha = (2N)^(1/4), init gain beta = (8N)^(-1/4)",
            "Wang et al. 2022 (DeepNet), decoder-only constants",
        ),
        _preset(
            "pre-dyt",
            Layout(block=_block(PRE, PRE), final_norm=True, norm="dyt"),
            "x' = x + F(DyT(x)), final DyT; DyT(x) = gamma tanh(alpha x) + beta, alpha a learned scalar",
            "Zhu et al. 2025 (Transformers without Normalization), eq. 1: every norm of a Pre-LN model replaced",
        ),
        _preset(
            "pre-derf",
            Layout(block=_block(PRE, PRE), final_norm=True, norm="derf"),
            "x' = x + F(Derf(x)), final Derf; Derf(x) = gamma erf(alpha x + s) + beta, alpha and s learned scalars",
            "Chen et al. 2025 (Stronger Normalization-Free Transformers, arXiv 2512.10938): every norm of a "
            "Pre-LN model replaced (the authors' Dynamic_erf: alpha0, s from 0; their LM recipe's learned "
            "embedding scale is not part of this preset)",
        ),
        _preset(
            "peri-derf",
            Layout(block=_block(PERI, PERI), embed_norm=True, final_norm=True, norm="derf"),
            "x' = x + Derf(F(Derf(x))), y0 = Derf(emb), final Derf",
            f"Peri-LN ({KIM}) with Derf (Chen et al. 2025) at every site",
        ),
        _preset(
            "pre-seednorm",
            Layout(block=_block(PRE, PRE), final_norm=True, norm="seednorm"),
            "x' = x + F(SeeDNorm(x)), final SeeDNorm; SeeDNorm(x) = [tanh(x beta^T) alpha + gamma] * x / RMS(x)",
            "Cai et al. 2025 (SeeDNorm: Self-Rescaled Dynamic Normalization, arXiv 2510.22777), eq. 3: every norm "
            "of a Pre-LN model replaced (normlab's starts: beta 0, alpha 1, gamma 1, RMSNorm at init)",
        ),
        _preset(
            "pre-ssrms",
            Layout(block=_block(PRE, PRE), final_norm=True, gain="scalar"),
            "x' = x + F(s x / RMS(x)), s one learned scalar per norm (from 1); final norm the same",
            "Park et al. 2025 (Outlier-Safe Pre-Training, arXiv 2506.19697): single-scale RMSNorm on Pre-LN "
            "(flax RMSNorm with feature_axes=(); their Muon optimizer and embedding projection not included)",
        ),
        _preset(
            "pre-scale",
            Layout(block=_block(PRE, PRE), final_norm=True, norm="scale"),
            "x' = x + F(ScaleNorm(x)), final ScaleNorm; ScaleNorm(x) = g x / ‖x‖, g a learned scalar (sqrt(d))",
            "Nguyen & Salazar 2019 (Transformers without Tears), eq. 3: PreNorm with ScaleNorm",
        ),
        _preset(
            "rezero",
            Layout(residual=Skip(h=0.0, h_learned="scalar")),
            "x' = x + a F(x), a a learned scalar per sublayer starting at 0, no norms",
            "Bachlechner et al. 2021 (ReZero is All You Need), eq. 5",
        ),
        _preset(
            "pre-layerscale",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=Skip(h=0.1, h_learned="channel")),
            "x' = x + diag(lambda) F(N(x)), lambda learned per channel starting at 0.1, final N",
            "Touvron et al. 2021 (CaiT), eq. 3, on Pre-LN (epsilon 0.1 for models up to 18 layers)",
        ),
        _preset(
            "pre-gpas",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=Skip(gpas=True)),
            "y = x + F(N(x)); x' = y - SiLU(a) sg(y), a a learned scalar per sublayer from 0, "
            "sg stop-gradient; final N",
            "Chen et al. 2025 (GPAS, arXiv 2506.22049), Sec. 3 and Fig. 1 on Pre-LN (the authors' GPASBlock, gate "
            "from 0; their code shares one gate between a layer's two sublayers, here one per sublayer as in the text)",
        ),
        _preset(
            "pre-lambda",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=Skip(h_learned="scalar", skip_learned=True)),
            "x' = lambda_skip x + lambda_branch F(N(x)), both learned scalars per sublayer from 1; final N",
            "modded-nanogpt (Jordan et al. 2024-25) residual lambdas, per sublayer on Pre-LN (its x0 mixing and "
            "U-Net skips not included)",
        ),
        _preset(
            "pre-hc",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=Streams(n=4)),
            "H' = A_r^T H + B^T F(N(A_m^T H)), n = 4 streams; A_m, A_r, B static + s tanh(norm(H) W) dynamic; "
            "H_0 = 4 copies of the embedding; final N of the streams' sum",
            "Zhu et al. 2025 (Hyper-Connections, ICLR 2025), eqs. 5-8 and App. J Alg. 2, on Pre-LN (n = 4, "
            "dynamic, tanh; static init A_m = e_(k mod n), A_r = I, B = 1)",
        ),
        _preset(
            "pre-mhc",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=Streams(n=4, mix="mhc")),
            "x' = H_res x + H_post^T F(N(H_pre x)), n = 4; H_pre = sigmoid(.), H_post = 2 sigmoid(.), "
            "H_res = Sinkhorn-Knopp(exp(.)) doubly stochastic, each from RMSNorm(vec(x)); final N of the streams' sum",
            "Xie et al. 2025 (mHC: Manifold-Constrained Hyper-Connections, DeepSeek, arXiv 2512.24880), eqs. 7-9 "
            "on Pre-LN (n = 4, t_max = 20, gating factors from 0.01)",
        ),
        _preset(
            "ngpt",
            Layout(
                block=_block(
                    SublayerSites(output=True, after_add=True), SublayerSites(output=True, after_add=True), QK
                ),
                norm="l2",
                qk_after_rope=True,
                residual=Sphere(),
            ),
            "h <- Norm(h + a_A (Norm(Attn(h)) - h)); h <- Norm(h + a_M (Norm(MLP(h)) - h)); Norm(x) = x / ‖x‖; "
            "q, k = s_qk Norm(RoPE(.)), softmax scale sqrt(d_k); u, v = s_u, s_v sqrt(d) W h; z = s_z W_out h; "
            "every weight row normalized after each step",
            "Loshchilov et al. 2024 (nGPT, arXiv 2410.01131), Sec. 2 eqs. 10-11, 15-16, 19-20 and the authors' "
            "NVIDIA/ngpt code (a 0.05 and s_qk, s_z stored at 1/sqrt(d); s_u, s_v at 1; a used as abs(a))",
        ),
        _preset(
            "pre-lns",
            Layout(block=_block(PRE, PRE), final_norm=True, ln_scaling=True),
            "x' = x + F(N(x) / sqrt(l)), l the layer's index from 1, final N",
            "Sun et al. 2025 (The Curse of Depth), eq. 6: LayerNorm Scaling on Pre-LN",
        ),
        _preset(
            "admin",
            Layout(block=_block(POST, POST), residual=Skip(alpha=ADMIN)),
            "x' = N(omega * x + F(x)), omega a learned vector per sublayer, at init sqrt(sum_{j<i} Var f_j)",
            "Liu et al. 2020 (Understanding the Difficulty of Training Transformers), eq. 7 and Sec. 4.3 (Admin)",
        ),
        _preset(
            "normformer",
            Layout(block=_block(PERI_ATTN, PRE_HIDDEN, HEAD_SCALE), final_norm=True, norm="layer"),
            "x' = x + N(HeadScale-MHA(N(x))); x' = x + W2 N(act(W1 N(x))); LayerNorm",
            "Shleifer et al. 2021 (NormFormer), Fig. 1 and eqs. 1-3 (residual scaling lambda_resid off)",
        ),
        _preset(
            "sub-ln",
            Layout(block=_block(PRE, PRE_HIDDEN, SUB_LN_ATTN), final_norm=True, norm="layer", inner_span="full"),
            "x' = x + W_O N(Attn(N(x))); x' = x + W2 N(act(W1 N(x))); LayerNorm",
            "Wang et al. 2022 (Foundation Transformers / Magneto), Sub-LN (its init scaling not included)",
        ),
        _preset(
            "pre-gate",
            Layout(block=_block(PRE, PRE, GATE), final_norm=True),
            "x' = x + W_O (Attn(N(x)) * sigmoid(N(x) W_theta)); final N",
            "Qiu et al. 2025 (Gated Attention for LLMs), eq. 5 at G1, elementwise, on Pre-LN",
        ),
        _preset(
            "llama4-qk",
            Layout(
                block=_block(PRE, PRE, QK),
                final_norm=True,
                qk_after_rope=True,
                site_norms=(("q", SiteNorm(gain="none")), ("k", SiteNorm(gain="none"))),
            ),
            "x' = x + F(N(x)), attention with N(RoPE(Q)), N(RoPE(K)), N without a gain; final N",
            "Meta 2025 (Llama 4): QK-norm after RoPE, x / sqrt(mean(x^2) + eps) per head (its NoPE layers aside)",
        ),
        _preset(
            "gemma3",
            Layout(block=_block(PERI, PERI, QK), final_norm=True, embed_scale=True, gain="centered"),
            "y0 = sqrt(d) emb; x' = x + N(F_QK(N(x))), N(Q), N(K) per head; every gain 1 + w; final N",
            "Gemma Team 2025 (Gemma 3), Sec. 2: Gemma 2's Peri-LN with QK-norm in place of soft-capping",
        ),
        _preset(
            "qwen3",
            Layout(block=_block(PRE, PRE, QK), final_norm=True),
            "x' = x + F(N(x)), attention with N(Q), N(K) per head before RoPE; final N",
            "Qwen Team 2025 (Qwen3 Technical Report), Sec. 2: QK-Norm on Pre-LN",
        ),
        _preset(
            "keel",
            Layout(block=_block(PRE_POST, PRE_POST), residual=Skip(alpha=KEEL)),
            "x' = N(alpha x + F(N(x))), alpha = L = 2N (the number of sublayers), every sublayer; no final norm",
            "Chen & Wei 2026 (Post-LayerNorm Is Back: Keel, arXiv 2601.19895): x_(l+1) = LN(alpha x_l + "
            "F_l(LN(x_l))), alpha = L the number of sublayers; Post-LN with a Highway-style scaled skip and a norm "
            "inside the branch, no special init (its section numbers were not retrievable here)",
        ),
        _preset(
            "spannorm",
            Layout(
                block=_block(POST, SPAN_MLP),
                rules=(LayerRule(LayerRange(0, 1), "attn", PRE_POST),),
                init="spannorm",
            ),
            "y = N(x + Attn(x)); x' = N(x + FFN(y)): the skip spans the block (first block: Attn(N(x)) reads the "
            "normed embedding, its skip the raw one); W_O, W_down init std / sqrt(N)",
            "Wang et al. 2026 (SpanNorm, arXiv 2601.22580), eqs. 5-8 as read from a third-party adaptation (the "
            "paper's text was not retrievable here) and the abstract's variance-bounding scale as a 1/sqrt(N) "
            "output-projection init (see docs/layouts.md)",
        ),
        _preset(
            "attnres",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=AttnRes(blocks=8)),
            "h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i over v = [emb, b_1 .. b_(n-1)] (+ the partial sum b_n "
            "within block n), b_n the sum of block n's sublayer outputs f_l = F_l(N(h_l)), 8 blocks; w_l from 0; "
            "the output attends over every block, then final N",
            "Kimi Team 2026 (Attention Residuals, arXiv 2603.15031), Sec. 3.2 eqs. 2-6 (Block AttnRes, N = 8 "
            "blocks of ceil(2L/8) sublayers) and Fig. 2's code, on Pre-LN (MoonshotAI/Attention-Residuals)",
        ),
        _preset(
            "attnres-full",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=AttnRes(blocks=ATTN_RES_FULL)),
            "h_l = sum_{i<l} softmax_i(w_l . RMSNorm(v_i)) v_i, v_0 = emb, v_i = f_i(h_i) the i-th sublayer's "
            "output; f_l = F(N(h_l)); w_l from 0; the output attends over every v_i, then final N",
            "Kimi Team 2026 (Attention Residuals, arXiv 2603.15031), Sec. 3.1 eqs. 1-4 (Full AttnRes) on Pre-LN",
        ),
        _preset(
            "siamese",
            Layout(block=_block(PRE, PRE), final_norm=True, residual=Siamese()),
            "X^ = N_X(X); O = F(N(X^ + N_Y(Y))); X' = X^ + O / sqrt(2 (l + 1)); Y' = Y + O (per sublayer, block l); "
            "X_0 = Y_0 = emb; output N(N(X_L) + N(Y_L))",
            "SiameseNorm (arXiv 2602.08064, ICML 2026): a Post-Norm-like and a Pre-Norm-like stream through shared "
            "sublayers; the paper's text was not retrievable here: as the authors' code computes it "
            "(Qwen-Applications/SiameseNorm, deit-model-siamesenorm.py, the 1/c as in OLMo_model_hybrid_pre.py)",
        ),
        _preset("none", Layout(), "x' = x + F(x)", f"{KAN}, Table 1 'LN off'"),
        *_designs_2026h2(),
    ]
    return {p.name: p for p in presets}


def _designs_2026h2() -> list[Preset]:
    """Issue 67's norms: GatedNorm as marin ships it and its sandwich form, and TaperNorm."""
    gated = Layout(block=_block(PRE, PRE), embed_norm=True, final_norm=True, norm="gatednorm")
    return [
        _preset(
            "pre-gatednorm",
            gated,
            "y0 = G(emb); x' = x + F(G(x)); final G; G(x) = y * sigmoid(SiLU(y W_down) W_up), y = RMSNorm(x), rank "
            "128 (marin's, at every width)",
            "marin's grug MoE recipe (experiments/grug/moe/model.py: RMSNorm then GatedNorm at the embedding, before "
            "attention and the MLP, and before the head; after arXiv 2601.22966)",
        ),
        _preset(
            "sandwich-gatednorm",
            replace(gated, block=_block(PRE, PERI)),
            "as pre-gatednorm, and the MLP's output through RMSNorm then the gate before the add: x' = x + G(F(G(x)))",
            "marin issue 4993 (sandwich GatedNorm on the MLP path; failed marin's gate 1 at 0.83x)",
        ),
        _preset(
            "pre-taper",
            Layout(
                block=_block(PRE, PRE),
                final_norm=True,
                norm="taper",
                site_norms=(("final", SiteNorm(kind="rms")),),
            ),
            "x' = x + F(T(x)), T(x) = g RMSNorm(x) + (1 - g) c gamma~ x, g from 1 to 0 on the step's schedule; final "
            "RMSNorm (the scale anchor)",
            "Kanavalau et al. 2026 (TaperNorm, arXiv 2602.10408), Internal-Taper: every internal norm tapered, the "
            "final norm kept; the tapered input norms fold into the projections (normlab.model.taper_fold)",
        ),
    ]


PRESETS: dict[str, Preset] = _build()


def presets_table(names: bool = False, markdown: bool = False) -> str:
    """`normlab layouts`: the presets with string form, equation and source, as aligned columns, a Markdown
    table (docs/layouts.md's) or the names only."""
    rows = [(p.name, p.layout.to_string(), p.equation, p.source) for p in PRESETS.values()]
    if names:
        return "\n".join(r[0] for r in rows)
    if markdown:
        lines = ["| preset | string form | equation | source |", "|---|---|---|---|"]
        return "\n".join(lines + [f"| `{name}` | `{form}` | {eq} | {src} |" for name, form, eq, src in rows])
    heads = ("preset", "string form", "equation", "source")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads[:3])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*r) for r in [heads, *rows])
