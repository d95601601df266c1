"""Every norm kind's facts in one torch-free row: the one place a new kind is described (its module is the other).

A row says what the kind is called, which parameters its module holds and how many numbers each has at a width
(`ParamSize`), whether it squashes each entry (point-wise, with a learned input scale alpha: DyT, Derf) or
divides by a statistic of the vector, whether it has a gain to choose (``gain=``), what it bounds as an output
norm (B) and what it does to the stream after the add (C) for the screen's well-posedness verdict (Kan et al.
2025, App. B), whether `normlab doctor`'s rescale can carry a stream scale through it, and, where none of the
code bases `normlab frameworks` writes for computes it, why not. Everything that needs one of these reads it
here: the layout's validation and grammar (normlab.layout.sites, .spec), the analytic parameter count
(normlab.model.params), the screen (normlab.screen.wellposed), the doctor (normlab.doctor.rescale) and the
frameworks' translation (normlab.recommend.frameworks.snippets). The torch module of each kind is registered by name
beside it in normlab.model.norms (`NORM_MODULES`); tests/unit/test_registries.py checks that the two agree.

Sources: rms, Zhang & Sennrich 2019; layer, Ba et al. 2016; dyt, Dynamic Tanh, Zhu et al. 2025; derf, Dynamic
erf, Chen et al. 2025 (arXiv 2512.10938); scale, ScaleNorm, Nguyen & Salazar 2019; l2, x / ||x|| with no gain;
seednorm, an input-dependent gain on x / RMS(x), Cai et al. 2025 (SeeDNorm, arXiv 2510.22777); gatednorm, RMSNorm
followed by a low-rank sigmoid gate (marin's grug MoE recipe, after Qiu et al. 2026, arXiv 2601.22966); taper,
RMSNorm tapered into a fixed per-channel scaling (TaperNorm, Kanavalau et al. 2026, arXiv 2602.10408).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How many numbers one parameter of a norm over ``width`` channels holds:
#   gain         the gain gamma: width for gain gamma or centered (1 + w), 1 for scalar, 0 for none
#   bias         beta: width when the model's norms have a bias (``norm_bias``), else 0
#   affine_bias  torch LayerNorm's beta: as bias, but only with a per-channel gain (elementwise_affine)
#   channel      one per channel, always
#   one          a single learned number
#   gate         one of GatedNorm's two low-rank matrices: width * rank
ParamSize = Literal["gain", "bias", "affine_bias", "channel", "one", "gate"]
PARAM_SIZES: tuple[str, ...] = ("gain", "bias", "affine_bias", "channel", "one", "gate")
GATED_NORM_RANK = 128  # marin's grug MoE recipe (experiments/grug/moe/model.py, _GATED_NORM_RANK)
PER_CHANNEL_GAINS: tuple[str, ...] = ("gamma", "centered")  # the gains with one number per channel


@dataclass(frozen=True)
class NormKindFacts:
    """One norm kind, as data (see the module docstring for who reads each field).

    name: the kind in the layout grammar (``norm=NAME``); title: its name in prose; source: the paper;
    params: (attribute, size) for each parameter its module holds, in the module's order; pointwise: squashes
    each entry with a learned input scale alpha started at alpha0 (no statistic of the vector); gained: has a
    gain to choose with ``gain=`` (else only gamma, its fixed form); output_bound: what an output norm (B) of
    this kind bounds, the update u = h * N_B(.); after_add: what a norm after the add (C) does to the stream;
    rescalable: N(c x) = N(x) with a per-channel gain to carry c (the doctor's fp16 rescale folds the scale
    through it); unsaid: why no code base `normlab frameworks` writes for computes it (None: they do, or the
    layout's sites decide).
    """

    name: str
    title: str
    source: str
    params: tuple[tuple[str, ParamSize], ...]
    pointwise: bool
    gained: bool
    output_bound: str
    after_add: str
    rescalable: bool
    unsaid: str | None = None

    def __post_init__(self) -> None:
        for attr, size in self.params:
            if size not in PARAM_SIZES:
                raise ValueError(f"norm kind {self.name}: parameter {attr} has size {size!r}; valid: {PARAM_SIZES}")

    def param_count(self, width: int, gain: str = "gamma", bias: bool = True, rank: int = GATED_NORM_RANK) -> int:
        """The numbers this kind's module holds over ``width`` channels with gain ``gain`` (and ``norm_bias``;
        ``rank``: GatedNorm's gate rank)."""
        return sum(self.param_sizes(width, gain, bias, rank).values())

    def param_sizes(
        self, width: int, gain: str = "gamma", bias: bool = True, rank: int = GATED_NORM_RANK
    ) -> dict[str, int]:
        """Each parameter's number of entries (0: the module holds none by that name)."""
        per_channel = gain in PER_CHANNEL_GAINS
        sizes = {
            "gain": {"none": 0, "scalar": 1}.get(gain, width),
            "bias": width if bias else 0,
            "affine_bias": width if bias and per_channel else 0,
            "channel": width,
            "one": 1,
            "gate": width * rank,
        }
        return {attr: sizes[size] for attr, size in self.params}


_ELLIPSOID_B = "u lies on N_B's ellipsoid (Kan Lemma 1): its entries are at most h*(max|gamma|*sqrt(d) + max|beta|)"
_NORMS = "its norms are LayerNorm, RMSNorm and their variants"


def _squash_bounds(title: str, fn: str, why: str, small: str) -> tuple[str, str]:
    """An element-wise squash's (DyT, Derf) output bound and after-add effect: the same box, its own function."""
    return (
        f"{title} squashes u entry by entry: |u_i| <= h*(|gamma_i| + |beta_i|) whatever its input ({why}); "
        f"bounded above but not fixed in size as on RMSNorm's ellipsoid (a small input passes as {small})",
        f"{title} squashes the stream into the box |x_i| <= |gamma_i| + |beta_i| (a large update saturates {fn}, "
        "where its gradient vanishes, instead of being projected)",
    )


_DYT_BOUNDS = _squash_bounds("DyT", "tanh", "Zhu et al. eq. 1", "gamma*alpha*x")
_DERF_BOUNDS = _squash_bounds(
    "Derf", "erf", "erf's range is (-1, 1); Chen et al. 2025", "gamma*(2/sqrt(pi))*alpha*x around the shift"
)

NORM_KIND_FACTS: tuple[NormKindFacts, ...] = (
    NormKindFacts(
        name="rms",
        title="RMSNorm",
        source="Zhang & Sennrich 2019",
        params=(("weight", "gain"),),
        pointwise=False,
        gained=True,
        output_bound=_ELLIPSOID_B,
        after_add="the stream is projected back onto the ellipsoid",
        rescalable=True,
    ),
    NormKindFacts(
        name="layer",
        title="LayerNorm",
        source="Ba et al. 2016",
        params=(("weight", "gain"), ("bias", "affine_bias")),
        pointwise=False,
        gained=True,
        output_bound=_ELLIPSOID_B,
        after_add="the stream is projected back onto the ellipsoid",
        rescalable=True,
    ),
    NormKindFacts(
        name="dyt",
        title="DyT",
        source="Zhu et al. 2025, Transformers without Normalization, eq. 1",
        params=(("alpha", "one"), ("weight", "gain"), ("bias", "bias")),
        pointwise=True,
        gained=True,
        output_bound=_DYT_BOUNDS[0],
        after_add=_DYT_BOUNDS[1],
        rescalable=False,
        unsaid=f"{_NORMS}: none computes DyT's tanh",
    ),
    NormKindFacts(
        name="derf",
        title="Derf",
        source="Chen et al. 2025, Stronger Normalization-Free Transformers, arXiv 2512.10938",
        params=(("alpha", "one"), ("weight", "gain"), ("bias", "bias"), ("shift", "one")),
        pointwise=True,
        gained=True,
        output_bound=_DERF_BOUNDS[0],
        after_add=_DERF_BOUNDS[1],
        rescalable=False,
        unsaid=f"{_NORMS}: none computes Derf's erf",
    ),
    NormKindFacts(
        name="scale",
        title="ScaleNorm",
        source="Nguyen & Salazar 2019, eq. 3",
        params=(("weight", "one"),),
        pointwise=False,
        gained=False,
        output_bound="ScaleNorm puts u on a sphere: ||u|| = h*|g| exactly (Nguyen & Salazar eq. 3)",
        after_add="the stream is projected back onto a sphere of radius |g|",
        # N(c x) = N(x) too, but its g is one scalar: it would do as well, and is left out to keep the rule short
        rescalable=False,
    ),
    NormKindFacts(
        name="l2",
        title="L2Norm",
        source="x / ||x||, no gain (nGPT's Norm; Llama 4's QK-norm)",
        params=(),
        pointwise=False,
        gained=False,
        output_bound="u is h times a unit vector: ||u|| = h exactly",
        after_add="the stream is projected back onto the unit sphere",
        rescalable=False,  # scale-invariant, but no gain to carry the scale
    ),
    NormKindFacts(
        name="seednorm",
        title="SeeDNorm",
        source="Cai et al. 2025, SeeDNorm: Self-Rescaled Dynamic Normalization, arXiv 2510.22777, eq. 3",
        params=(("weight", "gain"), ("self_scale", "channel"), ("dyn_gain", "channel")),
        pointwise=False,
        gained=True,
        output_bound=(
            "SeeDNorm scales x / RMS(x) by gamma + alpha tanh(x . beta): |u_i| <= h*(|gamma_i| + |alpha_i|)*sqrt(d), "
            "a bound set by its gains whatever the module's weights (tanh is in (-1, 1); Cai et al. 2025)"
        ),
        after_add="the stream is projected back onto the sphere, then scaled by an input-dependent gain",
        rescalable=False,
        unsaid=f"{_NORMS}: none has SeeDNorm's input-dependent gain",
    ),
)

_GATE_SOURCE = (
    "marin's grug MoE recipe (marin-community/marin experiments/grug/moe/model.py, class GatedNorm and "
    "Block.attention_residual / moe_residual), after arXiv 2601.22966"
)
NORM_KIND_FACTS += (
    NormKindFacts(
        name="gatednorm",
        title="GatedNorm",
        source=_GATE_SOURCE,
        params=(("weight", "gain"), ("gate_down", "gate"), ("gate_up", "gate")),
        pointwise=False,
        gained=True,
        output_bound=(
            "GatedNorm multiplies RMSNorm's output by a gate in (0, 1) channel by channel: |u_i| <= "
            "h*max|gamma|*sqrt(d), inside RMSNorm's ellipsoid's box but no longer on it"
        ),
        after_add="the stream is projected onto the ellipsoid, then each channel shrunk by a gate in (0, 1)",
        rescalable=False,  # N(c x) = N(x), but a scale carried by gamma reaches the gate's input and changes it
        unsaid=f"{_NORMS}: none has GatedNorm's low-rank gate",
    ),
    NormKindFacts(
        name="taper",
        title="TaperNorm",
        source="Kanavalau, Amo Alonso & Lall 2026 (TaperNorm, arXiv 2602.10408), RMSNorm form",
        params=(("weight", "gain"), ("taper_weight", "channel")),
        pointwise=False,
        gained=False,
        output_bound=(
            "while the gate g > 0, g times RMSNorm's ellipsoid plus (1 - g) c gamma~ x; once g = 0 the map is "
            "linear, c gamma~ x, and bounds nothing: u grows with the stream"
        ),
        after_add="tapered: the stream passes through a fixed per-channel scaling, nothing projects it back",
        rescalable=False,
        unsaid=f"{_NORMS}: none tapers a norm into a fixed scaling on a schedule",
    ),
)

NORM_FACTS: dict[str, NormKindFacts] = {f.name: f for f in NORM_KIND_FACTS}
