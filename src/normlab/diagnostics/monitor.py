"""normlab's probes inside someone else's training: any causal LM, any loop, a normlab run folder out.

    monitor = TrainingMonitor(model, "runs/mine", every=100)     # hooks the model's forward
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward()
        monitor.step(step)        # after the backward, before zero_grad: gradients, spikes, probes
        optimizer.step(); optimizer.zero_grad()
    monitor.close()

`normlab report runs/mine` then draws the same figures as for a normlab run (loss and gradient norm,
the stream by depth, gradient norm by layer, top activations against 65504, angular distance, norm
gains). The transformers Trainer callback (`normlab.hf.callback.NormlabCallback`) is this class driven
by the Trainer's events.

What it records (the names of `normlab.diagnostics.probes`, so the report reads them unchanged):

- every step, in ``metrics.jsonl``: the loss the model returned (mean over the micro-batches since the
  last step; their sum where the Trainer passed ``num_items_in_batch``, which makes each micro-batch's
  loss its share of the step's mean) and the global gradient norm;
- every ``every`` steps, in ``probes.jsonl``: per block, the gradient norm of each weight matrix (the
  block's relative module path as the site, e.g. ``self_attn.q_proj``) and of the whole block (site
  ``block``); the stream entering each block and leaving it (mean |h|, variance, RMS, max |h|, median,
  max/median, angular distance to the next layer), the top-100 activations and the FP16 headroom, from
  a probe forward on a fixed batch (the first batch seen, or ``probe_batch``); each norm's gain (mean,
  min, max) under normlab's site name where ``site_names`` gives one (the Trainer callback passes the
  registered transformers architectures': Llama's ``post_attention_layernorm`` is ``mlp_norms.input``),
  else its own path.
- a loss spike (OLMo's rule: more than ``sigmas`` standard deviations above the mean of the last
  ``window`` losses; 6 and 128 by default, `SpikeRule`) triggers a probe pass on the batch that caused
  it (the micro-batch with the largest loss since the last step), saved to ``spikes/step_N.pt`` with its
  loss, and a row in ``spikes.jsonl``.

- at ``close()``, a last probe pass on the final weights (at the step after the last one recorded, unless
  that step was probed).

The probe forward replays the first call the model received as it was made (positional arguments and
keywords: ``model(x, targets=y)`` for a NormLM or a nanoGPT-style loop, ``model(input_ids=...)`` for
transformers). A loss computed outside the model and not passed as ``loss=`` is recorded as null, and such a
run's status is judged by its gradient norm. A second monitor on a folder an earlier one wrote (the Trainer's
``resume_from_checkpoint``) continues it: the rows before its first step are kept, those at or after it are
replaced with a warning and an entry in config.json's ``resumes``, and the spike rule continues from the kept
losses.

Under torchrun (DDP, or FSDP2's DTensor parameters: HF Trainer and Lightning with FSDP), call ``step`` and
``close`` on every rank: the loss is averaged over the ranks, sharded gradients and norm gains are reduced per
shard (`normlab.diagnostics.shards`: only scalars cross ranks), every rank probes rank 0's first batch (the
sharded forward needs them all), and the main rank writes.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from normlab.diagnostics.attach import StreamProbe, find_blocks
from normlab.diagnostics.shards import moments, norms, reshard
from normlab.diagnostics.store import ProbeWriter
from normlab.io import atomic_write_bytes, own_folder, truncate_jsonl
from normlab.runs.files import RunDir

NORM_WORDS = ("norm", "ln_")  # module class or attribute names that mark a norm (RMSNorm, LayerNorm, ln_1)


@dataclass(frozen=True)
class SpikeRule:
    """A loss spike as OLMo's trainer flags it: loss > mean + ``sigmas`` * std of the previous ``window``
    losses, once at least ``min_history`` of them are known."""

    sigmas: float = 6.0
    window: int = 128
    min_history: int = 16

    def __post_init__(self) -> None:
        if not (self.sigmas > 0 and self.window >= 2 and 2 <= self.min_history <= self.window):
            raise ValueError(f"a spike rule needs sigmas > 0 and 2 <= min_history <= window, got {self}")

    def threshold(self, history: deque) -> float | None:
        """The loss above which the next step is a spike, or None while the history is too short."""
        if len(history) < self.min_history:
            return None
        values = np.fromiter(history, dtype=np.float64, count=len(history))  # population std, as OLMo
        return float(values.mean() + self.sigmas * values.std())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate-half (transformers' Llama convention, shared by the classes listed in the docstring)."""
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-b, a), dim=-1)


