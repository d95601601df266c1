"""normlab as a transformers model: `NormLabConfig` / `NormLabForCausalLM`, for any layout.

A thin `PreTrainedModel` around `NormLM`, registered with `AutoConfig` and `AutoModelForCausalLM`
(model_type "normlab"), so a saved folder loads with

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)   # any process with normlab installed
    import normlab.hf; AutoModelForCausalLM.from_pretrained(DIR)        # or after importing normlab.hf

and works with `generate()` and lm-evaluation-harness (`--model hf --model_args
pretrained=DIR,trust_remote_code=True`). There is no KV cache: each generated token re-runs the
prefix (fine for evaluation-sized models; exact, just slower). Padding: right padding is fine (the
model is causal, so padded positions never influence real ones); left padding would shift RoPE
positions and is refused with an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from normlab.layout import as_layout
from normlab.model.config import ModelConfig
from normlab.model.lm import NormLM
from normlab.model.rope import Rotary


class NormLabConfig(PretrainedConfig):
    model_type = "normlab"

    def __init__(self, layout: str = "pre", model: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.layout = as_layout(layout).to_string()
        self.model = ModelConfig(**(model or {})).to_dict()
        kwargs.setdefault("tie_word_embeddings", self.model["tie_embeddings"])
        kwargs.setdefault("vocab_size", self.model["vocab_size"])
        super().__init__(**kwargs)
        self.hidden_size = self.model["d_model"]
        self.num_hidden_layers = self.model["n_layers"]
        self.num_attention_heads = self.model["n_heads"]
        self.max_position_embeddings = self.model["max_seq_len"]


class NormLabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NormLabConfig
    base_model_prefix = "normlab"
    supports_gradient_checkpointing = False

    def __init__(self, config: NormLabConfig) -> None:
        super().__init__(config)
        cfg = ModelConfig(**config.model)
        self.normlab = NormLM(cfg, as_layout(config.layout).resolve(cfg.n_layers))
        if cfg.tie_embeddings:
            self._tied_weights_keys = {"normlab.lm_head.weight": "normlab.embed.weight"}
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from a normlab model or a checkpoint, never from transformers' initializer;
        only the RoPE tables (buffers, not saved) are recomputed when transformers built on meta."""
        if isinstance(module, Rotary):
            module.reset_tables()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.normlab.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.normlab.embed = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.normlab.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **_: Any) -> CausalLMOutputWithPast:
        if attention_mask is not None and not _right_padded(attention_mask):
            raise ValueError("normlab models take no padding mask: pad on the right (padding_side='right') "
                             "or run one sequence at a time")
        out = self.normlab(input_ids, return_hidden_states=bool(output_hidden_states))
        loss = None
        if labels is not None:  # transformers convention: labels are the inputs, shifted here
            loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, hidden_states=out.hidden_states)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **_: Any) -> dict[str, Any]:
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def _right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones followed by zeros."""
    m = mask.to(torch.int64)
    return bool((m[:, 1:] <= m[:, :-1]).all())


AutoConfig.register("normlab", NormLabConfig, exist_ok=True)
AutoModelForCausalLM.register(NormLabConfig, NormLabForCausalLM, exist_ok=True)
