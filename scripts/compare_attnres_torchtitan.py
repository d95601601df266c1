"""normlab's Block Attention Residuals against torchtitan's kimi_k3 port, logits compared (docs/frameworks.md).

No torchtitan release on PyPI carries kimi_k3 (0.3.0 is the newest; the port is open pull request 4281, RFC 3029),
so this script takes a checkout of it:

    git -C TORCHTITAN_MIRROR archive f0f2e69861212e1d5d35a0097e421dc792a4f205 torchtitan | tar -x -C CHECKOUT
    python scripts/compare_attnres_torchtitan.py CHECKOUT

It imports torchtitan's aggregation, ``torchtitan/models/kimi_k3/attn_res.py::block_attn_res`` (the paper's Fig. 2
primitive: softmax over the committed blocks and the partial sum, keys RMSNormed in float32), as written. That file's
two package imports (``models.common.linear.Linear``, ``protocols.module.Module``) pull in torchtitan's distributed
stack (spmd_types, tyro); they serve only its ``AttnResProjection`` class, which is not used here, so they are
given as stand-ins and the rest of the package is not imported. The decoder loop is
``KimiK3AttnResModel.forward`` and ``KimiAttnResDecoderLayer._forward_list_carrier`` (attn_res_model.py) restated
with normlab's sublayers: layers_per_block = ceil(L / num_blocks) decoder layers, a block committed at the start
of every layers_per_block-th layer (after that layer's pre-attention read), the embedding the first partial sum,
one more read (``output_res_proj``) before the final norm. normlab's weights (pseudo-queries drawn at random, so
the reads are not uniform) are used by both; the largest |logit difference| is printed per configuration.

Each configuration: L layers, N blocks (normlab's ``attnres=N``; torchtitan's ``num_blocks``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import types
from pathlib import Path

import torch
from torch import nn

import normlab

CONFIGS = ((6, 6), (6, 3), (6, 4), (4, 8))  # (layers, blocks)


def load_block_attn_res(checkout: Path):
    """torchtitan's ``block_attn_res`` from the checkout, its two distributed-stack imports stood in for."""
    path = checkout / "torchtitan" / "models" / "kimi_k3" / "attn_res.py"
    if not path.is_file():
        raise SystemExit(f"no {path}: give the root of a torchtitan checkout with models/kimi_k3 (pull request 4281)")
    linear = types.ModuleType("torchtitan.models.common.linear")
    linear.Linear = nn.Linear  # type: ignore[attr-defined]
    module = types.ModuleType("torchtitan.protocols.module")

    class Module:  # the protocol's Config is all AttnResProjection needs at class creation
        class Config:
            pass

    module.Module = Module  # type: ignore[attr-defined]
    sys.modules.update({"torchtitan.models.common.linear": linear, "torchtitan.protocols.module": module})
    spec = importlib.util.spec_from_file_location("torchtitan_kimi_k3_attn_res", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.block_attn_res


def _read(read: nn.Module) -> tuple[nn.Linear, nn.Module]:
    """normlab's DepthAttention as torchtitan's (proj, norm) pair: proj.weight = w (1, d), the same key norm."""
    proj = nn.Linear(read.d, 1, bias=False).to(read.query.dtype)
    with torch.no_grad():
        proj.weight.copy_(read.query[None])
    return proj, read.key_norm


def torchtitan_logits(model: normlab.NormLM, tokens: torch.Tensor, num_blocks: int, block_attn_res) -> torch.Tensor:
    """KimiK3AttnResModel.forward's list carrier with normlab's sublayers (module docstring)."""
    n_layers = len(model.blocks)
    per_block = -(-n_layers // min(num_blocks, n_layers))  # ceil; torchtitan refuses num_blocks > n_layers
    blocks: list[torch.Tensor] = []
    partial: torch.Tensor | None = model.embed(tokens)
    for i, blk in enumerate(model.blocks):
        assert partial is not None
        h = block_attn_res(blocks, partial, *_read(blk.attn_depth))
        if i % per_block == 0:
            blocks, partial = blocks + [partial], None
        a = blk.attn(blk.attn_norms.input(h))
        partial = a if partial is None else partial + a
        h = block_attn_res(blocks, partial, *_read(blk.mlp_depth))
        partial = partial + blk.mlp(blk.mlp_norms.input(h))
    assert partial is not None
    h = block_attn_res(blocks, partial, *_read(model.final_depth))
    return model.head(model.final_norm(h))


def compare(layers: int, blocks: int, block_attn_res, dtype: torch.dtype) -> tuple[float, float, int, int]:
    """(max |logit difference|, max |logit|, normlab's sublayers per block, torchtitan's layers per block)."""
    model = normlab.build_model(f"attnres,attnres={blocks}", "nano", n_layers=layers, seed=0).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "query") and isinstance(m.query, nn.Parameter):
                m.query.copy_(torch.randn(m.query.shape, generator=gen, dtype=dtype))
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    with torch.no_grad():
        ours = model(tokens).logits
        theirs = torchtitan_logits(model, tokens, blocks, block_attn_res)
    size = model.resolved.attn_res_size
    return (ours - theirs).abs().max().item(), ours.abs().max().item(), size, -(-layers // min(blocks, layers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="root of a torchtitan checkout with torchtitan/models/kimi_k3")
    args = parser.parse_args(argv)
    block_attn_res = load_block_attn_res(args.checkout)
    print("layers blocks | normlab sublayers/block | torchtitan layers/block | max |dlogit| float64 | float32", end="")
    print(" | max |logit|")
    for layers, blocks in CONFIGS:
        d64, big, size, per = compare(layers, blocks, block_attn_res, torch.float64)
        d32, _, _, _ = compare(layers, blocks, block_attn_res, torch.float32)
        print(f"{layers:6d} {blocks:6d} | {size:23d} | {per:23d} | {d64:21.3g} | {d32:7.3g} | {big:.3g}")
    eps = torch.finfo(torch.float32).eps
    print(
        f"float32 eps {eps:.3g}; equal partitions agree to rounding, unequal ones differ by O(1) (docs/frameworks.md)"
    )
    return 0 if math.isfinite(eps) else 1


if __name__ == "__main__":
    sys.exit(main())
