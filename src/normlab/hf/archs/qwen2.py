"""Qwen 2 / 2.5 (`Qwen2ForCausalLM`) <-> layout `pre` with biases on the query, key and value projections
(model option `qkv_bias`; Qwen2 technical report, Sec. 2.2.1: "QKV bias"), no QK-norm, no bias on W_O or the
MLP. Its optional sliding window (`use_sliding_window` from `max_window_layers` on) maps only when it covers
all layers or none."""

from __future__ import annotations

from typing import Any

from normlab.hf.archs.llama import Llama
from normlab.model.config import ModelConfig


class Qwen2(Llama):
    model_type = "qwen2"
    qkv_bias = True
    windows = True

    def hf_class(self, tf: Any) -> Any:
        return tf.Qwen2ForCausalLM

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        window = cfg.sliding_window is not None
        common = self.common_config(cfg)
        common.pop("attention_bias")
        return tf.Qwen2Config(
            use_sliding_window=window,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if window else cfg.n_layers,
            **common,
        )


QWEN2 = Qwen2()
