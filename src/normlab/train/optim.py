"""Optimizers and the learning-rate schedule.

AdamW with parameter groups (no weight decay on the parameters named in ``wd_exclude``: norm
gammas/betas and the learned scales with them, biases, embeddings; the gains of the input and the output norms
each with their own weight decay and learning rate where ``wd_input_gains`` ... ``lr_output_gains`` say so, the
gain's own policy of arXiv 2605.26895), or SGD with momentum (Kim App. I), or
Muon: ``torch.optim.Muon`` (orthogonalized momentum, Jordan et al. 2024; ``W <- W (1 - lr wd) - lr' NS_k(M)``)
on the blocks' 2-D hidden matrices (attention's q/k/v/o and gate, the MLP's matrices, each MoE expert's
matrices one by one), with AdamW on the rest (embeddings, the head, norms, learned scalars, gains, biases,
MoE routers), as Jordan's post and torch's docstring prescribe ("Other parameters, such as bias, and
embedding, should be optimized by a standard method such as AdamW"). Muon's lr' per matrix follows its
``adjust_lr_fn`` (``muon_adjust_lr``); its Newton-Schulz iteration runs in torch's bf16 or in float32
(``muon_ns_dtype``: `normlab.train.muon_fp32`). Schedule: linear warmup over ``warmup * steps`` steps, then cosine
decay to ``min_lr`` (Kim Table 2, Zhuo Table 7); each group follows it at its own peak (``lr_ratio``).

The probes record each matrix's update/parameter ratio, whatever the optimizer
(`normlab.diagnostics.stats.update_ratio`; for Muon about lr' sqrt(min(A, B)) / ||W||: its update's singular
values are near 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from normlab.config.train import TrainConfig
from normlab.layout.sites import GAIN_KINDS
from normlab.model.block import scale_params
from normlab.model.lm import NormLM
from normlab.model.mla import projection_lr
from normlab.model.norms import is_norm
from normlab.model.parametrization import ParamScale, param_scales
from normlab.model.streams import HyperConnection
from normlab.train.muon_fp32 import newton_schulz_in_float32

# a parameter group as torch's optimizers hold it: "params", "weight_decay", and normlab's "lr_ratio" (the group's
# multiple of the schedule's lr) and "gains" (the gain policy's kind); torch adds its own keys ("lr", "betas", ...)
ParamGroup = dict[str, Any]


def _lm(model: nn.Module) -> NormLM:
    """The `NormLM` the optimizer is built for: ``model`` or the one inside its DDP wrapper (``.module``)."""
    return cast(NormLM, getattr(model, "module", model))


def gain_kinds(model: nn.Module, cfg: TrainConfig) -> dict[int, str]:
    """The norm gains the gain policy covers, by parameter id: "input" or "output" (`GAIN_KINDS`: what the site's
    norm feeds), for each kind whose weight decay or learning rate the optimizer settings set (empty: none). A gain is
    a norm's ``weight`` (gamma, a centered gain's w, a single scale, ScaleNorm's g); betas, DyT's alpha and the like
    keep ``wd_exclude``'s rule."""
    o = cfg.optim
    wanted = {
        kind
        for kind, (wd, lr) in {
            "input": (o.wd_input_gains, o.lr_input_gains),
            "output": (o.wd_output_gains, o.lr_output_gains),
        }.items()
        if wd is not None or lr != 1.0
    }
    inner = _lm(model)  # DDP
    sites = inner.norms_at_sites() if wanted and hasattr(inner, "norms_at_sites") else {}
    out: dict[int, str] = {}
    for kind in wanted:
        for site in GAIN_KINDS[kind]:
            for norm in sites.get(site, ()):
                w = getattr(norm, "weight", None)
                if isinstance(w, nn.Parameter):
                    out[id(w)] = kind
    return out


