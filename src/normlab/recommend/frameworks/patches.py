"""Patches for placements a code base's settings do not reach, and the words for a placement as changes to the
user's own (`normlab.recommend.frameworks.snippets` prints them).

The placements patched are Peri-LN's parts on a Pre-LN block with or without QK-norm (per head, before RoPE),
RMSNorm with a gain per channel: output norms after attention and after the MLP, x + N_out(F(N_in(x))) (Kim et
al. 2025, Peri-LN, eq. 3), and the embedding norm y0 = N(emb) (Sec. 3.3). They are the changes
`normlab.recommend.planning.derived` makes to a Llama (pre) or Qwen3 (qwen3) user's model: eight layouts in all
(`PERI_FAMILY`), Pre-LN and Qwen3 among them.

torchtitan 0.3.0 (read in its sources: `Llama3TransformerBlock` / `Qwen3TransformerBlock` build attention,
feed_forward, attention_norm and ffn_norm from their `Config`, a `@dataclass(kw_only=True, slots=True)` whose
`build()` constructs the class it is nested in; `Decoder.forward` feeds the embedding straight to the first
block): a block subclass with a Config of its own carries the output norms, and on the first block the
embedding norm (its input is the embedding; a norm there is y0 = N(emb), and it shards, pipelines and
checkpoints as the block does); a model subclass gives the new norms the input norms' sharding in
`update_from_config`. litgpt 0.5.13 states output norms (post_attention_norm, post_mlp_norm) but has no embedding
norm: a `Block` subclass that normalizes its input replaces block 0. OLMo-core 3.0.0 states all eight by its
settings (`TransformerBlockType.peri_norm`, `TransformerConfig.embedding_norm`, `use_head_qk_norm`): no patch.

Nothing here imports those libraries; `tests/frameworks` runs every patch as printed.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace
from itertools import product

from normlab.layout import PRESETS, as_layout
from normlab.layout.sites import NORM_SITES


@dataclass(frozen=True)
class PeriParts:
    """A Pre-LN block (RMSNorm) with `qk` (QK-norm per head), `out` (output norms after attention and the MLP)
    and `emb` (an embedding norm)."""

    qk: bool
    out: bool
    emb: bool

    @property
    def layout(self) -> str:
        b = "B" if self.out else ""
        return as_layout(f"attn={'qk' if self.qk else ''}A{b},mlp=A{b}{',emb' if self.emb else ''},final").to_string()

    @property
    def name(self) -> str:
        """The preset's name where the layout is one, else its string form."""
        return next((n for n, p in PRESETS.items() if p.layout.to_string() == self.layout), self.layout)


PERI_FAMILY: tuple[PeriParts, ...] = tuple(PeriParts(*bits) for bits in product((False, True), repeat=3))


def _function(layout: str) -> str:
    """The layout's string form without its init: what the model computes."""
    return replace(as_layout(layout), init=None, name=None).to_string()


def peri_parts(layout: str) -> PeriParts | None:
    """The parts of `layout` where it is one of `PERI_FAMILY` (its init aside), else None."""
    want = _function(layout)
    return next((p for p in PERI_FAMILY if p.layout == want), None)


# --- a placement as changes to the user's ----------------------------------------------------------------

# the layout settings besides its norm sites that change what a block computes
SETTINGS = (
    "norm",
    "gain",
    "h",
    "h_learned",
    "skip_learned",
    "gpas",
    "streams",
    "stream_mix",
    "ngpt",
    "attn_res",
    "ln_scaling",
    "alpha",
    "embed_scale",
    "inner_span",
    "qk_after_rope",
    "init",
)

