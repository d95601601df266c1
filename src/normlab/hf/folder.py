"""A local transformers folder, checked before transformers reads any of it: the one rule for every
command that reads one (`doctor`, `scan`, `train --init-from`, `eval`; `recommend` reads a config.json
through `read_config`).

- config.json: a JSON object (UTF-8, nested at most `io.MAX_JSON_DEPTH` levels: `io.read_json`) whose
  ``model_type`` is a string, and whose fields have the types transformers' config class checks;
- every other JSON file there (generation_config.json, tokenizer_config.json, the weights' index, ...):
  the same bounds, since transformers reads them with Python's recursive parser;
- no model code of its own: a config.json whose ``auto_map`` names a module (other than normlab's class)
  for a ``model_type`` transformers does not ship is refused before the weights are opened (where the type is
  one transformers ships, its own class loads and the folder's code never runs);
- every ``*.safetensors``: a header the safetensors library reads (`safe_open` reads only the header);
- the tokenizer (`load_tokenizer`): tokenizer_config.json names no code of its own (``auto_map``: never
  run), its tokenizer.json passes `normlab.data.tokenizer.read_tokenizer_json`, and it encodes text;
- pickled weights (pytorch_model.bin): transformers reads them weights-only; a refused one is an
  `UnsafeCheckpointError` naming the refused global, never torch's advice to load it unsafely.

`reading(folder)` turns what transformers raises on a folder's content (a field of the wrong type, an
unknown model type, a weight file it cannot read) into one `DataError` line; it wraps only transformers'
own loading calls.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from normlab.errors import USER_ERRORS, DataError, UnsafeCheckpointError, without_unsafe_advice
from normlab.io import read_json

CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
STRING_FIELDS = ("model_type",)  # read before transformers: a list there fails inside it as "unhashable type"


def read_config(path: str | Path) -> dict[str, Any]:
    """A transformers config.json's object: bounded JSON (`io.read_json`), its string fields strings."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist; give a transformers config.json (or the folder that holds one)")
    data = read_json(path)
    if not isinstance(data, dict):
        raise DataError(
            f"{path} holds a JSON {_JSON_TYPES.get(type(data), 'value')}, not an object; a transformers config.json is "
            'an object such as {"model_type": "llama", "hidden_size": 2048, ...}'
        )
    text = data.get("text_config")  # a multimodal config's language model
    for part, prefix in ((data, ""), (text if isinstance(text, dict) else {}, "text_config.")):
        for key in STRING_FIELDS:
            if key in part and not isinstance(part[key], str):
                raise DataError(
                    f'{path}: "{prefix}{key}" must be a string such as "llama", not a JSON '
                    f"{_JSON_TYPES.get(type(part[key]), type(part[key]).__name__)}"
                )
    return data


_JSON_TYPES = {list: "array", dict: "object", int: "number", float: "number", bool: "boolean", type(None): "null"}


def code_modules(folder: str | Path, files: tuple[str, ...] = (CONFIG, "tokenizer_config.json")) -> set[str]:
    """The modules that the ``auto_map`` of a folder's ``files`` point at: the code transformers would
    import from the folder when it loads (bounded JSON, `io.read_json`)."""
    modules: set[str] = set()
    for name in files:
        path = Path(folder) / name
        if not path.is_file():
            continue
        data = read_json(path)
        if not isinstance(data, dict):
            raise DataError(f"{path} holds a JSON {_JSON_TYPES.get(type(data), 'value')}, not an object")
        auto_map = data.get("auto_map") or {}
        refs = [
            r
            for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])
            for r in (v if isinstance(v, (list, tuple)) else [v])
            if r
        ]
        modules |= {str(r).rsplit(".", 1)[0] for r in refs}
    return modules


# an export's own class: registered by normlab.hf.modeling, so its folder loads without running the file (eval
# runs the file only when it is byte for byte what this normlab writes: evaluation.harness.remote_code)
NORMLAB_MODULE = "modeling_normlab"


