"""Step 1 of Kan et al.'s workflow (App. B): well-posedness, decided from the layout data alone.

Per sublayer, what bounds the residual update u = h * N_B(f(N_A(x))):
- bounded      an output norm (B) sits on the branch: by Kan's Lemma 1 its output lies on the
               ellipsoid sum_i ((y_i - beta_i) / gamma_i)^2 = d, so the update has a size fixed by the
               norm's gamma and beta, whatever the module's weights (Theorem 4; Peri-LN, B-only, OLMo 2).
- tangential   no B, but a norm after the add (C): the stream stays on the ellipsoid, yet the update
               before the projection is unnormalized, so the tangential velocity is unbounded and the
               control problem degenerates (Kan App. J; Post-LN, DeepNorm).
- unbounded    neither: the update f(.) grows with the module's weights and activations (Kan
               Theorem 2; Pre-LN, HybridNorm's sublayers, no normalization at all).
The layout is well-posed only if every sublayer is bounded (the worst sublayer decides).

How a norm bounds depends on its kind: RMSNorm/LayerNorm fix the update on an ellipsoid, ScaleNorm and
L2 on a sphere (of radius |g| or 1), DyT and Derf squash it entry by entry into a box (|u_i| <= |gamma_i| + |beta_i|)
that bounds it from above without fixing its size. A learned step h (ReZero, LayerScale) scales every
bound by its current value, which training can grow: the verdict says so.

The 2026 residual forms change what carries the stream, not what bounds an update, so their sublayers are judged by
their sites as any other and `stream_path` says what carries the stream: Keel (A+C with the skip scaled by the
number of sublayers: tangential, as Post-LN), SpanNorm (C with the MLP's skip from the block's input: tangential)
and Attention Residuals (on Pre-LN's sites, unbounded in the weights, but each sublayer reads a convex mix of the
embedding and the block sums, so the stream does not grow with depth beyond one block).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from normlab.layout.norm_kinds import NORM_FACTS
from normlab.layout.sites import (
    ATTN_RES_FULL,
    KEEL,
    AttentionInnerSites,
    Layout,
    NormSpec,
    ResolvedLayout,
    SublayerSites,
    attn_res_block_size,
)

ORDER = {"bounded": 0, "tangential": 1, "unbounded": 2}
VERDICT = {"bounded": "well-posed", "tangential": "degenerate (tangential)", "unbounded": "ill-posed (unbounded)"}


@dataclass(frozen=True)
class SublayerVerdict:
    layers: str  # e.g. "0-5" or "0"
    sublayer: str  # attn | mlp
    kind: str  # bounded | tangential | unbounded
    why: str


def classify(
    sites: SublayerSites,
    inner: AttentionInnerSites | None,
    h: float,
    out: NormSpec | None = None,
    after: NormSpec | None = None,
    h_learned: str | None = None,
    hidden: bool = False,
) -> tuple[str, str]:
    """One sublayer's verdict and why, by the kinds of its B and C norms (RMSNorm when not given)."""
    step = (
        f"h={h:g}"
        if h_learned is None
        else f"h learned ({h_learned}, from {h:g}): the bound moves with h, which training can grow"
    )
    # what an output norm (B) of each kind bounds (u = h * N_B(.) whatever the module's weights) and what a norm after
    # the add (C) does to the stream: each kind's row of normlab.layout.norm_kinds, read here (a kind registered since)
    if sites.output:
        kind = out.kind if out is not None else "rms"
        gain = {"none": " (no gain: gamma = 1, beta = 0)", "scalar": " (one scalar gain)"}.get(
            out.gain if out is not None else "gamma", ""
        )
        return (
            "bounded",
            f"output norm (B, {kind}{gain}): {NORM_FACTS[kind].output_bound}, with {step}, "
            "whatever the module's weights",
        )
    if sites.after_add:
        kind = after.kind if after is not None else "rms"
        return "tangential", (
            f"norm after the add (C, {kind}) only: {NORM_FACTS[kind].after_add}, "
            "but the update before it is unnormalized, so its tangential speed is unbounded (Kan App. J)"
        )
    notes = []
    if inner is not None and inner.context:
        notes.append("the context norm (c) bounds W_O's input, not W_O's output")
    if inner is not None and (inner.v or inner.q or inner.k):
        notes.append("q/k/v norms act inside attention and leave the output projection free")
    if inner is not None and (inner.gate or inner.head_scale):
        notes.append("the gate (in (0, 1)) and head scales rescale W_O's input, not its output")
    if hidden:
        notes.append("the hidden norm (H) bounds W2's input, not its output")
    if sites.skip_normed:
        notes.append("the normalized skip resets the carried stream, but the added update is still free")
    if sites.skip_block:
        notes.append("the skip is the block's input, but the added update is still free")
    base = (
        "no norm on the module output: the update f(.) grows with the module's weights and activations "
        "(Kan Theorem 2, as Pre-LN)"
    )
    return "unbounded", base + ("; " + "; ".join(notes) if notes else "")


