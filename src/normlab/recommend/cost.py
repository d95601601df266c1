"""What `normlab recommend`'s stages cost on this machine, from counted work and a calibration measured
once per machine (no candidate is timed): the plan is a function of the inputs and the cached numbers,
so the same command plans the same grid on every call, loaded machine or not.

Counted work (from the model's shape and the layout's data, nothing built):

    training step   F = tokens x (6 N + 12 L H Q T)     matrix FLOPs, PaLM App. B (`normlab.train.mfu`);
                                                         N counts the gate's projection where there is one
                    E = tokens x (norm elements per token) every norm site's width over the layers
                                                         (d per A/B/C site, the FFN per H, heads x head
                                                         width per q/k/v/context), the embedding and final norms
    optimizer       M = Muon's Newton-Schulz FLOPs a step  k (4 m^2 n + 2 m^3) per m x n matrix Muon takes
                                                         (`normlab.train.mfu.newton_schulz_flops`) over the
                                                         blocks' matrices from the shape and the layout's data
                                                         (`muon_shapes`: q, k, v, o, the gate's projection, the
                                                         MLP's or each expert's); 0 for AdamW and SGD
                                                         (elementwise: O(N) against 6 N a token)
    streams         S = tokens x 2 L x n x d             hyper-connections (`streams=n`, n > 1): the widened
                                                         stream's elements each connection reads and writes
                                                         (its pre and post maps, its res mixing, its own RMS
                                                         and, for mHC, phi's product and the Sinkhorn
                                                         iterations: small tensors, many kernels, none of it in
                                                         F or E), priced per element at a rate of its own per
                                                         mix (`STREAM_MIXES`: hc, mhc)
    screen          B = 128 x (2 N_layer + 4 H Q T)      one block's forward FLOPs on the screen's 2 x 64 tokens

The calibration (`calibrate`, a few seconds, cached under the normlab cache folder keyed by the
machine, its CPU, torch's version and the thread count a worker uses) times training steps of a fixed
micro model (Pre-LN at 2 and 6 layers, Peri-LN at 6, and Pre-LN at 6 with 4 streams of each mix) and
screens of a fixed shape (1 and 3 layers at width 64, 1 layer at 256), each the fastest of a few repeats in
CPU time (time.process_time: other processes' load inflates it far less than wall time), and fits

    step seconds   = c0 + c_flop (F + M) + c_norm E + c_stream[mix] S
    screen seconds = s0 + L (s_layer + s_flop B)

The stream rates are each mix's 6-layer step beyond Pre-LN's, as a share of Pre-LN's, over its S (n = 4,
the presets' pre-hc and pre-mhc; `with_stream_rates`): on the 2-core VM (2026-11-26, loaded) a 12-layer proxy
step of the Llama 3.2 1B shape took 2.3x Pre-LN's with pre-hc and 3.4x with pre-mhc, where F and E alone
price both at 1.0x. A calibration cached before the stream rates existed gets them added, the rest kept.
A proxy run's seconds are `RUN_OVERHEAD_S` x this machine's speed (start-up, data, checkpoints) plus
`STEP_FACTOR` x steps x step seconds (probes, evaluation). Coefficients are clamped at zero, so a noisy
repeat can only make the plan smaller. Delete the cache file (its path is printed) to measure again.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from normlab.layout import as_layout
from normlab.layout.sites import STREAM_MIXES
from normlab.model.config import ModelConfig

CALIBRATION_VERSION = 1  # a cached calibration without stream rates gets them added (`calibration`)
CAL_STREAMS = 4  # the calibration's streams (the pre-hc and pre-mhc presets')
CAL_BATCH, CAL_SEQ = 16, 128  # the proxy runs' batch (RECOMMEND_BASE)
SCREEN_TOKENS, SCREEN_SEQ = 128, 64  # the screen's batch 2 x 64
RUN_OVERHEAD_S = 8.0  # a proxy run's start-up, data, evaluation and checkpoints on the reference VM
STEP_FACTOR = 1.0  # the reference VM: a 12-layer Peri-LN proxy of 150 steps took 49 s = 8 + 150 x 0.275
REFERENCE_STEP_S = 0.275  # the reference VM's bare step of the 12-layer Peri-LN proxy of a Llama shape
REFERENCE_SHAPE = ModelConfig(d_model=64, n_layers=12, n_heads=4, max_seq_len=128, vocab_size=256)


def _matrix_weights(cfg: ModelConfig, layout: str) -> int:
    """N: the weights in matrix products per token (q, k, v, o, the gate's projection, the MLP or the k
    experts a token uses and the router, the LM head)."""
    d, hd, h, kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    resolved = as_layout(layout).resolve(cfg.n_layers)
    n_mats = 3 if cfg.mlp in ("swiglu", "geglu-tanh") else 2
    mlp = cfg.moe_top_k * cfg.expert_weights + d * cfg.n_experts if cfg.n_experts else n_mats * d * cfg.ffn_dim
    total = cfg.vocab_size * d
    for blk in resolved.blocks:
        total += d * h * hd + 2 * d * kv * hd + h * hd * d + mlp + (d * h * hd if blk.attn_inner.gate else 0)
    return total


def _norm_elements(cfg: ModelConfig, layout: str) -> int:
    """Norm elements per token: every norm site's width, over the layers."""
    lay = as_layout(layout)
    d, hd = cfg.d_model, cfg.head_dim
    total = d * (int(lay.embed_norm) + int(lay.final_norm))
    for blk in lay.resolve(cfg.n_layers).blocks:
        inner = blk.attn_inner
        total += d * (blk.attn.n_norms + blk.mlp.n_norms) + cfg.ffn_dim * int(blk.mlp.hidden)
        total += hd * (
            cfg.n_heads * (int(inner.q) + int(inner.context) + int(inner.gate))
            + cfg.kv_heads * (int(inner.k) + int(inner.v))
        )
    return total