def check_folder(folder: str | Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Check ``folder`` as the module docstring says, before transformers opens it; its config.json.
    ``trust_remote_code``: the folder's own code may run (eval, where `remote_code` allowed it)."""
    folder = Path(folder)
    config = read_config(folder / CONFIG)
    for f in sorted(folder.glob("*.json")):
        if f.name != CONFIG and f.is_file():
            read_json(f)
    # the model's code; a tokenizer's (tokenizer_config.json) is refused by `load_tokenizer`, with its own words
    foreign = sorted(code_modules(folder, (CONFIG,)) - {NORMLAB_MODULE})
    if foreign and not trust_remote_code and not _shipped_type(config.get("model_type")):
        raise DataError(
            f"{folder} names model code of its own ({', '.join(m + '.py' for m in foreign)}) for model_type "
            f"{config.get('model_type')!r}, which transformers does not ship: loading it would run that code, and "
            "normlab never runs a folder's code; give a folder of a transformers architecture, or a normlab export"
        )
    for f in sorted(folder.glob("*.safetensors")):
        _check_safetensors(f)
    from normlab.hf.library import require_transformers

    tf = require_transformers()  # its install hint before normlab.hf.modeling imports it
    import normlab.hf.modeling  # noqa: F401 - registers the normlab class: an export's config reads too

    with reading(folder):  # the fields' types as transformers checks them (hidden_size "64", ...)
        tf.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    return config


def _shipped_type(model_type: object) -> bool:
    """Whether transformers ships a class for ``model_type`` (then a leftover ``auto_map`` is never run:
    transformers loads its own class with trust_remote_code=False, as for Phi-3 or Falcon hub snapshots).
    Imports transformers' config table (about 1.5 s of CPU), only for a folder that names code."""
    from normlab.hf.library import require_transformers

    require_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES


def _check_safetensors(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as err:
        raise DataError(
            f"{path} is not a readable safetensors file ({_words(err)}); give the weights as save_pretrained wrote them"
        ) from None


def load_tokenizer(folder: str | Path) -> Any:
    """The folder's tokenizer as transformers loads it, or None where it holds none (the texts are then
    fed as bytes); a tokenizer that names its own code, fails `read_tokenizer_json`, or cannot encode
    text is a DataError. The one rule of `doctor` and `scan`."""
    from normlab.data.tokenizer import PROBE_TEXT, read_tokenizer_json
    from normlab.hf.library import require_transformers

    folder = Path(folder)
    # only a folder that holds a tokenizer: transformers would otherwise guess one from the model type
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    if (folder / "tokenizer_config.json").is_file():
        config = read_json(folder / "tokenizer_config.json")
        if isinstance(config, dict) and config.get("auto_map"):
            raise DataError(
                f"{folder / 'tokenizer_config.json'} names tokenizer code of its own (auto_map "
                f"{config['auto_map']!r:.120}); normlab never runs a folder's code: remove auto_map to "
                "use its tokenizer.json, or the tokenizer files to feed bytes"
            )
    if (folder / "tokenizer.json").is_file():
        read_tokenizer_json(folder / "tokenizer.json")
    with reading(folder, "its tokenizer"):
        tok = require_transformers().AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False
        )
        tok(PROBE_TEXT, verbose=False)
    return tok


@contextlib.contextmanager
def reading(folder: str | Path, what: str = "a transformers model") -> Iterator[None]:
    """Around transformers' loading of ``folder``: what its content makes transformers raise becomes one
    DataError line (an unsafe pickle an UnsafeCheckpointError); normlab's own errors pass unchanged."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        yield
    except USER_ERRORS:
        raise
    except pickle.UnpicklingError as err:
        from normlab.runs.checkpoint import refused_global

        raise UnsafeCheckpointError(
            f"{folder}: a weight file holds objects other than tensors and plain values ({refused_global(err)}); "
            "loading it could run code, so it was refused; give the weights as safetensors"
        ) from None
    except (StrictDataclassError, SafetensorError, ValueError, TypeError, KeyError, OSError) as err:
        raise DataError(f"{folder} does not load as {what}: {type(err).__name__}: {_words(err)}") from None
    except RuntimeError as err:  # torch's "Error(s) in loading state_dict": weights of other shapes than the config's
        if not any(w in str(err) for w in ("state_dict", "size mismatch", "ignore_mismatched_sizes")):
            raise  # anything else (out of memory) is not the folder's content
        raise DataError(f"{folder} does not load as {what}: {type(err).__name__}: {_words(err)}") from None


def _words(err: BaseException) -> str:
    """The error's message on one line, at most 300 characters, without torch's advice to load unsafely."""
    return without_unsafe_advice(" ".join(str(err).split()))[:300]