def param_groups(model: nn.Module, cfg: TrainConfig, muon: set[int] | None = None) -> list[ParamGroup]:
    """The groups: decayed and not (``wd_exclude``), and the input and the output norms' gains where the gain policy
    sets their weight decay (a multiple of ``weight_decay``) or learning rate (``lr_ratio``, a multiple of the
    schedule's); under muP / CompleteP each split by its parameters' learning-rate and weight-decay factors
    (``muon``: the ids Muon takes, which follow Muon's own lr rule)."""
    exclude = set(cfg.wd_exclusions)
    kinds = gain_kinds(model, cfg)
    gains: dict[str, list[nn.Parameter]] = {"input": [], "output": []}
    norm_params: set[int] = set()
    emb_params: set[int] = set()
    for m in model.modules():
        if is_norm(m):  # every kind: RMS, Layer, DyT (its alpha too), ScaleNorm; not a norm's matrices (GatedNorm's
            # gate: DECAYED, decayed as the matrices, normlab.model.norms.GatedNorm)
            kept = getattr(m, "DECAYED", ())
            norm_params.update(id(p) for n, p in m.named_parameters(recurse=False) if n not in kept)
        if isinstance(m, nn.Embedding):
            emb_params.update(id(p) for p in m.parameters(recurse=False))
    # learned residual steps, Admin's omegas and head scales are scales too (normlab.model.block.SCALE_PARAMS)
    norm_params.update(id(p) for p in scale_params(model))
    # hyper-connections' static mixing (started at I, e_k, 1 or b = 0) and gating factors are scales too; their
    # dynamic projections (W, phi) are weights and decay
    norm_params.update(
        id(p)
        for m in model.modules()
        if isinstance(m, HyperConnection)
        for name, p in m.named_parameters()
        if not name.startswith(("dynamic", "phi"))
    )
    # Attention Residuals' pseudo-queries w (normlab.model.depth_attention) are weights, as the authors hold each in
    # an nn.Linear(d, 1): they decay, toward 0, the uniform average they start from; their key norms' gains are norm
    # gains (above). Keel and SpanNorm add no parameter of their own.
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in kinds:
            gains[kinds[id(p)]].append(p)
            continue
        is_excluded = (
            ("norms" in exclude and id(p) in norm_params)
            or ("embeddings" in exclude and id(p) in emb_params)
            or ("biases" in exclude and name.endswith(".bias"))
        )
        (no_decay if is_excluded else decay).append(p)
    o = cfg.optim
    groups: list[ParamGroup] = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    for kind, wd, lr in (
        ("input", o.wd_input_gains, o.lr_input_gains),
        ("output", o.wd_output_gains, o.lr_output_gains),
    ):
        if gains[kind]:
            # unset weight decay: the gains keep the rule wd_exclude gives norms
            factor = wd if wd is not None else (0.0 if "norms" in exclude else 1.0)
            groups.append(
                {"params": gains[kind], "weight_decay": o.weight_decay * factor, "lr_ratio": lr, "gains": kind}
            )
    inner = _lm(model)  # DDP
    groups = projection_groups(inner, groups)
    if inner.config.parametrization == "sp":
        return groups
    return scaled_groups(inner, groups, muon, cfg.optim.muon_adjust_lr)


def projection_groups(model: nn.Module, groups: list[ParamGroup]) -> list[ParamGroup]:
    """Each group split by the query and key projections' learning-rate multipliers (model.q_lr_mult, k_lr_mult;
    normlab.model.mla.projection_lr, after Anson & Aitchison 2025, arXiv 2511.21377): the parts with a multiplier
    other than 1 get ``lr_ratio`` times it. Unchanged when both multipliers are 1."""
    mults = projection_lr(model)
    if not mults:
        return groups
    out: list[ParamGroup] = []
    for g in groups:
        parts: dict[float, list[nn.Parameter]] = {}
        for p in g["params"]:
            parts.setdefault(mults.get(id(p), 1.0), []).append(p)
        for mult, params in parts.items():
            part = {**g, "params": params}
            if mult != 1.0:
                part["lr_ratio"] = g.get("lr_ratio", 1.0) * mult
            out.append(part)
    return out


def scaled_groups(
    model: NormLM, groups: list[ParamGroup], muon: set[int] | None = None, rule: str = "original"
) -> list[ParamGroup]:
    """muP / CompleteP: each group split by its parameters' learning-rate and weight-decay factors
    (normlab.model.parametrization.param_scales; `mup.MuAdamW`'s rule), each part with its ``lr_ratio`` to the
    schedule's peak (the schedule sets every group at lr x lr_ratio) and its weight decay scaled."""
    by_id = _scales_by_id(model, muon, rule)
    out: list[ParamGroup] = []
    for g in groups:
        parts: dict[tuple[float, float], list[nn.Parameter]] = {}
        for p in g["params"]:
            s = by_id.get(id(p), ParamScale())
            parts.setdefault((s.lr, s.weight_decay), []).append(p)
        ratio = g.get("lr_ratio", 1.0)
        for (lr_f, wd_f), params in parts.items():
            out.append({**g, "params": params, "weight_decay": g["weight_decay"] * wd_f, "lr_ratio": ratio * lr_f})
    return out