def _span(idx: list[int]) -> str:
    return (
        str(idx[0])
        if len(idx) == 1
        else f"{idx[0]}-{idx[-1]}"
        if idx == list(range(idx[0], idx[-1] + 1))
        else ",".join(map(str, idx))
    )


def wellposedness(resolved: ResolvedLayout) -> dict:
    """The per-sublayer verdicts (grouped over layers) and the layout's verdict."""
    lay = resolved.layout
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, blk in enumerate(resolved.blocks):
        for name, sites, inner in (("attn", blk.attn, blk.attn_inner), ("mlp", blk.mlp, None)):
            kind, why = classify(
                sites,
                inner,
                lay.h,
                lay.norm_at(f"{name}.B"),
                lay.norm_at(f"{name}.C"),
                lay.h_learned,
                hidden=sites.hidden,
            )
            groups.setdefault((name, kind, why), []).append(i)
    verdicts = [SublayerVerdict(_span(idx), name, kind, why) for (name, kind, why), idx in groups.items()]
    verdicts.sort(key=lambda v: (int(v.layers.split("-")[0].split(",")[0]), v.sublayer))
    worst = max((v.kind for v in verdicts), key=ORDER.__getitem__)
    return {
        "verdict": VERDICT[worst],
        "worst": worst,
        "sublayers": [asdict(v) for v in verdicts],
        "stream": stream_path(lay, resolved.n_layers),
    }


def stream_path(lay: Layout, n_layers: int | None = None) -> str:
    """What carries the stream from one sublayer to the next, when it is not the unit-weight identity: the verdicts
    above bound the update; these scale or mix what it is added to."""
    notes = []
    if lay.skip_learned:
        notes.append(
            "a learned skip scale lambda (from 1): the carried stream is multiplied by it each sublayer, so "
            "a lambda above 1 compounds over depth (no Theorem 4 bound)"
        )
    if lay.gpas:
        notes.append(
            "GPAS: the stream is multiplied by 1 - SiLU(a) after each sublayer (a learned from 0; at most "
            "1.28 as SiLU >= -0.28), its gradient left whole"
        )
    if lay.streams > 1:
        notes.append(
            f"{lay.streams} streams mixed by "
            + (
                "hyper-connections (Zhu et al. 2025): res = A_r^T is unconstrained, so its product over "
                "depth can amplify (the screen's hc_gain)"
                if lay.stream_mix == "hc"
                else "mHC (Xie et al. 2025): res is doubly stochastic (Sinkhorn-Knopp), so its product over depth "
                "has gain <= 1 in both directions (the screen's hc_gain), and post <= 2 scales each update"
            )
        )
    if lay.alpha == KEEL:
        notes.append(
            "Keel's skip scale alpha = 2N, the number of sublayers (Chen & Wei 2026): the carried stream enters each "
            "norm after the add alpha times as heavy as an update of its size, so one sublayer turns the normalized "
            "stream by about 1/alpha and the gradient through the skip is not halved at every norm as in Post-LN"
        )
    if any(s.skip_block for s in [lay.block.mlp] + [r.sites for r in lay.rules]):
        notes.append(
            "SpanNorm's whole-block skip (W): the MLP adds to the block's input, so the stream passes one norm per "
            "block (the MLP's C) and the attention sublayer's output only feeds the MLP (Wang et al. 2026)"
        )
    if lay.attn_res is not None:
        size = attn_res_block_size(lay.attn_res, n_layers) if n_layers else None
        blocks = (
            "each sublayer's output its own source"
            if lay.attn_res == ATTN_RES_FULL
            else f"{lay.attn_res} blocks" + (f" of {size} sublayers" if size else "")
        )
        notes.append(
            f"Attention Residuals over depth ({blocks}; Kimi Team 2026): each sublayer reads a softmax-weighted "
            "average of the embedding and the blocks' sums (weights >= 0 summing to 1), so its input is no larger "
            "than its largest source and the sums grow within a block only, not with depth; each update is bounded "
            "only as its sites say"
        )
    return "; ".join(notes) or "identity (unit-weight sum)"


def all_output_normalized(resolved: ResolvedLayout) -> bool:
    """Theorem 4's premise: every sublayer adds h * N_B(.) to an unnormalized identity path (not a learned skip
    scale, GPAS's rescaled stream, a hyper-connection's mixing of several streams, nor Attention Residuals' depth
    attention)."""
    lay = resolved.layout
    if lay.skip_learned or lay.gpas or lay.streams > 1 or lay.attn_res is not None:
        return False
    return all(
        s.output and not s.after_add and not s.skip_normed for blk in resolved.blocks for s in (blk.attn, blk.mlp)
    )
