"""The norm tax: what a candidate's extra norms (and any other change of the block) cost per step, measured
at the user's width, heads, FFN and sequence length on the device present, not at the proxy's.

What is timed: forward + backward of `BLOCKS` blocks of the user's shape (one where two would not fit
`MEMORY`; the embedding and head at a byte vocabulary, so the blocks are nearly all of it; the optimizer's
update of a norm's weight vector is left out), the baseline and the candidate in turns, the order alternating
(base then cand, cand then base: ABBA) so that a machine's drift and an order effect land on both; on the CPU
each step the lesser of its wall and CPU seconds (a load only ever lengthens either), on CUDA its wall time.
The tax is the geometric mean over turns of t_cand / t_base, minus 1, and its interval Student's t over the
turns' log ratios (`LEVEL`; the point and the interval from the same mean, so the point lies inside). Eager,
and under torch.compile (its fusion of the norms into the neighbouring element-wise work is what a compiled
run pays). Fused kernel libraries (liger-kernel's RMSNorm) are not timed: normlab's norms are its own modules.

Where it is measured matters: on a GPU the matrix products run far faster than the memory-bound norms, so a
norm's share of a GPU step is larger than of a CPU step. A tax measured on the CPU for a GPU user is a lower
bound (`bound`: "lower"), said so in the answer. On the CPU the timed sequence is cut to `CPU_TOKENS` tokens
(the attention's share grows with the sequence, the norms' does not: at the user's full sequence the norm
share is smaller still; said so).

Cached per (device, the whole model configuration but depth and vocabulary, tokens, torch version, pair,
mode) in the cache folder, so a second call (or a resumed recommendation) reads it instead of timing again;
a measurement the deadline cut short of its turns is not kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from normlab.errors import DataError
from normlab.io import atomic_write_json, read_json
from normlab.model.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

BLOCKS = 2
CPU_TOKENS = 128
GPU_TOKENS = 4096
TURNS = 5  # at least this many turns (where the deadline allows)
MAX_TURNS = 15  # and more, up to this many, while `extra_s` allows: the interval narrows as 1/sqrt(turns)
LEVEL = 0.95
TAX_VERSION = 2  # 2: denormals flushed on the CPU while timing
MEMORY = 6 * 2**30  # the timed blocks' weights and gradients at most about this (float32; checked on the CPU)
MIN_LEFT_S = 10.0  # no model is built with less than this left before the deadline


class TaxSkipped(RuntimeError):
    """The tax could not be timed here (too large for this machine's memory, or past the deadline); the
    message says which."""


def block_bytes(cfg: ModelConfig) -> int:
    """About the bytes one block's weights and gradients take in float32 (attention and MLP matrices)."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    attn = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * kv
    mlp = (3 if cfg.mlp in ("swiglu", "geglu", "geglu-tanh") else 2) * d * cfg.ffn_dim
    return 8 * (attn + mlp) * max(1, cfg.n_experts or 1)


@dataclass(frozen=True)
class TaxShape:
    """The shape the tax is timed at: the user's block, the tokens of one timed step."""

    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    ffn_dim: int
    mlp: str
    tokens: int
    user_seq_len: int

    @classmethod
    def of(cls, cfg: ModelConfig, device: str) -> TaxShape:
        seq = int(cfg.max_seq_len)
        cap = GPU_TOKENS if device == "cuda" else CPU_TOKENS
        return cls(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.mlp, min(seq, cap), seq)

    def words(self) -> str:
        return (
            f"d {self.d_model}, {self.n_heads}/{self.kv_heads} heads of {self.head_dim}, FFN {self.ffn_dim} "
            f"({self.mlp}), {self.tokens} tokens a step"
        )


@dataclass(frozen=True)
class Tax:
    """One candidate's measured tax against the baseline (t_cand / t_base - 1)."""

    baseline: str
    candidate: str
    value: float
    interval: list[float] | None
    mode: str  # eager | compiled
    device: str  # in words (normlab.train.mfu.device_name)
    device_type: str  # cpu | cuda
    shape: dict[str, Any]
    turns: int
    base_ms: float
    cand_ms: float
    torch: str
    bound: str | None  # "lower" where measured on the CPU (the user trains on GPUs)
    cached: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio_stats(ratios: list[float], level: float = LEVEL) -> tuple[float, list[float] | None]:
    """exp(mean log(t_cand / t_base)) - 1 over turns and Student's t interval on the log ratios (None under 2)."""
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    if len(ratios) < 2:
        return math.exp(m) - 1.0, None
    s = statistics.stdev(logs)
    half = float(stats.t.ppf(0.5 + level / 2, len(logs) - 1)) * s / math.sqrt(len(logs))
    return math.exp(m) - 1.0, [math.exp(m - half) - 1.0, math.exp(m + half) - 1.0]


def _cache_path(key: dict[str, Any]) -> Path:
    from normlab.data.corpus import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "recommend" / f"tax-{digest}.json"


def _cached(path: Path, key: dict[str, Any]) -> Tax | None:
    """The cached tax for `key`, None where absent or unreadable (then it is timed again and rewritten)."""
    if not path.is_file():
        return None
    try:
        hit = read_json(path)
        return Tax(**{**hit["tax"], "cached": True}) if hit.get("key") == key else None
    except (DataError, KeyError, TypeError, AttributeError):
        return None


def _step(model: nn.Module, x: torch.Tensor, compiled: bool) -> Callable[[], None]:
    import torch

    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(x, targets=x).loss.backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    return run


def _build(layout: str, cfg: ModelConfig, tokens: int, device: str, compiled: bool, blocks: int) -> nn.Module:
    import torch

    from normlab.model.build import build_model

    model = build_model(layout, cfg.with_(n_layers=blocks, vocab_size=256, max_seq_len=tokens), seed=0).to(device)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    return cast("nn.Module", torch.compile(model)) if compiled else model


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _key(cfg: ModelConfig, baseline: str, candidate: str, mode: str, dev: str) -> dict[str, Any]:
    """The cache's key: the device by name, the shape, torch's version, the pair, the mode, the blocks timed."""
    import torch

    from normlab.train.mfu import device_name

    per_block = block_bytes(cfg)
    return {
        "v": TAX_VERSION,
        "device": device_name(torch.device(dev)),
        "shape": asdict(TaxShape.of(cfg, dev)),
        "model": {k: v for k, v in cfg.to_dict().items() if k not in ("n_layers", "vocab_size")},  # all that builds it
        "torch": torch.__version__,
        "pair": [baseline, candidate],
        "mode": mode,
        "blocks": BLOCKS if 2 * BLOCKS * per_block <= MEMORY else 1,  # both models live at once
        "experts": cfg.n_experts,
    }


@dataclass(frozen=True)
class TaxTiming:
    """How `measure` times: eager or compiled ``mode``; at least ``turns`` ABBA turns, and more (up to `MAX_TURNS`)
    while they have taken less than ``extra_s`` seconds; the ``device`` (None: CUDA where present); a
    ``deadline`` (time.time()) that stops the turns early (at least 2 are kept, or the tax is refused with why);
    whether the cache is read and written (``use_cache``)."""

    mode: str = "eager"
    turns: int = TURNS
    extra_s: float = 0.0
    device: str | None = None
    deadline: float | None = None
    use_cache: bool = True


def measure(cfg: ModelConfig, baseline: str, candidate: str, timing: TaxTiming = TaxTiming()) -> Tax:
    """The candidate's tax against the baseline at the user's shape (module doc), timed as ``timing`` says."""
    import torch

    mode, deadline, use_cache = timing.mode, timing.deadline, timing.use_cache
    dev = timing.device or _device()
    key = _key(cfg, baseline, candidate, mode, dev)
    per_block = block_bytes(cfg)
    path = _cache_path(key)
    if use_cache and (hit := _cached(path, key)) is not None:
        return hit
    if 2 * per_block > MEMORY and dev == "cpu":
        raise TaxSkipped(
            f"one block of your shape takes about {per_block / 2**30:.1f} GiB with its gradients: too large to time "
            f"two side by side within {MEMORY / 2**30:.0f} GiB here"
        )
    if deadline is not None and time.time() + MIN_LEFT_S > deadline:
        raise TaxSkipped(f"the budget left less than {MIN_LEFT_S:g} s to time it")
    # denormal floats are computed slowly by a CPU and at full speed by a GPU: flushed to zero while timing, so the
    # CPU times the norms' work, not its handling of the tiny values one layout's activations may hold (restored)
    flushed = dev == "cpu" and torch.set_flush_denormal(True)
    try:
        tax = _timed(cfg, (baseline, candidate), mode, (timing.turns, timing.extra_s), dev, deadline, key["blocks"])
    finally:
        if flushed:
            torch.set_flush_denormal(False)
    if use_cache and tax.turns >= timing.turns:  # a measurement the deadline cut short is not kept
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"key": key, "tax": tax.to_dict()})
    return tax


