"""The per-step tier: a few numbers per layer at every step (or every Nth: ``run.layer_stats_every``), in
``layers.jsonl``.

Per block l (and the stream entering the first block, layer 0), at each of the tier's optimizer steps:

- stream_max: the largest |x| of the stream leaving block l-1 (layer 0: entering block 0), over the step's micro-batches
- grad_norm: the block's gradient norm (after unscaling, before clipping)
- update_rms: RMS of the update the optimizer applied to the block's parameters, sqrt(sum dW^2 / n)
- update_ratio: ||dW|| / ||W|| over the block (the relative update; Adam's update/parameter ratio)
- max_logit: per head, the largest causal attention logit q.k * scale over sampled queries (exact on the sample)
- max_logit_bound: per head, max_i ||q_i|| * max_j ||k_j|| * scale over every token: an upper bound on every logit
  (Cauchy-Schwarz)

SDPA returns no logits, so they are estimated without forming the T x T scores: ``max_logit`` computes
the exact logits of ``queries`` query positions (evenly spaced, the last included) of every sequence
against all the keys they attend to (a fraction queries / T of the score computation), and
``max_logit_bound`` bounds the logits of every query. The true maximum lies between the two. Both are
the plain causal logits (before a soft-cap, ignoring a sliding window), as the probes' ``max_logit``.

Costs: a max over each block's output, the sampled logits, one pass over the gradients and two over the
block parameters (a copy before the step, the difference after: one extra copy of the block parameters
in memory, of the local shard under FSDP2), and two reads back to the host per step. Measured in
docs/benchmarks.md: about 2% of a step on the CPU, 15-25% of an eager gpu-126m step on an H100, where the
eager step's CPU time already exceeds its device time (every launch added is paid). The hooks are active from
`reset` (a tier step's forward) to `before_step`, so evaluations, probe passes and spike replays between do
not run them. The hooks are not installed on a compiled model (a hook inside a torch.compile graph breaks
it): there, stream_max and the logits are absent from the rows and the rest is recorded.

Under torchrun the values are reduced across ranks before they are read: the sums of squares of sharded
parameters and gradients (FSDP2) are summed, the activation maxima (each rank saw its share of the batch)
take the maximum; DDP's gradients and weights are the same on every rank and are not summed.

`TierSpikes` applies OLMo's count rule (mean + 6 std of the previous 128 values; `SpikeRule`) to each
layer's gradient norm and stream maximum: a spike there triggers the full probe pass on the same batch (at
most once per probe interval: with two series per layer one fires often; the `spike` rows name every firing).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from normlab.diagnostics.shards import is_sharded, local
from normlab.diagnostics.training_monitor import SpikeRule

QUERIES = 8  # query positions per sequence whose logits are computed exactly


class StepTier:
    """Hooks a NormLM (or its FSDP2/DDP-unwrapped module) for the per-step tier (module docstring)."""

    def __init__(self, model: nn.Module, hooks: bool = True, queries: int = QUERIES) -> None:
        self.blocks = list(model.blocks)
        self.queries = queries
        self.params = [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]
        self.sharded = any(is_sharded(p) for ps in self.params for p in ps)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.device = local(self.params[0][0]).device
        self.heads = [getattr(b.attn, "n_heads", None) for b in self.blocks]
        self.width = max((x or 1 for x in self.heads), default=1)  # heads per layer in the logit rows
        self.hooked = hooks
        self.active = True  # the hooks' window: from `reset` to `before_step` (outside it they return at once)
        self._handles: list = []
        self._before: list[list[torch.Tensor]] | None = None
        self._qk: dict[int, torch.Tensor] = {}
        self.reset()
        if hooks:
            self.attach()

    def attach(self) -> None:
        """Install the forward hooks (stream maxima, sampled logits); `remove` takes them off."""
        self._handles.append(self.blocks[0].register_forward_pre_hook(self._entering))
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._leaving(i, o)))
            self._handles.append(block.attn.q.register_forward_hook(lambda m, a, o, i=i: self._tap(i, "q", o)))
            self._handles.append(block.attn.k.register_forward_hook(lambda m, a, o, i=i: self._tap(i, "k", o)))

    def reset(self) -> None:
        """Before a tier step's forward: the maxima start again and the hooks record until `before_step`."""
        self.active = True
        n = len(self.blocks)
        # One 0-d / (heads,) tensor per site, kept apart and stacked once in `before_step`: indexing a step-wide
        # buffer from every hook cost a launch per write (on CUDA the forward is partly launch-bound).
        self._streams: list[torch.Tensor | None] = [None] * (n + 1)
        self._logits: list[torch.Tensor | None] = [None] * n
        self._bounds: list[torch.Tensor | None] = [None] * n
        self._qk = {}
        self._pre: list[float] | None = None

    # -- the forward: stream maxima and sampled logits --
    @torch.no_grad()
    def _entering(self, module: nn.Module, args: tuple) -> None:
        if self.active and args and isinstance(args[0], torch.Tensor):
            _keep_max(self._streams, 0, _abs_max(args[0]))

    @torch.no_grad()
    def _leaving(self, i: int, out: Any) -> None:
        if not self.active:
            return
        x = out[0] if isinstance(out, tuple) else out
        _keep_max(self._streams, i + 1, _abs_max(x))

    @torch.no_grad()
    def _tap(self, i: int, which: str, x: torch.Tensor) -> None:
        if not self.active:
            return
        key = 2 * i + (which == "k")
        self._qk[key] = x.detach()
        q, k = self._qk.get(2 * i), self._qk.get(2 * i + 1)
        if q is None or k is None:
            return
        del self._qk[2 * i], self._qk[2 * i + 1]
        scale = getattr(self.blocks[i].attn, "scale", None) or q.shape[-1] ** -0.5
        logit, bound = sampled_logits(q, k, scale, self.queries)
        _keep_max(self._logits, i, logit)
        _keep_max(self._bounds, i, bound)

    def _extremes(self) -> torch.Tensor:
        """The step's maxima as one vector: stream (n+1; 0 where the forward did not run the hooks), then logits
        and bounds (n x heads each, -inf padded and where no hook ran)."""
        h = self.width
        zero, none = torch.zeros((), device=self.device), torch.full((h,), -math.inf, device=self.device)

        def rows(parts: list[torch.Tensor | None]) -> list[torch.Tensor]:
            if any(t is not None and len(t) > h for t in parts):
                raise ValueError(f"a block reported more than the {h} heads its attention declares")
            return [none if t is None else torch.nn.functional.pad(t, (0, h - len(t)), value=-math.inf) for t in parts]

        stream = torch.stack([zero if t is None else t for t in self._streams])
        return torch.cat([stream, *rows(self._logits), *rows(self._bounds)])

    # -- around the optimizer step --
    @torch.no_grad()
    def before_step(self) -> None:
        """After the backward (gradients unscaled, not yet clipped): gradient and weight norms per block, and a
        copy of the weights for the update. Ends the hooks' window (`reset` opens the next)."""
        self.active = False
        grads = [[local(p.grad) for p in ps if p.grad is not None] for ps in self.params]
        sums = _sumsq_by_group(grads + [[local(p) for p in ps] for ps in self.params], self.device)
        if self.sharded:
            dist.all_reduce(sums)
        extremes = self._extremes()
        if self.world > 1 and self.hooked:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        self._pre_t = (sums, extremes)
        if self._before is None:
            self._before = [[local(p).detach().clone() for p in ps] for ps in self.params]
        else:
            for buf, ps in zip(self._before, self.params):
                torch._foreach_copy_(buf, [local(p).detach() for p in ps])

    def read(self) -> dict[str, Any]:
        """The values of `before_step` on the host (one read-back): grad_norm, stream_max, logits by layer."""
        sums, extremes = self._pre_t
        n, h = len(self.blocks), self.width
        s, e = sums.tolist(), extremes.tolist()
        self._weights = s[n:]
        out: dict[str, Any] = {"grad_norm": [math.sqrt(v) for v in s[:n]]}
        if self.hooked:
            out["stream_max"] = e[: n + 1]
            logit, bound = e[n + 1 : n + 1 + n * h], e[n + 1 + n * h :]
            out["max_logit"] = [[v for v in logit[i * h : (i + 1) * h][: self.heads[i] or 1]] for i in range(n)]
            out["max_logit_bound"] = [[v for v in bound[i * h : (i + 1) * h][: self.heads[i] or 1]] for i in range(n)]
        self._pre = out
        return out

    @torch.no_grad()
    def after_step(self, applied: bool) -> dict[str, Any]:
        """After the optimizer step: update RMS and update/weight ratio per block (0 for a skipped step); the
        step's whole row."""
        if self._pre is None:
            self.read()
        n = len(self.blocks)
        if applied:
            for buf, ps in zip(self._before, self.params):
                torch._foreach_sub_(buf, [local(p).detach() for p in ps])  # the copy becomes -dW
            upd = _sumsq_by_group(self._before, self.device)
            if self.sharded:
                dist.all_reduce(upd)
            upd_l = upd.tolist()
        else:
            upd_l = [0.0] * n
        counts = [sum(p.numel() for p in ps) for ps in self.params]
        row = dict(self._pre)
        row["update_rms"] = [math.sqrt(u / c) if c else 0.0 for u, c in zip(upd_l, counts)]
        row["update_ratio"] = [math.sqrt(u) / math.sqrt(w) if w > 0 else 0.0 for u, w in zip(upd_l, self._weights)]
        return row

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| in float32, one reduction kernel (``x.abs().amax()`` writes |x| first)."""
    return torch.linalg.vector_norm(x.detach(), ord=math.inf, dtype=torch.float32)


def _keep_max(parts: list[torch.Tensor | None], i: int, value: torch.Tensor) -> None:
    """parts[i] = max(parts[i], value): the maxima over a step's micro-batches."""
    old = parts[i]
    parts[i] = value if old is None else torch.maximum(old, value)


