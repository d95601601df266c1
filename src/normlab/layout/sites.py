"""Where the norms sit: a normalization layout as plain data.

A Transformer block is two residual sublayers (attention, then MLP). Each sublayer has three
*sites* a norm can occupy (Kim et al. 2025, Fig. 2) plus one switch on where its skip is taken:

    input      (A)  f(N(x))            Pre-LN, Kim eq. (2)
    output     (B)  x + N(f(.))        Peri-LN / OLMo 2 "reordered norm", Kim eq. (3)
    after_add  (C)  N(x + f(.))        Post-LN, Kim eq. (1)
    skip_normed     N(x) + f(N(x))     the skip comes from the normalized input, Zhuo eq. (9)
    skip_block      N(x_in + f(.))     (MLP only) the skip is the block's input x_in, not the MLP's (SpanNorm)

and the attention sublayer has four more inside it, on the per-head Query, Key, Value and
Context (attention output before W_O) -- Zhuo et al. 2025 eqs. (7), (35)-(39).

One sublayer therefore computes (Kan et al. 2025, Sec. 5, with DeepNorm's skip scale alpha)::

    u    = N_A(x)                        # identity when A is off
    skip = u if skip_normed else x
    x'   = N_C(alpha * skip + h * N_B(f(u)))

How the update enters the stream (the skip and its scales, n streams, Attention Residuals' read over depth, nGPT's
sphere, SiameseNorm's two streams) is the layout's one `residual` variant (normlab.layout.residual). Model-level
norms (embedding norm, final norm) complete a `Layout`. Each site's norm is the layout's kind and gain unless
`site_norms` names another (`SiteNorm`, `norm_at`).
Per-layer differences (HybridNorm*'s first block, Mix-LN's Post-LN prefix) are `LayerRule`s,
and `resolve(layout, n_layers)` turns everything into one concrete `BlockLayout` per layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from normlab.errors import LayoutError
from normlab.layout.norm_kinds import NORM_FACTS, NORM_KIND_FACTS
from normlab.layout.residual import ADMIN, AttnRes, Residual, ResidualOptions, Skip, Sphere, Streams
from normlab.layout.residual import ATTN_RES_FULL as ATTN_RES_FULL  # read from here by older imports
from normlab.layout.residual import KEEL as KEEL  # read from here by older imports
from normlab.layout.residual import STREAM_MIXES as STREAM_MIXES
from normlab.layout.residual import attn_res_block_size as attn_res_block_size

# A norm kind's name (one of NORM_KINDS); every kind's facts are a row of normlab.layout.norm_kinds
NormKind = str
InnerSpan = Literal["head", "full"]

NORM_KINDS: tuple[str, ...] = tuple(NORM_FACTS)
# the point-wise kinds with a learned input scale alpha started at alpha0 (DyT, Derf)
ALPHA_KINDS: tuple[str, ...] = tuple(f.name for f in NORM_KIND_FACTS if f.pointwise)
# A norm's gain: gamma (per channel, the usual, 1 at init), none (no gain), centered: stored as w from 0
# and applied as 1 + w, so weight decay pulls the gain toward 1, not 0 (Gemma's RMSNorm; Qwen3-Next), or
# scalar: one learned number from 1 for all channels (the single-scale RMSNorm of Outlier-Safe
# Pre-Training, Park et al. 2025, arXiv 2506.19697: no per-channel scale for outliers to grow in)
GAINS: tuple[str, ...] = ("gamma", "none", "centered", "scalar")
INNER_SPANS: tuple[str, ...] = ("head", "full")
# How attention turns its logits into weights (normlab.model.attention): softmax; a learned logit per head in
# the denominator (GPT-OSS's sinks); a fixed sink logit 0 (Evan Miller's off-by-one softmax_1); softpick
# (Zuhri et al. 2025, arXiv 2504.20966: ReLU(e^x - 1) / sum |e^x - 1|, weights that need not sum to 1)
ATTN_SOFTMAX: tuple[str, ...] = ("softmax", "sink", "off-by-one", "softpick")
# Every norm site by name, for per-site kinds and gains (`SiteNorm`): a sublayer's A/B/C (and the MLP's
# hidden H), the inner q/k/v/c, and the model's embedding and final norms. A, B, C name both sublayers.
NORM_SITES: tuple[str, ...] = (
    "attn.A",
    "attn.B",
    "attn.C",
    "mlp.A",
    "mlp.B",
    "mlp.C",
    "mlp.H",
    "q",
    "k",
    "v",
    "c",
    "emb",
    "final",
)
SITE_GROUPS: dict[str, tuple[str, ...]] = {
    "A": ("attn.A", "mlp.A"),
    "B": ("attn.B", "mlp.B"),
    "C": ("attn.C", "mlp.C"),
    "H": ("mlp.H",),
}
_GAINED = tuple(f.name for f in NORM_KIND_FACTS if f.gained)  # the kinds with a gain to choose

# The norm sites by what their output feeds (arXiv 2605.26895, "Negligible in size, significant in effect": weight
# decay helps the gains of norms whose output feeds a linear map and hurts those after a sublayer). Input norms feed
# a projection: A (the sublayer's Q/K/V or W1), H (W2), q and k (the dot product), v and c (W_O), and the final norm
# (the head). Output norms sit after a sublayer or its add: B, C, and the embedding norm (after the embedding, into
# the stream). The optimizer's per-kind weight decay and learning rate read this (normlab.train.optim).
GAIN_KINDS: dict[str, tuple[str, ...]] = {
    "input": ("attn.A", "mlp.A", "mlp.H", "q", "k", "v", "c", "final"),
    "output": ("attn.B", "attn.C", "mlp.B", "mlp.C", "emb"),
}


@dataclass(frozen=True)
class SiteNorm:
    """What one norm site holds where it differs from the layout's defaults (None: the default).

    kind: the norm at this site (``Layout.norm`` otherwise); gain: its gain (``Layout.gain`` otherwise);
    alpha0: DyT's or Derf's initial alpha at this site (the model's ``dyt_alpha`` otherwise): Zhu et al. 2025
    Sec. 7 give language models a larger alpha0 in attention blocks than in FFN blocks and the final norm.
    """

    kind: str | None = None
    gain: str | None = None
    alpha0: float | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in NORM_KINDS:
            raise LayoutError(f"unknown norm kind {self.kind!r}; valid: {', '.join(NORM_KINDS)}")
        if self.gain is not None and self.gain not in GAINS:
            raise LayoutError(f"unknown gain {self.gain!r}; valid: {', '.join(GAINS)}")
        if self.alpha0 is not None and not (math.isfinite(self.alpha0) and self.alpha0 > 0):
            raise LayoutError(
                f"alpha0 must be a finite number > 0 (DyT's or Derf's initial alpha), got {self.alpha0!r}"
            )

    def merged(self, other: SiteNorm) -> SiteNorm:
        """This with ``other``'s set fields on top."""
        return SiteNorm(
            kind=other.kind if other.kind is not None else self.kind,
            gain=other.gain if other.gain is not None else self.gain,
            alpha0=other.alpha0 if other.alpha0 is not None else self.alpha0,
        )


@dataclass(frozen=True)
class NormSpec:
    """The norm one site holds, resolved: kind, gain, and DyT's/Derf's alpha0 (None: the model's dyt_alpha)."""

    kind: str
    gain: str
    alpha0: float | None = None


@dataclass(frozen=True)
class SublayerSites:
    """Norm sites around one residual sublayer (attention or MLP)."""

    input: bool = False  # A: f(N(x))
    output: bool = False  # B: x + N(f(.))
    after_add: bool = False  # C: N(x + f(.))
    skip_normed: bool = False  # skip = N_A(x) instead of x (HybridNorm FFN, Zhuo eq. 9)
    # H: a norm on the MLP's hidden activation, before its last projection: W2 N(act(x W1)) (NormFormer,
    # Shleifer et al. 2021 Fig. 1 "FFN LN"; Sub-LN / Magneto, Wang et al. 2022). MLP only.
    hidden: bool = False
    # W: the skip is the block's input (before the attention sublayer), not this sublayer's: SpanNorm's residual
    # spanning the whole block (Wang et al. 2026, arXiv 2601.22580), x' = N_C(x_block + FFN(y)). MLP only.
    skip_block: bool = False

    def __post_init__(self) -> None:
        if self.skip_normed and not self.input:
            raise LayoutError(
                "skip_normed (S) takes the residual from the input norm's output, so it needs the "
                "input norm (A) too: use 'AS', not 'S'"
            )
        if self.skip_normed and self.skip_block:
            raise LayoutError(
                "S (skip from the normed input) and W (skip from the block's input) both choose where the skip "
                "comes from; give one of them"
            )

    @property
    def n_norms(self) -> int:
        """The d_model-wide norms (A, B, C); the hidden norm H is over the MLP's width."""
        return int(self.input) + int(self.output) + int(self.after_add)


@dataclass(frozen=True)
class AttentionInnerSites:
    """Norms inside attention (Zhuo eqs. 7, 35-39): on Q and K before the logits (QK-norm),
    on V, and on the per-head context softmax(QK^T/sqrt(d_k))V before W_O; and two sites that scale the
    context instead of normalizing it: a sigmoid gate from the sublayer's input (gated attention, Qiu et
    al. 2025 eq. 5 at position G1: Y' = Y * sigmoid(X W_theta), elementwise) and a learned scale per head
    (NormFormer's HeadScale, Shleifer et al. 2021 eq. 3). Their order on the context Y::

        Y -> gate -> N_c -> head scale -> W_O
    """

    q: bool = False
    k: bool = False
    v: bool = False
    context: bool = False
    gate: bool = False
    head_scale: bool = False

    @property
    def n_norms(self) -> int:
        return int(self.q) + int(self.k) + int(self.v) + int(self.context)


@dataclass(frozen=True)
class BlockLayout:
    """The norms of one Transformer block."""

    attn: SublayerSites = field(default_factory=SublayerSites)
    attn_inner: AttentionInnerSites = field(default_factory=AttentionInnerSites)
    mlp: SublayerSites = field(default_factory=SublayerSites)

    def __post_init__(self) -> None:
        if self.attn.hidden:
            raise LayoutError("the hidden norm (H) sits inside the MLP, after its activation; attention has none")
        if self.attn.skip_block:
            raise LayoutError(_W_ON_ATTN)


_W_ON_ATTN = (
    "W takes the MLP's skip from the block's input (SpanNorm); attention's input is the block's input already, "
    "so W is an MLP site only"
)


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
            raise LayoutError(f"layer range {self} lies outside the model's {n_layers} layers (valid: 0..{n_layers})")
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
        if self.sublayer == "attn" and self.sites.hidden:
            raise LayoutError("the hidden norm (H) sits inside the MLP, after its activation; attention has none")
        if self.sublayer == "attn" and self.sites.skip_block:
            raise LayoutError(_W_ON_ATTN)


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
    # the residual path: one variant of normlab.layout.residual (Skip, Streams, AttnRes, Sphere, Siamese), its
    # options its own fields; the read-only views `h`, `alpha`, `streams`, ... below read them
    residual: Residual = field(default_factory=Skip)
    ln_scaling: bool = False  # LayerNorm Scaling (Sun et al. 2025): the input norm's output times 1/sqrt(layer)
    gain: str = "gamma"  # the norms' gain: gamma | none | centered (1 + w) | scalar; rms, layer, dyt, derf have one
    # per-site kinds, gains and DyT alpha0 where they differ from norm/gain above: (site, SiteNorm) pairs in
    # NORM_SITES order, one per site
    site_norms: tuple[tuple[str, SiteNorm], ...] = ()
    # Q/K norms after RoPE instead of before it (Llama 4's gain-free QK-norm). Without a gain it equals the
    # norm before RoPE (RoPE rotates pairs of channels, which keeps the head's norm); with one it does not.
    qk_after_rope: bool = False
    softmax: str = "softmax"  # attention's normalization of its logits: one of ATTN_SOFTMAX
    freeze_output_gamma: bool = False  # Output-LN (B) gamma fixed at 1, Kim Fig. 8
    embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (Gemma)
    init: str | None = None  # the init scheme the layout prescribes (DeepNorm's beta), else None
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS:
            raise LayoutError(f"unknown norm kind {self.norm!r}; valid: {', '.join(NORM_KINDS)}")
        if self.inner_span not in INNER_SPANS:
            raise LayoutError(f"unknown inner-norm span {self.inner_span!r}; valid: {', '.join(INNER_SPANS)}")
        if self.gain not in GAINS:
            raise LayoutError(f"unknown gain {self.gain!r}; valid: {', '.join(GAINS)}")
        if self.softmax not in ATTN_SOFTMAX:
            raise LayoutError(f"unknown attention softmax {self.softmax!r}; valid: {', '.join(ATTN_SOFTMAX)}")
        if self.gain != "gamma" and self.norm not in _GAINED:
            raise LayoutError(
                f"norm={self.norm} has no per-channel gain to change (ScaleNorm's is one scalar g, "
                "L2's none); gain= applies to rms, layer, dyt and derf"
            )
        if not isinstance(self.residual, Residual):
            raise LayoutError(
                f"a layout's residual is one of normlab.layout.residual's variants, not {type(self.residual).__name__}"
            )
        # An attention rule without its own inner norms keeps the base block's: store that
        # explicitly, so equal layouts compare equal and the string form round-trips.
        rules = tuple(
            replace(r, inner=self.block.attn_inner) if r.sublayer == "attn" and r.inner is None else r
            for r in self.rules
        )
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "site_norms", _canonical_site_norms(self.site_norms))
        if self.freeze_output_gamma and not self._any_output_site():
            raise LayoutError("freeze_output_gamma freezes the output norm (B), but this layout has no B site")

    # The residual options as read-only views of the variant (normlab.layout.residual): what the string form writes
    # and consumers read; a layout is changed through its `residual`, one variant, never flag by flag.
    @property
    def options(self) -> ResidualOptions:
        """The residual variant's options, flat (h, alpha, streams, ...; the grammar's tokens)."""
        return ResidualOptions.of(self.residual)

    @property
    def h(self) -> float:
        """The branch step h (Kan et al. Sec. 5; 1: the standard Transformer); learned: its start."""
        return self.residual.h

    @property
    def h_learned(self) -> str | None:
        """h learned per sublayer: "scalar" (ReZero) or "channel" (LayerScale); None: the fixed number."""
        return self.residual.h_learned

    @property
    def alpha(self) -> float | str:
        """The skip scale: a number, "deepnorm", "admin" or "keel" (`Skip`); 1 for the other schemes."""
        return self.residual.alpha if isinstance(self.residual, Skip) else 1.0

    @property
    def skip_learned(self) -> bool:
        return isinstance(self.residual, Skip) and self.residual.skip_learned

    @property
    def gpas(self) -> bool:
        return isinstance(self.residual, Skip) and self.residual.gpas

    @property
    def streams(self) -> int:
        """The residual streams n (`Streams`); 1 for every other scheme."""
        return self.residual.n if isinstance(self.residual, Streams) else 1

    @property
    def stream_mix(self) -> str:
        return self.residual.mix if isinstance(self.residual, Streams) else "hc"

    @property
    def ngpt(self) -> bool:
        return isinstance(self.residual, Sphere)

    @property
    def attn_res(self) -> int | str | None:
        """Attention Residuals' blocks N or "full" (`AttnRes`); None for every other scheme."""
        return self.residual.blocks if isinstance(self.residual, AttnRes) else None

    def norm_at(self, site: str) -> NormSpec:
        """The norm site ``site`` (one of NORM_SITES) holds: its kind, gain and DyT alpha0."""
        if site not in NORM_SITES:
            raise LayoutError(f"unknown norm site {site!r}; valid: {', '.join(NORM_SITES)}")
        own = dict(self.site_norms).get(site, SiteNorm())
        kind = own.kind or self.norm
        # the layout's gain applies where the kind has one; a site's own gain always
        gain = own.gain or (self.gain if kind in _GAINED else "gamma")
        return NormSpec(kind=kind, gain=gain, alpha0=own.alpha0)

    def sites_on(self) -> set[str]:
        """The norm sites some layer turns on (base block or a rule)."""
        on = {"emb"} if self.embed_norm else set()
        on |= {"final"} if self.final_norm else set()
        attn = [self.block.attn] + [r.sites for r in self.rules if r.sublayer == "attn"]
        mlp = [self.block.mlp] + [r.sites for r in self.rules if r.sublayer == "mlp"]
        inner = [self.block.attn_inner] + [r.inner for r in self.rules if r.inner is not None]
        for name, group in (("attn", attn), ("mlp", mlp)):
            for letter, attr in (("A", "input"), ("B", "output"), ("C", "after_add"), ("H", "hidden")):
                if any(getattr(s, attr) for s in group):
                    on.add(f"{name}.{letter}")
        for letter, attr in (("q", "q"), ("k", "k"), ("v", "v"), ("c", "context")):
            if any(getattr(i, attr) for i in inner):
                on.add(letter)
        return on

    def _any_output_site(self) -> bool:
        if self.block.attn.output or self.block.mlp.output:
            return True
        return any(rule.sites.output for rule in self.rules)

    def with_(self, **changes: Any) -> Layout:
        """A copy with fields changed (and the preset name dropped unless given)."""
        changes.setdefault("name", None)
        return replace(self, **changes)

    def with_qk_norm(self) -> Layout:
        """Add QK-norm (Wortsman et al. 2024) to every layer, whatever else the layout does."""
        block = replace(self.block, attn_inner=replace(self.block.attn_inner, q=True, k=True))
        rules = tuple(
            replace(r, inner=replace(r.inner, q=True, k=True)) if r.inner is not None else r for r in self.rules
        )
        return self.with_(block=block, rules=rules)

    def check_complete(self) -> None:
        """Checks of the finished layout that a half-built one (mid-parse) may fail: a per-site gain or alpha0 its
        site's kind lacks, a per-site setting for a site no layer turns on, what the residual scheme refuses
        (`Residual.check`: sites with no skip to act on, nGPT's fixed sites)."""
        for site, _ in self.site_norms:
            spec = self.norm_at(site)
            if spec.gain != "gamma" and spec.kind not in _GAINED:
                raise LayoutError(
                    f"site {site}: norm={spec.kind} has no per-channel gain to change (ScaleNorm's "
                    "is one scalar g, L2's none); gain applies to rms, layer, dyt and derf"
                )
            if spec.alpha0 is not None and spec.kind not in ALPHA_KINDS:
                raise LayoutError(
                    f"site {site}: alpha0 is DyT's or Derf's initial alpha, and this site holds norm={spec.kind}"
                )
        self.residual.check(self)
        if self.qk_after_rope and self.inner_span == "full":
            raise LayoutError("qk-rope normalizes each head's rotated q and k; it needs inner=head, not inner=full")
        off = [site for site, _ in self.site_norms if site not in self.sites_on()]
        if off:
            raise LayoutError(
                f"per-site norm settings for {', '.join(off)}, which no layer of this layout turns "
                f"on (on: {', '.join(s for s in NORM_SITES if s in self.sites_on()) or 'none'})"
            )

    def resolve(self, n_layers: int) -> ResolvedLayout:
        self.check_complete()
        return resolve(self, n_layers)

    def to_string(self) -> str:
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
    # Attention Residuals: sublayers per block S (1: Full AttnRes; 0: off), from the layout's N blocks at this depth
    attn_res_size: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def table(self) -> str:
        """The per-layer printout shown at build time."""
        lay = self.layout
        alpha = "admin (profiled)" if lay.alpha == ADMIN else f"{self.alpha:.4g}"
        if lay.alpha == KEEL:
            alpha += " (keel: the number of sublayers)"
        head = (
            f"layout {lay.label}: norm={lay.norm}, embed_norm={'on' if lay.embed_norm else 'off'}, "
            f"final_norm={'on' if lay.final_norm else 'off'}, h={lay.h:g}, alpha={alpha}"
        )
        if lay.qk_after_rope:
            head += ", q/k norms after RoPE"
        words = lay.residual.describe(self.n_layers)
        head += f", {words}" if words else ""
        if lay.site_norms:
            head += "\n  per site: " + "; ".join(
                f"{site} {lay.norm_at(site).kind}/{lay.norm_at(site).gain}"
                + (f"/alpha0 {sn.alpha0:g}" if sn.alpha0 is not None else "")
                for site, sn in lay.site_norms
            )
        lines = [head, "  layer  attn(inner)  attn   mlp"]
        for i, blk in enumerate(self.blocks):
            inner = format_inner(blk.attn_inner) or "-"
            lines.append(f"  {i:>5}  {inner:<11}  {format_sites(blk.attn) or '-':<5}  {format_sites(blk.mlp) or '-'}")
        return "\n".join(lines)


