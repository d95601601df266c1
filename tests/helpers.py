"""Helpers shared by the test modules: a small training config on the test corpus, a run's metrics rows
and losses, the planted fp16 overflow model. (Fixtures are in conftest.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import normlab
from normlab.train import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def small(corpus, out, **kw) -> TrainConfig:  # noqa: ANN001 - a path
    base = dict(data=str(corpus), size="nano", layout="peri", seq_len=32, batch_size=8, steps=12, lr=3e-3,
                eval_every=6, eval_batches=2, out=str(out), progress=False, device="cpu")
    return TrainConfig.of(**{**base, **kw})


def rows(run) -> list[dict]:  # noqa: ANN001 - a path
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def losses(run) -> list[float]:  # noqa: ANN001 - a path
    return [r["loss"] for r in rows(run)]


def planted_overflow(layout: str = "pre") -> torch.nn.Module:
    """A nano model whose stream is 4e4 after the embedding and whose MLP adds 4e4: the MLP's residual
    add is 8e4, past fp16's maximum, while every earlier tensor is representable."""
    torch.manual_seed(0)
    model = normlab.build_model(layout, size="nano", linear_bias=True)
    with torch.no_grad():
        model.embed.weight.fill_(4e4)
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.attn.o_proj.bias.zero_()
            block.mlp.down_proj.weight.zero_()
            block.mlp.down_proj.bias.fill_(4e4)
    return model
