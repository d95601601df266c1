"""OLMo 3 (`Olmo3ForCausalLM`) <-> layout `olmo2` (`attn=qkB,mlp=B,final,inner=full`) with OLMo 3's local
attention: a sliding window on three layers of every four (`full_attention_every=4`), one RoPE base or one
per layer type. The block is OLMo 2's (x' = x + N(F(x)), RMSNorm over the full Q and K projections)."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.olmo2 import Olmo2
from normlab.model.config import ModelConfig


class Olmo3(Olmo2):
    model_type = "olmo3"
    windows = True
    window_patterns = True
    local_rope = True

    def hf_class(self, tf: Any) -> Any:
        return tf.Olmo3ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        return tf.Olmo3Config(**{**self.common_config(cfg), **self.window_fields(cfg)})


OLMO3 = Olmo3()
