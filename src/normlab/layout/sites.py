"""Where the norms sit: a normalization layout as plain data.

A Transformer block is two residual sublayers (attention, then MLP). Each sublayer has three
*sites* a norm can occupy (Kim et al. 2025, Fig. 2) plus one switch on where its skip is taken:

    input      (A)  f(N(x))            Pre-LN, Kim eq. (2)
    output     (B)  x + N(f(.))        Peri-LN / OLMo 2 "reordered norm", Kim eq. (3)
    after_add  (C)  N(x + f(.))        Post-LN, Kim eq. (1)
    skip_normed     N(x) + f(N(x))     the skip comes from the normalized input, Zhuo eq. (9)

and the attention sublayer has four more inside it, on the per-head Query, Key, Value and
Context (attention output before W_O) -- Zhuo et al. 2025 eqs. (7), (35)-(39).

One sublayer therefore computes (Kan et al. 2025, Sec. 5, with DeepNorm's skip scale alpha)::

    u    = N_A(x)                        # identity when A is off
    skip = u if skip_normed else x
    x'   = N_C(alpha * skip + h * N_B(f(u)))

Model-level norms (embedding norm, final norm) and the scales h and alpha complete a `Layout`.
Per-layer differences (HybridNorm*'s first block, Mix-LN's Post-LN prefix) are `LayerRule`s,
and `resolve(layout, n_layers)` turns everything into one concrete `BlockLayout` per layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Literal

from normlab.errors import LayoutError

NormKind = Literal["rms", "layer", "dyt", "scale", "l2"]
InnerSpan = Literal["head", "full"]

# rms: Zhang & Sennrich 2019; layer: Ba et al. 2016; dyt: Dynamic Tanh, Zhu et al. 2025; scale: ScaleNorm,
# Nguyen & Salazar 2019; l2: x / ||x||, no gain (normlab.model.norms)
NORM_KINDS: tuple[str, ...] = ("rms", "layer", "dyt", "scale", "l2")
H_LEARNED: tuple[str, ...] = ("scalar", "channel")
# A norm's per-channel gain: gamma (the usual, 1 at init), none (no gain), or centered: stored as w from 0
# and applied as 1 + w, so weight decay pulls the gain toward 1, not 0 (Gemma's RMSNorm; Qwen3-Next)
GAINS: tuple[str, ...] = ("gamma", "none", "centered")
INNER_SPANS: tuple[str, ...] = ("head", "full")
DEEPNORM = "deepnorm"


@dataclass(frozen=True)
class SublayerSites:
    """Norm sites around one residual sublayer (attention or MLP)."""

    input: bool = False  # A: f(N(x))
    output: bool = False  # B: x + N(f(.))
    after_add: bool = False  # C: N(x + f(.))
    skip_normed: bool = False  # skip = N_A(x) instead of x (HybridNorm FFN, Zhuo eq. 9)

    def __post_init__(self) -> None:
        if self.skip_normed and not self.input:
            raise LayoutError(
                "skip_normed (S) takes the residual from the input norm's output, so it needs the "
                "input norm (A) too: use 'AS', not 'S'"
            )

    @property
    def n_norms(self) -> int:
        return int(self.input) + int(self.output) + int(self.after_add)


@dataclass(frozen=True)
class AttentionInnerSites:
    """Norms inside attention (Zhuo eqs. 7, 35-39): on Q and K before the logits (QK-norm),
    on V, and on the per-head context softmax(QK^T/sqrt(d_k))V before W_O."""

    q: bool = False
    k: bool = False
    v: bool = False
    context: bool = False

    @property
    def n_norms(self) -> int:
        return int(self.q) + int(self.k) + int(self.v) + int(self.context)


@dataclass(frozen=True)
class BlockLayout:
    """The norms of one Transformer block."""

    attn: SublayerSites = field(default_factory=SublayerSites)
    attn_inner: AttentionInnerSites = field(default_factory=AttentionInnerSites)
    mlp: SublayerSites = field(default_factory=SublayerSites)


@dataclass(frozen=True)
class LayerRange:
    """A half-open range of layers [start, stop), each end a layer index or a fraction of depth.

    Fractions resolve with floor, as Mix-LN's "first floor(alpha * L) layers" (Li et al. 2025).
    Negative indices count from the end, as in Python slices; ``None`` means the open end.
    """

    start: int | float | None = None
    stop: int | float | None = None

    def __post_init__(self) -> None:
        for end in (self.start, self.stop):
            if isinstance(end, float) and not 0.0 <= end <= 1.0:
                raise LayoutError(f"a layer fraction must lie in [0, 1], got {end}")

    def indices(self, n_layers: int) -> range:
        def at(end: int | float | None, default: int) -> int:
            if end is None:
                return default
            if isinstance(end, float):
                return math.floor(end * n_layers)
            return end + n_layers if end < 0 else end

        start, stop = at(self.start, 0), at(self.stop, n_layers)
        if not 0 <= start <= n_layers or not 0 <= stop <= n_layers:
            raise LayoutError(
                f"layer range {self} lies outside the model's {n_layers} layers (valid: 0..{n_layers})"
            )
        return range(start, stop)

    def __str__(self) -> str:
        def fmt(end: int | float | None) -> str:
            if end is None:
                return ""
            if isinstance(end, float):
                return f"{end * 100:g}%"
            return str(end)

        return f"{fmt(self.start)}:{fmt(self.stop)}"


@dataclass(frozen=True)
class LayerRule:
    """Override one sublayer's sites (and for attention its inner norms) on a range of layers."""

    layers: LayerRange
    sublayer: Literal["attn", "mlp"]
    sites: SublayerSites
    inner: AttentionInnerSites | None = None  # attention only

    def __post_init__(self) -> None:
        if self.sublayer not in ("attn", "mlp"):
            raise LayoutError(f"a layer rule overrides 'attn' or 'mlp', not {self.sublayer!r}")
        if self.sublayer == "mlp" and self.inner is not None:
            raise LayoutError("q/k/v/context norms live inside attention; an mlp rule cannot set them")


