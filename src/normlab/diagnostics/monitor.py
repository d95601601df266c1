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
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab.diagnostics.attach import StreamProbe, find_blocks
from normlab.diagnostics.store import ProbeWriter
from normlab.io import atomic_write_bytes, own_folder
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
        values = torch.tensor(list(history), dtype=torch.float64)
        return float(values.mean() + self.sigmas * values.std(unbiased=False))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate-half (transformers' Llama convention, shared by the classes listed in the docstring)."""
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-b, a), dim=-1)


class _AttentionLogits:
    """Pre-hooks on transformers-style attention modules: each head's largest causal logit, recomputed."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.modules = {}
        for i, block in enumerate(blocks):
            attn = next((m for m in block.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")
                         and isinstance(getattr(m, "q_proj"), nn.Linear)), None)
            if attn is not None:
                self.modules[i] = attn
        self.found: dict[int, list[float]] = {}

    def attach(self) -> list:
        return [m.register_forward_pre_hook(lambda mod, a, kw, i=i: self._record(i, mod, a, kw), with_kwargs=True)
                for i, m in self.modules.items()]

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
        scale = getattr(attn, "scaling", hd ** -0.5)
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        self.found[layer] = scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)).tolist()

    def rows(self, step: int) -> list[dict[str, Any]]:
        out = []
        for layer, heads in sorted(self.found.items()):
            out.append({"step": step, "layer": layer, "site": "attn", "metric": "max_logit", "value": max(heads)})
            out += [{"step": step, "layer": layer, "site": f"attn.head{h}", "metric": "max_logit", "value": v}
                    for h, v in enumerate(heads)]
        self.found = {}
        return out


def _norm_modules(block: nn.Module) -> dict[str, nn.Module]:
    """The norms inside one block (any module named like a norm that holds a weight), by relative path."""
    return {path: m for path, m in block.named_modules()
            if path and getattr(m, "weight", None) is not None and isinstance(m.weight, torch.Tensor)
            and any(w in (type(m).__name__.lower() + "." + path.rsplit(".", 1)[-1].lower()) for w in NORM_WORDS)
            and m.weight.dim() == 1}


class TrainingMonitor:
    """Probes, gradient norms and spike capture for any causal LM in its own training loop (module docstring)."""

    def __init__(self, model: nn.Module, out: str | Path, every: int = 100, probe_batch: dict[str, Any] | None = None,
                 spike: SpikeRule | None = SpikeRule(), top_k: int = 100, name: str | None = None,
                 site_names: dict[str, str] | None = None) -> None:
        """``site_names``: a norm's path inside a block -> the normlab site it records as (for a transformers
        model, `normlab.hf.callback.site_names(model)` gives it for the registered architectures)."""
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.model, self.every, self.spike, self.top_k = model, every, spike, top_k
        self.out = own_folder(out, "monitor")
        self.run = RunDir(self.out)
        self.block_path, blocks = find_blocks(model)
        self.blocks = list(blocks)
        self.stream = StreamProbe(model, self.blocks, top_k)
        self.logits = _AttentionLogits(self.blocks)
        self.sites = dict(site_names or {})
        self.probe_batch = probe_batch
        self.history: deque = deque(maxlen=spike.window if spike else 2)
        self._losses: list[float] = []
        self._worst: tuple[float, dict[str, Any]] | None = None
        self._probing = False
        self._shares = False
        self.spikes: list[dict[str, Any]] = []
        self.last_loss = math.nan
        self.last_step: int | None = None  # the last step recorded, and whether close() still owes it a probe
        self._probed_last = False
        label = name or type(model).__name__
        self.run.write_record({"config": {"layout": label, "source": "normlab.diagnostics.monitor"},
                               "blocks": f"{self.block_path} ({len(self.blocks)})", "every": every,
                               "spike_rule": None if spike is None else vars(spike)})
        self.metrics_file = self.run.metrics_file.open("w", buffering=1)  # a folder reused: a new record
        (self.out / "spikes.jsonl").unlink(missing_ok=True)
        self.writer = ProbeWriter(self.run.probes_file, 0)
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    # -- the model's forward: the loss it returned and the batch it read --
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._probing:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        batch = {k: v.detach() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if args and isinstance(args[0], torch.Tensor):
            batch.setdefault("input_ids", args[0].detach())
        if self.probe_batch is None and "input_ids" in batch:  # the first batch seen: the fixed probe batch
            self.probe_batch = {k: v.clone() for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        # transformers' Trainer passes num_items_in_batch under gradient accumulation: each micro-batch's loss is
        # then its share of the step's mean, and the step's loss is their sum
        self._shares = kwargs.get("num_items_in_batch") is not None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            value = float(loss.detach())
            self._losses.append(value)
            if self._worst is None or value > self._worst[0]:
                self._worst = (value, batch)

    # -- after the backward, before the gradients are cleared --
    def step(self, step: int, loss: float | None = None) -> dict[str, Any]:
        """Record step ``step``: its loss (the model's, or ``loss`` for a loss computed outside the model),
        the gradient norms, a spike check, and probes every ``every`` steps. Returns the metrics row."""
        if loss is None:
            n = 1 if self._shares else len(self._losses)
            loss = sum(self._losses) / n if self._losses else math.nan
        grads = self._grad_rows(step)
        total = math.sqrt(sum(r["value"] ** 2 for r in grads if r["site"] == "block"))
        row = {"step": step, "loss": loss, "grad_norm": total}
        self.metrics_file.write(json.dumps(row) + "\n")
        threshold = self.spike.threshold(self.history) if self.spike else None
        spiked = threshold is not None and math.isfinite(loss) and loss > threshold
        self.last_step, self._probed_last = step, step % self.every == 0
        if spiked or step % self.every == 0:
            self.writer.write(grads + self._probe_rows(step))
        if spiked:
            self._save_spike(step, loss, threshold)
        if math.isfinite(loss):
            self.history.append(loss)
        self.last_loss = loss
        self._losses, self._worst = [], None
        return row

    def _grad_rows(self, step: int) -> list[dict[str, Any]]:
        rows = []
        for i, block in enumerate(self.blocks):
            total = 0.0
            for path, m in block.named_modules():
                w = getattr(m, "weight", None)
                if isinstance(m, nn.Linear) and w is not None and w.grad is not None:
                    g = float(w.grad.detach().float().norm())
                    total += g * g
                    rows.append({"step": step, "layer": i, "site": path, "metric": "grad_norm", "value": g})
            for p in block.parameters():  # the rest of the block (norms, biases) counts in the block's norm
                if p.grad is not None and p.dim() < 2:
                    total += float(p.grad.detach().float().norm()) ** 2
            rows.append({"step": step, "layer": i, "site": "block", "metric": "grad_norm", "value": math.sqrt(total)})
        return rows

    def _probe_rows(self, step: int, batch: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        batch = batch or self.probe_batch
        rows: list[dict[str, Any]] = []
        if batch is not None:
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            was = self.model.training
            self._probing = True
            handles = self.logits.attach()
            try:
                self.model.eval()
                rows += self.stream.record(step, **inputs)
            finally:
                for h in handles:
                    h.remove()
                self._probing = False
                self.model.train(was)
            rows += self.logits.rows(step)
        for i, block in enumerate(self.blocks):
            for path, norm in _norm_modules(block).items():
                w = norm.weight.detach().float()
                site = self.sites.get(path, path)
                for metric, value in (("gamma_mean", w.mean()), ("gamma_min", w.min()), ("gamma_max", w.max())):
                    rows.append({"step": step, "layer": i, "site": site, "metric": metric, "value": float(value)})
        return rows

    def _save_spike(self, step: int, loss: float, threshold: float) -> None:
        loss_of_batch, batch = self._worst if self._worst is not None else (loss, {})
        path = self.out / "spikes" / f"step_{step}.pt"
        path.parent.mkdir(exist_ok=True)
        buf = io.BytesIO()
        torch.save({"step": step, "loss": loss, "batch_loss": loss_of_batch, "threshold": threshold,
                    "batch": {k: v.cpu() for k, v in batch.items()}}, buf)
        atomic_write_bytes(path, buf.getvalue())
        if batch:  # the offending batch's own probe pass, beside the fixed batch's
            self.writer.write([{**r, "site": f"spike:{r['site']}"} for r in self._probe_rows(step, batch)
                               if r["site"] in ("stream", "global")])
        record = {"step": step, "loss": loss, "threshold": threshold, "batch_loss": loss_of_batch, "file": str(path)}
        self.spikes.append(record)
        with (self.out / "spikes.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> dict[str, Any]:
        """Stop hooking the model; probe the final weights (at the last step + 1, as normlab's trainer probes after
        its last update) unless the last step was probed; write summary.json (status ok, final loss, spikes) and
        close the files."""
        self._hook.remove()
        if self.last_step is not None and not self._probed_last:
            self.writer.write(self._probe_rows(self.last_step + 1))
        self.metrics_file.close()
        self.writer.close()
        summary = {"status": "ok" if math.isfinite(self.last_loss) else "diverged", "final_loss": self.last_loss,
                   "spikes": len(self.spikes), "source": "normlab.diagnostics.monitor"}
        self.run.write_summary(summary)
        return summary
