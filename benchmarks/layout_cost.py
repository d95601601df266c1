"""What the extra norms cost: step time of peri and hybrid against pre at several widths, and the
memory each layout needs for one training step.

    python benchmarks/layout_cost.py [--widths 256,512,1024] [--layers 4] [--seq 128] [--batch 8]
                                     [--heads H] [--vocab V] [--compile] [--device cuda] [--precision bf16]

    # the GPU figures of docs/benchmarks.md (Kim et al.'s 400M shape):
    python benchmarks/layout_cost.py --device cuda --precision bf16 --compile --widths 1024 --layers 24 \
        --heads 8 --seq 2048 --batch 8 --vocab 32768 --turns 10

Step time: forward + backward + AdamW (fused on CUDA), eager and with --compile also torch.compile,
the layouts measured in turns (pre, peri, hybrid, pre, ...) so machine drift lands on all of them;
median over the turns. Memory, measured rather than estimated: the bytes autograd saves for backward
in one forward pass (every tensor passed to `saved_tensors_hooks`, each storage counted once), plus
parameters, gradients and AdamW state; on CUDA also the peak allocated memory of a step.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_device import Bench, add_args, setup

import normlab


def saved_activation_bytes(b: Bench, model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), b.autocast():
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
    p.add_argument("--heads", type=int, default=0, help="attention heads (0: d/64)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--compile", action="store_true", help="also measure torch.compile step times")
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    layouts = args.layouts.split(",")
    modes = ["eager"] + (["compiled"] if args.compile else [])
    print(b.header("layout cost"))
    print(
        f"# layers={args.layers} heads={args.heads or 'd/64'} seq={args.seq} batch={args.batch} vocab={args.vocab} "
        f"AdamW, {args.turns} turns\n"
    )
    peak_col = " | peak GB" if b.cuda else ""
    print(f"| d | layout | mode | step ms | vs pre | activations MB | params+grads+AdamW MB | total vs pre{peak_col} |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if b.cuda else ""))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(b.device)
    for d in (int(w) for w in args.widths.split(",")):
        for mode in modes:
            runs = {}
            for name in layouts:
                model = normlab.build_model(
                    name,
                    "tiny",
                    seed=0,
                    d_model=d,
                    n_layers=args.layers,
                    n_heads=args.heads or max(1, d // 64),
                    max_seq_len=args.seq,
                    vocab_size=args.vocab,
                ).to(b.device)
                act = saved_activation_bytes(b, model, x)
                state = 4 * sum(q.numel() for q in model.parameters()) * 4  # fp32 weights, grads, exp_avg, exp_avg_sq
                opt = b.adamw(model.parameters())
                fwd = torch.compile(model) if mode == "compiled" else model
                if b.cuda:
                    torch.cuda.reset_peak_memory_stats(b.device)
                for _ in range(3):  # warm-up (and compilation)
                    _step(b, fwd, opt, x)
                peak = torch.cuda.max_memory_allocated(b.device) if b.cuda else 0
                runs[name] = (fwd, opt, [], act, state, peak)
            for _ in range(args.turns):
                for fwd, opt, times, *_ in runs.values():
                    times.append(_step(b, fwd, opt, x))
            base_t = statistics.median(runs[layouts[0]][2])
            base_m = runs[layouts[0]][3] + runs[layouts[0]][4]
            for name, (_, _, times, act, state, peak) in runs.items():
                t = statistics.median(times)
                print(
                    f"| {d} | {name} | {mode} | {t * 1e3:.1f} | {t / base_t:.3f} | {act / 2**20:.1f} | "
                    f"{state / 2**20:.1f} | {(act + state) / base_m:.3f}"
                    + (f" | {peak / 1e9:.1f}" if b.cuda else "")
                    + " |",
                    flush=True,
                )
            del runs


def _step(b: Bench, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    return b.timed_step(opt, lambda: model(x, targets=x).loss)


if __name__ == "__main__":
    main()
