"""The training loop's hooks by name, each built from its own settings section, and the handle through which a
hook reaches the run.

`HOOKS` is the registry: name -> (its settings class, its hook class). A run builds, in this order, the hooks
of ``probes`` (the probe pass), ``tier`` (the per-step tier), ``divergence`` (the divergence monitor's decisions
and the spike policy: `normlab.train.step_hooks.DivergenceHook`), ``warnings`` (the early warnings), ``faults``
(a fault injected on purpose), ``checkpointing`` (the schedule) and ``loggers`` (TensorBoard, W&B, the progress
bar), each from ``cfg.<name>`` (`normlab.config.hooks`); a hook class's ``build(settings, handle)`` returns the
hook, or None where its settings leave it off. Their order among themselves is their priority's
(`normlab.diagnostics.hooks`).

A hook reaches the run through a `normlab.train.handle.RunHandle`: the step, the model, the optimizer, the run
folder, the log, the other hooks, and the step's batches and their rerun; no hook is handed a closure over the
trainer's state.

A user's hook is a `normlab.diagnostics.hooks.StepHook`: `train(cfg, hooks=[...])` takes instances, `normlab
train --hook module:Class` imports the user's module (their code, named by them) and builds the class from the
[hook] table of --config (`user_hook`). A hook with a ``bind(handle)`` method is given the handle before the
first step.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from normlab.config.hooks import (
    CheckpointSettings,
    DivergenceSettings,
    FaultSettings,
    LoggerSettings,
    ProbeSettings,
    QKSpectrumSettings,
    TierSettings,
    WarningSettings,
)
from normlab.diagnostics.early_warning import Alert, EarlyWarningHook, print_alert, replayed
from normlab.diagnostics.hooks import StepHook
from normlab.diagnostics.precursors import QK_SPECTRUM, merge
from normlab.diagnostics.qk_spectrum import QKSpectrum, QKSpectrumHook
from normlab.errors import ConfigError
from normlab.io import truncate_jsonl
from normlab.runs.metrics import Metric
from normlab.train import faults
from normlab.train.ckpt_schedule import SAVE_SHARE, CheckpointSchedule
from normlab.train.handle import RunHandle
from normlab.train.loggers import Sinks
from normlab.train.step_hooks import DivergenceHook, ProbeHook, TierHook


class WarningsHook(EarlyWarningHook):
    """The early warnings (`normlab.diagnostics.early_warning`), each alert on stderr (above the progress bar),
    in warnings.jsonl and as a logger event; a resumed run's detectors fed again from its own rows."""

    def __init__(self, handle: RunHandle, path: Path, before: Any) -> None:
        self.handle, self.path = handle, path
        super().__init__(handle.cfg.stored_dtype, self.tier_row, self.alert, before)

    @classmethod
    def build(cls, settings: WarningSettings, handle: RunHandle) -> StepHook | None:
        if not settings.early_warnings or handle.run is None:
            return None
        run, step = handle.run, handle.step
        # a resumed run: its alerts before the start kept (later ones cut, as the metrics are), its detectors as
        # they stood, fed again from its own rows (metrics.jsonl and layers.jsonl are cut back to the start already)
        truncate_jsonl(run.warnings_file, step)
        before = replayed(run.path, handle.cfg.stored_dtype, until=step) if step else None
        return cls(handle, run.warnings_file, before)

    def tier_row(self) -> dict[str, Any] | None:
        """The latest step's rows of the tier and the QK-spectrum probe, merged (`precursors.merge`)."""
        tier, qk = self.handle.find(TierHook), self.handle.find(QKSpectrumHook)
        tier_row = tier.last if isinstance(tier, TierHook) else None
        qk_row = qk.last if isinstance(qk, QKSpectrumHook) else None
        steps = [row[Metric.STEP] for row in (tier_row, qk_row) if row]
        return merge(tier_row, qk_row, max(steps)) if steps else None

    def alert(self, alert: Alert) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(alert.to_dict()) + "\n")
        sinks = self.handle.sinks
        if sinks is not None:
            sinks.alert(alert.step, alert.signal, alert.line())
        else:
            print_alert(alert)


class QKSpectrumProbe(QKSpectrumHook):
    """The QK spectral entropy probe (`normlab.diagnostics.qk_spectrum`) every ``qk_spectrum_every`` steps, its
    rows in qk_spectrum.jsonl on the main rank (a resumed run's rows past its start cut: they are replayed)."""

    @classmethod
    def build(cls, settings: QKSpectrumSettings, handle: RunHandle) -> StepHook | None:
        if not settings.qk_spectrum_every:
            return None
        log = None
        if handle.run is not None:
            truncate_jsonl(handle.run.path / QK_SPECTRUM, handle.step)
            log = handle.run.path.joinpath(QK_SPECTRUM).open("a", buffering=1)
        return cls(QKSpectrum(handle.model), log, settings.qk_spectrum_every)


