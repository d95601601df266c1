"""OLMo 2 (`Olmo2ForCausalLM`) <-> layout `olmo2` (`attn=qkB,mlp=B,final,inner=full`): x' = x + N(F(x))
with RMSNorm on the full Q and K projections (OLMo 2 report, Sec. 3.3)."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig


class Olmo2(Arch):
    model_type = "olmo2"
    preset = "olmo2"

    def hf_class(self, tf: Any) -> Any:
        return tf.Olmo2ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        return tf.Olmo2Config(**self.common_config(cfg))

    def layer_map(self, i: int) -> dict[str, str]:
        n, h = f"blocks.{i}.", f"model.layers.{i}."
        m = {f"{n}attn.{p}_proj.weight": f"{h}self_attn.{p}_proj.weight" for p in "qkvo"}
        m.update({f"{n}mlp.{p}_proj.weight": f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
        m[f"{n}attn.q_norm.weight"] = f"{h}self_attn.q_norm.weight"
        m[f"{n}attn.k_norm.weight"] = f"{h}self_attn.k_norm.weight"
        m[f"{n}attn_norms.output.weight"] = f"{h}post_attention_layernorm.weight"
        m[f"{n}mlp_norms.output.weight"] = f"{h}post_feedforward_layernorm.weight"
        return m


OLMO2 = Olmo2()
