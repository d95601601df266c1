"""normlab's GatedNorm presets against marin's grug MoE model, on the same weights: the largest logit difference.

    PYTHONPATH=src VENV/bin/python scripts/compare_gatednorm_marin.py CHECKOUT \
        [--layout pre-gatednorm|sandwich-gatednorm] [--layers 2] [--dtype float32|float64 [--norms-float64]]

CHECKOUT is a checkout of marin-community/marin (written against commit 0080498); only
``experiments/grug/moe/model.py`` is read, and it is run from there, never copied. It needs JAX, which normlab's own
venv does not have, so the script runs in a venv of its own (the versions it was run with; haliax 1.4.dev453 is the
newest on PyPI):

    python3.11 -m venv VENV
    VENV/bin/pip install "jax[cpu]==0.10.2" equinox==0.13.8 jaxtyping==0.3.11 einops==0.8.2 haliax==1.4.dev453 \
        torch==2.13.0 numpy==2.4.6

What runs from marin's file, as written: ``GrugModelConfig``, ``Transformer.logits`` (the embedding lookup,
``embed_gated_norm(embed_norm(.))``, ``block_range``, ``finalize_hidden`` = ``final_gated_norm(final_norm(.))``, the
output projection), ``Block.__call__`` (``attention_residual`` and ``moe_residual``), ``RMSNorm`` and ``GatedNorm``,
on a one-device CPU mesh with marin's axis names. What is normlab's: the sublayers. marin's attention (exclusive
self-attention, half RoPE, QK-norm, a head gate) and its QB-routed MoE are functions normlab's presets do not build,
so each ``Block``'s ``attn`` and ``mlp`` are normlab's attention and SwiGLU MLP of that layer, called from JAX through
``jax.pure_callback`` (the same function F on both sides: the comparison is of the norms, the gates and the residual
wiring), and ``shared`` (the shared expert) is None. For ``sandwich-gatednorm`` the MLP's output also goes through
marin's ``RMSNorm`` then ``GatedNorm`` before ``moe_residual`` adds it, as marin issue 4993 writes the sandwich
(``mlp_out = post_mlp_gated_norm(rms_post_mlp(mlp_out))``; its branch, moe_sandwich_gated_norm, was not merged, so
that one line is restated here with marin's own norm classes).

normlab's model is built at d_model 256 (the gate's rank is marin's 128, below the width, so a transposed gate
matrix fails on its shape) with eps 1e-5 and ``norm_compute=fp32`` (marin's ``layer_norm_eps`` default and its
RMSNorm's float32), every norm gain moved off 1 and the gate matrices drawn at std 0.1 (at marin's 0.02 the gate
is 1/2 within 1e-3, and a swapped matrix would hardly show); its weights are copied into marin's tree (marin's
``w_down`` (d, r) is normlab's ``gate_down`` (r, d) transposed, ``w_up`` likewise, ``output_proj`` is ``lm_head``'s
weight transposed). Prints the largest absolute logit difference and exits 1 if it exceeds float32's eps times the
logits' largest magnitude times 64 (a bound on the rounding of sums taken in another order): float32's eps in both
dtypes, since marin's RMSNorm computes in float32 whatever the input's dtype. ``--dtype float64 --norms-float64``
lifts that: marin's module is handed a ``jnp`` whose ``float32`` is float64 and normlab's norms compute in the
input's dtype, so nothing rounds at float32 and the bound takes float64's eps (what is left is float64's rounding).

Stand-ins: the file imports levanter (its grug attention, MoE, loss and sharding modules, the HF converter, the
tracker, the activation enum) and transformers at its top; levanter on PyPI (1.1, 1.2.dev1644) has no grug, so the
script gives stand-ins for all of those names. Four are on the path above: ``unshard`` (the identity: it gathers a
sharded norm weight, and one device holds everything), ``AttentionMask`` and ``RotaryConfig`` (records of the mask
``block_range`` hands to the attention and of the RoPE setting ``GrugModelConfig`` holds, both read only by marin's
attention, which normlab's causal attention replaces), and ``resolve_moe_implementation`` (``GrugModelConfig``
validates its MoE setting with it; returns it unchanged). The rest (annotations, the MoE kernel, the loss, the HF
converter, the FP8 op haliax 1.4.dev453 does not have yet) are empty names that the path never calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

MODEL = Path("experiments/grug/moe/model.py")
LAYOUTS = ("pre-gatednorm", "sandwich-gatednorm")
D_MODEL, N_HEADS, SEQ, GATE_STD, EPS = 256, 4, 16, 0.1, 1e-5
AXES = ("replica_dcn", "data", "expert", "model")  # marin's mesh axes (debug_mesh_and_token_pspec)


def _fail(msg: str) -> NoReturn:
    print(msg, file=sys.stderr)
    raise SystemExit(2)


class _Unused:
    """A name marin's file imports but the compared path never calls (an annotation, a class it subscripts)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a stand-in for a levanter name the comparison does not use was called")

    def __class_getitem__(cls, item: Any) -> type:
        return cls


