"""Qwen 3 (`Qwen3ForCausalLM`) <-> layout `qwen3` (`attn=qkA,mlp=A,final`): Pre-LN with RMSNorm on each head's
query and key before RoPE (Qwen3 technical report, Sec. 2: "QK-Norm ... to ensure stable training"),
SwiGLU, no biases, a head width of its own (``head_dim``, 128 in every Qwen 3 size). Its optional sliding
window (``use_sliding_window``, on the layers from ``max_window_layers``) maps only when it covers all
layers or none."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig


class Qwen3(Arch):
    model_type = "qwen3"
    preset = "qwen3"
    norm_names = {
        "attn_norms.input": "input_layernorm",
        "mlp_norms.input": "post_attention_layernorm",
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
    }
    windows = True

    def hf_class(self, tf: Any) -> Any:
        return tf.Qwen3ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        window = cfg.sliding_window is not None
        return tf.Qwen3Config(
            use_sliding_window=window,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if window else cfg.n_layers,
            **self.common_config(cfg),
        )


QWEN3 = Qwen3()
