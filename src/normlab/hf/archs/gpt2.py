"""GPT-2 (`GPT2LMHeadModel`) -> layout `pre,norm=layer` (import only: the checkpoints people want to look
at): x' = x + F(LN(x)), final LN, with learned absolute positions, a tanh-GELU MLP and biases
(Radford et al. 2019). Its Conv1D weights are (in, out), so they are transposed; c_attn holds Q, K and
V side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from normlab.hf.archs.base import Arch
from normlab.model.config import MlpKind, ModelConfig

if TYPE_CHECKING:
    import torch

ACTIVATIONS: dict[str, MlpKind] = {
    "gelu_new": "gelu-tanh",
    "gelu_pytorch_tanh": "gelu-tanh",
    "gelu": "gelu",
    "relu": "relu",
}


class GPT2(Arch):
    model_type = "gpt2"
    preset = "pre,norm=layer"  # x' = x + F(LN(x)), final LN: GPT-2 is Pre-LN with LayerNorm
    exports = False
    config_keys = {
        **Arch.config_keys,
        "d_model": "n_embd",
        "n_layers": "n_layer",
        "n_heads": "n_head",
        "d_ff": "n_inner",
        "mlp": "activation_function",
        "max_seq_len": "n_positions",
        "norm_eps": "layer_norm_epsilon",
        "tie_embeddings": "tie_word_embeddings",
    }

    def config_problems(self, config: Any) -> list[str]:
        problems = []
        if config.activation_function not in ACTIVATIONS:
            problems.append(f"activation {config.activation_function!r} (importable: {', '.join(ACTIVATIONS)})")
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            problems.append("scale_attn_by_inverse_layer_idx (normlab scales attention by 1/sqrt(head_dim) only)")
        if not getattr(config, "scale_attn_weights", True):
            problems.append("scale_attn_weights=False")
        if config.n_embd % config.n_head:
            problems.append("n_embd not divisible by n_head")
        return problems

    def model_config(self, config: Any) -> ModelConfig:
        d = config.n_embd
        return ModelConfig(
            vocab_size=config.vocab_size,
            d_model=d,
            n_layers=config.n_layer,
            n_heads=config.n_head,
            d_ff=config.n_inner or 4 * d,
            mlp=ACTIVATIONS[config.activation_function],
            max_seq_len=config.n_positions,
            position="learned",
            norm_eps=config.layer_norm_epsilon,
            linear_bias=True,
            norm_bias=True,
            tie_embeddings=True,
        )

    def import_state(self, theirs: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        d, t = config.n_embd, {k: v.float() for k, v in theirs.items()}
        state = {
            "embed.weight": t["transformer.wte.weight"],
            "lm_head.weight": t["transformer.wte.weight"],
            "pos_embed.weight": t["transformer.wpe.weight"],
            "final_norm.weight": t["transformer.ln_f.weight"],
            "final_norm.bias": t["transformer.ln_f.bias"],
        }
        for i in range(config.n_layer):
            h, b = f"transformer.h.{i}.", f"blocks.{i}."
            for ln, site in (("ln_1", "attn_norms"), ("ln_2", "mlp_norms")):
                state[f"{b}{site}.input.weight"], state[f"{b}{site}.input.bias"] = (
                    t[f"{h}{ln}.weight"],
                    t[f"{h}{ln}.bias"],
                )
            w, bias = t[f"{h}attn.c_attn.weight"].T, t[f"{h}attn.c_attn.bias"]
            for j, p in enumerate("qkv"):
                state[f"{b}attn.{p}_proj.weight"] = w[j * d : (j + 1) * d]
                state[f"{b}attn.{p}_proj.bias"] = bias[j * d : (j + 1) * d]
            for ours, their in (
                ("attn.o_proj", "attn.c_proj"),
                ("mlp.up_proj", "mlp.c_fc"),
                ("mlp.down_proj", "mlp.c_proj"),
            ):
                state[f"{b}{ours}.weight"], state[f"{b}{ours}.bias"] = t[f"{h}{their}.weight"].T, t[f"{h}{their}.bias"]
        return state


GPT2_ARCH = GPT2()
