"""Exact conversions between normlab models and transformers' own architectures.

A normlab layout maps onto a transformers class only when the two compute the same function:

- `llama` (LlamaForCausalLM) <-> layout `pre` (`attn=A,mlp=A,final`): x' = x + F(N(x)), final N;
  RMSNorm, SwiGLU, RoPE, no biases.
- `olmo2` (Olmo2ForCausalLM) <-> layout `olmo2` (`attn=qkB,mlp=B,final,inner=full`): x' = x + N(F(x))
  with RMSNorm on the full Q and K projections (OLMo 2, Sec. 3.3 of its report).
- `gpt2` (GPT2LMHeadModel) -> layout `pre,norm=layer` with learned absolute positions, a tanh-GELU
  MLP and biases (import only: the checkpoints people want to look at).

Anything else is refused with `NativeExportError` naming the first difference. Gemma 2 and Gemma 2
checkpoints are refused on import for the same reason: normlab does not model Gemma 2's logit
soft-capping, sliding-window layers, (1 + w) norm scale and GeGLU-tanh; a conversion that silently
changed the function would be worse than none.

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

ARCHS = {"llama": "pre", "olmo2": "olmo2"}  # transformers model_type -> the normlab preset it equals
GPT2_LAYOUT = "pre,norm=layer"  # x' = x + F(LN(x)), final LN: GPT-2 is Pre-LN with LayerNorm (Radford et al. 2019)
REFUSED = {
    "gemma2": "Gemma 2 soft-caps attention and final logits, alternates sliding-window layers, scales norms by "
              "(1 + w) and uses GeGLU with tanh GELU; normlab's gemma2 preset models only its norm placement",
}
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
    want = PRESETS[ARCHS[arch]].layout.to_string()
    have = model.layout.to_string()
    if have != want:
        raise NativeExportError(f"layout {have!r} does not map exactly onto {arch} (which is {ARCHS[arch]!r}: {want!r}); "
                                f"native exports: " + ", ".join(f"{p} -> {a}" for a, p in ARCHS.items()))
    cfg = model.config
    problems = []
    if cfg.mlp != "swiglu":
        problems.append(f"mlp={cfg.mlp} (needs swiglu)")
    if cfg.linear_bias:
        problems.append("linear_bias=True (needs no biases)")
    if cfg.position != "rope":
        problems.append(f"position={cfg.position} (needs rope)")
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
    return tf.Olmo2Config(**common)


def _layer_map(arch: str, i: int) -> dict[str, str]:
    """normlab parameter name -> transformers parameter name, for block i."""
    n, h = f"blocks.{i}.", f"model.layers.{i}."
    m = {f"{n}attn.{p}_proj.weight": f"{h}self_attn.{p}_proj.weight" for p in "qkvo"}
    m.update({f"{n}mlp.{p}_proj.weight": f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
    if arch == "llama":
        m[f"{n}attn_norms.input.weight"] = f"{h}input_layernorm.weight"
        m[f"{n}mlp_norms.input.weight"] = f"{h}post_attention_layernorm.weight"
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
    cls = tf.LlamaForCausalLM if arch == "llama" else tf.Olmo2ForCausalLM
    hf = cls(_hf_config(cfg, arch))
    ours = model.state_dict()
    mapping = name_map(arch, cfg.n_layers, cfg.tie_embeddings)
    missing = sorted(set(ours) - set(mapping) - {k for k in ours if not k.endswith("weight")})
    if missing:
        raise NativeExportError(f"parameters with no {arch} counterpart: {missing[:5]}")
    state = {mapping[k]: v for k, v in ours.items() if k in mapping}
    result = hf.load_state_dict(state, strict=False)
    unexpected = [k for k in result.missing_keys if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if unexpected or result.unexpected_keys:
        raise NativeExportError(f"weight names did not line up: missing {unexpected}, unexpected {result.unexpected_keys}")
    return hf.eval()


def save_native(model: NormLM, out: str | Path, arch: str, tokenizer: Any = None) -> Path:
    """Save ``model`` as a transformers `arch` checkpoint (config.json + model.safetensors)."""
    hf = to_native(model, arch)
    out = Path(out)
    hf.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def from_native(source: str | Path | Any) -> NormLM:
    """A normlab model from a transformers Llama or OLMo 2 model, or a local checkpoint folder of one."""
    tf = _transformers()
    if isinstance(source, (str, Path)):
        config = tf.AutoConfig.from_pretrained(source, local_files_only=True)
        _check_importable(config)
        hf = tf.AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32)
    else:
        hf, config = source, source.config
        _check_importable(config)
    arch = config.model_type
    if arch == "gpt2":
        return _from_gpt2(hf, config)
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
    if kind not in ARCHS:
        raise NativeExportError(f"no exact normlab layout for model_type {kind!r}; importable: {', '.join(ARCHS)}, gpt2")
    rope = getattr(config, "rope_parameters", None) or {}
    problems = []
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} (normlab implements default RoPE)")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (needs silu: SwiGLU)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases on projections")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"head_dim {head_dim} x heads != hidden_size (normlab ties head_dim to d_model / heads)")
    if problems:
        raise NativeExportError(f"{kind} config does not map exactly onto normlab: {'; '.join(problems)}")
