"""What `normlab recommend`'s stages cost on this machine, from counted work and a calibration measured
per machine and cached (no candidate is timed for the plan): the plan is a function of the inputs and the
cached numbers, so the same command plans the same grid on every call with the same cache, loaded machine
or not (the cache keeps the fastest honest measurement: below).

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

The calibration (`measure`, a few seconds, at most about `CALIBRATION_CAP_S`: past a timing's share of it no
further repeat starts, cached under the normlab cache folder keyed by the machine, its CPU, torch's version and
the thread count a worker uses) times training steps of a fixed
micro model (Pre-LN at 2 and 6 layers, Peri-LN at 6, and Pre-LN at 6 with 4 streams of each mix) and
screens of a fixed shape (1 and 3 layers at width 64, 1 layer at 256), each the fastest of a few repeats
(`STEP_REPEATS`, `SCREEN_REPEATS`), each repeat the lesser of its CPU time (time.process_time: other
processes' load inflates it far less than wall time) and its wall time (which a thread count above one
does not multiply), and fits

    step seconds   = c0 + c_flop (F + M) + c_norm E + c_stream[mix] S
    screen seconds = s0 + L (s_layer + s_flop B)

The stream rates are each mix's 6-layer step beyond Pre-LN's, as a share of Pre-LN's, over its S (n = 4,
the presets' pre-hc and pre-mhc; `with_stream_rates`): on the 2-core VM (2026-11-26, loaded) a 12-layer proxy
step of the Llama 3.2 1B shape took 2.3x Pre-LN's with pre-hc and 3.4x with pre-mhc, where F and E alone
price both at 1.0x. A mix is measured only where the plan trains a candidate of it (`stream_rates`: until then
it is priced at the reference VM's ratio, `REFERENCE_STREAM_RATIOS`), once, within the same cap.
A proxy run's seconds are `RUN_OVERHEAD_S` x this machine's speed (start-up, data, checkpoints) plus
`STEP_FACTOR` x steps x step seconds (probes, evaluation). Coefficients are clamped at zero, so a noisy
repeat can only make the plan smaller.

A load can only make a measurement slower, so the cache keeps the fastest honest one:
- `normlab recommend --recalibrate` (`calibration(..., remeasure=True)`) measures again and keeps, timing by
  timing, the faster of the cached and the new (`faster`); deleting the cache file measures afresh.
- Finished proxy runs refresh it (`refresh_from_runs`): each run's median step (its summary's tokens a
  second) against the step the calibration predicts for it; where the runs' median ratio is below
  `LOWER_BELOW` (the machine ran faster than calibrated: the calibration was measured under a load) the
  training rates (and the step timings behind them) are scaled down by it, and the screen's rates likewise
  by the screens' median ratio (each candidate's screen seconds, as screen.json records them). A ratio
  above 1 (a busy machine) never raises them.
- Two calls on one machine never lose each other's measurement: each write re-reads the file under a lock and
  keeps, timing by timing, the faster (`merged`), written whole (a temporary file renamed over it); the stream
  rates likewise keep each mix's faster ratio.
- A cache file that is no measurement of a machine (a number not finite or negative, a step outside
  `SPEED_RANGE` of the reference VM's: every rate 0, c_flop 1e308; `problem`) is said and measured again.
- A plan refused for its budget says which calibration it used (when measured, how fast against the
  reference VM, lowered by runs or not, its cache file) and how to measure again (`Calibration.describe`).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from normlab.layout import Layout, as_layout
from normlab.layout.sites import STREAM_MIXES
from normlab.model.config import ModelConfig
from normlab.recommend.planning.work import (
    CAL_BATCH,
    CAL_SEQ,
    SCREEN_SEQ,
    block_work,
    optimizer_work,
    step_work,
    stream_work,
)

if TYPE_CHECKING:
    pass

# 2: timings the lesser of CPU and wall time, the fastest of more repeats, the measurement's date: a calibration
# cached by an earlier release (CPU time only) is measured again once (a cached one without stream rates gets
# them added, `calibration`)
CALIBRATION_VERSION = 2
STEP_REPEATS, SCREEN_REPEATS = 5, 2  # timed repeats after one warm-up: the fastest is kept
TIMINGS = ("pre2", "pre6", "peri6", "screen1", "screen3", "screen1_w256")  # `fit`'s six, in its order
STEP_TIMINGS = TIMINGS[:3]
LOWER_BELOW = 0.9  # runs faster than predicted by more than 10% (their median) lower the cached rates
RECALIBRATE = "normlab recommend ... --recalibrate"  # how a user measures again (keeps the faster)
CAL_STREAMS = 4  # the calibration's streams (the pre-hc and pre-mhc presets')
RUN_OVERHEAD_S = 8.0  # a proxy run's start-up, data, evaluation and checkpoints on the reference VM
STEP_FACTOR = 1.0  # the reference VM: a 12-layer Peri-LN proxy of 150 steps took 49 s = 8 + 150 x 0.275
REFERENCE_STEP_S = 0.275  # the reference VM's bare step of the 12-layer Peri-LN proxy of a Llama shape
REFERENCE_SHAPE = ModelConfig(d_model=64, n_layers=12, n_heads=4, max_seq_len=128, vocab_size=256)
# every measurement is bounded: the six timings take at most about this many seconds in all (each its share:
# past it, no further repeat starts, and the fastest so far, the warm-up's at worst, is kept: a load can only
# make a timing slower, so a cut-short calibration prices the plan larger, never smaller), the stream rates the
# same for each mix measured
CALIBRATION_CAP_S = 60.0
# the stream mixes' step against Pre-LN's (6 layers, 4 streams) on the reference VM (module doc): the price of a
# mix not measured on this machine yet (the plan prices with it, and only a mix the plan runs is measured)
REFERENCE_STREAM_RATIOS = {"hc": 2.3, "mhc": 3.4}
# a cache file whose numbers are out of these ranges is not a measurement of a machine: refused, measured again
SPEED_RANGE = (1e-3, 1e3)  # this machine's step against the reference VM's
SCREEN_RANGE_S = (1e-6, 1e3)  # one screen of the calibration's 1-layer shape, in seconds
STREAM_RATIO_MAX = 1e3  # a mix's step against Pre-LN's


@dataclass(frozen=True)
class Calibration:
    """This machine's rates (module doc); `seconds`: what measuring them took; `measured_at`: when (Unix time,
    0: unknown), `measurements`: how many measurements its timings are the fastest of; `runs_factor`, `runs_at`:
    the scale finished runs lowered its training rates by (1: never) and when."""

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
    measured_at: float = 0.0
    measurements: int = 1
    runs_factor: float = 1.0
    runs_at: float = 0.0

    def step_seconds(
        self,
        cfg: ModelConfig,
        layout: str | Layout,
        optimizer: str = "adamw",
        ns_steps: int = 5,
        tokens: int = CAL_BATCH * CAL_SEQ,
        seq: int = CAL_SEQ,
    ) -> float:
        """One training step of `layout` at `cfg` on `tokens` tokens in sequences of `seq` (the proxies' batch)."""
        layout = as_layout(layout)  # parsed once for the three counts
        f, e = step_work(cfg, layout, tokens, seq)
        mix, s = stream_work(cfg, layout, tokens)
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
        self, cfg: ModelConfig, layout: str | Layout, steps: int, optimizer: str = "adamw", ns_steps: int = 5
    ) -> float:
        return RUN_OVERHEAD_S * self.speed + STEP_FACTOR * steps * self.step_seconds(cfg, layout, optimizer, ns_steps)

    def screen_seconds(self, cfg: ModelConfig) -> float:
        """One candidate's screen at `cfg` (its depth and width)."""
        return self.s0 + cfg.n_layers * (self.s_layer + self.s_flop * block_work(cfg))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """Which calibration this is, in words: how fast against the reference VM, when it was measured (the
        fastest of how many measurements), whether finished runs lowered it, and its cache file."""
        when = _when(self.measured_at) if self.measured_at else "at an unknown time"
        text = f"{self.speed:.2f}x the reference VM's step time, measured {when}"
        if self.measurements > 1:
            text += f" (the fastest of {self.measurements} measurements)"
        if self.runs_factor < 1:
            text += (
                f", lowered to {self.runs_factor:.2f}x of that by proxy runs that ran faster ({_when(self.runs_at)})"
            )
        return text + (f"; cached in {cache_file(self.key)}" if self.key else "")

    def remeasure_hint(self) -> str:
        """How to measure this machine again (the refusal's advice)."""
        where = f" or delete {cache_file(self.key)}" if self.key else ""
        return f"if the machine was busy then, measure it again: {RECALIBRATE} (keeps the faster){where}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


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


