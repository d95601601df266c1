"""The compact string form of a layout, for command lines and file names.

A layout string is comma-separated tokens, read left to right. It may start with a preset name,
which the following tokens modify (``peri,h=0.5``), or describe a layout from scratch::

    attn=AB,mlp=AB,emb,final                   Peri-LN (Kim eq. 3)
    attn=qkv,mlp=AS,final,[0:1]attn=qkvA,[0:1]mlp=A   HybridNorm* (Zhuo eqs. 8-11)

Tokens:
    attn=LETTERS     sites of attention: q k v c (inner norms on Q, K, V, Context), g (sigmoid gate
                     on the context, Qiu et al. 2025), s (a learned scale per head, NormFormer) and
                     A (input), B (output), C (after the add), S (skip from the normed input);
                     "-" for none
    mlp=LETTERS      sites of the MLP: A B C S, H (a norm on the hidden activation, NormFormer), W (the skip from
                     the block's input: SpanNorm's residual spanning the whole block), or "-"
    [a:b]attn=...    the same, for layers a..b-1 only (ints, negative from the end, or fractions
    [a:b]mlp=...     of depth such as [:0.25] or [:25%]; floor, as Mix-LN)
    emb / -emb       embedding norm on / off
    final / -final   final norm on / off
    qk               add QK-norm to every layer
    norm=KIND        one kind everywhere: a row of normlab.layout.norm_kinds (NORM_KINDS), e.g. rms
                     (RMSNorm), layer (LayerNorm), dyt (Dynamic Tanh), scale (ScaleNorm), l2 (x / ||x||)
    inner=head|full  q/k/v/c norms per head or across all heads (OLMo 2)
    h=FLOAT          residual branch scale (Kan et al. Sec. 5)
    alpha=FLOAT|deepnorm|admin|keel   skip scale (DeepNorm: (2N)^(1/4); Admin: learned, profiled at init;
                     Keel: the number of sublayers 2N)
    frozen-out       output-norm (B) gamma frozen at 1 (Kim Fig. 8); -frozen-out undoes it
    emb-scale        multiply embeddings by sqrt(d_model) (Gemma); -emb-scale undoes it
    h-scalar         h learned, one scalar per sublayer starting at h (ReZero: h=0); -h-learned undoes it
    h-channel        h learned, one per channel starting at h (LayerScale: h=0.1 or smaller)
    skip-scalar      a learned skip scale per sublayer from 1: x' = lambda x + h F(.) (modded-nanogpt); -skip-scalar
    streams=N        N parallel residual streams (hyper-connections' expansion rate; 1: one stream)
    mix=hc|mhc       how the streams connect: hyper-connections (Zhu et al. 2025) or mHC, the mixing matrix
                     made doubly stochastic by Sinkhorn-Knopp (Xie et al. 2025); needs streams=N > 1
    ngpt             nGPT (Loshchilov et al. 2024) on attn=qkBC,mlp=BC,norm=l2,qk-rope: eigen learning rates,
                     s_qk, s_u/s_v, s_z, weights normalized after each step (preset ngpt); -ngpt undoes it
    siamese          SiameseNorm (arXiv 2602.08064): a Post-Norm-like and a Pre-Norm-like stream through the same
                     sublayers (preset siamese); -siamese undoes it
    attnres=N|full   Attention Residuals (Kimi Team 2026): each sublayer reads a softmax attention over the
                     embedding and N blocks' summed outputs (Block AttnRes) or every earlier sublayer's output
                     (full) instead of the unit-weight sum; -attnres undoes it
    gpas             GPAS after each sublayer: x <- x - SiLU(a) stopgrad(x), a learned from 0 (Chen et al. 2025); -gpas
    gain=G           the norms' gain: gamma (default), none, centered (1 + w, w from 0), or scalar
                     (one learned number from 1: single-scale RMSNorm)
    lns              LayerNorm Scaling: the input norm's output times 1/sqrt(layer index from 1); -lns undoes it
    qk-rope          Q/K norms after RoPE instead of before (Llama 4); -qk-rope undoes it
    softmax=KIND     attention's weights: softmax (default), sink (a learned logit per head in the softmax's
                     denominator, GPT-OSS), off-by-one (a sink fixed at logit 0, Miller's softmax_1),
                     softpick (ReLU(e^x - 1) / sum |e^x - 1|, Zuhri et al. 2025)
    norm.SITES=KIND  a kind at some sites only; SITES joins site names with "+": attn.A attn.B attn.C
                     mlp.A mlp.B mlp.C mlp.H q k v c emb final, or A B C H for both sublayers
                     (e.g. norm.B=dyt, norm.q+k=l2)
    gain.SITES=G     a gain at some sites only (e.g. gain.q+k=none)
    alpha0.SITES=F   DyT's or Derf's initial alpha at some sites (e.g. alpha0.attn.A=0.8,alpha0.mlp.A+final=0.2)
    init=NAME        the init scheme the layout prescribes (DeepNorm)

`format_layout` writes the canonical form; ``parse_layout(format_layout(x)) == x`` for every layout.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

from normlab.errors import LayoutError
from normlab.layout.residual import ALPHA_MODES, ATTN_RES_FULL, SCHEMES, STREAM_MIXES, ResidualOptions, Skip
from normlab.layout.sites import (
    ATTN_SOFTMAX,
    GAINS,
    INNER_LETTERS,
    INNER_SPANS,
    MLP_LETTERS,
    NORM_KINDS,
    NORM_SITES,
    SITE_FIELDS,
    SITE_GROUPS,
    SITE_LETTERS,
    AttentionInnerSites,
    InnerSpan,
    LayerRange,
    LayerRule,
    Layout,
    SiteNorm,
    SublayerSites,
)

_FLAGS = {
    "emb": ("embed_norm", True),
    "-emb": ("embed_norm", False),
    "final": ("final_norm", True),
    "-final": ("final_norm", False),
    "frozen-out": ("freeze_output_gamma", True),
    "-frozen-out": ("freeze_output_gamma", False),
    "emb-scale": ("embed_scale", True),
    "-emb-scale": ("embed_scale", False),
    "lns": ("ln_scaling", True),
    "-lns": ("ln_scaling", False),
    "qk-rope": ("qk_after_rope", True),
    "-qk-rope": ("qk_after_rope", False),
}
# the on/off tokens of the residual scheme: fields of ResidualOptions (normlab.layout.residual)
_RESIDUAL_FLAGS: dict[str, tuple[str, object]] = {
    "h-scalar": ("h_learned", "scalar"),
    "h-channel": ("h_learned", "channel"),
    "-h-learned": ("h_learned", None),
    "skip-scalar": ("skip_learned", True),
    "-skip-scalar": ("skip_learned", False),
    "gpas": ("gpas", True),
    "-gpas": ("gpas", False),
    "-attnres": ("attn_res", None),
}


def _on_off() -> tuple[str, ...]:
    """Every on/off token: the flags, the residual flags, the one-token residual schemes (`SCHEMES`) and qk."""
    return (*_FLAGS, *_RESIDUAL_FLAGS, *SCHEMES, *(f"-{t}" for t in SCHEMES), "qk")


TOKEN_HELP = (
    "attn=<qkvc+ABCS or ->, mlp=<ABCSHW or ->, [a:b]attn=..., [a:b]mlp=..., emb, -emb, final, "
    "-final, qk, norm=" + "|".join(NORM_KINDS) + ", inner=head|full, h=<float>, "
    "alpha=<float>|deepnorm|admin|keel, frozen-out, "
    "emb-scale, h-scalar, h-channel, skip-scalar, gpas, " + ", ".join(SCHEMES) + ", streams=<n>, mix=hc|mhc, "
    "attnres=<n>|full, lns, "
    "qk-rope, "
    "softmax=softmax|sink|off-by-one|softpick, "
    "gain=gamma|none|centered|scalar, norm.SITES=KIND, gain.SITES=G, "
    "alpha0.SITES=<float>, init=<scheme>"
)
_RULE = re.compile(r"^\[(?P<start>[^:\]]*):(?P<stop>[^\]]*)\](?P<rest>.+)$")


def _parse_site_names(text: str, token: str) -> list[str]:
    sites: list[str] = []
    for name in text.split("+"):
        if name in SITE_GROUPS:
            sites.extend(SITE_GROUPS[name])
        elif name in NORM_SITES:
            sites.append(name)
        else:
            raise LayoutError(
                f"in {token!r}: {name!r} is not a norm site; valid: {', '.join(NORM_SITES)}, or "
                f"{', '.join(SITE_GROUPS)} for both sublayers' site; join several with '+'"
            )
    return sites


def _parse_letters(text: str, sublayer: str, token: str) -> tuple[SublayerSites, AttentionInnerSites | None]:
    if text == "-":
        return SublayerSites(), (AttentionInnerSites() if sublayer == "attn" else None)
    valid = ("qkvcgs" if sublayer == "attn" else "") + "ABCS" + ("HW" if sublayer == "mlp" else "")
    seen: set[str] = set()
    for ch in text:
        if ch not in valid:
            raise LayoutError(
                f"in {token!r}: {ch!r} is not a {sublayer} site; valid letters are {valid!r} "
                "(q k v c: inner Q/K/V/Context norms, g: gate, s: head scale; A input, B output, C after add, "
                "S skip from normed input, H: MLP hidden norm, W: MLP skip from the block's input), or '-' for none"
            )
        if ch in seen:
            raise LayoutError(f"in {token!r}: site {ch!r} is given twice; each site holds one norm")
        seen.add(ch)
    sites = SublayerSites(**{attr: letter in seen for letter, attr in {**SITE_LETTERS, **MLP_LETTERS}.items()})
    if sublayer != "attn":
        return sites, None
    inner = AttentionInnerSites(**{attr: letter in seen for letter, attr in INNER_LETTERS.items()})
    return sites, inner


def _parse_range_end(text: str, token: str) -> int | float | None:
    text = text.strip()
    if text == "":
        return None
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100.0
        if re.fullmatch(r"-?\d+", text):
            return int(text)
        return float(text)
    except ValueError:
        raise LayoutError(
            f"in {token!r}: {text!r} is not a layer index (e.g. 2, -1) or fraction (e.g. 0.25, 25%)"
        ) from None


def _parse_float(text: str, token: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise LayoutError(f"in {token!r}: {text!r} is not a number") from None


def _attn_res_value(value: str, token: str) -> int | str | None:
    if value == "none":
        return None
    if value != ATTN_RES_FULL and not re.fullmatch(r"\d+", value):
        raise LayoutError(
            f"in {token!r}: attnres is a whole number of blocks (Block AttnRes; the paper uses about 8) or "
            f"{ATTN_RES_FULL!r} (every sublayer's output its own source)"
        )
    return value if value == ATTN_RES_FULL else int(value)


def _residual_token(opts: ResidualOptions, token: str) -> ResidualOptions | None:
    """``opts`` with one residual token applied (normlab.layout.residual), or None if ``token`` is not one: the
    residual tokens are gathered in any order and the variant is built once the string is read."""
    if token in _RESIDUAL_FLAGS:
        attr, flag = _RESIDUAL_FLAGS[token]
        return opts.with_(**{attr: flag})
    if token.lstrip("-") in SCHEMES:  # ngpt, siamese and their negations: a scheme that is one token
        return opts.with_(scheme=None if token.startswith("-") else token)
    key, eq, value = token.partition("=")
    if not (eq and value):
        return None
    if key == "streams":
        if not re.fullmatch(r"\d+", value):
            raise LayoutError(f"in {token!r}: streams is a whole number (the expansion rate n, e.g. 4)")
        return opts.with_(streams=int(value))
    if key == "mix":
        if value not in STREAM_MIXES:
            raise LayoutError(f"in {token!r}: mix must be one of {', '.join(STREAM_MIXES)}")
        return opts.with_(mix=value)
    if key == "h":
        return opts.with_(h=_parse_float(value, token))
    if key == "alpha":
        return opts.with_(alpha=value if value in ALPHA_MODES else _parse_float(value, token))
    if key == "attnres":
        return opts.with_(attn_res=_attn_res_value(value, token))
    return None


def _apply(layout: Layout, token: str) -> Layout:
    m = _RULE.match(token)
    if m:
        rng = LayerRange(_parse_range_end(m["start"], token), _parse_range_end(m["stop"], token))
        key, _, value = m["rest"].partition("=")
        if key not in ("attn", "mlp") or not value:
            raise LayoutError(f"in {token!r}: a layer rule is [a:b]attn=LETTERS or [a:b]mlp=LETTERS")
        sites, inner = _parse_letters(value, key, token)
        rule = LayerRule(layers=rng, sublayer=key, sites=sites, inner=inner)  # type: ignore[arg-type]
        return replace(layout, rules=layout.rules + (rule,))
    if token in _FLAGS:
        attr, flag = _FLAGS[token]
        changes: dict[str, Any] = {attr: flag}  # the field's type is the flag table's (bool)
        return replace(layout, **changes)
    if token == "qk":
        return layout.with_qk_norm()
    key, eq, value = token.partition("=")
    field, dot, where = key.partition(".")
    if eq and value and dot and field in SITE_FIELDS:
        names = _parse_site_names(where, token)
        if field == "alpha0":
            spec = SiteNorm(alpha0=_parse_float(value, token))
        elif field == "norm":
            if value not in NORM_KINDS:
                raise LayoutError(f"in {token!r}: norm must be one of {', '.join(NORM_KINDS)}")
            spec = SiteNorm(kind=value)
        else:
            if value not in GAINS:
                raise LayoutError(f"in {token!r}: gain must be one of {', '.join(GAINS)}")
            spec = SiteNorm(gain=value)
        return replace(layout, site_norms=layout.site_norms + tuple((site, spec) for site in names))
    if eq and value:
        if key in ("attn", "mlp"):
            sites, inner = _parse_letters(value, key, token)
            if key == "attn":
                assert inner is not None
                block = replace(layout.block, attn=sites, attn_inner=inner)
            else:
                block = replace(layout.block, mlp=sites)
            return replace(layout, block=block)
        if key == "gain":
            if value not in GAINS:
                raise LayoutError(f"in {token!r}: gain must be one of {', '.join(GAINS)}")
            return replace(layout, gain=value)
        if key == "norm":
            if value not in NORM_KINDS:
                raise LayoutError(f"in {token!r}: norm must be one of {', '.join(NORM_KINDS)}")
            return replace(layout, norm=value)
        if key == "softmax":
            if value not in ATTN_SOFTMAX:
                raise LayoutError(f"in {token!r}: softmax must be one of {', '.join(ATTN_SOFTMAX)}")
            return replace(layout, softmax=value)
        if key == "inner":
            if value not in INNER_SPANS:
                raise LayoutError(f"in {token!r}: inner must be one of {', '.join(INNER_SPANS)}")
            return replace(layout, inner_span=cast(InnerSpan, value))
        if key == "init":
            return replace(layout, init=None if value == "none" else value)
    raise LayoutError(f"unknown layout token {token!r}; valid tokens: {TOKEN_HELP}")


def option_token(key: str, value: object) -> str:
    """One layout option given as a key and a value (``--set layout.KEY=VALUE``, a TOML ``[layout]`` table, a
    sweep axis ``layout.KEY``) as this grammar's token, so that every entry point reads it with one parser:
    ``KEY=VALUE`` (``h=0.5``, ``alpha=admin``, ``norm.B=dyt``, ``init=none``), or for an on/off token (``emb``,
    ``final``, ``qk``, ``lns``, ``h-scalar``, ...) the token itself for true and its negation for false."""
    if not isinstance(key, str) or not key:
        raise LayoutError(f"a layout option needs a name, got {key!r}")
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if isinstance(value, bool):
        if key not in _on_off():
            raise LayoutError(
                f"layout.{key}: true/false is for the on/off tokens "
                f"({', '.join(t for t in _on_off() if not t.startswith('-'))}); {key} takes a value"
            )
        if value:
            return key
        off = "-h-learned" if key.startswith("h-") else f"-{key}"
        if off not in _on_off():
            raise LayoutError(f"layout.{key}=false: {key} has no negation in the grammar; leave it out instead")
        return off
    text = "none" if value is None else repr(value) if isinstance(value, float) else str(value)
    return f"{key}={text}"


def check_option(key: str, value: object) -> str:
    """The token of one layout option (its name and value are checked with the layout they edit, by the grammar)."""
    token = option_token(key, value)
    if "," in token:
        raise LayoutError(f"layout.{key}: one option per key, got {value!r} (a comma starts another token)")
    return token


def edit_layout(text: str, options: Mapping[str, object]) -> Layout:
    """The layout ``text`` (a preset name or string form) with ``options`` appended as tokens and parsed as one
    string: ``--set layout.alpha=admin`` on ``post`` is ``post,alpha=admin``. Named by that string."""
    label = text + "".join("," + check_option(k, v) for k, v in options.items())
    return replace(parse_layout(label), name=label)


def parse_layout(text: str) -> Layout:
    """Parse a preset name or string form into a `Layout` (see the module docstring)."""
    from normlab.layout.presets import PRESETS

    if not isinstance(text, str) or not text.strip():
        raise LayoutError("empty layout; give a preset name (see `normlab layouts`) or a string form")
    tokens = [t.strip() for t in text.split(",")]
    if any(not t for t in tokens):
        raise LayoutError(f"empty token in layout {text!r} (two commas in a row?)")
    first = tokens[0]
    if first in PRESETS:
        layout, tokens = PRESETS[first].layout, tokens[1:]
        if not tokens:
            return layout
    elif "=" not in first and not first.startswith("[") and first not in _on_off():
        close = difflib.get_close_matches(first, PRESETS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise LayoutError(
            f"unknown layout preset {first!r}.{hint} Valid presets: {', '.join(PRESETS)}; "
            f"or a string form of tokens: {TOKEN_HELP}"
        )
    else:
        layout = Layout()
    # the residual tokens are gathered in any order and built into one variant at the end (`_residual_token`)
    opts, layout = ResidualOptions.of(layout.residual), replace(layout, residual=Skip())
    for token in tokens:
        changed = _residual_token(opts, token)
        if changed is not None:
            opts = changed
        else:
            layout = _apply(layout, token)
    # Re-run validation of the finished layout (cross-field checks such as frozen-out needing B).
    layout = replace(layout, residual=opts.build(), name=None)
    layout.check_complete()
    return layout
