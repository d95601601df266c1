"""Reading someone else's model for `normlab.diagnostics.training_monitor`: its residual blocks (found or
named) and their norms, the calls it received (kept to replay as the probe batch), its attention logits
recomputed from a transformers-convention attention module's own inputs, and its gradient norms measured at a
backward's end (sharded ones reduced per shard: `normlab.diagnostics.shards`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from normlab.diagnostics.attach import find_blocks
from normlab.diagnostics.probe_store import ProbeRow
from normlab.diagnostics.shards import local, shard_groups
from normlab.errors import ConfigError
from normlab.runs.metrics import ProbeMetric

NORM_WORDS = ("norm", "ln_")  # module class or attribute names that mark a norm (RMSNorm, LayerNorm, ln_1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate-half (transformers' Llama convention, shared by the classes listed in the docstring)."""
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-b, a), dim=-1)


class AttentionLogits:
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

    def attach(self) -> list[Any]:
        return [
            m.register_forward_pre_hook(lambda mod, a, kw, i=i: self._record(i, mod, a, kw), with_kwargs=True)
            for i, m in self.modules.items()
        ]

    @torch.no_grad()
    def _record(self, layer: int, attn: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        h = kwargs.get("hidden_states", args[0] if args else None)
        rope = kwargs.get("position_embeddings")
        if h is None or rope is None:
            return
        cos, sin = rope
        b, t, _ = h.shape
        # the module was found by its q_proj and k_proj (__init__): a transformers-convention attention
        q, k = cast(nn.Module, attn.q_proj)(h), cast(nn.Module, attn.k_proj)(h)
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

    def rows(self, step: int) -> list[ProbeRow]:
        out: list[ProbeRow] = []
        for layer, heads in sorted(self.found.items()):
            out.append(ProbeRow(step=step, layer=layer, site="attn", metric=ProbeMetric.MAX_LOGIT, value=max(heads)))
            out += [
                ProbeRow(step=step, layer=layer, site=f"attn.head{h}", metric=ProbeMetric.MAX_LOGIT, value=v)
                for h, v in enumerate(heads)
            ]
        self.found = {}
        return out


def norm_modules(block: nn.Module) -> dict[str, nn.Module]:
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


def rank_and_world() -> tuple[int, int]:
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

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        return cls(
            tuple(_detached(a) for a in args),
            {k: _detached(v) for k, v in kwargs.items() if isinstance(v, REPLAYED) and k not in NOT_REPLAYED},
        )

    def to(self, device: torch.device | None = None) -> Call:
        def move(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            return v.to(device) if device is not None else v.clone()

        return Call(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The call's tensors by name (positional ones as ``arg0``, ``arg1``...): what a spike's file holds."""
        out = {f"arg{i}": a for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)}
        out.update({k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)})
        return out


WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")  # compile, AC, FSDP1
AT_BACKWARD = "the end of the last backward pass before each step (after DDP/FSDP reduction, before any clipping)"
AT_CALL = "as they stood when capture_grads() or step() was called"


def unwrapped_path(path: str) -> str:
    """A path inside a block without the prefixes that torch.compile, activation checkpointing and FSDP1 insert."""
    for prefix in WRAPPER_PREFIXES:
        path = path.replace(prefix, "")
    return path


def grad_site(path: str) -> str:
    """A parameter's site: its path in the block, ``.weight`` dropped (``self_attn.q_proj``)."""
    path = unwrapped_path(path)
    return path.removesuffix(".weight") if path != "weight" else path


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors a forward returned (a tensor, a tuple or list, a mapping such as transformers' ModelOutput,
    a dataclass such as NormLM's LMOutput), one level of tuples inside them included."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        items = list(output.values())
    elif isinstance(output, (tuple, list)):
        items = list(output)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return []
    found = []
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found += [t for t in item if isinstance(t, torch.Tensor)]
    return found


@dataclass
class GradNorms:
    """Each parameter's squared gradient norm at one moment, on this rank: device tensors not yet read back (a
    measurement never waits for the device), with what the read needs to reduce the sharded ones."""

    params: list[nn.Parameter]  # those that had a gradient, in model.parameters() order
    groups: list[tuple[list[int], torch.Tensor]]  # indices into params, their local squared norms (float64)
    shards: list[
        tuple[Any, ...]
    ]  # per param: the process groups over which its gradient is sharded (none: a plain tensor)
    devices: list[torch.device]
    scale: float
    at: str
    squares: dict[int, float] | None = None  # the read, once made

    @classmethod
    def measure(cls, params: Iterator[nn.Parameter], scale: float, at: str) -> GradNorms:
        """The gradients as they are now: per (device, dtype), one ``torch._foreach_norm`` as ``clip_grad_norm_``
        computes it (in float32 for 16-bit gradients), squared in float64."""
        with torch.no_grad():
            pairs = [(p, p.grad) for p in params if p.grad is not None]
            have = [p for p, _ in pairs]
            grads = [local(g).detach() for _, g in pairs]
            kinds: dict[tuple[Any, ...], list[int]] = {}
            for i, g in enumerate(grads):
                kinds.setdefault((g.device, g.dtype), []).append(i)
            groups = []
            for (_, dtype), idx in kinds.items():
                wide = torch.float64 if dtype == torch.float64 else torch.float32
                ts = [grads[i] for i in idx]
                try:
                    found = list(torch._foreach_norm(ts, 2, dtype=wide))
                except (RuntimeError, NotImplementedError):  # a device without foreach kernels
                    found = [torch.linalg.vector_norm(t, dtype=wide) for t in ts]
                groups.append((idx, torch.stack(found).double().square()))
        return cls(have, groups, [shard_groups(g) for _, g in pairs], [g.device for g in grads], scale, at)

    def read(self) -> dict[int, float]:
        """``id(parameter)`` -> its squared gradient norm over every shard, divided by the loss scale squared
        (sharded ones: local sums all-reduced over their shard groups, one all-reduce per set of groups). Read
        once: every rank reads the same measurements in the same order, so the all-reduces pair up."""
        if self.squares is not None:
            return self.squares
        sq = [0.0] * len(self.params)
        for idx, values in self.groups:
            for i, v in zip(idx, values.tolist()):
                sq[i] = v
        by_groups: dict[tuple[Any, ...], list[int]] = {}
        for i, groups in enumerate(self.shards):
            if groups:
                by_groups.setdefault(groups, []).append(i)
        for groups, idx in by_groups.items():
            t = torch.tensor([sq[i] for i in idx], dtype=torch.float64, device=self.devices[idx[0]])
            for g in groups:
                torch.distributed.all_reduce(t, group=g)
            for i, v in zip(idx, t.tolist()):
                sq[i] = v
        self.squares = {id(p): v / self.scale**2 for p, v in zip(self.params, sq)}
        return self.squares

    def total(self) -> float | None:
        """The L2 norm over every parameter measured; None when none had a gradient."""
        squares = self.read()
        return math.sqrt(sum(squares.values())) if squares else None


def _block_names(container: nn.Module | list[Any] | tuple[Any, ...]) -> list[str]:
    """A ModuleDict's keys; a ModuleList's, a Sequential's or a list's positions."""
    if isinstance(container, nn.ModuleDict):
        return list(container.keys())
    if not isinstance(container, Sized):
        raise TypeError(f"the blocks' container {type(container).__name__} has no length")
    return [str(i) for i in range(len(container))]


def resolve_blocks(model: nn.Module, blocks: Any) -> tuple[str, list[nn.Module], list[str]]:
    """The blocks to record: found (the longest ModuleList or ModuleDict of same-typed modules), or ``blocks``
    (a ModuleList, ModuleDict or Sequential of the model, its attribute path, or a list of its modules)."""
    if blocks is None:
        path, found = find_blocks(model)
        return path, found, _block_names(model.get_submodule(path))
    if isinstance(blocks, str):
        try:
            container = model.get_submodule(blocks)
        except AttributeError:
            raise ConfigError(
                f"blocks={blocks!r}: {type(model).__name__} has no submodule at that path; give the attribute path "
                "of its blocks' container (e.g. 'model.layers'), the container, or a list of the block modules"
            ) from None
        path = blocks
    else:
        container = blocks
        path = next((name for name, m in model.named_modules() if m is blocks), "blocks")
    if isinstance(container, nn.ModuleDict):
        modules = list(container.values())
    elif isinstance(container, (nn.ModuleList, nn.Sequential, list, tuple)):
        modules = list(container)
    else:
        raise ConfigError(
            f"blocks= must be an nn.ModuleList, nn.ModuleDict or nn.Sequential of the model, its attribute path, or a "
            f"list of the block modules; got {type(container).__name__}"
        )
    inside = {id(m) for m in model.modules()}
    if not modules or not all(isinstance(m, nn.Module) and id(m) in inside for m in modules):
        raise ConfigError(
            f"blocks= must hold at least one module, each a module of the model being trained "
            f"({type(model).__name__}); got {len(modules)} entries, not all of them its modules"
        )
    return path, modules, _block_names(container)


def step_number(step: Any, last: int | None) -> int:
    """``step`` as the next step to record, or a ConfigError: a whole number >= 0 after the last one recorded."""
    try:
        n = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ConfigError(
            f"TrainingMonitor.step: the step must be a whole number >= 0 (the optimizer step), got {step!r}"
        )
    if last is not None and n <= last:
        raise ConfigError(
            f"TrainingMonitor.step: step {n} does not come after the last step recorded ({last}); steps must "
            "increase (a new TrainingMonitor on the folder continues it from an earlier step)"
        )
    return n


def loss_value(loss: Any) -> float | None:
    """``loss=`` as a float (NaN and inf kept: a diverged step), or a ConfigError."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return float(loss)
    raise ConfigError(
        f"TrainingMonitor.step: loss must be a number (or a one-element tensor) or None, got {type(loss).__name__}"
    )
