"""The transformers architectures normlab converts exactly, one adapter each (beside its weight map).

Adding an architecture is one module with an `Arch` subclass and one entry here.
"""

from normlab.hf.archs.base import Arch
from normlab.hf.archs.gemma2 import GEMMA2
from normlab.hf.archs.gpt2 import GPT2_ARCH
from normlab.hf.archs.llama import LLAMA
from normlab.hf.archs.mistral import MISTRAL
from normlab.hf.archs.olmo2 import OLMO2
from normlab.hf.archs.qwen3 import QWEN3

ARCHITECTURES: dict[str, Arch] = {a.model_type: a for a in (LLAMA, OLMO2, GEMMA2, GPT2_ARCH, QWEN3, MISTRAL)}
EXPORTABLE: dict[str, str] = {t: a.preset for t, a in ARCHITECTURES.items() if a.exports}  # model_type -> preset

__all__ = ["ARCHITECTURES", "EXPORTABLE", "Arch"]
