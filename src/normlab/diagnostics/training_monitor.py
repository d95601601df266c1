"""normlab's probes inside someone else's training: any causal LM, any loop, a normlab run folder out.

    monitor = TrainingMonitor(model, "runs/mine", every=100)     # hooks the model's forward
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward()
        monitor.step(step)        # after the backward: gradients (as the backward left them), spikes, probes
        optimizer.step(); optimizer.zero_grad()
    monitor.close()

`normlab report runs/mine` then draws the same figures as for a normlab run (loss and gradient norm,
the stream by depth, gradient norm by layer, top activations against 65504, angular distance, norm
gains). The transformers Trainer callback (`normlab.hf.callback.NormlabCallback`) is this class driven
by the Trainer's events.

What it records (the names of `normlab.diagnostics.probes`, so the report reads them unchanged):

- every step, in ``metrics.jsonl``: the loss the model returned (mean over the micro-batches since the
  last step; their sum where the Trainer passed ``num_items_in_batch``, which makes each micro-batch's
  loss its share of the step's mean) and ``grad_norm``, the L2 norm of the gradients of every parameter of
  ``model`` (each shared tensor once, as ``model.parameters()`` lists them: what ``clip_grad_norm_`` over
  them returns), before any clipping (see "Which gradients" below); null when no parameter has one;
- at the first step recorded and every ``every`` steps, in ``probes.jsonl``: per block, the gradient norm of
  each parameter of 2 or more dimensions (its path in the block as the site, ``.weight`` dropped:
  ``self_attn.q_proj``) and of all the block's parameters (site ``block``), from the same gradients as
  ``grad_norm``; the stream entering each block and leaving it (mean |h|, variance, RMS, max |h|, median,
  max/median, angular distance to the next layer), the top-100 activations and the FP16 headroom, from a probe
  forward on a fixed batch (the first batch seen, or ``probe_batch``); each norm's gain (mean, min, max) under
  normlab's site name where ``site_names`` gives one (the Trainer callback passes the registered transformers
  architectures': Llama's ``post_attention_layernorm`` is ``mlp_norms.input``), else its own path.
- every step, in ``layers.jsonl``: ``stream_max``, the largest |x| of the stream entering the first block and
  leaving each block over the step's training forwards (`normlab.diagnostics.stream_maxima`), the per-step
  tier's row for a model normlab did not build; it feeds the stream-growth alert (a line on stderr and a row
  in warnings.jsonl, beside the loss and gradient-norm spike alerts: `normlab.diagnostics.early_warning`);
- a loss spike (OLMo's rule: more than ``sigmas`` standard deviations above the mean of the last
  ``window`` losses; 6 and 128 by default, `SpikeRule`) triggers a probe pass on the batch that caused
  it (the micro-batch with the largest loss since the last step), saved to ``spikes/step_N.pt`` with its
  loss, and a row in ``spikes.jsonl``; so does the first loss more than `LOSS_RISE` (1 nat) above the first
  step's (the early warnings' loss-rise rule, which needs no history: a run that blows up before the spike
  rule has ``min_history`` losses), with that bound as its threshold.
- every alert of the early warnings (`normlab.diagnostics.early_warning`, judged at ``precision``'s limits:
  fp16's 65,504 for the stream; the loss-rise rule from the second step on) as a line on stderr and a row in
  ``warnings.jsonl``; summary.json's status is then ``warned`` (``diverged`` where the last loss is
  non-finite), with the first alert's line as its ``reason``.

- at ``close()``, a last probe pass on the final weights (at the step after the last one recorded, unless
  that step was probed).

The probe forward replays the first call the model received as it was made (positional arguments and
keywords: ``model(x, targets=y)`` for a NormLM or a nanoGPT-style loop, ``model(input_ids=...)`` for
transformers). A loss computed outside the model and not passed as ``loss=`` is recorded as null, and such a
run's status is judged by its gradient norm. A second monitor on a folder an earlier one wrote (the Trainer's
``resume_from_checkpoint``) continues it: the rows before its first step are kept, those at or after it are
replaced with a warning and an entry in config.json's ``resumes``, and the spike rule continues from the kept
losses.

Which gradients. ``grad_norm`` and the per-block norms are the gradients as they stand at the end of the
last backward pass before ``step`` (every backward through the model's forward queues a measurement that
autograd runs once the pass is over, after the callbacks DDP and FSDP2 queue to reduce and shard the
gradients): before any clipping, wherever ``step`` is called, so a trainer whose only event comes after its
clip (transformers' ``on_pre_optimizer_step``) still records the norm it clipped from. Under fp16 loss scaling
those gradients are multiplied by the scale: pass ``grad_scaler`` (the ``torch.amp.GradScaler``) and each
measurement is divided by its scale at that backward. ``capture_grads()`` measures the gradients as they are
when it is called instead (Lightning's ``on_before_optimizer_step``: unscaled, not yet clipped); ``step``
then reports that. config.json's ``grad_norm`` says which of the two the run's first step recorded.

The blocks are the longest ``nn.ModuleList`` or ``nn.ModuleDict`` of same-typed modules (``model.layers``;
torchtitan's ``layers`` ModuleDict keyed "0", "1", ...), or ``blocks=``: that container, its attribute
path, or a list of the block modules; rows number them 0, 1, ... in that order (config.json's
``block_names`` keeps a ModuleDict's keys where they are not those numbers). ``step`` takes whole numbers
that increase from call to call; anything else (NaN, a negative or fractional step, one at or below the
last recorded, any step after ``close()``) is refused with a `ConfigError` before anything is written.

Under torchrun (DDP, or FSDP2's DTensor parameters: HF Trainer and Lightning with FSDP), call ``step`` and
``close`` on every rank: the loss is averaged over the ranks, sharded gradients and norm gains are reduced per
shard (`normlab.diagnostics.shards`: only scalars cross ranks), every rank probes rank 0's first batch (the
sharded forward needs them all), and the main rank writes. Every rank must hold the same model (whole, or
shards of it): ranks whose models differ (pipeline-parallel stages) are refused at the first step.

- attention logits per head (``attn.head{h}`` / ``attn``: ``max_logit``, the largest causal q.k scaled as the
  model scales it) where a block's attention module follows transformers' convention (``q_proj``,
  ``k_proj``, optional ``q_norm``/``k_norm`` per head or over the full projection, RoPE from the
  ``position_embeddings`` (cos, sin) its layer passes, ``scaling``): Llama, Mistral, Qwen 2/3, OLMo 2/3,
  Gemma 2/3. The scores are recomputed from the module's own inputs during the probe pass, since the
  attention function that makes them is not a module a hook can see.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO, TypedDict, Unpack, cast

import torch
from torch import nn

from normlab.diagnostics.attach import StreamProbe
from normlab.diagnostics.early_warning import LOSS_RISE, EarlyWarnings, print_alert, replayed
from normlab.diagnostics.foreign_model import (
    AT_BACKWARD,
    AT_CALL,
    AttentionLogits,
    Call,
    GradNorms,
    grad_site,
    loss_value,
    norm_modules,
    output_tensors,
    rank_and_world,
    resolve_blocks,
    step_number,
    unwrapped_path,
)
from normlab.diagnostics.hooks import StepHook, StepHooks
from normlab.diagnostics.probe_store import ProbeRow, ProbeWriter
from normlab.diagnostics.shards import moments, reshard
from normlab.diagnostics.stability import SpikeRule, spike_score
from normlab.diagnostics.stream_maxima import StreamMaxima
from normlab.errors import ConfigError
from normlab.io import atomic_write_bytes, own_folder, truncate_jsonl
from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric, ProbeMetric

DEFAULT_SPIKE = SpikeRule()  # frozen: one shared default


def _check_arguments(model: Any, every: Any, probe_batch: Any, spike: Any, options: Mapping[str, Any]) -> None:
    """`TrainingMonitor`'s arguments, each refused in one line (ConfigError) before its folder is made."""
    unknown = sorted(set(options) - set(MonitorOptions.__annotations__))
    if unknown:
        raise TypeError(f"TrainingMonitor() got an unexpected keyword argument {unknown[0]!r}")
    top_k, grad_scaler = options.get("top_k", 100), options.get("grad_scaler")
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"TrainingMonitor needs the model being trained (a torch.nn.Module), got {type(model).__name__}"
        )
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"every must be a positive number of steps, got {every!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ConfigError(f"top_k must be a positive number of activations (the top-k band), got {top_k!r}")
    if options.get("precision", "bf16") not in ("fp16", "bf16", "fp32"):
        raise ConfigError(
            f"precision must be fp16, bf16 or fp32 (the early warnings' limits), got {options['precision']!r}"
        )
    if spike is not None and not isinstance(spike, SpikeRule):
        raise ConfigError(f"spike must be a SpikeRule or None, got {type(spike).__name__}")
    if probe_batch is not None and not isinstance(probe_batch, Mapping):
        raise ConfigError(
            f"probe_batch must be the model's keyword arguments (a dict) or None, got {type(probe_batch).__name__}"
        )
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise ConfigError(
            "grad_scaler must be the fp16 loss scaler (a torch.amp.GradScaler) or None, got "
            f"{type(grad_scaler).__name__}"
        )
    hooks = options.get("hooks", ())
    if not isinstance(hooks, (list, tuple)) or not all(isinstance(h, StepHook) for h in hooks):
        raise ConfigError("hooks must be a list of step hooks (normlab.diagnostics.hooks.StepHook instances)")


