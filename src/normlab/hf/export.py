"""Save any normlab model as a transformers checkpoint of the normlab class, and load it back; `export`
chooses between that class and transformers' own.

The folder holds `config.json` (model_type "normlab", the layout string, the ModelConfig and the
special token ids), `generation_config.json` (bos/eos/pad: `generate()` stops at end-of-text),
`model.safetensors`, a self-contained `modeling_normlab.py` (`normlab.hf.bundle`: loads with only
torch and transformers, what `trust_remote_code=True` runs), and the tokenizer when one is given:
stock files (tokenizer.json, tokenizer_config.json naming `PreTrainedTokenizerFast`) that load with
no custom code. For layouts that a transformers architecture computes exactly, `normlab.hf.save_native`
writes that class instead, and `export(..., arch="auto")` (what `normlab export` does by default) picks it:
custom code only where no stock class computes the placement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from normlab.io import atomic_write_bytes
from normlab.model.lm import NormLM


def to_hf(model: NormLM, tokenizer: Any = None) -> Any:
    """The `NormLabForCausalLM` holding ``model``'s weights (same function, same parameters)."""
    from normlab.hf.modeling import NormLabConfig, NormLabForCausalLM
    from normlab.hf.tokenizer import set_special_tokens

    config = NormLabConfig(layout=model.layout.to_string(), model=model.config.to_dict())
    config.auto_map = {
        "AutoConfig": "modeling_normlab.NormLabConfig",
        "AutoModelForCausalLM": "modeling_normlab.NormLabForCausalLM",
    }
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
        save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """The tokenizer as stock transformers files: tokenizer.json and a tokenizer_config.json whose class is
    `PreTrainedTokenizerFast` (the name every transformers version reads; 5.x writes its alias
    TokenizersBackend, which 4.x does not know). No tokenizer code is ever needed to load it."""
    import json

    tokenizer.save_pretrained(out)
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    atomic_write_bytes(path, (json.dumps(config, indent=2) + "\n").encode())


def exact_native(model: NormLM) -> list[str]:
    """The transformers classes that compute ``model`` exactly (`normlab.hf.native`'s adapters), in registry order."""
    from normlab.hf.native import ARCHS, NativeExportError, _export_arch

    found = []
    for arch in ARCHS:
        try:
            _export_arch(model, arch)
        except NativeExportError:
            continue
        found.append(arch)
    return found


def export(model: NormLM, out: str | Path, arch: str = "auto", tokenizer: Any = None) -> tuple[Path, str, str]:
    """Write ``model`` as a transformers folder: ``arch`` "auto" takes transformers' own class where one computes
    the layout exactly (no trust_remote_code anywhere), else the normlab class; "normlab" or an architecture name
    (refused with the reason where it is not exact) forces one. Returns (folder, class written, why, in words)."""
    from normlab.hf.native import ARCHS, NativeExportError, save_native

    layout = model.layout.label
    if model.layout.streams > 1 and arch != "normlab":
        # transformers 5.24 computes mHC only inside DeepseekV4ForCausalLM, around its MoE, compressed attention
        # and learned stream head: no class computes hyper-connections on a dense block
        raise NativeExportError(
            f"layout {layout} has {model.layout.streams} residual streams (hyper-connections): no transformers class "
            "computes them on a dense block (DeepseekV4ForCausalLM's mHC sits inside its MoE and compressed "
            "attention); --arch normlab writes the normlab class, with its code"
        )
    exact = exact_native(model)
    if arch == "auto":
        arch = exact[0] if exact else "normlab"
        why = (
            f"transformers' own {arch} class computes layout {layout} exactly: no custom code"
            if exact
            else f"no transformers class computes layout {layout} (exact: "
            + ", ".join(f"{p} -> {a}" for a, p in ARCHS.items())
            + "): the normlab class, with its code"
        )
    elif arch == "normlab":
        why = "the normlab class, as asked" + (
            f" (transformers' {exact[0]} class computes this layout exactly: --arch {exact[0]} needs no custom code)"
            if exact
            else ""
        )
    else:
        why = f"transformers' {arch} class, as asked"
    if arch == "normlab":
        return save_hf(model, out, tokenizer), arch, why
    path = save_native(model, out, arch, tokenizer)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    return path, arch, why


def from_hf(path: str | Path) -> NormLM:
    """The NormLM inside a saved normlab-class folder (for training on, screening, probing)."""
    from transformers import AutoModelForCausalLM

    import normlab.hf.modeling  # noqa: F401 - registers the classes
    from normlab.hf.folder import check_folder, reading

    check_folder(path)
    # trust_remote_code=False: normlab's registered class loads; code in the folder never runs (nor is asked about)
    with reading(path):
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False).normlab


def export_run(source: str | Path, out: str | Path, arch: str = "auto") -> tuple[list[str], Path, bool]:
    """`normlab export`: a run's (or checkpoint's) newest weights and its tokenizer into a new or empty
    folder; the lines that say what was written and how to load it, the folder, whether it needs
    trust_remote_code."""
    from normlab.errors import ConfigError
    from normlab.hf.tokenizer import to_hf_tokenizer
    from normlab.runs.model import load_run_model, run_tokenizer

    dest = Path(out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(
            f"export destination {dest} {'is a file' if not dest.is_dir() else 'is not empty'}; "
            "nothing there is overwritten: give a new or empty folder"
        )
    run = load_run_model(source)
    tok = run_tokenizer(run.config, run.run_dir)
    tokenizer = to_hf_tokenizer(tok, run.model.config.max_seq_len) if tok is not None else None
    folder, used, why = export(run.model, dest, arch, tokenizer)
    remote = used == "normlab"
    lines = [
        f"{run.checkpoint} -> {folder} ({used}: {why})",
        f"load: AutoModelForCausalLM.from_pretrained({str(folder)!r}{', trust_remote_code=True' if remote else ''})",
    ]
    if tokenizer is not None:  # stock files; AutoTokenizer on a normlab-class folder would first ask about its code
        lines.append(
            f"tokenizer: {'PreTrainedTokenizerFast' if remote else 'AutoTokenizer'}.from_pretrained("
            f"{str(folder)!r})" + (" (stock; no custom code)" if remote else "")
        )
    return lines, folder, remote
