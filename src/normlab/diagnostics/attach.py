"""Probes for your own training loop, and for models that are not normlab's.

    with normlab.diagnostics.probing(model, (x, y), every=100, path="runs/mine/probes.jsonl") as probe:
        for step in range(steps):
            probe.step(step)            # records at step 0, 100, 200, ...
            ...your forward, backward, optimizer step...
    rows = probe.rows                   # also written to `path`, readable with load_run / pandas

`probing` takes a `NormLM` and records everything `Probes` does. For any other module (a plain
PyTorch model, a Hugging Face causal LM) `StreamProbe` finds the residual blocks -- the longest
`nn.ModuleList` or `nn.ModuleDict` of same-typed modules, e.g. ``model.layers`` or ``transformer.h`` -- hooks their
outputs, and records the stream statistics, top activations, FP16 headroom and angular distances
by depth: the capture points such a model exposes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab.diagnostics.probe_store import ProbeRow, ProbeWriter
from normlab.diagnostics.probes import Probes
from normlab.diagnostics.stats import angular_matrix, hidden_stats, massive_activations
from normlab.errors import ConfigError
from normlab.model.lm import NormLM
from normlab.runs.metrics import ProbeMetric


class ProbeSession:
    def __init__(self, probes: Probes, every: int, writer: ProbeWriter | None) -> None:
        self.probes, self.every, self.writer = probes, every, writer
        self.rows: list[ProbeRow] = []

    def step(self, step: int, force: bool = False) -> list[ProbeRow]:
        """Record if ``step`` is a multiple of ``every`` (or ``force``); returns the new rows."""
        if not force and step % self.every:
            return []
        rows = self.probes.record(step)
        self.rows.extend(rows)
        if self.writer is not None:
            self.writer.write(rows)
        return rows


@contextlib.contextmanager
def probing(
    model: NormLM, batch: tuple[torch.Tensor, torch.Tensor], every: int = 100, path: str | Path | None = None
) -> Iterator[ProbeSession]:
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    writer = ProbeWriter(Path(path), 0) if path is not None else None
    try:
        yield ProbeSession(Probes(model, batch), every, writer)
    finally:
        if writer is not None:
            writer.close()


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """The residual blocks: the longest `nn.ModuleList` or `nn.ModuleDict` whose children all share one type
    (``model.layers`` of a transformers Llama, ``transformer.h`` of GPT-2, torchtitan's ``layers`` ModuleDict
    keyed "0", "1", ...), as its path and its modules in order."""
    best: tuple[str, list[nn.Module]] | None = None
    for name, m in module.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)
        if children and len({type(c) for c in children}) == 1 and (best is None or len(children) > len(best[1])):
            best = (name, children)
    if best is None:
        raise ConfigError(
            f"{type(module).__name__} has no nn.ModuleList or nn.ModuleDict of same-typed blocks; "
            "pass blocks= (the blocks' container, its attribute path, or a list of the block modules)"
        )
    return best


class StreamProbe:
    """Stream statistics by depth for any module whose blocks can be found (or are given)."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module] | None = None, top_k: int = 100) -> None:
        self.module = module
        self.blocks = list(blocks) if blocks is not None else list(find_blocks(module)[1])
        self.top_k = top_k

    @torch.no_grad()
    def capture(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """Run ``module(*args, **kwargs)``; return the stream entering the first block, then each block's output."""
        states: list[torch.Tensor] = []
        first_input: list[torch.Tensor] = []

        def out_hook(m: nn.Module, a: tuple[Any, ...], o: Any) -> None:
            states.append(o[0] if isinstance(o, tuple) else o)

        def pre_hook(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            if not first_input:
                x = a[0] if a else next(v for v in kw.values() if isinstance(v, torch.Tensor))
                first_input.append(x)

        handles = [b.register_forward_hook(out_hook) for b in self.blocks]
        handles.append(self.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        try:
            self.module(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        return first_input + states

    @torch.no_grad()
    def record(self, step: int, *args: Any, **kwargs: Any) -> list[ProbeRow]:
        """Run ``module(*args, **kwargs)`` and return rows like `Probes`' stream and global rows
        (layer l = the output of block l-1; layer 0 = the input of the first block)."""
        hidden = self.capture(*args, **kwargs)
        rows: list[ProbeRow] = []
        for layer, h in enumerate(hidden):
            for k, v in hidden_stats(h).items():
                rows.append(ProbeRow(step=step, layer=layer, site="stream", metric=k, value=v))
        ang = angular_matrix(hidden)
        for i in range(len(hidden) - 1):
            rows.append(
                ProbeRow(step=step, layer=i, site="stream", metric=ProbeMetric.ANGULAR_NEXT, value=ang[i][i + 1])
            )
        for k, v in massive_activations(hidden[1:], self.top_k).items():
            rows.append(ProbeRow(step=step, layer=None, site="global", metric=k, value=v))
        return rows
