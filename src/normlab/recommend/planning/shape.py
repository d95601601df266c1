"""The user's model, as `normlab recommend` reads it: a size preset, a TOML of model options, or a
transformers `config.json` (or the folder holding it); and the two shapes derived from it.

- `read_user_model`: depth, width, heads, FFN, vocabulary and the options that change what a block
  computes (MLP kind, tied embeddings, soft-capping, biases), plus the placement the model has now
  where its architecture names one (a `model_type` normlab converts exactly: `normlab.hf.archs`).
- `screen_shape`: the user's depth at the largest width the screen's time allows, head width and the
  FFN and GQA ratios kept (`normlab.recommend.planning.plan` picks the width).
- `proxy_shape`: the user's depth where the budget allows, at the proxy width (64): the same ratios,
  the same MLP kind and options, byte-level vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from normlab.errors import ConfigError
from normlab.model.config import SIZES, ModelConfig

PROXY_WIDTH = 64  # micro's width: a 12-layer proxy trains 150 steps in about a minute on one core
PROXY_HEAD_DIM = 16  # micro's head width
PROXY_SEQ_LEN = 128

# transformers config keys for each shape field, first found wins (Llama family, GPT-2, OPT, Falcon, ...)
_KEYS = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "d_model": ("hidden_size", "n_embd", "d_model", "dim"),
    "n_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "n_kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"),
    "d_ff": ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "d_head": ("head_dim",),
}
# the config's activation name -> normlab's MLP kind (a gated MLP for the Llama-family names)
_ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu-tanh",
    "gelu_new": "gelu-tanh",
    "gelu_fast": "gelu-tanh",
    "gelu": "gelu",
    "relu": "relu",
}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": None}


@dataclass(frozen=True)
class UserModel:
    """The user's model as `recommend` needs it."""

    config: ModelConfig  # the full shape
    source: str  # what it was read from, in words
    layout: str | None = None  # the placement it has now (a preset or string form), where known
    precision: str | None = None  # bf16 / fp16 from config.json's torch_dtype, where given
    notes: tuple[str, ...] = field(default_factory=tuple)  # what was read approximately, or left out
    # what the config asks for that normlab does not compute (a scaled RoPE, ...): the proxies leave it out, and the
    # framework snippets list it as not stated (normlab.recommend.frameworks.snippets.settings_for's `unmodelled`)
    unmodelled: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        c = self.config
        ffn = f"FFN {c.ffn_dim} ({c.mlp})" + (f", {c.n_experts} experts" if c.n_experts else "")
        kv = f"/{c.kv_heads} kv" if c.kv_heads != c.n_heads else ""
        return (
            f"{self.source}: {c.n_layers} layers, d {c.d_model}, {c.n_heads}{kv} heads of {c.head_dim}, {ffn}, "
            f"vocabulary {c.vocab_size:,}" + (f"; placement now: {self.layout}" if self.layout else "")
        )


def read_user_model(spec: str) -> UserModel:
    """A size preset name, a .toml file (`size`, `layout` and a `[model]` table of model options) or a
    transformers config.json / a folder holding one."""
    path = Path(spec)
    if spec in SIZES:
        return UserModel(SIZES[spec], f"size preset {spec}")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{spec} is a folder without a config.json; give a size preset ({', '.join(SIZES)}), "
                "a .toml of model options or a transformers config.json"
            )
    if path.suffix == ".toml":
        return _from_toml(path)
    if path.suffix == ".json":
        return _from_config_json(path)
    raise ConfigError(
        f"model {spec!r} is not a size preset, a .toml file or a config.json; valid size presets: {', '.join(SIZES)}"
    )