def _fastest(fn: Callable[[], object], repeats: int, deadline: float = math.inf) -> float:
    """The fastest of `repeats` calls after one warm-up call, each the lesser of its CPU and its wall seconds
    (module doc): a load only ever makes either slower. No repeat starts past `deadline` (time.perf_counter):
    then the fastest so far is kept, the warm-up's (an upper bound: it includes the first call's set-up) where
    no repeat started."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    warm = min(time.perf_counter() - wall, time.process_time() - cpu)
    best = math.inf
    for _ in range(repeats):
        if time.perf_counter() > deadline:
            break
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        best = min(best, time.perf_counter() - wall, time.process_time() - cpu)
    return best if math.isfinite(best) else warm


def _step_time(layout: str, n_layers: int, deadline: float = math.inf) -> float:
    """The fastest of `STEP_REPEATS` AdamW steps of `layout` at the reference shape, `n_layers` deep, fp16 storage
    emulated, no repeat started past `deadline` (`_fastest`)."""
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

    return _fastest(one, STEP_REPEATS, deadline)


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as the trainer runs on a CPU
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _shares(started: float, cap_s: float, n: int) -> list[float]:
    """The deadlines (time.perf_counter) of `n` timings sharing `cap_s` seconds from `started`, in turn."""
    return [started + cap_s * (i + 1) / n for i in range(n)]


def measure(threads: int = 1, cap_s: float = CALIBRATION_CAP_S) -> Calibration:
    """Run the micro benchmark (module doc), at `threads` torch threads, within about `cap_s` seconds (each
    timing its share; `_fastest`)."""
    from normlab.config.commands import ScreenConfig
    from normlab.screen.screen import screen_layout

    started = time.perf_counter()
    by = _shares(started, cap_s, len(TIMINGS))
    with _threads(threads):

        def screen_of(width: int, n_layers: int, deadline: float) -> float:
            shape = _screen_shape(width, n_layers).to_dict()
            cfg = ScreenConfig(size="nano", model=shape, stresses=(1.0, 8.0))
            return _fastest(lambda: screen_layout("pre", cfg), SCREEN_REPEATS, deadline)

        timings = (
            _step_time("pre", 2, by[0]),
            _step_time("pre", 6, by[1]),
            _step_time("peri", 6, by[2]),
            screen_of(64, 1, by[3]),
            screen_of(64, 3, by[4]),
            screen_of(256, 1, by[5]),
        )
    cal = fit(*timings, seconds=time.perf_counter() - started, key=machine_key(threads))
    return replace(cal, measured_at=time.time())


def measure_streams(
    threads: int = 1, mixes: tuple[str, ...] = STREAM_MIXES, cap_s: float = CALIBRATION_CAP_S
) -> tuple[float, dict[str, float]]:
    """Pre-LN's 6-layer step and each of `mixes`' (`with_stream_rates`), timed in one session within about
    `cap_s` seconds (each timing its share)."""
    by = _shares(time.perf_counter(), cap_s, 1 + len(mixes))
    with _threads(threads):
        pre6 = _step_time("pre", 6, by[0])
        return pre6, {mix: _step_time(_stream_layout(mix), 6, by[i + 1]) for i, mix in enumerate(mixes)}


def stream_cache_file(key: str) -> Path:
    """The stream rates' cache, beside the calibration's (whose form stays the one older releases read)."""
    return cache_file(key).with_name(f"calibration-{key}-streams.json")


def problem(cal: Calibration) -> str:
    """Why `cal` is not a measurement of a machine ("" where it is one): a number that is not finite and
    non-negative, a machine faster or slower than `SPEED_RANGE` against the reference VM (every rate 0: every
    budget fits; c_flop 1e308: none does), a screen outside `SCREEN_RANGE_S`, a stream ratio past
    `STREAM_RATIO_MAX`. A single rate clamped at 0 by `fit` is a measurement (a noisy one)."""
    numbers = {k: getattr(cal, k) for k in ("c0", "c_flop", "c_norm", "s0", "s_layer", "s_flop", "seconds")}
    numbers.update(measured_at=cal.measured_at, runs_factor=cal.runs_factor, runs_at=cal.runs_at)
    numbers.update({f"measured.{k}": v for k, v in (cal.measured or {}).items()})
    numbers.update({f"c_stream.{k}": v for k, v in cal.c_stream.items()})
    for name, x in numbers.items():
        if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0):
            return f"{name} is {x!r}, not a finite number >= 0"
    if not isinstance(cal.measurements, int) or isinstance(cal.measurements, bool) or cal.measurements < 1:
        return f"measurements is {cal.measurements!r}, not a count >= 1"
    if not isinstance(cal.key, str):
        return "its key is not a string"
    low, high = SPEED_RANGE
    if not low <= cal.speed <= high:
        return f"its step is {cal.speed:.3g}x the reference VM's (a machine is within {low:g}x ... {high:g}x)"
    screen = cal.screen_seconds(_screen_shape(64, 1))
    if not SCREEN_RANGE_S[0] <= screen <= SCREEN_RANGE_S[1]:
        return f"a 1-layer screen takes {screen:.3g} s (a machine: {SCREEN_RANGE_S[0]:g} ... {SCREEN_RANGE_S[1]:g} s)"
    for mix, ratio in stream_ratios(cal).items():
        if ratio > STREAM_RATIO_MAX:
            return f"the {mix} mix's step is {ratio:.3g}x Pre-LN's (at most {STREAM_RATIO_MAX:g}x)"
    return ""


def _read(path: Path) -> tuple[Calibration | None, str]:
    """The calibration a cache file holds and "", or None and why not (missing: ""; unreadable, or not a
    measurement of a machine: `problem`)."""
    try:
        text = path.read_text()
    except OSError:
        return None, ""
    try:
        cal = Calibration(**json.loads(text))
    except (ValueError, TypeError) as err:
        return None, f"not a calibration ({type(err).__name__})"
    try:
        why = problem(cal)
    except (ValueError, TypeError, ArithmeticError) as err:
        why = f"its numbers do not price a step ({type(err).__name__})"
    return (None, why) if why else (cal, "")


def cached_calibration(path: Path) -> Calibration | None:
    """The calibration a cache file holds, None where it is missing, unreadable or not a measurement of a
    machine (`problem`: then it is measured again)."""
    return _read(path)[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s lock file (beside it) while a read-merge-write runs: two calls on one
    machine never lose each other's measurement."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def store_calibration(path: Path, cal: Calibration) -> Calibration:
    """`cal` written to `path` merged with what the file holds now (`merged`: another call may have written
    it since this one read it), under a lock, atomically (a temporary file renamed over it); returns what
    was written."""
    from normlab.io import atomic_write_json

    with _locked(path):
        disk = cached_calibration(path)
        out = merged(disk, cal) if disk is not None else cal
        atomic_write_json(path, {k: v for k, v in out.to_dict().items() if k != "c_stream"})
    return replace(out, c_stream=cal.c_stream)


def merged(disk: Calibration, mine: Calibration) -> Calibration:
    """Two calibrations of one machine as one (`store_calibration`): timing by timing the faster, refit; where either
    lacks its timings, the one with the faster step. Unlike `faster` (a new measurement beside the cached one),
    merging a calibration with itself or with one it came from changes nothing: the counts are the larger, not
    the sum."""
    a, b = disk.measured or {}, mine.measured or {}
    count = max(disk.measurements, mine.measurements)
    if not all(isinstance(t.get(k), (int, float)) for t in (a, b) for k in TIMINGS):
        kept = mine if mine.speed <= disk.speed else disk
        return replace(kept, measurements=count, key=mine.key or disk.key)
    if all(a[k] == b[k] for k in TIMINGS):
        return replace(mine, measurements=count)
    pre2, pre6, peri6, s1, s3, s1_w256 = (min(a[k], b[k]) for k in TIMINGS)
    out = fit(pre2, pre6, peri6, s1, s3, s1_w256, seconds=mine.seconds, key=mine.key or disk.key)
    lowered_by = disk if all(a[k] <= b[k] for k in STEP_TIMINGS) else mine  # whose step timings are kept
    return replace(
        out,
        measured_at=max(disk.measured_at, mine.measured_at),
        measurements=count,
        runs_factor=lowered_by.runs_factor,
        runs_at=lowered_by.runs_at,
    )


def faster(cached: Calibration, new: Calibration) -> Calibration:
    """A new measurement kept beside the cached one (module doc): each of the six timings the faster of the two,
    refit; where either lacks its timings, the one with the faster step. A load only ever slows a timing, so
    the faster is the more honest."""
    a, b = cached.measured or {}, new.measured or {}
    count = cached.measurements + new.measurements
    if not all(isinstance(t.get(k), (int, float)) for t in (a, b) for k in TIMINGS):
        kept = new if new.speed < cached.speed else cached
        return replace(kept, measurements=count, key=new.key or cached.key)
    pre2, pre6, peri6, s1, s3, s1_w256 = (min(a[k], b[k]) for k in TIMINGS)
    out = fit(pre2, pre6, peri6, s1, s3, s1_w256, seconds=new.seconds, key=new.key or cached.key)
    from_runs = all(a[k] <= b[k] for k in STEP_TIMINGS)  # the cached steps kept: their lowering by runs with them
    return replace(
        out,
        measured_at=new.measured_at,
        measurements=count,
        runs_factor=cached.runs_factor if from_runs else 1.0,
        runs_at=cached.runs_at if from_runs else 0.0,
    )


def calibration(
    threads: int = 1,
    log: Callable[[str], Any] = print,
    streams: bool | tuple[str, ...] = True,
    remeasure: bool = False,
) -> tuple[Calibration, bool]:
    """This machine's calibration from the cache, else measured now (within `CALIBRATION_CAP_S`) and cached;
    (it, whether cached). A cache file that is not a measurement of a machine (`problem`) is said and measured
    again. `remeasure` (--recalibrate): measured now and kept beside the cached one, the faster of the two
    (`faster`). What is written is merged with what another call may have written meanwhile (`store_calibration`).
    `streams`: the stream mixes whose rates are needed (True: all), read from their cache (`stream_rates`) and
    measured where it lacks them (`measure_stream_rates`); False: none read, none measured."""
    key = machine_key(threads)
    path = cache_file(key)
    cal, why = _read(path)
    cached = True
    if cal is not None and cal.key != key:
        cal = replace(cal, key=key)  # the file it was read from: named in a refusal
    if cal is None or remeasure:
        if why:
            log(f"  the cached calibration in {path} is not a measurement of a machine ({why}): measuring again")
        if cal is None:
            log(f"  calibrating this machine once (at most about {CALIBRATION_CAP_S:.0f} s; cached in {path})")
        else:
            log(f"  measuring this machine again (--recalibrate; the cached calibration: {cal.describe()})")
        new = measure(threads)
        cal, cached = (new if cal is None else faster(cal, new)), False
        try:
            cal = store_calibration(path, cal)
        except OSError as err:  # a cache that cannot be written: this call plans with what it measured
            log(f"  calibration not cached: {path} cannot be written ({err.strerror or err})")
    if streams is False:
        return cal, cached
    mixes = STREAM_MIXES if streams is True else tuple(streams)
    cal, missing = stream_rates(cal)
    todo = tuple(m for m in mixes if m in missing)
    if todo:
        cal = measure_stream_rates(cal, threads, todo, log)
    return cal, cached


def stream_ratios(cal: Calibration) -> dict[str, float]:
    """Each mix's 6-layer step with `CAL_STREAMS` streams against Pre-LN's, as `cal` prices them."""
    shape = REFERENCE_SHAPE.with_(n_layers=6)
    base = cal.step_seconds(shape, "pre")
    if base <= 0:
        return {}
    return {mix: 1.0 + rate * stream_work(shape, _stream_layout(mix))[1] / base for mix, rate in cal.c_stream.items()}


def _ratio_ok(x: object) -> TypeGuard[float]:
    return positive_finite(x) and x <= STREAM_RATIO_MAX


def _saved_ratios(spath: Path, cal: Calibration) -> dict[str, float]:
    """The stream ratios the stream cache holds, each mix whose number is valid: `ratio` (this release),
    else `measured` (a mix's 6-layer step and Pre-LN's, timed together), else `c_stream` (rates alone)."""
    try:
        saved = json.loads(spath.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    out: dict[str, float] = {}
    tables: list[dict[str, Any]] = [
        table if isinstance(table := saved.get(k), dict) else {} for k in ("ratio", "measured", "c_stream")
    ]
    ratio, timed, rates = tables
    for mix in STREAM_MIXES:
        if _ratio_ok(ratio.get(mix)):
            out[mix] = float(ratio[mix])
        elif (
            positive_finite(timed.get("pre6"))
            and positive_finite(timed.get(mix))
            and _ratio_ok(timed[mix] / timed["pre6"])
        ):
            out[mix] = timed[mix] / timed["pre6"]
        elif isinstance(rates.get(mix), (int, float)) and not isinstance(rates.get(mix), bool):
            r = stream_ratios(replace(cal, c_stream={mix: float(rates[mix])})).get(mix)
            if r is not None and math.isfinite(r) and rates[mix] >= 0 and _ratio_ok(r):
                out[mix] = r
    return out


def stream_rates(cal: Calibration) -> tuple[Calibration, set[str]]:
    """`cal` with every mix's stream rate: the cached ones (`stream_cache_file`), and for a mix not measured on
    this machine the reference VM's ratio (`REFERENCE_STREAM_RATIOS`); (it, the mixes not measured)."""
    saved = _saved_ratios(stream_cache_file(cal.key or machine_key()), cal)
    ratios = {m: saved.get(m, REFERENCE_STREAM_RATIOS[m]) for m in STREAM_MIXES}
    return with_stream_rates(cal, 1.0, ratios), set(STREAM_MIXES) - set(saved)