@dataclass(frozen=True)
class Layout:
    """A complete normalization layout: per-block sites, per-layer rules, model-level norms.

    Equality compares the structure only; ``name`` is a label (a preset's name, or None).
    """

    block: BlockLayout = field(default_factory=BlockLayout)
    rules: tuple[LayerRule, ...] = ()
    embed_norm: bool = False  # y_0 = N(x_embed), Kim Sec. 3.3 (optional embedding norm)
    final_norm: bool = False  # y_L = N(x_L) before the LM head
    norm: NormKind = "rms"
    inner_span: InnerSpan = "head"  # q/k/v/context norms per head (Zhuo, Gemma 3) or over all heads (OLMo 2)
    h: float = 1.0  # residual branch scale, Kan et al. Sec. 5 (h = 1: standard Transformer); learned: its start
    # h as a learned parameter per sublayer: "scalar" (ReZero, Bachlechner et al. 2021: starts at 0) or
    # "channel" (LayerScale, Touvron et al. 2021: one per channel, starts small); None: the fixed number h
    h_learned: str | None = None
    ln_scaling: bool = False  # LayerNorm Scaling (Sun et al. 2025): the input norm's output times 1/sqrt(layer)
    gain: str = "gamma"  # the norms' gain: gamma | none | centered (1 + w); rms, layer and dyt have one
    alpha: float | str = 1.0  # skip scale; "deepnorm" = (2N)^(1/4), Wang et al. 2022
    freeze_output_gamma: bool = False  # Output-LN (B) gamma fixed at 1, Kim Fig. 8
    embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (Gemma)
    init: str | None = None  # the init scheme the layout prescribes (DeepNorm's beta), else None
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS:
            raise LayoutError(f"unknown norm kind {self.norm!r}; valid: {', '.join(NORM_KINDS)}")
        if self.inner_span not in INNER_SPANS:
            raise LayoutError(
                f"unknown inner-norm span {self.inner_span!r}; valid: {', '.join(INNER_SPANS)}"
            )
        if self.gain not in GAINS:
            raise LayoutError(f"unknown gain {self.gain!r}; valid: {', '.join(GAINS)}")
        if self.gain != "gamma" and self.norm in ("scale", "l2"):
            raise LayoutError(f"norm={self.norm} has no per-channel gain to change (ScaleNorm's is one scalar g, "
                              "L2's none); gain= applies to rms, layer and dyt")
        if self.h_learned not in (None, *H_LEARNED):
            raise LayoutError(f"h_learned must be one of {', '.join(H_LEARNED)} (or None), got {self.h_learned!r}")
        # h may be 0 only where it is learned (ReZero starts there); `resolve` refuses a fixed 0, which would
        # remove every update (checked there: the string form sets h before h-scalar)
        if not (isinstance(self.h, (int, float)) and math.isfinite(self.h) and self.h >= 0):
            raise LayoutError(f"residual scale h must be a finite number > 0 (>= 0 when learned), got {self.h!r}")
        if isinstance(self.alpha, str):
            if self.alpha != DEEPNORM:
                raise LayoutError(f"alpha must be a number > 0 or {DEEPNORM!r}, got {self.alpha!r}")
        elif not (math.isfinite(self.alpha) and self.alpha > 0):
            raise LayoutError(f"skip scale alpha must be a finite number > 0, got {self.alpha!r}")
        # An attention rule without its own inner norms keeps the base block's: store that
        # explicitly, so equal layouts compare equal and the string form round-trips.
        rules = tuple(
            replace(r, inner=self.block.attn_inner) if r.sublayer == "attn" and r.inner is None else r
            for r in self.rules
        )
        object.__setattr__(self, "rules", rules)
        if self.freeze_output_gamma and not self._any_output_site():
            raise LayoutError(
                "freeze_output_gamma freezes the output norm (B), but this layout has no B site"
            )

    def _any_output_site(self) -> bool:
        if self.block.attn.output or self.block.mlp.output:
            return True
        return any(rule.sites.output for rule in self.rules)

    def with_(self, **changes: object) -> Layout:
        """A copy with fields changed (and the preset name dropped unless given)."""
        changes.setdefault("name", None)
        return replace(self, **changes)

    def with_qk_norm(self) -> Layout:
        """Add QK-norm (Wortsman et al. 2024) to every layer, whatever else the layout does."""
        block = replace(self.block, attn_inner=replace(self.block.attn_inner, q=True, k=True))
        rules = tuple(
            replace(r, inner=replace(r.inner, q=True, k=True)) if r.inner is not None else r
            for r in self.rules
        )
        return self.with_(block=block, rules=rules)

    def resolve(self, n_layers: int) -> ResolvedLayout:
        if self.h == 0 and self.h_learned is None:
            raise LayoutError("h=0 with a fixed h removes every update; learn it from 0 with h-scalar (ReZero) "
                              "or h-channel, or give h > 0")
        return resolve(self, n_layers)

    def to_string(self) -> str:
        from normlab.layout.spec import format_layout

        return format_layout(self)

    @property
    def label(self) -> str:
        """The preset name if this is one, else the string form."""
        return self.name or self.to_string()

    @property
    def slug(self) -> str:
        """A filename-safe label."""
        return re.sub(r"[^A-Za-z0-9._+=-]+", "_", self.label)


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout made concrete for a given depth: one `BlockLayout` per layer, numeric alpha."""

    layout: Layout
    blocks: tuple[BlockLayout, ...]
    alpha: float

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def table(self) -> str:
        """The per-layer printout shown at build time."""
        from normlab.layout.spec import format_inner, format_sites

        lay = self.layout
        head = (
            f"layout {lay.label}: norm={lay.norm}, embed_norm={'on' if lay.embed_norm else 'off'}, "
            f"final_norm={'on' if lay.final_norm else 'off'}, h={lay.h:g}, alpha={self.alpha:.4g}"
        )
        lines = [head, "  layer  attn(inner)  attn   mlp"]
        for i, blk in enumerate(self.blocks):
            inner = format_inner(blk.attn_inner) or "-"
            lines.append(
                f"  {i:>5}  {inner:<11}  {format_sites(blk.attn) or '-':<5}  {format_sites(blk.mlp) or '-'}"
            )
        return "\n".join(lines)


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNorm's skip scale for a decoder-only model of N layers: (2N)^(1/4) (Wang et al. 2022)."""
    return (2.0 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNorm's init gain on FFN, V and output projections: (8N)^(-1/4) (Wang et al. 2022)."""
    return (8.0 * n_layers) ** -0.25


def resolve(layout: Layout, n_layers: int) -> ResolvedLayout:
    """Apply the layer rules to the base block; reject two rules claiming the same sublayer."""
    if not isinstance(n_layers, int) or n_layers < 1:
        raise LayoutError(f"n_layers must be a positive integer, got {n_layers!r}")
    blocks = [layout.block] * n_layers
    claimed: dict[tuple[int, str], LayerRule] = {}
    for rule in layout.rules:
        for i in rule.layers.indices(n_layers):
            prior = claimed.get((i, rule.sublayer))
            if prior is not None:
                raise LayoutError(
                    f"layer {i} {rule.sublayer}: claimed by both rule [{prior.layers}] and "
                    f"rule [{rule.layers}]; make the layer ranges disjoint"
                )
            claimed[(i, rule.sublayer)] = rule
            blk = blocks[i]
            if rule.sublayer == "attn":
                inner = rule.inner if rule.inner is not None else blk.attn_inner
                blocks[i] = replace(blk, attn=rule.sites, attn_inner=inner)
            else:
                blocks[i] = replace(blk, mlp=rule.sites)
    alpha = deepnorm_alpha(n_layers) if layout.alpha == DEEPNORM else float(layout.alpha)
    return ResolvedLayout(layout=layout, blocks=tuple(blocks), alpha=alpha)
