"""How a run ended: the outcome vocabulary, the outcome columns a sweep keeps, and one line of words.

A run's status is one of
- ``ok``: trained to its last step with a finite loss;
- ``stalled``: trained to its end but learned nothing beyond token frequencies (normlab.train.divergence);
- ``diverged``: stopped by a divergence rule, with the step and the reason;
- ``failed``: crashed (a bad data path, a killed worker): not a result, re-run by a sweep; one the time budget
  stopped is recorded ``failed`` with the reason `BUDGET_STOP` and said "stopped by the budget" (`shown_status`).
A sweep's store adds ``pending`` and ``running`` before a run ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

FINISHED = ("ok", "stalled", "diverged")  # the outcomes of a run that ran to its end (or its divergence)
TRAINED = ("ok", "stalled")  # finished with a finite final loss: seed means and evaluations use these
# a run the time budget stopped is recorded `failed` with this reason (the runner's `Deadline`: the next run of
# its sweep continues it); every summary says it as STOPPED, never "failed" (it did not fail)
BUDGET_STOP = "stopped at the end of the time budget"
STOPPED = "stopped by the budget"


def shown_status(status: Any, reason: Any = None) -> str:
    """The status a summary says: STOPPED for a run the time budget stopped, else the recorded one."""
    return STOPPED if status == "failed" and str(reason or "").startswith(BUDGET_STOP) else str(status)


def shown_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Runs by `shown_status`, in `STATUSES`' order with STOPPED after failed (a sweep's closing line: "2 ok, 1
    stopped by the budget")."""
    out: dict[str, int] = {}
    for row in rows:
        key = shown_status(row.get("status"), row.get("reason"))
        out[key] = out.get(key, 0) + 1
    order = [*FINISHED, "failed", STOPPED]
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


STATUSES = ("pending", "running", *FINISHED, "failed")  # a sweep store row's life cycle
# Outcome columns a sweep keeps from a run's summary.json (normlab.runs.store).
OUTCOME = (
    "initial_loss",
    "final_loss",
    "final_val_loss",
    "diverged_step",
    "loss_spikes",
    "grad_spikes",
    "megatron_spikes",
    "wall_time_s",
    "tokens",
    "max_activation",
    "first_break",
    "spike_score",
)


def describe(result: Mapping[str, Any]) -> str:
    """One line for an ended run, from its summary.json or its sweep-store row (they share the keys):
    the status (with the step and the reason of a divergence or a stall), the final losses of a run
    that trained, steps skipped, the speed, and where a diverged run first broke."""
    status, reason = result.get("status", "failed"), result.get("reason")
    if shown_status(status, reason) == STOPPED:
        return STOPPED + str(reason)[len(BUDGET_STOP) :]
    if status not in FINISHED:
        return f"{status}: {reason}"
    text = status
    if status == "diverged":
        text += f" at step {result.get('diverged_step')} ({reason})"
    elif status == "stalled":
        text += f" ({reason})"
    fault = result.get("fault")
    if isinstance(fault, Mapping) and fault.get("text"):
        text += f"; FAULT INJECTED: {fault['text']}"  # run.fault: this outcome is the fault's, not the setting's
    trained = status in TRAINED  # a diverged run's losses are not results (Kim et al. exclude them)
    if trained and result.get("final_loss") is not None:
        text += f"; final loss {result['final_loss']:.4f}"
        if result.get("final_val_loss") is not None:
            text += f", val loss {result['final_val_loss']:.4f}"
    for key, what in (("overflow_steps", "fp16 overflow steps skipped"), ("skipped_steps", "non-finite steps skipped")):
        if result.get(key):
            text += f"; {len(result[key])} {what}"
    if result.get("tok_per_s"):
        mfu = result.get("mfu")
        text += f"; {result['tok_per_s']:,.0f} tok/s" + (f", MFU {mfu:.1%}" if isinstance(mfu, float) else "")
    elif trained and result.get("wall_time_s") is not None:
        text += f" ({result['wall_time_s']:.0f}s)"
    if isinstance(result.get("forensics"), Mapping) and result["forensics"].get("text"):
        text += f"; {result['forensics']['text']}"  # last: where a diverged run first broke
    elif result.get("first_break"):
        text += f"; first overflow: {result['first_break']}"
    return text
