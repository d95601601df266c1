"""Cost of the probes at the default interval, as a fraction of training time.

    python benchmarks/probe_overhead.py [--size tiny] [--every 100] [--steps 200]

Two measurements in one process: (1) the median time of a training step (forward, backward, AdamW)
and of a probe pass (plus the update snapshot), giving probe / (every x step); (2) end to end: the
same `normlab train` run with probes every `every` steps and with probes off.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time

import torch

import normlab
from normlab.diagnostics import Probes
from normlab.train import TrainConfig, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--layout", default="peri")
    p.add_argument("--every", type=int, default=TrainConfig().probe_every)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    cfg = TrainConfig()
    model = normlab.build_model(args.layout, args.size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=g)
    probes = Probes(model, (x[: cfg.probe_batch], x[: cfg.probe_batch]))
    step_t, probe_t = [], []
    for i in range(13):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x, targets=x).loss.backward()
        opt.step()
        step_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        probes.record(i)
        probes.snapshot()
        probes.updates(i)
        probe_t.append(time.perf_counter() - t0)
    ts, tp = statistics.median(step_t[3:]), statistics.median(probe_t[3:])
    print(f"# probe overhead, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"# size={args.size} layout={args.layout} batch={cfg.batch_size}x{cfg.seq_len} probe batch={cfg.probe_batch}")
    print(f"train step {ts * 1e3:.1f} ms, probe pass {tp * 1e3:.1f} ms -> {tp / (args.every * ts) * 100:.2f}% at every={args.every}")
    walls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for every in (args.every, 0):
            run = TrainConfig(layout=args.layout, size=args.size, data="stdlib", steps=args.steps, probe_every=every,
                              eval_every=0, progress=False, out=f"{tmp}/{every}")
            t0 = time.perf_counter()
            train(run)
            walls[every] = time.perf_counter() - t0
    print(f"end to end, {args.steps} steps: probes every {args.every}: {walls[args.every]:.1f}s, off: {walls[0]:.1f}s, "
          f"ratio {walls[args.every] / walls[0]:.3f}")


if __name__ == "__main__":
    main()
