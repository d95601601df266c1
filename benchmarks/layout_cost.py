"""What the extra norms cost: step time of peri and hybrid against pre at several widths, and the
memory each layout needs for one training step.

    python benchmarks/layout_cost.py [--widths 256,512,1024] [--layers 4] [--seq 128] [--batch 8]

Step time: forward + backward + AdamW, eager, the layouts measured in turns (pre, peri, hybrid, pre,
...) so machine drift lands on all of them; median over the turns. Memory, measured rather than
estimated: the bytes autograd saves for backward in one forward pass (every tensor passed to
`saved_tensors_hooks`, each storage counted once), plus parameters, gradients and AdamW state.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

import normlab


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, targets=x).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="256,512,1024")
    p.add_argument("--layouts", default="pre,peri,hybrid")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--turns", type=int, default=15)
    args = p.parse_args()
    layouts = args.layouts.split(",")
    print(f"# layout cost, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# layers={args.layers} heads=d/64 seq={args.seq} batch={args.batch} fp32 AdamW eager, {args.turns} turns\n")
    print("| d | layout | step ms | vs pre | activations MB | params+grads+AdamW MB | total vs pre |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    for d in (int(w) for w in args.widths.split(",")):
        runs = {}
        for name in layouts:
            model = normlab.build_model(name, "tiny", seed=0, d_model=d, n_layers=args.layers, n_heads=max(1, d // 64),
                                        max_seq_len=args.seq)
            act = saved_activation_bytes(model, x)
            state = 4 * sum(q.numel() for q in model.parameters()) * 4  # fp32 weights, grads, exp_avg, exp_avg_sq
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            runs[name] = (model, opt, [], act, state)
            for _ in range(2):
                _step(model, opt, x)
        for _ in range(args.turns):
            for model, opt, times, _, _ in runs.values():
                times.append(_step(model, opt, x))
        base_t = statistics.median(runs[layouts[0]][2])
        base_m = runs[layouts[0]][3] + runs[layouts[0]][4]
        for name, (_, _, times, act, state) in runs.items():
            t = statistics.median(times)
            print(f"| {d} | {name} | {t * 1e3:.1f} | {t / base_t:.3f} | {act / 2**20:.1f} | {state / 2**20:.1f} | "
                  f"{(act + state) / base_m:.3f} |")


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x, targets=x).loss.backward()
    opt.step()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
