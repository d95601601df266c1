"""Exact conversions between normlab models and transformers' own architectures.

A normlab layout maps onto a transformers class only when the two compute the same function. The
architectures are a registry (`normlab.hf.archs.ARCHITECTURES`), one adapter each beside its weight
map:

Both ways:
- `llama` (LlamaForCausalLM) <-> layout `pre` (`attn=A,mlp=A,final`): x' = x + F(N(x)), final N.
- `olmo2` (Olmo2ForCausalLM) <-> layout `olmo2` (`attn=qkB,mlp=B,final,inner=full`): x' = x + N(F(x))
  with RMSNorm on the full Q and K projections.
- `gemma2` (Gemma2ForCausalLM) <-> layout `gemma2` (Peri-LN with the sqrt(d) embedding scale) with
  Gemma 2's GeGLU-tanh MLP, attention scale and soft-capping as model options.
- `qwen3` (Qwen3ForCausalLM) <-> layout `qwen3` (`attn=qkA,mlp=A,final`): Pre-LN with per-head QK-norm
  before RoPE, its own head width (`d_head`).
- `mistral` (MistralForCausalLM) <-> layout `pre` with `sliding_window` on every layer.
- `qwen2` (Qwen2ForCausalLM) <-> layout `pre` with `qkv_bias` (biases on Q, K, V only).
- `gemma3` (Gemma3ForCausalLM, model_type gemma3_text) <-> layout `gemma3` (Peri-LN, QK-norm, (1 + w) gains as
  normlab's centered gain) with its local layers (`sliding_window`, `full_attention_every`, `rope_local_theta`).
- `olmo3` (Olmo3ForCausalLM) <-> layout `olmo2` with OLMo 3's local layers (three of four windowed).
Import only:
- `gpt2` (GPT2LMHeadModel) -> layout `pre,norm=layer` with learned absolute positions and biases.

A muP or CompleteP model (`normlab.model.parametrization`) computes the stock function with multipliers on it: the
logits W (h / m), the q.k scale sqrt(d_head,base) / d_head, CompleteP's branch r^-alpha. Each is a constant on a
linear path, so it is folded into the weights that precede it (`parametrization_folds`): 1/m into the final norm's
gain (tied embeddings untouched), the attention scale's ratio to the class's own into the q projection (or the
q-norm's gain where QK-norm would undo a scale on the projection), r^-alpha into the output norm's gain or, without
one, the o and down projections. The exported class then computes normlab's logits to rounding; what it trains
further is SP (its multipliers are weights now). A multiplier with no exact place is refused by name, and `export`'s
"auto" writes the normlab class, which computes the parametrization itself.

Anything else is refused with `NativeExportError` naming the first difference; so is a config that
asks for something normlab does not compute (scaled RoPE, other activations, biases, a pattern of
local and global layers other than "every k-th layer global"): a conversion that silently changed the function would
be worse than none.

transformers is an optional dependency (`pip install normlab[hf]`), imported only here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from normlab.errors import ConfigError
from normlab.hf.archs import ARCHITECTURES, BY_NAME, EXPORTABLE, Arch
from normlab.hf.library import require_transformers
from normlab.layout import PRESETS
from normlab.model.build import build_model
from normlab.model.config import ModelConfig
from normlab.model.lm import NormLM

ARCHS = EXPORTABLE  # export name (a transformers model_type, or gemma3) -> the normlab preset it equals
REFUSED: dict[str, str] = {}  # model_type -> why it cannot be imported exactly


class NativeExportError(ConfigError):
    """The model's layout or options do not map exactly onto the requested transformers class."""


def attention_refusal(kind: str, arch: str) -> str:
    """Why attention ``kind`` (mla, moda, depth_value) has no exact ``arch`` counterpart."""
    if kind == "depth_value":
        return (
            f"attention=depth_value has no {arch} counterpart: no transformers class mixes a layer's values with the "
            "earlier layers' at the same position (Depth-Attention, arXiv 2606.05014); export with --arch normlab"
        )
    if kind == "moda":
        return (
            f"attention=moda has no {arch} counterpart: no transformers class lets a head attend to the earlier "
            "layers' keys and values (mixture-of-depths attention, arXiv 2603.15619); export with --arch normlab"
        )
    return (
        f"attention=mla has no {arch} counterpart ({arch} projects keys and values per head); export with --arch "
        "normlab, or, for layout pre with a RoPE part, build transformers' DeepseekV3ForCausalLM with "
        "normlab.hf.deepseek.to_deepseek_v3"
    )