class _AttentionLogits:
    """Pre-hooks on transformers-style attention modules: each head's largest causal logit, recomputed."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.modules = {}
        for i, block in enumerate(blocks):
            attn = next(
                (
                    m
                    for m in block.modules()
                    if hasattr(m, "q_proj") and hasattr(m, "k_proj") and isinstance(m.q_proj, nn.Linear)
                ),
                None,
            )
            if attn is not None:
                self.modules[i] = attn
        self.found: dict[int, list[float]] = {}

    def attach(self) -> list:
        return [
            m.register_forward_pre_hook(lambda mod, a, kw, i=i: self._record(i, mod, a, kw), with_kwargs=True)
            for i, m in self.modules.items()
        ]

    @torch.no_grad()
    def _record(self, layer: int, attn: nn.Module, args: tuple, kwargs: dict) -> None:
        h = kwargs.get("hidden_states", args[0] if args else None)
        rope = kwargs.get("position_embeddings")
        if h is None or rope is None:
            return
        cos, sin = rope
        b, t, _ = h.shape
        q, k = attn.q_proj(h), attn.k_proj(h)
        hd = getattr(attn, "head_dim", None) or cos.shape[-1]
        for name in ("q", "k"):
            norm = getattr(attn, f"{name}_norm", None)
            x = q if name == "q" else k
            if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape[-1] != hd:
                x = norm(x)  # over the full projection (OLMo 2/3), before the head split
            x = x.view(b, t, -1, hd).transpose(1, 2)
            if norm is not None and (getattr(norm, "weight", None) is None or norm.weight.shape[-1] == hd):
                x = norm(x)  # per head (Qwen 3, Gemma 3)
            x = x * cos[:, None] + _rotate_half(x) * sin[:, None]
            q, k = (x, k) if name == "q" else (q, x)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = getattr(attn, "scaling", hd**-0.5)
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        self.found[layer] = scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)).tolist()

    def rows(self, step: int) -> list[dict[str, Any]]:
        out = []
        for layer, heads in sorted(self.found.items()):
            out.append({"step": step, "layer": layer, "site": "attn", "metric": "max_logit", "value": max(heads)})
            out += [
                {"step": step, "layer": layer, "site": f"attn.head{h}", "metric": "max_logit", "value": v}
                for h, v in enumerate(heads)
            ]
        self.found = {}
        return out


def _norm_modules(block: nn.Module) -> dict[str, nn.Module]:
    """The norms inside one block (any module named like a norm that holds a weight), by relative path."""
    return {
        path: m
        for path, m in block.named_modules()
        if path
        and getattr(m, "weight", None) is not None
        and isinstance(m.weight, torch.Tensor)
        and any(w in (type(m).__name__.lower() + "." + path.rsplit(".", 1)[-1].lower()) for w in NORM_WORDS)
        and m.weight.dim() == 1
    }


def _dist() -> tuple[int, int]:
    """(rank, world) of the default process group; (0, 1) outside torchrun."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


REPLAYED = (torch.Tensor, bool, int, float, str, type(None))  # what a recorded call keeps of its arguments
NOT_REPLAYED = ("num_items_in_batch",)  # the Trainer's loss normalizer: no input of the model


