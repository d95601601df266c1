"""`normlab demo`: layouts side by side at initialization and after a few AdamW steps.

Data: bytes of Python's own `argparse.py` source, present on every machine with Python (the real
corpus and trainer come with `normlab train`). Shows what the papers measure first: hidden-state
RMS by depth (Kim Fig. 1) and gradient norm by layer (Kim Fig. 7, Zhuo Fig. 5).
"""

from __future__ import annotations

import argparse as _argparse_module
import time
from pathlib import Path

import torch

from normlab.model.build import build_model
from normlab.model.mlp import MLP
from normlab.model.moe import MoE
from normlab.model.params import count_params


def _down_proj_grad(mlp: MLP | MoE) -> float:
    """The gradient norm of the MLP's output projection (a MoE sublayer's: every expert's, stacked)."""
    w = mlp.experts.down_proj if isinstance(mlp, MoE) else mlp.down_proj.weight
    assert w.grad is not None  # after a backward
    return w.grad.norm().item()


def demo_tokens(seq_len: int, batch: int, seed: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(Path(_argparse_module.__file__).read_bytes()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=g)
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


def _row(values: list[float]) -> str:
    return " ".join(f"{v:7.3g}" for v in values)


def run_demo(layouts: list[str], size: str = "tiny", seed: int = 0, steps: int = 30, lr: float = 3e-3) -> None:
    from normlab.layout import as_layout
    from normlab.model.config import get_size

    depth = get_size(size).n_layers
    for name in layouts:  # every layout and the size checked before any work: a typo fails at once
        as_layout(name).resolve(depth)
    torch.manual_seed(seed)
    batch = demo_tokens(128, 16, seed)
    x, y = batch[:, :-1], batch[:, 1:]
    print(
        f"normlab demo: size={size}, {x.shape[0]}x{x.shape[1]} byte tokens of argparse.py, "
        f"{steps} AdamW steps at lr={lr}\n"
    )
    for name in layouts:
        model = build_model(name, size, seed=seed)
        out = model(x, targets=y, return_hidden_states=True)
        out.loss.backward()
        rms = [h.pow(2).mean().sqrt().item() for h in out.hidden_states]
        grads = [_down_proj_grad(b.mlp) for b in model.block_list()]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        t0 = time.perf_counter()
        losses = [out.loss.item()]
        opt.step()
        for _ in range(steps - 1):
            opt.zero_grad(set_to_none=True)
            loss = model(x, targets=y).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        dt = time.perf_counter() - t0
        print(f"[{name}] {model.layout.to_string()}  ({count_params(model)})")
        print(f"  hidden RMS by depth (embed, block 0..):  {_row(rms)}")
        print(f"  |grad W_down| by layer at init:          {_row(grads)}")
        print(f"  loss: init {losses[0]:.3f} -> step {steps} {losses[-1]:.3f}   ({dt:.1f}s)\n")
