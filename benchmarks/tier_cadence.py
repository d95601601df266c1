"""The per-step tier's cost at each cadence (`--layer-stats-every N`), eager and compiled: a training step with
the tier off against the tier every step, every 10th and every 100th.

    python benchmarks/tier_cadence.py [--sizes micro,small] [--modes eager,compiled] [--repeats 15]
    python benchmarks/tier_cadence.py --device cuda --precision bf16 --sizes gpu-126m,kim-400m --seq 1024 --batch 16

Per size and mode, two copies of one model (the same weights): one with no tier, one with a `StepTier` (compiled:
``compiled=True``, its hooks in the graph) driven by `TierHook` as `normlab train` drives it (reset before the
forward, norms after the backward, the per-layer spike rule, the row after the update). Three kinds of step:

- off: the copy without the tier;
- tier: a tier step (the cadence's step: the hooks record, the host reads the row);
- between: a step off the cadence (eager: the hooks return at once; compiled: the graph is the same at every step,
  so its in-graph reductions run and only the host's work is skipped).

The kinds are interleaved (off, tier, between, rotated each repeat) so load and drift land on all three, and
each is the median of ``--repeats`` steps after warm-up (compilation excluded). A run at cadence N costs one tier
step and N - 1 steps between per N steps, so its overhead is ((t_tier + (N - 1) t_between) / N) / t_off - 1; the
table gives that for N = 1, 10, 100 (N = 1 is the tier step itself). Rows are printed as they finish (a run cut
short keeps what it measured). AdamW, one micro-batch per step, random tokens; ``--profile N`` adds
torch.profiler's top N ops of one step of each kind (where the tier's cost is). ``--forwards N`` times N forwards
of each copy, interleaved, the tiered one as in a step between: compiled, the in-graph part alone (the tier's
reductions are all in the forward, and run at every step), whose difference the whole step's noise (the backward,
the optimizer, the host) would hide; eager, what the hooks cost when they return at once.

On the CPU the table also gives the tier's own time, measured directly (`OwnTime`: a clock around each of its
forward hooks and TierHook's calls; the tier's work is synchronous there; compiled, TierHook's host calls only),
and that time over the step off's at cadence 1 and 10: on a loaded machine the step times vary by several percent
from step to step, more than the tier adds, and the difference of two medians cannot resolve 1%; the direct
measure can.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
from bench_device import Bench, add_args, setup

import normlab
from normlab.diagnostics.tier import StepTier
from normlab.model.lm import LMOutput
from normlab.train.step_hooks import TierHook

KINDS = ("off", "tier", "between")
CADENCES = (1, 10, 100)


def measure(b: Bench, args: argparse.Namespace, size: str, compiled: bool) -> dict[str, list[float]]:
    """Seconds per step of each kind (`KINDS`), ``args.repeats`` each, interleaved."""
    plain = normlab.build_model(args.layout, size, seed=0, max_seq_len=max(args.seq, 64)).to(b.device)
    tiered = copy.deepcopy(plain)
    tier = StepTier(tiered, hooks=False, compiled=compiled)
    hook = TierHook(tier, None, every=2)  # even steps: tier steps; odd: between
    # before attach: the hooks are the timed ones; compiled, only TierHook's host calls (the forward hooks are in the
    # graph, where a clock would break it)
    own = OwnTime(tier, hook, forward=not compiled) if not b.cuda else None
    tier.attach()
    fwd_plain, fwd_tiered = (torch.compile(plain), torch.compile(tiered)) if compiled else (plain, tiered)
    opt_tiered = b.adamw(tiered.parameters())
    runs: dict[str, tuple[Callable[..., LMOutput], torch.optim.Optimizer, TierHook | None]] = {
        "off": (fwd_plain, b.adamw(plain.parameters()), None),
        "tier": (fwd_tiered, opt_tiered, hook),
        "between": (fwd_tiered, opt_tiered, hook),
    }
    x = torch.randint(0, plain.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    x = x.to(b.device)

    owned: dict[str, list[float]] = {"tier": [], "between": []}
    parts: dict[str, list[float]] = {}  # the tier step's own time by function (OwnTime)

    def step(kind: str) -> float:
        fwd, opt, h = runs[kind]
        n = 0 if kind == "tier" else 1
        if own is not None:
            own.parts.clear()
        t0 = b.clock()
        if h is not None:
            h.pre_step(n)
        opt.zero_grad(set_to_none=True)
        with b.autocast():
            loss = fwd(x, targets=x).loss
        loss.backward()
        if h is not None:
            h.post_backward(n)
            h.fired(n)
        opt.step()
        if h is not None:
            h.post_step(n, True)
        elapsed = b.clock() - t0
        if own is not None and kind != "off":
            owned[kind].append(sum(own.parts.values()))
            if kind == "tier":
                for name, sec in own.parts.items():
                    parts.setdefault(name, []).append(sec)
        return elapsed

    for _ in range(args.warmup):  # compilation, the allocator, the tier's buffers
        for kind in KINDS:
            step(kind)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    owned.update({"tier": [], "between": []})  # the warm-up's are dropped
    parts.clear()
    for r in range(args.repeats):
        for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
            times[kind].append(step(kind))
    if own is not None:  # before the profiled steps below, which would add a slowed sample of each kind
        times.update({f"own {k}": list(v) for k, v in owned.items()})
        times.update({f"part {k}": list(v) for k, v in parts.items()})
    # the two copies' forwards alone, interleaved (no backward, no host work); the tiered copy's as in a step between:
    # compiled, the in-graph part; eager, the hooks' early return
    for r in range(args.forwards):
        for kind in ("off", "between") if r % 2 == 0 else ("between", "off"):
            t0 = b.clock()
            with b.autocast():
                runs[kind][0](x, targets=x)
            times.setdefault(f"forward {kind}", []).append(b.clock() - t0)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
        sort = "self_cuda_time_total" if b.cuda else "self_cpu_time_total"
        for kind in KINDS:
            with profile(activities=acts) as prof:
                step(kind)
            print(f"## profile, {size}, {'compiled' if compiled else 'eager'}, one step: {kind}", flush=True)
            print(prof.key_averages().table(sort_by=sort, row_limit=args.profile), flush=True)
    return times


class OwnTime:
    """The seconds a step spends inside the tier itself: its forward hooks (`StepTier._entering`, `_leaving`,
    `_tap`) and `TierHook`'s calls around the step, each wrapped in a clock. On the CPU in eager mode the tier's
    work is synchronous, so this is its whole cost, measured directly rather than as the difference of two noisy
    step times (a loaded machine's steps vary by far more than the tier adds). Compiled (``forward=False``): only
    TierHook's calls, the host's part (the norms, the update's copy and difference, the read-back); the forward
    hooks' reductions are inside the graph, seen only as the step between against the step off. Not for CUDA
    (asynchronous)."""

    def __init__(self, tier: StepTier, hook: TierHook, forward: bool = True) -> None:
        self.parts: dict[str, float] = {}  # the seconds inside each timed function this step
        for owner, names in (
            (tier, ("_entering", "_leaving", "_tap") if forward else ()),
            (hook, ("pre_step", "post_backward", "fired", "post_step")),
        ):
            for name in names:
                setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

        return timed


def median_error(xs: list[float]) -> float:
    """The standard error of a median of ``xs``, from its spread: 1.2533 sigma / sqrt(n), sigma estimated as
    IQR / 1.349 (robust to the slow outliers a loaded machine adds)."""
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / math.sqrt(len(xs))


def overhead(med: dict[str, float], every: int) -> float:
    """The fraction a run at cadence ``every`` adds to a step (module docstring)."""
    return (med["tier"] + (every - 1) * med["between"]) / every / med["off"] - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--sizes", default="micro,small")
    p.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    p.add_argument("--layout", default="peri")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15, help="timed steps of each kind (at least 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each kind first")
    p.add_argument("--profile", type=int, default=0, help="print this many ops of a profile of each kind of step")
    p.add_argument(
        "--forwards",
        type=int,
        default=0,
        help="also time this many forwards of each copy, interleaved, the tiered one as in a step between (compiled: "
        "the in-graph part; eager: the hooks' early return), without the backward's and the optimizer's noise",
    )
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if args.repeats < 3 or args.forwards == 1 or args.forwards < 0 or not modes:
        p.error("--repeats: at least 3; --forwards: 0 or at least 2; --modes: a comma list of eager, compiled")
    if any(m not in ("eager", "compiled") for m in modes):
        p.error("--modes: a comma list of eager, compiled")
    b = setup(args)
    print(b.header("per-step tier by cadence"))
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(
        f"# layout {args.layout}, batch {args.batch} x {args.seq}, AdamW, {args.repeats} steps of each kind "
        f"interleaved after {args.warmup} warm-up{load}"
    )
    cols = " | ".join(f"cadence {n}" for n in CADENCES)
    own_cols = " | ".join(f"own, cadence {n}" for n in CADENCES[:2])
    print(
        f"\n| size | mode | step off (ms) | tier step (ms) | step between (ms) | {cols} | spread off (ms) | "
        f"tier's own time (ms) | {own_cols} |"
    )
    print("|---|---|---|---|---|" + "---|" * len(CADENCES) + "---|---|" + "---|" * 2, flush=True)
    for size in args.sizes.split(","):
        for mode in modes:
            times = measure(b, args, size, mode == "compiled")
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios = " | ".join(f"{overhead(med, n) * 100:+.2f}%" for n in CADENCES)
            spread = f"{min(times['off']) * 1e3:.1f}..{max(times['off']) * 1e3:.1f}"
            if "own tier" in med:  # the tier's own seconds over the step off's: the direct estimate (OwnTime)
                own = [(med["own tier"] + (n - 1) * med["own between"]) / n / med["off"] for n in CADENCES[:2]]
                direct = f"{med['own tier'] * 1e3:.2f} | " + " | ".join(f"+{x * 100:.2f}%" for x in own)
            else:
                direct = "- | - | -"
            print(
                f"| {size} | {mode} | {med['off'] * 1e3:.2f} | {med['tier'] * 1e3:.2f} | {med['between'] * 1e3:.2f} "
                f"| {ratios} | {spread} | {direct} |",
                flush=True,
            )
            by_part = {k[5:]: v for k, v in med.items() if k.startswith("part ")}
            if by_part:
                print(
                    f"# {size}, {mode}: the tier step's own time by part (medians, ms): "
                    + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in by_part.items()),
                    flush=True,
                )
            if "forward off" in med:
                extra = (med["forward between"] - med["forward off"]) / med["off"]
                se = math.hypot(*(median_error(times[f"forward {k}"]) for k in ("off", "between"))) / med["off"]
                what = "in-graph part" if mode == "compiled" else "hooks returning at once"
                print(
                    f"# {size}, {mode}: {what} {extra * 100:+.2f}% +- {2 * se * 100:.2f}% (two standard "
                    f"errors) of the step off (median forward "
                    f"{med['forward off'] * 1e3:.2f} ms without the tier, {med['forward between'] * 1e3:.2f} with it, "
                    f"{len(times['forward off'])} each)",
                    flush=True,
                )
    if load:
        print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
