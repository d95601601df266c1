"""normlab's SiameseNorm against the authors' own Block, on the same weights: the largest logit difference.

    python scripts/compare_siamese.py CHECKOUT [--layers 4] [--dtype float32|float64]

CHECKOUT is a checkout of Qwen-Applications/SiameseNorm (only its ``deit-model-siamesenorm.py`` is read; it is run
from there, never copied). The authors ship SiameseNorm three times: as a patch to OLMo for language models
(``changes.patch``, which their repository's snapshot does not hold), as ``OLMo_model_hybrid_pre.py`` (its
HybridNorm variant, which needs the whole OLMo package), and for DeiT and DiT. The DeiT file's ``Block`` is the
plain two-stream form normlab's ``siamese`` preset computes; it needs only torch, but the file imports timm at its
top (data constants, a registry, PatchEmbed, Mlp, DropPath), which is not installed here, so the script gives it
stand-ins for those names: none of them is used by ``Block.forward`` except the MLP, which the comparison replaces
by normlab's sublayer anyway, and DropPath at rate 0 (the identity).

The comparison: normlab's ``siamese,norm=layer`` model (LayerNorm, as DeiT's ``norm_layer``) at a small size with a
fixed seed and every norm gain and bias moved off its start; the authors' ``Block`` built per layer with
``index=l`` and ``nn.LayerNorm`` of normlab's eps, its six norms loaded with normlab's (post_norm1/2 <- the X norms,
pre_norm1/2 <- the Y norms, input_norm1/2 <- the sites A), its ``attn`` and ``mlp`` set to normlab's attention and
MLP of that layer (the same function F: the comparison is of the residual wiring); the model's output read as the
DeiT file's ``forward_features`` does (``final_norm(pre_norm(x) + post_norm(y))``) with normlab's output norms, and
the LM head on top. Prints the largest absolute logit difference and exits 1 if it exceeds the dtype's eps times
the logits' largest magnitude times 64 (a bound on the rounding of sums taken in another order).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn


class _Stand(nn.Module):
    """A stand-in for a timm module the DeiT file names but Block.forward does not use (or the comparison replaces)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _timm_stand_ins() -> dict[str, types.ModuleType]:
    def noop(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else None

    names: dict[str, dict[str, Any]] = {
        "timm": {},
        "timm.data": {k: (0.5, 0.5, 0.5) for k in ("IMAGENET_DEFAULT_MEAN", "IMAGENET_DEFAULT_STD")}
        | {k: (0.5, 0.5, 0.5) for k in ("IMAGENET_INCEPTION_MEAN", "IMAGENET_INCEPTION_STD")},
        "timm.models": {},
        "timm.models.helpers": {"build_model_with_cfg": noop, "named_apply": noop, "adapt_input_conv": noop},
        "timm.models.layers": {"PatchEmbed": _Stand, "Mlp": _Stand, "DropPath": _Stand}
        | {"trunc_normal_": noop, "lecun_normal_": noop},
        "timm.models.registry": {"register_model": noop},
    }
    mods = {}
    for name, attrs in names.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mods[name] = mod
    return mods


def load_authors_block(checkout: Path) -> type[nn.Module]:
    """The ``Block`` class of the authors' deit-model-siamesenorm.py, run from ``checkout`` with timm stood in."""
    path = checkout / "deit-model-siamesenorm.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: give the path of a checkout of Qwen-Applications/SiameseNorm")
    saved = {k: sys.modules.get(k) for k in _timm_stand_ins()}
    sys.modules.update(_timm_stand_ins())
    try:
        spec = importlib.util.spec_from_file_location("siamesenorm_deit", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module.Block


def _load(theirs: nn.Module, ours: nn.Module) -> None:
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias if getattr(ours, "bias", None) is not None else torch.zeros_like(theirs.bias))


def _moved(model: nn.Module, seed: int) -> None:
    """Every LayerNorm's gain and bias off its start (1, 0), so a swapped or missing norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.mul_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=g))


def compare(checkout: Path, layers: int, dtype: torch.dtype) -> float:
    import normlab

    block_cls = load_authors_block(checkout)
    ours = normlab.build_model("siamese,norm=layer", "nano", seed=0, n_layers=layers).to(dtype)
    _moved(ours, 1)
    d, heads, eps = ours.config.d_model, ours.config.n_heads, ours.config.norm_eps
    theirs = []
    for i, b in enumerate(ours.blocks):
        blk = block_cls(d, heads, index=i, norm_layer=partial(nn.LayerNorm, eps=eps)).to(dtype)
        for mine, name in (
            (b.attn_xnorm, "post_norm1"),
            (b.attn_ynorm, "pre_norm1"),
            (b.attn_norms.input, "input_norm1"),
            (b.mlp_xnorm, "post_norm2"),
            (b.mlp_ynorm, "pre_norm2"),
            (b.mlp_norms.input, "input_norm2"),
        ):
            _load(getattr(blk, name), mine)
        blk.attn, blk.mlp = b.attn, b.mlp  # the same F: the comparison is of the residual wiring
        theirs.append(blk)
    pre_norm, post_norm = (nn.LayerNorm(d, eps=eps).to(dtype) for _ in range(2))
    _load(pre_norm, ours.final_xnorm)  # forward_features: pre_norm(x) reads the X stream, post_norm(y) the Y
    _load(post_norm, ours.final_ynorm)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(tokens).logits
        x = ours.embed(tokens)
        y = x.clone()
        for blk in theirs:
            x, y = blk(x, y)
        got = ours.lm_head(ours.final_norm(pre_norm(x) + post_norm(y)))
    diff = (got - want).abs().max().item()
    bound = torch.finfo(dtype).eps * want.abs().max().item() * 64
    print(
        f"{layers} layers, {dtype}: largest |logit difference| {diff:.3g} (bound {bound:.3g}; logits up to "
        f"{want.abs().max().item():.3g})"
    )
    return diff if diff <= bound else float("inf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of Qwen-Applications/SiameseNorm")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args()
    return 0 if compare(args.checkout, args.layers, getattr(torch, args.dtype)) != float("inf") else 1


if __name__ == "__main__":
    sys.exit(main())
