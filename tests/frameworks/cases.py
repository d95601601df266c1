"""The (placement, code base) pairs `tests/frameworks` builds in the real library, written out: a pair that
`normlab.recommend.frameworks` can emit and this list lacks fails `tests/unit/test_recommend.py` (a snippet
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
)
