"""The norm tax table: what each placement's norms cost per step against Pre-LN (or another baseline) at a
model's width, timed as `normlab recommend` times it (normlab.recommend.evidence.tax: forward + backward of two blocks
of the shape, the pair in turns, the median ratio and Student's t interval over the turns), eager and under
torch.compile, on the device present (CUDA in bf16 up to 4,096 tokens a step, else the CPU at 128).

    python benchmarks/norm_tax.py [--sizes gpu-126m,kim-400m] [--pairs pre:peri,pre:peri-noemb,qwen3:olmo2]
                                  [--modes eager,compiled] [--turns 9] [--seq 1024]

No cache is read or written (each figure is measured again). Fused kernels (liger-kernel's RMSNorm and fused
add + RMSNorm) are not timed: normlab's norms are its own modules, and swapping in a library's kernel is not
built; torch.compile's fusion of the norms with their neighbours is the compiled column.
"""

from __future__ import annotations

import argparse

from bench_device import add_args, setup

from normlab.model.config import get_size
from normlab.recommend.evidence import tax


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="gpu-126m,kim-400m")
    p.add_argument("--pairs", default="pre:peri,pre:peri-noemb,pre:hybrid,qwen3:olmo2")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--turns", type=int, default=9)
    p.add_argument("--seq", type=int, default=1024, help="the shape's sequence length (the CPU times 128 tokens)")
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    print(b.header("norm tax (normlab.recommend.evidence.tax; CUDA times bf16 weights whatever --precision)"))
    print("| size | baseline -> candidate | mode | tax | interval | base ms | cand ms | turns | device |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        cfg = get_size(size).with_(max_seq_len=args.seq)
        for pair in args.pairs.split(","):
            base, cand = pair.split(":")
            for mode in args.modes.split(","):
                t = tax.measure(
                    cfg, base, cand, tax.TaxTiming(mode=mode, turns=args.turns, device=b.device.type, use_cache=False)
                )
                iv = f"[{100 * t.interval[0]:+.1f}%, {100 * t.interval[1]:+.1f}%]" if t.interval else "-"
                print(
                    f"| {size} | {base} -> {cand} | {mode} | {100 * t.value:+.1f}% | {iv} | {t.base_ms:.1f} | "
                    f"{t.cand_ms:.1f} | {t.turns} | {t.device} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
