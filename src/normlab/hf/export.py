"""Save any normlab model as a transformers checkpoint of the normlab class, and load it back; `export`
chooses between that class and transformers' own.

The folder holds `config.json` (model_type "normlab", the layout string, the ModelConfig and the
special token ids), `generation_config.json` (bos/eos/pad: `generate()` stops at end-of-text),
`model.safetensors`, a self-contained `modeling_normlab.py` (`normlab.hf.bundle`: loads with only
torch and transformers, what `trust_remote_code=True` runs), and the tokenizer when one is given:
stock files (tokenizer.json, tokenizer_config.json naming `PreTrainedTokenizerFast`) that load with
no custom code. For layouts that a transformers architecture computes exactly, `normlab.hf.save_native`
writes that class instead, and `export(..., arch="auto")` (what `normlab export` does by default) picks it:
custom code only where no stock class computes the placement. A muP or CompleteP model's multipliers are folded
into the stock class's weights where that is exact (`normlab.hf.native.parametrization_folds`), else the normlab
class is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from normlab.errors import DataError
from normlab.io import atomic_write_bytes
from normlab.model.lm import NormLM

KIND = "export"  # the kind of folder `export_run` writes (its `.normlab` marker)


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


def choose_arch(model: NormLM, arch: str = "auto") -> tuple[str, str]:
    """The class `export` writes for ``model`` and why, in words: ``arch`` "auto" takes transformers' own class
    where one computes the layout exactly, else the normlab class; "normlab" or an architecture name forces one
    (an architecture that is not exact is refused when it is written)."""
    from normlab.hf.native import ARCHS, NativeExportError, folds_in_words

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
    if arch != "normlab":
        why += folds_in_words(model)
    return arch, why


def export(model: NormLM, out: str | Path, arch: str = "auto", tokenizer: Any = None) -> tuple[Path, str, str]:
    """Write ``model`` as a transformers folder: ``arch`` "auto" takes transformers' own class where one computes
    the layout exactly (no trust_remote_code anywhere), else the normlab class; "normlab" or an architecture name
    (refused with the reason where it is not exact) forces one. Returns (folder, class written, why, in words)."""
    from normlab.hf.native import save_native

    arch, why = choose_arch(model, arch)
    if arch == "normlab":
        return save_hf(model, out, tokenizer), arch, why
    path = save_native(model, out, arch, tokenizer)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    return path, arch, why


def weights_digest(model: NormLM) -> str:
    """SHA-256 over ``model``'s state (names, dtypes, shapes, bytes, in name order): what an export folder's
    marker records, so a rerun knows the weights it holds."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def from_hf(path: str | Path) -> NormLM:
    """The NormLM inside a saved normlab-class folder (for training on, screening, probing)."""
    from transformers import AutoModelForCausalLM

    import normlab.hf.modeling  # noqa: F401 - registers the classes
    from normlab.hf.folder import check_folder, reading

    check_folder(path)
    # trust_remote_code=False: normlab's registered class loads; code in the folder never runs (nor is asked about).
    # transformers' own load report and progress bar are silenced: a weight file that does not match the config
    # (another model's weights under normlab's config) is refused here in one line instead of loading half-empty
    with reading(path), _quiet_transformers():
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True
        )  # mismatched sizes listed (and refused below), not raised with a pointer to the silenced report
    hf, info = cast(tuple[Any, dict[str, Any]], loaded)
    wrong = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(wrong.values()):
        said = "; ".join(
            f"{len(v)} {k.replace('_keys', '')} (e.g. {v[0] if k != 'mismatched_keys' else v[0][0]})"
            for k, v in wrong.items()
            if v
        )
        raise DataError(
            f"{path}: its weights are not the model its config.json describes (normlab class, layout "
            f"{hf.config.layout!r}): {said}; give the folder normlab export wrote, or the weights' own config.json"
        )
    return cast(NormLM, hf.normlab)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' logging at errors only and its progress bars off, for the duration (restored after)."""
    from transformers.utils import logging as tf_logging

    level, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


def export_run(source: str | Path, out: str | Path, arch: str = "auto") -> tuple[list[str], Path, bool]:
    """`normlab export`: a run's (or checkpoint's) newest weights and its tokenizer into a new or empty
    folder; the lines that say what was written and how to load it, the folder, whether it needs
    trust_remote_code.

    The folder is written whole or not at all (`normlab.io.staged_folder`): a hidden sibling, moved into
    place once complete, so an export killed at any point (kill -9 included) leaves no folder, or a complete
    one, and the same command run again completes it (a staging folder the killed export left is removed).
    The marker records the weights' digest and the class written: the same export run again into its own
    finished folder answers as the first did and writes nothing; an export of other weights (or another
    class) into it is refused, nothing overwritten."""
    from normlab.errors import ForeignFolderError
    from normlab.hf.tokenizer import to_hf_tokenizer
    from normlab.io import folder_record, own_folder, staged_folder
    from normlab.runs.model import load_run_model, run_tokenizer

    dest = Path(out)
    prior = (folder_record(dest) if dest.is_dir() else None) or {}
    finished = prior.get("kind") == KIND and (dest / "config.json").is_file()
    if not finished:
        own_folder(dest, KIND, claim=False)  # someone's files, another folder's kind, read-only: before any work
    run = load_run_model(source)
    used, why = choose_arch(run.model, arch)
    facts = {"weights_sha256": weights_digest(run.model), "class": used}
    if finished and {k: prior.get(k) for k in facts} != facts:
        raise ForeignFolderError(
            f"{dest} holds a finished normlab export of other weights or another class "
            f"({prior.get('class', 'unknown')}); nothing there is overwritten: give a new or empty folder"
        )
    tok = run_tokenizer(run.config, run.run_dir)
    tokenizer = to_hf_tokenizer(tok, run.model.config.max_seq_len) if tok is not None else None
    if not finished:  # else: the same weights as the same class are there already, whole: nothing to write
        with staged_folder(dest, KIND, facts) as tmp:
            export(run.model, tmp, used, tokenizer)
    remote = used == "normlab"
    lines = [
        f"{run.checkpoint} -> {dest} ({used}: {why})",
        f"load: AutoModelForCausalLM.from_pretrained({str(dest)!r}{', trust_remote_code=True' if remote else ''})",
    ]
    if tokenizer is not None:  # stock files; AutoTokenizer on a normlab-class folder would first ask about its code
        lines.append(
            f"tokenizer: {'PreTrainedTokenizerFast' if remote else 'AutoTokenizer'}.from_pretrained("
            f"{str(dest)!r})" + (" (stock; no custom code)" if remote else "")
        )
    return lines, dest, remote