class MonitorOptions(TypedDict, total=False):
    """`TrainingMonitor`'s optional keyword arguments, past ``every``, ``probe_batch`` and ``spike``."""

    top_k: int
    name: str | None
    site_names: dict[str, str] | None
    blocks: nn.Module | str | list[nn.Module] | None
    grad_scaler: Any | None
    hooks: list[StepHook]
    precision: str  # the early warnings' limits (normlab.diagnostics.early_warning): fp16, bf16 (default) or fp32


class TrainingMonitor:
    """Probes, gradient norms and spike capture for any causal LM in its own training loop (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        out: str | Path,
        every: int = 100,
        probe_batch: dict[str, Any] | None = None,
        spike: SpikeRule | None = DEFAULT_SPIKE,
        **options: Unpack[MonitorOptions],
    ) -> None:
        """``options`` (`MonitorOptions`): ``top_k`` (the top-k band, default 100), ``name`` (config.json's
        layout label; default the model's class). ``site_names``: a norm's path inside a block -> the normlab
        site it records as (for a transformers model, `normlab.hf.callback.site_names(model)` gives it for the
        registered architectures).
        ``probe_batch``: the model's keyword arguments for the probe forward (default: the first call seen,
        replayed as it was made). ``blocks``: the residual blocks (default: found, see the module docstring).
        ``grad_scaler``: the fp16 loss scaler (``torch.amp.GradScaler``) whose scale multiplies the gradients
        at the end of each backward. ``hooks``: step hooks (`normlab.diagnostics.hooks`) this monitor drives from
        the loop it watches: ``post_step(step, True)`` after each `step` is recorded, then ``post_train``,
        ``summary`` (its keys added to summary.json) and ``close`` in `close` (the loop's own pre-step,
        after-backward and veto points are not the monitor's to see). Every argument is checked before the
        folder is made."""
        _check_arguments(model, every, probe_batch, spike, options)
        top_k, name = options.get("top_k", 100), options.get("name")
        site_names, blocks, grad_scaler = options.get("site_names"), options.get("blocks"), options.get("grad_scaler")
        self.hooks = StepHooks(options.get("hooks", ()))
        self.block_path, found, self.block_names = resolve_blocks(model, blocks)
        self.model, self.every, self.spike, self.top_k = model, every, spike, top_k
        self.grad_scaler = grad_scaler
        self.rank, self.world = rank_and_world()
        self.main = self.rank == 0
        self.out = own_folder(out, "monitor") if self.main else Path(out)  # only the main rank writes
        self.run = RunDir(self.out)
        # the live alerts on the loss, gradient norm and stream maxima of each step (spikes, the spike score,
        # stream growth against ``precision``'s limit): stderr and
        # warnings.jsonl on the main rank, every alert in summary.json (`normlab.diagnostics.early_warning`)
        self.warnings = EarlyWarnings(str(options.get("precision", "bf16")))
        self.blocks = found
        # the stream's maximum at every block boundary on every step: the stream-growth alert, layers.jsonl
        self.streams = StreamMaxima(found, next(model.parameters()).device, self.world)
        self.stream = StreamProbe(model, self.blocks, top_k)
        self.logits = AttentionLogits(self.blocks)
        self.sites = dict(site_names or {})
        self.probe_call = Call((), dict(probe_batch)).to() if probe_batch is not None else None
        self._probe_fixed = probe_batch is not None or self.world == 1
        self.history: deque[Any] = deque(maxlen=spike.window if spike else 2)
        self._losses: list[float] = []
        self._worst: tuple[float, Call] | None = None
        self._probing = False
        self._shares = False
        self._started = False
        self._closed = False
        self._summary: dict[str, Any] = {}
        self._last_step: int | None = None
        self._probed_last = False
        self._grads: GradNorms | None = None  # the latest measurement, until a step reports it
        self.spikes: list[dict[str, Any]] = []
        self.last_loss: float | None = None
        self.last_grad_norm: float | None = None
        self.record: dict[str, Any] = {
            "config": {"layout": name or type(model).__name__, "source": "normlab.diagnostics.monitor"},
            "blocks": f"{self.block_path} ({len(self.blocks)})",
            "every": every,
            "world_size": self.world,
            "spike_rule": None if spike is None else vars(spike),
        }
        if self.block_names != [str(i) for i in range(len(self.blocks))]:
            self.record["block_names"] = self.block_names
        self.metrics_file: TextIO | None = None  # the main rank's metrics.jsonl and probes.jsonl, once `_open`ed
        self.layers_log: TextIO | None = None  # the main rank's layers.jsonl, opened with its first row
        self.writer: ProbeWriter | None = None
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    # -- the model's forward: the loss it returned and the call it received --
    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._probing:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        call = Call.of(args, kwargs)
        if self.probe_call is None:  # the first call seen: the fixed probe batch
            self.probe_call = call.to()
        # transformers' Trainer passes num_items_in_batch under gradient accumulation: each micro-batch's loss is
        # then its share of the step's mean, and the step's loss is their sum
        self._shares = kwargs.get("num_items_in_batch") is not None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            value = float(loss.detach())
            self._losses.append(value)
            if self._worst is None or value > self._worst[0]:
                self._worst = (value, call)
        if torch.is_grad_enabled():  # a training forward: measure the gradients when its backward is over
            tensors = [t for t in output_tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._on_backward, mode="any")

    def _on_backward(self, grad: torch.Tensor) -> None:
        """The first gradient of a backward through the model's outputs: queue the measurement for the end of
        the pass. Queued twice over, so that it runs after the callbacks queued during the pass (DDP's reducer
        finalizes its all-reduce, FSDP2 its reduce-scatter and the sharded gradients, in such callbacks)."""
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._at_backward_end))

    def _at_backward_end(self) -> None:
        if self._closed:
            return
        scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
        at = AT_BACKWARD + (", divided by the GradScaler's scale" if self.grad_scaler is not None else "")
        self._grads = GradNorms.measure(self.model.parameters(), scale, at)

    def capture_grads(self, at: str = AT_CALL) -> None:
        """Measure the gradients as they are now (not divided by any loss scale): the next ``step`` reports
        these, unless a backward ends in between. For trainers with an event after unscaling and before clipping
        (Lightning's ``on_before_optimizer_step``); ``at`` says where, in config.json."""
        self._grads = GradNorms.measure(self.model.parameters(), 1.0, at)

    def pending_grad_norm(self) -> float | None:
        """The ``grad_norm`` the next ``step`` would record (the last measurement; None when there is none yet,
        or no parameter had a gradient). Under torchrun, call it on every rank (sharded norms are reduced)."""
        return self._grads.total() if self._grads is not None else None

    def grad_norm_now(self) -> float | None:
        """The L2 norm of the gradients of every parameter as they are now, without recording it (every rank)."""
        return GradNorms.measure(self.model.parameters(), 1.0, AT_CALL).total()

    # -- the run folder: a new one, or the history of an earlier monitor continued --
    def _same_model_on_every_rank(self) -> None:
        """Under torchrun: every rank holds the same model (whole or sharded), or a ConfigError on every rank."""
        if self.world == 1:
            return
        mine = (sum(1 for _ in self.model.parameters()), self.block_names)
        found: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(found, mine)
        if any(f != found[0] for f in found):
            raise ConfigError(
                "TrainingMonitor: the ranks hold different models (parameter tensors and blocks per rank: "
                f"{[(f[0], len(f[1])) for f in found]}); every rank must hold the same model, whole or sharded "
                "(pipeline-parallel stages are not supported)"
            )

    def _open(self, step: int) -> None:
        """At the first step: keep the folder's history before ``step`` (a resumed Trainer's earlier monitor),
        cut what was logged at or after it (those steps are trained again), say so, and append."""
        self._started = True
        if not self.main:
            return
        before = self.run.record() or {}
        resumes = (
            list(before.get("resumes", []))
            if before.get("config", {}).get("source") == self.record["config"]["source"]
            else []
        )
        logged = [r[Metric.STEP] for r in self.run.metrics() if isinstance(r.get(Metric.STEP), int)]
        replaced = sorted(s for s in logged if s >= step)
        if logged:
            resumes.append(
                {
                    "step": step,
                    "kept": len(logged) - len(replaced),
                    "replaced": [replaced[0], replaced[-1]] if replaced else None,
                }
            )
            if replaced:
                warnings.warn(
                    f"{self.out}: the monitor resumes at step {step}; the {len(replaced)} steps logged at or "
                    f"after it ({replaced[0]}..{replaced[-1]}) are replaced by this run's",
                    stacklevel=3,
                )
        for path in (self.run.metrics_file, self.run.spikes_file, self.run.layers_file, self.run.warnings_file):
            if path.exists():
                truncate_jsonl(path, step)
        if logged:  # the early warnings as they stood at the step it resumes from (each fires once per run)
            self.warnings = replayed(self.out, self.warnings.precision, until=step)
        for old in self.run.spikes():
            self.spikes.append(old)
        for s in replaced:
            self.run.spike_batch_file(s).unlink(missing_ok=True)
        kept = [r.get(Metric.LOSS) for r in self.run.metrics()]
        self.history.extend(v for v in kept if isinstance(v, (int, float)) and math.isfinite(v))
        self.record["resumes"] = resumes
        self.run.write_record(self.record)
        self.metrics_file = self.run.metrics_file.open("a", buffering=1)
        self.writer = ProbeWriter(self.run.probes_file, step)

    def _fix_probe_batch(self) -> None:
        """Under torchrun every rank probes rank 0's first batch (a sharded model's forward needs every rank,
        and the same batch makes each rank's statistics the whole batch's, the median included)."""
        if not self._probe_fixed:
            box = [self.probe_call.to(torch.device("cpu")) if self.probe_call is not None else None]
            torch.distributed.broadcast_object_list(box, src=0)
            device = next(self.model.parameters()).device
            self.probe_call = box[0].to(device) if box[0] is not None else None
            self._probe_fixed = True

    # -- after the backward, before the gradients are cleared --
    def step(self, step: int, loss: float | None = None) -> dict[str, Any]:
        """Record step ``step``: its loss (the model's, or ``loss`` for a loss computed outside the model; none
        when neither is known: the row's loss is null), the gradient norms (of the gradients the last backward
        left, see the module docstring), a spike check, and probes every ``every`` steps. Under torchrun, call
        it on every rank: the loss is averaged over the ranks, sharded gradients reduced, and the main rank
        writes. A step that is not a whole number above the last one, or any step after ``close()``, is refused
        (ConfigError) before anything is written. Returns the metrics row."""
        if self._closed:
            raise ConfigError(
                f"TrainingMonitor.step({step!r}): this monitor was closed; a new TrainingMonitor on {self.out} "
                "continues its folder"
            )
        step = step_number(step, self._last_step)
        given = loss_value(loss)
        grads = self._grads or GradNorms.measure(self.model.parameters(), 1.0, AT_CALL)
        self._grads = None
        first = not self._started  # the first step this monitor records is probed: the model as it starts
        if not self._started:
            self._same_model_on_every_rank()
            self.record[Metric.GRAD_NORM] = {
                "of": f"every parameter of {type(self.model).__name__} (L2 norm, each tensor once)",
                "at": grads.at,
            }
            self._open(step)
        self._fix_probe_batch()
        loss = given
        if loss is None and self._losses:
            n = 1 if self._shares else len(self._losses)
            loss = sum(self._losses) / n
        if loss is not None and self.world > 1:
            t = torch.tensor([float(loss)], dtype=torch.float64, device=next(self.model.parameters()).device)
            torch.distributed.all_reduce(t)
            loss = t.item() / self.world
        squares = grads.read()
        total = grads.total()
        row: dict[str, Any] = {Metric.STEP: step, Metric.LOSS: loss, Metric.GRAD_NORM: total}
        if self.main:
            assert self.metrics_file is not None  # opened by the first step's `_open`
            self.metrics_file.write(json.dumps(row) + "\n")
        stream = self.streams.take()
        tier: dict[str, Any] = {ProbeMetric.STREAM_MAX: stream} if stream is not None else {}
        alerts = self.warnings.feed(step, tier, row)
        threshold = self.spike.threshold(self.history) if self.spike else None
        spiked = threshold is not None and loss is not None and math.isfinite(loss) and loss > threshold
        rise = self.warnings.rise
        if self.spike and not spiked and any(a.signal == rise.signal and math.isfinite(a.value) for a in alerts):
            # the loss-rise rule fired before the spike rule's history is long enough: capture the batch too
            assert rise.start is not None  # the rule fires only once it has a start
            spiked, threshold = True, rise.start + LOSS_RISE
        probed = spiked or first or step % self.every == 0
        if probed:
            rows = self._grad_rows(step, squares) + self._probe_rows(step)
            if self.main:
                assert self.writer is not None
                self.writer.write(rows)
        if spiked:
            assert loss is not None and threshold is not None  # a spike is a finite loss past the threshold
            self._save_spike(step, loss, threshold)
        if loss is not None and math.isfinite(loss):
            self.history.append(loss)
        if loss is not None:
            self.last_loss = loss
        self.last_grad_norm = total
        self._last_step, self._probed_last = step, probed
        self._losses, self._worst = [], None
        if self.main and stream is not None:
            if self.layers_log is None:
                self.layers_log = self.run.layers_file.open("a", buffering=1)
            self.layers_log.write(json.dumps({Metric.STEP: step, **tier}) + "\n")
        for alert in alerts:
            if self.main:
                with self.run.warnings_file.open("a") as f:
                    f.write(json.dumps(alert.to_dict()) + "\n")
                print_alert(alert)
        self.hooks.post_step(step, True)
        return row

    def _grad_rows(self, step: int, squares: dict[int, float]) -> list[ProbeRow]:
        """Per block: the gradient norm of each parameter of 2 or more dimensions and of all the block's
        parameters, from ``squares`` (a parameter's squared norm by ``id``; one without a gradient is left out,
        a block without any is not recorded)."""
        rows: list[ProbeRow] = []
        for i, block in enumerate(self.blocks):
            mine = [(path, p) for path, p in block.named_parameters() if id(p) in squares]
            if not mine:
                continue  # no gradients here (cleared, or frozen): nothing to record
            for path, p in mine:
                if p.dim() >= 2:
                    value = math.sqrt(squares[id(p)])
                    rows.append(
                        ProbeRow(step=step, layer=i, site=grad_site(path), metric=ProbeMetric.GRAD_NORM, value=value)
                    )
            total = math.sqrt(sum(squares[id(p)] for _, p in mine))
            rows.append(ProbeRow(step=step, layer=i, site="block", metric=ProbeMetric.GRAD_NORM, value=total))
        return rows

    def _probe_rows(self, step: int, call: Call | None = None) -> list[ProbeRow]:
        call = call or self.probe_call
        rows: list[ProbeRow] = []
        if call is not None:
            was = self.model.training
            self._probing = self.streams.paused = True
            handles = self.logits.attach()
            try:
                self.model.eval()
                rows += self.stream.record(step, *call.args, **call.kwargs)
            finally:
                for h in handles:
                    h.remove()
                self._probing = self.streams.paused = False
                self.model.train(was)
                reshard(self.model)
            rows += self.logits.rows(step)
        norms_ = [(i, path, norm) for i, block in enumerate(self.blocks) for path, norm in norm_modules(block).items()]
        # norm_modules keeps the modules whose weight is a tensor
        for (i, path, _), m in zip(norms_, moments([cast(torch.Tensor, n.weight) for _, _, n in norms_])):
            site = self.sites.get(unwrapped_path(path), unwrapped_path(path))
            for metric, value in (
                (ProbeMetric.GAMMA_MEAN, m.mean),
                (ProbeMetric.GAMMA_MIN, m.minimum),
                (ProbeMetric.GAMMA_MAX, m.maximum),
            ):
                rows.append({"step": step, "layer": i, "site": site, "metric": metric, "value": float(value)})
        return rows

    def _spike_call(self, loss: float) -> tuple[float, Call | None]:
        """The micro-batch with the largest loss since the last step (under torchrun: of every rank's)."""
        mine = self._worst if self._worst is not None else (loss, None)
        if self.world == 1:
            return mine
        found: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(found, (mine[0], mine[1].to(torch.device("cpu")) if mine[1] else None))
        value, call = max(found, key=lambda f: f[0])
        return value, call.to(next(self.model.parameters()).device) if call is not None else None

    def _save_spike(self, step: int, loss: float, threshold: float) -> None:
        loss_of_batch, call = self._spike_call(loss)
        rows = (
            [
                ProbeRow(**{**r, "site": f"spike:{r['site']}"})
                for r in self._probe_rows(step, call)
                if r["site"] in ("stream", "global")
            ]
            if call is not None
            else []
        )
        if not self.main:
            return
        path = self.run.spike_batch_file(step)
        path.parent.mkdir(exist_ok=True)
        buf = io.BytesIO()
        tensors = {k: v.cpu() for k, v in call.tensors().items()} if call is not None else {}
        torch.save(
            {"step": step, "loss": loss, "batch_loss": loss_of_batch, "threshold": threshold, "batch": tensors}, buf
        )
        atomic_write_bytes(path, buf.getvalue())
        assert self.writer is not None  # the main rank's, opened by the first step's `_open`
        self.writer.write(rows)  # the offending batch's own probe pass, beside the fixed batch's
        record = {"step": step, "loss": loss, "threshold": threshold, "batch_loss": loss_of_batch, "file": str(path)}
        self.spikes.append(record)
        with self.run.spikes_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> dict[str, Any]:
        """Probe the final weights (at the step after the last one recorded, unless that one was just probed),
        stop hooking the model, and write summary.json: status ``diverged`` where the last known loss is
        non-finite (a run whose loss the monitor never saw is judged by its gradient norm), else ``warned``
        where an early warning fired (``reason``: the first one's line; ``warnings``: every one), else ``ok``;
        the precision the warnings judged by, the final loss, the spikes.
        A second call writes nothing and returns the same summary."""
        if self._closed:
            return dict(self._summary)
        if self._started and self._last_step is not None and not self._probed_last:
            rows = self._probe_rows(self._last_step + 1)
            if self.main:
                assert self.writer is not None
                self.writer.write(rows)
        self._hook.remove()
        self.streams.remove()
        self._closed = True
        self._grads = None
        if self._last_step is not None:
            self.hooks.post_train(self._last_step + 1)
        hooks_summary = self.hooks.summary()
        self.hooks.close()
        if not self.main:
            return {}
        if not self._started:
            self._open(0)
        assert self.metrics_file is not None and self.writer is not None  # `_open`ed on the main rank
        self.metrics_file.close()
        if self.layers_log is not None:
            self.layers_log.close()
        self.writer.close()
        last = self.last_loss if self.last_loss is not None else self.last_grad_norm
        metric_rows = self.run.metrics()
        alerts = self.warnings.alerts
        status = "diverged" if last is not None and not math.isfinite(last) else "warned" if alerts else "ok"
        summary = {
            "status": status,
            # what made it so: the first early warning's line (every one is in ``warnings``)
            **({"reason": alerts[0].line()} if alerts else {}),
            "precision": self.warnings.precision,
            "final_loss": self.last_loss,
            "spikes": len(self.spikes),
            # OLMo-core's spike score over the steps recorded (normlab.diagnostics.stability.spike_score)
            **spike_score([r.get(Metric.LOSS) for r in metric_rows], [r.get(Metric.GRAD_NORM) for r in metric_rows]),
            **hooks_summary,
            "source": "normlab.diagnostics.monitor",
            "warnings": [a.to_dict() for a in alerts],
        }
        self.run.write_summary(summary)
        self._summary = summary
        return dict(summary)
