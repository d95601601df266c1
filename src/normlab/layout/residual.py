"""The residual path as one typed value: how each sublayer's update enters the stream.

A `Layout` holds exactly one `Residual` variant, a frozen dataclass whose fields are the options that scheme has,
so an option another scheme owns cannot be written (``Streams`` has no skip scale, ``Sphere`` no step h)::

    Skip(h, h_learned, alpha, skip_learned, gpas)   x' = N_C(alpha lambda x + h N_B(F(N_A(x)))), then GPAS
    Streams(n, mix, h, h_learned)                   n streams, H' = res H + post h F(pre H)   (hyper-connections)
    AttnRes(blocks, h, h_learned)                   h_l = softmax read over depth, update added to its block's sum
    Sphere()                                        nGPT: h <- Norm((1 - a) h + a Norm(F(h)))
    Siamese()                                       SiameseNorm: X' = N(X) + O / c, Y' = Y + O, O = F(N(N(X) + N(Y)))

The variants' equations and sources are in their docstrings; the modules that compute them are
normlab.model.residual (one class per variant, `RESIDUALS` there). The string grammar (normlab.layout.spec) reads
the residual tokens (``h=``, ``alpha=``, ``h-scalar``, ``skip-scalar``, ``gpas``, ``streams=``, ``mix=``,
``attnres=``, ``ngpt``) into one flat `ResidualOptions` in any order and builds the variant once, at the end
(`ResidualOptions.build`): a combination no variant holds is refused there with one message naming both sides.
What a variant says about the rest of the layout (a scheme without a skip has nothing for the sites C, S, W to act
on; nGPT fixes every site) is its ``check``, run with the layout's other checks.

A new residual design is one variant here (with its tokens in `ResidualOptions`) and one class in
normlab.model.residual.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol

from normlab.errors import LayoutError


class LayoutFacts(Protocol):
    """What a variant's `check` reads of a layout (normlab.layout.sites.Layout, which imports this module)."""

    @property
    def block(self) -> Any: ...

    @property
    def rules(self) -> tuple[Any, ...]: ...

    @property
    def embed_norm(self) -> bool: ...

    @property
    def final_norm(self) -> bool: ...

    @property
    def embed_scale(self) -> bool: ...

    @property
    def qk_after_rope(self) -> bool: ...

    @property
    def softmax(self) -> str: ...

    @property
    def inner_span(self) -> str: ...

    def norm_at(self, site: str) -> Any: ...

    def sites_on(self) -> set[str]: ...

    def to_string(self) -> str: ...


H_LEARNED: tuple[str, ...] = ("scalar", "channel")
# How n > 1 residual streams are connected (normlab.model.streams): hyper-connections (Zhu et al., ICLR 2025) or
# manifold-constrained ones, the mixing matrix made doubly stochastic by Sinkhorn-Knopp (Xie et al. 2025, mHC)
STREAM_MIXES: tuple[str, ...] = ("hc", "mhc")
DEEPNORM = "deepnorm"
ADMIN = "admin"  # Liu et al. 2020: a learned skip scale per sublayer and channel, set by a profiling pass
# Keel (Chen & Wei 2026, arXiv 2601.19895): Post-LN's skip scaled by alpha = L, the number of sublayers (2N)
KEEL = "keel"
ALPHA_MODES: tuple[str, ...] = (DEEPNORM, ADMIN, KEEL)
# Attention Residuals over every earlier sublayer (Kimi Team 2026, arXiv 2603.15031, Sec. 3.1: Full AttnRes); an
# integer N instead is Block AttnRes with N blocks (Sec. 3.2)
ATTN_RES_FULL = "full"


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNorm's skip scale for a decoder-only model of N layers: (2N)^(1/4) (Wang et al. 2022)."""
    return float((2.0 * n_layers) ** 0.25)


def keel_alpha(n_layers: int) -> float:
    """Keel's skip scale for N blocks: alpha = L, the number of sublayers the stream passes (2N), Chen & Wei 2026."""
    return float(2 * n_layers)