@dataclass
class Call:
    """A forward call as the model received it: positional arguments and keywords (tensors detached), so a
    probe replays it as called (``model(x)`` for NormLM or nanoGPT-style loops, ``model(input_ids=...)``)."""

    args: tuple
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, args: tuple, kwargs: dict[str, Any]) -> Call:
        return cls(
            tuple(_detached(a) for a in args),
            {k: _detached(v) for k, v in kwargs.items() if isinstance(v, REPLAYED) and k not in NOT_REPLAYED},
        )

    def to(self, device: torch.device | None = None) -> Call:
        move = (
            (lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)
            if device is not None
            else (lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
        )
        return Call(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The call's tensors by name (positional ones as ``arg0``, ``arg1``...): what a spike's file holds."""
        out = {f"arg{i}": a for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)}
        out.update({k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)})
        return out


class TrainingMonitor:
    """Probes, gradient norms and spike capture for any causal LM in its own training loop (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        out: str | Path,
        every: int = 100,
        probe_batch: dict[str, Any] | None = None,
        spike: SpikeRule | None = SpikeRule(),
        top_k: int = 100,
        name: str | None = None,
        site_names: dict[str, str] | None = None,
    ) -> None:
        """``site_names``: a norm's path inside a block -> the normlab site it records as (for a transformers
        model, `normlab.hf.callback.site_names(model)` gives it for the registered architectures).
        ``probe_batch``: the model's keyword arguments for the probe forward (default: the first call seen,
        replayed as it was made)."""
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be a positive number of activations (the top-k band), got {top_k!r}")
        if spike is not None and not isinstance(spike, SpikeRule):
            raise ValueError(f"spike must be a SpikeRule or None, got {type(spike).__name__}")
        self.model, self.every, self.spike, self.top_k = model, every, spike, top_k
        self.rank, self.world = _dist()
        self.main = self.rank == 0
        self.out = own_folder(out, "monitor") if self.main else Path(out)  # only the main rank writes
        self.run = RunDir(self.out)
        self.block_path, blocks = find_blocks(model)
        self.blocks = list(blocks)
        self.stream = StreamProbe(model, self.blocks, top_k)
        self.logits = _AttentionLogits(self.blocks)
        self.sites = dict(site_names or {})
        self.probe_call = Call((), dict(probe_batch)).to() if probe_batch is not None else None
        self._probe_fixed = probe_batch is not None or self.world == 1
        self.history: deque = deque(maxlen=spike.window if spike else 2)
        self._losses: list[float] = []
        self._worst: tuple[float, Call] | None = None
        self._probing = False
        self._shares = False
        self._started = False
        self._last_step: int | None = None
        self._probed_last = False
        self.spikes: list[dict[str, Any]] = []
        self.last_loss: float | None = None
        self.last_grad_norm = 0.0
        self.record = {
            "config": {"layout": name or type(model).__name__, "source": "normlab.diagnostics.monitor"},
            "blocks": f"{self.block_path} ({len(self.blocks)})",
            "every": every,
            "world_size": self.world,
            "spike_rule": None if spike is None else vars(spike),
        }
        self.metrics_file = None
        self.writer: ProbeWriter | None = None
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    # -- the model's forward: the loss it returned and the call it received --
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
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

    # -- the run folder: a new one, or the history of an earlier monitor continued --
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
        logged = [r["step"] for r in self.run.metrics() if isinstance(r.get("step"), int)]
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
        for path in (self.run.metrics_file, self.run.spikes_file):
            if path.exists():
                truncate_jsonl(path, step)
        for old in self.run.spikes():
            self.spikes.append(old)
        for s in replaced:
            self.run.spike_batch_file(s).unlink(missing_ok=True)
        kept = [r.get("loss") for r in self.run.metrics()]
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
        when neither is known: the row's loss is null), the gradient norms, a spike check, and probes every
        ``every`` steps. Under torchrun, call it on every rank: the loss is averaged over the ranks, sharded
        gradients reduced, and the main rank writes. Returns the metrics row."""
        if not self._started:
            self._open(step)
        self._fix_probe_batch()
        if loss is None and self._losses:
            n = 1 if self._shares else len(self._losses)
            loss = sum(self._losses) / n
        if loss is not None and self.world > 1:
            t = torch.tensor([float(loss)], dtype=torch.float64, device=next(self.model.parameters()).device)
            torch.distributed.all_reduce(t)
            loss = t.item() / self.world
        grads = self._grad_rows(step)
        total = math.sqrt(sum(r["value"] ** 2 for r in grads if r["site"] == "block"))
        row = {"step": step, "loss": loss, "grad_norm": total}
        if self.main:
            self.metrics_file.write(json.dumps(row) + "\n")
        threshold = self.spike.threshold(self.history) if self.spike else None
        spiked = threshold is not None and loss is not None and math.isfinite(loss) and loss > threshold
        probed = spiked or step % self.every == 0
        if probed:
            rows = grads + self._probe_rows(step)
            if self.main:
                self.writer.write(rows)
        if spiked:
            self._save_spike(step, loss, threshold)
        if loss is not None and math.isfinite(loss):
            self.history.append(loss)
        if loss is not None:
            self.last_loss = loss
        self.last_grad_norm = total
        self._last_step, self._probed_last = step, probed
        self._losses, self._worst = [], None
        return row

    def _grad_rows(self, step: int) -> list[dict[str, Any]]:
        """Per block: each weight matrix's gradient norm and the block's (sharded gradients reduced per shard)."""
        rows: list[dict[str, Any]] = []
        for i, block in enumerate(self.blocks):
            mats = [
                (path, m.weight.grad)
                for path, m in block.named_modules()
                if isinstance(m, nn.Linear) and m.weight is not None and m.weight.grad is not None
            ]
            rest = [p.grad for p in block.parameters() if p.grad is not None and p.dim() < 2]  # norms, biases
            if not mats and not rest:
                continue  # no gradients here (cleared, or frozen): nothing to record
            found = norms([g for _, g in mats] + rest)
            for (path, _), g in zip(mats, found):
                rows.append({"step": step, "layer": i, "site": path, "metric": "grad_norm", "value": g})
            rows.append(
                {
                    "step": step,
                    "layer": i,
                    "site": "block",
                    "metric": "grad_norm",
                    "value": math.sqrt(sum(g * g for g in found)),
                }
            )
        return rows

    def _probe_rows(self, step: int, call: Call | None = None) -> list[dict[str, Any]]:
        call = call or self.probe_call
        rows: list[dict[str, Any]] = []
        if call is not None:
            was = self.model.training
            self._probing = True
            handles = self.logits.attach()
            try:
                self.model.eval()
                rows += self.stream.record(step, *call.args, **call.kwargs)
            finally:
                for h in handles:
                    h.remove()
                self._probing = False
                self.model.train(was)
                reshard(self.model)
            rows += self.logits.rows(step)
        norms_ = [(i, path, norm) for i, block in enumerate(self.blocks) for path, norm in _norm_modules(block).items()]
        for (i, path, _), m in zip(norms_, moments([n.weight for _, _, n in norms_])):
            site = self.sites.get(path, path)
            for metric, value in (("gamma_mean", m.mean), ("gamma_min", m.minimum), ("gamma_max", m.maximum)):
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
                {**r, "site": f"spike:{r['site']}"}
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
        self.writer.write(rows)  # the offending batch's own probe pass, beside the fixed batch's
        record = {"step": step, "loss": loss, "threshold": threshold, "batch_loss": loss_of_batch, "file": str(path)}
        self.spikes.append(record)
        with self.run.spikes_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> dict[str, Any]:
        """Probe the final weights (at the step after the last one recorded, unless that one was just probed),
        stop hooking the model, and write summary.json: status ok unless the last known loss is non-finite
        (a run whose loss the monitor never saw is judged by its gradient norm), the final loss, the spikes."""
        if self._started and self._last_step is not None and not self._probed_last:
            rows = self._probe_rows(self._last_step + 1)
            if self.main:
                self.writer.write(rows)
        self._hook.remove()
        if not self.main:
            return {}
        if not self._started:
            self._open(0)
        self.metrics_file.close()
        self.writer.close()
        healthy = math.isfinite(self.last_loss) if self.last_loss is not None else math.isfinite(self.last_grad_norm)
        summary = {
            "status": "ok" if healthy else "diverged",
            "final_loss": self.last_loss,
            "spikes": len(self.spikes),
            "source": "normlab.diagnostics.monitor",
        }
        self.run.write_summary(summary)
        return summary
