"""The probe pass: one eager forward/backward on a fixed batch, recorded as tidy rows.

`Probes(model, batch).record(step)` returns rows ``{"step", "layer", "site", "metric", "value"}``:

- stream (layer: 0..L (0 = the embedding stream, l = block l-1's output)): mean_abs, var, rms, max_abs, median_abs,
  max_median_ratio, grad_norm (dL/dX_l), angular_next (last token)
- resid_mid, attn_update, mlp_update (layer: block): mean_abs, var, rms, max_abs
- attn.q, attn.k, attn.v (layer: block): rms, max_abs
- attn (layer: block): max_logit, entropy (mean over heads)
- attn.head{h} (layer: block): max_logit, entropy, sink_mass (attention on the first token, queries t >= 1)
- attn (layer: block): sink_rate (share of heads whose sink_mass > 0.3, Gu et al. 2025)
- stream (layer: 0..L): kurtosis (E[(x-mu)^4]/Var^2 over the layer's entries)
- adam (layer: block): exp_avg_norm, exp_avg_sq_norm (Adam's moments over the block's parameters; with `optimizer=`)
- attn.q_proj ... mlp.down_proj (layer: block): grad_norm, weight_norm (and update_norm, update_ratio = update_norm /
  the weight's norm before the step, from `updates`)
- attn_norms.output, ... (layer: block): gamma_mean, gamma_min, gamma_max (every norm present)
- embed_norm, final_norm (layer: null): gamma_mean, gamma_min, gamma_max
- (any norm site), DyT (layer: as the site): alpha (DyT's learned scalar, Zhu et al. eq. 1)
- attn_h, mlp_h (layer: block): h_mean, h_abs_max (a learned residual step: ReZero, LayerScale)
- stream{k} (n > 1 streams) (layer: 0..L): mean_abs, rms, max_abs of stream k (hyper-connections; SiameseNorm: stream0
  the Post-Norm-like X, stream1 the Pre-Norm-like Y; `stream` rows are over
  all n side by side)
- attn_hc, mlp_hc (layer: block): res_row_sum_max, res_col_sum_max, res_diag_mean, pre_mean, post_mean (each
  connection's mixing, normlab.model.streams)
- hc (layer: block): composite_gain_forward, composite_gain_backward (max abs row / column sum of res_l ... res_1 over
  tokens: mHC's Amax gain)
- attn_omega, mlp_omega (layer: block): omega_mean, omega_abs_max (Admin's skip scale, Liu et al. 2020)
- attn.head_scale (layer: block): head_scale_mean, head_scale_abs_max (NormFormer's HeadScale)
- attn.gate (layer: block): gate_mean, gate_below_0.1, gate_below_0.01, gate_below_0.001 (gated attention's scores,
  Qiu et al. 2025; the last two: saturation, gates all but closed)
- (a DyT/Derf site) (layer: block): saturated_share (inputs where the squash passes < 5% of a change:
  `normlab.model.norms.DyT.saturated_share`; arXiv 2604.23434's predictor of DyT's regime)
- angular:{j} (layer: i): angular_distance between stream states i and j at the last token (Gromov et al., Kim Fig. 9);
  angular_distance_all over every token
- global (layer: null): top100_max, top100_min, top100_mean, max_abs, median_abs, max_median_ratio, fp16_headroom
- moe.expert{e} (layer: block (MoE)): load (share of the token-expert assignments)
- moe (layer: block (MoE)): load_max_ratio (max load x E: 1 is balanced), router_entropy, aux_loss
- prop31 (layer: L-1): per token (Prop. 3.1's setting, `prop31.per_token`): tok_grad_max, tok_grad_mean (largest
  |dl_t/dW2_ij| of the last MLP), tok_h_norm, tok_a_norm, grad_h_slope, grad_h_corr, and for an output-normalized last
  MLP tok_bound, tok_within_bound; for the batch: grad_max (max |dL/dW2_ij|), h_norm, a_norm, bound

Gradients come from `torch.autograd.grad`, so the probe never touches `.grad`, fires no DDP hooks
and draws no random numbers: training is unchanged with probes on (tested).

Under FSDP2 (`fully_shard`: DTensor parameters) every rank runs the probe on the same batch, so the
activations, and every statistic of them, are each rank's own and the whole batch's. What depends on the
weights is reduced per shard (`normlab.diagnostics.shards`: local sums, sums of squares, extremes and
counts, all-reduced as scalars; nothing is gathered): weight norms, gains, learned scales, update norms,
Adam's moments. A weight matrix's gradient is not a tensor autograd can return for a sharded parameter, so
there it is formed from the matrix's input X and output gradient G (dL/dW = G^T X over the batch's
tokens), a block of rows at a time: one matrix's gradient at most, never the model's. The numbers equal
the single process's on the same weights (tests/integration/test_distributed.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from normlab.diagnostics.probe_store import ProbeRow
from normlab.diagnostics.prop31 import per_token
from normlab.diagnostics.shards import is_sharded, moments, norms, reshard
from normlab.diagnostics.stats import (
    SINK_THRESHOLD,
    angular_matrix,
    attention_stats,
    hidden_stats,
    kurtosis,
    massive_activations,
    sink_mass,
)
from normlab.layout.norm_kinds import NORM_FACTS
from normlab.model.block import SCALE_PARAMS
from normlab.model.lm import NormLM
from normlab.model.moe import MoE
from normlab.model.norms import gain_of, is_norm, norm_kind_of
from normlab.model.streams import composite_gain
from normlab.runs.metrics import ProbeMetric, scale_metric

WEIGHTS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORM_SITES = (
    "attn_norms.input",
    "attn_norms.output",
    "attn_norms.after_add",
    "mlp_norms.input",
    "mlp_norms.output",
    "mlp_norms.after_add",
    "mlp.hidden_norm",
    "attn.q_norm",
    "attn.k_norm",
    "attn.v_norm",
    "attn.context_norm",
)

TAPS = ("resid_mid", "attn_update", "mlp_update", "attn.q", "attn.k", "attn.v")


def _pointwise(m: nn.Module) -> bool:
    """Whether ``m`` is the module of a norm kind whose facts say point-wise (normlab.layout.norm_kinds: DyT, Derf),
    which measures its own `saturated_share` (normlab.model.norms.DyT.saturated_share)."""
    kind = norm_kind_of(m)
    return kind is not None and NORM_FACTS[kind].pointwise


@dataclass
class _Seen:
    """What one probe pass saw: the modules by name, the stream, the taps, the gradients' statistics."""

    mods: dict[str, nn.Module]
    n_layers: int
    targets: torch.Tensor
    loss: torch.Tensor
    hidden: list[torch.Tensor]
    hgrads: list[torch.Tensor | None]  # dL/dX_l per stream layer (None: unused)
    a_grad: torch.Tensor | None  # the last dense MLP's output gradient (Prop. 3.1)
    captured: dict[str, torch.Tensor]
    wstats: dict[int, tuple[float, float]]  # id(weight) -> (gradient norm, gradient |max|)
    weight_norms: dict[int, float]


