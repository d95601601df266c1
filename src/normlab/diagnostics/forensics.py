"""Where a diverged run first broke: a hooked re-run of the failing batch.

When a run diverges, the weights in memory are the last ones the optimizer applied: the failing
step's update is never applied (a non-finite loss or gradient stops the run before `opt.step`).
`first_break` runs that step's batch forward again through them with a forward hook at every site
in execution order and returns the first one whose tensor is not finite once stored in the run's
activation dtype (for fp16: past 65504; `normlab.model.storage`):

    embedding | per block and sublayer: input norm (A) | q, k, v, context | MLP hidden |
    sublayer output f(u) | output norm (B) | update h * N_B(f) | residual add | after-add norm (C) |
    final norm | logits

with the largest finite |value| that flowed *into* that site (for the residual add: the stream and
the update it adds), so a reader sees "block 7's residual add: stream 6.1e4 + update 9.3e3 > 65504".
A forward that stays finite (the run diverged by a loss rule, or in the backward) reports the
largest activation and its site instead, and `gradient_break` names the parameters whose
gradients were non-finite in the failing step (deepest layer first: the backward runs from the loss).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normlab.model.norms import is_norm
from normlab.model.storage import NO_STORAGE, Storage
from normlab.runs.summary import Forensics

_SUBLAYER = {"attn": "attention", "mlp": "MLP"}
_NORM_SITE = {"input": "input norm (A)", "output": "output norm (B)", "after_add": "after-add norm (C)"}


def _max_finite(t: torch.Tensor) -> float:
    t = t.detach()
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else math.nan


def _layer(path: str) -> int | None:
    m = re.match(r"blocks\.(\d+)\.", path)
    return int(m.group(1)) if m else None


class _Recorder:
    """Forward hooks on every site of a NormLM; keeps the first break and the largest activation."""

    def __init__(self, model: nn.Module, storage: Storage) -> None:
        self.storage, self.model = storage, model
        self.first: dict[str, Any] | None = None
        self.largest: dict[str, Any] = {"value": 0.0}
        self.stream: dict[str, float] = {}  # the stream entering each (block, sublayer): for the residual add
        self.update: dict[str, float] = {}
        self.sublayer_in: dict[str, float] = {}  # u = N_A(x), the sublayer's input
        self.handles = []
        for path, mod in model.named_modules():
            site = self._site(path, mod)
            if site is not None:
                self.handles.append(mod.register_forward_hook(self._hook(path, site)))

    def _site(self, path: str, mod: nn.Module) -> str | None:
        parts = path.split(".")
        if path == "embed_out":
            return "embedding"
        if path == "final_norm":
            return "final norm" if is_norm(mod) else None
        if path == "lm_head":
            return "logits"
        if len(parts) == 3 and parts[0] == "blocks":
            if parts[2] in _SUBLAYER:
                return f"{_SUBLAYER[parts[2]]} output f(u)"
            if parts[2] in ("attn_update", "mlp_update"):
                return f"{_SUBLAYER[parts[2][:-7]]} update"
        if len(parts) == 4 and parts[0] == "blocks":
            sub, leaf = parts[2], parts[3]
            if sub in ("attn_norms", "mlp_norms") and leaf in _NORM_SITE:
                return f"{_SUBLAYER[sub[:-6]]} {_NORM_SITE[leaf]}"  # Identity sites too: they see the stream
            if sub == "attn" and leaf in ("q", "k", "v", "context"):
                return f"attention {leaf}"  # after q/k norms and RoPE; the context before o_proj
            if sub == "mlp" and leaf == "down_proj":
                return "MLP hidden"
        return None

    def _hook(self, path: str, site: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            parts = path.split(
                "."
            )  # the (block, sublayer) a site belongs to: blocks.3.attn_norms.input -> blocks.3.attn
            key = f"blocks.{parts[1]}.{parts[2].split('_')[0]}" if path.startswith("blocks.") else path
            if site == "MLP hidden":  # the hidden is the projection's input; what flowed in: the sublayer's u
                self._check(path, site, x, before=self.sublayer_in.get(key, math.nan))
                return
            if path.endswith("norms.input") and x is not None:
                self.stream[key] = _max_finite(x)
                self.sublayer_in[key] = _max_finite(out) if isinstance(out, torch.Tensor) else math.nan
            if path.endswith("norms.after_add") and x is not None:  # its input is the residual sum
                before = max(self.stream.get(key, math.nan), self.update.get(key, math.nan))
                self._check(path, site.replace("after-add norm (C)", "residual add"), x, before, what="input")
                if not is_norm(mod):
                    return
            if not isinstance(out, torch.Tensor) or (not is_norm(mod) and "norm" in site):
                return  # an Identity norm site: its output is its input, already seen
            if path.endswith("_update"):
                self.update[key] = _max_finite(out)
            self._check(path, site, out, before=_max_finite(x) if x is not None else math.nan)

        return hook

    def _check(self, path: str, site: str, t: torch.Tensor | None, before: float, what: str = "output") -> None:
        if t is None or not t.is_floating_point():
            return
        t = t.detach()
        stored = self.storage(t)
        value = _max_finite(t)
        if not math.isnan(value) and value > self.largest["value"]:
            self.largest = {"value": value, "module": path, "layer": _layer(path), "site": site}
        if self.first is not None:
            return
        bad = ~torch.isfinite(stored)
        if bool(bad.any()):
            self.first = {
                "module": path + (" (input)" if what == "input" else ""),
                "layer": _layer(path),
                "site": site,
                "nonfinite": int(bad.sum()),
                "of": t.numel(),
                "kind": "overflow" if bool(torch.isinf(stored).any()) else "nan",
                "value": value,
                "before": before,
            }

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def first_break(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast: Any = None
) -> dict[str, Any]:
    """Re-run ``batches`` (the failing step's micro-batches, in order) through ``model`` (a NormLM)
    with hooks at every site; the first site whose stored tensor is not finite, or None there.

    Returns ``{"forward": first | None, "micro_batch", "largest": {value, module, layer, site},
    "dtype", "limit", "loss"}``; ``autocast``: a context factory to run under (the run's precision).
    """
    storage = getattr(model, "store", NO_STORAGE)
    rec = _Recorder(model, storage)
    was_training = model.training
    model.eval()
    result: dict[str, Any] = {"forward": None, "micro_batch": None, "dtype": storage.name, "limit": storage.max}
    try:
        # every micro-batch, with no early exit: under FSDP2 the forward is collective, and every rank
        # must run as many as the others
        for i, (x, y) in enumerate(batches):
            with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
                loss = float(model(x, targets=y).loss)
            result.setdefault("loss", loss)
            if result["forward"] is not None:
                continue
            if rec.first is not None:
                result.update(forward=rec.first, micro_batch=i, loss=loss)
            elif not math.isfinite(loss):  # non-finite from the loss itself (every site finite)
                result.update(
                    forward={
                        "module": "loss",
                        "layer": None,
                        "site": "loss",
                        "nonfinite": 1,
                        "of": 1,
                        "kind": "nan",
                        "value": math.nan,
                        "before": rec.largest["value"],
                    },
                    micro_batch=i,
                    loss=loss,
                )
    finally:
        rec.close()
        model.train(was_training)
    result["largest"] = rec.largest
    return result


def gradient_break(model: nn.Module) -> list[str]:
    """The parameters whose gradients are not finite now, in the backward's order (head and final
    norm, then the blocks from the deepest, then the embedding)."""

    def depth(name: str) -> int:
        layer = _layer(name)
        return layer if layer is not None else (10**9 if name.startswith(("lm_head", "final_norm")) else -1)

    def local(g: torch.Tensor) -> torch.Tensor:  # FSDP2: a DTensor; this rank's shard (ranks are gathered after)
        return g.to_local() if hasattr(g, "to_local") else g

    bad = [
        n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())
    ]
    return sorted(bad, key=lambda n: -depth(n))


def site_of(forensics: dict[str, Any] | None) -> str | None:
    """The short form of where the forward first broke, "block 11: MLP residual add" (None: it did not):
    `normlab.runs.summary.Forensics.site` of a `first_break` result."""
    return Forensics.from_json(forensics).site if forensics else None


def tally(sites: list[str | float | None]) -> str:
    """Breaks of several runs grouped by site: "MLP residual add x3 (blocks 9, 11, 11); logits x1". A run with
    no break (None, or NaN from a table's empty cell: a divergence by loss-scale collapse) is left out."""
    by_site: dict[str, list[str]] = {}
    for s in sites:
        if not isinstance(s, str) or not s:
            continue
        block, _, site = s.rpartition(": ")
        by_site.setdefault(site, []).append(block.removeprefix("block "))
    parts = []
    for site, blocks in sorted(by_site.items(), key=lambda kv: -len(kv[1])):
        nums = [b for b in blocks if b]
        where = f" ({'blocks' if len(nums) > 1 else 'block'} {', '.join(sorted(nums, key=int))})" if nums else ""
        parts.append(f"{site} x{len(blocks)}{where}")
    return "; ".join(parts)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def describe(forensics: dict[str, Any] | None) -> str:
    """One line: where the run first broke (the CLI's last line, summaries, the report)."""
    if not forensics:
        return ""
    fwd = forensics.get("forward")
    if fwd is not None:
        where = ("" if fwd["layer"] is None else f"block {fwd['layer']} ") + fwd["site"]
        limit = forensics.get("dtype", "fp32")
        if fwd["kind"] == "overflow":
            what = f"|x| past {_fmt(forensics.get('limit'))} ({limit})"
        else:
            what = "NaN"
        text = f"first broke at {where} [{fwd['module']}]: {what}"
        if fwd.get("before") is not None and not (isinstance(fwd["before"], float) and math.isnan(fwd["before"])):
            text += f", largest finite |x| flowing in {_fmt(fwd['before'])}"
        return text
    grads = forensics.get("gradients") or []
    if grads:
        more = f" (+{len(grads) - 1} more)" if len(grads) > 1 else ""
        return f"forward finite; first non-finite gradient at {grads[0]}{more}"
    big = forensics.get("largest") or {}
    if big.get("module"):
        where = ("" if big.get("layer") is None else f"block {big['layer']} ") + big["site"]
        return f"forward finite (largest |x| {_fmt(big['value'])} at {where})"
    return "forward finite"
