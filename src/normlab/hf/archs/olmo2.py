"""OLMo 2 (`Olmo2ForCausalLM`) <-> layout `olmo2` (`attn=qkB,mlp=B,final,inner=full`): x' = x + N(F(x))
with RMSNorm on the full Q and K projections (OLMo 2 report, Sec. 3.3)."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig


class Olmo2(Arch):
    model_type = "olmo2"
    preset = "olmo2"
    norm_names = {
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
        "attn_norms.output": "post_attention_layernorm",
        "mlp_norms.output": "post_feedforward_layernorm",
    }

    def hf_class(self, tf: Any) -> Any:
        return tf.Olmo2ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        return tf.Olmo2Config(**self.common_config(cfg))


OLMO2 = Olmo2()
