"""Greedy generation through transformers' `generate()`: with the KV cache against re-running the prefix.

    python benchmarks/generation.py [--size tiny] [--layout peri] [--prompt 64] [--new 192] [--batch 1] [--device cuda]

The model is `NormLabForCausalLM` (what an export loads); both paths produce the same tokens (checked
here, and in tests/integration/test_generation.py). Without the cache each new token runs the whole prefix again
(quadratic in the length); with it, one token per step attends over the cached keys.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_device import add_args, setup

import normlab
from normlab.hf import to_hf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--layout", default="peri")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--turns", type=int, default=3)
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    model = normlab.build_model(args.layout, args.size, seed=0, max_seq_len=args.prompt + args.new).eval()
    hf = to_hf(model).to(b.device)
    x = torch.randint(1, 256, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)).to(b.device)
    print(b.header("generation"))
    print(
        f"# {args.layout} {args.size}, batch={args.batch}, prompt={args.prompt}, new={args.new}, greedy, "
        f"{args.turns} turns\n"
    )

    def gen(cache: bool) -> tuple[float, torch.Tensor]:
        t0 = b.clock()
        with torch.no_grad(), b.autocast():
            out = hf.generate(
                x,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                use_cache=cache,
                pad_token_id=0,
                eos_token_id=None,
            )
        return b.clock() - t0, out

    results = {}
    for cache in (True, False):
        gen(cache)  # warm-up
        runs = [gen(cache) for _ in range(args.turns)]
        results[cache] = (statistics.median(t for t, _ in runs), runs[0][1])
    same = torch.equal(results[True][1], results[False][1])
    print("| path | new tokens/s | time | vs cache |")
    print("|---|---|---|---|")
    for cache, label in ((True, "KV cache"), (False, "re-run prefix")):
        t = results[cache][0]
        print(f"| {label} | {args.batch * args.new / t:,.0f} | {t:.2f} s | {t / results[True][0]:.2f}x |")
    print(f"\nsame tokens: {same}")


if __name__ == "__main__":
    main()
