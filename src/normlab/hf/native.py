"""Exact conversions between normlab models and transformers' own architectures.

A normlab layout maps onto a transformers class only when the two compute the same function:

Both ways:
- `llama` (LlamaForCausalLM) <-> layout `pre` (`attn=A,mlp=A,final`): x' = x + F(N(x)), final N;
  RMSNorm, SwiGLU, RoPE, no biases.
- `olmo2` (Olmo2ForCausalLM) <-> layout `olmo2` (`attn=qkB,mlp=B,final,inner=full`): x' = x + N(F(x))
  with RMSNorm on the full Q and K projections (OLMo 2, Sec. 3.3 of its report).
- `gemma2` (Gemma2ForCausalLM) <-> layout `gemma2` (`attn=AB,mlp=AB,final,emb-scale`, Peri-LN with the
  sqrt(d) embedding scale) with Gemma 2's other pieces as model options: GeGLU-tanh MLP, attention
  scale query_pre_attn_scalar^-1/2, attention and final-logit soft-capping; its RMSNorm's (1 + w)
  scale is folded into the weights. Gemma 2 alternates sliding-window (4096) and global layers;
  normlab attends globally, which is the same function for sequences up to the window, so the
  import sets max_seq_len = min(max_position_embeddings, sliding_window) and longer inputs are refused;
  the export sets the window to the whole context.
Import only:
- `gpt2` (GPT2LMHeadModel) -> layout `pre,norm=layer` with learned absolute positions, a tanh-GELU
  MLP and biases (import only: the checkpoints people want to look at).

Anything else is refused with `NativeExportError` naming the first difference. Gemma 2 and Checkpoints are
refused on import for the same reason when their config asks for something normlab does not
compute (scaled RoPE, other activations, biases, a head_dim apart from d_model / heads): a
conversion that silently changed the function would be worse than none.

transformers is an optional dependency (`pip install normlab[hf]`), imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from normlab.layout import PRESETS
from normlab.model.build import build_model
from normlab.model.config import ConfigError, ModelConfig
from normlab.model.lm import NormLM

ARCHS = {"llama": "pre", "olmo2": "olmo2", "gemma2": "gemma2"}  # transformers model_type -> the normlab preset it equals
MLP_OF = {"llama": "swiglu", "olmo2": "swiglu", "gemma2": "geglu-tanh"}
GPT2_LAYOUT = "pre,norm=layer"  # x' = x + F(LN(x)), final LN: GPT-2 is Pre-LN with LayerNorm (Radford et al. 2019)
REFUSED: dict[str, str] = {}
GPT2_ACTS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu", "relu": "relu"}


class NativeExportError(ConfigError):
    """The model's layout or options do not map exactly onto the requested transformers class."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("this needs transformers: pip install normlab[hf] (or pip install transformers)") from None
    return transformers


def _check_native(model: NormLM, arch: str) -> None:
    if arch not in ARCHS:
        raise NativeExportError(f"no native transformers class for {arch!r}; valid: {', '.join(ARCHS)} "
                                "(or save with the normlab class)")
    if model.config.n_experts:
        raise NativeExportError(
            f"a mixture-of-experts model has no exact {arch} counterpart ({arch} has dense MLPs; OLMoE's class, the "
            "nearest MoE architecture, is not mapped: its routing renormalization and weight layout would need an "
            "exact match); export with --arch normlab, which keeps every layout and the experts")
    want = PRESETS[ARCHS[arch]].layout.to_string()
    have = model.layout.to_string()
    if have != want:
        raise NativeExportError(f"layout {have!r} does not map exactly onto {arch} (which is {ARCHS[arch]!r}: {want!r}); "
                                f"native exports: " + ", ".join(f"{p} -> {a}" for a, p in ARCHS.items()))
    cfg = model.config
    problems = []
    if cfg.mlp != MLP_OF[arch]:
        problems.append(f"mlp={cfg.mlp} (needs {MLP_OF[arch]})")
    if cfg.linear_bias:
        problems.append("linear_bias=True (needs no biases)")
    if cfg.position != "rope":
        problems.append(f"position={cfg.position} (needs rope)")
    if arch == "gemma2" and cfg.attn_scale is not None and cfg.attn_scale != int(cfg.attn_scale):
        problems.append(f"attn_scale={cfg.attn_scale} (Gemma 2's query_pre_attn_scalar is an integer)")
    for name in ("attn_scale", "attn_softcap", "logit_softcap"):
        if getattr(cfg, name) is not None and arch != "gemma2":
            problems.append(f"{name}={getattr(cfg, name)} (needs None)")
    if problems:
        raise NativeExportError(f"model options do not map onto {arch}: {'; '.join(problems)}")


def _hf_config(cfg: ModelConfig, arch: str) -> Any:
    tf = _transformers()
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, hidden_act="silu")
    if arch == "llama":
        return tf.LlamaConfig(mlp_bias=False, **common)
    if arch == "gemma2":  # sliding window = the whole context: every layer attends globally, as normlab does
        common.pop("hidden_act")
        return tf.Gemma2Config(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(cfg.attn_scale or cfg.head_dim),
                               attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.logit_softcap,
                               sliding_window=cfg.max_seq_len, **common)
    return tf.Olmo2Config(**common)


