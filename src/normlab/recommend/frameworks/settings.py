"""Each code base's settings as data and its snippet's writer (OLMo-core 3.0.0, torchtitan 0.3.0, litgpt
0.5.13: `PINS`): the placements its settings compute (preset -> its own settings), the model options it
cannot state, and the complete Python that builds the model at the user's shape. What each computes was
read from the installed sources (`normlab.recommend.frameworks.snippets`' docstring); `tests/frameworks` builds every
snippet in the real library and compares logits. Split from `frameworks` (matching, the patches, the
settings per code base), which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from normlab.layout import PRESETS
from normlab.model.config import ModelConfig
from normlab.recommend.frameworks.patches import (
    LITGPT_EMBEDDING_NORM,
    LITGPT_EMBEDDING_NORM_BUILD,
    PERI_FAMILY,
    PeriParts,
    titan_block_fields,
    titan_classes,
    titan_names,
)

# the releases the snippets are written for and tested against (`make test-frameworks`)
PINS: dict[str, str] = {
    "OLMo-core": "ai2-olmo-core==3.0.0",
    "torchtitan": "torchtitan==0.3.0",
    "litgpt": "litgpt==0.5.13",
}


@dataclass(frozen=True)
class Framework:
    """One code base: the placements it computes (preset -> its own settings for it, as data), the model
    options it cannot state, and the snippet's writer."""

    name: str
    placements: dict[str, dict[str, Any]]
    problems: Callable[[ModelConfig], list[str]]
    write: Callable[[str, dict[str, Any], ModelConfig], str]
    # placement -> the writer's options for a patch (code beside the library's settings: framework_patches)
    patches: dict[str, dict[str, Any]] = field(default_factory=dict)


