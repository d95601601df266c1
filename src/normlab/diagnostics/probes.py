"""The probe pass: one eager forward/backward on a fixed batch, recorded as tidy rows.

`Probes(model, batch).record(step)` returns rows ``{"step", "layer", "site", "metric", "value"}``:

| site                            | layer          | metrics |
|---------------------------------|----------------|---------|
| stream                          | 0..L (0 = the embedding stream, l = block l-1's output) | mean_abs, var, rms, max_abs, median_abs, max_median_ratio, grad_norm (dL/dX_l), angular_next (last token) |
| resid_mid, attn_update, mlp_update | block      | mean_abs, var, rms, max_abs |
| attn.q, attn.k, attn.v          | block          | rms, max_abs |
| attn                            | block          | max_logit, entropy (mean over heads) |
| attn.head{h}                    | block          | max_logit, entropy |
| attn.q_proj ... mlp.down_proj   | block          | grad_norm, weight_norm (and update_norm, update_ratio = update_norm / the weight's norm before the step, from `updates`) |
| attn_norms.output, ...          | block          | gamma_mean, gamma_min, gamma_max (every norm present) |
| embed_norm, final_norm          | null           | gamma_mean, gamma_min, gamma_max |
| (any norm site), DyT            | as the site    | alpha (DyT's learned scalar, Zhu et al. eq. 1) |
| attn_h, mlp_h                   | block          | h_mean, h_abs_max (a learned residual step: ReZero, LayerScale) |
| attn_omega, mlp_omega           | block          | omega_mean, omega_abs_max (Admin's skip scale, Liu et al. 2020) |
| attn.head_scale                 | block          | head_scale_mean, head_scale_abs_max (NormFormer's HeadScale) |
| attn.gate                       | block          | gate_mean, gate_below_0.1 (gated attention's scores, Qiu et al. 2025) |
| angular:{j}                     | i              | angular_distance between stream states i and j at the last token (Gromov et al., Kim Fig. 9); angular_distance_all over every token |
| global                          | null           | top100_max, top100_min, top100_mean, max_abs, median_abs, max_median_ratio, fp16_headroom |
| moe.expert{e}                   | block (MoE)    | load (share of the token-expert assignments) |
| moe                             | block (MoE)    | load_max_ratio (max load x E: 1 is balanced), router_entropy, aux_loss |
| prop31                          | L-1            | per token (Prop. 3.1's setting, `prop31.per_token`): tok_grad_max, tok_grad_mean (largest |dl_t/dW2_ij| of the last MLP), tok_h_norm, tok_a_norm, grad_h_slope, grad_h_corr, and for an output-normalized last MLP tok_bound, tok_within_bound; for the batch: grad_max (max |dL/dW2_ij|), h_norm, a_norm, bound |

Gradients come from `torch.autograd.grad`, so the probe never touches `.grad`, fires no DDP hooks
and draws no random numbers: training is unchanged with probes on (tested).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from normlab.diagnostics.prop31 import per_token
from normlab.model.block import SCALE_PARAMS
from normlab.diagnostics.stats import angular_matrix, attention_stats, hidden_stats, massive_activations, update_ratio
from normlab.model.norms import gain_of, is_norm

WEIGHTS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORM_SITES = ("attn_norms.input", "attn_norms.output", "attn_norms.after_add", "mlp_norms.input",
              "mlp_norms.output", "mlp_norms.after_add", "mlp.hidden_norm", "attn.q_norm", "attn.k_norm", "attn.v_norm",
              "attn.context_norm")

TAPS = ("resid_mid", "attn_update", "mlp_update", "attn.q", "attn.k", "attn.v")


class Probes:
    """Probe a `NormLM` on a fixed batch ``(inputs, targets)``; see the module docstring."""

    def __init__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], top_k: int = 100) -> None:
        self.model, self.batch, self.top_k = model, batch, top_k
        self._snapshot: dict[str, torch.Tensor] | None = None

    def _row(self, rows: list, step: int, layer: int | None, site: str, metric: str, value: float) -> None:
        rows.append({"step": step, "layer": layer, "site": site, "metric": metric, "value": float(value)})

    def record(self, step: int) -> list[dict[str, Any]]:
        model = self.model
        was_training = model.training
        model.train()  # the same mode as training (no dropout exists; norms have no running stats)
        mods = dict(model.named_modules())
        device = next(model.parameters()).device
        x, y = (t.to(device) for t in self.batch)
        captured: dict[str, torch.Tensor] = {}
        handles = []
        n_layers = len(model.blocks)
        for i in range(n_layers):
            for tap in TAPS:
                name = f"blocks.{i}.{tap}"
                handles.append(mods[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o)))
            if getattr(mods[f"blocks.{i}.attn"], "gate_proj", None) is not None:  # gated attention's scores
                name = f"blocks.{i}.attn.gate"
                handles.append(mods[name].register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, o)))
            if f"blocks.{i}.mlp.down_proj" in mods:  # a dense MLP (Prop. 3.1's h and a)
                handles.append(mods[f"blocks.{i}.mlp.down_proj"].register_forward_hook(
                    lambda m, a, o, i=i: captured.update({f"h{i}": a[0], f"a{i}": o})))
        try:
            with torch.enable_grad():
                # the model's own forward (soft-caps, embedding scale, ... included): probe_loss is the training loss
                out = model(x, targets=y, return_hidden_states=True)
                loss, hidden = out.loss, list(out.hidden_states)
                params = [mods[f"blocks.{i}.{w}"].weight for i in range(n_layers) for w in WEIGHTS if f"blocks.{i}.{w}" in mods
                          and mods[f"blocks.{i}.{w}"] is not None]
                last_a = [captured[f"a{n_layers - 1}"]] if f"a{n_layers - 1}" in captured else []
                wanted = [p for p in params if p.requires_grad] + list(hidden) + last_a
                grads = torch.autograd.grad(loss, wanted, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
        n_params = sum(1 for p in params if p.requires_grad)
        pgrads = dict(zip([id(p) for p in params if p.requires_grad], grads[:n_params]))
        hgrads = grads[n_params:n_params + len(hidden)]
        a_grad = grads[-1] if last_a else None
        rows: list[dict[str, Any]] = []
        self._row(rows, step, None, "global", "probe_loss", loss.item())

        # the stream: depth profile, gradient by depth, consecutive angular distance
        for layer, h in enumerate(hidden):
            for k, v in hidden_stats(h).items():
                self._row(rows, step, layer, "stream", k, v)
            g = hgrads[layer]
            self._row(rows, step, layer, "stream", "grad_norm", g.norm().item() if g is not None else 0.0)
        ang = angular_matrix(list(hidden))  # at the last token (Gromov et al.; Kim Fig. 9)
        ang_all = angular_matrix(list(hidden), tokens="all")
        for i in range(len(hidden)):
            if i + 1 < len(hidden):
                self._row(rows, step, i, "stream", "angular_next", ang[i][i + 1])
            for j in range(len(hidden)):
                self._row(rows, step, i, f"angular:{j}", "angular_distance", ang[i][j])
                self._row(rows, step, i, f"angular:{j}", "angular_distance_all", ang_all[i][j])

        # massive activations over the block outputs (Kim Fig. 11; Sun et al.)
        for k, v in massive_activations(list(hidden[1:]), self.top_k).items():
            self._row(rows, step, None, "global", k, v)

        for i in range(n_layers):
            for site in ("resid_mid", "attn_update", "mlp_update"):
                st = hidden_stats(captured[f"blocks.{i}.{site}"])
                for k in ("mean_abs", "var", "rms", "max_abs"):
                    self._row(rows, step, i, site, k, st[k])
            for site in ("attn.q", "attn.k", "attn.v"):
                st = hidden_stats(captured[f"blocks.{i}.{site}"])
                self._row(rows, step, i, site, "rms", st["rms"])
                self._row(rows, step, i, site, "max_abs", st["max_abs"])
            max_logit, entropy = attention_stats(captured[f"blocks.{i}.attn.q"], captured[f"blocks.{i}.attn.k"],
                                                 getattr(mods[f"blocks.{i}.attn"], "scale", None))
            self._row(rows, step, i, "attn", "max_logit", max(max_logit))
            self._row(rows, step, i, "attn", "entropy", sum(entropy) / len(entropy))
            for head, (ml, en) in enumerate(zip(max_logit, entropy)):
                self._row(rows, step, i, f"attn.head{head}", "max_logit", ml)
                self._row(rows, step, i, f"attn.head{head}", "entropy", en)
            gate = captured.get(f"blocks.{i}.attn.gate")
            if gate is not None:  # Qiu et al. 2025 Sec. 4.2: the scores are sparse (mean 0.116 in their model)
                g = gate.detach().float()
                self._row(rows, step, i, "attn.gate", "gate_mean", g.mean().item())
                self._row(rows, step, i, "attn.gate", "gate_below_0.1", (g < 0.1).float().mean().item())
            for w in WEIGHTS:
                mod = mods.get(f"blocks.{i}.{w}")
                if mod is None or not mod.weight.requires_grad:
                    continue
                g = pgrads.get(id(mod.weight))
                self._row(rows, step, i, w, "grad_norm", g.norm().item() if g is not None else 0.0)
                self._row(rows, step, i, w, "weight_norm", mod.weight.detach().norm().item())
            for site in NORM_SITES:
                m = mods.get(f"blocks.{i}.{site}")
                if m is not None and is_norm(m):
                    self._gamma_rows(rows, step, i, site, m)
            # learned scales that are not norms (ReZero's a, LayerScale's lambda, Admin's omega, NormFormer's
            # head scales: normlab.model.block.SCALE_PARAMS), each at its path in the block as the site
            for site, p in mods[f"blocks.{i}"].named_parameters():
                prefix = SCALE_PARAMS.get(site.rpartition(".")[2])
                if prefix is not None:
                    v = p.detach().float()
                    self._row(rows, step, i, site, f"{prefix}_mean", v.mean().item())
                    self._row(rows, step, i, site, f"{prefix}_abs_max", v.abs().max().item())
        for site in ("embed_norm", "final_norm"):
            if is_norm(mods[site]):
                self._gamma_rows(rows, step, None, site, mods[site])

        # routing (MoE layers): the share of assignments per expert, its max over the uniform share, entropy
        for i in range(n_layers):
            moe = mods[f"blocks.{i}.mlp"]
            if getattr(moe, "load", None) is not None:
                for e, share in enumerate(moe.load.tolist()):
                    self._row(rows, step, i, f"moe.expert{e}", "load", share)
                self._row(rows, step, i, "moe", "load_max_ratio", moe.load.max().item() * len(moe.load))
                self._row(rows, step, i, "moe", "router_entropy", moe.entropy.item())
                self._row(rows, step, i, "moe", "aux_loss", moe.aux.item())

        # Kim Prop. 3.1 quantities for the last MLP (a dense, two-matrix MLP's quantities; not for MoE)
        last = n_layers - 1
        if f"h{last}" not in captured:
            return rows
        g = pgrads.get(id(mods[f"blocks.{last}.mlp.down_proj"].weight))
        h_act, a_out = captured[f"h{last}"].detach(), captured[f"a{last}"].detach()
        h_norm, a_norm = h_act.norm(dim=-1).mean().item(), a_out.norm(dim=-1).mean().item()
        self._row(rows, step, last, "prop31", "grad_max", g.abs().max().item() if g is not None else 0.0)
        self._row(rows, step, last, "prop31", "h_norm", h_norm)
        self._row(rows, step, last, "prop31", "a_norm", a_norm)
        out_norm = mods[f"blocks.{last}.mlp_norms.output"]
        # Kim Prop. 3.1's bound is for a normalizing output norm (RMS/Layer), not DyT's squashing or ScaleNorm
        normalizing = isinstance(out_norm, (nn.RMSNorm, nn.LayerNorm))
        gain = gain_of(out_norm) if normalizing else None
        gamma_max = (gain.detach().abs().max().item() if gain is not None else 1.0) if normalizing else None
        if gamma_max is not None and a_norm > 0:
            d = a_out.shape[-1]
            ratio = (h_act.norm(dim=-1) / a_out.norm(dim=-1).clamp_min(1e-30)).mean().item()
            self._row(rows, step, last, "prop31", "bound", 4.0 * gamma_max * math.sqrt(d) * ratio)
        if a_grad is not None:
            for k, v in per_token(h_act, a_out, a_grad, y != -100, gamma_max).items():
                self._row(rows, step, last, "prop31", k, v)
        return rows

    def _gamma_rows(self, rows: list, step: int, layer: int | None, site: str, norm: nn.Module) -> None:
        """gamma's mean, min and max (ScaleNorm's g: one value); DyT's alpha too; nothing for a gain-free norm."""
        if getattr(norm, "alpha", None) is not None:
            self._row(rows, step, layer, site, "alpha", norm.alpha.detach().float().item())
        g = gain_of(norm)  # a centered gain's 1 + w
        if g is None:
            return
        w = g.detach().float()
        self._row(rows, step, layer, site, "gamma_mean", w.mean().item())
        self._row(rows, step, layer, site, "gamma_min", w.min().item())
        self._row(rows, step, layer, site, "gamma_max", w.max().item())

    # --- update norms: call `snapshot()` before an optimizer step and `updates(step)` after it ---
    def snapshot(self) -> None:
        mods = dict(self.model.named_modules())
        self._snapshot = {f"{i}:{w}": mods[f"blocks.{i}.{w}"].weight.detach().clone()
                          for i in range(len(self.model.blocks)) for w in WEIGHTS if mods.get(f"blocks.{i}.{w}") is not None}

    def updates(self, step: int) -> list[dict[str, Any]]:
        if self._snapshot is None:
            return []
        mods = dict(self.model.named_modules())
        rows: list[dict[str, Any]] = []
        for key, before in self._snapshot.items():
            i, w = key.split(":")
            after = mods[f"blocks.{i}.{w}"].weight.detach()
            self._row(rows, step, int(i), w, "update_norm", (after - before).norm().item())
            self._row(rows, step, int(i), w, "update_ratio", update_ratio(before, after))
        self._snapshot = None
        return rows
