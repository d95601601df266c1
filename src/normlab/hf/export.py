"""Save any normlab model as a transformers checkpoint of the normlab class, and load it back.

The folder holds `config.json` (model_type "normlab", the layout string, the ModelConfig and the
special token ids), `generation_config.json` (bos/eos/pad: `generate()` stops at end-of-text),
`model.safetensors`, a self-contained `modeling_normlab.py` (`normlab.hf.bundle`: loads with only
torch and transformers, what `trust_remote_code=True` runs), and the tokenizer when one is given.
For layouts that equal a transformers architecture, `normlab.hf.save_native` writes that class instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from normlab.io import atomic_write_bytes
from normlab.model.lm import NormLM


def set_special_tokens(hf_model: Any, tokenizer: Any) -> None:
    """The tokenizer's bos/eos/pad ids into the model's config and generation config (transformers'
    defaults, e.g. LlamaConfig's bos 1 / eos 2, would name ordinary tokens here)."""
    from normlab.hf.tokenizer import special_token_ids

    ids = special_token_ids(tokenizer) if tokenizer is not None else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf_model.config, key, ids.get(key))
        setattr(hf_model.generation_config, key, ids.get(key))


def to_hf(model: NormLM, tokenizer: Any = None) -> Any:
    """The `NormLabForCausalLM` holding ``model``'s weights (same function, same parameters)."""
    from normlab.hf.modeling import NormLabConfig, NormLabForCausalLM

    config = NormLabConfig(layout=model.layout.to_string(), model=model.config.to_dict())
    config.auto_map = {"AutoConfig": "modeling_normlab.NormLabConfig",
                       "AutoModelForCausalLM": "modeling_normlab.NormLabForCausalLM"}
    hf = NormLabForCausalLM(config)
    hf.normlab.load_state_dict(model.state_dict())
    set_special_tokens(hf, tokenizer)
    return hf.eval()


def save_hf(model: NormLM, out: str | Path, tokenizer: Any = None) -> Path:
    from normlab.hf.bundle import bundle_source

    out = Path(out)
    hf = to_hf(model, tokenizer)
    hf.save_pretrained(out, safe_serialization=True)
    atomic_write_bytes(out / "modeling_normlab.py", bundle_source().encode())
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def from_hf(path: str | Path) -> NormLM:
    """The NormLM inside a saved normlab-class folder (for training on, screening, probing)."""
    from transformers import AutoModelForCausalLM

    import normlab.hf.modeling  # noqa: F401 - registers the classes
    from normlab.hf.folder import check_folder, reading

    check_folder(path)
    # trust_remote_code=False: normlab's registered class loads; code in the folder never runs (nor is asked about)
    with reading(path):
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False).normlab
