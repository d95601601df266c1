"""Llama (`LlamaForCausalLM`) <-> layout `pre` (`attn=A,mlp=A,final`): x' = x + F(N(x)), final N; RMSNorm,
SwiGLU, RoPE, no biases (Touvron et al. 2023)."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig


class Llama(Arch):
    model_type = "llama"
    preset = "pre"

    def hf_class(self, tf: Any) -> Any:
        return tf.LlamaForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        return tf.LlamaConfig(mlp_bias=False, **self.common_config(cfg))

    def layer_map(self, i: int) -> dict[str, str]:
        n, h = f"blocks.{i}.", f"model.layers.{i}."
        m = {f"{n}attn.{p}_proj.weight": f"{h}self_attn.{p}_proj.weight" for p in "qkvo"}
        m.update({f"{n}mlp.{p}_proj.weight": f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
        m[f"{n}attn_norms.input.weight"] = f"{h}input_layernorm.weight"
        m[f"{n}mlp_norms.input.weight"] = f"{h}post_attention_layernorm.weight"
        return m


LLAMA = Llama()