def _export_arch(model: NormLM, arch: str) -> Arch:
    """The adapter for exporting ``model`` as ``arch``, or a NativeExportError naming the first difference."""
    if arch not in ARCHS:
        raise NativeExportError(
            f"no native transformers class for {arch!r}; valid: {', '.join(ARCHS)} (or save with the normlab class)"
        )
    adapter = BY_NAME[arch]
    if model.config.n_experts:
        raise NativeExportError(
            f"a mixture-of-experts model has no exact {arch} counterpart ({arch} has dense MLPs; OLMoE's class, the "
            "nearest MoE architecture, is not mapped: its routing renormalization and weight layout would need an "
            "exact match); export with --arch normlab, which keeps every layout and the experts"
        )
    if model.config.attention != "mha":
        raise NativeExportError(attention_refusal(model.config.attention, arch))
    if model.layout.softmax != "softmax":
        raise NativeExportError(
            f"attention softmax={model.layout.softmax} has no exact {arch} counterpart: {arch} normalizes its logits "
            "with a plain softmax (GPT-OSS's class computes learned sinks, but around its clamped-SwiGLU experts "
            "and biased router, which normlab does not compute); export with --arch normlab, which keeps it"
        )
    why = residual_refusal(model.layout, arch) or norm_refusal(model.layout, arch)
    if why is not None:
        raise NativeExportError(why)
    want = PRESETS[adapter.preset].layout.to_string()
    have = model.layout.to_string()
    if have != want:
        raise NativeExportError(
            f"layout {have!r} does not map exactly onto {arch} (which is {adapter.preset!r}: "
            f"{want!r}); native exports: " + ", ".join(f"{p} -> {a}" for a, p in ARCHS.items())
        )
    problems = adapter.model_problems(model.config)
    if problems:
        raise NativeExportError(f"model options do not map onto {arch}: {'; '.join(problems)}")
    parametrization_folds(model, arch)  # a multiplier with no exact place: refused by name
    return adapter


@dataclass(frozen=True)
class Fold:
    """One weight that takes a parametrization's multiplier: normlab parameter ``name`` times ``factor``; a
    centered gain (applied as 1 + w) takes it as 1 + w' = factor (1 + w)."""

    name: str
    factor: float
    centered: bool = False

    def apply(self, value: torch.Tensor) -> torch.Tensor:
        off = 1.0 if self.centered else 0.0
        return (self.factor * (value.double() + off) - off).to(value.dtype)


def _norm_folds(model: NormLM, path: str, factor: float) -> list[Fold] | None:
    """Folds of ``factor`` into the norm at module ``path``: its gain (and LayerNorm's beta), which multiply its
    whole output; None where the norm has no per-channel gain to carry it (or is not a plain RMS/LayerNorm)."""
    from normlab.model.norms import LayerNorm, RMSNorm

    norm = model.get_submodule(path)
    if type(norm) not in (RMSNorm, LayerNorm) or getattr(norm, "weight", None) is None:
        return None
    folds = [Fold(f"{path}.weight", factor, bool(getattr(norm, "offset", 0.0)))]
    if getattr(norm, "bias", None) is not None:
        folds.append(Fold(f"{path}.bias", factor))
    return folds


def _linear_folds(model: NormLM, path: str, factor: float) -> list[Fold]:
    """Folds of ``factor`` into the Linear at ``path`` (its output times factor: weight and bias)."""
    lin = model.get_submodule(path)
    return [Fold(f"{path}.{p}", factor) for p in ("weight", "bias") if getattr(lin, p, None) is not None]


def parametrization_folds(model: NormLM, arch: str) -> list[Fold]:
    """The weights that carry ``model``'s parametrization multipliers in ``arch``'s class (module doc), none under SP
    or at the base shape; a NativeExportError naming the multiplier where one has no exact place.

    - muP's readout, logits = W (h / m): the final norm's gain times 1/m (its output is all the head reads; the
      head itself is the embedding when tied, which a fold there would change too).
    - the q.k scale s (muP's sqrt(d_base) / d_head law) where the class computes s_0 = query_pre_attn_scalar^-1/2
      (Gemma) or d_head^-1/2: q times s / s_0 (RoPE is linear, so before or after it alike): on the q projection,
      or with QK-norm on the q-norm's gain (the norm would undo a scale on its input).
    - CompleteP's x + r^-alpha F: the output norm's gain where the block has one, else the o and down projections.
    """
    cfg = model.config
    if cfg.parametrization == "sp":
        return []
    folds: list[Fold] = []
    missing: list[str] = []
    if cfg.output_multiplier != 1.0:
        got = _norm_folds(model, "final_norm", cfg.output_multiplier)
        if got is None:
            missing.append(f"the readout's 1/m = {cfg.output_multiplier:g} (no final-norm gain to carry it)")
        folds += got or []
    base = (cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim) ** -0.5  # the class's own q.k scale
    r = cfg.branch_multiplier
    for i, block in enumerate(model.blocks):
        attn = cast(Any, block).attn
        scale = attn.scale if attn.scale is not None else attn.head_dim**-0.5
        if scale != base:
            c = scale / base
            if isinstance(attn.q_norm, torch.nn.Identity):
                folds += _linear_folds(model, f"blocks.{i}.attn.q_proj", c)
            else:
                got = _norm_folds(model, f"blocks.{i}.attn.q_norm", c)
                if got is None:
                    missing.append(f"block {i}'s q.k scale x{c:.6g} (its q-norm has no gain to carry it)")
                folds += got or []
        if r != 1.0:
            for sub, proj in (("attn", "attn.o_proj"), ("mlp", "mlp.down_proj")):
                path = f"blocks.{i}.{sub}_norms.output"
                if isinstance(model.get_submodule(path), torch.nn.Identity):
                    folds += _linear_folds(model, f"blocks.{i}.{proj}", r)
                    continue
                got = _norm_folds(model, path, r)
                if got is None:
                    missing.append(f"block {i}'s {sub} branch x{r:.6g} (its output norm has no gain to carry it)")
                folds += got or []
    if missing:
        raise NativeExportError(
            f"parametrization={cfg.parametrization}'s multipliers have no exact place in {arch}'s weights: "
            f"{'; '.join(missing[:3])}; export with --arch normlab, whose class computes them"
        )
    return folds


