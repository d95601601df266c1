"""Cost of the per-step tier (normlab.diagnostics.tier) as a fraction of a training step.

    python benchmarks/tier_overhead.py [--size small] [--steps 24] [--device cpu]
    python benchmarks/tier_overhead.py --size gpu-126m --seq 1024 --batch 16 --device cuda --bf16   # the GPU figure

One process, one model, AdamW, the trainer's defaults (batch 32 x 128). Steps cycle tier off / tier on /
tier on and timed (after 4 warm-up steps), so that load and drift land on every kind; two figures:

1. A/B: the median step with the tier on over the median with it off (noisier: on a shared machine the
   step's own spread is larger than the tier);
2. direct: the time spent in the tier itself (its hooks during the forward and backward, timed inside the
   hooks, plus before_step, read and after_step), over the median step with the tier off. On CUDA the timed
   hooks synchronize the device around each hook, which stalls the queue, so the timed steps are kept apart
   from the A/B ones (the 2026-11-26 H100 figure, 1.37, was measured with those syncs inside the on steps).

``--profile`` adds torch.profiler's table of one step of each kind (the ops with the most self time on the
device, or on the CPU without one): where a tier's cost is, kernel by kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import time

import torch

import normlab
from normlab.diagnostics import tier as tier_mod
from normlab.diagnostics.tier import StepTier, TierSpikes


class Timed(StepTier):
    """StepTier whose hooks add their own time to ``spent`` (synchronized on CUDA)."""

    spent = 0.0

    def _timed(self, fn, *a):
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn(*a)
        sync()
        Timed.spent += time.perf_counter() - t0

    def _entering(self, *a):
        self._timed(super()._entering, *a)

    def _leaving(self, *a):
        self._timed(super()._leaving, *a)

    def _tap(self, *a):
        self._timed(super()._tap, *a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small")
    p.add_argument("--layout", default="peri")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=24, help="measured steps, a third of each kind (at least 3)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--profile", type=int, default=0, help="print this many rows of a profile of each kind of step")
    args = p.parse_args()
    if args.steps < 3:
        p.error(f"--steps {args.steps}: give at least 3 (one step each: tier off, on, on and timed)")
    dev = torch.device(args.device)
    model = normlab.build_model(args.layout, args.size, seed=0, max_seq_len=max(args.seq, 64)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    x = torch.randint(
        0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    ).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext

    def step(tier: StepTier | None) -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        own = 0.0
        if tier is not None:
            tier.reset()
        opt.zero_grad(set_to_none=True)
        with cast():
            loss = model(x, targets=x).loss
        loss.backward()
        if tier is not None:
            t1 = time.perf_counter()
            tier.before_step()
            spikes.check(tier.read())
            own += time.perf_counter() - t1
        opt.step()
        if tier is not None:
            t1 = time.perf_counter()
            tier.after_step(True)
            sync()
            own += time.perf_counter() - t1
        sync()
        return time.perf_counter() - t0, own

    plain, timed, spikes = StepTier(model), Timed(model), TierSpikes()
    plain.remove()  # hooks on for the tier's steps only
    timed.remove()
    for _ in range(4):
        step(None)
    on, off, own = [], [], []
    for i in range(args.steps):
        kind = i % 3
        if kind == 0:
            off.append(step(None)[0])
        elif kind == 1:
            plain.attach()
            on.append(step(plain)[0])
            plain.remove()
        else:
            timed.attach()
            Timed.spent = 0.0
            mine = step(timed)[1]
            timed.remove()
            own.append(mine + Timed.spent)
    tables = []
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        for name, tier in (("off", None), ("on", plain)):
            if tier is not None:
                tier.attach()
            with profile(activities=acts) as prof:
                step(tier)
            if tier is not None:
                tier.remove()
            tables.append(
                f"## profile, one step, tier {name}\n{prof.key_averages().table(sort_by=sort, row_limit=args.profile)}"
            )
    m_on, m_off, m_own = statistics.median(on), statistics.median(off), statistics.median(own)
    print(
        f"# per-step tier overhead, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
    )
    print(
        f"# size={args.size} layout={args.layout} batch={args.batch}x{args.seq} bf16={args.bf16} "
        f"queries={tier_mod.QUERIES} steps={args.steps} (off / on / timed)"
    )
    print(f"median step, tier off: {m_off * 1e3:.1f} ms; tier on: {m_on * 1e3:.1f} ms")
    print(f"direct: tier's own time {m_own * 1e3:.2f} ms = {m_own / m_off * 100:.2f}% of a step")
    print(f"A/B: on / off = {m_on / m_off:.4f} (step spread off: {min(off) * 1e3:.0f}..{max(off) * 1e3:.0f} ms)")
    print("\n".join(tables))


if __name__ == "__main__":
    main()
