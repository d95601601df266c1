"""Save any normlab model as a transformers checkpoint of the normlab class, and load it back.

The folder holds `config.json` (model_type "normlab", the layout string and the ModelConfig),
`model.safetensors`, a two-line `modeling_normlab.py` that imports the classes from the installed
normlab (what `trust_remote_code=True` loads), and the tokenizer when one is given. For layouts that
equal a transformers architecture, `normlab.hf.save_native` writes that class instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from normlab.io import atomic_write_bytes
from normlab.model.lm import NormLM

REMOTE_CODE = '''"""Loads normlab's transformers classes from the installed normlab package (pip install normlab[hf])."""
from normlab.hf.modeling import NormLabConfig, NormLabForCausalLM  # noqa: F401
'''


def to_hf(model: NormLM) -> Any:
    """The `NormLabForCausalLM` holding ``model``'s weights (same function, same parameters)."""
    from normlab.hf.modeling import NormLabConfig, NormLabForCausalLM

    config = NormLabConfig(layout=model.layout.to_string(), model=model.config.to_dict())
    config.auto_map = {"AutoConfig": "modeling_normlab.NormLabConfig",
                       "AutoModelForCausalLM": "modeling_normlab.NormLabForCausalLM"}
    hf = NormLabForCausalLM(config)
    hf.normlab.load_state_dict(model.state_dict())
    return hf.eval()


def save_hf(model: NormLM, out: str | Path, tokenizer: Any = None) -> Path:
    out = Path(out)
    hf = to_hf(model)
    hf.save_pretrained(out, safe_serialization=True)
    atomic_write_bytes(out / "modeling_normlab.py", REMOTE_CODE.encode())
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def from_hf(path: str | Path) -> NormLM:
    """The NormLM inside a saved normlab-class folder (for training on, screening, probing)."""
    from transformers import AutoModelForCausalLM

    import normlab.hf.modeling  # noqa: F401 - registers the classes

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).normlab
