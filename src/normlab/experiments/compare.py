"""`normlab compare`: the main job. Post-LN, Pre-LN, Peri-LN and HybridNorm trained side by side on
the default corpus with probes on, then one HTML report (loss curves, variance by depth, gradient
norms by layer, top activations, ...) and the sweep summary.

It is a sweep with one axis (layout), so it runs in parallel and resumes like any sweep: run it
again and finished layouts are not retrained. Defaults are sized to finish in about ten minutes on
two CPU cores (docs/results.md has the measured time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from normlab.experiments.runner import run_sweep
from normlab.experiments.summarize import summarize
from normlab.experiments.sweep import SweepConfig

COMPARE_LAYOUTS = ("post", "pre", "peri", "hybrid")
COMPARE_BASE: dict[str, Any] = {"size": "tiny", "steps": 300, "probe_every": 50, "eval_every": 50}


def compare(layouts: list[str] | tuple[str, ...] = COMPARE_LAYOUTS, out: str | Path = "runs/compare",
            workers: int | None = None, log=print, **base: Any) -> Path:  # noqa: ANN001 - log: print-like
    """Train ``layouts`` with the same settings and write the report; returns the report's index.html."""
    from normlab.diagnostics.report import make_report

    sweep = SweepConfig(name="compare", base={**COMPARE_BASE, **base}, grid={"layout": list(layouts)},
                        source="Kim et al. 2025 Figs. 1, 6, 7, 11; Zhuo et al. 2025 Fig. 5",
                        scale=f"{base.get('size', COMPARE_BASE['size'])}, {base.get('steps', COMPARE_BASE['steps'])} steps")
    root = Path(out)
    run_sweep(sweep, root, workers=workers, log=log)
    summarize(root)
    finished = [root / "runs" / s.run_id for s in sweep.expand() if (root / "runs" / s.run_id / "metrics.jsonl").exists()]
    return make_report(finished, root / "report")