def _canonical_site_norms(pairs: tuple[tuple[str, SiteNorm], ...]) -> tuple[tuple[str, SiteNorm], ...]:
    """One entry per site in NORM_SITES order, later entries' fields over earlier ones, empty ones dropped."""
    merged: dict[str, SiteNorm] = {}
    for site, spec in pairs:
        if site not in NORM_SITES:
            raise LayoutError(
                f"unknown norm site {site!r}; valid: {', '.join(NORM_SITES)} "
                f"(or the groups {', '.join(SITE_GROUPS)} in the string form)"
            )
        if not isinstance(spec, SiteNorm):
            raise LayoutError(f"site {site}: expected a SiteNorm, got {type(spec).__name__}")
        merged[site] = merged.get(site, SiteNorm()).merged(spec)
    return tuple((s, merged[s]) for s in NORM_SITES if s in merged and merged[s] != SiteNorm())


def deepnorm_beta(n_layers: int) -> float:
    """DeepNorm's init gain on FFN, V and output projections: (8N)^(-1/4) (Wang et al. 2022)."""
    return float((8.0 * n_layers) ** -0.25)


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
    alpha = layout.residual.skip_scale(n_layers)
    size = attn_res_block_size(layout.attn_res, n_layers)
    return ResolvedLayout(layout=layout, blocks=tuple(blocks), alpha=alpha, attn_res_size=size)


