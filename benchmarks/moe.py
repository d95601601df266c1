"""MoE training speed against the dense model with the same active parameters.

    python benchmarks/moe.py [--dense micro] [--moe moe-micro] [--batch 16] [--seq 128]
        [--device cuda] [--precision bf16]

moe-micro (8 experts of width 128, 2 per token) uses per token exactly the feed-forward weights of
micro (one SwiGLU of width 256): same active parameters, same FLOPs per token (`normlab.train.mfu`).
Forward + backward (+ the routers' auxiliary losses) + AdamW, layout pre, the models measured in turns;
median step time. The ratio is the routing overhead: the router, the top-k, sorting tokens by expert and
running the experts on their segments, and (looped dispatch) one masked gather per expert.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_device import Bench, add_args, setup

import normlab
from normlab.model import count_params


def step(b: Bench, model, opt, x) -> float:
    def loss():
        out = model(x, targets=x)
        return out.loss if out.aux_loss is None else out.loss + out.aux_loss

    return b.timed_step(opt, loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", default="micro")
    p.add_argument("--moe", default="moe-micro")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--turns", type=int, default=15)
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    variants = {
        "dense": (args.dense, {}),
        "moe (sorted)": (args.moe, {"moe_dispatch": "sorted"}),
        "moe (loop)": (args.moe, {"moe_dispatch": "loop"}),
    }
    x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(b.device)
    print(b.header("moe"))
    print(f"# batch={args.batch} seq={args.seq} layout pre, AdamW, {args.turns} turns\n")
    runs = {}
    for name, (size, opts) in variants.items():
        model = normlab.build_model("pre", size, seed=0, **opts).to(b.device)
        opt = b.adamw(model.parameters())
        for _ in range(3):
            step(b, model, opt, x)
        runs[name] = (model, opt, [])
    for _ in range(args.turns):
        for model, opt, times in runs.values():
            times.append(step(b, model, opt, x))
    base = statistics.median(runs["dense"][2])
    print("| model | size | params (total / active) | tok/s | step vs dense |")
    print("|---|---|---|---|---|")
    for name, (model, _, times) in runs.items():
        c, t = count_params(model), statistics.median(times)
        active = c.active if c.active is not None else c.total
        print(
            f"| {name} | {variants[name][0]} | {c.total / 1e6:.2f}M / {active / 1e6:.2f}M | "
            f"{args.batch * args.seq / t:,.0f} | {t / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
