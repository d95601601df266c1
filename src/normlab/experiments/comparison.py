"""`normlab compare`: the main job, and the README's first command. Post-LN, Pre-LN, Peri-LN and
HybridNorm trained side by side with activations stored in fp16 (as the papers' Megatron runs did;
`normlab.model.storage`), probes on, then one HTML report that opens with a reading of the runs.

The defaults provoke Kim et al.'s failure (Sec. 7.2, Fig. 11) on a CPU in minutes: a 12-layer model
at a high learning rate (0.1) without weight decay (Kan et al. Table 1's setting), where Pre-LN's residual stream
grows past fp16's 65504 and the run
diverges at a named site, while Peri-LN's activations stay in the tens. `--set` changes any of it
(`--set activation_dtype=fp32` shows the same Pre-LN run surviving in float32).

It is a sweep with one axis (layout), so it runs in parallel and resumes like any sweep: run it
again and finished layouts are not retrained. docs/results.md has the measured time and output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from normlab.config.commands import COMPARE_BASE, COMPARE_LAYOUTS, CompareConfig
from normlab.experiments.runner import run_sweep
from normlab.experiments.summary import summarize
from normlab.experiments.sweep import SweepConfig
from normlab.runs.files import SweepDir


def compare(
    layouts: list[str] | tuple[str, ...] = COMPARE_LAYOUTS,
    out: str | Path = "runs/compare",
    workers: int | None = None,
    log: Callable[[str], object] = print,
    **base: Any,
) -> Path:
    """Train ``layouts`` with the same settings and write the report; returns the report's index.html."""
    from normlab.diagnostics.probe_store import load_run
    from normlab.diagnostics.run_report import make_report, reading_lines

    merged = {**COMPARE_BASE, **base}
    sweep = SweepConfig(
        name="compare",
        base=merged,
        grid={"layout": list(layouts)},
        source="Kim et al. 2025 Sec. 7.2, Figs. 1, 6, 7, 11; Zhuo et al. 2025 Fig. 5",
        scale=", ".join(
            f"{k} {merged[k]}" for k in ("size", "lr", "weight_decay", "steps", "activation_dtype") if k in merged
        ),
    )
    root = Path(out)
    run_sweep(sweep, root, workers=workers, log=log)
    md = summarize(root)["markdown"].read_text()
    log(md[md.index("## Cells") :].split("\n## ", 1)[0].strip())  # the cell table, not the list of runs
    folder = SweepDir(root)
    finished: list[str | Path] = [
        run.path for run in (folder.run(s.run_id) for s in sweep.expand()) if run.has_metrics()
    ]
    index = make_report(finished, folder.report_dir)
    runs = [load_run(p) for p in finished]
    log("\n".join(["reading:"] + [f"  {line}" for line in reading_lines(runs, [r.name for r in runs])]))
    return index


def compare_command(cfg: CompareConfig, settings: dict[str, Any]) -> str:
    """`normlab compare`: `compare` with the command's declared settings and its runs' ``settings`` (typed, over
    COMPARE_BASE); its closing lines: the time taken and the report's path."""
    t0 = time.perf_counter()
    index = compare(list(cfg.layouts), out=cfg.out, workers=cfg.workers, **settings)  # logs runs, cells, reading
    return f"done in {time.perf_counter() - t0:.0f}s\nreport: {index}"