# norm sites by what they are, grouped as a user names them (sites of normlab.layout.sites.NORM_SITES)
_SITE_WORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("attn.B", "mlp.B"), "output norms after attention and after the MLP"),
    (("attn.B",), "an output norm after attention"),
    (("mlp.B",), "an output norm after the MLP"),
    (("attn.A", "mlp.A"), "input norms before attention and the MLP"),
    (("attn.A",), "an input norm before attention"),
    (("mlp.A",), "an input norm before the MLP"),
    (("attn.C", "mlp.C"), "norms after each residual add (Post-LN)"),
    (("attn.C",), "a norm after attention's residual add"),
    (("mlp.C",), "a norm after the MLP's residual add"),
    (("mlp.H",), "a norm on the MLP's hidden activation"),
    (("q", "k"), "QK-norm"),
    (("q",), "a query norm"),
    (("k",), "a key norm"),
    (("v",), "a value norm"),
    (("c",), "a norm on attention's output before W_O"),
    (("emb",), "an embedding norm"),
    (("final",), "the final norm"),
)
assert {s for sites, _ in _SITE_WORDS for s in sites} == set(NORM_SITES)


def _named(sites: set[str]) -> list[str]:
    out, left = [], set(sites)
    for group, words in _SITE_WORDS:
        if set(group) <= left:
            out.append(words)
            left -= set(group)
    return out + sorted(left)


def changes(base: str, layout: str) -> list[str]:
    """`layout` as changes to `base`, in words: "+ output norms after attention and after the MLP", "without
    QK-norm", and "(other settings: norm, gain)" for what differs besides the norm sites (empty: the same)."""
    mine, theirs = as_layout(base), as_layout(layout)
    have, want = mine.sites_on() & set(NORM_SITES), theirs.sites_on() & set(NORM_SITES)
    words = [f"+ {w}" for w in _named(want - have)] + [f"without {w}" for w in _named(have - want)]
    other = [k for k in SETTINGS if getattr(mine, k) != getattr(theirs, k)]
    if other:
        words.append(f"(other settings: {', '.join(other)})")
    return words


def as_change(base: str, layout: str) -> str:
    """`layout` said from the user's model: "your model (qwen3) + output norms after attention and after the MLP"."""
    said = changes(base, layout)
    return f"your model ({base}) " + (" ".join(said) if said else "as it is")


# --- torchtitan 0.3.0 ------------------------------------------------------------------------------------


def titan_names(parts: PeriParts) -> tuple[str, str]:
    """(the block subclass's name, the model subclass's name) the torchtitan patch defines."""
    what = "PeriLN" if parts.out else "EmbeddingNorm"
    return f"{what}Block", f"{what}Model"


def titan_new_parameters(parts: PeriParts) -> list[str]:
    """The state-dict names the torchtitan patch adds to its base model's, each an RMSNorm gain initialized to 1."""
    names = ["layers.{i}.post_attention_norm.weight", "layers.{i}.post_ffn_norm.weight"] if parts.out else []
    return names + (["layers.0.embedding_norm.weight"] if parts.emb else [])


