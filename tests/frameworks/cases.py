"""The (placement, code base) pairs `tests/frameworks` builds in the real library, written out: a pair that
`normlab.recommend.frameworks.snippets` can emit and this list lacks fails `tests/unit/test_recommend.py` (a snippet
that no test builds is not shipped)."""

TESTED: tuple[tuple[str, str], ...] = (
    ("pre", "OLMo-core"),
    ("pre-lns", "OLMo-core"),
    ("qwen3", "OLMo-core"),
    ("pre-gate", "OLMo-core"),
    ("olmo2", "OLMo-core"),
    ("b", "OLMo-core"),
    ("peri", "OLMo-core"),
    ("peri-noemb", "OLMo-core"),
    ("peri+qk", "OLMo-core"),
    ("gemma2", "OLMo-core"),
    ("gemma3", "OLMo-core"),
    ("pre", "torchtitan"),
    ("qwen3", "torchtitan"),
    ("pre", "litgpt"),
    ("peri-noemb", "litgpt"),
    ("gemma2", "litgpt"),
    ("gemma3", "litgpt"),
    ("qwen3", "litgpt"),
    ("olmo2", "litgpt"),
    # qwen3's function with Zhuo et al.'s Megatron init: the same snippets
    ("pre-qk-pre", "OLMo-core"),
    ("pre-qk-pre", "torchtitan"),
    ("pre-qk-pre", "litgpt"),
    # a Llama or Qwen3 user's model with Peri-LN's parts, by the code base's settings
    ("attn=A,mlp=A,emb,final", "OLMo-core"),
    ("attn=qkA,mlp=A,emb,final", "OLMo-core"),
    ("attn=qkAB,mlp=AB,final", "OLMo-core"),
    ("attn=qkAB,mlp=AB,emb,final", "OLMo-core"),
    ("attn=qkAB,mlp=AB,final", "litgpt"),
)

# (placement, code base, the user's placement or None): the patches
# `normlab.recommend.frameworks.snippets.patch` writes where
# the settings do not reach, each run as printed; every (placement, code base) of `PATCHES` is here at least once
# (tests/unit/test_framework_patches.py). The user's placement picks torchtitan's base block: Llama3's for "pre",
# Qwen3's for "qwen3"; ("attn=qkAB,mlp=AB,final", "pre") is QK-norm and output norms on Llama3's block.
PATCHED: tuple[tuple[str, str, str | None], ...] = (
    ("peri", "torchtitan", "pre"),
    ("peri", "torchtitan", None),
    ("peri-noemb", "torchtitan", "pre"),
    ("attn=A,mlp=A,emb,final", "torchtitan", "pre"),
    ("attn=qkA,mlp=A,emb,final", "torchtitan", "qwen3"),
    ("attn=qkAB,mlp=AB,final", "torchtitan", "qwen3"),
    ("attn=qkAB,mlp=AB,final", "torchtitan", "pre"),
    ("attn=qkAB,mlp=AB,emb,final", "torchtitan", "qwen3"),
    ("peri", "litgpt", "pre"),
    ("attn=A,mlp=A,emb,final", "litgpt", "pre"),
    ("attn=qkA,mlp=A,emb,final", "litgpt", "qwen3"),
    ("attn=qkAB,mlp=AB,emb,final", "litgpt", "qwen3"),
)