def _scales_by_id(model: NormLM, muon: set[int] | None, rule: str) -> dict[int, ParamScale]:
    """param_scales by parameter id (empty under SP: every factor is 1)."""
    if model.config.parametrization == "sp":
        return {}
    scales = param_scales(model, muon, rule)
    return {id(p): scales[name] for name, p in model.named_parameters()}


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon takes: those inside the blocks with two or more dimensions (nn.Linear weights,
    (out, in); stacked MoE experts, (E, in, out), taken per expert), except MoE routers (a router's rows are
    per-expert logits, read like a head: AdamW) and hyper-connections' mixing weights (small maps to n streams, their
    static matrices started at I or e_k: AdamW, as the papers train them)."""
    blocks = _lm(model).blocks  # DDP wraps the model
    routers = {id(r.weight) for m in blocks.modules() if isinstance(r := getattr(m, "router", None), nn.Linear)}
    routers |= {id(p) for m in blocks.modules() if isinstance(m, HyperConnection) for p in m.parameters()}
    return [p for p in blocks.parameters() if p.requires_grad and p.ndim >= 2 and id(p) not in routers]


class MuonAdamW:
    """torch.optim.Muon on `muon_matrices`, torch.optim.AdamW on the rest, stepped as one optimizer.

    ``param_groups`` lists AdamW's groups, then Muon's, then one group per stacked expert tensor (E, in, out)
    that stands for its E matrices: Muon holds each expert's matrix as a transposed view (out, in) of the
    tensor's storage (the orientation of an nn.Linear weight, which the "original" lr rule reads), and the
    step hands it the matching view of the gradient. The trainer's schedule, the loss scaler's unscale and
    checkpoints see one object; ``state_dict`` holds both optimizers' states (the momentum buffers, AdamW's
    moments) so a resumed run continues bit for bit.
    """

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        """Both optimizers' per-parameter state in one mapping (Muon's momentum buffers, AdamW's moments), as a
        torch optimizer's ``state`` reads (the probes' Adam moment norms)."""
        return {**self.muon.state, **self.adamw.state}

    def __init__(self, model: nn.Module, cfg: TrainConfig, fused: bool = False) -> None:
        o = cfg.optim
        self.ns_dtype = o.muon_ns_dtype
        matrices = muon_matrices(model)
        taken = {id(p) for p in matrices}
        adamw_lr = o.muon_adamw_lr if o.muon_adamw_lr is not None else o.lr
        groups = [
            {
                **g,
                "params": [p for p in g["params"] if id(p) not in taken],
                "lr_ratio": g.get("lr_ratio", 1.0) * adamw_lr / o.lr,
            }
            for g in param_groups(model, cfg)
        ]
        groups = [g for g in groups if g["params"]]
        eps = o.eps * _lm(model).config.adam_eps_multiplier
        self.adamw = torch.optim.AdamW(groups, lr=adamw_lr, betas=(o.beta1, o.beta2), eps=eps, fused=fused or None)
        wd = o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay
        flat = [p for p in matrices if p.ndim == 2]
        self.stacked = [p for p in matrices if p.ndim > 2]
        self.views = [[p.detach()[e].T for e in range(p.shape[0])] for p in self.stacked]
        # muP / CompleteP: Muon's matrices split by their lr factor (Muon's own rule: normlab.model.parametrization)
        flat_groups: dict[tuple[float, float], list[nn.Parameter]] = {}
        by_id = _scales_by_id(_lm(model), taken, o.muon_adjust_lr)
        proj = projection_lr(_lm(model))  # model.q_lr_mult, k_lr_mult on Muon's query/key matrices too
        for p in flat:
            s = by_id.get(id(p))
            lr_f, wd_f = (s.lr, s.weight_decay) if s else (1.0, 1.0)
            flat_groups.setdefault((lr_f * proj.get(id(p), 1.0), wd_f), []).append(p)
        flat_groups_list = [
            {"params": ps, "lr_ratio": lr_f, **({"weight_decay": wd * wd_f} if wd_f != 1.0 else {})}
            for (lr_f, wd_f), ps in flat_groups.items()
        ]
        muon_groups = flat_groups_list + [{"params": views, "lr_ratio": 1.0} for views in self.views]
        self.muon = torch.optim.Muon(
            muon_groups,
            lr=o.lr,
            weight_decay=wd,
            momentum=o.muon_momentum,
            nesterov=o.muon_nesterov,
            ns_steps=o.muon_ns_steps,
            adjust_lr_fn=o.muon_adjust_lr,
        )
        self._n_flat = len(
            flat_groups_list
        )  # (load_state_dict replaces the group dicts: read them through the optimizer)
        # the stacked tensors' own groups (unscaled and scheduled through them); their views follow them
        self.expert_groups: list[ParamGroup] = [{"params": [p], "lr": o.lr, "lr_ratio": 1.0} for p in self.stacked]

    @property
    def _flat_muon(self) -> list[ParamGroup]:
        return self.muon.param_groups[: self._n_flat]

    @property
    def _expert_muon(self) -> list[ParamGroup]:
        return self.muon.param_groups[self._n_flat :]

    @property
    def param_groups(self) -> list[ParamGroup]:
        return self.adamw.param_groups + self._flat_muon + self.expert_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        self.muon.zero_grad(set_to_none)
        for g in self.expert_groups:
            for p in g["params"]:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        for p, views, group, shadow in zip(self.stacked, self.views, self._expert_muon, self.expert_groups):
            group["lr"] = shadow["lr"]
            for e, v in enumerate(views):
                v.grad = None if p.grad is None else p.grad[e].T
        self.adamw.step()
        if self.ns_dtype == "fp32":
            with newton_schulz_in_float32():
                self.muon.step()
        else:
            self.muon.step()

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])
        for group, shadow in zip(self._expert_muon, self.expert_groups):
            shadow["lr"] = group["lr"]


def _adamw(model: nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps * _lm(model).config.adam_eps_multiplier,
        fused=fused or None,
    )


def _sgd(model: nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups(model, cfg), lr=cfg.optim.lr, momentum=cfg.optim.momentum, fused=fused or None)


# what `make_optimizer` returns: a torch optimizer, or MuonAdamW (which reads and steps like one)
TrainOptimizer = torch.optim.Optimizer | MuonAdamW

# optimizer name -> how it is built from the model and the settings: one entry per row of
# normlab.config.optimizers.OPTIMIZER_FACTS (tests/unit/test_registries.py checks they agree)
OPTIMIZER_BUILDERS: dict[str, Callable[[nn.Module, TrainConfig, bool], TrainOptimizer]] = {
    "adamw": _adamw,
    "sgd": _sgd,
    "muon": MuonAdamW,
}


def make_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool = False) -> TrainOptimizer:
    """AdamW, SGD or Muon with AdamW (`OPTIMIZER_BUILDERS`); ``fused`` (CUDA): torch's fused kernels (AdamW, SGD),
    one launch for all. Whatever the model asks to run after every step runs after it (its ``post_step_hooks``:
    nGPT's weights put back on the sphere), so the factory reads no layout flag."""
    opt = OPTIMIZER_BUILDERS[cfg.optim.optimizer](model, cfg, fused)
    inner = _lm(model)  # DDP
    last = opt.muon if isinstance(opt, MuonAdamW) else opt  # MuonAdamW steps AdamW, then Muon
    for hook in inner.post_step_hooks() if hasattr(inner, "post_step_hooks") else ():
        last.register_step_post_hook(lambda *_, hook=hook: hook())
    return opt


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr/warmup_steps to lr, then cosine to the floor at the last step."""
    warmup_steps = int(cfg.optim.warmup * cfg.optim.steps)
    if step < warmup_steps:
        return cfg.optim.lr * (step + 1) / warmup_steps
    span = max(1, cfg.optim.steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = cfg.lr_floor
    return floor + 0.5 * (cfg.optim.lr - floor) * (1 + math.cos(math.pi * progress))


def set_lr(opt: TrainOptimizer, lr: float) -> None:
    """The schedule's lr at this step on every group, times the group's ratio to the peak ``lr`` (Muon's
    AdamW groups: muon_adamw_lr / lr)."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