def folds_in_words(model: NormLM) -> str:
    """What a stock export of ``model`` folded into its weights, in words ("" under SP or at the base shape)."""
    cfg = model.config
    if cfg.parametrization == "sp":
        return ""
    said = []
    if cfg.output_multiplier != 1.0:
        said.append(f"the readout's 1/m = {cfg.output_multiplier:g} in the final norm's gain")
    attn = cast(Any, model.blocks[0]).attn
    scale = attn.scale if attn.scale is not None else attn.head_dim**-0.5
    base = (cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim) ** -0.5
    if scale != base:
        said.append(f"the q.k scale's x{scale / base:.4g} in q")
    if cfg.branch_multiplier != 1.0:
        said.append(f"the branches' x{cfg.branch_multiplier:.4g} in their last weights")
    if not said:
        return ""
    return (
        f"; {cfg.parametrization}'s multipliers folded into the weights ({', '.join(said)}): the same logits, and "
        "what trains further on it is SP"
    )


def residual_refusal(layout: Any, arch: str) -> str | None:
    """Why no transformers class computes ``layout``'s residual path, for the 2026 forms (Keel's skip scale, SpanNorm's
    whole-block skip, Attention Residuals, SiameseNorm's two streams), or None: every class adds each sublayer's output
    to its input with weight 1."""
    what = [
        text
        for text, on in (
            (
                "Attention Residuals (a softmax read over the embedding and the blocks' sums in place of the "
                "residual sum)",
                layout.attn_res is not None,
            ),
            (
                "SpanNorm's whole-block skip (the MLP adds to the block's input)",
                any(s.skip_block for s in [layout.block.mlp] + [r.sites for r in layout.rules]),
            ),
            ("Keel's skip scale (alpha = the number of sublayers)", layout.alpha == "keel"),
            (
                "SiameseNorm's two streams (a Post-Norm-like and a Pre-Norm-like stream through the same sublayers)",
                layout.residual.token == "siamese",
            ),
        )
        if on
    ]
    if not what:
        return None
    return (
        f"{'; '.join(what)}: no transformers class computes it ({arch}'s blocks add each sublayer's output to its "
        "input with weight 1); export with --arch normlab, whose remote code is normlab's block"
    )


# the 2026-H2 norm kinds (issue 67): why no transformers class computes each
_NORM_REFUSALS = {
    "gatednorm": (
        "GatedNorm's low-rank gate y * sigmoid(SiLU(y W_down) W_up) after RMSNorm: {arch}'s norms are RMSNorm with a "
        "per-channel weight and no gate"
    ),
    "taper": (
        "TaperNorm: while its gate is above 0 it blends RMSNorm with a fixed scaling, which no class computes; at "
        "gate 0 its input norms fold into the projections (normlab.model.taper_fold), but {arch}'s layers still "
        "apply their RMSNorm there"
    ),
}


def norm_refusal(layout: Any, arch: str) -> str | None:
    """Why no transformers class computes ``layout``'s norm kind (GatedNorm, TaperNorm), or None."""
    kinds = {layout.norm} | {sn.kind for _, sn in layout.site_norms if sn.kind is not None}
    what = [_NORM_REFUSALS[k].format(arch=arch) for k in sorted(kinds) if k in _NORM_REFUSALS]
    if not what:
        return None
    return f"{'; '.join(what)}; export with --arch normlab, whose remote code is normlab's norm"


