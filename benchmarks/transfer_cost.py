"""What a recipe costs in CPU time, measured on its own runs' settings before it starts: how the transfer
study (docs/results.md, "Transfer study") was sized.

    OMP_NUM_THREADS=1 python benchmarks/transfer_cost.py transfer-llama1b-w64 transfer-llama1b-w128 [--layout pre]
    # another design:
    OMP_NUM_THREADS=1 python benchmarks/transfer_cost.py transfer-llama1b-w128 --set model.n_layers=16

For each recipe: its first run with that layout (the grid's first by default) is trained by the trainer
itself (fp16 storage, probes, checkpoints: everything the sweep's worker does) for 3 and then 3 + N
steps (`--steps N`, default 16), one thread, in a temporary folder, after one warm-up run (the first
calls' costs); the process time (CPU seconds, so the other processes on a shared machine do not count,
as wall time would) of the N extra steps gives the seconds per step, the rest the per-run overhead. The
recipe's estimate: runs x (overhead + steps x seconds per step).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from normlab.config.train import typed_settings
from normlab.experiments.recipes import load_recipe
from normlab.train.trainer import train


def cpu_seconds(cfg) -> float:
    t = time.process_time()
    train(cfg, log=lambda *a, **k: None)
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--layout", help="time this layout's first run (default: the grid's first run)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run setting over the recipe's (repeatable): the cost of a design not written as a recipe",
    )
    ap.add_argument("--steps", type=int, default=16, help="the extra steps timed (default 16)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warm = Path(tempfile.mkdtemp(prefix="transfer-cost-"))
    try:  # imports, data loading, first kernel calls: paid once, not per run
        train(
            load_recipe(args.recipes[0]).expand()[0].train_config(warm / "w").with_({"steps": 2, "device": "cpu"}),
            log=lambda *a, **k: None,
        )
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    print(
        "| recipe | layout | d | layers | CPU s/step | overhead s | runs x steps | CPU hours |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for name in args.recipes:
        recipe = load_recipe(name)
        if args.set:
            recipe = recipe.with_(
                base=typed_settings(dict(item.split("=", 1) for item in args.set), "--set", from_text=True)
            )
        specs = recipe.expand()
        spec = next((s for s in specs if args.layout in (None, s.axes.get("layout"))), specs[0])
        out = Path(tempfile.mkdtemp(prefix="transfer-cost-"))
        try:
            short = spec.train_config(out / "a").with_({"steps": 3, "device": "cpu"})
            long = spec.train_config(out / "b").with_({"steps": 3 + args.steps, "device": "cpu"})
            a, b = cpu_seconds(short), cpu_seconds(long)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        per_step = (b - a) / args.steps
        overhead = a - 3 * per_step
        cfg = spec.train_config("unused")
        model = cfg.model.model_config()
        hours = len(specs) * (overhead + cfg.optim.steps * per_step) / 3600
        print(
            f"| {name} | {spec.axes.get('layout')} | {model.d_model} | {model.n_layers} | "
            f"{per_step:.3f} | {overhead:.1f} | "
            f"{len(specs)} x {cfg.optim.steps} | {hours:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