def step_work(
    cfg: ModelConfig, layout: str, tokens: int = CAL_BATCH * CAL_SEQ, seq: int = CAL_SEQ
) -> tuple[float, float]:
    """(F, E) of one training step of `layout` at `cfg` on `tokens` tokens (module doc)."""
    flops = 6 * _matrix_weights(cfg, layout) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq
    return float(tokens * flops), float(tokens * _norm_elements(cfg, layout))


def stream_work(cfg: ModelConfig, layout: str, tokens: int = CAL_BATCH * CAL_SEQ) -> tuple[str, float]:
    """(mix, S) of one training step (module doc): the stream elements every hyper-connection reads and writes,
    S = tokens x 2 L x n x d; ("", 0) for one stream."""
    lay = as_layout(layout)
    if lay.streams <= 1:
        return "", 0.0
    return lay.stream_mix, float(tokens * 2 * cfg.n_layers * lay.streams * cfg.d_model)


def block_work(cfg: ModelConfig) -> float:
    """B: one block's forward FLOPs on the screen's tokens."""
    per_layer = _matrix_weights(cfg.with_(n_layers=1), "pre") - cfg.vocab_size * cfg.d_model
    return float(SCREEN_TOKENS * (2 * per_layer + 4 * cfg.n_heads * cfg.head_dim * SCREEN_SEQ))


def muon_shapes(cfg: ModelConfig, layout: str) -> list[tuple[int, int]]:
    """The (out, in) shapes of the matrices Muon takes (`normlab.train.optim.muon_matrices`), counted from
    the shape and the layout's data: per block q, k, v, o, the gate's projection where the layout has one,
    and the MLP's matrices, or each expert's (and a shared expert's); routers stay with AdamW."""
    d, hd, h, kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    gated = cfg.mlp in ("swiglu", "geglu-tanh")
    out: list[tuple[int, int]] = []
    for blk in as_layout(layout).resolve(cfg.n_layers).blocks:
        out += [(h * hd, d), (kv * hd, d), (kv * hd, d), (d, h * hd)] + ([(h * hd, d)] if blk.attn_inner.gate else [])
        if cfg.n_experts:
            f = cfg.expert_ffn_dim
            out += cfg.n_experts * [(f, d), (f, d), (d, f)]
            out += [(f, d), (f, d), (d, f)] if cfg.moe_shared_expert else []
        else:
            out += [(cfg.ffn_dim, d)] * (2 if gated else 1) + [(d, cfg.ffn_dim)]
    return out


def optimizer_work(cfg: ModelConfig, layout: str, optimizer: str = "adamw", ns_steps: int = 5) -> float:
    """M: the FLOPs an optimizer step adds (module doc): Muon's Newton-Schulz iterations over the matrices
    it takes; 0 for AdamW and SGD."""
    if optimizer != "muon":
        return 0.0
    from normlab.train.mfu import newton_schulz_flops

    return float(sum(newton_schulz_flops(s, ns_steps) for s in muon_shapes(cfg, layout)))


