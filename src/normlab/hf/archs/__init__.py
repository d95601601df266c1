"""The transformers architectures normlab converts exactly, one adapter each (beside its weight map).

Adding an architecture is one module with an `Arch` subclass and one entry here.
"""

from normlab.hf.archs.base import Arch
from normlab.hf.archs.gemma2 import GEMMA2
from normlab.hf.archs.gemma3 import GEMMA3
from normlab.hf.archs.gpt2 import GPT2_ARCH
from normlab.hf.archs.llama import LLAMA
from normlab.hf.archs.mistral import MISTRAL
from normlab.hf.archs.olmo2 import OLMO2
from normlab.hf.archs.olmo3 import OLMO3
from normlab.hf.archs.qwen2 import QWEN2
from normlab.hf.archs.qwen3 import QWEN3

ARCHITECTURES: dict[str, Arch] = {
    a.model_type: a for a in (LLAMA, OLMO2, GEMMA2, GPT2_ARCH, QWEN2, QWEN3, MISTRAL, GEMMA3, OLMO3)
}
# the names `--arch` takes (a model_type, or a shorter name where transformers' is a variant: gemma3)
BY_NAME: dict[str, Arch] = {a.name or a.model_type: a for a in ARCHITECTURES.values()}
EXPORTABLE: dict[str, str] = {n: a.preset for n, a in BY_NAME.items() if a.exports}  # export name -> preset

__all__ = ["ARCHITECTURES", "BY_NAME", "EXPORTABLE", "Arch"]
