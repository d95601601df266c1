"""Cost of the probes at the default interval, as a fraction of training time.

    python benchmarks/probe_overhead.py [--size tiny] [--every 100] [--steps 200]

Two measurements in one process: (1) the median time of a training step (forward, backward, AdamW)
and of a probe pass (plus the update snapshot), giving probe / (every x step); (2) end to end: the
same `normlab train` run with probes every `every` steps and with probes off, in ABBA order after a
warm-up run.
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
    x = torch.randint(0, 256, (cfg.data.batch_size, cfg.data.seq_len), generator=g)
    probes = Probes(model, (x[: cfg.run.probe_batch], x[: cfg.run.probe_batch]))
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
    print(
        f"# probe overhead, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}"
    )
    print(
        f"# size={args.size} layout={args.layout} batch={cfg.data.batch_size}x{cfg.data.seq_len} "
        f"probe batch={cfg.run.probe_batch}"
    )
    print(
        f"train step {ts * 1e3:.1f} ms, probe pass {tp * 1e3:.1f} ms -> "
        f"{tp / (args.every * ts) * 100:.2f}% at every={args.every}"
    )
    # End to end in ABBA order after a warm-up run, so that process warm-up (allocator, thread pools,
    # corpus cache) and drift do not land on one side.
    walls: dict[int, list[float]] = {args.every: [], 0: []}
    with tempfile.TemporaryDirectory() as tmp:

        def run(every: int, steps: int, tag: str) -> float:
            cfg_run = TrainConfig.of(
                layout=args.layout,
                size=args.size,
                data="stdlib",
                steps=steps,
                probe_every=every,
                eval_every=0,
                progress=False,
                out=f"{tmp}/{tag}",
            )
            t0 = time.perf_counter()
            train(cfg_run)
            return time.perf_counter() - t0

        run(args.every, 10, "warmup")
        for i, every in enumerate((args.every, 0, 0, args.every)):
            walls[every].append(run(every, args.steps, f"{i}-{every}"))
    on, off = statistics.mean(walls[args.every]), statistics.mean(walls[0])
    print(
        f"end to end, {args.steps} steps, ABBA mean of 2: probes every {args.every}: {on:.1f}s, off: {off:.1f}s, "
        f"ratio {on / off:.3f} (runs: on {', '.join(f'{w:.1f}' for w in walls[args.every])}; "
        f"off {', '.join(f'{w:.1f}' for w in walls[0])})"
    )


if __name__ == "__main__":
    main()
