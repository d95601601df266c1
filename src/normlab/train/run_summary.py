"""A run's summary.json: its outcome (the divergence monitor's), losses, speed and MFU, memory, the largest
activation, where a diverged run broke, its spikes, the per-step tier's largest values and the step hooks'
own keys."""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from normlab.diagnostics.hooks import Stop
from normlab.diagnostics.stability import spike_score
from normlab.diagnostics.tier import tier_summary
from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric, ProbeMetric
from normlab.runs.summary import Forensics
from normlab.train.faults import injected
from normlab.train.mfu import device_name
from normlab.train.run_state import RunState


def speed_summary(rows: list[dict[str, Any]], state: RunState) -> dict[str, Any]:
    """Median throughput and MFU over the steps after warm-up (the first 10%, at least one step:
    compilation, allocator growth), per run and per device; MFU "unknown" without a known peak."""
    steps = [r for r in rows if isinstance(r.get(Metric.TOK_PER_S), (int, float))]
    steady = steps[max(1, len(steps) // 10) :] or steps
    if not steady:
        return {}
    tok_s = statistics.median(r[Metric.TOK_PER_S] for r in steady)
    per_device = tok_s / state.info.world
    return {
        Metric.TOK_PER_S.value: tok_s,  # the summary's keys: plain strings
        Metric.TOK_PER_S_PER_DEVICE.value: per_device,
        "devices": state.info.world,
        "device": str(state.info.device),
        "device_name": device_name(state.info.device),
        "flops_per_token": state.flops_per_token,
        "mfu": per_device * state.flops_per_token / state.peak_flops if state.peak_flops else "unknown",
    }


def max_activation(run: RunDir, forensics: Forensics | None) -> float | None:
    """The largest finite |activation| of the run: the probes' global top-100 maximum over their steps,
    and for a diverged run the largest finite value the forensic re-run saw (Kim Fig. 11's quantity)."""
    seen: list[float | None] = [v for _, v in run.probe_series("global", ProbeMetric.TOP100_MAX)]
    if forensics is not None:
        seen += forensics.finite_values()
    finite = [float(v) for v in seen if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(finite) if finite else None


def _memory_summary(state: RunState) -> dict[str, float] | None:
    """On CUDA: the plan's total and activations against what the allocator held at most (GiB)."""
    if state.info.device.type != "cuda" or state.memory_plan is None:
        return None
    plan, gib = state.memory_plan, 2**30
    return {
        "planned_gib": round(plan.total / gib, 3),
        "planned_activations_gib": round(plan.activations / gib, 3),
        "max_allocated_gib": round(torch.cuda.max_memory_allocated(state.info.device) / gib, 3),
    }


def write_summary(
    state: RunState, status: str | None = None, error: str | None = None, halt: Stop | None = None
) -> dict[str, Any]:
    """summary.json: the divergence monitor's verdict and the run's figures; ``status`` and ``error``: a crash's;
    ``halt``: the hooks' stop, where one ended the run (a failed one that the monitor did not see, a user's hook's:
    status "diverged" at its step, for its reason)."""
    run = RunDir(state.run)
    rows = run.metrics()
    losses = [r.get(Metric.LOSS) for r in rows]
    finite = [v for v in losses if isinstance(v, (int, float)) and math.isfinite(v)]
    summary = {
        **state.monitor.summary(),
        "layout": state.cfg.model.layout_label,
        "steps": len(rows),
        "tokens": state.tokens,
        "wall_time_s": state.wall,
        **speed_summary(rows, state),
        "initial_loss": finite[0] if finite else None,
        "final_loss": sum(finite[-10:]) / len(finite[-10:]) if finite else None,
        "final_val_loss": state.final_val,
        "params_non_embedding": state.params.non_embedding,
        "activation_dtype": state.cfg.stored_dtype,
        "memory": _memory_summary(state),
        "precision": state.cfg.precision,  # auto decided by the device (config.json holds the resolved settings)
        "compiled": bool(state.cfg.run.compile),
        "max_activation": max_activation(run, state.forensics),
        "forensics": None if state.forensics is None else state.forensics.to_json(),
        "first_break": None if state.forensics is None else state.forensics.site,
        "spikes": [
            {"step": r["step"], "verdict": r["verdict"], "action": r["action"]} for r in run.spikes() if "verdict" in r
        ],  # normlab.train.spikes: each spike's attribution
        "layer_stats": tier_summary(run.layers()),  # the per-step tier's largest values (normlab.diagnostics.tier)
        # OLMo-core's spike score: the share of steps whose loss or gradient norm jumped 6 sigma over the last 128
        **spike_score(losses, [r.get(Metric.GRAD_NORM) for r in rows]),
        "fault": injected(state.cfg),  # run.fault: a fault injected on purpose (None: none)
    }
    summary.update(state.hooks.summary())  # the step hooks' keys (QK-clip's counts)
    if halt is not None and halt.failed and summary["status"] != "diverged":
        summary.update(status="diverged", reason=halt.reason, diverged_step=halt.step)
    if status is not None:
        summary["status"] = status
    if error is not None:
        summary["reason"] = error
        summary["failed_step"] = state.step
    run.write_summary(summary)
    return summary