@dataclasses.dataclass(frozen=True)
class _AttentionMask:
    """levanter.grug.attention.AttentionMask's fields as block_range builds them; the attention that would read it
    is normlab's (causal, no window), so it is only carried."""

    is_causal: bool = True
    sliding_window: int | None = None
    segment_ids: Any = None

    @classmethod
    def causal(cls) -> _AttentionMask:
        return cls()


@dataclasses.dataclass(frozen=True)
class _Rotary:
    """levanter.grug.attention.RotaryConfig: GrugModelConfig's ``rope`` field makes one; only marin's attention,
    replaced here, reads it."""

    theta: float = 10000.0


class _Activation(enum.Enum):
    silu = "silu"  # DenseMLP's default argument; the shared expert (its only user) is None here


def _stand_ins() -> dict[str, types.ModuleType]:
    names: dict[str, dict[str, Any]] = {
        "levanter": {},
        "levanter.compat": {},
        "levanter.compat.hf_checkpoints": {"HFCheckpointConverter": _Unused},
        "levanter.grug": {},
        "levanter.grug.attention": {"AttentionMask": _AttentionMask, "GrugAttentionImplementation": str}
        | {"RotaryConfig": _Rotary, "align_kv_heads": _Unused, "apply_rotary_embedding": _Unused}
        | {"attention": _Unused},
        "levanter.grug.grug_moe": {"MOE_REMAT_SAVE_NAMES": (), "MoeActivation": _Unused, "MoEExpertMlp": _Unused}
        | {"MoeImplementation": str, "MoeRaggedDotOps": _Unused}
        | {"resolve_moe_implementation": lambda implementation: implementation},
        "levanter.grug.loss": {"fused_linear_softmax_cross_entropy_loss": _Unused},
        "levanter.grug.sharding": {"Pembed_vocab": None, "Plm_head": None, "unshard": lambda x: x},
        "levanter.tracker": {},
        "levanter.tracker.histogram": {"Histogram": _Unused, "SummaryStats": _Unused},
        "levanter.utils": {},
        "levanter.utils.activation": {"ActivationFunctionEnum": _Activation},
        "transformers": {"PretrainedConfig": type("PretrainedConfig", (), {})},
    }
    mods = {}
    for name, attrs in names.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mods[name] = mod
    return mods


def load_marin(checkout: Path) -> types.ModuleType:
    """marin's experiments/grug/moe/model.py, run from ``checkout`` with levanter and transformers stood in."""
    import haliax.quantization

    if not hasattr(haliax.quantization, "Fp8RaggedDotOp"):  # MoEMLP.init's research FP8 path only
        haliax.quantization.Fp8RaggedDotOp = _Unused  # type: ignore[attr-defined]
    stand_ins = _stand_ins()
    saved = {k: sys.modules.get(k) for k in stand_ins}
    sys.modules.update(stand_ins)
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ written into the checkout
    try:
        spec = importlib.util.spec_from_file_location("marin_grug_moe_model", checkout / MODEL)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = bytecode
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def build_ours(layout: str, layers: int, dtype: torch.dtype) -> Any:
    """normlab's model with every norm gain off 1 and the gates off their near-1/2 start (see the docstring)."""
    import normlab
    from normlab.model.norms import GatedNorm

    ours = normlab.build_model(
        layout, "nano", seed=0, n_layers=layers, d_model=D_MODEL, n_heads=N_HEADS, norm_eps=EPS, norm_compute="fp32"
    ).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, GatedNorm):
                m.weight.mul_(1 + 0.3 * torch.randn(m.weight.shape, generator=g, dtype=dtype))
                m.gate_down.copy_(GATE_STD * torch.randn(m.gate_down.shape, generator=g, dtype=dtype))
                m.gate_up.copy_(GATE_STD * torch.randn(m.gate_up.shape, generator=g, dtype=dtype))
    return ours