def _timed(
    cfg: ModelConfig,
    pair: tuple[str, str],
    mode: str,
    turns_and_extra: tuple[int, float],
    dev: str,
    deadline: float | None,
    blocks: int,
) -> Tax:
    """`measure`'s timing of `pair` (baseline, candidate), once the cache has missed: at least `turns`, and more
    while `extra_s` allows (`turns_and_extra`)."""
    import torch

    from normlab.train.mfu import device_name

    baseline, candidate = pair
    turns, extra_s = turns_and_extra
    shape, name = TaxShape.of(cfg, dev), device_name(torch.device(dev))
    compiled = mode == "compiled"
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, shape.tokens), generator=g).to(dev)
    # by role, not by name: a layout timed against itself (a control) is two models too
    steps = {
        role: _step(_build(n, cfg, shape.tokens, dev, compiled, blocks), x, compiled)
        for role, n in (("base", baseline), ("cand", candidate))
    }
    warm = time.time()
    for fn in steps.values():  # warm-up (and compilation) outside the turns
        fn()
    one = time.time() - warm
    if deadline is not None and time.time() + 3 * one > deadline:  # a second warm-up and two turns: 3 step pairs
        raise TaxSkipped(f"the budget left no time to time it (a step pair took {one:.1f} s)")
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {"base": [], "cand": []}
    began = time.time()
    for i in range(max(turns, MAX_TURNS if extra_s > 0 else turns)):
        if deadline is not None and len(times["base"]) >= 2 and time.time() + 0.5 * one > deadline:
            break
        if i >= turns and time.time() + 0.5 * one > began + extra_s:
            break
        for n in ("base", "cand") if i % 2 == 0 else ("cand", "base"):  # ABBA: an order effect cancels
            wall, cpu = time.perf_counter(), time.process_time()
            steps[n]()
            # on the CPU the lesser of wall and CPU seconds (as normlab.recommend.planning.cost's calibration): another
            # process's load only ever makes either larger; on CUDA the wall time (the step ends synchronized)
            took = time.perf_counter() - wall
            times[n].append(took if dev == "cuda" else min(took, time.process_time() - cpu))
    ratios = [c / b for b, c in zip(times["base"], times["cand"])]
    value, interval = ratio_stats(ratios)
    tax = Tax(
        baseline=baseline,
        candidate=candidate,
        value=value,
        interval=interval,
        mode=mode,
        device=name,
        device_type=dev,
        shape=asdict(shape),
        turns=len(ratios),
        base_ms=1e3 * statistics.median(times["base"]),
        cand_ms=1e3 * statistics.median(times["cand"]),
        torch=torch.__version__,
        bound="lower" if dev == "cpu" else None,
        note=_note(dev, shape),
    )
    return tax