def _from_toml(path: Path) -> UserModel:
    from normlab.io import read_toml

    data = read_toml(path, "model file")
    unknown = sorted(set(data) - {"size", "layout", "model"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; valid: size, layout and a [model] table")
    size = data.get("size", "tiny")
    if size not in SIZES:
        raise ConfigError(f"{path}: unknown size {size!r}; valid: {', '.join(SIZES)}")
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"{path}: [model] must be a table of model options, e.g. n_layers = 24")
    layout = data.get("layout")
    if layout is not None:
        from normlab.layout import as_layout

        as_layout(layout)  # a typo fails here, with the valid names
    return UserModel(SIZES[size].with_(**model), f"{path.name}", layout=layout)


def _from_config_json(path: Path) -> UserModel:
    from normlab.hf.folder import read_config

    data = read_config(path)  # bounded JSON, an object, model_type a string
    notes = []
    kind = data.get("model_type", "?")
    if isinstance(data.get("text_config"), dict):  # a multimodal config (Gemma 3, Llava): its language model
        notes.append(f"read the language model of {kind} (text_config)")
        data = {**data["text_config"], "torch_dtype": data.get("torch_dtype", data["text_config"].get("torch_dtype"))}
        kind = data.get("model_type", kind)
    unmodelled: list[str] = []
    config, layout = _via_adapter(kind, data, notes, unmodelled)
    if config is None:
        config = _generic(data, path, notes)
        layout = None
        notes.append(
            f"model_type {kind!r} has no exact normlab adapter: shape read from the config's fields, "
            "its placement unknown"
        )
    experts = data.get("num_experts") or data.get("num_local_experts") or data.get("n_routed_experts")
    if experts:
        notes.append(
            f"{experts} experts per layer: screened and proxied as a dense MLP of the same width "
            "(the router's own instabilities are not tested)"
        )
    dtype = data.get("torch_dtype") or data.get("dtype")
    return UserModel(
        config,
        f"{path.name} ({kind})",
        layout=layout,
        precision=_DTYPES.get(str(dtype)),
        notes=tuple(notes),
        unmodelled=tuple(unmodelled),
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' logger at errors only, and Python's warnings caught, while it builds a config: what is
    wrong with the file is said by normlab's checks, in one line (or as a note)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _via_adapter(
    kind: str, data: dict[str, Any], notes: list[str], unmodelled: list[str]
) -> tuple[ModelConfig | None, str | None]:
    """The shape and placement through normlab's adapter for `kind` (transformers builds the config
    object, so its defaults fill what the file leaves out); (None, None) where that does not apply. What the
    adapter finds normlab does not compute goes into `unmodelled` (and, in words, `notes`)."""
    from normlab.hf.archs import ARCHITECTURES

    if kind not in ARCHITECTURES:
        return None, None
    try:
        import transformers

        body = {k: v for k, v in data.items() if k != "model_type"}
        with _quiet_transformers():  # its warnings on a bad field (vocab_size 0) precede normlab's one line
            config = transformers.AutoConfig.for_model(kind, **body)
    except Exception:  # noqa: BLE001 - transformers missing or too old for this type: read the fields instead
        return None, None
    adapter = ARCHITECTURES[kind]
    problems = adapter.config_problems(config)
    if problems:
        notes.append("not modelled by the proxies: " + "; ".join(problems))
        unmodelled.extend(problems)
    try:
        model = adapter.model_config(config)
    except (ConfigError, ValueError, AttributeError, TypeError) as err:
        notes.append(f"{kind}'s adapter could not read it ({err})")
        return None, None
    return model, adapter.preset


def _first(data: dict[str, Any], name: str) -> Any:
    return next((data[k] for k in _KEYS[name] if data.get(k) is not None), None)


def _generic(data: dict[str, Any], path: Path, notes: list[str]) -> ModelConfig:
    """The shape from the common field names of transformers configs (any model_type)."""
    values = {name: _first(data, name) for name in _KEYS}
    missing = [name for name in ("n_layers", "d_model", "n_heads") if values[name] is None]
    if missing:
        raise ConfigError(
            f"{path}: no {', '.join(missing)} found (looked for "
            + "; ".join(f"{m}: {' / '.join(_KEYS[m])}" for m in missing)
            + ")"
        )
    act = data.get("hidden_act") or data.get("hidden_activation") or data.get("activation_function") or "silu"
    mlp = _ACTIVATIONS.get(str(act))
    if mlp is None:
        notes.append(f"activation {act!r} is not one normlab builds: proxied with SwiGLU")
        mlp = "swiglu"
    opts: dict[str, Any] = {k: v for k, v in values.items() if v is not None and k != "d_head"}
    if values["d_head"] and values["d_head"] * values["n_heads"] != values["d_model"]:
        opts["d_head"] = values["d_head"]
    opts.update(mlp=mlp, tie_embeddings=bool(data.get("tie_word_embeddings", False)))  # absent: untied, as most LMs
    if "n_positions" in data and "rotary" not in json.dumps(data):
        opts["position"] = "learned"
    try:
        return ModelConfig().with_(**opts)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def _kv_heads(user: ModelConfig, heads: int) -> int:
    """The proxy's key/value heads: the user's query-to-kv ratio where it divides `heads`, else one."""
    ratio = user.n_heads // user.kv_heads
    return heads // ratio if ratio and heads % ratio == 0 and heads >= ratio else 1


def _scaled(user: ModelConfig, width: int, head_dim: int) -> dict[str, Any]:
    """The user's block at another width: head width `head_dim`, the FFN ratio and GQA ratio kept."""
    heads = max(1, width // head_dim)
    ffn = max(8, int(round(user.ffn_dim / user.d_model * width / 8)) * 8)
    options = {f.name: getattr(user, f.name) for f in fields(ModelConfig)}
    options.update(
        d_model=width,
        n_heads=heads,
        n_kv_heads=_kv_heads(user, heads),
        d_head=None,
        d_ff=ffn,
        attn_scale=None,
        sliding_window=None,
        full_attention_every=0,
        rope_local_theta=None,
    )
    if user.n_experts:  # the experts' width on the same ratio
        options["expert_d_ff"] = max(8, int(round(user.expert_ffn_dim / user.d_model * width / 8)) * 8)
    return options


def screen_shape(user: ModelConfig, width: int, seq_len: int) -> dict[str, Any]:
    """Model options for the screen: the user's depth at `width` (the user's own where it fits), the
    head width kept where the width allows, a byte vocabulary (the screen feeds random tokens: the
    embedding's size changes nothing it measures)."""
    if width >= user.d_model:
        options = {f.name: getattr(user, f.name) for f in fields(ModelConfig)}
    else:
        options = _scaled(user, width, min(user.head_dim, width))
    options.update(vocab_size=256, max_seq_len=max(seq_len, 8))
    return options


def proxy_shape(user: ModelConfig, n_layers: int, width: int = PROXY_WIDTH) -> dict[str, Any]:
    """Model options for the proxy grid: `n_layers` at width 64 (`width`: the verify stage's wider ones) in
    heads of 16, the user's FFN and GQA ratios, MLP kind, tied embeddings, soft-capping and biases; bytes as
    the vocabulary."""
    options = _scaled(user, width, PROXY_HEAD_DIM)
    options.update(n_layers=n_layers, vocab_size=256, max_seq_len=PROXY_SEQ_LEN)
    return options
