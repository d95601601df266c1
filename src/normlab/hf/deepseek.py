"""An MLA model (``attention=mla``) as transformers' DeepseekV3ForCausalLM, where the two compute the same function.

transformers 5.24's ``DeepseekV3Attention`` is DeepSeek-V2's MLA (normlab.model.mla): ``q_a_proj`` W^DQ,
``q_a_layernorm`` the query latent's RMSNorm, ``q_b_proj`` (or ``q_proj`` without a query latent) W^UQ and W^QR
stacked per head as [nope; rope], ``kv_a_proj_with_mqa`` W^DKV and W^KR stacked, ``kv_a_layernorm``, ``kv_b_proj``
W^UK and W^UV stacked per head as [k; v], ``o_proj``; scores at qk_head_dim^-1/2; RoPE on the last
qk_rope_head_dim features, half-split with ``rope_interleave=False`` (normlab's `Rotary`). Its decoder layer is
Pre-LN with a SwiGLU MLP below ``first_k_dense_replace`` (set to the depth: no MoE layer), a final RMSNorm.

So the mapping is exact for: layout ``pre`` (RMSNorm at A on both sublayers, final norm; no QK-norm: the class has
none), a dense SwiGLU MLP, RoPE positions with a RoPE part (qk_rope_head_dim > 0), the latent norms on, no biases,
no window, soft-cap or attention scale, parametrization sp, and ``norm_eps`` = 1e-6 (the class builds its latent
norms with RMSNorm's default eps, 1e-6, whatever ``rms_norm_eps`` says). Anything else is refused with the
reason (`deepseek_v3_problem`). tests/unit/test_mla.py builds the class and compares logits.
"""

from __future__ import annotations

from typing import Any

import torch

from normlab.hf.library import require_transformers
from normlab.layout import PRESETS
from normlab.model.lm import NormLM
from normlab.model.mla import mla_dims

LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's default, which the class's q_a_layernorm and kv_a_layernorm keep


def deepseek_v3_problem(model: NormLM) -> str | None:
    """Why DeepseekV3ForCausalLM does not compute ``model``, or None."""
    cfg = model.config
    if cfg.attention != "mla":
        return f"attention={cfg.attention}: DeepseekV3ForCausalLM computes multi-head latent attention (attention=mla)"
    if model.layout.to_string() != PRESETS["pre"].layout.to_string():
        return f"layout {model.layout.label}: DeepseekV3's decoder layer is Pre-LN with a final norm (layout pre)"
    wrong = [
        what
        for what, bad in (
            ("mixture of experts", cfg.n_experts > 0),
            (f"mlp={cfg.mlp} (the class's dense MLP is SwiGLU)", cfg.mlp != "swiglu"),
            ("learned positions", cfg.position != "rope"),
            ("no RoPE part (qk_rope_head_dim=0)", cfg.qk_rope_head_dim == 0),
            ("mla_latent_norm=false (the class always norms the latents)", not cfg.mla_latent_norm),
            ("biases", cfg.linear_bias or cfg.qkv_bias),
            ("a sliding window", cfg.sliding_window is not None),
            (
                "soft-capping or an attention scale",
                any(v is not None for v in (cfg.attn_softcap, cfg.logit_softcap, cfg.attn_scale)),
            ),
            (f"parametrization={cfg.parametrization}", cfg.parametrization != "sp"),
            (f"norm_eps={cfg.norm_eps:g} (its latent norms use {LATENT_EPS:g})", cfg.norm_eps != LATENT_EPS),
        )
        if bad
    ]
    return f"DeepseekV3ForCausalLM does not compute {', '.join(wrong)}" if wrong else None


def deepseek_v3_config(model: NormLM) -> Any:
    """The DeepseekV3Config of ``model``'s shape (every layer dense)."""
    tf = require_transformers()
    cfg = model.config
    d_c, d_cq, nope, rope, v = mla_dims(cfg)
    return tf.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        first_k_dense_replace=cfg.n_layers, kv_lora_rank=d_c, q_lora_rank=d_cq, qk_rope_head_dim=rope,
        qk_nope_head_dim=nope, v_head_dim=v, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rope_interleave=False, attention_bias=False, tie_word_embeddings=cfg.tie_embeddings, num_mtp_layers=0,
    )  # fmt: skip


def _per_head(h: int, *parts: torch.Tensor) -> torch.Tensor:
    """Rows of ``parts`` (each h x width_i rows, head-major) interleaved head by head: [p1_h; p2_h; ...] for each h."""
    return torch.cat([p.view(h, -1, p.shape[-1]) for p in parts], dim=1).reshape(-1, parts[0].shape[-1])


def _layer_state(model: NormLM, i: int) -> dict[str, torch.Tensor]:
    blk: Any = model.blocks[i]  # its attention is LatentAttention (attention=mla, checked by the caller)
    h, a, pre = model.config.n_heads, blk.attn, f"model.layers.{i}."
    q_b = _per_head(h, a.q_proj.weight, a.q_rope.weight)
    out = {
        f"{pre}input_layernorm.weight": blk.attn_norms.input.weight,
        f"{pre}post_attention_layernorm.weight": blk.mlp_norms.input.weight,
        f"{pre}self_attn.kv_a_proj_with_mqa.weight": torch.cat([a.kv_down.weight, a.k_rope.weight]),
        f"{pre}self_attn.kv_a_layernorm.weight": a.kv_latent_norm.weight,
        f"{pre}self_attn.kv_b_proj.weight": _per_head(h, a.k_proj.weight, a.v_proj.weight),
        f"{pre}self_attn.o_proj.weight": a.o_proj.weight,
        **{f"{pre}mlp.{p}_proj.weight": getattr(blk.mlp, f"{p}_proj").weight for p in ("gate", "up", "down")},
    }
    if a.q_down is None:
        out[f"{pre}self_attn.q_proj.weight"] = q_b
    else:
        out[f"{pre}self_attn.q_a_proj.weight"] = a.q_down.weight
        out[f"{pre}self_attn.q_a_layernorm.weight"] = a.q_latent_norm.weight
        out[f"{pre}self_attn.q_b_proj.weight"] = q_b
    return out


def to_deepseek_v3(model: NormLM) -> Any:
    """A transformers DeepseekV3ForCausalLM computing exactly what ``model`` does (every weight placed; refused with
    the reason where the class computes something else: `deepseek_v3_problem`)."""
    from normlab.hf.native import NativeExportError

    if (why := deepseek_v3_problem(model)) is not None:
        raise NativeExportError(why)
    tf = require_transformers()
    hf = tf.DeepseekV3ForCausalLM(deepseek_v3_config(model)).to(next(model.parameters()).dtype)
    lm: Any = model  # final_norm is an RMSNorm under layout pre (checked above)
    state = {"model.embed_tokens.weight": lm.embed.weight, "model.norm.weight": lm.final_norm.weight}
    if not model.config.tie_embeddings:
        state["lm_head.weight"] = model.lm_head.weight
    for i in range(model.config.n_layers):
        state.update(_layer_state(model, i))
    result = hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if not (model.config.tie_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise NativeExportError(f"weight names did not line up: missing {missing}, unexpected {result.unexpected_keys}")
    return hf.eval()
