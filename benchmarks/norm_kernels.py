"""Norm kernels: normlab's norm modules against torch's, forward + backward, in GB/s.

    python benchmarks/norm_kernels.py [--rows 4096] [--widths 256,1024,4096] [--device cuda] [--precision bf16]

Paths measured (`normlab.model.norms`):
- normlab (input): the weight cast to the activation dtype, torch's fused kernel in that dtype
  (normlab's default, ``norm_compute="input"``);
- normlab (fp32): upcast, normalize and scale in float32, cast back (``norm_compute="fp32"``, the
  float32-compute-then-cast of Hugging Face's LlamaRMSNorm);
- torch module, fp32 weight: `nn.RMSNorm` / `nn.LayerNorm` as autocast leaves them, float32 weights on
  bf16/fp16 activations (what normlab ran before: RMSNorm falls off the fused kernel with "Mismatch
  dtype between input and weight"; CUDA autocast runs LayerNorm in float32);
- functional: `F.rms_norm` / `F.layer_norm` with the weight already in the activation dtype, the
  fused kernel alone: the reference.
In fp32 the first and last are compared (the module path must add nothing). Bytes counted per
forward + backward: read x, write y; read x and dy, write dx: 5 x rows x d x (bytes per element of the
activation dtype); gamma and its gradient are negligible. On a GPU with a known bandwidth the
table gives the fraction of HBM bandwidth reached.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F
from bench_device import Bench, add_args, setup

from normlab.model.norms import make_norm


def bench(b: Bench, fn, x: torch.Tensor, dy: torch.Tensor, reps: int) -> float:
    times = []
    for _ in range(reps):
        x.grad = None
        t0 = b.clock()
        with b.autocast():
            y = fn(x)
        y.backward(dy)
        times.append(b.clock() - t0)
    return statistics.median(times[2:])


def paths(kind: str, d: int, b: Bench) -> dict:
    """name -> a function of x; every path with the same (float32) gamma and beta."""
    ours = make_norm(kind, d, 1e-6).to(b.device)
    up = make_norm(kind, d, 1e-6, compute="fp32").to(b.device)
    torch_mod = (torch.nn.RMSNorm(d, eps=1e-6) if kind == "rms" else torch.nn.LayerNorm(d, eps=1e-6)).to(b.device)
    w = torch.ones(d, device=b.device, dtype=b.dtype, requires_grad=True)
    bias = torch.zeros(d, device=b.device, dtype=b.dtype, requires_grad=True)
    if kind == "rms":
        ref = lambda t: F.rms_norm(t, (d,), w, 1e-6)
    else:
        ref = lambda t: F.layer_norm(t, (d,), w, bias, 1e-6)
    if b.precision == "fp32":
        return {"normlab": ours, "functional": ref}
    return {"normlab (input)": ours, "normlab (fp32)": up, "torch module, fp32 weight": torch_mod, "functional": ref}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--widths", default="256,1024,4096")
    p.add_argument("--reps", type=int, default=30)
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    warnings.filterwarnings("ignore", message="Mismatch dtype")  # the torch-module path's, shown by the table
    print(f"{b.header('norm kernels')}, rows={args.rows}\n")
    hbm = b.hbm
    print("| norm | d | path | GB/s | " + ("% of HBM | " if hbm else "") + "vs functional |")
    print("|---|---|---|---|" + ("---|" if hbm else "") + "---|")
    for d in (int(w) for w in args.widths.split(",")):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.rows, d, generator=g).to(b.device, b.dtype).requires_grad_(True)
        dy = torch.randn(args.rows, d, generator=g).to(b.device, b.dtype)
        nbytes = 5 * args.rows * d * x.element_size()
        for kind in ("rms", "layer"):
            fns = paths(kind, d, b)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(3):  # alternate, so drift lands on every path
                for name, fn in fns.items():
                    times[name].append(bench(b, fn, x, dy, args.reps))
            ref = statistics.median(times["functional"])
            for name, ts in times.items():
                t = statistics.median(ts)
                frac = f"{nbytes / t / hbm:.0%} | " if hbm else ""
                print(f"| {kind} | {d} | {name} | {nbytes / t / 1e9:.2f} | {frac}{ref / t:.3f} |", flush=True)


if __name__ == "__main__":
    main()
