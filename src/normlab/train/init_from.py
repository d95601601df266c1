"""`--init-from`: start a run from trained weights (fine-tuning, continued pre-training).

Sources: a normlab run directory (its newest checkpoint), a checkpoint file, or a transformers
folder (the normlab class, or a checkpoint of a registered architecture that maps exactly:
`normlab.hf.archs`; needs transformers). Only the weights are taken: the optimizer, schedule and step
start fresh.

A transformers folder states the function its weights compute: its layout and every model option that
shapes that function (`FUNCTION_OPTIONS`: the norms' epsilon, the RoPE base of each layer type, tied
embeddings, soft-caps, head width, windows, vocabulary, ...). `normlab train` takes them all into the
run's configuration (`folder_settings`: recorded in its config.json, so a resume and an export compute
the same function), or refuses in one line, before anything is written, the first that a flag asks
otherwise. RoPE's table length is the one exception: transformers computes default RoPE at every
position whatever ``max_position_embeddings`` says, so a longer ``--seq-len`` (or ``model.max_seq_len``)
is the run's own. A run given its settings some other way (a TrainConfig, a sweep) is checked the same
way when the weights are loaded (`InitWeights.load_into`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from normlab.errors import ConfigError
from normlab.layout import parse_layout
from normlab.model.config import ModelConfig, get_size
from normlab.model.lm import NormLM
from normlab.runs.checkpoint import load_model_state, newest_checkpoint
from normlab.runs.files import RunDir

if TYPE_CHECKING:
    from normlab.config.train import TrainConfig
    from normlab.hf.native import StatedModel

# Model options that say how a model is trained, not what function its weights compute: a flag may set them.
TRAINING_OPTIONS = ("init", "init_std", "dyt_alpha", "norm_compute", "moe_aux_coef", "moe_z_coef", "moe_dispatch")
MOE_OPTIONS = ("moe_top_k", "expert_d_ff", "moe_shared_expert")  # stated by a mixture of experts only
FUNCTION_OPTIONS = tuple(f.name for f in fields(ModelConfig) if f.name not in TRAINING_OPTIONS)
SIZE_SHAPE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff")  # what --size asks for


def is_transformers_folder(source: str | Path) -> bool:
    """A folder with a config.json and no normlab checkpoints: a transformers model (or the normlab class)."""
    folder = RunDir(Path(source))
    return folder.config_file.is_file() and not folder.has_checkpoints()


def stated_options(config: ModelConfig) -> dict[str, Any]:
    """The options of ``config`` that shape its function (`FUNCTION_OPTIONS`; a dense model's MoE options aside)."""
    skip = () if config.n_experts else MOE_OPTIONS
    names = sorted((n for n in FUNCTION_OPTIONS if n not in skip), key=lambda n: n == "rope_local_theta")
    return {name: getattr(config, name) for name in names}  # the local base after the base it defaults to


def _computed(config: ModelConfig, name: str) -> Any:
    """An option as the model computes with it (n_kv_heads none: n_heads, d_head none: d_model / n_heads, ...)."""
    if name == "n_kv_heads":
        return config.kv_heads
    if name == "d_head":
        return config.head_dim
    if name == "d_ff":
        return config.ffn_dim
    if name == "rope_local_theta":  # the windowed layers' base (none: no windowed layer)
        if config.sliding_window is None:
            return None
        return config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
    return getattr(config, name)


def _differs(stated: ModelConfig, name: str, value: Any) -> bool:
    """Whether ``value`` for option ``name`` computes something other than ``stated`` does."""
    try:
        ours = stated.with_(**{name: value})
    except ConfigError:
        return True
    return bool(_computed(ours, name) != _computed(stated, name))


def _text(value: Any) -> str:
    """A value as a flag spells it: floats short where that is exact (1e-06, 3000), else in full."""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def folder_settings(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """``cfg`` with the settings a transformers folder (``cfg.model.init_from``) states: its layout and
    `FUNCTION_OPTIONS` as model options; ``given``: the settings the user gave (`settings_keys`). A flag that
    asks for something else is refused with one line naming the setting, both values and what to do; a
    source that is not a transformers folder returns ``cfg`` unchanged. Reads the folder's config only."""
    source = cfg.model.init_from
    if not source or not is_transformers_folder(source):
        return cfg
    from normlab.hf.native import stated_model

    folder = stated_model(source)
    stated = folder.config
    rope = stated.position == "rope"
    _check_layout(cfg, given, folder, source)
    options = stated_options(stated)
    for name in options:
        if f"model.{name}" not in given:
            continue
        value = cfg.model.options[name]
        if name == "max_seq_len" and rope and value >= stated.max_seq_len:
            continue  # a longer RoPE table (see the module docstring)
        if _differs(stated, name, value):
            raise ConfigError(
                f"--init-from {source}: the folder's {folder.key(name)} is {_text(_computed(stated, name))}, "
                f"but model.{name}={_text(value)} was given; leave model.{name} out to train with the folder's "
                "value (a model computing another function would not be the folder's weights)"
            )
    if "size" in given:
        preset = get_size(cfg.model.size)
        for name in SIZE_SHAPE:
            if f"model.{name}" not in given and _computed(preset, name) != _computed(stated, name):
                raise ConfigError(
                    f"--init-from {source}: the folder's {folder.key(name)} is {_computed(stated, name)}, but "
                    f"--size {cfg.model.size} has {name}={_computed(preset, name)}; leave --size out to train "
                    "the folder's shape"
                )
    if rope:  # a table length: the longer of the folder's and the run's own
        explicit = cfg.model.options["max_seq_len"] if "model.max_seq_len" in given else None
        options["max_seq_len"] = explicit or max(stated.max_seq_len, cfg.data.seq_len)
    elif cfg.data.seq_len > stated.max_seq_len:  # learned positions: one weight row per position
        raise ConfigError(
            f"--init-from {source}: --seq-len {cfg.data.seq_len} is longer than the folder's "
            f"{folder.key('max_seq_len')} {stated.max_seq_len} (its learned positions); give --seq-len "
            f"{stated.max_seq_len} or less"
        )
    settings: dict[str, Any] = {f"model.{k}": v for k, v in options.items()}
    if "layout" not in given:
        settings["layout"] = folder.layout
    before = cfg.model.model_config()
    new = cfg.with_(settings, f"{source} (its config.json)")
    changed = [f"{k}={_text(v)}" for k, v in options.items() if getattr(before, k) != v]
    print(
        f"normlab train: --init-from {source}: the folder's settings ({folder.kind}, layout "
        f"{new.model.layout_label}{', ' if changed else ''}{', '.join(changed)})",
        flush=True,
    )
    return new


def _check_layout(cfg: TrainConfig, given: set[str], folder: StatedModel, source: str) -> None:
    """Refuse a --layout (or layout.* setting) that places the norms otherwise than the folder's class."""
    asked = [k for k in sorted(given) if k == "layout" or k.startswith("layout.")]
    want = parse_layout(folder.layout).to_string()
    if asked and cfg.model.layout.to_string() != want:
        flag = "--layout " + cfg.model.layout_label if "layout" in asked else ", ".join(asked)
        spelled = folder.layout if folder.layout == want else f"{folder.layout} ({want})"
        raise ConfigError(
            f"--init-from {source}: the folder's class ({folder.kind}) computes layout {spelled}, but {flag} asks "
            f"for {cfg.model.layout.to_string()}; leave the layout out to train the folder's (to move its weights "
            "to another layout, train them once, then `normlab convert`)"
        )


@dataclass
class InitWeights:
    """The weights a run starts from, read before its model is built (a file that could run code is refused
    first), with what a transformers folder states about them."""

    source: str
    state: dict[str, torch.Tensor]
    stated: ModelConfig | None = None  # a transformers folder's options (None: a normlab run or checkpoint)
    layout: str | None = None  # its layout, string form

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse data whose token ids a transformers folder's embedding does not have."""
        if self.stated is not None and vocab_size > self.stated.vocab_size:
            raise ConfigError(
                f"init_from {self.source}: its vocabulary has {self.stated.vocab_size} ids, the data's tokenizer "
                f"{vocab_size}; train with the folder's tokenizer (--tokenizer {self.source}) or data whose ids fit"
            )

    def load_into(self, model: NormLM) -> None:
        """Load the weights into ``model``; refused, naming the first difference, where a transformers folder
        states another function (its layout or an option) or the weights do not fit."""
        if self.stated is not None:
            ours = model.config
            if model.layout.to_string() != self.layout:
                raise ConfigError(
                    f"init_from {self.source}: the folder computes layout {self.layout}, this run's model "
                    f"{model.layout.to_string()}; give the folder's layout (`normlab train --init-from` takes it)"
                )
            for name, value in stated_options(self.stated).items():
                if name == "max_seq_len" and self.stated.position == "rope" and ours.max_seq_len >= value:
                    continue  # a longer RoPE table (see the module docstring)
                if _differs(self.stated, name, getattr(ours, name)):
                    raise ConfigError(
                        f"init_from {self.source}: the folder states {name}={_text(value)}, this run's model "
                        f"has {_text(getattr(ours, name))}; give model.{name}={_text(value)} "
                        "(`normlab train --init-from` takes every setting the folder states)"
                    )
        ours_state = model.state_dict()
        state = self.state
        missing, extra = sorted(set(ours_state) - set(state)), sorted(set(state) - set(ours_state))
        shapes = [k for k in set(ours_state) & set(state) if ours_state[k].shape != state[k].shape]
        if missing or extra or shapes:
            detail = "; ".join(
                x
                for x in (
                    f"missing {missing[:4]}" if missing else "",
                    f"unexpected {extra[:4]}" if extra else "",
                    f"shape differs for {sorted(shapes)[:4]}" if shapes else "",
                )
                if x
            )
            raise ConfigError(
                f"init_from {self.source}: its weights do not fit the model built from this run's layout, "
                f"size and model options ({detail}); use the same --layout/--size/--model as the source"
            )
        model.load_state_dict(state)


def read_init_weights(source: str | Path) -> InitWeights:
    """The weights at ``source`` (see the module docstring); a transformers folder's with what it states."""
    src = Path(source)
    if is_transformers_folder(src):
        # a foreign folder (custom code: never run, an unknown type, bad JSON or weights) fails in the loaders
        # with one line (`normlab.hf.folder`)
        from normlab.hf.folder import read_config

        if read_config(RunDir(src).config_file).get("model_type") == "normlab":
            from normlab.hf import from_hf

            model = from_hf(src)
        else:
            from normlab.hf import from_native

            model = from_native(src)
        return InitWeights(str(source), model.state_dict(), model.config, model.layout.to_string())
    ckpt = newest_checkpoint(src)
    if ckpt is None or not ckpt.exists():
        raise ConfigError(
            f"init_from {source}: no checkpoint there; give a run directory, a checkpoint file "
            "or a transformers model folder"
        )
    return InitWeights(str(source), load_model_state(ckpt))


def load_init_weights(model: NormLM, source: str | Path) -> None:
    """Load the weights at ``source`` into ``model`` (`InitWeights.load_into`'s checks)."""
    read_init_weights(source).load_into(model)