# --- the canonical string form (parsed back by normlab.layout.spec, whose grammar reads these letter tables) ---

SITE_LETTERS = {"A": "input", "B": "output", "C": "after_add", "S": "skip_normed"}
MLP_LETTERS = {"H": "hidden", "W": "skip_block"}
INNER_LETTERS = {"q": "q", "k": "k", "v": "v", "c": "context", "g": "gate", "s": "head_scale"}
SITE_FIELDS = {"norm": "kind", "gain": "gain", "alpha0": "alpha0"}


def format_sites(sites: SublayerSites) -> str:
    letters = {**SITE_LETTERS, **MLP_LETTERS}
    return "".join(letter for letter, attr in letters.items() if getattr(sites, attr))


def format_inner(inner: AttentionInnerSites) -> str:
    return "".join(letter for letter, attr in INNER_LETTERS.items() if getattr(inner, attr))


def _format_range_end(end: int | float | None) -> str:
    return "" if end is None else repr(end)


def _format_site_norms(layout: Layout) -> list[str]:
    """norm./gain./alpha0. tokens, sites with one value joined by "+", both sublayers' X written as X."""
    tokens = []
    for key, attr in SITE_FIELDS.items():
        by_value: dict[object, list[str]] = {}
        for site, spec in layout.site_norms:
            value = getattr(spec, attr)
            if value is not None:
                by_value.setdefault(value, []).append(site)
        for value, sites in by_value.items():
            for group, members in SITE_GROUPS.items():
                if len(members) > 1 and all(m in sites for m in members):
                    sites = [group if s == members[0] else s for s in sites if s not in members[1:]]
            text = repr(value) if isinstance(value, float) else str(value)
            tokens.append(f"{key}.{'+'.join(sites)}={text}")
    return tokens


