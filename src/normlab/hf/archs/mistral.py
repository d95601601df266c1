"""Mistral (`MistralForCausalLM`) <-> layout `pre` with sliding-window attention on every layer (Jiang et al.
2023, Sec. 2: each token attends to at most W tokens of the previous layer): Llama's block otherwise."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.llama import Llama
from normlab.model.config import ModelConfig


class Mistral(Llama):
    model_type = "mistral"
    windows = True

    def hf_class(self, tf: Any) -> Any:
        return tf.MistralForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        return tf.MistralConfig(sliding_window=cfg.sliding_window, **self.common_config(cfg))


MISTRAL = Mistral()