def _via_torch(module: torch.nn.Module) -> Any:
    """normlab's sublayer as a JAX function (jax.pure_callback: it runs inside marin's checkpointed block)."""
    import jax

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(np.array(x))).numpy()

    return lambda x: jax.pure_callback(run, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _marin_norms(marin: types.ModuleType, norm: Any, jnp: Any) -> tuple[Any, Any]:
    """marin's RMSNorm and GatedNorm holding one normlab GatedNorm's weights."""
    w = {k: jnp.asarray(v.detach().numpy()) for k, v in norm.named_parameters()}
    rms = marin.RMSNorm(weight=w["weight"], eps=norm.eps)
    return rms, marin.GatedNorm(w_down=w["gate_down"].T, w_up=w["gate_up"].T)


def build_marin(marin: types.ModuleType, ours: Any, sandwich: bool) -> Any:
    """marin's Transformer holding normlab's weights, each Block's attn and mlp normlab's (the docstring)."""
    import jax.numpy as jnp

    cfg = ours.config
    stats = {k: jnp.zeros(()) for k in ("routing_entropy", "routing_counts", "load_balancing_loss")}
    stats |= {k: jnp.zeros(()) for k in ("router_z_loss", "qb_beta", "capacity_overflow")}
    blocks = []
    for b in ours.blocks:
        attn, mlp = _via_torch(b.attn), _via_torch(b.mlp)
        if sandwich:  # marin issue 4993: mlp_out = post_mlp_gated_norm(rms_post_mlp(mlp_out))
            rms_post, gated_post = _marin_norms(marin, b.mlp_norms.output, jnp)
            mlp = (lambda f, r, g: lambda x: g(r(f(x))))(mlp, rms_post, gated_post)
        rms_attn, attn_gated = _marin_norms(marin, b.attn_norms.input, jnp)
        rms_mlp, mlp_gated = _marin_norms(marin, b.mlp_norms.input, jnp)
        blocks.append(
            marin.Block(
                rms_attn=rms_attn,
                attn_gated_norm=attn_gated,
                attn=(lambda f: lambda x, mask, use_pko=False, disable_rope=False: f(x))(attn),
                rms_mlp=rms_mlp,
                mlp_gated_norm=mlp_gated,
                mlp=(lambda f: lambda x: (f(x), stats))(mlp),
                shared=None,
            )
        )
    embed_norm, embed_gated = _marin_norms(marin, ours.embed_norm, jnp)
    final_norm, final_gated = _marin_norms(marin, ours.final_norm, jnp)
    grug = marin.GrugModelConfig(
        vocab_size=cfg.vocab_size, hidden_dim=cfg.d_model, num_layers=cfg.n_layers, num_heads=cfg.n_heads
    )
    grug = dataclasses.replace(grug, num_kv_heads=cfg.n_heads, max_seq_len=SEQ, sliding_window=SEQ, layer_norm_eps=EPS)
    return marin.Transformer(
        token_embed=jnp.asarray(ours.embed.weight.detach().numpy()),
        embed_norm=embed_norm,
        embed_gated_norm=embed_gated,
        output_proj=jnp.asarray(ours.lm_head.weight.detach().numpy().T),
        blocks=tuple(blocks),
        final_norm=final_norm,
        final_gated_norm=final_gated,
        config=grug,
    )


def _norms_in_float64(marin: types.ModuleType, ours: Any) -> None:
    """marin's RMSNorm casts to ``jnp.float32`` whatever the input; its module is handed a ``jnp`` whose float32 is
    float64, and normlab's norms compute in the input's dtype, so a float64 run rounds nowhere at float32."""
    import jax.numpy as jnp

    wide = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
    wide.float32 = jnp.float64
    marin.jnp = wide  # type: ignore[attr-defined]
    for m in ours.modules():
        if hasattr(m, "compute"):
            m.compute = "input"


def compare(checkout: Path, layout: str, layers: int, dtype: torch.dtype, wide: bool) -> tuple[float, float]:
    """(largest |logit difference|, bound) of normlab's ``layout`` against marin's model on its weights; ``wide``:
    both sides' norms in float64 (``--norms-float64``)."""
    try:
        import jax
    except ImportError:
        _fail("jax is not installed here: run this script in the venv its docstring gives (jax[cpu]==0.10.2, ...)")
    jax.config.update("jax_enable_x64", dtype == torch.float64)
    marin = load_marin(checkout)
    ours = build_ours(layout, layers, dtype)
    if wide:
        _norms_in_float64(marin, ours)
    tokens = torch.randint(0, ours.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(2))
    explicit = (jax.sharding.AxisType.Explicit,) * len(AXES)
    with jax.set_mesh(jax.make_mesh((1,) * len(AXES), AXES, axis_types=explicit)):
        model = build_marin(marin, ours, sandwich=layout == "sandwich-gatednorm")
        got = np.asarray(model.logits(jax.numpy.asarray(tokens.numpy())))
    with torch.no_grad():
        want = ours(tokens).logits.numpy()
    if got.dtype != want.dtype:
        raise AssertionError(f"marin's logits are {got.dtype}, normlab's {want.dtype}")
    diff = float(np.abs(got - want).max())
    bound = float(torch.finfo(dtype if wide else torch.float32).eps * np.abs(want).max() * 64)
    norms = ", norms float64" if wide else ""
    print(
        f"{layout}, {layers} layers, {dtype}{norms}: largest |logit difference| {diff:.3g} (bound {bound:.3g}; "
        f"logits up to {np.abs(want).max():.3g})"
    )
    return diff, bound


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of marin-community/marin")
    parser.add_argument("--layout", choices=LAYOUTS, default="pre-gatednorm")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--norms-float64", action="store_true", help="with --dtype float64: the norms too")
    args = parser.parse_args()
    if args.layers < 1:
        _fail(f"--layers {args.layers}: give a positive number of layers")
    if not (args.checkout / MODEL).is_file():
        _fail(f"no {args.checkout / MODEL}: give the root of a checkout of marin-community/marin (it holds {MODEL})")
    if args.norms_float64 and args.dtype != "float64":
        _fail("--norms-float64 goes with --dtype float64 (it lifts marin's float32 RMSNorm to float64)")
    diff, bound = compare(args.checkout, args.layout, args.layers, getattr(torch, args.dtype), args.norms_float64)
    return 0 if diff <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
