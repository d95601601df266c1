"""normlab's weights under the names another code base gives them, for the snippets of
`normlab.recommend.frameworks.snippets` (read from each library's modules: litgpt 0.5.13, OLMo-core 3.0.0,
torchtitan 0.3.0). Each map returns the whole state dict, so that `load_state_dict(strict=True)` fails
on a norm the snippet built that normlab's model lacks, or the reverse."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from normlab.recommend.frameworks.snippets import FRAMEWORKS, placement


def _blocks(sd: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))


def _renamed(
    sd: dict[str, torch.Tensor], blocks: str, rename: dict[str, str], top: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """normlab's state dict under another library's names: ``blocks.i.MODULE.KIND`` -> ``BLOCKS.i.rename[MODULE].KIND``,
    every other key through ``top``."""
    out = {}
    for k, v in sd.items():
        if k.startswith("blocks."):
            i, rest = k.split(".", 2)[1:]
            ours, kind = rest.rsplit(".", 1)
            out[f"{blocks}.{i}.{rename[ours]}.{kind}"] = v
        else:
            out[top(k)] = v
    return out


def litgpt(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    norms = {
        "attn_norms.input": "norm_1",
        "attn_norms.output": "post_attention_norm",
        "mlp_norms.input": "norm_2",
        "mlp_norms.output": "post_mlp_norm",
        "attn.q_norm": "attn.norm_q",
        "attn.k_norm": "attn.norm_k",
        "attn.o_proj": "attn.proj",
        "mlp.down_proj": "mlp.proj",
    }
    gated = any(k.endswith("mlp.gate_proj.weight") for k in sd)
    norms.update({"mlp.gate_proj": "mlp.fc_1", "mlp.up_proj": "mlp.fc_2"} if gated else {"mlp.up_proj": "mlp.fc"})
    out = {
        "transformer.wte.weight": sd["embed.weight"],
        # the patch's embedding norm: block 0 normalizes its input (normlab.recommend.frameworks.patches)
        **({"transformer.h.0.embedding_norm.weight": sd["embed_norm.weight"]} if "embed_norm.weight" in sd else {}),
        "transformer.ln_f.weight": sd["final_norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(_blocks(sd)):
        n, h = f"blocks.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            if f"{n}attn.q_proj.{kind}" in sd:  # litgpt's one qkv projection: q, then k, then v
                out[f"{h}attn.qkv.{kind}"] = torch.cat([sd[f"{n}attn.{p}_proj.{kind}"] for p in "qkv"])
            for ours, theirs in norms.items():
                if f"{n}{ours}.{kind}" in sd:
                    out[f"{h}{theirs}.{kind}"] = sd[f"{n}{ours}.{kind}"]
    return out


def _norm_weight(key: str) -> bool:
    """Whether a key of normlab's state dict is a norm's weight (its gain)."""
    return re.search(r"(_norms\.\w+|_norm)\.weight$", key) is not None


def olmo_core(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    opts = FRAMEWORKS["OLMo-core"].placements[placement("OLMo-core", layout)]
    block = opts["block"]
    if opts.get("unit_offset"):  # normlab's gain 1 + w is OLMo-core's RMSNorm weight (olmo_core.nn.hf.convert)
        sd = {k: v + 1.0 if _norm_weight(k) else v for k, v in sd.items()}
    # reordered_norm keeps its output norms under the input norms' names (x + attention_norm(attention(x)))
    site = "output" if block == "reordered_norm" else "input"
    rename = {
        f"attn_norms.{site}": "attention_norm",
        f"mlp_norms.{site}": "feed_forward_norm",
        "attn.q_proj": "attention.w_q",
        "attn.k_proj": "attention.w_k",
        "attn.v_proj": "attention.w_v",
        "attn.o_proj": "attention.w_out",
        "attn.gate_proj": "attention.w_g",
        "attn.q_norm": "attention.q_norm",
        "attn.k_norm": "attention.k_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
    }
    if block == "peri_norm":
        rename.update({"attn_norms.output": "post_attention_norm", "mlp_norms.output": "post_feed_forward_norm"})
    top = {
        "embed": "embeddings",
        "embed_norm": "embedding_norm",
        "final_norm": "lm_head.norm",
        "lm_head": "lm_head.w_out",
    }
    return _renamed(sd, "blocks", rename, lambda k: top[k.rsplit(".", 1)[0]] + "." + k.rsplit(".", 1)[1])


def torchtitan(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    rename = {
        "attn_norms.input": "attention_norm",
        "mlp_norms.input": "ffn_norm",
        # the patch's output norms (normlab.recommend.frameworks.patches)
        "attn_norms.output": "post_attention_norm",
        "mlp_norms.output": "post_ffn_norm",
        "attn.q_proj": "attention.qkv_linear.wq",
        "attn.k_proj": "attention.qkv_linear.wk",
        "attn.v_proj": "attention.qkv_linear.wv",
        "attn.o_proj": "attention.wo",
        "attn.q_norm": "attention.q_norm",
        "attn.k_norm": "attention.k_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
    }
    top = {
        "embed.weight": "tok_embeddings.weight",
        "final_norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "embed_norm.weight": "layers.0.embedding_norm.weight",  # the patch's: the first block normalizes its input
    }
    return _renamed(sd, "layers", rename, top.__getitem__)


WEIGHTS = {"litgpt": litgpt, "OLMo-core": olmo_core, "torchtitan": torchtitan}