@dataclass(frozen=True)
class Calibration:
    """This machine's rates (module doc); `seconds`: what measuring them took."""

    c0: float
    c_flop: float
    c_norm: float
    s0: float
    s_layer: float
    s_flop: float
    seconds: float
    key: str = ""
    measured: dict[str, float] | None = None  # the timings behind the fit
    c_stream: dict[str, float] = field(default_factory=dict)  # seconds per stream element, per mix (module doc)

    def step_seconds(self, cfg: ModelConfig, layout: str, optimizer: str = "adamw", ns_steps: int = 5) -> float:
        f, e = step_work(cfg, layout)
        mix, s = stream_work(cfg, layout)
        return (
            self.c0
            + self.c_flop * (f + optimizer_work(cfg, layout, optimizer, ns_steps))
            + self.c_norm * e
            + self.c_stream.get(mix, 0.0) * s
        )

    @property
    def speed(self) -> float:
        """This machine's step time over the reference VM's (> 1: slower)."""
        return self.step_seconds(REFERENCE_SHAPE, "peri") / REFERENCE_STEP_S

    def run_seconds(
        self, cfg: ModelConfig, layout: str, steps: int, optimizer: str = "adamw", ns_steps: int = 5
    ) -> float:
        return RUN_OVERHEAD_S * self.speed + STEP_FACTOR * steps * self.step_seconds(cfg, layout, optimizer, ns_steps)

    def screen_seconds(self, cfg: ModelConfig) -> float:
        """One candidate's screen at `cfg` (its depth and width)."""
        return self.s0 + cfg.n_layers * (self.s_layer + self.s_flop * block_work(cfg))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit(
    t_pre2: float,
    t_pre6: float,
    t_peri6: float,
    t_s1: float,
    t_s3: float,
    t_s1_wide: float,
    seconds: float = 0.0,
    key: str = "",
) -> Calibration:
    """The rates from the six timings (module doc), clamped at zero (the stream rates: `with_stream_rates`)."""
    shape = REFERENCE_SHAPE
    f2, e2 = step_work(shape.with_(n_layers=2), "pre")
    f6, e6 = step_work(shape.with_(n_layers=6), "pre")
    fp, ep = step_work(shape.with_(n_layers=6), "peri")
    import numpy as np

    c0, c_flop, c_norm = (
        max(0.0, float(x))
        for x in np.linalg.solve(
            np.array([[1.0, f2, e2], [1.0, f6, e6], [1.0, fp, ep]]), np.array([t_pre2, t_pre6, t_peri6])
        )
    )
    narrow, wide = _screen_shape(64, 1), _screen_shape(256, 1)
    per_layer = max(0.0, (t_s3 - t_s1) / 2)
    s_flop = max(0.0, (t_s1_wide - t_s1) / (block_work(wide) - block_work(narrow)))
    s_layer = max(0.0, per_layer - s_flop * block_work(narrow))
    s0 = max(0.0, t_s1 - per_layer)
    timings = dict(pre2=t_pre2, pre6=t_pre6, peri6=t_peri6, screen1=t_s1, screen3=t_s3, screen1_w256=t_s1_wide)
    return Calibration(c0, c_flop, c_norm, s0, s_layer, s_flop, seconds, key, timings)


def with_stream_rates(cal: Calibration, t_pre6: float, t_streams: dict[str, float]) -> Calibration:
    """`cal` with each mix's stream rate (module doc) from `t_streams` (its 6-layer step with `CAL_STREAMS`
    streams) and `t_pre6` (Pre-LN's 6-layer step, timed in the same session): the share a step takes beyond
    Pre-LN's, applied to `cal`'s own Pre-LN step, so stream rates measured later on a loaded machine keep the
    scale of the cached ones."""
    shape = REFERENCE_SHAPE.with_(n_layers=6)
    base = cal.step_seconds(shape, "pre")
    rates = dict(cal.c_stream)
    for mix, t in t_streams.items():
        rates[mix] = max(0.0, base * (t / t_pre6 - 1.0) / stream_work(shape, _stream_layout(mix))[1])
    return replace(cal, c_stream=rates)


def _stream_layout(mix: str) -> str:
    """The calibration's layout for a stream mix: Pre-LN with `CAL_STREAMS` streams."""
    return f"pre,streams={CAL_STREAMS},mix={mix}"