class FaultHook(faults.LogitGrowthHook):
    """The logit_growth fault, built from the faults section (the other faults act on the step's learning rate
    and batch: `normlab.train.faults.lr_factor`, `corrupt`)."""

    @classmethod
    def build(cls, settings: FaultSettings, handle: RunHandle) -> StepHook | None:
        if settings.fault != "logit_growth":
            return None
        return cls(handle.model, settings.fault_step, settings.fault_scale)


class CheckpointHook(StepHook):
    """The checkpoint schedule (`normlab.train.ckpt_schedule`): asks the loop for a save at the schedule's steps and
    at the run's last one (every rank saves); each save timed on the schedule's clock, the interval stretched where
    a save is slow (with ckpt_every 0) and the new interval noted in the loggers."""

    def __init__(self, schedule: CheckpointSchedule, handle: RunHandle | None = None) -> None:
        self.schedule, self.handle = schedule, handle
        self._t0: float | None = None

    @classmethod
    def build(cls, settings: CheckpointSettings, handle: RunHandle) -> StepHook | None:
        cfg = handle.cfg
        every, adaptive = cfg.checkpoint_every, settings.ckpt_every == 0
        return cls(CheckpointSchedule(every, adaptive, cfg.optim.steps, handle.info, handle.step), handle)

    def checkpoint_due(self, step: int, finishing: bool) -> bool:
        return self.schedule.due(step) or finishing

    def pre_checkpoint(self, step: int) -> None:
        self._t0 = self.schedule.now()

    def post_checkpoint(self, step: int) -> None:
        """The schedule learns what the save cost (`CheckpointSchedule.saved`: collective under torchrun)."""
        if self._t0 is None:
            return
        grew = self.schedule.saved(step, self.schedule.now() - self._t0)
        self._t0 = None
        sinks = self.handle.sinks if self.handle is not None else None
        if grew is not None and sinks is not None:
            every, save_s = grew
            sinks.note(
                f"checkpoints: a save took {save_s:.1f} s; every {every} steps from step {step} on "
                f"(saving at most {SAVE_SHARE:.0%} of the time; --ckpt-every N fixes it)"
            )


class LoggerHook(StepHook):
    """The loggers (`normlab.train.loggers.Sinks`: the progress bar, TensorBoard, W&B) on the main rank."""

    def __init__(self, sinks: Sinks) -> None:
        self.sinks = sinks

    @classmethod
    def build(cls, settings: LoggerSettings, handle: RunHandle) -> StepHook | None:
        if handle.run is None:
            return None
        return cls(Sinks(handle.cfg, handle.run, handle.step))

    def row_done(self, row: Mapping[str, Any]) -> None:
        self.sinks.log(dict(row))

    def close(self) -> None:
        self.sinks.close()


# name -> (its settings section's class, its hook class); built in this order (`build_hooks`)
HOOKS: dict[str, tuple[type, Any]] = {
    "probes": (ProbeSettings, ProbeHook),
    "tier": (TierSettings, TierHook),
    "divergence": (DivergenceSettings, DivergenceHook),
    "qk_spectrum": (QKSpectrumSettings, QKSpectrumProbe),
    "warnings": (WarningSettings, WarningsHook),
    "faults": (FaultSettings, FaultHook),
    "checkpointing": (CheckpointSettings, CheckpointHook),
    "loggers": (LoggerSettings, LoggerHook),
}


def build_hooks(cfg: Any, handle: RunHandle) -> dict[str, StepHook]:
    """Each registered hook built from its own section of ``cfg`` (those its settings leave off are absent)."""
    built: dict[str, StepHook] = {}
    for name, (settings_class, _) in HOOKS.items():
        settings = getattr(cfg, name)
        assert isinstance(settings, settings_class)
        hook = HOOKS[name][1].build(settings, handle)
        if hook is not None:
            built[name] = hook
    return built


def user_hook(spec: str, settings: Mapping[str, Any] | None = None) -> StepHook:
    """``module:Class`` (a module the user wrote, importable from here or the working directory) built as a hook:
    with ``Class.Settings(**settings)`` where the class declares a ``Settings`` dataclass (the [hook] table of
    --config), else with no arguments. One-line ConfigError where it cannot be."""
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        raise ConfigError(f"--hook takes module:Class (a StepHook subclass in a module you wrote), got {spec!r}")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--hook {spec}: cannot import it ({type(err).__name__}: {err})") from None
    if not (isinstance(cls, type) and issubclass(cls, StepHook)):
        raise ConfigError(f"--hook {spec}: not a StepHook subclass (normlab.diagnostics.hooks.StepHook)")
    declared = getattr(cls, "Settings", None)
    given = dict(settings or {})
    if declared is None:
        if given:
            raise ConfigError(f"--hook {spec}: the [hook] table gives {sorted(given)}, and {name} takes no Settings")
        return cls()
    if not dataclasses.is_dataclass(declared):
        raise ConfigError(f"--hook {spec}: {name}.Settings must be a dataclass")
    try:
        return cls(declared(**given))  # type: ignore[call-arg,operator]  # the user's class and its Settings
    except TypeError as err:
        valid = ", ".join(f.name for f in dataclasses.fields(declared))
        raise ConfigError(f"--hook {spec}: [hook] table: {err}; valid: {valid}") from None
