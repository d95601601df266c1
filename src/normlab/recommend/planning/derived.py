"""Candidates as changes to the user's own placement: "your model + output norms" keeps everything the
user has (their QK-norm, soft-caps, norm kind, gain, per-layer rules) and adds or removes one thing.

The presets answer "which published placement?"; the user asks "what do I change?". A Qwen3 user moved
to the preset `peri` loses their QK-norm without a word; `yours+out` is Qwen3 with Peri-LN's output
norms (Kim et al. 2025 eq. 3: x + N_out(F(N_in(x)))) and QK-norm kept (issue 53).

The changes, each a name the user can give in --candidates (`CHANGES`):

    yours          your placement as it is
    yours+out      + output norms after attention and after the MLP (Peri-LN's N_out; Gemma 2/3, OLMo 2)
    yours+out+emb  + output norms and an embedding norm (the whole of Peri-LN, Kim et al. Sec. 3.3)
    yours+emb      + an embedding norm only
    yours-qk       without QK-norm (where you have it): the evidence for keeping it

A change that does not apply (output norms on a Post-LN block, QK-norm you do not have) is not offered;
one whose result is a preset already among the candidates is that preset, labelled with the change too.
Soft-caps and every other model option are the user's in every candidate: they live in the model config,
which every proxy shares (`normlab.recommend.planning.shape.proxy_shape`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from normlab.errors import ConfigError
from normlab.layout import PRESETS, Layout, as_layout
from normlab.layout.sites import AttentionInnerSites, SublayerSites


def _with_output(s: SublayerSites) -> SublayerSites | None:
    """The sublayer with an output norm, where it takes one: a pre-norm sublayer (input norm, nothing after
    the add) without an output norm already."""
    return replace(s, output=True) if s.input and not s.output and not s.after_add else None


def _add_output(lay: Layout) -> Layout | None:
    attn, mlp = _with_output(lay.block.attn), _with_output(lay.block.mlp)
    if attn is None and mlp is None:
        return None
    block = replace(lay.block, attn=attn or lay.block.attn, mlp=mlp or lay.block.mlp)
    rules = tuple(replace(r, sites=_with_output(r.sites) or r.sites) for r in lay.rules)
    return replace(lay, block=block, rules=rules)


def _add_embedding(lay: Layout) -> Layout | None:
    if lay.embed_norm or lay.block.attn.after_add or lay.ngpt:
        return None
    return replace(lay, embed_norm=True)


def _add_output_and_embedding(lay: Layout) -> Layout | None:
    out = _add_output(lay)
    return _add_embedding(out) if out is not None else None


def _no_qk(inner: AttentionInnerSites | None) -> AttentionInnerSites | None:
    return None if inner is None else replace(inner, q=False, k=False)


def _remove_qk(lay: Layout) -> Layout | None:
    inner = lay.block.attn_inner
    if not (inner.q or inner.k) or lay.ngpt:
        return None
    rules = tuple(replace(r, inner=_no_qk(r.inner)) for r in lay.rules)
    return replace(lay, block=replace(lay.block, attn_inner=replace(inner, q=False, k=False)), rules=rules)


@dataclass(frozen=True)
class Change:
    """One change to the user's placement: its name in --candidates, its words, and what it does (None where
    it does not apply to that placement); `removes`: it takes away something the user has."""

    name: str
    words: str
    apply: Callable[[Layout], Layout | None]
    removes: bool = False


CHANGES: dict[str, Change] = {
    c.name: c
    for c in (
        Change("yours+out", "+ output norms", _add_output),
        Change("yours+out+emb", "+ output and embedding norms", _add_output_and_embedding),
        Change("yours+emb", "+ embedding norm", _add_embedding),
        Change("yours-qk", "without QK-norm", _remove_qk, removes=True),
    )
}
YOURS = "yours"
DEFAULT_CHANGES = ("yours+out", "yours+out+emb", "yours-qk")  # offered with the presets by default


@dataclass(frozen=True)
class Derived:
    """A candidate made from the user's placement: the layout's name as the sweeps run it (a preset's name
    where the result is one, else its string form) and its label ("your model (qwen3) + output norms")."""

    name: str
    label: str
    change: str
    removes: bool


def derive(current: str, change: str) -> Derived | None:
    """The candidate `change` (a key of `CHANGES`) makes of the placement `current`, or None where it does
    not apply."""
    c = CHANGES[change]
    lay = as_layout(current)  # parsed once
    made = c.apply(replace(lay, name=None))
    if made is None or made.to_string() == lay.to_string():
        return None
    form = made.to_string()
    preset = next((n for n, p in PRESETS.items() if p.layout.to_string() == form), None)
    return Derived(preset or form, f"your model ({current}) {c.words}", change, c.removes)


def resolve(names: tuple[str, ...] | list[str], current: str | None) -> tuple[list[str], dict[str, str]]:
    """The --candidates names with `yours...` made into layouts of the user's placement: (names, each
    derived name's label). A `yours` name without a known placement, or an unknown change, is refused in one
    line; a change that does not apply to the user's placement is left out (said in the label map as '')."""
    out: list[str] = []
    labels: dict[str, str] = {}
    for name in names:
        if not name.startswith(YOURS):
            out.append(name)
            continue
        if current is None:
            raise ConfigError(
                f"--candidates {name}: your model file does not say its placement; give `layout` in a .toml "
                "model file, or name layouts instead of yours..."
            )
        if name == YOURS:
            out.append(current)
            continue
        if name not in CHANGES:
            raise ConfigError(f"--candidates: unknown change {name!r}; valid: {', '.join([YOURS, *CHANGES])}")
        d = derive(current, name)
        if d is None:
            labels[name] = ""
            continue
        out.append(d.name)
        labels[d.name] = d.label
    return out, labels