def name_map(arch: str, n_layers: int, tied: bool) -> dict[str, str]:
    """normlab parameter name -> transformers parameter name for ``arch``."""
    return BY_NAME[arch].name_map(n_layers, tied)


def to_native(model: NormLM, arch: str) -> Any:
    """A transformers model of ``arch``'s own class computing exactly what ``model`` does."""
    adapter = _export_arch(model, arch)
    tf = require_transformers()
    cfg = model.config
    hf = adapter.hf_class(tf)(adapter.hf_config(tf, cfg))
    ours = model.state_dict()
    mapping = adapter.name_map(cfg.n_layers, cfg.tie_embeddings)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()  # the embedding under its second name
    missing = sorted(set(ours) - set(mapping) - tied - {k for k in ours if not k.endswith("weight")})
    if missing:
        raise NativeExportError(f"parameters with no {arch} counterpart: {missing[:5]}")
    ours = dict(ours)
    for fold in parametrization_folds(model, arch):  # muP's and CompleteP's multipliers (module doc)
        ours[fold.name] = fold.apply(ours[fold.name])
    state = {mapping[k]: adapter.export_weight(mapping[k], v) for k, v in ours.items() if k in mapping}
    result = hf.load_state_dict(state, strict=False)
    unexpected = [k for k in result.missing_keys if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if unexpected or result.unexpected_keys:
        raise NativeExportError(
            f"weight names did not line up: missing {unexpected}, unexpected {result.unexpected_keys}"
        )
    return hf.eval()


def save_native(model: NormLM, out: str | Path, arch: str, tokenizer: Any = None) -> Path:
    """Save ``model`` as a transformers `arch` checkpoint (config.json + model.safetensors)."""
    from normlab.hf.tokenizer import set_special_tokens

    hf = to_native(model, arch)
    set_special_tokens(hf, tokenizer)
    out = Path(out)
    hf.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def from_native(source: str | Path | Any) -> NormLM:
    """A normlab model from a transformers model of a registered architecture, or a local folder of one."""
    tf = require_transformers()
    if isinstance(source, (str, Path)):
        from normlab.hf.folder import check_folder, reading

        check_folder(source)
        with reading(source):
            config = tf.AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False)
            adapter = _import_arch(config)
            hf = tf.AutoModelForCausalLM.from_pretrained(
                source, local_files_only=True, dtype=torch.float32, trust_remote_code=False
            )
    else:
        hf, config = source, source.config
        adapter = _import_arch(config)
    model = build_model(adapter.preset, adapter.model_config(config), seed=0)
    model.load_state_dict(adapter.import_state(hf.state_dict(), config), strict=True)
    return model.eval()


@dataclass(frozen=True)
class StatedModel:
    """What a transformers folder's config.json says about the model it holds, read as normlab computes it."""

    kind: str  # the config's model_type ("normlab" for the normlab class)
    layout: str  # the layout its class computes (a preset name or string form)
    config: ModelConfig  # every setting the folder states, as normlab's model options
    keys: dict[str, str]  # normlab option -> the config.json key that states it (for messages)

    def key(self, option: str) -> str:
        return self.keys.get(option, option)


def stated_model(folder: str | Path) -> StatedModel:
    """The model a transformers folder holds, from its config.json alone (the weights are not read): the folder is
    checked first (`normlab.hf.folder.check_folder`), transformers reads the config (its defaults fill what the
    file leaves out), and the registered adapter turns it into the layout and `ModelConfig` that compute the
    same function, as `from_native` builds them; a config normlab does not compute exactly is a
    NativeExportError naming the first difference. A normlab-class export states its layout and options."""
    from normlab.hf.folder import check_folder, reading

    tf = require_transformers()
    check_folder(folder)
    with reading(folder):
        config = tf.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        if config.model_type == "normlab":
            return StatedModel(
                "normlab", config.layout, ModelConfig(**config.model), {k: f"model.{k}" for k in config.model}
            )
        adapter = _import_arch(config)
        return StatedModel(
            config.model_type,
            adapter.preset,
            adapter.model_config(config),
            {"mlp": adapter.activation_key, **adapter.config_keys},
        )


def _import_arch(config: Any) -> Arch:
    """The adapter for importing ``config``, or a NativeExportError naming what does not map."""
    kind = getattr(config, "model_type", "?")
    if kind in REFUSED:
        raise NativeExportError(f"cannot import {kind} exactly: {REFUSED[kind]}")
    if kind not in ARCHITECTURES:
        raise NativeExportError(
            f"no exact normlab layout for model_type {kind!r}; importable: {', '.join(ARCHITECTURES)}"
        )
    adapter = ARCHITECTURES[kind]
    problems = adapter.config_problems(config)
    if problems:
        raise NativeExportError(f"{kind} config does not map exactly onto normlab: {'; '.join(problems)}")
    return adapter