class OptimizerState(Protocol):
    """What the probes read of an optimizer: its per-parameter ``state`` (a torch optimizer's, or normlab's
    MuonAdamW's merged view of its two)."""

    @property
    def state(self) -> Mapping[torch.Tensor, Any]: ...


class Probes:
    """Probe a `NormLM` on a fixed batch ``(inputs, targets)``; see the module docstring."""

    def __init__(
        self,
        model: NormLM,
        batch: tuple[torch.Tensor, torch.Tensor],
        top_k: int = 100,
        optimizer: OptimizerState | None = None,
    ) -> None:
        """``optimizer``: an Adam-family optimizer whose moments (exp_avg, exp_avg_sq) are recorded per block."""
        self.model, self.batch, self.top_k, self.optimizer = model, batch, top_k, optimizer
        self._snapshot: dict[str, torch.Tensor] | None = None

    def _row(self, rows: list[ProbeRow], step: int, layer: int | None, site: str, metric: str, value: float) -> None:
        rows.append(ProbeRow(step=step, layer=layer, site=site, metric=metric, value=float(value)))

    def _stream_rows(self, rows: list[ProbeRow], step: int, model: NormLM, hidden: list[torch.Tensor]) -> None:
        """Several streams side by side (hyper-connections' n, SiameseNorm's X and Y: `NormLM.streams`): each stream's
        scale by depth; with hyper-connections (normlab.model.streams) each connection's mixing (the last forward's,
        per token) and the composite mixing's gain so far (Xie et al. 2025's quantity: 1 when every res is doubly
        stochastic)."""
        n = getattr(model, "streams", 1)
        if n <= 1:
            return
        for layer, h in enumerate(hidden):
            for k, part in enumerate(h.detach().unflatten(-1, (n, -1)).unbind(-2)):
                st = hidden_stats(part)
                for key in (ProbeMetric.MEAN_ABS, ProbeMetric.RMS, ProbeMetric.MAX_ABS):
                    self._row(rows, step, layer, f"stream{k}", key, st[key])
        if model.layout.streams <= 1:  # no hyper-connections (SiameseNorm's streams are not mixed)
            return
        mixes = []
        for i, block in enumerate(model.blocks):
            for name in ("attn_hc", "mlp_hc"):
                conn = getattr(block, name)
                res, pre, post = conn.last_res.float(), conn.last_pre.float(), conn.last_post.float()
                mixes.append(res)
                self._row(rows, step, i, name, ProbeMetric.RES_ROW_SUM_MAX, res.abs().sum(-1).amax().item())
                self._row(rows, step, i, name, ProbeMetric.RES_COL_SUM_MAX, res.abs().sum(-2).amax().item())
                self._row(rows, step, i, name, ProbeMetric.RES_DIAG_MEAN, res.diagonal(dim1=-2, dim2=-1).mean().item())
                self._row(rows, step, i, name, ProbeMetric.PRE_MEAN, pre.mean().item())
                self._row(rows, step, i, name, ProbeMetric.POST_MEAN, post.mean().item())
        gain = composite_gain(mixes)
        for i in range(len(model.blocks)):  # after block i: its MLP's connection, the (2 i + 1)-th
            self._row(rows, step, i, "hc", ProbeMetric.COMPOSITE_GAIN_FORWARD, gain["forward"][2 * i + 1])
            self._row(rows, step, i, "hc", ProbeMetric.COMPOSITE_GAIN_BACKWARD, gain["backward"][2 * i + 1])

    def record(self, step: int) -> list[ProbeRow]:
        seen = self._probe_pass()
        rows: list[ProbeRow] = []
        self._row(rows, step, None, "global", ProbeMetric.PROBE_LOSS, seen.loss.item())
        self._stream_section(rows, step, seen)
        for i in range(seen.n_layers):
            self._block_rows(rows, step, seen, i)
        for site in ("embed_norm", "final_norm"):
            if is_norm(seen.mods[site]):
                self._gamma_rows(rows, step, None, site, seen.mods[site])
        rows += self.adam_rows(step)
        self._moe_rows(rows, step, seen)
        self._prop31_rows(rows, step, seen)
        return rows

    def _taps(
        self, mods: dict[str, nn.Module], n_layers: int, sharded: bool, captured: dict[str, Any], io: dict[str, Any]
    ) -> list[Any]:
        """Forward hooks filling ``captured`` (the taps, gates, the dense MLPs' h and a) and, sharded, ``io``
        (each weight matrix's input and output); their handles."""
        handles = []
        for i in range(n_layers):
            if sharded:
                for w in WEIGHTS:
                    name = f"blocks.{i}.{w}"
                    if name in mods and mods[name] is not None and mods[name].weight.requires_grad:
                        handles.append(
                            mods[name].register_forward_hook(lambda m, a, o, name=name: io.__setitem__(name, (a[0], o)))
                        )
            for tap in TAPS:
                name = f"blocks.{i}.{tap}"
                handles.append(
                    mods[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o))
                )
            for name, m in mods.items():  # a point-wise kind's (DyT, Derf): the share of saturated inputs, per pass
                if name.startswith(f"blocks.{i}.") and _pointwise(m):
                    handles.append(
                        m.register_forward_hook(
                            lambda mod, a, o: captured.__setitem__(f"saturated:{id(mod)}", mod.saturated_share(a[0]))
                        )
                    )
            if getattr(mods[f"blocks.{i}.attn"], "gate_proj", None) is not None:  # gated attention's scores
                name = f"blocks.{i}.attn.gate"
                handles.append(
                    mods[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o))
                )
            if f"blocks.{i}.mlp.down_proj" in mods:  # a dense MLP (Prop. 3.1's h and a)
                handles.append(
                    mods[f"blocks.{i}.mlp.down_proj"].register_forward_hook(
                        lambda m, a, o, i=i: captured.update({f"h{i}": a[0], f"a{i}": o})
                    )
                )
        return handles

    def _probe_pass(self) -> _Seen:
        """The hooked forward and the one `autograd.grad` of the probe pass: what the rows are read from."""
        model = self.model
        was_training = model.training
        model.train()  # the same mode as training (no dropout exists; norms have no running stats)
        mods = dict(model.named_modules())
        device = next(model.parameters()).device
        x, y = (t.to(device) for t in self.batch)
        captured: dict[str, torch.Tensor] = {}
        n_layers = len(model.blocks)
        sharded = any(is_sharded(p) for p in model.parameters())
        io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # sharded: each weight matrix's input and output
        handles = self._taps(mods, n_layers, sharded, captured, io)
        try:
            with torch.enable_grad():
                # the model's own forward (soft-caps, embedding scale, ... included): probe_loss is the training loss
                out = model(x, targets=y, return_hidden_states=True)
                loss, hidden = out.loss, list(out.hidden_states)
                params = [
                    mods[f"blocks.{i}.{w}"].weight
                    for i in range(n_layers)
                    for w in WEIGHTS
                    if f"blocks.{i}.{w}" in mods and mods[f"blocks.{i}.{w}"] is not None
                ]
                last_a = [captured[f"a{n_layers - 1}"]] if f"a{n_layers - 1}" in captured else []
                if sharded:  # the matrices' output gradients: dL/dW = G^T X (module docstring)
                    outs = [
                        io[f"blocks.{i}.{w}"][1] for i in range(n_layers) for w in WEIGHTS if f"blocks.{i}.{w}" in io
                    ]
                    wanted = outs + list(hidden) + last_a
                else:
                    wanted = [p for p in params if p.requires_grad] + list(hidden) + last_a
                grads = torch.autograd.grad(loss, wanted, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
            reshard(model)
        n_params = len(outs) if sharded else sum(1 for p in params if p.requires_grad)
        if sharded:
            keys = [k for k in (f"blocks.{i}.{w}" for i in range(n_layers) for w in WEIGHTS) if k in io]
            wstats = {id(mods[k].weight): _grad_from_io(io[k][0], g) for k, g in zip(keys, grads[:n_params])}
        else:
            pgrads = dict(zip([id(p) for p in params if p.requires_grad], grads[:n_params]))
            wstats = {
                k: (g.norm().item(), g.abs().max().item()) if g is not None else (0.0, 0.0) for k, g in pgrads.items()
            }
        return _Seen(
            mods=mods,
            n_layers=n_layers,
            targets=y,
            loss=loss,
            hidden=hidden,
            hgrads=list(grads[n_params : n_params + len(hidden)]),
            a_grad=grads[-1] if last_a else None,
            captured=captured,
            wstats=wstats,
            weight_norms=dict(zip([id(p) for p in params], norms([p.detach() for p in params]))),
        )

    def _stream_section(self, rows: list[ProbeRow], step: int, seen: _Seen) -> None:
        """The stream: depth profile, gradient by depth, consecutive angular distance, massive activations."""
        hidden = seen.hidden
        for layer, h in enumerate(hidden):
            for k, v in hidden_stats(h).items():
                self._row(rows, step, layer, "stream", k, v)
            g = seen.hgrads[layer]
            self._row(rows, step, layer, "stream", ProbeMetric.GRAD_NORM, g.norm().item() if g is not None else 0.0)
            self._row(rows, step, layer, "stream", ProbeMetric.KURTOSIS, kurtosis(h))
        self._stream_rows(rows, step, self.model, hidden)
        ang = angular_matrix(list(hidden))  # at the last token (Gromov et al.; Kim Fig. 9)
        ang_all = angular_matrix(list(hidden), tokens="all")
        for i in range(len(hidden)):
            if i + 1 < len(hidden):
                self._row(rows, step, i, "stream", ProbeMetric.ANGULAR_NEXT, ang[i][i + 1])
            for j in range(len(hidden)):
                self._row(rows, step, i, f"angular:{j}", ProbeMetric.ANGULAR_DISTANCE, ang[i][j])
                self._row(rows, step, i, f"angular:{j}", ProbeMetric.ANGULAR_DISTANCE_ALL, ang_all[i][j])

        # massive activations over the block outputs (Kim Fig. 11; Sun et al.)
        for k, v in massive_activations(list(hidden[1:]), self.top_k).items():
            self._row(rows, step, None, "global", k, v)

    def _block_rows(self, rows: list[ProbeRow], step: int, seen: _Seen, i: int) -> None:
        """Block ``i``: its sites' activations, attention, gate, weights, norms' gains and learned scales."""
        mods, captured = seen.mods, seen.captured
        for site in ("resid_mid", "attn_update", "mlp_update"):
            st = hidden_stats(captured[f"blocks.{i}.{site}"])
            for k in (ProbeMetric.MEAN_ABS, ProbeMetric.VAR, ProbeMetric.RMS, ProbeMetric.MAX_ABS):
                self._row(rows, step, i, site, k, st[k])
        for site in ("attn.q", "attn.k", "attn.v"):
            st = hidden_stats(captured[f"blocks.{i}.{site}"])
            self._row(rows, step, i, site, ProbeMetric.RMS, st[ProbeMetric.RMS])
            self._row(rows, step, i, site, ProbeMetric.MAX_ABS, st[ProbeMetric.MAX_ABS])
        self._attention_rows(rows, step, seen, i)
        for w in WEIGHTS:
            mod = mods.get(f"blocks.{i}.{w}")
            if mod is None or not mod.weight.requires_grad:
                continue
            self._row(rows, step, i, w, ProbeMetric.GRAD_NORM, seen.wstats.get(id(mod.weight), (0.0, 0.0))[0])
            self._row(rows, step, i, w, ProbeMetric.WEIGHT_NORM, seen.weight_norms[id(mod.weight)])
        for site in NORM_SITES:
            m = mods.get(f"blocks.{i}.{site}")
            if m is not None and is_norm(m):
                self._gamma_rows(rows, step, i, site, m)
                if (share := captured.get(f"saturated:{id(m)}")) is not None:
                    self._row(rows, step, i, site, ProbeMetric.SATURATED_SHARE, float(share))
        # learned scales that are not norms (ReZero's a, LayerScale's lambda, Admin's omega, NormFormer's
        # head scales: normlab.model.block.SCALE_PARAMS), each at its path in the block as the site
        scales = [
            (site, p)
            for site, p in mods[f"blocks.{i}"].named_parameters()
            if SCALE_PARAMS.get(site.rpartition(".")[2]) is not None
        ]
        for (site, _), mom in zip(scales, moments([p.detach() for _, p in scales])):
            prefix = SCALE_PARAMS[site.rpartition(".")[2]]
            self._row(rows, step, i, site, scale_metric(prefix, ProbeMetric.SCALE_MEAN), mom.mean)
            self._row(rows, step, i, site, scale_metric(prefix, ProbeMetric.SCALE_ABS_MAX), mom.max_abs)

    def _attention_rows(self, rows: list[ProbeRow], step: int, seen: _Seen, i: int) -> None:
        """Block ``i``'s attention: max logit, entropy and sinks (mean and per head), and a gate's scores."""
        mods, captured = seen.mods, seen.captured
        q, k = captured[f"blocks.{i}.attn.q"], captured[f"blocks.{i}.attn.k"]
        max_logit, entropy = attention_stats(q, k, getattr(mods[f"blocks.{i}.attn"], "scale", None))
        self._row(rows, step, i, "attn", ProbeMetric.MAX_LOGIT, max(max_logit))
        self._row(rows, step, i, "attn", ProbeMetric.ENTROPY, sum(entropy) / len(entropy))
        sinks = sink_mass(q, k, getattr(mods[f"blocks.{i}.attn"], "scale", None))
        self._row(rows, step, i, "attn", ProbeMetric.SINK_RATE, sum(m > SINK_THRESHOLD for m in sinks) / len(sinks))
        for head, (ml, en, sm) in enumerate(zip(max_logit, entropy, sinks)):
            self._row(rows, step, i, f"attn.head{head}", ProbeMetric.MAX_LOGIT, ml)
            self._row(rows, step, i, f"attn.head{head}", ProbeMetric.ENTROPY, en)
            self._row(rows, step, i, f"attn.head{head}", ProbeMetric.SINK_MASS, sm)
        gate = captured.get(f"blocks.{i}.attn.gate")
        if gate is not None:  # Qiu et al. 2025 Sec. 4.2: the scores are sparse (mean 0.116 in their model)
            g = gate.detach().float()
            self._row(rows, step, i, "attn.gate", ProbeMetric.GATE_MEAN, g.mean().item())
            for cut in ("0.1", "0.01", "0.001"):  # saturation: gates closed to a tenth, a hundredth, a thousandth
                self._row(
                    rows, step, i, "attn.gate", f"{ProbeMetric.GATE_BELOW}{cut}", (g < float(cut)).float().mean().item()
                )

    def _moe_rows(self, rows: list[ProbeRow], step: int, seen: _Seen) -> None:
        """Routing (MoE layers): the share of assignments per expert, its max over the uniform share, entropy."""
        for i in range(seen.n_layers):
            moe = seen.mods[f"blocks.{i}.mlp"]
            if isinstance(moe, MoE) and moe.load is not None:  # a MoE layer after a forward
                assert moe.entropy is not None and moe.aux is not None  # each forward sets them with `load`
                for e, share in enumerate(moe.load.tolist()):
                    self._row(rows, step, i, f"moe.expert{e}", ProbeMetric.LOAD, share)
                self._row(rows, step, i, "moe", ProbeMetric.LOAD_MAX_RATIO, moe.load.max().item() * len(moe.load))
                self._row(rows, step, i, "moe", ProbeMetric.ROUTER_ENTROPY, moe.entropy.item())
                self._row(rows, step, i, "moe", ProbeMetric.AUX_LOSS, moe.aux.item())

    def _prop31_rows(self, rows: list[ProbeRow], step: int, seen: _Seen) -> None:
        """Kim Prop. 3.1 quantities for the last MLP (a dense, two-matrix MLP's quantities; not for MoE)."""
        mods, captured = seen.mods, seen.captured
        last = seen.n_layers - 1
        if f"h{last}" not in captured:
            return
        h_act, a_out = captured[f"h{last}"].detach(), captured[f"a{last}"].detach()
        h_norm, a_norm = h_act.norm(dim=-1).mean().item(), a_out.norm(dim=-1).mean().item()
        down = mods[f"blocks.{last}.mlp.down_proj"].weight
        self._row(rows, step, last, "prop31", ProbeMetric.GRAD_MAX, seen.wstats.get(id(down), (0.0, 0.0))[1])
        self._row(rows, step, last, "prop31", ProbeMetric.H_NORM, h_norm)
        self._row(rows, step, last, "prop31", ProbeMetric.A_NORM, a_norm)
        out_norm = mods[f"blocks.{last}.mlp_norms.output"]
        # Kim Prop. 3.1's bound is for a normalizing output norm (RMS/Layer), not DyT's squashing or ScaleNorm
        normalizing = isinstance(out_norm, (nn.RMSNorm, nn.LayerNorm))
        gain = gain_of(out_norm) if normalizing else None
        gamma_max = (moments([gain.detach()])[0].max_abs if gain is not None else 1.0) if normalizing else None
        if gamma_max is not None and a_norm > 0:
            d = a_out.shape[-1]
            ratio = (h_act.norm(dim=-1) / a_out.norm(dim=-1).clamp_min(1e-30)).mean().item()
            self._row(rows, step, last, "prop31", ProbeMetric.BOUND, 4.0 * gamma_max * math.sqrt(d) * ratio)
        if seen.a_grad is not None:
            for k, v in per_token(h_act, a_out, seen.a_grad, seen.targets != -100, gamma_max).items():
                self._row(rows, step, last, "prop31", k, v)

    def adam_rows(self, step: int) -> list[ProbeRow]:
        """Per block: the norms of Adam's first and second moments over the block's parameters
        (sqrt of the sum of squares of exp_avg, of exp_avg_sq), from the optimizer's state; none before its
        first step or without an Adam-family optimizer."""
        if self.optimizer is None:
            return []
        rows: list[ProbeRow] = []
        state = self.optimizer.state  # read once: MuonAdamW merges its two optimizers' states on each read
        for i, block in enumerate(self.model.blocks):
            states = [state.get(p, {}) for p in block.parameters()]
            pairs = [(s["exp_avg"], s["exp_avg_sq"]) for s in states if "exp_avg" in s and "exp_avg_sq" in s]
            if not pairs:
                continue
            found = norms([m for m, _ in pairs] + [v for _, v in pairs])
            n = len(pairs)
            self._row(rows, step, i, "adam", ProbeMetric.EXP_AVG_NORM, math.sqrt(sum(x * x for x in found[:n])))
            self._row(rows, step, i, "adam", ProbeMetric.EXP_AVG_SQ_NORM, math.sqrt(sum(x * x for x in found[n:])))
        return rows

    def _gamma_rows(self, rows: list[ProbeRow], step: int, layer: int | None, site: str, norm: nn.Module) -> None:
        """gamma's mean, min and max (ScaleNorm's g: one value); DyT's alpha too; nothing for a gain-free norm."""
        if (alpha := getattr(norm, "alpha", None)) is not None:
            self._row(rows, step, layer, site, ProbeMetric.ALPHA, moments([alpha.detach()])[0].mean)
        if (shift := getattr(norm, "shift", None)) is not None:  # Derf's s
            self._row(rows, step, layer, site, ProbeMetric.SHIFT, moments([shift.detach()])[0].mean)
        g = gain_of(norm)  # a centered gain's 1 + w
        if g is None:
            return
        m = moments([g.detach()])[0]
        self._row(rows, step, layer, site, ProbeMetric.GAMMA_MEAN, m.mean)
        self._row(rows, step, layer, site, ProbeMetric.GAMMA_MIN, m.minimum)
        self._row(rows, step, layer, site, ProbeMetric.GAMMA_MAX, m.maximum)

    # --- update norms: call `snapshot()` before an optimizer step and `updates(step)` after it ---
    def snapshot(self) -> None:
        mods = dict(self.model.named_modules())
        self._snapshot = {
            f"{i}:{w}": mods[f"blocks.{i}.{w}"].weight.detach().clone()
            for i in range(len(self.model.blocks))
            for w in WEIGHTS
            if mods.get(f"blocks.{i}.{w}") is not None
        }

    def updates(self, step: int) -> list[ProbeRow]:
        if self._snapshot is None:
            return []
        mods = dict(self.model.named_modules())
        rows: list[ProbeRow] = []
        keys = list(self._snapshot)
        deltas = norms(
            [mods[f"blocks.{k.split(':')[0]}.{k.split(':')[1]}"].weight.detach() - self._snapshot[k] for k in keys]
        )
        befores = norms([self._snapshot[k] for k in keys])  # reduced over shards as the deltas are
        for key, delta, before in zip(keys, deltas, befores):
            i, w = key.split(":")
            self._row(rows, step, int(i), w, ProbeMetric.UPDATE_NORM, delta)
            # update_ratio's ||W' - W|| / ||W|| (normlab.diagnostics.stats), from the shard-reduced norms
            self._row(rows, step, int(i), w, ProbeMetric.UPDATE_RATIO, delta / before if before > 0 else math.inf)
        self._snapshot = None
        return rows


def _grad_from_io(x: torch.Tensor, g: torch.Tensor | None, rows: int = 1024) -> tuple[float, float]:
    """(||dL/dW||_F, max |dL/dW_ij|) of a linear map y = x W^T from its input ``x`` and output gradient ``g``:
    dL/dW = g^T x summed over the tokens, formed ``rows`` output rows at a time (the norm and the maximum
    accumulate in float64; the matrix itself is never held whole)."""
    if g is None:
        return 0.0, 0.0
    x, g = x.detach().reshape(-1, x.shape[-1]), g.detach().reshape(-1, g.shape[-1])
    sumsq, largest = 0.0, 0.0
    for r in range(0, g.shape[1], rows):
        part = g[:, r : r + rows].transpose(0, 1) @ x.to(g.dtype)
        sumsq += part.double().pow(2).sum().item()
        largest = max(largest, part.abs().max().item())
    return math.sqrt(sumsq), largest
