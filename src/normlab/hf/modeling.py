"""normlab as a transformers model: `NormLabConfig` / `NormLabForCausalLM`, for any layout.

A thin `PreTrainedModel` around `NormLM`, registered with `AutoConfig` and `AutoModelForCausalLM`
(model_type "normlab"). An export (`normlab export`, `save_hf`) carries a self-contained copy of
this file and of the model code it needs (`modeling_normlab.py`, written by `normlab.hf.bundle`), so

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)   # torch + transformers, no normlab
    import normlab.hf; AutoModelForCausalLM.from_pretrained(DIR)        # or normlab's own classes

and it works with `generate()` (KV cache: transformers' `DynamicCache`; stops at the tokenizer's
end-of-text, which the export writes into `generation_config.json`), batched and left-padded inputs
(positions from the attention mask), lm-evaluation-harness (`--model hf --model_args
pretrained=DIR,trust_remote_code=True`), and transformers' activation checkpointing.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from normlab.layout import as_layout
from normlab.model.config import ModelConfig
from normlab.model.decoding import make_decoding
from normlab.model.lm import NormLM
from normlab.model.rope import Rotary

# transformers 5.24 renamed the KV cache `past_key_values` -> `cache` (argument and output field); the
# model takes either name and fills the output field the installed version has, so an export runs
# under transformers before and after the rename
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class NormLabConfig(PretrainedConfig):
    model_type = "normlab"

    def __init__(
        self, layout: str = "pre", model: dict[str, Any] | None = None, use_cache: bool = True, **kwargs: Any
    ) -> None:
        self.layout = as_layout(layout).to_string()
        self.use_cache = use_cache
        self.model = ModelConfig(**(model or {})).to_dict()
        kwargs.setdefault("tie_word_embeddings", self.model["tie_embeddings"])
        kwargs.setdefault("vocab_size", self.model["vocab_size"])
        super().__init__(**kwargs)
        # the standard names, for transformers' caches and for tools that read them
        self.hidden_size = self.model["d_model"]
        self.num_hidden_layers = self.model["n_layers"]
        self.num_attention_heads = self.model["n_heads"]
        self.num_key_value_heads = self.model["n_kv_heads"] or self.model["n_heads"]
        self.head_dim = ModelConfig(**self.model).head_dim
        self.max_position_embeddings = self.model["max_seq_len"]


class NormLabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NormLabConfig
    base_model_prefix = "normlab"
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    def __init__(self, config: NormLabConfig) -> None:
        super().__init__(config)
        cfg = ModelConfig(**config.model)
        self.normlab = NormLM(cfg, as_layout(config.layout).resolve(cfg.n_layers))
        if cfg.tie_embeddings:
            self._tied_weights_keys = {"normlab.lm_head.weight": "normlab.embed.weight"}
        self.gradient_checkpointing = False
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from a normlab model or a checkpoint, never from transformers' initializer;
        only the RoPE tables (buffers, not saved) are recomputed when transformers built on meta."""
        if isinstance(module, Rotary):
            module.reset_tables()

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: Any = None, every_n_layers: int = 1
    ) -> None:
        """transformers' `activation_checkpointing_enable` / `gradient_checkpointing_enable` land here:
        NormLM recomputes every block in the backward (non-reentrant `torch.utils.checkpoint`)."""
        self.gradient_checkpointing = self.normlab.activation_checkpointing = bool(enable)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.normlab.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.normlab.embed = cast(torch.nn.Embedding, value)  # transformers' API types it as any module

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.normlab.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """``attention_mask`` (B, past + T): 1 for tokens, 0 for padding (left or right); positions
        count real tokens only, as in transformers' Llama. The keys transformers finds by this signature
        (attention_mask, position_ids, logits_to_keep, labels) are named; the rest come as its keywords:
        ``cache`` (``past_key_values`` before transformers 5.24): a transformers Cache (one is made when
        ``use_cache`` and none is given); ``use_cache``; ``output_hidden_states``; others are ignored."""
        cache: Any = kwargs.get("cache")
        past_key_values = kwargs.get("past_key_values")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("give the KV cache as `cache` or as `past_key_values`, not both")
        cache = cache if cache is not None else past_key_values
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and not self.training
        if use_cache and cache is None:
            cache = DynamicCache()
        output_hidden_states = kwargs.get("output_hidden_states")
        b, t = input_ids.shape
        dec = make_decoding(b, t, input_ids.device, attention_mask, cache if use_cache else None, position_ids)
        out = self.normlab(
            input_ids, return_hidden_states=bool(output_hidden_states), decoding=dec, logits_to_keep=logits_to_keep
        )
        loss = None
        if labels is not None:  # transformers convention: labels are the inputs, shifted here
            loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(
            loss=loss, logits=out.logits, hidden_states=out.hidden_states, **{CACHE_FIELD: cache if use_cache else None}
        )


AutoConfig.register("normlab", NormLabConfig, exist_ok=True)
AutoModelForCausalLM.register(NormLabConfig, NormLabForCausalLM, exist_ok=True)
