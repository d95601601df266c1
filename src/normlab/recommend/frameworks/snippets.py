"""The winner's settings as five code bases write them: normlab, transformers, OLMo-core, torchtitan
and litgpt; where none of a code base's settings gives that placement, a tested patch where one is written
(`PATCHES`: a Llama or Qwen3 user's model with Peri-LN's output or embedding norms in torchtitan and litgpt,
`normlab.recommend.frameworks.patches`), else that plainly, with the change from the user's model (`base_layout`)
where the code base states the user's model, or the nearest placement it has and the norm sites in which the two
differ.

For OLMo-core, torchtitan and litgpt the settings are a complete Python snippet for the pinned release
(`PINS`) that builds the model config at the user's shape and then the model (`model`), stating every
default that changes the function: norm type, eps and bias, the rotary fraction, QK-norm's width (per
head or over all heads), the embedding scale, the gain offset (1 + w), tied embeddings, the MLP,
the key/value heads, RoPE's base. `tests/frameworks` (`make test-frameworks`) executes each snippet that
`PLACEMENTS` can emit in the real library, copies a normlab model's weights into the model it builds and
compares logits in float32; a placement is listed here only with such a test, and so is each patch
(`tests/frameworks/cases.PATCHED`). What a snippet cannot state is listed in its header ("NOT stated here"):
model options the library has no setting for, a muP or CompleteP parametrization (its multipliers and
per-parameter rates; none of the three has muP: the recipe gives an SP model's learning rate instead), what the
user's config asks for that normlab does not compute either (a scaled RoPE: `settings_for`'s `unmodelled`), and
Gemma's attn_scale only where it differs from the head width (equal, it is the libraries' own 1/sqrt(head_dim)).

What each computes was read from the installed sources (litgpt 0.5.13 `Config` / `Block`: norm_1, norm_2
input norms, post_attention_norm / post_mlp_norm output norms, norm_qk with norm_qk_type "default" (per
head) or "olmo2" (full width), scale_embeddings, and an RMSNorm gain of 1 + w when the config's name
contains "Gemma"; OLMo-core 3.0.0 `TransformerBlockType` default (Pre-LN), default_scaled (LayerNorm
Scaling), reordered_norm (x + N(F(x))), peri_norm (Peri-LN), `AttentionConfig(qk_norm, use_head_qk_norm,
gate, sliding_window)`, `TransformerConfig(embedding_norm, embed_scale, block_pattern)`, an RMSNorm that
multiplies by its weight, so gemma3's gain 1 + w is held as that weight, as its Gemma 3 conversion
`olmo_core.nn.hf.convert` holds it; its windows run in the torch backend on the CPU, which `tests/frameworks`
checks); torchtitan 0.3.0 `Llama3Model.Config` and
`Qwen3Model.Config` built from per-layer block configs with `make_gqa_config(qk_norm=...)`). transformers
goes through normlab's exact adapters (`normlab.hf.archs`). Nothing here imports those libraries.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from normlab.layout import PRESETS, Layout, as_layout
from normlab.layout.norm_kinds import NORM_KIND_FACTS, NormKindFacts
from normlab.layout.sites import NORM_SITES
from normlab.model.config import ModelConfig
from normlab.recommend.frameworks.patches import (
    PERI_FAMILY,
    SETTINGS,
    as_change,
    peri_parts,
    titan_names,
    titan_new_parameters,
)
from normlab.recommend.frameworks.settings import FRAMEWORKS, PINS, Framework


def _kinds(lay: Layout) -> set[str]:
    return {lay.norm_at(s).kind for s in lay.sites_on() if s in NORM_SITES}


def _gains(lay: Layout) -> set[str]:
    return {lay.norm_at(s).gain for s in lay.sites_on() if s in NORM_SITES}


@dataclass(frozen=True)
class Unsaid:
    """A part of a layout that none of a code base's settings states, and why: `why` per code base where it has
    a reason of its own, else `common` (read in the pinned sources, `PINS`; for transformers, its classes)."""

    what: str
    has: Callable[[Layout], bool]
    common: str
    why: dict[str, str] = field(default_factory=dict)


_NORMS = "its norms are LayerNorm, RMSNorm and their variants"


def _unsaid_kind(facts: NormKindFacts) -> Unsaid:
    """A norm kind none of the code bases computes (its facts' ``unsaid``, normlab.layout.norm_kinds)."""
    return Unsaid(facts.title, lambda lay: facts.name in _kinds(lay), str(facts.unsaid))


UNSAID: tuple[Unsaid, ...] = (
    Unsaid(
        "several residual streams (hyper-connections)",
        lambda lay: lay.streams > 1,
        "its blocks carry one residual stream (no hyper-connections or mHC in its sources)",
        {
            "transformers": "its one class with mHC, DeepseekV4ForCausalLM, computes it around DeepSeek-V4's MoE, "
            "compressed attention and learned stream head, not on a dense block"
        },
    ),
    Unsaid(
        "nGPT (hidden states and weights on the unit sphere)",
        lambda lay: lay.ngpt,
        "it has no normalized (nGPT) model",
        {
            "OLMo-core": "its nGPT (TransformerConfig.ngpt_like: NormalizedAttention) normalizes q and k over all "
            "heads at once (qk_norm on the whole projection; it takes no per-head option), where nGPT's code and "
            "normlab normalize each head: another function",
        },
    ),
    Unsaid(
        "Attention Residuals (softmax attention over depth)",
        lambda lay: lay.attn_res is not None,
        "its blocks add each sublayer's output to one residual stream with weight 1 (no attention over depth in "
        "its sources)",
        {"transformers": "no class of it attends over depth in place of the residual sum"},
    ),
    Unsaid(
        "SpanNorm's whole-block skip",
        lambda lay: any(s.skip_block for s in [lay.block.mlp] + [r.sites for r in lay.rules]),
        "each of its sublayers adds to its own input, none to the block's",
    ),
    Unsaid(
        "Keel's skip scale",
        lambda lay: lay.alpha == "keel",
        "its blocks add the skip with weight 1 and none normalizes after the add",
        {
            "OLMo-core": "its attention/feed_forward_residual_alpha scales the branch, not the skip, and none of its "
            "blocks normalizes after the add (where the two would agree)"
        },
    ),
    Unsaid(
        "SiameseNorm's two streams",
        lambda lay: lay.residual.token == "siamese",
        "its blocks carry one residual stream; none carries a Post-Norm-like stream beside it through the same "
        "sublayers (SiameseNorm's own code is a patch to OLMo, not a setting of it)",
    ),
    Unsaid("GPAS", lambda lay: lay.gpas, "no block of it subtracts a stop-gradient share of the stream"),
    Unsaid("learned skip scalars", lambda lay: lay.skip_learned, "its blocks add the stream with weight 1"),
    *(_unsaid_kind(f) for f in NORM_KIND_FACTS if f.unsaid is not None),  # each norm kind's, from its facts
    Unsaid(
        "single-scale norms",
        lambda lay: "scalar" in _gains(lay),
        f"{_NORMS}, each with a gain per channel, none with one scalar gain",
    ),
)


def unsaid(framework: str, layout: str) -> list[str]:
    """Why `framework` cannot state `layout`, for each part of it in `UNSAID` (empty: no such part; the
    norm sites may still differ, as `_nearest` says)."""
    lay = as_layout(layout)
    out = []
    for u in UNSAID:
        if u.has(lay):
            why = u.why.get(framework, u.common if framework != "transformers" else "")
            out.append(f"{u.what}: {why}" if why else u.what)
    return out


def _canonical(layout: str) -> str:
    return as_layout(layout).to_string()


def _function(layout: str) -> str:
    """The layout's string form without its init: what the model computes (the snippets leave init to the library)."""
    return replace(as_layout(layout), init=None, name=None).to_string()


def _sites(layout: str) -> set[str]:
    """The norm sites on, and the attention's scaling sites (gate, head scale) by name."""
    lay = as_layout(layout)
    inner = [lay.block.attn_inner] + [r.inner for r in lay.rules if r.inner is not None]
    extra = {name for name in ("gate", "head_scale") if any(getattr(i, name) for i in inner)}
    return lay.sites_on() | extra


def _match(layout: str, table: dict[str, Any]) -> str | None:
    want = _function(layout)
    return next((name for name in table if _function(name) == want), None)


def _nearest(layout: str, table: dict[str, Any]) -> str:
    """The placement of `table` closest to `layout` (fewest norm sites different), with the difference."""
    mine = _sites(layout)
    best = min(table, key=lambda name: (len(_sites(name) ^ mine), name))
    extra, missing = sorted(_sites(best) - mine), sorted(mine - _sites(best))
    parts = ([f"has {', '.join(extra)}"] if extra else []) + ([f"lacks {', '.join(missing)}"] if missing else [])
    theirs, yours = as_layout(best), as_layout(layout)
    other = [k for k in SETTINGS if getattr(theirs, k) != getattr(yours, k)]
    if other:
        parts.append(f"differs in {', '.join(other)}")
    return f"{best} ({'; '.join(parts) or 'same norm sites, other settings'})"


# placement (a preset, or a Llama or Qwen3 user's model with Peri-LN's parts, framework_patches.PERI_FAMILY) ->
# the code bases whose settings compute it (init aside); a placement absent is not expressible there
PLACEMENTS: dict[str, tuple[str, ...]] = {
    name: fws
    for name in dict.fromkeys([*PRESETS, *(p.name for p in PERI_FAMILY)])
    if (fws := tuple(f.name for f in FRAMEWORKS.values() if _match(name, f.placements) is not None))
}
# placement -> the code bases that compute it with a patch (`patch`), where their settings do not
PATCHES: dict[str, tuple[str, ...]] = {
    name: fws
    for name in dict.fromkeys([*PRESETS, *(p.name for p in PERI_FAMILY)])
    if (
        fws := tuple(
            f.name
            for f in FRAMEWORKS.values()
            if _match(name, f.placements) is None and _match(name, f.patches) is not None
        )
    )
}


def placement(framework: str, layout: str) -> str | None:
    """The placement of `framework`'s table that computes `layout` (init aside), or None."""
    return _match(layout, FRAMEWORKS[framework].placements)


def _init_note(layout: str, hit: str) -> str:
    init = as_layout(layout).init
    if init != as_layout(hit).init:  # e.g. pre-qk-pre: qwen3's function with Zhuo et al.'s Megatron init
        return f'# {layout}: the function of "{hit}"; its init ({init}) is not among these settings\n'
    return ""


def snippet(framework: str, layout: str, config: ModelConfig, unmodelled: Sequence[str] = ()) -> str | None:
    """The Python that builds `layout` at `config`'s shape in `framework` (its model in `model`), or None where
    none of that code base's settings gives the placement. `unmodelled`: what the user's config asks for that
    normlab does not compute (a scaled RoPE, ...), listed in the header as not stated."""
    fw, hit = FRAMEWORKS[framework], placement(framework, layout)
    if hit is None:
        return None
    return _init_note(layout, hit) + fw.write(hit, {**fw.placements[hit], "unstated": tuple(unmodelled)}, config)


def _titan_model(layout: str, base_layout: str | None) -> str:
    """torchtitan's model the patch subclasses: the user's (Llama3 for a Pre-LN model, Qwen3 for one with
    QK-norm) where `base_layout` is one of those, else by whether `layout` has QK-norm. The QK-norm itself is the
    attention's setting (make_gqa_config(qk_norm=...)) on either."""
    base = peri_parts(base_layout) if base_layout is not None else None
    target = peri_parts(layout)
    qk = base.qk if base is not None else bool(target and target.qk)
    return "Qwen3Model" if qk else "Llama3Model"


def patch(
    framework: str,
    layout: str,
    config: ModelConfig,
    base_layout: str | None = None,
    unmodelled: Sequence[str] = (),
) -> str | None:
    """The Python that builds `layout` in `framework` with a patch (a subclass beside the library's settings), its
    model in `model`, where none of its settings gives the placement and a patch is written for it; else None.
    `base_layout`, the user's placement, picks torchtitan's base block (the user's model's)."""
    fw = FRAMEWORKS[framework]
    if placement(framework, layout) is not None:
        return None
    hit = _match(layout, fw.patches)
    if hit is None:
        return None
    opts = {**fw.patches[hit], "unstated": tuple(unmodelled)}
    if framework == "torchtitan":
        opts["model"] = _titan_model(layout, base_layout)
    parts = peri_parts(hit)
    assert parts is not None  # every patch is of PERI_FAMILY
    said = as_change(base_layout, layout) if base_layout is not None else f"{hit}"
    if framework == "torchtitan":
        block, _ = titan_names(parts)
        how = (
            f"{block} subclasses torchtitan's {opts['model'].removesuffix('Model')}TransformerBlock; "
            f"new parameters (RMSNorm gains, init 1): {', '.join(titan_new_parameters(parts))}"
        )
    else:
        how = "EmbeddingNormBlock (a Block) replaces block 0; new parameter: transformer.h.0.embedding_norm.weight"
    entry = (
        " litgpt's own entry points do not open a checkpoint of this model: litgpt generate, chat and finetune "
        "build GPT(config) and load it strictly (unexpected key transformer.h.0.embedding_norm.weight), litgpt "
        "evaluate converts it to Hugging Face first; load it in your own script, where the line that replaces "
        "block 0 runs before model.load_state_dict."
        if framework == "litgpt"
        else ""
    )
    note = textwrap.wrap(
        f"a patch: none of {framework}'s settings gives {said}. {how}. Checkpoint converters (to and from "
        f"Hugging Face) do not know the new norms.{entry}",
        width=114,
        initial_indent="# ",
        subsequent_indent="# ",
    )
    return "\n".join(note) + "\n" + _init_note(layout, hit) + fw.write(hit, opts, config)


def _entry(
    layout: str, fw: Framework, config: ModelConfig, base_layout: str | None, unmodelled: Sequence[str]
) -> dict[str, Any]:
    change = (
        f"{as_change(base_layout, layout)}: "
        if base_layout is not None and _canonical(base_layout) != _canonical(layout)
        else ""
    )
    code = snippet(fw.name, layout, config, unmodelled)
    problems = fw.problems(config)
    said = f" (your model's options it cannot state: {'; '.join(problems)})" if problems else ""
    if unmodelled:
        said += f" (not stated, as normlab does not compute it: {'; '.join(unmodelled)})"
    if code is not None:
        return {
            "expressible": True,
            "patch": False,
            "code": code,
            "settings": f"{change}{PINS[fw.name]}{said}; builds it with:\n\n```python\n{code}```",
        }
    why = unsaid(fw.name, layout)
    none = f"none of {fw.name}'s settings gives {layout}" + (f" ({'; '.join(why)})" if why else "")
    code = patch(fw.name, layout, config, base_layout, unmodelled)
    if code is not None:
        return {
            "expressible": False,
            "patch": True,
            "code": code,
            "settings": f"{change}{none}; this patch for {PINS[fw.name]}{said} builds it (normlab's tests run it in "
            f"that release and compare its logits with normlab's):\n\n```python\n{code}```",
        }
    if base_layout is not None and placement(fw.name, base_layout) is not None:
        # the advice starts from the user's model, which this code base's settings give
        start = (
            f"from your model ({base_layout}), which its settings give, the change is: {as_change(base_layout, layout)}"
        )
    else:
        start = f"nearest: {_nearest(layout, fw.placements)}"
    return {
        "expressible": False,
        "patch": False,
        "code": None,
        "settings": f"{none}; {start}. It needs its block's forward changed (the equation in `normlab layouts`).",
    }


def _transformers(layout: str, config: ModelConfig, base_layout: str | None) -> dict[str, Any]:
    from normlab.hf.archs import BY_NAME

    exact = {name: a for name, a in BY_NAME.items() if a.exports and _canonical(a.preset) == _canonical(layout)}
    via_normlab = (
        "`normlab export RUN OUT --arch normlab` writes normlab's own class for any placement "
        "(AutoModelForCausalLM with trust_remote_code=True)"
    )
    if not exact:
        presets = {a.preset: n for n, a in BY_NAME.items() if a.exports}
        why = unsaid("transformers", layout)
        start = (
            f"; as changes to {as_change(base_layout, layout)}"
            if base_layout is not None and _canonical(base_layout) != _canonical(layout)
            else ""
        )
        return {
            "expressible": False,
            "patch": False,
            "code": None,
            "settings": f"no transformers class computes {layout}"
            + (f" ({'; '.join(why)})" if why else "")
            + f"{start}; nearest: {_nearest(layout, presets)}. "
            + via_normlab,
        }
    problems = {name: a.model_problems(config) for name, a in exact.items()}
    clean = [name for name, p in problems.items() if not p] or list(exact)[:1]  # else the first, with what differs
    lines = []
    for name in clean:
        how = f"{type(exact[name]).__name__}ForCausalLM via `normlab export RUN OUT --arch {name}`"
        lines.append(how + (f" (your model's options differ: {'; '.join(problems[name])})" if problems[name] else ""))
    return {"expressible": True, "patch": False, "code": None, "settings": "; or ".join(lines) + ". " + via_normlab}


def settings_for(
    layout: str,
    config: ModelConfig,
    base_layout: str | None = None,
    unmodelled: Sequence[str] = (),
    named: tuple[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """The winner's settings per code base: {"expressible": bool (by the code base's settings), "patch": bool (a
    tested patch instead), "settings": text, "code": a runnable snippet or patch (OLMo-core, torchtitan, litgpt;
    also inside "settings" as a fenced block) or None}. `base_layout`, the user's current placement (a preset's
    name or a string form), words the advice as changes to the user's model and picks torchtitan's base block.
    `unmodelled`: what the user's config asks for that normlab does not compute (`UserModel.unmodelled`: a scaled
    RoPE, ...), which each snippet lists as not stated (it builds the function without it). `named`: the layout's
    short name and words when it is a change to the user's placement (`yours+emb`, "your model (gemma3) + embedding
    norm"), which the code headers then name beside its string form (`_with_name`)."""
    lay = as_layout(layout)
    string = lay.to_string()
    preset = next((name for name, p in PRESETS.items() if p.layout.to_string() == string), None)
    toml = f'layout = "{preset or string}"'
    settings = {
        "normlab": {
            "expressible": True,
            "patch": False,
            "code": None,
            "settings": f"--layout {preset or repr(string)} (string form {string}); in a TOML: {toml}",
        },
        "transformers": _transformers(layout, config, base_layout),
        **{name: _entry(layout, fw, config, base_layout, unmodelled) for name, fw in FRAMEWORKS.items()},
    }
    return _with_name(settings, layout, *named) if named else settings


def _with_name(settings: dict[str, dict[str, Any]], layout: str, short: str, label: str) -> dict[str, dict[str, Any]]:
    """The settings with the code headers naming the layout by its short name and words
    (`# normlab layout yours+emb (your model (gemma3) + embedding norm): "attn=..."`), not its string form alone."""
    old, new = f'# normlab layout "{layout}"', f'# normlab layout {short} ({label}): "{layout}"'
    return {
        fw: {k: v.replace(old, new) if isinstance(v, str) else v for k, v in entry.items()}
        for fw, entry in settings.items()
    }


__all__ = [
    "FRAMEWORKS",
    "PATCHES",
    "PINS",
    "PLACEMENTS",
    "UNSAID",
    "Framework",
    "patch",
    "placement",
    "settings_for",
    "snippet",
    "unsaid",
]
