"""CPU training throughput of the tiny presets: tokens/s of forward + backward + AdamW, eager and
torch.compile, measured in one process so the ratios compare like with like.

    python benchmarks/train_throughput.py [--layouts pre,peri,hybrid,post] [--steps 20]
        [--device cuda] [--precision bf16]

Each measurement: build the model, warm up (3 steps eager; compile warm-up is excluded from the
timing), then time `steps` optimizer steps on random tokens, median of 3 repeats.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_device import Bench, add_args, setup

import normlab


def step_time(b: Bench, model, opt, x, y, steps: int) -> float:
    return statistics.median(b.timed_step(opt, lambda: model(x, targets=y).loss) for _ in range(steps))


def measure(b: Bench, layout: str, size: str, batch: int, seq: int, steps: int, compiled: bool) -> float:
    model = normlab.build_model(layout, size, seed=0).to(b.device)
    opt = b.adamw(model.parameters())
    fwd = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(b.device)
    y = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(b.device)
    step_time(b, fwd, opt, x, y, 3)  # warm-up (and compilation)
    return batch * seq / step_time(b, fwd, opt, x, y, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="pre,peri,hybrid,post")
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--no-compile", action="store_true")
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    print(b.header("train throughput"))
    print(f"# size={args.size} batch={args.batch} seq={args.seq} steps={args.steps}; tokens/s (median step)")
    print("| layout | eager tok/s | compiled tok/s | compiled / eager | eager vs pre |")
    print("|---|---|---|---|---|")
    base = None
    for layout in args.layouts.split(","):
        eager = measure(b, layout, args.size, args.batch, args.seq, args.steps, False)
        comp = None if args.no_compile else measure(b, layout, args.size, args.batch, args.seq, args.steps, True)
        base = base or eager
        comp_s = f"{comp:,.0f}" if comp else "-"
        ratio = f"{comp / eager:.2f}x" if comp else "-"
        print(f"| {layout} | {eager:,.0f} | {comp_s} | {ratio} | {eager / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
