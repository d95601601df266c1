"""`--init-from`: start a run from trained weights (fine-tuning, continued pre-training).

Sources: a normlab run directory (its newest checkpoint), a checkpoint file, or a transformers
folder (the normlab class, or a Llama / OLMo 2 checkpoint that maps exactly; needs transformers).
Only the weights are taken: the optimizer, schedule and step start fresh. The model being trained
is built from this run's --layout/--size/--model, and the weights must fit it exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from normlab.errors import ConfigError
from normlab.runs.checkpoint import load_model_state, newest_checkpoint
from normlab.runs.files import RunDir


def init_state(source: str | Path) -> dict[str, torch.Tensor]:
    src = Path(source)
    folder = RunDir(src)
    if folder.config_file.is_file() and not folder.has_checkpoints():  # a transformers folder, not a run
        # a foreign folder (custom code: never run, an unknown type, bad JSON or weights) fails in the loaders
        # with one line (`normlab.hf.folder`)
        from normlab.hf.folder import read_config

        if read_config(folder.config_file).get("model_type") == "normlab":
            from normlab.hf import from_hf

            return from_hf(src).state_dict()
        from normlab.hf import from_native

        return from_native(src).state_dict()
    ckpt = newest_checkpoint(src)
    if ckpt is None or not ckpt.exists():
        raise ConfigError(
            f"init_from {source}: no checkpoint there; give a run directory, a checkpoint file "
            "or a transformers model folder"
        )
    return load_model_state(ckpt)


def load_init_weights(model: nn.Module, source: str | Path) -> None:
    state = init_state(source)
    ours = model.state_dict()
    missing, extra = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    shapes = [k for k in set(ours) & set(state) if ours[k].shape != state[k].shape]
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
            f"init_from {source}: its weights do not fit the model built from this run's layout, "
            f"size and model options ({detail}); use the same --layout/--size/--model as the source"
        )
    model.load_state_dict(state)