def format_layout(layout: Layout) -> str:
    """The canonical string form of a layout (round-trips through `parse_layout`)."""
    blk = layout.block
    tokens = [
        f"attn={format_inner(blk.attn_inner) + format_sites(blk.attn) or '-'}",
        f"mlp={format_sites(blk.mlp) or '-'}",
    ]
    for rule in layout.rules:
        rng = f"[{_format_range_end(rule.layers.start)}:{_format_range_end(rule.layers.stop)}]"
        inner = format_inner(rule.inner) if rule.inner is not None else ""
        tokens.append(f"{rng}{rule.sublayer}={inner + format_sites(rule.sites) or '-'}")
    if layout.embed_norm:
        tokens.append("emb")
    if layout.final_norm:
        tokens.append("final")
    if layout.norm != "rms":
        tokens.append(f"norm={layout.norm}")
    if layout.gain != "gamma":
        tokens.append(f"gain={layout.gain}")
    if layout.inner_span != "head":
        tokens.append(f"inner={layout.inner_span}")
    if layout.h != 1.0:
        tokens.append(f"h={layout.h!r}")
    if layout.alpha != 1.0:
        tokens.append(f"alpha={layout.alpha if isinstance(layout.alpha, str) else repr(layout.alpha)}")
    if layout.freeze_output_gamma:
        tokens.append("frozen-out")
    if layout.embed_scale:
        tokens.append("emb-scale")
    if layout.h_learned is not None:
        tokens.append(f"h-{layout.h_learned}")
    if layout.skip_learned:
        tokens.append("skip-scalar")
    if layout.gpas:
        tokens.append("gpas")
    if layout.residual.token:  # a one-token scheme (ngpt)
        tokens.append(layout.residual.token)
    if layout.attn_res is not None:
        tokens.append(f"attnres={layout.attn_res}")
    if layout.streams != 1:
        tokens.append(f"streams={layout.streams}")
    if layout.stream_mix != "hc":
        tokens.append(f"mix={layout.stream_mix}")
    if layout.ln_scaling:
        tokens.append("lns")
    if layout.qk_after_rope:
        tokens.append("qk-rope")
    if layout.softmax != "softmax":
        tokens.append(f"softmax={layout.softmax}")
    tokens.extend(_format_site_norms(layout))
    if layout.init is not None:
        tokens.append(f"init={layout.init}")
    return ",".join(tokens)
