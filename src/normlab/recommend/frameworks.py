"""The winner's settings as five code bases write them: normlab, transformers, OLMo-core, torchtitan
and litgpt; or, where none of a code base's settings gives that placement, that plainly, with the
nearest placement it has and the norm sites in which the two differ.

What each can express was read from their sources (2026-11): transformers through normlab's exact
adapters (`normlab.hf.archs`: a class computes a placement exactly or is not named); OLMo-core's
`TransformerBlockType` (default: Pre-LN; default_scaled: LayerNorm Scaling; reordered_norm: OLMo 2's
x + N(F(x)); peri_norm: Peri-LN) with `AttentionConfig(qk_norm, use_head_qk_norm, gate)` and
`TransformerConfig.embedding_norm`; torchtitan's llama3 model (Pre-LN) and qwen3 model
(`Qwen3ModelArgs.qk_norm`); litgpt's `Config` (norm_1 / norm_2 input norms, post_attention_norm /
post_mlp_norm output norms, norm_qk with norm_qk_type "default" (per head) or "olmo2" (full width),
scale_embeddings). Nothing here imports those libraries.
"""

from __future__ import annotations

from typing import Any

from normlab.layout import PRESETS, as_layout
from normlab.model.config import ModelConfig

_OLMO_RMS = 'LayerNormConfig(name=LayerNormType.rms)'
# placement (a preset) -> how each code base writes it; a placement absent from a table is not expressible there
OLMO_CORE: dict[str, str] = {
    "pre": 'TransformerBlockConfig(name=TransformerBlockType.default, layer_norm=' + _OLMO_RMS + ', ...)',
    "pre-lns": 'TransformerBlockConfig(name=TransformerBlockType.default_scaled, layer_norm=' + _OLMO_RMS + ', ...)',
    "olmo2": ('TransformerBlockConfig(name=TransformerBlockType.reordered_norm, layer_norm=' + _OLMO_RMS
              + ', attention=AttentionConfig(qk_norm=' + _OLMO_RMS + ', use_head_qk_norm=False, ...), ...)'),
    "peri": ('TransformerConfig(embedding_norm=' + _OLMO_RMS + ', block=TransformerBlockConfig('
             'name=TransformerBlockType.peri_norm, layer_norm=' + _OLMO_RMS + ', ...), ...)'),
    "peri-noemb": 'TransformerBlockConfig(name=TransformerBlockType.peri_norm, layer_norm=' + _OLMO_RMS + ', ...)',
    "qwen3": ('TransformerBlockConfig(name=TransformerBlockType.default, attention=AttentionConfig(qk_norm='
              + _OLMO_RMS + ', use_head_qk_norm=True, ...), ...)'),
    "pre-gate": ('TransformerBlockConfig(name=TransformerBlockType.default, attention=AttentionConfig('
                 'gate=GateConfig(granularity=GateGranularity.elementwise), ...), ...)'),
}
TORCHTITAN: dict[str, str] = {
    "pre": "the llama3 model (TransformerModelArgs; RMSNorm before attention and FFN, final norm)",
    "qwen3": "the qwen3 model, Qwen3ModelArgs(qk_norm=True, ...)",
}
_LIT = 'Config(norm_class_name="RMSNorm", parallel_residual=False, mlp_class_name="LLaMAMLP", '
LITGPT: dict[str, str] = {
    "pre": _LIT + '...)',
    "peri-noemb": _LIT + 'post_attention_norm=True, post_mlp_norm=True, ...)',
    "gemma2": _LIT + 'post_attention_norm=True, post_mlp_norm=True, scale_embeddings=True, ...)',
    "qwen3": _LIT + 'norm_qk=True, norm_qk_type="default", ...)',
    "olmo2": _LIT + 'norm_1=False, norm_2=False, post_attention_norm=True, post_mlp_norm=True, norm_qk=True, '
                    'norm_qk_type="olmo2", ...)',
}