def titan_classes(parts: PeriParts, model: str) -> list[str]:
    """The block and model subclasses on torchtitan's `model` ("Llama3Model" or "Qwen3Model"): Python lines."""
    base = model.removesuffix("Model") + "TransformerBlock"
    block, new_model = titan_names(parts)
    moe = model == "Qwen3Model"  # Qwen3's block holds a MoE in place of the feed-forward where configured
    fields = ["post_attention_norm", "post_ffn_norm"] if parts.out else []
    doc = (
        f"{base} with Peri-LN's output norms, x + N_out(F(N_in(x))) (Kim et al. 2025, eq. 3)"
        + (", and on the first block the embedding norm y0 = N(emb) (Sec. 3.3) on its input." if parts.emb else ".")
        if parts.out
        else f"{base} that normalizes its input on the first block: the embedding norm y0 = N(emb) (Peri-LN, "
        "Kim et al. 2025, Sec. 3.3)."
    )
    doc += f" New parameters: {', '.join(titan_new_parameters(parts))}; init ones (norm()'s param_init)."
    wrapped = textwrap.wrap(doc, width=110, initial_indent='    """', subsequent_indent="    ")
    lines = [
        f"class {block}({base}):",
        *wrapped[:-1],
        wrapped[-1] + '"""',
        "",
        "    @dataclass(kw_only=True, slots=True)",
        f"    class Config({base}.Config):",
        *(f"        {f}: RMSNorm.Config" for f in fields),
    ]
    if parts.emb:
        lines.append("        embedding_norm: RMSNorm.Config | None = None  # the first block's only")
    lines += ["", "    def __init__(self, config):", "        super().__init__(config)"]
    lines += [f"        self.{f} = config.{f}.build()" for f in fields]
    if parts.emb:
        lines.append(
            "        self.embedding_norm = None if config.embedding_norm is None else config.embedding_norm.build()"
        )
    lines += ["", "    def forward(self, x, attention_masks, positions=None):"]
    if parts.emb:
        lines += [
            "        if self.embedding_norm is not None:  # the first block: its input is the embedding",
            "            x = self.embedding_norm(x)",
        ]
    if parts.out:
        lines += [
            "        h = self.attention(self.attention_norm(x), attention_masks, positions)",
            "        x = x + self.post_attention_norm(h)",
            "        ffn = self.moe if self.moe_enabled else self.feed_forward"
            if moe
            else "        ffn = self.feed_forward",
            "        return x + self.post_ffn_norm(ffn(self.ffn_norm(x)))",
        ]
    else:
        lines.append(f"        return {base}.forward(self, x, attention_masks, positions)")
    new = [*fields, *(["embedding_norm"] if parts.emb else [])]
    lines += [
        "",
        "",
        f"class {new_model}({model}):",
        f'    """{model} whose config gives the new norms the sharding of the input norms (tensor and sequence',
        '    parallel: each normalizes the residual stream\'s width where attention_norm does)."""',
        "",
        "    @dataclass(kw_only=True, slots=True)",
        f"    class Config({model}.Config):",
        "        def update_from_config(self, *, config, **kwargs):",
        f"            {model}.Config.update_from_config(self, config=config, **kwargs)",
        "            for layer in self.layers:",
        f"                for name in {tuple(new)!r}:",
        "                    if getattr(layer, name) is not None:",
        "                        getattr(layer, name).sharding_config = layer.attention_norm.sharding_config",
    ]
    return lines


def titan_block_fields(parts: PeriParts, d: int) -> list[str]:
    """The block config's extra fields, one line each (inside `for i in range(n_layers)`)."""
    lines = [f"post_attention_norm=norm({d}),", f"post_ffn_norm=norm({d}),"] if parts.out else []
    return lines + ([f"embedding_norm=norm({d}) if i == 0 else None,"] if parts.emb else [])


# --- litgpt 0.5.13 ---------------------------------------------------------------------------------------

LITGPT_EMBEDDING_NORM = [
    "",
    "",
    "class EmbeddingNormBlock(Block):",
    '    """litgpt\'s Block that normalizes its input first: as block 0, Peri-LN\'s embedding norm y0 = N(emb)',
    "    (Kim et al. 2025, Sec. 3.3). New parameter: transformer.h.0.embedding_norm.weight, init ones (litgpt's",
    '    RMSNorm)."""',
    "",
    "    def __init__(self, config, block_idx):",
    "        super().__init__(config, block_idx)",
    "        self.embedding_norm = config.norm_class(config.n_embd, eps=config.norm_eps)",
    "",
    "    def forward(self, x, *args, **kwargs):",
    "        return super().forward(self.embedding_norm(x), *args, **kwargs)",
    "",
    "",
]
LITGPT_EMBEDDING_NORM_BUILD = [
    "model.transformer.h[0] = EmbeddingNormBlock(config, 0)",
    "# in your script: wherever it builds GPT(config) (litgpt's pretrain does so in its setup); litgpt's",
    "# _init_weights leaves the norms at 1",
]


__all__ = [
    "LITGPT_EMBEDDING_NORM",
    "LITGPT_EMBEDDING_NORM_BUILD",
    "PERI_FAMILY",
    "SETTINGS",
    "PeriParts",
    "as_change",
    "changes",
    "peri_parts",
    "titan_block_fields",
    "titan_classes",
    "titan_names",
    "titan_new_parameters",
]
