"""Norm kernels: normlab's norm modules against torch's functional kernels, forward + backward, in GB/s.

    python benchmarks/norm_kernels.py [--rows 4096] [--widths 256,1024,4096]

normlab's norms are `torch.nn.RMSNorm` / `torch.nn.LayerNorm` built by `normlab.model.norms.make_norm`
(we do not hand-write norm kernels: torch's are fused), so the ratio checks that the module path
adds no copies or overhead over `torch.nn.functional.rms_norm` / `layer_norm`. Bytes counted per
forward + backward: read x, write y (forward); read x and dy, write dx (backward): 5 x rows x d x 4
(gamma and its gradient are negligible at these shapes). On a GPU the same numbers can be set
against the memory bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from normlab.model.norms import make_norm


def bench(fn, x: torch.Tensor, dy: torch.Tensor, reps: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(reps):
        x.grad = None
        t0 = time.perf_counter()
        fn(x).backward(dy)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--widths", default="256,1024,4096")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    print(f"# norm kernels, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, rows={args.rows}\n")
    print("| norm | d | normlab GB/s | torch functional GB/s | normlab / torch |")
    print("|---|---|---|---|---|")
    for d in (int(w) for w in args.widths.split(",")):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.rows, d, generator=g).requires_grad_(True)
        dy = torch.randn(args.rows, d, generator=g)
        nbytes = 5 * args.rows * d * 4
        for kind in ("rms", "layer"):
            mod = make_norm(kind, d, 1e-6)
            w = mod.weight.detach().clone().requires_grad_(True)
            if kind == "rms":
                ref = lambda t, w=w: F.rms_norm(t, (d,), w, 1e-6)  # noqa: E731
            else:
                b = mod.bias.detach().clone().requires_grad_(True)
                ref = lambda t, w=w, b=b: F.layer_norm(t, (d,), w, b, 1e-6)  # noqa: E731
            ours, theirs = [], []
            for _ in range(3):  # alternate, so drift lands on both
                ours.append(bench(mod, x, dy, args.reps))
                theirs.append(bench(ref, x, dy, args.reps))
            a, b_ = statistics.median(ours), statistics.median(theirs)
            print(f"| {kind} | {d} | {nbytes / a / 1e9:.2f} | {nbytes / b_ / 1e9:.2f} | {b_ / a:.3f} |")


if __name__ == "__main__":
    main()