# the layout settings besides its norm sites that change what a block computes
_SETTINGS = ("norm", "gain", "h", "h_learned", "ln_scaling", "alpha", "embed_scale", "inner_span", "qk_after_rope", "init")


def _canonical(layout: str) -> str:
    return as_layout(layout).to_string()


def _sites(layout: str) -> set[str]:
    """The norm sites on, and the attention's scaling sites (gate, head scale) by name."""
    lay = as_layout(layout)
    inner = [lay.block.attn_inner] + [r.inner for r in lay.rules if r.inner is not None]
    extra = {name for name in ("gate", "head_scale") if any(getattr(i, name) for i in inner)}
    return lay.sites_on() | extra


def _match(layout: str, table: dict[str, Any]) -> str | None:
    want = _canonical(layout)
    return next((name for name in table if _canonical(name) == want), None)


def _nearest(layout: str, table: dict[str, Any]) -> str:
    """The placement of `table` closest to `layout` (fewest norm sites different), with the difference."""
    mine = _sites(layout)
    best = min(table, key=lambda name: (len(_sites(name) ^ mine), name))
    extra, missing = sorted(_sites(best) - mine), sorted(mine - _sites(best))
    parts = ([f"has {', '.join(extra)}"] if extra else []) + ([f"lacks {', '.join(missing)}"] if missing else [])
    other = [k for k in _SETTINGS if getattr(as_layout(best), k) != getattr(as_layout(layout), k)]
    if other:
        parts.append(f"differs in {', '.join(other)}")
    return f"{best} ({'; '.join(parts) or 'same norm sites, other settings'})"


def _entry(layout: str, table: dict[str, str], name: str) -> dict[str, Any]:
    hit = _match(layout, table)
    if hit is not None:
        return {"expressible": True, "settings": table[hit]}
    return {"expressible": False,
            "settings": f"none of {name}'s settings gives {layout}; nearest: {_nearest(layout, table)}. "
                        "It needs its block's forward changed (the equation in `normlab layouts`)."}


def _transformers(layout: str, config: ModelConfig) -> dict[str, Any]:
    from normlab.hf.archs import BY_NAME

    exact = {name: a for name, a in BY_NAME.items() if a.exports and _canonical(a.preset) == _canonical(layout)}
    via_normlab = ("`normlab export RUN OUT --arch normlab` writes normlab's own class for any placement "
                   "(AutoModelForCausalLM with trust_remote_code=True)")
    if not exact:
        presets = {a.preset: n for n, a in BY_NAME.items() if a.exports}
        return {"expressible": False,
                "settings": f"no transformers class computes {layout}; nearest: {_nearest(layout, presets)}. "
                            + via_normlab}
    problems = {name: a.model_problems(config) for name, a in exact.items()}
    clean = [name for name, p in problems.items() if not p] or list(exact)[:1]  # else the first, with what differs
    lines = []
    for name in clean:
        how = f"{type(exact[name]).__name__}ForCausalLM via `normlab export RUN OUT --arch {name}`"
        lines.append(how + (f" (your model's options differ: {'; '.join(problems[name])})" if problems[name] else ""))
    return {"expressible": True, "settings": "; or ".join(lines) + ". " + via_normlab}


def settings_for(layout: str, config: ModelConfig) -> dict[str, dict[str, Any]]:
    """The winner's settings per code base: {"expressible": bool, "settings": text}."""
    lay = as_layout(layout)
    string = lay.to_string()
    preset = next((name for name, p in PRESETS.items() if p.layout.to_string() == string), None)
    toml = f'layout = "{preset or string}"'
    return {
        "normlab": {"expressible": True,
                    "settings": f"--layout {preset or repr(string)} (string form {string}); in a TOML: {toml}"},
        "transformers": _transformers(layout, config),
        "OLMo-core": _entry(layout, OLMO_CORE, "OLMo-core"),
        "torchtitan": _entry(layout, TORCHTITAN, "torchtitan"),
        "litgpt": _entry(layout, LITGPT, "litgpt"),
    }
