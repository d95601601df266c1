"""Gemma 3 (`Gemma3ForCausalLM`, text) <-> layout `gemma3` (`attn=qkAB,mlp=AB,final,emb-scale,gain=centered`):
Peri-LN with the sqrt(d) embedding scale, RMSNorm on each head's Q and K before RoPE, and every norm's gain
stored as w and applied as (1 + w) (Gemma Team 2025, Gemma 3 report Sec. 2: "we replace the soft-capping
of Gemma 2 with QK-norm"). Its other pieces are model options: GeGLU-tanh MLP, attention scale
query_pre_attn_scalar^-1/2, local layers with a sliding window (five of every six: full_attention_every=6)
and their own RoPE base (`rope_local_theta`, 10,000 against 1,000,000 on the global layers).

normlab's centered gain is Gemma's parametrization, so the weights pass through unchanged (Gemma 2's
adapter folds the 1 in instead, since its preset keeps gamma).
"""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig


class Gemma3(Arch):
    model_type = "gemma3_text"
    name = "gemma3"
    preset = "gemma3"
    norm_names = {
        "attn_norms.input": "input_layernorm",
        "attn_norms.output": "post_attention_layernorm",
        "mlp_norms.input": "pre_feedforward_layernorm",
        "mlp_norms.output": "post_feedforward_layernorm",
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
    }
    mlp = "geglu-tanh"
    activation = "gelu_pytorch_tanh"
    activation_key = "hidden_activation"
    options = ("attn_scale",)
    windows = True
    window_patterns = True
    local_rope = True

    def hf_class(self, tf: Any) -> Any:
        return tf.Gemma3ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        common = self.common_config(cfg)
        common.pop("hidden_act")
        return tf.Gemma3TextConfig(
            hidden_activation=self.activation,
            query_pre_attn_scalar=int(cfg.attn_scale or cfg.head_dim),
            **{**common, **self.window_fields(cfg)},
        )

    def config_problems(self, config: Any) -> list[str]:
        problems = super().config_problems(config)
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                problems.append(f"{name}={getattr(config, name)} (Gemma 3 has none; normlab's gemma3 neither)")
        if getattr(config, "use_bidirectional_attention", False):
            problems.append("use_bidirectional_attention (normlab is causal)")
        return problems

    def model_config(self, config: Any) -> ModelConfig:
        return super().model_config(config).with_(attn_scale=float(config.query_pre_attn_scalar))


GEMMA3 = Gemma3()