def _num(x: float) -> str:
    """A number as Python source: an integral value without a fraction (litgpt and OLMo-core type RoPE's base int)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _header(
    framework: str, layout: str, cfg: ModelConfig, problems: list[str], unmodelled: tuple[str, ...] = ()
) -> list[str]:
    preset = PRESETS.get(layout)
    lines = [
        f'# normlab layout "{layout}"' + (f": {preset.equation}" if preset else ""),
        f"# in {PINS[framework].replace('==', ' ')} (pip install {PINS[framework]}); the function only: "
        "initialize and train it as that library does",
    ]
    if problems:
        lines.append(f"# NOT stated here ({framework} has no setting for it): {'; '.join(problems)}")
    if unmodelled:  # the user's config asks for it; normlab does not compute it, so neither does this code
        lines.append(
            "# NOT stated here (your config has it; normlab does not compute it, so this code leaves it out: add "
            f"{framework}'s own setting for it, if it has one): {'; '.join(unmodelled)}"
        )
    return lines


def parametrization_unsaid(cfg: ModelConfig) -> str | None:
    """What a muP / CompleteP model computes beyond SP, which none of OLMo-core 3.0.0, torchtitan 0.3.0 or litgpt
    0.5.13 has a setting for (normlab.model.parametrization), in words with its numbers; None under SP."""
    if cfg.parametrization == "sp":
        return None
    parts = []
    if cfg.output_multiplier != 1.0:
        parts.append(f"the logits' multiplier 1/m = {cfg.output_multiplier:g}")
    scale, sp = cfg.attention_scale(cfg.head_dim), (cfg.attn_scale or cfg.head_dim) ** -0.5
    if scale is not None and scale != sp:
        parts.append(f"the q.k scale {scale:.6g} (muP's 1/d_head law; SP's {sp:.6g})")
    if cfg.branch_multiplier != 1.0:
        parts.append(f"each residual branch x {cfg.branch_multiplier:.6g} (CompleteP's (L/L_base)^-alpha)")
    parts.append("per-parameter learning rates, init and weight decay")
    return (
        f"parametrization={cfg.parametrization} ({', '.join(parts)}: normlab's only; the library trains SP; "
        "the recipe says the learning rate for an SP model at your width)"
    )


def attn_scale_differs(cfg: ModelConfig) -> bool:
    """Whether ``attn_scale`` (Gemma's query_pre_attn_scalar) changes the function: its scale attn_scale^-1/2 is the
    libraries' own 1/sqrt(head_dim) where it equals the head width (every Gemma 3)."""
    return cfg.attn_scale is not None and float(cfg.attn_scale) != float(cfg.head_dim)


def _common_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if (mup := parametrization_unsaid(cfg)) is not None:
        problems.append(mup)
    if cfg.position != "rope":
        problems.append(f"position={cfg.position} (learned absolute positions)")
    if cfg.n_experts:
        problems.append(f"n_experts={cfg.n_experts} (normlab's MoE)")
    return problems


# --- litgpt ---------------------------------------------------------------------------------------

_LITGPT_MLP = {
    "swiglu": ("LLaMAMLP", "none"),
    "geglu-tanh": ("GemmaMLP", "tanh"),
    "gelu": ("GptNeoxMLP", "none"),
    "gelu-tanh": ("GptNeoxMLP", "tanh"),
}


def _litgpt_problems(cfg: ModelConfig) -> list[str]:
    problems = _common_problems(cfg)
    if cfg.mlp not in _LITGPT_MLP:
        problems.append(f"mlp={cfg.mlp}")
    if cfg.attn_scale is not None and not float(cfg.attn_scale).is_integer():
        problems.append(f"attn_scale={cfg.attn_scale} (attention_scores_scalar is an integer)")
    return problems


def _litgpt_fields(layout: str, opts: dict[str, Any], cfg: ModelConfig) -> list[tuple[str, Any, str | None]]:
    """litgpt's Config fields for `layout` at `cfg`'s shape: (name, value as source, a comment or None)."""
    mlp, approx = _LITGPT_MLP.get(cfg.mlp, _LITGPT_MLP["swiglu"])
    gemma = opts.get("unit_offset", False)
    windows = [0 if cfg.window_of(i) is None else 1 for i in range(cfg.n_layers)]
    local = cfg.sliding_window is not None and cfg.rope_local_theta is not None
    fields = [
        (
            "name",
            repr(f"Gemma-normlab-{layout}" if gemma else f"normlab-{layout}"),
            "contains 'Gemma': every RMSNorm gain is 1 + w"
            if gemma
            else "a name with 'Gemma' in it would make every RMSNorm gain 1 + w",
        ),
        ("block_size", cfg.max_seq_len, None),
        ("vocab_size", cfg.vocab_size, None),
        ("padded_vocab_size", cfg.vocab_size, "else padded to a multiple of 512"),
        ("n_layer", cfg.n_layers, None),
        ("n_embd", cfg.d_model, None),
        ("n_head", cfg.n_heads, None),
        ("n_query_groups", cfg.kv_heads, "key/value heads"),
        ("head_size", cfg.head_dim, None),
        ("intermediate_size", cfg.ffn_dim, None),
        ("mlp_class_name", repr(mlp), None),
        ("gelu_approximate", repr(approx), None),
        ("bias", cfg.linear_bias, "default True: biases on qkv, proj and the MLP"),
        ("attn_bias", cfg.qkv_bias, None),
        ("lm_head_bias", False, None),
        ("parallel_residual", False, "default True: GPT-NeoX's parallel attention and MLP"),
        ("shared_attention_norm", False, None),
        ("norm_class_name", repr("RMSNorm"), "default LayerNorm"),
        ("norm_eps", cfg.norm_eps, "default 1e-5"),
        ("norm_1", opts.get("norm_1", True), "RMSNorm on the attention's input"),
        ("norm_2", opts.get("norm_2", True), "RMSNorm on the MLP's input"),
        ("post_attention_norm", opts.get("post_attention_norm", False), "RMSNorm on the attention's output"),
        ("post_mlp_norm", opts.get("post_mlp_norm", False), "RMSNorm on the MLP's output"),
        ("norm_qk", opts.get("norm_qk", False), None),
        (
            "norm_qk_type",
            repr(opts.get("norm_qk_type", "default")),
            "'default': per head (head_size wide); 'olmo2': over all heads",
        ),
        ("scale_embeddings", opts.get("scale_embeddings", False), "embeddings times sqrt(n_embd)"),
        ("rotary_percentage", 1.0, "default 0.25: RoPE on a quarter of each head"),
        ("rope_base", _num(cfg.rope_theta), None),
        ("rope_condense_ratio", 1, None),
        ("rope_interleave", False, "rotate-half pairs, as normlab"),
        (
            "attention_scores_scalar",
            None if cfg.attn_scale is None or not float(cfg.attn_scale).is_integer() else int(cfg.attn_scale),
            "None: head_size",
        ),
        ("attention_logit_softcapping", cfg.attn_softcap, None),
        ("final_logit_softcapping", cfg.logit_softcap, None),
        ("sliding_window_size", cfg.sliding_window, None),
        ("sliding_window_indices", windows if cfg.sliding_window is not None else None, "1: windowed layer"),
        (
            "rope_local_base_freq",
            _num(cfg.rope_local_theta) if local and cfg.rope_local_theta is not None else None,
            None,
        ),
        ("rope_indices", windows if local else None, "1: the local base"),
    ]
    return fields


def _litgpt(layout: str, opts: dict[str, Any], cfg: ModelConfig) -> str:
    gemma = opts.get("unit_offset", False)
    fields = _litgpt_fields(layout, opts, cfg)
    emb = opts.get("emb", False)  # a patch: litgpt has no embedding norm (framework_patches)
    lines = _header("litgpt", layout, cfg, _litgpt_problems(cfg), opts.get("unstated", ()))
    lines += ["from litgpt.config import Config", f"from litgpt.model import {'GPT, Block' if emb else 'GPT'}"]
    lines += LITGPT_EMBEDDING_NORM if emb else [""]
    lines += ["config = Config("]
    lines += [f"    {k}={v},{f'  # {c}' if c else ''}" for k, v, c in fields]
    lines += [")", "model = GPT(config)"]
    if emb:
        lines += LITGPT_EMBEDDING_NORM_BUILD
    if gemma:
        lines += [
            "# litgpt initializes w at 1 (a gain of 2); normlab's 1 + w starts at w = 0",
            "for m in model.modules():",
            "    if type(m).__name__ == 'RMSNorm':",
            "        m.weight.data.zero_()",
        ]
    if cfg.tie_embeddings:
        lines += ["model.lm_head.weight = model.transformer.wte.weight  # tied (litgpt's Config has no such field)"]
    return "\n".join(lines) + "\n"


LITGPT = Framework(
    "litgpt",
    {
        "pre": {},
        "peri-noemb": {"post_attention_norm": True, "post_mlp_norm": True},
        "gemma2": {"post_attention_norm": True, "post_mlp_norm": True, "scale_embeddings": True},
        "gemma3": {
            "post_attention_norm": True,
            "post_mlp_norm": True,
            "scale_embeddings": True,
            "norm_qk": True,
            "norm_qk_type": "default",
            "unit_offset": True,
        },
        "qwen3": {"norm_qk": True, "norm_qk_type": "default"},
        "olmo2": {
            "norm_1": False,
            "norm_2": False,
            "post_attention_norm": True,
            "post_mlp_norm": True,
            "norm_qk": True,
            "norm_qk_type": "olmo2",
        },
        # your model (qwen3) + output norms
        PeriParts(qk=True, out=True, emb=False).layout: {
            "post_attention_norm": True,
            "post_mlp_norm": True,
            "norm_qk": True,
            "norm_qk_type": "default",
        },
    },
    _litgpt_problems,
    _litgpt,
    # the embedding norm, which no litgpt setting gives, on the placements its settings give without it
    {
        p.name: {
            "post_attention_norm": p.out,
            "post_mlp_norm": p.out,
            "norm_qk": p.qk,
            "norm_qk_type": "default",
            "emb": True,
        }
        for p in PERI_FAMILY
        if p.emb
    },
)


# --- OLMo-core ------------------------------------------------------------------------------------

_OLMO_ACT = {"swiglu": "silu", "geglu-tanh": "gelu_tanh"}


def _olmo_problems(cfg: ModelConfig) -> list[str]:
    problems = _common_problems(cfg)
    if cfg.mlp not in _OLMO_ACT:
        problems.append(f"mlp={cfg.mlp} (OLMo-core's feed-forward is gated: silu or gelu_tanh)")
    if cfg.qkv_bias and not cfg.linear_bias:
        problems.append("qkv_bias=True (OLMo-core's bias is on every projection or none)")
    if attn_scale_differs(cfg):
        problems.append(f"attn_scale={cfg.attn_scale}")
    for name in ("attn_softcap", "logit_softcap"):
        if getattr(cfg, name) is not None:
            problems.append(f"{name}={getattr(cfg, name)}")
    return problems


def _olmo_block(opts: dict[str, Any], cfg: ModelConfig, theta: float, window: int | None) -> list[str]:
    """A `TransformerBlockConfig(...)` expression, one line each, indented from its first line's column:
    attention with RoPE base `theta` and, where `window` is set, OLMo-core's sliding window (the last
    `window` keys, the query's own included: `Attention` masks keys i - (window - 1) .. i, as normlab)."""
    qk = opts.get("qk")  # None, "head" or "full"
    lines = [
        "TransformerBlockConfig(",
        f"    name=TransformerBlockType.{opts['block']},",
        "    sequence_mixer=AttentionConfig(",
        f"        n_heads={cfg.n_heads},",
        f"        n_kv_heads={cfg.kv_heads},",
        f"        head_dim={cfg.head_dim},",
        f"        bias={cfg.linear_bias},  # default True",
        f"        rope=RoPEConfig(name=RoPEType.default, theta={_num(theta)}, full_precision=True),"
        "  # theta's default is 500,000",
        f"        qk_norm={'norm' if qk else 'None'},",
        f"        use_head_qk_norm={qk == 'head'},  # True: per head; False: over all heads",
        (
            "        gate=GateConfig(granularity=GateGranularity.elementwise, full_precision=True),"
            if opts.get("gate")
            else "        gate=None,"
        ),
    ]
    if window is not None:
        lines += [
            "        sliding_window=SlidingWindowAttentionConfig(",
            f"            pattern=[{window}],  # a query sees the last {window} keys, itself included",
            "            force_full_attention_on_first_layer=False,  # default True",
            "            force_full_attention_on_last_layer=False,  # default True",
            "        ),",
        ]
    elif cfg.sliding_window is not None:
        lines.append("        sliding_window=None,  # every key before the query")
    return lines + [
        "    ),",
        f"    feed_forward=FeedForwardConfig(hidden_size={cfg.ffn_dim}, bias={cfg.linear_bias}, "
        f"activation=ActivationFunction.{_OLMO_ACT.get(cfg.mlp, 'silu')}),",
        "    layer_norm=norm,",
        ")",
    ]


def _olmo_core(layout: str, opts: dict[str, Any], cfg: ModelConfig) -> str:
    layer = opts.get("norm", "rms") == "layer"
    norm = (
        f"LayerNormConfig(name=LayerNormType.default, eps={cfg.norm_eps!r}, bias={cfg.norm_bias})"
        if layer
        else f"LayerNormConfig(name=LayerNormType.rms, eps={cfg.norm_eps!r}, bias=False)"
    )
    window, every = cfg.sliding_window, cfg.full_attention_every
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    lines = _header("OLMo-core", layout, cfg, _olmo_problems(cfg), opts.get("unstated", ()))
    lines += [
        "from olmo_core.nn.attention import AttentionConfig, GateConfig, GateGranularity"
        + (", SlidingWindowAttentionConfig" if window is not None else ""),
        "from olmo_core.nn.feed_forward import ActivationFunction, FeedForwardConfig",
        "from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType",
        "from olmo_core.nn.lm_head import LMHeadConfig",
        "from olmo_core.nn.rope import RoPEConfig, RoPEType",
        "from olmo_core.nn.transformer import TransformerBlockConfig, TransformerBlockType, TransformerConfig",
        "",
        (
            "# LayerNorm (with its bias where normlab's has one)"
            if layer
            else "# RMSNorm without a bias: LayerNormConfig's defaults (bias=True, eps=1e-5) are another function"
        ),
    ]
    if opts.get("unit_offset"):
        lines += [
            "# normlab's gain 1 + w (w from 0) is this RMSNorm's weight (it multiplies by its weight, from 1): load",
            "# normlab's or Gemma's w as 1 + w (olmo_core.nn.hf.convert does so for Gemma 3). The same function;",
            "# in training, weight decay on it pulls the gain to 0 (normlab's to 1), and in bf16 a weight near 1",
            "# has coarser steps than a w near 0",
        ]
    lines.append(f"norm = {norm}")
    if window is not None and every:  # windowed blocks and every `every`-th block full, by name
        local, full = _olmo_block(opts, cfg, local_theta, window), _olmo_block(opts, cfg, cfg.rope_theta, None)
        lines += ["local = " + local[0], *local[1:], "full = " + full[0], *full[1:]]
        block = [
            '    block={"local": local, "full": full},',
            f'    block_pattern=["local"] * {every - 1} + ["full"],  # cycled over the layers: layer i is full '
            f"where (i + 1) % {every} == 0",
        ]
    else:
        inner = _olmo_block(opts, cfg, local_theta if window is not None else cfg.rope_theta, window)
        block = ["    block=" + inner[0], *(f"    {line}" for line in inner[1:-1]), "    ),"]
    lines += [
        "config = TransformerConfig(",
        f"    d_model={cfg.d_model},",
        f"    vocab_size={cfg.vocab_size},",
        f"    n_layers={cfg.n_layers},",
        *block,
        "    lm_head=LMHeadConfig(layer_norm=norm, bias=False),  # layer_norm: the final norm",
        f"    embedding_norm={'norm' if opts.get('embedding_norm') else 'None'},",
        f"    embed_scale={f'{cfg.d_model} ** 0.5' if opts.get('embed_scale') else 'None'},",
        f"    tie_word_embeddings={cfg.tie_embeddings},",
        ")",
        'model = config.build(init_device="cpu")',
    ]
    if window is not None:
        lines += [
            "# OLMo-core's torch (SDPA) backend masks the windows (run on the CPU by normlab's tests); on a GPU with",
            "# flash-attn 2 installed, its windowed layers take its flash_2 backend instead (not run by those tests)",
        ]
    return "\n".join(lines) + "\n"


OLMO_CORE = Framework(
    "OLMo-core",
    {
        "pre": {"block": "default"},
        "pre-lns": {"block": "default_scaled"},
        "qwen3": {"block": "default", "qk": "head"},
        "pre-gate": {"block": "default", "gate": True},
        "olmo2": {"block": "reordered_norm", "qk": "full"},
        "b": {"block": "reordered_norm", "embedding_norm": True},
        "peri": {"block": "peri_norm", "embedding_norm": True},
        "peri-noemb": {"block": "peri_norm"},
        "peri+qk": {"block": "peri_norm", "embedding_norm": True, "qk": "head", "norm": "layer"},
        "gemma2": {"block": "peri_norm", "embed_scale": True},
        # the gain 1 + w held as the weight itself (OLMo-core's Gemma 3 conversion, olmo_core.nn.hf.convert)
        "gemma3": {"block": "peri_norm", "embed_scale": True, "qk": "head", "unit_offset": True},
        # a Llama or Qwen3 user's model with output norms, an embedding norm or both (framework_patches.PERI_FAMILY)
        **{
            p.layout: {
                "block": "peri_norm" if p.out else "default",
                "embedding_norm": p.emb,
                "qk": "head" if p.qk else None,
            }
            for p in PERI_FAMILY
            if p.name == p.layout
        },
    },
    _olmo_problems,
    _olmo_core,
)


# --- torchtitan -----------------------------------------------------------------------------------


def _titan_problems(cfg: ModelConfig) -> list[str]:
    problems = _common_problems(cfg)
    if cfg.mlp != "swiglu":
        problems.append(f"mlp={cfg.mlp} (torchtitan's FeedForward is SwiGLU)")
    for name in ("linear_bias", "qkv_bias"):
        if getattr(cfg, name):
            problems.append(f"{name}=True")
    if attn_scale_differs(cfg):
        problems.append(f"attn_scale={cfg.attn_scale}")
    for name in ("attn_softcap", "logit_softcap", "sliding_window", "rope_local_theta"):
        if getattr(cfg, name) is not None:
            problems.append(f"{name}={getattr(cfg, name)}")
    return problems


def _torchtitan(layout: str, opts: dict[str, Any], cfg: ModelConfig) -> str:
    model, module = opts["model"], opts["model"].lower().removesuffix("model")
    block = model.removesuffix("Model") + "TransformerBlock"
    d, hd = cfg.d_model, cfg.head_dim
    parts = PeriParts(qk=bool(opts.get("qk")), out=opts.get("out", False), emb=opts.get("emb", False))
    patched = parts.out or parts.emb  # a patch: subclasses of the block and the model (framework_patches)
    config_block, config_model = titan_names(parts) if patched else (block, model)
    lines = _header("torchtitan", layout, cfg, _titan_problems(cfg), opts.get("unstated", ()))
    lines += [
        *(["from dataclasses import dataclass"] if patched else []),
        "from functools import partial",
        "",
        "import torch.nn as nn",
        "from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm",
        "from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config",
        f"from torchtitan.models.{module} import {model}, {block}",
        "",
        "init = {'weight': partial(nn.init.normal_, std=0.02), 'bias': nn.init.zeros_}",
        "",
        "",
        "def norm(width):  # RMSNorm.Config's eps defaults to 1e-5",
        f"    return RMSNorm.Config(normalized_shape=width, eps={cfg.norm_eps!r}, "
        "param_init={'weight': nn.init.ones_})",
        "",
        "",
        *([*titan_classes(parts, model), "", ""] if patched else []),
        f"config = {config_model}.Config(",
        f"    dim={d},",
        f"    vocab_size={cfg.vocab_size},",
        f"    enable_weight_tying={cfg.tie_embeddings},",
        f"    tok_embeddings=Embedding.Config(num_embeddings={cfg.vocab_size}, embedding_dim={d}, param_init=init),",
        f"    lm_head=Linear.Config(in_features={d}, out_features={cfg.vocab_size}, param_init=init),",
        f"    norm=norm({d}),  # the final norm",
        "    layers=[",
        f"        {config_block}.Config(",
        f"            attention_norm=norm({d}),",
        f"            ffn_norm=norm({d}),",
        *(f"            {line}" for line in titan_block_fields(parts, d)),
        "            attention=make_gqa_config(",
        f"                dim={d}, n_heads={cfg.n_heads}, n_kv_heads={cfg.kv_heads}, head_dim={hd},",
        "                wqkv_param_init=init, wo_param_init=init,",
        '                inner_attention=get_attention_config("flex"),  # or "varlen"',
        "                # rotate-half RoPE, as normlab (ComplexRoPE pairs adjacent features)",
        f"                rope=CosSinRoPE.Config(dim={hd}, max_seq_len={cfg.max_seq_len}, "
        f"theta={float(cfg.rope_theta)!r}),",
        f"                qk_norm={f'norm({hd}),  # per head, before RoPE' if opts.get('qk') else 'None,'}",
        "            ),",
        f"            feed_forward=make_ffn_config(dim={d}, hidden_dim={cfg.ffn_dim}, w1_param_init=init, "
        "w2w3_param_init=init),",
        "        )",
        f"        for {'i' if parts.emb else '_'} in range({cfg.n_layers})",
        "    ],",
        ")",
        "model = config.build()",
        "model.init_states()",
    ]
    return "\n".join(lines) + "\n"


TORCHTITAN = Framework(
    "torchtitan",
    {
        "pre": {"model": "Llama3Model"},
        "qwen3": {"model": "Qwen3Model", "qk": True},
    },
    _titan_problems,
    _torchtitan,
    # output norms and the embedding norm, which no torchtitan setting gives; the base model is chosen by `patch`
    {p.name: {"qk": p.qk, "out": p.out, "emb": p.emb} for p in PERI_FAMILY if p.out or p.emb},
)

FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (OLMO_CORE, TORCHTITAN, LITGPT)}
