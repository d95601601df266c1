"""The run directory's guard rails: what `--out` may be, and what a restarted run continues from.

Nothing already written is lost:
- `--out` must be a missing or empty directory, or a normlab run directory (its config.json says so);
  a file, or a folder holding anything else (an export, a dataset, `.`), is refused before anything
  is written; so is a folder on read-only storage (a finished run on a read-only mount), in one line.
- A run directory whose identity settings differ from this run's is refused, naming the settings.
- A finished run (summary.json ok/diverged for the same settings) is not trained again: its summary
  is returned as it is.
- A run that was killed continues from its newest checkpoint that loads (a corrupt newer one is
  skipped with a warning); one killed before its first checkpoint restarts cleanly from step 0.
- One process at a time: an exclusive lock (`.lock`; `normlab.runs.lock`: flock on a local disk, an
  O_EXCL lock file on a shared filesystem) held while training, so a run can never execute twice at
  once (a sweep restarted while a killed coordinator's worker still runs, two shells, a duplicate job).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.config.train import TrainConfig
from normlab.errors import ConfigError
from normlab.io import check_writable
from normlab.runs.checkpoint import TEMP_FILE, load_latest_checkpoint
from normlab.runs.files import LOCK, RunDir
from normlab.runs.lock import FolderLock, RunLock  # noqa: F401 - the run's guard rails, in one import

OWN_FILES = (LOCK,)  # what a run writes before its config.json (a run killed that early left only this)


def default_out(*parts: str) -> str:
    """An output folder named after what the command makes (train: runs/LAYOUT-SIZE; convert:
    runs/SOURCE-LAYOUT), for a command given no --out: every command that writes has a default, printed."""
    return "runs/" + "-".join(re.sub(r"[^A-Za-z0-9._+-]+", "_", p).strip("_") or "run" for p in parts)


def check_out(run: Path) -> None:
    """Refuse an --out that is a file, a non-empty folder that is not a normlab run, or one that cannot be
    written (read-only storage: `normlab.io.check_writable`)."""
    if run.exists() and not run.is_dir():
        raise ConfigError(f"--out {run} is a file; give a directory for the run (it is created if missing)")
    held = (
        sorted(p.name for p in run.iterdir() if p.name not in OWN_FILES and not TEMP_FILE.fullmatch(p.name))
        if run.is_dir()
        else []
    )
    if held and not RunDir(run).is_run():
        raise ConfigError(
            f"--out {run} is a folder that is not a normlab run (it holds {', '.join(held[:5])}"
            f"{', ...' if len(held) > 5 else ''}); nothing there is overwritten: "
            "choose a new or empty directory"
        )
    check_writable(run, "--out")  # a finished run on a read-only mount: one line, before the lock is taken


@dataclass
class Start:
    """Where a run starts: from scratch, from a checkpoint, or not at all (already finished)."""

    step: int = 0
    path: Path | None = None  # the checkpoint file
    checkpoint: dict[str, Any] | None = None
    finished: dict[str, Any] | None = None  # the summary of a run that already ended
    note: str | None = None  # what happened, for the user (a restart, a skipped checkpoint)


def plan_start(cfg: TrainConfig, warn=print) -> Start:  # noqa: ANN001 - warn: print-like
    """Decide how the run in `cfg.run.out` starts (see the module docstring); raises ConfigError to refuse.
    Called after `check_out` and under the run's lock (as `train` does)."""
    run, rd = Path(cfg.run.out), RunDir(cfg.run.out)
    if not rd.is_run():
        return Start()
    saved = rd.train_config()
    if saved is None:
        raise ConfigError(f"{rd.config_file} is not readable by this normlab; choose another --out")
    diff = saved.identity_diff(cfg)
    if diff:
        was, now = saved.identity(), cfg.identity()
        changes = ", ".join(f"{k}: {was[k]!r} -> {now[k]!r}" for k in diff[:6])
        raise ConfigError(
            f"{run} holds a run with different settings ({changes}); "
            "resume with the same settings or choose another --out"
        )
    was_layout, now_layout = (rd.record() or {}).get("layout"), cfg.model.layout.to_string()
    if was_layout is not None and was_layout != now_layout:  # a preset's definition changed under its name
        raise ConfigError(
            f"{run} was trained with layout {cfg.model.layout_label!r} = {was_layout!r}; this normlab "
            f"defines it as {now_layout!r}. Choose another --out to train the new definition, or "
            f"give --layout {was_layout!r} to resume the old one"
        )
    if not cfg.run.resume:
        raise ConfigError(
            f"{run} already holds a run and --no-resume was given; choose another --out (nothing there is overwritten)"
        )
    summary = rd.read_summary()
    if summary is not None and (summary.status == "diverged" or (summary.trained and summary.steps == cfg.optim.steps)):
        return Start(finished=summary.to_json(), note=f"{run} already finished ({summary.status}); nothing to do")
    found = load_latest_checkpoint(run, warn=lambda m: warn(f"normlab: warning: {m}"))
    if found is None:
        return Start(note=f"{run}: no checkpoint to resume from; restarting from step 0")
    path, ckpt = found
    return Start(step=int(ckpt["step"]), path=path, checkpoint=ckpt, note=f"{run}: resuming from {path.name}")


def recorded_shape(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """--init-from a run or a converted folder: the source's recorded size, model options and layout (its
    config.json) where the command gave none of them, so its weights fit the model built here."""
    assert cfg.model.init_from is not None  # called for --init-from only
    source = Path(cfg.model.init_from)
    folder = source.parent.parent if source.is_file() else source  # a checkpoint file: its run folder
    recorded = RunDir(folder).train_config() if RunDir(folder).config_file.is_file() else None
    if recorded is None:
        return cfg  # a transformers folder: its shape is read with its weights, or the mismatch is named
    shape: dict[str, Any] = {} if "size" in given else {"size": recorded.model.size}
    if not any(k.startswith("model.") for k in given):
        shape.update({f"model.{k}": v for k, v in recorded.model.options.items()})
    if "layout" not in given and not any(k.startswith("layout.") for k in given):
        shape["layout"] = recorded.model.layout_label
    if not shape:
        return cfg
    print(
        f"normlab train: --init-from {source}: its recorded shape ({', '.join(f'{k}={v}' for k, v in shape.items())})",
        flush=True,
    )
    return cfg.with_(shape, f"{source} (recorded shape)")
