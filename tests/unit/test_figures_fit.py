"""Figures that fit the run (issue 53 item 7): the FP16 maximum drawn only for runs stored in fp16, no panel
for a metric no run recorded, and a colour legend on the panels with a line per layer."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd

from normlab.diagnostics.figures import fig_layers_per_step, fig_top100
from normlab.diagnostics.probe_store import Run, tier_rows
from normlab.runs.summary import RunSummary


def _run(dtype: str, tier: list[dict]) -> Run:
    probes = pd.DataFrame(
        [
            {"step": s, "layer": None, "site": "global", "metric": m, "value": v * (s + 1)}
            for s in range(3)
            for m, v in (("top100_min", 1.0), ("top100_max", 10.0))
        ]
    )
    summary = RunSummary.from_json({"activation_dtype": dtype})
    return Run(
        path=None, config={}, summary=summary, metrics=pd.DataFrame(), probes=probes, layers=tier_rows(tier),
    )  # fmt: skip


def _fp16_lines(fig) -> int:
    return sum(1 for ax in fig.axes for line in ax.get_lines() if list(line.get_ydata()) == [65504.0, 65504.0])


def test_the_fp16_maximum_is_drawn_only_for_fp16_runs():
    assert _fp16_lines(fig_top100([_run("bf16", [])], ["a"])) == 0
    assert _fp16_lines(fig_top100([_run("bf16", []), _run("fp16", [])], ["a", "b"])) == 1


def test_tier_panels_only_for_recorded_metrics_each_with_a_layer_colour_bar():
    rows = [
        {"step": s, "stream_max": [1.0, 2.0, 3.0], "grad_norm": [1.0, 1.0], "update_ratio": [0.1, 0.1]}
        for s in range(4)
    ]
    fig = fig_layers_per_step([_run("bf16", rows)], ["a"])
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        "a: stream's largest |x|",
        "a: gradient norm",
        "a: update / weight norm",
    ]
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "layer"]  # no logits recorded: no logit panel
    assert len(bars) == 3
