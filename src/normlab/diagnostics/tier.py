"""The per-step tier: a few numbers per layer at every step (or every Nth: ``run.layer_stats_every``), in
``layers.jsonl``.

Per block l (and the stream entering the first block, layer 0), at each of the tier's optimizer steps:

- stream_max: the largest |x| of the stream leaving block l-1 (layer 0: entering block 0), over the step's micro-batches
- grad_norm: the block's gradient norm (after unscaling, before clipping)
- update_rms: RMS of the update the optimizer applied to the block's parameters, sqrt(sum dW^2 / n)
- update_ratio: ||dW|| / ||W|| over the block (the relative update; Adam's update/parameter ratio)
- max_logit: per head, the largest causal attention logit q.k * scale over sampled queries (exact on the sample)
- max_logit_bound: per head, max_i ||q_i|| * max_j ||k_j|| * |scale| over every token of the sampled sequences: an
  upper bound on every logit of those sequences (Cauchy-Schwarz)

SDPA returns no logits, so they are estimated without forming the T x T scores, on a fixed sample: at most
``sequences`` sequences of each micro-batch (every ceil(B / sequences)-th from the first, so spread over the whole
batch: 8 of 32, 5 of 9, all of a batch of 8 or fewer) and, in each, ``queries`` query positions (evenly spaced, the
last included). ``max_logit`` is exact on the sampled queries against all the keys they attend to;
``max_logit_bound`` bounds every query of the sampled sequences. The true maximum over those sequences lies between
the two. Both are the plain causal logits (before a soft-cap, ignoring
a sliding window), as the probes' ``max_logit``; the probe pass (``run.probe_every``) computes every logit of its
batch exactly.

Why a sample of sequences (8) and not the batch: the bound's row norms are two passes over q and k, the largest
part of the tier (on a 2-core CPU two thirds of the logits' time at small, where the cache does not hold them);
the sample's size fixes the logits' cost whatever the batch (their share of a step falls as the batch grows), and
a logit's growth is the weights' (W_q, W_k and the norms before them), seen in every sequence, where one odd
sequence's activations still reach the stream maxima, which read every token. Measured in docs/benchmarks.md
("The tier's own time").

Eager, the sampled q and k of consecutive layers are copied into one float32 buffer as each layer's attention
runs and their logits computed once for the lot at the blocks' end (`LogitSample`): about 12 operations a layer
become 2 copies a layer and 12 a group. On the CPU each operation is a dispatch of tens of microseconds; on a GPU
each is a launch, and an eager GPU step's CPU time already exceeds its device time (docs/diagnostics.md), so each
launch is paid. The buffer holds at most 256 MiB (gpu-126m at 16 x 1,024 tokens: 5 layers' samples of 8 sequences,
48 MiB each; a micro model's 6 layers: 3 MiB), kept from step to step; a layer of which it would hold fewer than two
is computed where it lies. Under torch.compile each layer's reductions stay where they are (inductor fuses them).

Costs: a max over each block's output, the sampled logits, one pass over the gradients and two over the
block parameters (a copy before the step, the difference after: one extra copy of the block parameters
in memory, of the local shard under FSDP2; eager, the sampled q and k's buffer, at most 256 MiB), and two reads
back to the host per step. Measured in docs/benchmarks.md ("The tier's own time", benchmarks/tier_cadence.py): on
an idle 2-core CPU at cadence 1, eager, 0.77% of a small step and 1.5% of a micro one (0.08%, 0.19% at cadence 10),
compiled within 1% at both (the host's part 0.51-0.54%, 0.56-0.76%; the in-graph part +0.12%, -0.08%); 15-25% of an
eager gpu-126m step on an H100 (before the CPU changes; there the eager step's CPU time already exceeds its device
time: every launch added is paid). The hooks are active from `reset` (a tier
step's forward) to `before_step`, so evaluations, probe passes and spike replays between do
not run them.

Under torch.compile (``compiled=True``: the hooks are registered before the model's first compiled call, and
Dynamo traces forward hooks into the graph) the hooks have no Python state to branch on: every compiled
forward computes the maxima and sampled logits as reductions inside the graph and folds them, in place, into
one device buffer (``torch.maximum`` into its slices; a mutated graph input, no output added). The cadence
stays on the host: `reset` refills the buffer before a tier step's forward and `before_step` copies it, so
the graph is the same at every step and every cadence (no guard on the cadence, no recompile, no graph break:
tests/unit/test_tier_compile.py counts them with torch._dynamo's counters). The price is that the reductions
run in every compiled forward, tier step or not (evaluations included; their values are overwritten by the
next `reset`). The same design as torchtitan's compile-safe tensor statistics (the cadence a host-side
decision, the statistics a fixed part of the graph), written here for the tier's own quantities. Forward
calls outside the compiled graph (the probe pass on the plain module) keep the eager window. With activation
checkpointing, a compiled tier sets torch._dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``
(the recompute in the backward would only record the same maxima again).

Under torchrun the values are reduced across ranks before they are read: the sums of squares of sharded
parameters and gradients (FSDP2) are summed, the activation maxima (each rank saw its share of the batch)
take the maximum; DDP's gradients and weights are the same on every rank and are not summed.

`TierSpikes` applies OLMo's count rule (mean + 6 std of the previous 128 values; `SpikeRule`) to each
layer's gradient norm and stream maximum: a spike there triggers the full probe pass on the same batch (at
most once per probe interval: with two series per layer one fires often; the `spike` rows name every firing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from normlab.diagnostics.shards import is_sharded, local
from normlab.diagnostics.stability import SpikeRule
from normlab.diagnostics.stats import abs_max
from normlab.runs.metrics import Metric, ProbeMetric

QUERIES = 8  # query positions per sequence whose logits are computed exactly
SEQUENCES = 8  # sequences per micro-batch whose queries are sampled (module docstring)
SAMPLE_BYTES = 256 * 2**20  # eager: the float32 copy of consecutive layers' sampled q and k (`LogitSample`)


class StepTier:
    """Hooks a NormLM (or its FSDP2/DDP-unwrapped module) for the per-step tier (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        hooks: bool = True,
        queries: int = QUERIES,
        compiled: bool = False,
        sequences: int = SEQUENCES,
    ) -> None:
        self.blocks: list[nn.Module] = list(model.get_submodule("blocks").children())
        if queries < 1 or sequences < 1:
            raise ValueError(
                f"the tier samples at least one query and one sequence (queries {queries}, sequences {sequences})"
            )
        self.queries = queries
        self.sequences = sequences
        self.params: list[list[torch.Tensor]] = [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]
        self.sharded = any(is_sharded(p) for ps in self.params for p in ps)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.device = local(self.params[0][0]).device
        self.heads = [getattr(b.attn, "n_heads", None) for b in self.blocks]
        self.width = max((x or 1 for x in self.heads), default=1)  # heads per layer in the logit rows
        self.hooked = hooks
        self.compiled = compiled  # the hooks write one device buffer (module docstring) instead of Python lists
        self.active = True  # the hooks' window: from `reset` to `before_step` (outside it they return at once)
        self._handles: list[RemovableHandle] = []
        self._before: WeightCopy | None = None  # the weights before the step (their difference after: the update)
        n, h = len(self.blocks), self.width
        # compiled: [stream (n+1) | logits (n x h) | bounds (n x h)], and what `reset` refills it with
        self._empty = torch.cat(
            [torch.zeros(n + 1, device=self.device), torch.full((2 * n * h,), -math.inf, device=self.device)]
        )
        self._buffer = self._empty.clone()
        self._pending_q: list[torch.Tensor | None] = [None] * n  # a layer's q until its k arrives
        self._streams: list[torch.Tensor | None] = []  # per site: the largest x (CUDA: |x|)
        self._lows: list[torch.Tensor | None] = []  # per site, CPU: the smallest x (|x|'s max taken in `_extremes`)
        self._sample = LogitSample(self._fold_logits, n, queries, sequences)
        self._logits: list[torch.Tensor | None] = []
        self._bounds: list[torch.Tensor | None] = []
        self._pre: dict[str, Any] | None = None
        self._pre_t: tuple[torch.Tensor, torch.Tensor] | None = None
        self._weights: list[float] = []
        self.reset()
        if compiled:
            # With activation checkpointing a block's forward is traced as a checkpoint region, which refuses the
            # hooks' writes (a Python side effect) unless it may skip replaying them in the backward's recompute:
            # eager replays them, recording the same maxima again, so skipping changes no value (process-wide).
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        if hooks:
            self.attach()

    def attach(self) -> None:
        """Install the forward hooks (stream maxima, sampled logits); `remove` takes them off."""
        self._handles.append(self.blocks[0].register_forward_pre_hook(self._entering))
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._leaving(i, o)))
            self._handles.append(
                block.get_submodule("attn.q").register_forward_hook(lambda m, a, o, i=i: self._tap(i, "q", o))
            )
            self._handles.append(
                block.get_submodule("attn.k").register_forward_hook(lambda m, a, o, i=i: self._tap(i, "k", o))
            )

    def reset(self) -> None:
        """Before a tier step's forward: the maxima start again and the hooks record until `before_step`."""
        self.active = True
        n = len(self.blocks)
        # One 0-d / (heads,) tensor per site, kept apart and stacked once in `before_step`: indexing a step-wide
        # buffer from every hook cost a launch per write (on CUDA the forward is partly launch-bound).
        self._streams = [None] * (n + 1)
        self._lows = [None] * (n + 1)
        self._sample.discard()
        self._logits = [None] * n
        self._bounds = [None] * n
        self._pending_q = [None] * n
        self._pre = None
        if self.compiled:
            self._buffer.copy_(self._empty)  # in place: the compiled graph holds this tensor

    # -- the forward: stream maxima and sampled logits --
    def _recording(self) -> bool:
        """Whether a hook records: always inside a compiled graph (no Python branch there: module docstring),
        else in the window from `reset` to `before_step`."""
        return torch.compiler.is_compiling() or self.active

    def _keep(self, start: int, value: torch.Tensor) -> None:
        """Compiled: fold ``value`` into the step's maximum in the buffer's slice from ``start`` (module docstring)."""
        seg = self._buffer[start : start + value.numel()]
        seg.copy_(torch.maximum(seg, value.reshape(seg.shape)))

    def _stream(self, i: int, x: torch.Tensor) -> None:
        """Fold the stream x into site i's maximum of |x|. Compiled, and on CUDA, one reduction (`abs_max`); eager on
        the CPU, ``aminmax``, its two ends combined for every site at once in `_extremes` (on the CPU each call is a
        dispatch of tens of microseconds, three a site otherwise)."""
        if self.compiled:
            self._keep(i, abs_max(x))
        elif x.device.type == "cuda":
            _keep_max(self._streams, i, abs_max(x))
        else:
            lo, hi = torch.aminmax(x.detach())
            _keep_max(self._streams, i, hi)
            old = self._lows[i]
            self._lows[i] = lo if old is None else torch.minimum(old, lo)

    def _entering(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._recording() and args and isinstance(args[0], torch.Tensor):
            self._stream(0, args[0])

    def _leaving(self, i: int, out: Any) -> None:
        if not self._recording():
            return
        self._stream(i + 1, out[0] if isinstance(out, tuple) else out)
        if not self.compiled and i == len(self.blocks) - 1:  # the blocks' end: the micro-batch's sampled logits
            self._sample.flush()

    def _tap(self, i: int, which: str, x: torch.Tensor) -> None:
        if not self._recording():
            return
        if which == "q":
            self._pending_q[i] = x.detach()
            return
        q = self._pending_q[i]
        if q is None:
            return
        self._pending_q[i] = None
        scale = getattr(self.blocks[i].attn, "scale", None) or q.shape[-1] ** -0.5
        if not self.compiled:  # with the next layers' (`LogitSample`), into `_fold_logits`
            self._sample.add(i, q, x.detach(), scale)
            return
        logit, bound = sampled_logits(q, x.detach(), scale, self.queries, self.sequences)
        if len(logit) > self.width:
            raise ValueError(f"a block reported more than the {self.width} heads its attention declares")
        n, h = len(self.blocks), self.width
        self._keep(n + 1 + i * h, logit)
        self._keep(n + 1 + (n + i) * h, bound)

    def _fold_logits(self, layers: list[int], exact: torch.Tensor, bound: torch.Tensor) -> None:
        """Eager: the sampled logits and bounds of ``layers`` ((layers, heads) each) into the step's maxima (a block
        with more heads than its attention declares is refused in `_extremes`)."""
        for i, e, b in zip(layers, exact.unbind(0), bound.unbind(0)):
            _keep_max(self._logits, i, e)
            _keep_max(self._bounds, i, b)

    def _extremes(self) -> torch.Tensor:
        """The step's maxima as one vector: stream (n+1; 0 where the forward did not run the hooks), then logits
        and bounds (n x heads each, -inf padded and where no hook ran)."""
        h = self.width

        def row(t: torch.Tensor | None) -> torch.Tensor:
            if t is None:
                return torch.full((h,), -math.inf, device=self.device)
            if len(t) > h:
                raise ValueError(f"a block reported more than the {h} heads its attention declares")
            # padded only where a block has fewer heads than the widest: no operation per block otherwise (on
            # CUDA each would be a launch, every tier step)
            return t if len(t) == h else torch.nn.functional.pad(t, (0, h - len(t)), value=-math.inf)

        zero = torch.zeros((), device=self.device)
        stream = torch.stack([zero if t is None else t for t in self._streams]).float()
        if any(t is not None for t in self._lows):  # the CPU's ends (`_stream`): max |x| = max(max x, -min x)
            stream = torch.maximum(stream, torch.stack([zero if t is None else t for t in self._lows]).float().neg())
        return torch.cat([stream, *map(row, self._logits), *map(row, self._bounds)])

    # -- around the optimizer step --
    @torch.no_grad()
    def before_step(self) -> None:
        """After the backward (gradients unscaled, not yet clipped): gradient and weight norms per block, and a
        copy of the weights for the update. Ends the hooks' window (`reset` opens the next)."""
        self.active = False
        self._sample.flush()  # a forward that ended before the last block (the hooks' window closes here)
        grads = [[local(p.grad) for p in ps if p.grad is not None] for ps in self.params]
        weights = self._local_weights()
        if self._before is None:
            self._before = WeightCopy(weights)
        self._before.load(weights)
        # the weight norms from the copy: one slice a block (per dtype) instead of one tensor a parameter
        sums = _sumsq_by_group(grads + self._before.slices, self.device)
        if self.sharded:
            dist.all_reduce(sums)
        extremes = self._buffer.clone() if self.compiled else self._extremes()
        if self.world > 1 and self.hooked:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        self._pre_t = (sums, extremes)

    def _local_weights(self) -> list[list[torch.Tensor]]:
        """Each block's parameters as this rank holds them (FSDP2: the local shards); the parameters themselves
        otherwise, no operation per tensor (the tier reads them under no_grad)."""
        return [[local(p) for p in ps] for ps in self.params] if self.sharded else self.params

    def read(self) -> dict[str, Any]:
        """The values of `before_step` on the host (one read-back): grad_norm, stream_max, logits by layer."""
        if self._pre_t is None:
            raise RuntimeError("StepTier.read before before_step: no values yet")
        sums, extremes = self._pre_t
        n, h = len(self.blocks), self.width
        s, e = sums.tolist(), extremes.tolist()
        self._weights = s[n:]
        out: dict[str, Any] = {ProbeMetric.GRAD_NORM: [math.sqrt(v) for v in s[:n]]}
        if self.hooked:
            out[ProbeMetric.STREAM_MAX] = e[: n + 1]
            logit, bound = e[n + 1 : n + 1 + n * h], e[n + 1 + n * h :]
            out[ProbeMetric.MAX_LOGIT] = [
                [v for v in logit[i * h : (i + 1) * h][: self.heads[i] or 1]] for i in range(n)
            ]
            out[ProbeMetric.MAX_LOGIT_BOUND] = [
                [v for v in bound[i * h : (i + 1) * h][: self.heads[i] or 1]] for i in range(n)
            ]
        self._pre = out
        return out

    @torch.no_grad()
    def after_step(self, applied: bool) -> dict[str, Any]:
        """After the optimizer step: update RMS and update/weight ratio per block (0 for a skipped step); the
        step's whole row."""
        pre = self._pre if self._pre is not None else self.read()
        n = len(self.blocks)
        if applied and self._before is not None:
            self._before.subtract(self._local_weights())  # the copy becomes -dW
            upd = _sumsq_by_group(self._before.slices, self.device)
            if self.sharded:
                dist.all_reduce(upd)
            upd_l = upd.tolist()
        else:
            upd_l = [0.0] * n
        counts = [sum(p.numel() for p in ps) for ps in self.params]
        row = dict(pre)
        row[ProbeMetric.UPDATE_RMS] = [math.sqrt(u / c) if c else 0.0 for u, c in zip(upd_l, counts)]
        row[ProbeMetric.UPDATE_RATIO] = [
            math.sqrt(u) / math.sqrt(w) if w > 0 else 0.0 for u, w in zip(upd_l, self._weights)
        ]
        return row

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._sample.release()


class WeightCopy:
    """One copy of parameter groups (the tier's blocks) in one flat buffer per dtype: the weights before a step,
    whose difference from the weights after is the update. A group's parameters of one dtype lie in one slice
    (`slices`), so a group's norm is one reduction a slice instead of one a tensor, and the copy and the difference
    one multi-tensor call each (``torch._foreach_copy_``, ``_foreach_sub_``) into the views shaped as the tensors:
    on the CPU each per-tensor call from Python is a dispatch of a few microseconds, and a micro model's 6 blocks
    hold 66 tensors (written here: no torch API keeps a flat copy of a list of tensors of several dtypes with views
    per group)."""

    def __init__(self, groups: list[list[torch.Tensor]]) -> None:
        sizes: dict[torch.dtype, int] = {}  # each dtype's buffer length so far
        starts: list[list[int]] = []  # each parameter's offset in its dtype's buffer
        spans: list[dict[torch.dtype, list[int]]] = []  # per group: dtype -> [start, end) in that dtype's buffer
        for g, ps in enumerate(groups):
            span: dict[torch.dtype, list[int]] = {}
            starts.append([])
            for p in ps:
                start = sizes.get(p.dtype, 0)
                sizes[p.dtype] = start + p.numel()
                span.setdefault(p.dtype, [start, start])[1] = start + p.numel()
                starts[g].append(start)
            spans.append(span)
        device = next((t.device for ts in groups for t in ts), torch.device("cpu"))
        self.flat = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self.slices = [[self.flat[dtype][a:b] for dtype, (a, b) in span.items()] for span in spans]
        # each parameter's place, shaped as it
        self.views = [
            [self.flat[p.dtype][a : a + p.numel()].view(p.shape) for p, a in zip(ps, at)]
            for ps, at in zip(groups, starts)
        ]
        self._all_views = [v for vs in self.views for v in vs]

    @torch.no_grad()
    def load(self, groups: list[list[torch.Tensor]]) -> None:
        """Copy the groups' tensors in (the same tensors, shapes and dtypes as at construction)."""
        torch._foreach_copy_(self._all_views, [t for ts in groups for t in ts])

    @torch.no_grad()
    def subtract(self, groups: list[list[torch.Tensor]]) -> None:
        """copy -= groups, in place (after the step: the copy becomes -dW)."""
        torch._foreach_sub_(self._all_views, [t for ts in groups for t in ts])


def _keep_max(parts: list[torch.Tensor | None], i: int, value: torch.Tensor) -> None:
    """parts[i] = max(parts[i], value): the maxima over a step's micro-batches."""
    old = parts[i]
    parts[i] = value if old is None else torch.maximum(old, value)


_OWNERS: dict[
    tuple[Any, ...], torch.Tensor
] = {}  # group sizes and device -> the owner index (made once, not each step)


def _sumsq_by_group(groups: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Each group's sum of squares, (len(groups),): one fused norm over every tensor, then summed per group
    (one kernel launch for the lot instead of one per block: the tier may run every step)."""
    # accumulated in float32 (a float64 tensor narrowed first: the norm's dtype may not narrow)
    tensors = [t.float() if t.dtype == torch.float64 else t for g in groups for t in g]
    out = torch.zeros(len(groups), device=device)
    if tensors:
        key = (str(device), *(len(g) for g in groups))
        owner = _OWNERS.get(key)
        if owner is None:
            owner = _OWNERS[key] = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=device)
        out.index_add_(0, owner, torch.stack(torch._foreach_norm(tensors, dtype=torch.float32)).pow(2))
    return out


_SAMPLES: dict[
    tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]
] = {}  # (T, queries, device) -> query rows, causal mask


def _sample_rows(t: int, queries: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled query positions (``queries`` evenly spaced over ``t``, the last included) and, for each, the
    keys after it (True: masked)."""
    idx = torch.linspace(0, t - 1, min(queries, t), device=device).round().long()
    return idx, torch.arange(t, device=device)[None, :] > idx[:, None]


def _sequence_sample(x: torch.Tensor, sequences: int) -> torch.Tensor:
    """At most ``sequences`` of x's (dim 0): every ceil(B / sequences)-th from the first, a view spread over the
    whole batch. Under torch.compile with a batch size marked dynamic, the stride is a guard: a batch whose stride
    differs (an evaluation's smaller batch) compiles once more."""
    every = (x.shape[0] + sequences - 1) // sequences
    return x[::every]


def _query_rows(t: int, queries: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`_sample_rows`, made once per (T, queries, device) in eager mode; inside a compiled graph made there
    (constants of the graph: a cache lookup would add guards)."""
    if torch.compiler.is_compiling():
        return _sample_rows(t, queries, device)
    key = (t, queries, str(device))
    if key not in _SAMPLES:
        if len(_SAMPLES) > 64:  # sequence lengths vary (evaluations, generation): keep the cache small
            _SAMPLES.clear()
        with torch.inference_mode(False):  # ordinary tensors, usable later with gradients on
            _SAMPLES[key] = _sample_rows(t, queries, device)
    return _SAMPLES[key]


def layer_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, queries: int = QUERIES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and head, from the sampled sequences' q (L, H, S, T, d) and k (L, H_kv, S, T, d) (any strides and
    float dtype): (the largest causal logit q_t.k_s * scale, s <= t, over ``queries`` evenly spaced query positions t
    of each sequence, the last included: exact on that sample; max_t ||q_t|| * max_s ||k_s|| * |scale| over every
    token: a bound on every logit of those sequences, Cauchy-Schwarz), (L, H) each, float32.

    Query head h = j * group + r reads key head j, as the attention's repeat_interleave pairs them: the group's
    queries are rows of one product, one batched product over (layer, key head, sequence) for the lot; no product
    mixes heads, so a query head whose q overflowed leaves the others' maxima finite, and a key head that overflowed
    reaches only its group's query heads. The scale multiplies the sampled queries (a negative one flips their sign:
    the largest logit is still a maximum); the maximum over the sequences comes before the causal mask, on
    (L, H, queries, T): the same maximum as masking every sequence's logits (the mask does not depend on the
    sequence), at an S-th of the masking."""
    n_layers, h, s, t, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    idx, future = _query_rows(t, queries, q.device)
    n = len(idx)
    rows = (q.index_select(3, idx).float() * scale).view(n_layers, hkv, group, s, n, d)
    rows = rows.transpose(2, 3).reshape(n_layers * hkv * s, group * n, d)  # a view without GQA
    keys = k.float().reshape(n_layers * hkv * s, t, d)  # a view for `LogitSample`'s buffer
    top = torch.bmm(rows, keys.transpose(1, 2)).view(n_layers, hkv, s, group, n, t).amax(2)
    exact = top.view(n_layers, h, n, t).masked_fill(future, -math.inf).amax(dim=(2, 3))
    q_norm, k_norm = _max_row_norms(q), _max_row_norms(k)
    if group > 1:  # each query head's key head
        k_norm = k_norm.repeat_interleave(group, dim=1)
    return exact, q_norm * k_norm * abs(scale)


def _max_row_norms(x: torch.Tensor) -> torch.Tensor:
    """max over (S, T) of ||x_t|| per layer and head of x (L, H, S, T, d), float32: (L, H)."""
    out: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).amax(dim=(2, 3))
    return out


def sampled_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, queries: int = QUERIES, sequences: int = SEQUENCES
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's `layer_logits` over at most ``sequences`` sequences spread over the batch (`_sequence_sample`):
    (exact, bound), (H,) each. q: (B, H, T, d), k: (B, H_kv, T, d)."""
    q, k = _sequence_sample(q, sequences), _sequence_sample(k, sequences)
    exact, bound = layer_logits(q.transpose(0, 1)[None], k.transpose(0, 1)[None], scale, queries)
    return exact[0], bound[0]


class LogitSample:
    """Eager: the sampled sequences' q and k of consecutive layers, copied as each layer's attention runs into one
    float32 buffer, and their logits (`layer_logits`) computed once for the lot, handed to ``fold`` (layers, exact,
    bound). Each operation costs a fixed dispatch (the CPU: tens of microseconds whatever its size; a GPU: a launch):
    a layer's logits are about 12, so a micro model's 6 layers cost 72 a micro-batch one at a time and 12 together
    (plus 2 copies a layer). The buffer holds at most ``budget`` bytes; a layer of which it would hold fewer than
    two is computed where it lies, without the copy.
    `flush` computes what the buffer holds: when it is full, when a layer of another shape or scale comes, at the
    blocks' end (`StepTier._leaving`) and before the step. Written here: torch fuses such reductions only by
    compiling, which an eager run does not."""

    def __init__(
        self,
        fold: Callable[[list[int], torch.Tensor, torch.Tensor], None],
        layers: int,
        queries: int = QUERIES,
        sequences: int = SEQUENCES,
        budget: int = SAMPLE_BYTES,
    ) -> None:
        self.fold, self.max_layers, self.queries, self.sequences, self.budget = fold, layers, queries, sequences, budget
        self.layers: list[int] = []  # the buffer's layers, in its order
        self._key: tuple[Any, ...] | None = None  # their shapes, device and scale (last)
        self._flat: torch.Tensor | None = None  # the one buffer, as large as the largest group so far
        self._views: dict[
            tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]
        ] = {}  # key -> its q and k views of the buffer

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        """Layer ``layer``'s q (B, H, T, d) and k (B, H_kv, T, d): sampled, and copied or computed."""
        q, k = _sequence_sample(q, self.sequences), _sequence_sample(k, self.sequences)
        (s, h, t, d), hkv = q.shape, k.shape[1]
        key = (s, h, hkv, t, d, str(q.device), scale)
        if key != self._key:
            self.flush()
        cap = min(self.budget // ((h + hkv) * s * t * d * 4), self.max_layers)
        if cap < 2:  # nothing to share: this layer's operations on its own sample
            exact, bound = layer_logits(q.transpose(0, 1)[None], k.transpose(0, 1)[None], scale, self.queries)
            self.fold([layer], exact, bound)
            return
        if key not in self._views:
            self._views[key] = self._place(cap, (h, hkv, s, t, d), q.device)
        qs, ks = self._views[key]
        j = len(self.layers)
        qs[j].copy_(q.transpose(0, 1))
        ks[j].copy_(k.transpose(0, 1))
        self.layers.append(layer)
        self._key = key
        if len(self.layers) == cap:
            self.flush()

    def _place(
        self, cap: int, shape: tuple[int, int, int, int, int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the buffer for ``cap`` layers' q (cap, H, S, T, d) and k (cap, H_kv, S, T, d): one buffer for
        every shape (a group is computed before the next shape's begins), grown when a shape needs more."""
        h, hkv, s, t, d = shape
        per_head = s * t * d
        need = cap * (h + hkv) * per_head
        split = cap * h * per_head
        # ordinary tensors and views even when made in an inference-mode forward (the next training step writes them)
        with torch.inference_mode(False):
            if self._flat is None or self._flat.numel() < need or self._flat.device != device:
                self._flat = torch.empty(need, dtype=torch.float32, device=device)
                self._views.clear()  # views of the old buffer
            return self._flat[:split].view(cap, h, s, t, d), self._flat[split:need].view(cap, hkv, s, t, d)

    def flush(self) -> None:
        """The buffer's layers' logits, to ``fold``; the buffer is free again."""
        if not self.layers:
            return
        assert self._key is not None  # set with the first layer
        qs, ks = self._views[self._key]
        n = len(self.layers)
        exact, bound = layer_logits(qs[:n], ks[:n], self._key[-1], self.queries)
        layers, self.layers = self.layers, []
        self.fold(layers, exact, bound)

    def discard(self) -> None:
        """Forget the buffer's layers (a new step's forward begins)."""
        self.layers = []

    def release(self) -> None:
        """Forget the buffer itself (the tier is taken off)."""
        self.layers, self._key, self._flat = [], None, None
        self._views.clear()


def tier_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For summary.json: each tier metric's largest value over the run, with its step and layer (and head)."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        for key, values in r.items():
            if key == Metric.STEP or not isinstance(values, list):
                continue
            for layer, v in enumerate(values):
                for head, x in enumerate(v) if isinstance(v, list) else [(None, v)]:
                    if isinstance(x, (int, float)) and math.isfinite(x) and (key not in best or x > best[key]["value"]):
                        best[key] = {
                            "value": x,
                            Metric.STEP: r.get(Metric.STEP),
                            "layer": layer,
                            **({"head": head} if head is not None else {}),
                        }
    return best or None


class TierSpikes:
    """OLMo's count rule on each layer's gradient norm and stream maximum: value > mean + sigmas * std of the
    previous ``window`` finite values of its series (population std), once ``min_history`` are known.

    Every series' window lives in one array (a row a series, a ring of ``window`` columns), and the thresholds of
    all the series whose windows hold as many values are one mean and one std over their rows: per series one numpy
    call each cost about 20 microseconds, 1.1 ms a step at 24 layers (49 series), paid on the host every tier step.
    Each row is read oldest first, so each threshold is the one `SpikeRule.threshold` computes over the same
    values (`SpikeRule.limits`)."""

    def __init__(self, sigmas: float = 6.0, window: int = 128, min_history: int = 16) -> None:
        self.rule = SpikeRule(sigmas, window, min_history)
        self._row: dict[str, int] = {}  # each series' row, in the order they came
        self._values = np.zeros((0, window))  # each series' last values, a ring
        self._count = np.zeros(0, dtype=np.int64)  # how many it holds (at most window)
        self._next = np.zeros(0, dtype=np.int64)  # where its next value goes
        self._labels: dict[tuple[str, int], list[str]] = {}  # (metric, layers) -> the series' names

    def history(self, name: str) -> list[float]:
        """Series ``name``'s window, oldest first (empty for a series not seen)."""
        if name not in self._row:
            return []
        i, w = self._row[name], self.rule.window
        n = int(self._count[i])
        values: list[float] = self._values[i, (self._next[i] - n + np.arange(n)) % w].tolist()
        return values

    def check(self, row: dict[str, Any]) -> list[str]:
        """The series of this row that spiked (e.g. ``grad_norm[3]``); every finite value enters its window."""
        names: list[str] = []
        values: list[float] = []
        for key in (ProbeMetric.GRAD_NORM, ProbeMetric.STREAM_MAX):
            series = row.get(key) or []
            label = self._labels.get((key, len(series)))
            if label is None:
                label = self._labels[(key, len(series))] = [f"{key}[{layer}]" for layer in range(len(series))]
            names += label
            values += series
        if not names:
            return []
        rows = np.array([self._place(n) for n in names], dtype=np.int64)
        v = np.array(values, dtype=np.float64)
        limit = np.full(len(v), np.inf)
        count = self._count[rows]
        w = self.rule.window
        for n in np.unique(count[count >= self.rule.min_history]):  # one vectorized threshold per window length
            at = np.nonzero(count == n)[0]
            r = rows[at]
            window = self._values[r[:, None], (self._next[r][:, None] - n + np.arange(n)) % w]  # oldest first
            limit[at] = self.rule.limits(window)
        finite = np.isfinite(v)
        fired = [names[i] for i in np.nonzero(finite & (v > limit))[0]]
        r = rows[finite]
        self._values[r, self._next[r]] = v[finite]
        self._next[r] = (self._next[r] + 1) % w
        self._count[r] = np.minimum(self._count[r] + 1, w)
        return fired

    def _place(self, name: str) -> int:
        """Series ``name``'s row, added empty the first time."""
        i = self._row.get(name)
        if i is None:
            i = self._row[name] = len(self._row)
            self._values = np.vstack([self._values, np.zeros((1, self.rule.window))])
            self._count = np.append(self._count, 0)
            self._next = np.append(self._next, 0)
        return i
