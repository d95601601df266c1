"""The step-hook protocol: what a feature of a training loop sees of each optimizer step, and what it keeps
for resume.

A loop that drives hooks calls, for each optimizer step ``step``:

1. ``pre_step(step)``: before the step's forward (a probe pass on the weights as they are, maxima reset,
   the step's RNG state kept);
2. ``post_backward(step)``: after the backward (and an fp16 scaler's unscale), before the gradient clip
   (gradient norms as the backward left them, the weights before the update);
3. ``admit(step, loss, grad_norm, scaled)``: on every step, finite or not, before the update: a hook that
   returns False keeps the update from being applied (the divergence hook: a non-finite value skipped, or
   stopping the run; fp16's overflow with ``scaled``). Every hook is asked;
4. ``veto(step, loss, grad_norm)``: on a step every hook admitted, before the update: a hook may return a
   record (a loss spike); one whose ``action`` is ``"skipped"`` keeps the update from being applied. The
   first hook that returns a record decides; later ones are not asked. `StepHooks.before_update` asks both
   (the loop's one call, `Update`);
5. ``post_step(step, applied)``: after the optimizer step (``applied``: whether the update was applied);
6. ``row_metrics(step, applied, row)``: the step's metrics row as the loop wrote it; a hook returns keys to add
   (the divergence hook's spike flags);
7. ``stop_request()``: before the first step and after each step's ``row_metrics``: a `Stop` ends the run after
   the current step (the divergence hook: the run diverged; ``failed`` then: no last checkpoint, the break
   located, the summary's status "diverged");
8. ``row_done(row)``: the step's finished row (the hooks' keys added, the validation loss on an evaluating
   step), on every rank (the loggers' hook, built on the main rank only, writes it);
9. ``checkpoint_due(step, finishing)``: after ``row_done`` (``step``: the steps done): True asks the loop
   to save a checkpoint now (the checkpoint schedule); ``finishing``: the run completed its last step and no
   hook stopped it as failed. Around every save, ``pre_checkpoint(step)`` and ``post_checkpoint(step)``.

``post_train(step)`` runs once after the last step, ``summary()`` adds keys to the run's summary and
``close()`` runs always, also after an error. A hook with a ``state_key`` is saved in each checkpoint under
that key (``state_dict()``) and restored from it (``load_state_dict``): the key is the checkpoint's, so a
checkpoint written before the hook existed resumes unchanged.

Order: hooks run by ``priority`` (higher first) before the update (``pre_step``, ``post_backward``, ``admit``,
``veto``) and in the reverse order after it (``post_step``), so the first hook's events bracket the others' (the
probe pass reads the weights before any other hook has touched the step, and its update rows see every
other hook's change to the weights).

The events and the state protocol follow OLMo-core's trainer callbacks (``pre_step``, ``pre_optim_step``,
``post_step``, ``post_train``, ``close``, ``state_dict``/``load_state_dict``, ``pre_checkpoint``/``post_checkpoint``:
https://github.com/allenai/OLMo-core, ``src/olmo_core/train/callbacks/callback.py``); the admission, the veto, the
stop and checkpoint requests and the before-the-clip event are normlab's (its divergence and spike rules decide
before the update, and its loop asks its hooks, not a component, whether to stop and whether to save).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Stop:
    """A hook's request to end the run after the current step: at ``step``, for ``reason``; ``failed`` (the run
    diverged): no last checkpoint is saved, the loop locates where it broke (`normlab.diagnostics.forensics`) and
    the summary says diverged at ``step`` for ``reason``; otherwise the last checkpoint is saved and the reason
    noted in the run's log."""

    step: int
    reason: str
    failed: bool = False


@dataclass(frozen=True)
class Update:
    """What the hooks decided about a step before its update (`StepHooks.before_update`): ``admitted`` (every hook
    admitted it: its values are finite, or its policy lets them through) and the veto's ``record`` (a spike) or None."""

    admitted: bool
    record: dict[str, Any] | None = None

    @property
    def vetoed(self) -> bool:
        """The record's action is "skipped": the spike policy kept the update from being applied."""
        return self.record is not None and self.record["action"] == "skipped"

    @property
    def applied(self) -> bool:
        return self.admitted and not self.vetoed


