"""What a run does with a loss or gradient-norm spike: skip or count it, rerun it, attribute it, keep its batch.

A finite step is checked against OLMo-core's skip rule (`normlab.train.divergence.SkipRule`). A spike is then:

1. **rerun** on the pre-step weights (the optimizer has not stepped yet): the step's micro-batches again,
   forward and backward, with the RNG state the step started with (the batch is a function of (seed,
   step), so keeping the RNG state is all the pre-step state a rerun needs). The loss and gradient norm are
   compared with the first pass within `REPRODUCE_RTOL` (on CPU they are bitwise equal);
2. **attributed**, as Megatron's rerun state machine separates a fault from a real spike:
   - not reproduced: ``hardware`` (a transient fault or non-deterministic kernels: the same weights and
     batch gave another answer);
   - reproduced, and the previous step's batch on the same weights is within the rule: ``data`` (this batch
     makes the spike);
   - reproduced, and the previous batch spikes too on these weights: ``dynamics`` (the weights do);
3. **saved**: the step's whole batch (every rank's share: the batch is recomputed from (seed, step)) in
   ``spikes/step_N.pt``, and a row in ``spikes.jsonl``;
4. **probed**: the full probe pass on the step's batch (sites prefixed ``spike:``), as for a spike of the
   per-step tier (`normlab.diagnostics.tier`);
5. with ``on_spike=skip``, **not applied** (counted in ``spike_skipped_steps``, bounded by max_skipped).

Two extra forward/backward passes per spike: spikes are rare, and a skipped run is bounded.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import torch

from normlab.io import atomic_write_bytes
from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric
from normlab.train.divergence import DivergenceMonitor

REPRODUCE_RTOL = 1e-5  # relative difference of loss and gradient norm under which a rerun reproduces the step


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= REPRODUCE_RTOL * max(abs(a), abs(b))


class SpikeHandler:
    """The policy, rerun and records of spikes for one run (module docstring)."""

    def __init__(self, monitor: DivergenceMonitor, policy: str, run: RunDir | None) -> None:
        self.monitor, self.policy, self.run = monitor, policy, run  # run: None on ranks that do not write
        self._rng: dict[str, Any] | None = None

    def start(self, device: torch.device) -> None:
        """At a step's start: the RNG state its rerun restores."""
        self._rng = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            self._rng["cuda"] = torch.cuda.get_rng_state(device)

    def restore_rng(self, device: torch.device) -> None:
        if self._rng is not None:
            torch.set_rng_state(self._rng["cpu"])
            if "cuda" in self._rng:
                torch.cuda.set_rng_state(self._rng["cuda"], device)

    def check(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        replay: Callable[[int, bool], tuple[float, float]],
        batch: Callable[[int], dict[str, torch.Tensor]],
    ) -> dict[str, Any] | None:
        """A finite step: None if it did not spike; else the spike's record (rerun, verdict, action), its batch
        saved. ``replay(step, same_rng)`` reruns a step's forward/backward on the current weights and returns
        its (loss, gradient norm); ``batch(step)`` is the step's whole batch."""
        rule = self.monitor.skip_rule
        windows = [list(rule.losses), list(rule.grad_norms)]  # before this step's values enter them
        spike = self.monitor.check_spike(step, loss, grad_norm, skip=self.policy == "skip")
        if spike is None:
            return None
        again = replay(step, True)
        reproduced = _close(again[0], loss) and _close(again[1], grad_norm)
        record: dict[str, Any] = {
            "step": step,
            "kinds": spike["kinds"],
            Metric.LOSS.value: loss,
            Metric.GRAD_NORM.value: grad_norm,
            "z_loss": spike["z_loss"],
            "z_grad_norm": spike["z_grad_norm"],
            "action": "skipped" if self.policy == "skip" else "applied",
            "rerun": {Metric.LOSS.value: again[0], Metric.GRAD_NORM.value: again[1], "reproduced": reproduced},
        }
        if not reproduced:
            record["verdict"] = "hardware"
            record["why"] = (
                "the rerun on the same weights and batch differs: a transient fault or non-deterministic "
                "kernels, not the data or the dynamics"
            )
        elif step > 0:
            before = replay(step - 1, False)
            beyond = []
            for kind, value, window in (
                (Metric.LOSS, before[0], windows[0]),
                (Metric.GRAD_NORM, before[1], windows[1]),
            ):
                if kind in spike["kinds"] and len(window) >= 2:  # the skip rule on the windows the step met
                    beyond.append(rule.rule.spikes(value, window, min_history=2))
            record["previous_batch"] = {
                Metric.LOSS.value: before[0],
                Metric.GRAD_NORM.value: before[1],
                "spikes": any(beyond),
            }
            record["verdict"] = "dynamics" if any(beyond) else "data"
            record["why"] = (
                "the previous step's batch spikes too on these weights: the weights make it"
                if any(beyond)
                else "reproduced, and the previous step's batch on the same weights does not spike: this batch makes it"
            )
        else:
            record["verdict"] = "data"
            record["why"] = "reproduced at the first step (no earlier batch to compare)"
        tensors = batch(step)
        if self.run is not None:
            path = self.run.spike_batch_file(step)
            path.parent.mkdir(exist_ok=True)
            buf = io.BytesIO()
            torch.save({"step": step, "record": record, "batch": {k: v.cpu() for k, v in tensors.items()}}, buf)
            atomic_write_bytes(path, buf.getvalue())
            record["batch_file"] = str(path.relative_to(self.run.path))
            with self.run.spikes_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record