def _layer_map(arch: str, i: int) -> dict[str, str]:
    """normlab parameter name -> transformers parameter name, for block i."""
    n, h = f"blocks.{i}.", f"model.layers.{i}."
    m = {f"{n}attn.{p}_proj.weight": f"{h}self_attn.{p}_proj.weight" for p in "qkvo"}
    m.update({f"{n}mlp.{p}_proj.weight": f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
    if arch == "llama":
        m[f"{n}attn_norms.input.weight"] = f"{h}input_layernorm.weight"
        m[f"{n}mlp_norms.input.weight"] = f"{h}post_attention_layernorm.weight"
    elif arch == "gemma2":
        m[f"{n}attn_norms.input.weight"] = f"{h}input_layernorm.weight"
        m[f"{n}attn_norms.output.weight"] = f"{h}post_attention_layernorm.weight"
        m[f"{n}mlp_norms.input.weight"] = f"{h}pre_feedforward_layernorm.weight"
        m[f"{n}mlp_norms.output.weight"] = f"{h}post_feedforward_layernorm.weight"
    else:
        m[f"{n}attn.q_norm.weight"] = f"{h}self_attn.q_norm.weight"
        m[f"{n}attn.k_norm.weight"] = f"{h}self_attn.k_norm.weight"
        m[f"{n}attn_norms.output.weight"] = f"{h}post_attention_layernorm.weight"
        m[f"{n}mlp_norms.output.weight"] = f"{h}post_feedforward_layernorm.weight"
    return m


def name_map(arch: str, n_layers: int, tied: bool) -> dict[str, str]:
    m = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not tied:
        m["lm_head.weight"] = "lm_head.weight"
    for i in range(n_layers):
        m.update(_layer_map(arch, i))
    return m


def to_native(model: NormLM, arch: str) -> Any:
    """A transformers model (`LlamaForCausalLM` or `Olmo2ForCausalLM`) computing exactly what ``model`` does."""
    _check_native(model, arch)
    tf = _transformers()
    cfg = model.config
    cls = {"llama": tf.LlamaForCausalLM, "olmo2": tf.Olmo2ForCausalLM, "gemma2": tf.Gemma2ForCausalLM}[arch]
    hf = cls(_hf_config(cfg, arch))
    ours = model.state_dict()
    mapping = name_map(arch, cfg.n_layers, cfg.tie_embeddings)
    missing = sorted(set(ours) - set(mapping) - {k for k in ours if not k.endswith("weight")})
    if missing:
        raise NativeExportError(f"parameters with no {arch} counterpart: {missing[:5]}")
    state = {mapping[k]: v for k, v in ours.items() if k in mapping}
    if arch == "gemma2":  # Gemma's RMSNorm multiplies by (1 + w)
        state = {k: v - 1.0 if "norm" in k else v for k, v in state.items()}
    result = hf.load_state_dict(state, strict=False)
    unexpected = [k for k in result.missing_keys if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if unexpected or result.unexpected_keys:
        raise NativeExportError(f"weight names did not line up: missing {unexpected}, unexpected {result.unexpected_keys}")
    return hf.eval()


def save_native(model: NormLM, out: str | Path, arch: str, tokenizer: Any = None) -> Path:
    """Save ``model`` as a transformers `arch` checkpoint (config.json + model.safetensors)."""
    from normlab.hf.export import set_special_tokens

    hf = to_native(model, arch)
    set_special_tokens(hf, tokenizer)
    out = Path(out)
    hf.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def from_native(source: str | Path | Any) -> NormLM:
    """A normlab model from a transformers Llama or OLMo 2 model, or a local checkpoint folder of one."""
    tf = _transformers()
    if isinstance(source, (str, Path)):
        config = tf.AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False)
        _check_importable(config)
        hf = tf.AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32,
                                                     trust_remote_code=False)
    else:
        hf, config = source, source.config
        _check_importable(config)
    arch = config.model_type
    if arch == "gpt2":
        return _from_gpt2(hf, config)
    if arch == "gemma2":
        return _from_gemma2(hf, config)
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 10_000.0))
    model = build_model(ARCHS[arch], ModelConfig(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads, d_ff=config.intermediate_size,
        mlp="swiglu", max_seq_len=config.max_position_embeddings, rope_theta=float(rope), norm_eps=config.rms_norm_eps,
        tie_embeddings=bool(config.tie_word_embeddings)), seed=0)
    theirs = hf.state_dict()
    mapping = name_map(arch, config.num_hidden_layers, bool(config.tie_word_embeddings))
    state = {k: theirs[v].float() for k, v in mapping.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def _from_gpt2(hf: Any, config: Any) -> NormLM:
    """GPT-2: Conv1D weights are (in, out), so they are transposed; c_attn holds Q, K, V side by side."""
    d, n = config.n_embd, config.n_layer
    model = build_model(GPT2_LAYOUT, ModelConfig(
        vocab_size=config.vocab_size, d_model=d, n_layers=n, n_heads=config.n_head, d_ff=config.n_inner or 4 * d,
        mlp=GPT2_ACTS[config.activation_function], max_seq_len=config.n_positions, position="learned",
        norm_eps=config.layer_norm_epsilon, linear_bias=True, norm_bias=True, tie_embeddings=True), seed=0)
    t = {k: v.float() for k, v in hf.state_dict().items()}
    state = {"embed.weight": t["transformer.wte.weight"], "lm_head.weight": t["transformer.wte.weight"],
             "pos_embed.weight": t["transformer.wpe.weight"],
             "final_norm.weight": t["transformer.ln_f.weight"], "final_norm.bias": t["transformer.ln_f.bias"]}
    for i in range(n):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ln, site in (("ln_1", "attn_norms"), ("ln_2", "mlp_norms")):
            state[f"{b}{site}.input.weight"], state[f"{b}{site}.input.bias"] = t[f"{h}{ln}.weight"], t[f"{h}{ln}.bias"]
        w, bias = t[f"{h}attn.c_attn.weight"].T, t[f"{h}attn.c_attn.bias"]
        for j, p in enumerate("qkv"):
            state[f"{b}attn.{p}_proj.weight"], state[f"{b}attn.{p}_proj.bias"] = w[j * d:(j + 1) * d], bias[j * d:(j + 1) * d]
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")):
            state[f"{b}{ours}.weight"], state[f"{b}{ours}.bias"] = t[f"{h}{theirs}.weight"].T, t[f"{h}{theirs}.bias"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def _from_gemma2(hf: Any, config: Any) -> NormLM:
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10_000.0)
    window = getattr(config, "sliding_window", None) or config.max_position_embeddings
    model = build_model("gemma2", ModelConfig(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads, d_ff=config.intermediate_size,
        mlp="geglu-tanh", max_seq_len=min(config.max_position_embeddings, window), rope_theta=float(rope),
        norm_eps=config.rms_norm_eps, tie_embeddings=bool(config.tie_word_embeddings),
        attn_scale=float(config.query_pre_attn_scalar), attn_softcap=config.attn_logit_softcapping,
        logit_softcap=config.final_logit_softcapping), seed=0)
    t = {k: v.float() for k, v in hf.state_dict().items()}
    one = lambda k: t[k] + 1.0  # noqa: E731 - Gemma's RMSNorm multiplies by (1 + w)
    state = {"embed.weight": t["model.embed_tokens.weight"], "final_norm.weight": one("model.norm.weight")}
    state["lm_head.weight"] = state["embed.weight"] if config.tie_word_embeddings else t["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for p in "qkvo":
            state[f"{b}attn.{p}_proj.weight"] = t[f"{h}self_attn.{p}_proj.weight"]
        for p in ("gate", "up", "down"):
            state[f"{b}mlp.{p}_proj.weight"] = t[f"{h}mlp.{p}_proj.weight"]
        for theirs, ours in (("input_layernorm", "attn_norms.input"), ("post_attention_layernorm", "attn_norms.output"),
                             ("pre_feedforward_layernorm", "mlp_norms.input"),
                             ("post_feedforward_layernorm", "mlp_norms.output")):
            state[f"{b}{ours}.weight"] = one(f"{h}{theirs}.weight")
    model.load_state_dict(state, strict=True)
    return model.eval()


def _check_gpt2(config: Any) -> None:
    problems = []
    if config.activation_function not in GPT2_ACTS:
        problems.append(f"activation {config.activation_function!r} (importable: {', '.join(GPT2_ACTS)})")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx (normlab scales attention by 1/sqrt(head_dim) only)")
    if not getattr(config, "scale_attn_weights", True):
        problems.append("scale_attn_weights=False")
    if config.n_embd % config.n_head:
        problems.append("n_embd not divisible by n_head")
    if problems:
        raise NativeExportError(f"gpt2 config does not map exactly onto normlab: {'; '.join(problems)}")


def _check_importable(config: Any) -> None:
    kind = getattr(config, "model_type", "?")
    if kind in REFUSED:
        raise NativeExportError(f"cannot import {kind} exactly: {REFUSED[kind]}")
    if kind == "gpt2":
        return _check_gpt2(config)
    if kind not in (*ARCHS, "gemma2"):
        raise NativeExportError(f"no exact normlab layout for model_type {kind!r}; importable: {', '.join(ARCHS)}, "
                                "gemma2, gpt2")
    rope = getattr(config, "rope_parameters", None) or {}
    problems = []
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} (normlab implements default RoPE)")
    act = getattr(config, "hidden_activation", None) if kind == "gemma2" else getattr(config, "hidden_act", "silu")
    want = "gelu_pytorch_tanh" if kind == "gemma2" else "silu"
    if act != want:
        problems.append(f"activation {act!r} (needs {want})")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases on projections")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"head_dim {head_dim} x heads != hidden_size (normlab ties head_dim to d_model / heads)")
    if problems:
        raise NativeExportError(f"{kind} config does not map exactly onto normlab: {'; '.join(problems)}")
