"""`RunHandle`: what a step hook sees of a training run (`normlab.train.hook_registry`): the step, the model, the
optimizer, the run folder, the log, the other hooks, and the step's batches and their rerun. Hooks hold the
handle, never a closure over the trainer's state; the trainer hands it its step functions (`StepActions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from normlab.diagnostics.hooks import StepHook
from normlab.model.lm import NormLM
from normlab.runs.files import RunDir
from normlab.train import distributed
from normlab.train.loggers import Sinks

if TYPE_CHECKING:
    from normlab.train.run_state import RunState


@dataclass(frozen=True)
class StepActions:
    """The trainer's functions a handle calls with the run's state: a step's rerun, its whole batch, its
    micro-batches (`normlab.train.trainer.replay`, `global_batch`, `micro_batches`)."""

    replay: Callable[..., tuple[float, float]]
    global_batch: Callable[..., dict[str, torch.Tensor]]
    micro_batches: Callable[..., list[tuple[torch.Tensor, torch.Tensor]]]


class RunHandle:
    """What a hook sees of the run: read-only views of the trainer's state and the few actions hooks need."""

    def __init__(self, state: RunState, steps: StepActions) -> None:
        self._state, self._steps = state, steps

    @property
    def step(self) -> int:
        """The next step to run (the one in progress inside a step's events)."""
        return self._state.step

    @property
    def cfg(self) -> Any:
        return self._state.cfg

    @property
    def model(self) -> NormLM:
        """The model, unwrapped from DDP/FSDP."""
        return distributed.unwrap(self._state.model)

    @property
    def optimizer(self) -> Any:
        return self._state.opt

    @property
    def data(self) -> Any:
        """The run's data (its validation windows: `val_windows`)."""
        return self._state.data

    @property
    def device(self) -> torch.device:
        return self._state.info.device

    @property
    def info(self) -> distributed.DistInfo:
        """The rank, the world size and the device (`normlab.train.distributed`)."""
        return self._state.info

    @property
    def is_main(self) -> bool:
        return self._state.info.is_main

    @property
    def run(self) -> RunDir | None:
        """The run folder, on the rank that writes it (None on the others)."""
        return RunDir(self._state.run) if self._state.info.is_main else None

    @property
    def monitor(self) -> Any:
        """The divergence monitor (`normlab.train.divergence.DivergenceMonitor`): the run's record of its health,
        saved under "monitor"; the divergence hook (`normlab.train.step_hooks.DivergenceHook`) makes its decisions."""
        return self._state.monitor

    @property
    def sinks(self) -> Sinks | None:
        return self._state.sinks

    def log(self, text: str) -> None:
        """A line for the user: above the progress bar and in the loggers where they are open, else printed."""
        if self._state.sinks is not None:
            self._state.sinks.note(text)
        else:
            print(text, flush=True)

    def find(self, kind: type[StepHook]) -> StepHook | None:
        """The run's first hook of type ``kind``, or None."""
        return self._state.hooks.find(kind)

    def rerun(self, step: int, restore_rng: Callable[[], None] | None = None) -> tuple[float, float]:
        """Step ``step``'s forward and backward again on the weights as they are (its gradients kept aside and
        put back): its (loss, gradient norm); ``restore_rng()`` first, where given (the step's own RNG state)."""
        return self._steps.replay(self._state, step, restore_rng)

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The whole batch of ``step`` (every rank's share), recomputed from (seed, step)."""
        return self._steps.global_batch(self._state, step)

    def first_micro_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's first micro-batch of ``step``, on the device."""
        return self._steps.micro_batches(self._state, step)[0]