_OWNERS: dict[tuple, torch.Tensor] = {}  # group sizes and device -> the owner index (made once, not each step)


def _sumsq_by_group(groups: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Each group's sum of squares, (len(groups),): one fused norm over every tensor, then summed per group
    (one kernel launch for the lot instead of one per block: the tier may run every step)."""
    tensors = [t.float() if t.dtype != torch.float32 else t for g in groups for t in g]
    out = torch.zeros(len(groups), device=device)
    if tensors:
        key = (str(device), *(len(g) for g in groups))
        owner = _OWNERS.get(key)
        if owner is None:
            owner = _OWNERS[key] = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=device)
        out.index_add_(0, owner, torch.stack(torch._foreach_norm(tensors)).pow(2))
    return out


_SAMPLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (T, queries, device) -> query rows, causal mask


def sampled_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, queries: int = QUERIES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: (the largest causal logit q_t.k_s * scale, s <= t, over ``queries`` evenly spaced query
    positions t of every sequence (the last included): exact on that sample; max_t ||q_t|| * max_s ||k_s|| *
    scale: a bound on every logit). q: (B, H, T, d), k: (B, H_kv, T, d)."""
    t = q.shape[-2]
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    key = (t, queries, str(q.device))
    if key not in _SAMPLES:
        if len(_SAMPLES) > 64:  # sequence lengths vary (evaluations, generation): keep the cache small
            _SAMPLES.clear()
        with torch.inference_mode(False):  # ordinary tensors, usable later with gradients on
            idx = torch.linspace(0, t - 1, min(queries, t), device=q.device).round().long()
            _SAMPLES[key] = idx, torch.arange(t, device=q.device)[None, :] > idx[:, None]
    idx, future = _SAMPLES[key]
    logits = (q[:, :, idx].float() * scale) @ k.float().transpose(-1, -2)  # (B, H, queries, T)
    exact = logits.masked_fill(future, -math.inf).amax(dim=(0, 2, 3))
    norm = torch.linalg.vector_norm  # in float32 without a float copy of q and k
    bound = norm(q, dim=-1, dtype=torch.float32).amax(dim=(0, 2)) * norm(k, dim=-1, dtype=torch.float32).amax(
        dim=(0, 2)
    )
    return exact, bound * abs(scale)


def tier_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For summary.json: each tier metric's largest value over the run, with its step and layer (and head)."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        for key, values in r.items():
            if key == "step" or not isinstance(values, list):
                continue
            for layer, v in enumerate(values):
                for head, x in enumerate(v) if isinstance(v, list) else [(None, v)]:
                    if isinstance(x, (int, float)) and math.isfinite(x) and (key not in best or x > best[key]["value"]):
                        best[key] = {
                            "value": x,
                            "step": r.get("step"),
                            "layer": layer,
                            **({"head": head} if head is not None else {}),
                        }
    return best or None


class TierSpikes:
    """OLMo's count rule on each layer's gradient norm and stream maximum: value > mean + sigmas * std of the
    previous ``window`` values (population std), once ``min_history`` are known."""

    def __init__(self, sigmas: float = 6.0, window: int = 128, min_history: int = 16) -> None:
        self.rule = SpikeRule(sigmas, window, min_history)
        self.history: dict[str, deque] = {}

    def check(self, row: dict[str, Any]) -> list[str]:
        """The series of this row that spiked (e.g. ``grad_norm[3]``); every finite value enters its window."""
        fired = []
        for key in ("grad_norm", "stream_max"):
            for layer, v in enumerate(row.get(key) or []):
                name = f"{key}[{layer}]"
                h = self.history.setdefault(name, deque(maxlen=self.rule.window))
                limit = self.rule.threshold(h) if math.isfinite(v) else None
                if limit is not None and v > limit:
                    fired.append(name)
                if math.isfinite(v):
                    h.append(v)
        return fired