def measure_stream_rates(
    cal: Calibration, threads: int, mixes: tuple[str, ...], log: Callable[[str], Any] = print
) -> Calibration:
    """`mixes`' stream rates measured now (within `CALIBRATION_CAP_S`) and cached, merged under a lock with
    what the cache holds (each mix the faster ratio); `cal` with the cached ratios."""
    from normlab.io import atomic_write_json

    spath = stream_cache_file(cal.key or machine_key(threads))
    log(
        f"  measuring the step rates of {', '.join(mixes)} (hyper-connections) once (at most about "
        f"{CALIBRATION_CAP_S:.0f} s; cached in {spath})"
    )
    t_pre6, t_streams = measure_streams(threads, mixes)
    new = {m: t / t_pre6 for m, t in t_streams.items() if positive_finite(t) and positive_finite(t_pre6)}
    new = {m: r for m, r in new.items() if _ratio_ok(r)}
    try:
        with _locked(spath):
            ratios = _saved_ratios(spath, cal)
            for m, r in new.items():
                ratios[m] = min(r, ratios.get(m, math.inf))
            atomic_write_json(spath, {"ratio": ratios})
    except OSError as err:
        log(f"  stream rates not cached: {spath} cannot be written ({err.strerror or err})")
        ratios = {**_saved_ratios(spath, cal), **new}
    full = {m: ratios.get(m, REFERENCE_STREAM_RATIOS[m]) for m in STREAM_MIXES}
    return with_stream_rates(cal, 1.0, full)


def positive_finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def makespan(seconds: list[float], workers: int) -> float:
    """A round's wall time: its runs dealt longest first to the worker free soonest (LPT)."""
    free = [0.0] * max(1, min(workers, len(seconds)))
    for s in sorted(seconds, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free) if seconds else 0.0