def attn_res_block_size(attn_res: int | str | None, n_layers: int) -> int:
    """Sublayers per Block AttnRes block: the 2N sublayers in at most ``attn_res`` blocks of S = ceil(2N / blocks)
    (the last block holds the remainder: Kimi Team 2026 Sec. 3.2); 1 for "full" (each its own source); 0 off."""
    if attn_res is None:
        return 0
    if attn_res == ATTN_RES_FULL:
        return 1
    sublayers = 2 * n_layers
    return -(-sublayers // min(int(attn_res), sublayers))


def _check_step(h: float, h_learned: str | None) -> None:
    """The branch step h (Kan et al. 2025 Sec. 5): a finite number > 0, or >= 0 where it is learned (ReZero)."""
    if h_learned not in (None, *H_LEARNED):
        raise LayoutError(f"h_learned must be one of {', '.join(H_LEARNED)} (or None), got {h_learned!r}")
    if isinstance(h, bool) or not (isinstance(h, (int, float)) and math.isfinite(h) and h >= 0):
        raise LayoutError(f"residual scale h must be a finite number > 0 (>= 0 when learned), got {h!r}")
    if h == 0 and h_learned is None:
        raise LayoutError(
            "h=0 with a fixed h removes every update; learn it from 0 with h-scalar (ReZero) "
            "or h-channel, or give h > 0"
        )


def _skip_sites_taken(layout: LayoutFacts) -> list[str]:
    """The sites that act on a skip (C, S, W) some layer of ``layout`` turns on."""
    blocks = [layout.block.attn, layout.block.mlp] + [r.sites for r in layout.rules]
    return [
        what
        for what, on in (
            ("a norm after the add (C)", any(s.after_add for s in blocks)),
            ("a skip from the normed input (S)", any(s.skip_normed for s in blocks)),
            ("a skip from the block's input (W)", any(s.skip_block for s in blocks)),
        )
        if on
    ]


@dataclass(frozen=True)
class Residual:
    """One residual scheme (the base of the variants; see the module docstring)."""

    # the layout's branch step h: fixed, or learned from h ("scalar" ReZero, "channel" LayerScale); 1 where none
    h: float = 1.0
    h_learned: str | None = None
    # what `ResolvedLayout.table` prints for it at a depth ("" for the plain sum)
    words: ClassVar[str] = ""
    # a scheme without options of its own is one on/off token of the grammar (`SCHEMES`: ngpt), and ``alone`` says
    # why it takes no other residual option (the refusal's reason)
    token: ClassVar[str | None] = None
    alone: ClassVar[str] = ""

    def check(self, layout: LayoutFacts) -> None:
        """Refuse what of ``layout`` this scheme gives nothing to act on (one message); nothing by default."""

    def skip_scale(self, n_layers: int) -> float:
        """The fixed skip scale alpha at this depth (1 where the scheme has none)."""
        return 1.0

    def describe(self, n_layers: int) -> str:
        return self.words


@dataclass(frozen=True)
class Skip(Residual):
    """The residual sum x' = N_C(alpha lambda omega x + h N_B(F(N_A(x)))) (Kim et al. 2025 Fig. 2 sites; Kan et al.
    2025 Sec. 5's h), then GPAS's x' <- x' - SiLU(a) sg(x') (Chen et al. 2025, arXiv 2506.22049, Sec. 3).

    alpha: a number, "deepnorm" ((2N)^(1/4), Wang et al. 2022), "keel" (2N, Chen & Wei 2026) or "admin" (a learned
    omega per sublayer and channel, set at init by a profiling pass: Liu et al. 2020 eq. 7); skip_learned: a learned
    scalar lambda from 1 on the skip (modded-nanogpt's residual lambdas); gpas: GPAS's gate a, from 0.
    """

    alpha: float | str = 1.0
    skip_learned: bool = False
    gpas: bool = False

    def __post_init__(self) -> None:
        _check_step(self.h, self.h_learned)
        if isinstance(self.alpha, str):
            if self.alpha not in ALPHA_MODES:
                raise LayoutError(
                    f"alpha must be a number > 0 or one of {', '.join(map(repr, ALPHA_MODES))}, got {self.alpha!r}"
                )
        elif isinstance(self.alpha, bool) or not (math.isfinite(self.alpha) and self.alpha > 0):
            raise LayoutError(f"skip scale alpha must be a finite number > 0, got {self.alpha!r}")

    def skip_scale(self, n_layers: int) -> float:
        # Admin's omega is learned and set by profiling at init (normlab.model.admin); the fixed part is 1
        if self.alpha == DEEPNORM:
            return deepnorm_alpha(n_layers)
        if self.alpha == KEEL:
            return keel_alpha(n_layers)
        return 1.0 if self.alpha == ADMIN else float(self.alpha)

    def describe(self, n_layers: int) -> str:
        on = ((self.skip_learned, "skip lambda learned"), (self.gpas, "GPAS after each sublayer"))
        return ", ".join(words for flag, words in on if flag)


@dataclass(frozen=True)
class Streams(Residual):
    """n parallel residual streams mixed by hyper-connections (Zhu et al. 2025 eq. 3; mix "mhc": Xie et al. 2025's
    doubly stochastic mixing, eqs. 7-8): h_0 = sum_j pre_j H_j, H'_i = sum_j res_ij H_j + post_i h F(h_0)
    (normlab.model.streams). The mixing is the skip path: no skip scale, lambda or GPAS exists to set."""

    n: int = 4
    mix: str = "hc"

    def __post_init__(self) -> None:
        _check_step(self.h, self.h_learned)
        if not (isinstance(self.n, int) and not isinstance(self.n, bool) and 2 <= self.n <= 16):
            raise LayoutError(f"streams must be a whole number from 1 to 16 (the expansion rate n), got {self.n!r}")
        if self.mix not in STREAM_MIXES:
            raise LayoutError(f"unknown stream mix {self.mix!r}; valid: {', '.join(STREAM_MIXES)}")

    def check(self, layout: LayoutFacts) -> None:
        taken = _skip_sites_taken(layout)
        if taken:
            raise LayoutError(
                f"streams={self.n}: the hyper-connections' mixing replaces the skip path, so "
                f"{', '.join(taken)} has nothing to act on; use norm sites A, B (and H) with streams"
            )

    def describe(self, n_layers: int) -> str:
        return f"{self.n} residual streams ({self.mix})"


@dataclass(frozen=True)
class AttnRes(Residual):
    """Attention Residuals (Kimi Team 2026, arXiv 2603.15031): each sublayer reads h_l = sum_i alpha_{i->l} v_i, a
    softmax over the embedding and earlier blocks' summed outputs (eqs. 2-6), and adds its update to its block's sum
    (normlab.model.depth_attention). blocks: N (Block AttnRes, Sec. 3.2) or "full" (every sublayer its own source)."""

    blocks: int | str = 8

    def __post_init__(self) -> None:
        _check_step(self.h, self.h_learned)
        if not (
            self.blocks == ATTN_RES_FULL
            or (isinstance(self.blocks, int) and not isinstance(self.blocks, bool) and 1 <= self.blocks <= 1024)
        ):
            raise LayoutError(
                f"attn_res must be a whole number of blocks from 1 to 1024 (Block AttnRes; the paper uses about 8) "
                f"or {ATTN_RES_FULL!r} (Full AttnRes), got {self.blocks!r}"
            )

    def check(self, layout: LayoutFacts) -> None:
        taken = _skip_sites_taken(layout)
        if taken:
            raise LayoutError(
                f"attnres={self.blocks}: Attention Residuals replace the residual sum (each sublayer reads a "
                "softmax mix of the embedding and the blocks' sums and adds its update to its block's sum), so "
                f"{'; '.join(taken)} has no skip to act on; use norm sites A, B (and H, q/k/v/c) with attnres"
            )

    def describe(self, n_layers: int) -> str:
        size = attn_res_block_size(self.blocks, n_layers)
        if self.blocks == ATTN_RES_FULL:
            return "Attention Residuals over depth (full: every sublayer's output a source)"
        return (
            f"Attention Residuals over depth ({-(-2 * n_layers // max(1, size))} blocks of {size} "
            f"sublayer{'s' if size > 1 else ''})"
        )


@dataclass(frozen=True)
class Sphere(Residual):
    """nGPT (Loshchilov et al. 2024, arXiv 2410.01131, eqs. 10-11): the stream on the unit sphere, each sublayer
    h <- Norm(h + a (Norm(F(h)) - h)) with eigen learning rates a per channel (a lerp: skip 1 - a, branch a), with
    s_qk, s_u/s_v, s_z and the weights normalized after every step (normlab.model.sphere). Its step is a: no h."""

    words: ClassVar[str] = "nGPT (eigen learning rates, s_qk, s_uv, s_z; weights on the sphere)"
    token: ClassVar[str | None] = "ngpt"
    alone: ClassVar[str] = (
        "ngpt is nGPT's whole block (attn=qkBC,mlp=BC,norm=l2,qk-rope,ngpt; preset ngpt), its eigen learning rate "
        "its step"
    )

    def __post_init__(self) -> None:
        if self.h != 1.0 or self.h_learned is not None:
            raise LayoutError("nGPT's step is its eigen learning rate a; it takes no h (give neither h= nor h-scalar)")

    def check(self, layout: LayoutFacts) -> None:
        """nGPT's sites are fixed by its equations: its Norm is x / ||x|| at B (on F's output), C (after the lerp)
        and on q, k after RoPE, nothing else."""
        sites = ",".join(layout.to_string().split(",")[:2])  # the canonical form starts attn=...,mlp=...
        kinds = {layout.norm_at(s).kind for s in layout.sites_on()}
        wrong = [
            what
            for what, bad in (
                (f"sites {sites} (nGPT's: attn=qkBC,mlp=BC)", sites != "attn=qkBC,mlp=BC" or bool(layout.rules)),
                (f"norm kinds {', '.join(sorted(kinds))} (nGPT's Norm is l2: x / ||x||)", kinds != {"l2"}),
                ("q/k norms before RoPE (nGPT normalizes after it: qk-rope)", not layout.qk_after_rope),
                (
                    "an embedding or final norm (nGPT's embedding rows are unit vectors; its stream is one)",
                    layout.embed_norm or layout.final_norm,
                ),
                ("a gain on a norm (l2 has none)", any(layout.norm_at(s).gain != "gamma" for s in layout.sites_on())),
                (f"softmax={layout.softmax} (nGPT's attention is a softmax)", layout.softmax != "softmax"),
                ("inner=full (nGPT normalizes q and k per head)", layout.inner_span != "head"),
                ("emb-scale", layout.embed_scale),
            )
            if bad
        ]
        if wrong:
            raise LayoutError(
                "ngpt is nGPT's whole block (attn=qkBC,mlp=BC,norm=l2,qk-rope,ngpt; preset ngpt); this layout has "
                + "; ".join(wrong)
            )


@dataclass(frozen=True)
class Siamese(Residual):
    """SiameseNorm (arXiv 2602.08064, ICML 2026): two streams through shared sublayers, X Post-Norm-like (normalized
    at every sublayer) and Y Pre-Norm-like (never normalized: the identity path of its gradient). Each sublayer of
    block l reads u = N_A(N_X(X) + N_Y(Y)), and with O = N_B(F(u)) writes X' = N_X(X) + O / c, Y' = Y + O,
    c = sqrt(2 (l + 1)); both start as the embedding and the model reads N_final(N_x(X_L) + N_y(Y_L)). The paper's
    text could not be read here: this follows the authors' code (Qwen-Applications/SiameseNorm,
    deit-model-siamesenorm.py Block.forward and VisionTransformer.forward_features; the same 1/c in
    OLMo_model_hybrid_pre.py), as normlab.model.residual.SiamesePath says line by line."""

    words: ClassVar[str] = "SiameseNorm (a Post-Norm-like and a Pre-Norm-like stream sharing each block's weights)"
    token: ClassVar[str | None] = "siamese"
    alone: ClassVar[str] = "siamese is SiameseNorm's two streams, its steps fixed by its equations"

    def __post_init__(self) -> None:
        if self.h != 1.0 or self.h_learned is not None:
            raise LayoutError("SiameseNorm's steps are 1 (Y) and 1/sqrt(2 (l + 1)) (X); it takes no h")

    def check(self, layout: LayoutFacts) -> None:
        taken = _skip_sites_taken(layout)
        if taken:
            raise LayoutError(
                "siamese: SiameseNorm's streams are its skips (X normalized by its own norm, Y never), so "
                f"{', '.join(taken)} has no one skip to act on; use norm sites A, B (and H, q/k/v/c) with siamese"
            )


@dataclass(frozen=True)
class ResidualOptions:
    """The residual tokens of the string grammar as read, flat and in any order; `build` makes the one variant
    they describe (or refuses them with one message) once the whole string is read."""

    h: float = 1.0
    h_learned: str | None = None
    alpha: float | str = 1.0
    skip_learned: bool = False
    gpas: bool = False
    streams: int = 1
    mix: str = "hc"
    attn_res: int | str | None = None
    scheme: str | None = None  # a scheme that is one token (`SCHEMES`: ngpt), or None

    @classmethod
    def of(cls, residual: Residual) -> ResidualOptions:
        """The flat options a variant was written with (the inverse of `build`)."""
        own = {f.name: getattr(residual, f.name) for f in fields(residual)}
        flat: dict[str, Any] = {k: v for k, v in own.items() if k in ("h", "h_learned", "alpha", "skip_learned")}
        flat["gpas"] = own.get("gpas", False)
        if isinstance(residual, Streams):
            flat.update(streams=residual.n, mix=residual.mix)
        if isinstance(residual, AttnRes):
            flat["attn_res"] = residual.blocks
        return cls(**flat, scheme=residual.token)

    def with_(self, **changes: Any) -> ResidualOptions:
        return replace(self, **changes)

    def _skip_options(self) -> list[str]:
        return [
            what
            for what, on in (
                (f"a skip scale alpha={self.alpha}", self.alpha != 1.0),
                ("skip-scalar", self.skip_learned),
                ("gpas", self.gpas),
            )
            if on
        ]

    def _scheme(self) -> Residual:
        """The one-token scheme, refusing any other residual option."""
        if self.scheme not in SCHEMES:
            raise LayoutError(f"unknown residual scheme {self.scheme!r}; valid: {', '.join(SCHEMES)}")
        variant = SCHEMES[self.scheme]
        rest = self._skip_options() + [
            what
            for what, on in (
                ("h", self.h != 1.0 or self.h_learned is not None),
                (f"streams={self.streams}", self.streams != 1),
                (f"attnres={self.attn_res}", self.attn_res is not None),
            )
            if on
        ]
        if rest:
            raise LayoutError(
                f"{variant.alone or self.scheme + ' is a residual scheme of its own'}: it takes no h, alpha, "
                f"skip-scalar, gpas, streams or attnres, and this layout has {', '.join(rest)}"
            )
        return variant()

    def build(self) -> Residual:
        """The variant these options describe; two schemes at once, or an option the chosen scheme lacks, is
        refused with one message naming both."""
        if self.scheme is not None:
            return self._scheme()
        if self.attn_res is not None:
            taken = self._skip_options()
            if self.streams > 1:
                taken.append(f"streams={self.streams} (hyper-connections: another replacement of the sum)")
            if taken:
                raise LayoutError(
                    f"attnres={self.attn_res}: Attention Residuals replace the residual sum (each sublayer reads a "
                    "softmax mix of the embedding and the blocks' sums and adds its update to its block's sum), so "
                    f"{'; '.join(taken)} has no skip to act on"
                )
            return AttnRes(h=self.h, h_learned=self.h_learned, blocks=self.attn_res)
        if not (isinstance(self.streams, int) and not isinstance(self.streams, bool) and 1 <= self.streams <= 16):
            raise LayoutError(
                f"streams must be a whole number from 1 to 16 (the expansion rate n), got {self.streams!r}"
            )
        if self.streams > 1:
            taken = self._skip_options()
            if taken:
                raise LayoutError(
                    f"streams={self.streams}: the hyper-connections' mixing replaces the skip path, so "
                    f"{', '.join(taken)} has nothing to act on"
                )
            return Streams(h=self.h, h_learned=self.h_learned, n=self.streams, mix=self.mix)
        if self.mix != "hc":
            raise LayoutError(
                f"mix={self.mix} connects several residual streams; give streams=N with N > 1 (DeepSeek's mHC uses 4)"
            )
        return Skip(
            h=self.h, h_learned=self.h_learned, alpha=self.alpha, skip_learned=self.skip_learned, gpas=self.gpas
        )


# the schemes that are one on/off token of the grammar, by token (``ngpt``, ``-ngpt``); a new one joins with
# `register_scheme` and its class in normlab.model.residual with `register` there
SCHEMES: dict[str, type[Residual]] = {}


def register_scheme(variant: type[Residual]) -> type[Residual]:
    """Make ``variant`` (a Residual with a ``token``, no options) the grammar's token ``variant.token``."""
    if not variant.token or not re.fullmatch(r"[a-z][a-z0-9-]*", variant.token):
        raise ValueError(f"a residual scheme's token is lower-case letters, digits and '-', got {variant.token!r}")
    SCHEMES[variant.token] = variant
    return variant


register_scheme(Sphere)
register_scheme(Siamese)
