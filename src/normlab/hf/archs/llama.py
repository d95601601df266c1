"""Llama (`LlamaForCausalLM`) <-> layout `pre` (`attn=A,mlp=A,final`): x' = x + F(N(x)), final N; RMSNorm,
SwiGLU, RoPE, no biases (Touvron et al. 2023)."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig


class Llama(Arch):
    model_type = "llama"
    preset = "pre"
    norm_names = {"attn_norms.input": "input_layernorm", "mlp_norms.input": "post_attention_layernorm"}

    def hf_class(self, tf: Any) -> Any:
        return tf.LlamaForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        return tf.LlamaConfig(mlp_bias=False, **self.common_config(cfg))


LLAMA = Llama()
