"""An fp16-safe copy of a model whose layout makes the residual stream's scale irrelevant.

If every reader of the stream is a scale-invariant norm (RMSNorm or LayerNorm: N(c x) = N(x) up to eps) --
each sublayer's input norm (A) and the final norm, with no after-add norm (C) and no normalized skip (S) --
then multiplying the whole stream by c > 0 changes nothing downstream: every sublayer reads N_A(c x) =
N_A(x), and the final norm hands the head the same vector. The stream is scaled by c by scaling what is
added to it: the embedding (the embedding norm's gain where there is one, else the embedding itself and
learned positions) and each sublayer's update (the output norm's gain and bias where B is on, else the
learned step h, else the output projection W_O / W_down and its bias). Gemma 3 in fp16 is the known case
(activations past 65504); this is the rescaling Kim et al.'s Peri-LN makes unnecessary.

`rescalable` says why a layout does not qualify (a DyT reads the stream, a C site renormalizes it, a tied
embedding without an embedding norm would scale the logits too); `rescale_for_fp16` picks c so that the
largest activation on the sample is 65504 / ``headroom`` and returns the copy with the logits' change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from normlab.diagnostics.stats import FP16_MAX
from normlab.layout.norm_kinds import NORM_KIND_FACTS
from normlab.model.lm import NormLM
from normlab.model.norms import gain_of

# kinds with N(c x) = N(x) and a gain to carry c: RMSNorm, LayerNorm (each kind's `rescalable` in
# normlab.layout.norm_kinds; not DyT; ScaleNorm and L2 are scale-invariant too, but left out there)
SCALE_FREE = tuple(f.name for f in NORM_KIND_FACTS if f.rescalable)


def rescalable(model: NormLM) -> str | None:
    """None if the stream's scale is irrelevant to ``model``'s function (a NormLM); else why not."""
    lay, cfg = model.layout, model.config
    for i, blk in enumerate(model.resolved.blocks):
        for name, sites in (("attn", blk.attn), ("mlp", blk.mlp)):
            if not sites.input:
                return f"block {i} {name} reads the raw stream (no input norm A): its output would scale with it"
            if sites.after_add or sites.skip_normed:
                return (
                    f"block {i} {name} has an after-add norm (C) or a normalized skip (S): the stream is renormalized"
                )
            kind = lay.norm_at(f"{name}.A").kind
            if kind not in SCALE_FREE:
                return f"block {i} {name}'s input norm is {kind}, not scale-invariant (rms or layer)"
            out = lay.norm_at(f"{name}.B")
            if sites.output and (out.kind not in SCALE_FREE or out.gain == "none"):
                return f"block {i} {name}'s output norm ({out.kind}, gain {out.gain}) has no gain to carry the scale"
    if not lay.final_norm or lay.norm_at("final").kind not in SCALE_FREE:
        return "no scale-invariant final norm: the head would read the scaled stream"
    if lay.embed_norm:
        if lay.norm_at("emb").gain == "none" or lay.norm_at("emb").kind not in SCALE_FREE:
            return "the embedding norm has no gain to carry the scale"
    elif cfg.tie_embeddings:
        return "tied embeddings without an embedding norm: scaling the embedding would scale the head too"
    if lay.alpha == "admin":
        return "Admin's omegas multiply the stream"
    return None


def _scale_norm(norm: nn.Module, c: float) -> None:
    """Multiply a norm's output by c through its gain (and bias): gamma -> c gamma (centered: w -> c (1 + w) - 1)."""
    weight, bias = cast(torch.Tensor, norm.weight), getattr(norm, "bias", None)
    if getattr(norm, "offset", 0.0):
        gain = gain_of(norm)
        assert gain is not None  # a centered gain (offset 1) is a gain
        weight.copy_(c * gain - 1.0)
    else:
        weight.mul_(c)
    if bias is not None:
        bias.mul_(c)


@torch.no_grad()
def scale_stream(model: NormLM, c: float) -> NormLM:
    """A copy of ``model`` (rescalable) whose residual stream is c times the original everywhere."""
    why = rescalable(model)
    if why is not None:
        raise ValueError(f"the stream's scale is not free in this layout: {why}")
    m = copy.deepcopy(model)
    if m.layout.embed_norm:
        _scale_norm(m.embed_norm, c)
    else:
        m.embed.weight.mul_(c)
        if m.pos_embed is not None:
            m.pos_embed.weight.mul_(c)
    for block, blk in zip(m.blocks, m.resolved.blocks):
        for name, sites in (("attn", blk.attn), ("mlp", blk.mlp)):
            step = getattr(block, f"{name}_h")
            if sites.output:
                _scale_norm(getattr(block, f"{name}_norms").output, c)
            elif step is not None:
                step.mul_(c)
            else:
                sub = getattr(block, name)
                projections = [sub.o_proj] if name == "attn" else ([sub.down_proj] if hasattr(sub, "down_proj") else [])
                if name == "mlp" and getattr(sub, "experts", None) is not None:  # MoE: every expert's W_down
                    sub.experts.down_proj.mul_(c)
                    projections = [sub.shared.down_proj] if sub.shared is not None else []
                for lin in projections:
                    lin.weight.mul_(c)
                    if lin.bias is not None:
                        lin.bias.mul_(c)
    return m


@dataclass
class Rescale:
    factor: float  # c: the stream's new scale over the old
    max_before: float
    max_after: float
    max_logit_change: float  # max |logits_new - logits_old| on the sample
    kl: float  # mean KL(p_old || p_new) per token on the sample, nats
    model: NormLM


@torch.no_grad()
def _max_stream(model: NormLM, x: torch.Tensor) -> float:
    out = model(x, return_hidden_states=True)
    return max(float(h.abs().max()) for h in out.hidden_states)


@torch.no_grad()
def rescale_for_fp16(model: NormLM, x: torch.Tensor, headroom: float = 16.0) -> Rescale:
    """Scale the stream so that its largest value on ``x`` is FP16_MAX / headroom; the logits' change measured."""
    before = _max_stream(model, x)
    c = min(1.0, FP16_MAX / headroom / before) if before > 0 else 1.0
    new = scale_stream(model, c)
    from normlab.runs.convert import token_kl  # the KL per token, as convert reports a change of layout

    old_logits, new_logits = model(x).logits.double(), new(x).logits.double()
    return Rescale(
        factor=c,
        max_before=before,
        max_after=_max_stream(new, x),
        max_logit_change=float((new_logits - old_logits).abs().max()),
        kl=float(token_kl(old_logits, new_logits).mean()),
        model=new,
    )