def _screen_shape(width: int, n_layers: int) -> ModelConfig:
    """The calibration's screen shape: heads of 16, FFN 4 x width."""
    return REFERENCE_SHAPE.with_(d_model=width, n_heads=width // 16, n_layers=n_layers, max_seq_len=SCREEN_SEQ)


def machine_key(threads: int = 1) -> str:
    """The calibration's cache key: host, CPU model and count, torch's version, worker threads."""
    import torch

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    text = json.dumps(
        [
            platform.node(),
            platform.machine(),
            cpu or platform.processor(),
            os.cpu_count(),
            torch.__version__,
            threads,
            CALIBRATION_VERSION,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file(key: str) -> Path:
    from normlab.data.corpus import cache_dir

    return cache_dir() / "recommend" / f"calibration-{key}.json"


def _fastest(fn, repeats: int) -> float:  # noqa: ANN001 - () -> None
    """The fastest of `repeats` calls in CPU seconds, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def _step_time(layout: str, n_layers: int) -> float:
    """The fastest of 3 AdamW steps of `layout` at the reference shape, `n_layers` deep, fp16 storage emulated."""
    import torch

    from normlab.model import build_model
    from normlab.model.storage import for_run

    tokens = torch.randint(0, 256, (CAL_BATCH, CAL_SEQ + 1), generator=torch.Generator().manual_seed(0))
    model = build_model(layout, "micro", seed=0, **{**REFERENCE_SHAPE.to_dict(), "n_layers": n_layers})
    model.set_storage(for_run("fp32", "fp16"))  # the fp16 runs' emulated storage
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def one() -> None:
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _fastest(one, 3)


@contextlib.contextmanager
def _threads(threads: int):  # noqa: ANN202 - a context manager
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as the trainer runs on a CPU
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def measure(threads: int = 1) -> Calibration:
    """Run the micro benchmark (module doc), at `threads` torch threads."""
    from normlab.config.commands import ScreenConfig
    from normlab.screen.screen import screen_layout

    started = time.perf_counter()
    with _threads(threads):

        def screen_of(width: int, n_layers: int) -> float:
            shape = _screen_shape(width, n_layers).to_dict()
            cfg = ScreenConfig(size="nano", model=shape, stresses=(1.0, 8.0))
            return _fastest(lambda: screen_layout("pre", cfg), 1)

        timings = (
            _step_time("pre", 2),
            _step_time("pre", 6),
            _step_time("peri", 6),
            screen_of(64, 1),
            screen_of(64, 3),
            screen_of(256, 1),
        )
    return fit(*timings, seconds=time.perf_counter() - started, key=machine_key(threads))


def measure_streams(threads: int = 1) -> tuple[float, dict[str, float]]:
    """Pre-LN's 6-layer step and each stream mix's, timed in one session (`with_stream_rates`)."""
    with _threads(threads):
        return _step_time("pre", 6), {mix: _step_time(_stream_layout(mix), 6) for mix in STREAM_MIXES}


def stream_cache_file(key: str) -> Path:
    """The stream rates' cache, beside the calibration's (whose form stays the one older releases read)."""
    return cache_file(key).with_name(f"calibration-{key}-streams.json")


def calibration(threads: int = 1, log=print, streams: bool = True) -> tuple[Calibration, bool]:  # noqa: ANN001
    """This machine's calibration from the cache, else measured now and cached; (it, whether cached). The stream
    rates are cached in a file of their own: a calibration cached before they existed is kept (the same plans)
    and they alone are measured, once, where `streams` (a candidate has several streams; else none are read)."""
    from normlab.io import atomic_write_json

    key = machine_key(threads)
    path, spath = cache_file(key), stream_cache_file(key)
    cached = True
    try:
        cal = Calibration(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        log(f"  calibrating this machine once (a few seconds; cached in {path})")
        cal, cached = measure(threads), False
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {k: v for k, v in cal.to_dict().items() if k != "c_stream"})
    if not streams:
        return cal, cached
    try:
        rates = json.loads(spath.read_text())["c_stream"]
        if set(STREAM_MIXES) <= set(rates) and all(isinstance(rates[m], float) for m in STREAM_MIXES):
            return replace(cal, c_stream={m: rates[m] for m in STREAM_MIXES}), cached
    except (OSError, ValueError, TypeError, KeyError):
        pass
    if cached:
        log(f"  measuring the hyper-connections' step rates once (a few seconds; cached in {spath})")
    t_pre6, t_streams = measure_streams(threads)
    cal = with_stream_rates(cal, t_pre6, t_streams)
    atomic_write_json(spath, {"c_stream": cal.c_stream, "measured": {"pre6": t_pre6, **t_streams}})
    return cal, cached


def makespan(seconds: list[float], workers: int) -> float:
    """A round's wall time: its runs dealt longest first to the worker free soonest (LPT)."""
    free = [0.0] * max(1, min(workers, len(seconds)))
    for s in sorted(seconds, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free) if seconds else 0.0