def defaults(current: str | None) -> list[Derived]:
    """The changes offered by default to a user whose placement is `current` (none where it is unknown)."""
    if current is None:
        return []
    found = [derive(current, c) for c in DEFAULT_CHANGES]
    if found[1] is None:  # output norms there already (Peri-LN, Gemma): the embedding norm alone
        found[1] = derive(current, "yours+emb")
    return [d for d in found if d is not None]


QUICK_PREFERENCE = ("yours+out", "yours+emb", "yours-qk")  # --quick's one change: the first that applies


def applicable(current: str) -> list[str]:
    """The changes (`CHANGES`' names) that change the placement `current`: the only ones suggested."""
    return [c for c in CHANGES if derive(current, c) is not None]


def quick_default(current: str) -> tuple[str, ...]:
    """--quick's candidate when none is given: the first of `QUICK_PREFERENCE` that applies to `current` (output
    norms; where it has them already, as Gemma 2/3 and OLMo 2 do, an embedding norm; else without QK-norm), none
    where no change applies."""
    return next(((c,) for c in QUICK_PREFERENCE if derive(current, c) is not None), ())


def short_names(current: str | None, names: list[str]) -> dict[str, str]:
    """Each of `names` that is a change to `current` written as a string form (no preset's name) -> the change's
    name (`yours+emb`): what the output calls it in place of its string form."""
    if current is None:
        return {}
    made = {d.name: c for c in CHANGES if (d := derive(current, c)) is not None and d.name not in PRESETS}
    return {n: made[n] for n in names if n in made}


def stabilizers(layout: str) -> list[str]:
    """What in a placement holds training stable, by name (to say what a winner takes away)."""
    lay = as_layout(layout)
    sites = lay.sites_on()
    inner = lay.block.attn_inner
    named = {
        "QK-norm": inner.q and inner.k,
        "output norms": "attn.B" in sites or "mlp.B" in sites,
        "embedding norm": lay.embed_norm,
        "final norm": lay.final_norm,
        "attention gate": inner.gate,
        "value norm": inner.v,
    }
    return [k for k, on in named.items() if on]


def dropped(current: str | None, winner: str) -> list[str]:
    """The stabilizers the user's placement has and `winner` lacks."""
    if current is None:
        return []
    mine, theirs = stabilizers(current), stabilizers(winner)
    return [k for k in mine if k not in theirs]


__all__ = [
    "CHANGES",
    "DEFAULT_CHANGES",
    "QUICK_PREFERENCE",
    "YOURS",
    "Change",
    "Derived",
    "applicable",
    "defaults",
    "derive",
    "dropped",
    "quick_default",
    "resolve",
    "short_names",
]
