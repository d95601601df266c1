"""Gemma 2 (`Gemma2ForCausalLM`) <-> layout `gemma2` (`attn=AB,mlp=AB,final,emb-scale`: Peri-LN with the
sqrt(d) embedding scale), with Gemma 2's other pieces as model options: GeGLU-tanh MLP, attention scale
query_pre_attn_scalar^-1/2, attention and final-logit soft-capping (Gemma Team 2024).

Gemma's RMSNorm multiplies by (1 + w): the 1 is folded into normlab's weights on import and taken
out on export. Gemma 2 alternates sliding-window (4096) and global layers: `sliding_window` with
`full_attention_every=2` (until 2026-11-24 normlab had no windows and imported Gemma 2 with max_seq_len
cut to the window).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from normlab.hf.archs.base import Arch
from normlab.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


class Gemma2(Arch):
    model_type = "gemma2"
    preset = "gemma2"
    norm_names = {
        "attn_norms.input": "input_layernorm",
        "attn_norms.output": "post_attention_layernorm",
        "mlp_norms.input": "pre_feedforward_layernorm",
        "mlp_norms.output": "post_feedforward_layernorm",
    }
    mlp = "geglu-tanh"
    activation = "gelu_pytorch_tanh"
    activation_key = "hidden_activation"
    options = ("attn_scale", "attn_softcap", "logit_softcap")
    windows = True
    window_patterns = True

    def hf_class(self, tf: Any) -> Any:
        return tf.Gemma2ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        common = self.common_config(cfg)
        common.pop("hidden_act")
        return tf.Gemma2Config(
            hidden_activation=self.activation,
            query_pre_attn_scalar=int(cfg.attn_scale or cfg.head_dim),
            attn_logit_softcapping=cfg.attn_softcap,
            final_logit_softcapping=cfg.logit_softcap,
            **{**common, **self.window_fields(cfg)},
        )

    def export_weight(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value - 1.0 if "norm" in name else value  # Gemma's RMSNorm multiplies by (1 + w)

    def import_weight(self, their_name: str, value: torch.Tensor) -> torch.Tensor:
        return value + 1.0 if "norm" in their_name else value

    def model_config(self, config: Any) -> ModelConfig:
        return (
            super()
            .model_config(config)
            .with_(
                attn_scale=float(config.query_pre_attn_scalar),
                attn_softcap=config.attn_logit_softcapping,
                logit_softcap=config.final_logit_softcapping,
            )
        )


GEMMA2 = Gemma2()