def _note(device: str, shape: TaxShape) -> str:
    if device != "cpu":
        return f"measured on your kind of device at {shape.words()}"
    cut = f" (your sequence {shape.user_seq_len:,} cut to {shape.tokens}: the norms' share is smaller at yours)"
    return (
        f"measured on the CPU at {shape.words()}{cut}; on a GPU the matrix products run far faster than the "
        "memory-bound norms, so this is a lower bound on your GPU's tax (fused kernels are not timed)"
    )


def words(tax: dict[str, Any]) -> str:
    """ "+3.1% [+2.0%, +4.2%] a step (eager, NVIDIA H200, d 2048, ...)" """
    iv = tax.get("interval")
    text = f"{100 * tax['value']:+.1f}%"
    if iv:
        text += f" [{100 * iv[0]:+.1f}%, {100 * iv[1]:+.1f}%]"
    text += f" a step ({tax['mode']}, {tax['device']}, {TaxShape(**tax['shape']).words()})"
    if tax.get("bound") == "lower":
        text += ": a lower bound for a GPU"
    return text


def is_cached(cfg: ModelConfig, baseline: str, candidate: str, mode: str) -> bool:
    """Whether the cache holds this tax for the device present (timing it then costs nothing)."""
    key = _key(cfg, baseline, candidate, mode, _device())
    return _cached(_cache_path(key), key) is not None