class StepHook:
    """A feature of the training loop: every event does nothing unless overridden (module docstring)."""

    priority: ClassVar[int] = 0  # higher runs earlier before the update, later after it
    state_key: ClassVar[str | None] = None  # the checkpoint's key for this hook's state; None: no state

    def pre_step(self, step: int) -> None:
        """Before the step's forward."""

    def post_backward(self, step: int) -> None:
        """After the backward, before the gradient clip and the update."""

    def admit(self, step: int, loss: float, grad_norm: float, scaled: bool) -> bool:
        """On every step before the update: False keeps it from being applied (``scaled``: fp16's loss scaler)."""
        return True

    def veto(self, step: int, loss: float, grad_norm: float) -> dict[str, Any] | None:
        """On an admitted step before the update: a record (``action`` "skipped" vetoes the update) or None."""
        return None

    def post_step(self, step: int, applied: bool) -> None:
        """After the optimizer step; ``applied``: whether the update was applied."""

    def row_metrics(self, step: int, applied: bool, row: Mapping[str, Any]) -> dict[str, Any]:
        """Keys this hook adds to the step's metrics row (``row``: the loop's keys)."""
        return {}

    def row_done(self, row: Mapping[str, Any]) -> None:
        """The step's finished metrics row (the hooks' keys and, on an evaluating step, the validation loss), on
        every rank: the loggers' hook (main rank only) writes it here."""

    def stop_request(self) -> Stop | None:
        """A `Stop` to end the run after the current step, or None to go on."""
        return None

    def checkpoint_due(self, step: int, finishing: bool) -> bool:
        """After ``step`` steps: whether the loop saves a checkpoint now (``finishing``: the run's last step)."""
        return False

    def pre_checkpoint(self, step: int) -> None:
        """Before a checkpoint of ``step`` steps is written (every rank)."""

    def post_checkpoint(self, step: int) -> None:
        """After a checkpoint of ``step`` steps was written (every rank)."""

    def post_train(self, step: int) -> None:
        """After the last step (``step``: the step the run stopped at)."""

    def summary(self) -> dict[str, Any]:
        """Keys this hook adds to the run's summary."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (saved under ``state_key``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def close(self) -> None:
        """Release files and module hooks; called once, also after an error."""


class StepHooks:
    """The loop's hooks in their order, each event dispatched to all of them (module docstring)."""

    def __init__(self, hooks: Iterable[StepHook] = ()) -> None:
        self._hooks: list[StepHook] = []
        for hook in hooks:
            self.add(hook)

    def add(self, hook: StepHook) -> None:
        """Add ``hook`` after the hooks of its priority or higher."""
        self._hooks.append(hook)
        self._hooks.sort(key=lambda h: -h.priority)  # stable: equal priorities keep their order of addition

    def __iter__(self) -> Iterator[StepHook]:
        return iter(self._hooks)

    def find(self, kind: type[StepHook]) -> StepHook | None:
        """The first hook of type ``kind``, or None."""
        return next((h for h in self._hooks if isinstance(h, kind)), None)

    def pre_step(self, step: int) -> None:
        for hook in self._hooks:
            hook.pre_step(step)

    def post_backward(self, step: int) -> None:
        for hook in self._hooks:
            hook.post_backward(step)

    def veto(self, step: int, loss: float, grad_norm: float) -> dict[str, Any] | None:
        for hook in self._hooks:
            record = hook.veto(step, loss, grad_norm)
            if record is not None:
                return record
        return None

    def before_update(self, step: int, loss: float, grad_norm: float, scaled: bool) -> Update:
        """The step's admission by every hook (all are asked), then, where admitted, the veto."""
        admitted = all([hook.admit(step, loss, grad_norm, scaled) for hook in self._hooks])
        return Update(admitted, self.veto(step, loss, grad_norm) if admitted else None)

    def post_step(self, step: int, applied: bool) -> None:
        for hook in reversed(self._hooks):
            hook.post_step(step, applied)

    def row_metrics(self, step: int, applied: bool, row: Mapping[str, Any]) -> dict[str, Any]:
        """The keys every hook adds to the step's row, in the hooks' order."""
        out: dict[str, Any] = {}
        for hook in self._hooks:
            out.update(hook.row_metrics(step, applied, row))
        return out

    def row_done(self, row: Mapping[str, Any]) -> None:
        for hook in self._hooks:
            hook.row_done(row)

    def stop_request(self) -> Stop | None:
        """The first hook's request to stop, or None."""
        return next((stop for hook in self._hooks if (stop := hook.stop_request()) is not None), None)

    def checkpoint_due(self, step: int, finishing: bool) -> bool:
        """Whether any hook asks for a checkpoint now (every hook is asked)."""
        return any([hook.checkpoint_due(step, finishing) for hook in self._hooks])

    def pre_checkpoint(self, step: int) -> None:
        for hook in self._hooks:
            hook.pre_checkpoint(step)

    def post_checkpoint(self, step: int) -> None:
        for hook in self._hooks:
            hook.post_checkpoint(step)

    def post_train(self, step: int) -> None:
        for hook in self._hooks:
            hook.post_train(step)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for hook in self._hooks:
            out.update(hook.summary())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Each stateful hook's state under its key (the checkpoint's extra entries)."""
        return {h.state_key: h.state_dict() for h in self._hooks if h.state_key is not None}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Each stateful hook's state from ``checkpoint``'s entry under its key, where the checkpoint has one."""
        for hook in self._hooks:
            if hook.state_key is not None and hook.state_key in checkpoint:
                hook.load_state_dict(checkpoint[hook.state_key])

    def close(self) -> None:
        for hook in self._hooks:
            hook.close()
