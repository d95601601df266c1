"""The training loop's optional features as step hooks (`normlab.diagnostics.hooks`): the probe pass
(probes.jsonl), the per-step tier (layers.jsonl), QK-clip and the divergence section's hook (the divergence
monitor's decisions and the spike policy; built by name: `normlab.train.hook_registry`).

Their priorities put the probe pass first before the update and last after it (its rows read the weights
before any other hook has touched the step, and its update rows include QK-clip's rescale), the tier next
(its update RMS includes the rescale too), then QK-clip (its maxima reset after the probe pass's forward, so
only the step's own micro-batches count), then the divergence hook (its RNG state kept last, just before the
forward).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

import torch

from normlab.diagnostics.hooks import StepHook, Stop
from normlab.diagnostics.probe_store import ProbeRow, ProbeWriter
from normlab.diagnostics.probes import Probes
from normlab.diagnostics.tier import StepTier, TierSpikes
from normlab.runs.metrics import Metric
from normlab.train.qk_clip import QKClip
from normlab.train.spikes import SpikeHandler

if TYPE_CHECKING:
    from normlab.config.hooks import DivergenceSettings, ProbeSettings, TierSettings
    from normlab.train.handle import RunHandle

Batch = tuple[torch.Tensor, torch.Tensor]


class ProbeHook(StepHook):
    """The probe pass every ``every`` steps (`normlab.diagnostics.probes`): its rows before the step, the
    weights kept after the backward, the update rows after the step, the end state after the last step.
    ``writer``: probes.jsonl (the main rank's; under FSDP2 every rank probes, the main rank writes)."""

    priority = 30

    def __init__(self, probes: Probes, writer: ProbeWriter | None, every: int) -> None:
        self.probes, self.writer, self.every = probes, writer, every
        self.probing = False

    @classmethod
    def build(cls, settings: ProbeSettings, handle: RunHandle) -> ProbeHook | None:
        """The probes section's hook: on the main rank (under FSDP2 on every rank: the probe is sharded), on the
        first `probe_batch` validation windows; None with probe_every 0."""
        cfg = handle.cfg
        if not settings.probe_every or not (handle.is_main or cfg.run.fsdp):
            return None
        batch = handle.data.val_windows(1, settings.probe_batch, cfg.data.seq_len)[0]
        probes = Probes(handle.model, batch, optimizer=handle.optimizer)
        run = handle.run
        writer = ProbeWriter(run.probes_file, handle.step) if run is not None else None
        return cls(probes, writer, settings.probe_every)

    def write(self, rows: list[ProbeRow]) -> None:
        if self.writer is not None:
            self.writer.write(rows)

    def spike_rows(self, step: int, batch: Batch) -> list[ProbeRow]:
        """The full probe pass on a spiking step's own batch with the pre-step weights (sites prefixed spike:)."""
        rows = Probes(self.probes.model, batch, optimizer=self.probes.optimizer).record(step)
        return [ProbeRow(**{**r, "site": f"spike:{r['site']}"}) for r in rows]

    def pre_step(self, step: int) -> None:
        self.probing = step % self.every == 0
        if self.probing:
            self.write(self.probes.record(step))

    def post_backward(self, step: int) -> None:
        if self.probing:
            self.probes.snapshot()  # the weights before the update (nothing changes them until the step)

    def post_step(self, step: int, applied: bool) -> None:
        if self.probing:
            self.write(self.probes.updates(step))

    def post_train(self, step: int) -> None:
        self.write(self.probes.record(step))  # the end state (also of a diverged run, at the step it stopped)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TierHook(StepHook):
    """The per-step tier every ``every`` steps (`normlab.diagnostics.tier`): its maxima from the forward to the
    backward's end, its gradient and weight norms before the clip, its row (update RMS and ratio added) to
    layers.jsonl (``log``: open for appending on the main rank, else None) after the step."""

    priority = 20

    def __init__(self, tier: StepTier, log: IO[str] | None, every: int) -> None:
        self.tier, self.log, self.every = tier, log, every
        self.spikes = TierSpikes()
        self.last: dict[str, Any] = {}
        tier.active = False  # each tier step's reset opens its hooks' window (not an evaluation before it)

    @classmethod
    def build(cls, settings: TierSettings, handle: RunHandle) -> TierHook | None:
        """The tier section's hook (None with layer_stats off); its rows to layers.jsonl on the main rank."""
        if not settings.layer_stats:
            return None
        tier = StepTier(handle.model, compiled=bool(handle.cfg.run.compile))  # resolved by the run: a bool
        run = handle.run
        log = run.layers_file.open("a", buffering=1) if run is not None else None
        return cls(tier, log, settings.layer_stats_every)

    def on(self, step: int) -> bool:
        """Whether ``step`` is one of the tier's (every ``every``-th)."""
        return step % self.every == 0

    def fired(self, step: int) -> list[str]:
        """Before the update: the tier's values read and its per-layer spike rule applied (what fired)."""
        return self.spikes.check(self.tier.read()) if self.on(step) else []

    def pre_step(self, step: int) -> None:
        if self.on(step):
            self.tier.reset()

    def post_backward(self, step: int) -> None:
        if self.on(step):
            self.tier.before_step()  # per-block gradient and weight norms, before the clip

    def post_step(self, step: int, applied: bool) -> None:
        if not self.on(step):
            return
        row = self.tier.after_step(applied)
        self.last = {Metric.STEP: step, **row}  # the early warnings read it (normlab.diagnostics.early_warning)
        if self.log is not None:
            self.log.write(json.dumps(self.last) + "\n")

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        self.tier.remove()


class QKClipHook(StepHook):
    """QK-clip (`normlab.train.qk_clip`): the step's max logits from its own micro-batches, the rescale after
    an applied update; its counts kept in the checkpoint under "qk_clip" and reported in the summary."""

    priority = 10
    state_key = "qk_clip"

    def __init__(self, clip: QKClip) -> None:
        self.clip = clip

    def pre_step(self, step: int) -> None:
        self.clip.reset()  # the max logits of this step's micro-batches only

    def post_step(self, step: int, applied: bool) -> None:
        if applied:
            self.clip.apply()

    def summary(self) -> dict[str, Any]:
        return {"qk_clip": self.clip.summary()}

    def state_dict(self) -> dict[str, Any]:
        return self.clip.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip.load_state_dict(state)


class DivergenceHook(StepHook):
    """The divergence section's hook: the divergence monitor's decisions (`normlab.train.divergence`) and the spike
    policy (`normlab.train.spikes`). Before the update it admits a step or not (a non-finite loss or gradient norm
    skipped or stopping the run per ``on_nonfinite``; fp16's overflow), then applies the tier's per-layer rule and
    the loss and gradient-norm rule with its rerun (through the run's handle: the step again on the same weights,
    its whole batch saved with a spike), on a spike of either the full probe pass on the step's first micro-batch;
    after it, the loss scale's collapse rule and the monitor's spike flags in the row; it asks the loop to stop
    once the run diverged, and judges the finished run (the final-loss and stalled rules). The step's RNG state is
    kept before its forward. The monitor's state is the run's (`RunState.monitor`, the checkpoint's "monitor")."""

    def __init__(self, handler: SpikeHandler, handle: RunHandle, on_nonfinite: str = "stop") -> None:
        self.handler, self.handle, self.on_nonfinite = handler, handle, on_nonfinite
        self.monitor = handler.monitor
        self.tier_probed: int | None = None  # the last step whose tier spike ran the full probe pass

    @classmethod
    def build(cls, settings: DivergenceSettings, handle: RunHandle) -> DivergenceHook:
        return cls(SpikeHandler(handle.monitor, settings.on_spike, handle.run), handle, settings.on_nonfinite)

    def admit(self, step: int, loss: float, grad_norm: float, scaled: bool) -> bool:
        return self.monitor.check_finite(step, loss, grad_norm, self.on_nonfinite, scaled=scaled)

    def row_metrics(self, step: int, applied: bool, row: Mapping[str, Any]) -> dict[str, Any]:
        """fp16's loss scale after the scaler's update checked (the collapse rule); on an applied step, the
        monitor's spike rules that fired (`DivergenceMonitor.update`) as flags."""
        if Metric.LOSS_SCALE in row:
            self.monitor.check_scale(step, row[Metric.LOSS_SCALE])
        if not applied:
            return {}
        return {k: True for k, v in self.monitor.update(step, row[Metric.LOSS], row[Metric.GRAD_NORM]).items() if v}

    def stop_request(self) -> Stop | None:
        step = self.monitor.diverged_step
        if not self.monitor.diverged or step is None:
            return None
        return Stop(step, self.monitor.reason or "diverged", failed=True)

    def post_train(self, step: int) -> None:
        self.monitor.finish(step)  # the final-loss and stalled rules, on the run as it ended

    def pre_step(self, step: int) -> None:
        self.handler.start(self.handle.device)

    def rerun(self, step: int, same_rng: bool) -> tuple[float, float]:
        """Step ``step`` again on the weights as they are; with ``same_rng``, from the RNG state it started with."""
        return self.handle.rerun(step, self._restore_rng if same_rng else None)

    def _restore_rng(self) -> None:
        self.handler.restore_rng(self.handle.device)

    def veto(self, step: int, loss: float, grad_norm: float) -> dict[str, Any] | None:
        tier, probes = self.handle.find(TierHook), self.handle.find(ProbeHook)
        fired = tier.fired(step) if isinstance(tier, TierHook) else []
        record = self.handler.check(step, loss, grad_norm, self.rerun, self.handle.global_batch)
        if (record is not None or fired) and isinstance(probes, ProbeHook):
            self._probe(probes, step, record, fired)
        return record

    def _probe(self, probes: ProbeHook, step: int, record: dict[str, Any] | None, fired: list[str]) -> None:
        """A spike's probe rows: a per-layer tier spike (two series per layer: one fires often early on) runs
        the full pass at most once per probe interval; a loss or gradient-norm spike always does."""
        every = probes.every
        bounded = fired and record is None and self.tier_probed is not None and step - self.tier_probed < every
        rows: list[ProbeRow] = []
        if not bounded:
            self.tier_probed = step if fired else self.tier_probed
            rows = probes.spike_rows(step, self.handle.first_micro_batch(step))
        why = (record["kinds"] if record else []) + fired
        marks = [ProbeRow(step=step, layer=None, site="spike", metric=f"fired:{w}", value=1.0) for w in why]
        probes.write(rows + marks)
