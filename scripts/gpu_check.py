"""`make gpu-check`: every GPU check the project has, in one command, within a time budget on one GPU.

    python scripts/gpu_check.py             # on a CUDA machine: runs everything, rewrites the docs' sections
    python scripts/gpu_check.py --dry-run   # anywhere: the same plan at nano shapes on the CPU, docs to a temp folder

The plan (`plan()`), in order of priority, each item one subprocess with its own time limit:

1. ``pytest tests/gpu`` (the CUDA behaviour tests);
2. a short `gpu-126m` run per key layout (pre, peri, post, hybrid) in bf16 and in fp16 (`normlab train`,
   eager: the per-step tier's hooks on; the stdlib corpus: the device reaches no network), each run's status,
   final loss, tok/s, MFU, largest activation read from its summary.json;
3. the GPU benchmarks with MFU: `benchmarks/peers.py` (normlab against transformers' Llama, tokens/s and
   MFU, compiled);
4. FSDP2 on one GPU: ``torchrun --nproc_per_node 1 -m normlab train --fsdp`` with probes on;
5. the pre bf16 run again with the per-step tier every 10 steps and off (its cost end to end), and with the
   default checkpoint interval (stretched by a save's cost);
6. `benchmarks/tier_cadence.py`: the per-step tier's cost at cadence 1, 10 and 100, eager and compiled, at
   gpu-126m and kim-400m (bf16, 16 x 1,024; one item per mode; with 40 forwards of each copy alone: compiled, the
   in-graph part);
7. `benchmarks/train_throughput.py` (eager and compiled, pre and peri).

The whole check has a budget (``--budget-s``, default 540 s): a device lease is 15 minutes of GPU time with
the machine's start counted and at most 10 minutes a command, so the check is one command of a lease (give a
smaller budget to share the lease with the transfer study's GPU rungs, as the 2026-11-26 lease did with 320
s). Measured on that H200: tests/gpu 116 s; a gpu-126m run's 100 steps took 6.8 s of its 47.7 s, most of the
rest in ten 1.5 GB checkpoints (its runs here now save one). On the 2026-11-26 H100 lease (453 s in all):
tests/gpu 72 s, each layout run 19-24 s, FSDP2 30 s, throughput 69 s, tier overhead 14 s; peers ran past its
90 s (it now has 150 s and 8 turns). Each item runs within the smaller of its own
limit and the time left; an item that would start with under 15 s left is not run and is written as "not
run: the budget was spent", so the order above is the trade-off: the behaviour tests and the layouts'
bf16/fp16 runs first, the throughput figures last. The tier's cadence items (6) need up to 360 s, mostly
compilation, so a lease spent on them alone runs ``--only "per-step tier"`` (``make gpu-check
GPU_CHECK_ARGS='--only "per-step tier"'``).

The figures go into docs/benchmarks.md and docs/results.md between ``<!-- gpu-check:begin -->`` and
``<!-- gpu-check:end -->`` (the section is replaced, or appended when the page has none), headed by the
device's name, the date and the commit. A failed item is written as failed (its last output lines), and the
command exits 1 after writing. ``--dry-run`` swaps the sizes for nano, a few steps, the CPU and fp32 (the
fp16 runs then store activations in fp16, emulated), collects tests/gpu without running them, and writes to
``--docs-dir`` (a temporary folder by default): it checks the plumbing, not the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
LAYOUTS = ("pre", "peri", "post", "hybrid")
PRECISIONS = ("bf16", "fp16")
BUDGET_S = 540  # seconds; see the module docstring
MIN_ITEM_S = 15  # an item is not started with less left


@dataclass
class Item:
    name: str
    cmd: list[str]
    limit_s: int
    doc: str  # "benchmarks" or "results"
    run: str | None = None  # a training run's folder (its summary.json is read)
    result: dict = field(default_factory=dict)


def plan(dry: bool, out: Path) -> list[Item]:
    """The checks in order (see the module docstring); ``dry``: nano shapes on the CPU."""
    py = sys.executable
    dev = ["--device", "cpu"] if dry else ["--device", "cuda"]
    items = [
        Item(
            "pytest tests/gpu",
            [py, "-m", "pytest", "-q", "tests/gpu"] + (["--collect-only"] if dry else []),
            150,
            "benchmarks",
        )
    ]
    if dry:
        bench = [
            (
                "peers (MFU)",
                [
                    "benchmarks/peers.py",
                    "--width",
                    "32",
                    "--layers",
                    "2",
                    "--heads",
                    "2",
                    "--seq",
                    "32",
                    "--batch",
                    "2",
                    "--turns",
                    "2",
                    "--no-compile",
                ],
            ),
            (
                "train throughput",
                [
                    "benchmarks/train_throughput.py",
                    "--size",
                    "nano",
                    "--layouts",
                    "pre",
                    "--steps",
                    "2",
                    "--no-compile",
                    "--batch",
                    "4",
                    "--seq",
                    "32",
                ],
            ),
        ]
    else:
        bench = [
            (
                "peers (MFU)",
                [
                    "benchmarks/peers.py",
                    "--precision",
                    "bf16",
                    "--width",
                    "1024",
                    "--layers",
                    "24",
                    "--heads",
                    "8",
                    "--seq",
                    "2048",
                    "--batch",
                    "8",
                    "--vocab",
                    "32768",
                    "--turns",
                    "8",  # with its two compiles it took 100 s on an H100 (12 turns ran past 90 s)
                ],
            ),
            (
                "train throughput",
                [
                    "benchmarks/train_throughput.py",
                    "--precision",
                    "bf16",
                    "--size",
                    "gpu-126m",
                    "--seq",
                    "1024",
                    "--batch",
                    "16",
                    "--layouts",
                    "pre,peri",
                ],
            ),
        ]
    size, steps, seq, batch = ("nano", 3, 32, 4) if dry else ("gpu-126m", 100, 1024, 16)

    def train(layout: str, precision: list[str], run: Path, *extra: str, ckpt: bool = True) -> list[str]:
        """`normlab train`'s arguments shared by the layout runs and the FSDP2 run; ``ckpt=False`` keeps the
        default checkpoint interval (stretched by the cost of a save, train/ckpt_schedule.py)."""
        return [
            "normlab",
            "train",
            *extra,
            "--layout",
            layout,
            "--size",
            size,
            "--data",
            "stdlib",
            "--steps",
            str(steps),
            "--seq-len",
            str(seq),
            "--batch-size",
            str(batch),
            "--probe-every",
            "50",
            "--eval-every",
            "0",
            *(["--ckpt-every", str(steps)] if ckpt else []),  # one save, at the end: each is 1.5 GB
            "--no-progress",
            "--no-compile",
            *precision,
            *dev,
            "--out",
            str(run),
        ]

    for layout in LAYOUTS:
        for precision in PRECISIONS:
            run = out / f"{layout}-{precision}"
            prec = ["--precision", "fp32", "--activation-dtype", precision] if dry else ["--precision", precision]
            cmd = [py, "-m", *train(layout, prec, run, "--lr", "3e-3")]
            items.append(Item(f"{size} {layout} {precision}", cmd, 90, "results", run=str(run)))
    peers, *later = [
        Item(name, [py, *args, *dev], limit, "benchmarks") for (name, args), limit in zip(bench, (150, 75))
    ]
    # The per-step tier's cost at cadence 1, 10 and 100, eager and compiled (benchmarks/tier_cadence.py; compiled:
    # the tier's reductions inside the graph), one item per mode so a compile that runs long keeps the eager rows.
    cadence = ["benchmarks/tier_cadence.py", *dev]
    if dry:
        cadence += ["--sizes", "nano", "--batch", "4", "--seq", "32", "--repeats", "3", "--warmup", "1"]
        cadence += ["--forwards", "2"]
    else:
        cadence += ["--precision", "bf16", "--sizes", "gpu-126m,kim-400m", "--seq", "1024", "--batch", "16"]
        cadence += ["--repeats", "20", "--forwards", "40"]  # forwards: compiled, the in-graph part alone
    by_cadence = [
        Item(f"per-step tier by cadence, {mode}", [py, *cadence, "--modes", mode], limit, "benchmarks")
        for mode, limit in (("eager", 120), ("compiled", 240))
    ]
    # The norm tax at gpu-126m and kim-400m (benchmarks/norm_tax.py: what recommend times, eager and compiled)
    tax = ["benchmarks/norm_tax.py", *dev]
    if dry:
        tax += ["--sizes", "nano", "--pairs", "pre:peri", "--turns", "2", "--modes", "eager"]
    else:
        tax += ["--sizes", "gpu-126m,kim-400m", "--pairs", "pre:peri,pre:peri-noemb,qwen3:olmo2", "--seq", "2048"]
    tax_item = Item("norm tax, eager and compiled", [py, *tax], 200, "benchmarks")
    run = out / "fsdp-1gpu"
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m"]
    fsdp = train("peri", ["--precision", "fp32"] if dry else ["--precision", "bf16"], run, "--fsdp")
    fsdp_item = Item("FSDP2 on one device, probes on", [*torchrun, *fsdp], 60, "results", run=str(run))
    # The pre bf16 run again: the per-step tier's cost end to end against the layout run above (tier every step,
    # one save; the H100 lease: 262,026 tok/s with it every step, 325,627 without), then the default checkpoint
    # interval, stretched by the cost of a save (train/ckpt_schedule.py; its note is in the item's log).
    prec = ["--precision", "fp32"] if dry else ["--precision", "bf16"]
    name = f"{size} pre {'fp32' if dry else 'bf16'}"
    variants = (
        ("tier every 10 steps", "tier-10", ["--layer-stats-every", "10"], True),
        ("tier off", "tier-off", ["--no-layer-stats"], True),
        ("default checkpoint interval", "default-ckpt", [], False),
    )
    tiers = [
        Item(
            f"{name}, {label}",
            [py, "-m", *train("pre", prec, out / f"pre-{tag}", "--lr", "3e-3", *args, ckpt=once)],
            90,
            "results",
            run=str(out / f"pre-{tag}"),
        )
        for label, tag, args, once in variants
    ]
    return [*items, peers, fsdp_item, *tiers, *by_cadence, tax_item, *later]


def execute(item: Item, limit_s: float, logs: Path) -> None:
    """Run one item within ``limit_s`` seconds (its own limit, or less when the budget has less left); its whole
    output goes to ``logs/<name>.log`` (the pages keep the last lines)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + str(REPO / "benchmarks")}
    t0 = time.perf_counter()
    try:
        res = subprocess.run(item.cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=limit_s)
        code, text = res.returncode, (res.stdout + res.stderr)
    except subprocess.TimeoutExpired as err:

        def decoded(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")

        code, text = 124, f"{decoded(err.stdout)}{decoded(err.stderr)}\ntimed out after {limit_s:.0f} s"
    logs.mkdir(exist_ok=True)
    (logs / (re.sub(r"[^A-Za-z0-9-]+", "_", item.name).strip("_") + ".log")).write_text(text)
    item.result = {
        "ok": code == 0,
        "code": code,
        "seconds": round(time.perf_counter() - t0, 1),
        "tail": "\n".join(text.strip().splitlines()[-12:]),
    }
    if item.run and code == 0:
        summary = json.loads((Path(item.run) / "summary.json").read_text())
        item.result["summary"] = {
            k: summary.get(k)
            for k in (
                "status",
                "final_loss",
                "tok_per_s",
                "mfu",
                "max_activation",
                "overflow_steps",
                "spike_skipped_steps",
            )
        }


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return str(len(v))
    return "-" if v is None else str(v)


def sections(items: list[Item], device: str, commit: str, dry: bool) -> dict[str, str]:
    """The two pages' sections (markdown between the markers)."""
    head = (
        f"## GPU check ({device}; {datetime.date.today()}; commit {commit})\n\n"
        "Written by `make gpu-check` (`scripts/gpu_check.py`"
        f"{' --dry-run: CPU plumbing only, no GPU figures' if dry else ''}); "
        f"each item's command, its time and its last lines of output.\n"
    )
    pages = {"benchmarks": [head], "results": [head]}
    pages["results"].append(
        "\n| run | status | final loss | tok/s | MFU | largest activation | overflow steps | "
        "spike-skipped |\n|---|---|---|---|---|---|---|---|"
    )
    for it in items:
        if it.run and it.result.get("summary"):
            s = it.result["summary"]
            pages["results"].append(
                f"| {it.name} | {s['status']} | {_fmt(s['final_loss'])} | {_fmt(s['tok_per_s'])} | "
                f"{_fmt(s['mfu'])} | {_fmt(s['max_activation'])} | {_fmt(s['overflow_steps'])} | "
                f"{_fmt(s['spike_skipped_steps'])} |"
            )
    for it in items:
        if it.run and it.result.get("summary"):
            continue
        if it.result.get("skipped"):
            pages[it.doc].append(f"\n### {it.name}: not run (the check's time budget was spent)")
            continue
        status = "ok" if it.result.get("ok") else f"FAILED (exit {it.result.get('code')})"
        pages[it.doc].append(
            f"\n### {it.name}: {status}, {it.result.get('seconds')} s\n\n"
            f"`{' '.join(Path(c).name if c == sys.executable else c for c in it.cmd)}`\n\n"
            f"```\n{it.result.get('tail', '')}\n```"
        )
    return {k: "\n".join(v) + "\n" for k, v in pages.items()}


def replace_section(page: Path, body: str) -> None:
    """Put ``body`` between the markers of ``page`` (appended with them when the page has none)."""
    text = page.read_text() if page.exists() else ""
    block = f"{BEGIN}\n{body}{END}\n"
    if BEGIN in text and END in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        text = text[:start] + block.rstrip("\n") + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    page.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="nano shapes on the CPU; docs to --docs-dir")
    p.add_argument(
        "--docs-dir", help="where the pages are rewritten (default: docs/, or a temporary copy with --dry-run)"
    )
    p.add_argument(
        "--out", help="the folder the runs and each item's full output (logs/) go in (made; default: a temp folder)"
    )
    p.add_argument("--only", default="", help="comma list of item-name prefixes to run (default: all)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds for the whole check; items past it are not run (default {BUDGET_S}; a dry run gets 5x)",
    )
    args = p.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device here; run it where a GPU is lent, or use --dry-run for the CPU plumbing",
            file=sys.stderr,
        )
        return 2
    device = "CPU dry run" if args.dry_run else torch.cuda.get_device_name(0)
    if args.out:
        out = Path(args.out)
        if out.exists():
            print(f"gpu-check: --out {out} exists; name a new folder (it is made)", file=sys.stderr)
            return 2
        out.mkdir(parents=True)
    else:
        out = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    docs = Path(args.docs_dir) if args.docs_dir else (out / "docs" if args.dry_run else REPO / "docs")
    if docs != REPO / "docs" and not docs.exists():
        docs.mkdir(parents=True)
        for name in ("benchmarks.md", "results.md"):
            shutil.copy(REPO / "docs" / name, docs / name)
    items = plan(args.dry_run, out / "runs")
    wanted = [w for w in args.only.split(",") if w]
    items = [it for it in items if not wanted or any(it.name.startswith(w) for w in wanted)]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    slack = 5.0 if args.dry_run else 1.0  # a dry run on a loaded CPU is slower than the GPU
    deadline = time.perf_counter() + args.budget_s * slack
    for it in items:
        left = deadline - time.perf_counter()
        if left < MIN_ITEM_S:
            it.result = {"ok": True, "skipped": True, "seconds": 0, "tail": ""}
            print(f"gpu-check: {it.name}: not run (the budget of {args.budget_s:.0f} s was spent)", flush=True)
            continue
        print(f"gpu-check: {it.name} ...", flush=True)
        execute(it, min(it.limit_s * slack, left), out / "logs")
        print(f"gpu-check: {it.name}: {'ok' if it.result['ok'] else 'FAILED'} ({it.result['seconds']} s)", flush=True)
        # the pages are rewritten after every item, so a lease cut short still leaves what was measured
        done = [i for i in items if i.result]
        for page, body in sections(done, device, commit or "unknown", args.dry_run).items():
            replace_section(docs / f"{page}.md", body)
    for page, body in sections(items, device, commit or "unknown", args.dry_run).items():
        replace_section(docs / f"{page}.md", body)
    print(f"gpu-check: wrote {docs / 'benchmarks.md'} and {docs / 'results.md'}")
    return 0 if all(it.result["ok"] for it in items) else 1


if __name__ == "__main__":
    sys.exit(main())
