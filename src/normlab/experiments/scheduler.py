"""What the scheduler accepts and gives, read without submitting anything: the [slurm] table's keys checked
(before any folder is written), the USR2 signal's delay before a time limit, and the CPUs an allocation holds
(torch's threads inside a job). Below `sweep` (which checks a sweep's options), `cluster` (which submits) and
`job` (which runs inside the allocation); imports none of them.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from normlab.errors import ConfigError

# submitit's generic options, and the SLURM ones (slurm_*), as [slurm] table keys; slurm_max_num_timeout is
# submitit's executor argument: how many time limits a run is requeued after.
GENERIC_OPTIONS = (
    "cpus_per_task",
    "gpus_per_node",
    "mem_gb",
    "name",
    "nodes",
    "stderr_to_stdout",
    "tasks_per_node",
    "timeout_min",
)
EXTRA_OPTIONS = ("slurm_max_num_timeout",)
SIGNAL_DELAY_S = 90  # submitit's default slurm_signal_delay_s


def valid_options() -> list[str]:
    """The [slurm] table's keys (submitit's parameters); [] when submitit is not installed."""
    try:
        import submitit
    except ImportError:
        return []
    return sorted(
        {
            *submitit.AutoExecutor._valid_parameters(),
            *(f"slurm_{k}" for k in submitit.SlurmExecutor._valid_parameters()),
            *EXTRA_OPTIONS,
        }
    )


def check_options(options: dict[str, Any], executor: str) -> None:
    """Refuse an unknown [slurm] key (did you mean ...) or a missing submitit, before anything is written."""
    if not options and executor == "local":
        return
    valid = valid_options()
    if not valid:
        if executor != "local":
            raise ConfigError(f'executor {executor!r} needs submitit: pip install submitit (or use executor = "local")')
        return
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1) or difflib.get_close_matches(f"slurm_{key}", valid, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"unknown key {key!r} in the [slurm] table{hint}; valid: submitit's options "
                f"({', '.join(GENERIC_OPTIONS)}, slurm_partition, slurm_qos, slurm_array_parallelism, "
                "slurm_signal_delay_s, ... as in submitit's SlurmExecutor) and slurm_max_num_timeout"
            )
    limit, delay = options.get("timeout_min"), options.get("slurm_signal_delay_s")
    if isinstance(limit, (int, float)) and isinstance(delay, (int, float)) and delay >= limit * 60:
        raise ConfigError(
            f"slurm_signal_delay_s = {delay} is not shorter than timeout_min = {limit} "
            f"({limit * 60:g} s): SLURM would send the USR2 that saves and requeues a run the moment "
            "its job starts; give "
            f"slurm_signal_delay_s below {limit * 60:g} (or leave it out: a quarter of the limit, at "
            f"most {SIGNAL_DELAY_S} s)"
        )


def signal_delay(timeout_min: float | None) -> int:
    """Seconds before the time limit that SLURM signals USR2 when the [slurm] table does not say: submitit's 90 s,
    but at most a quarter of a short limit (a 1-minute job gets 15 s: with 90 s it would be signalled at its start)."""
    if not isinstance(timeout_min, (int, float)):
        return SIGNAL_DELAY_S
    return int(min(SIGNAL_DELAY_S, max(5, timeout_min * 60 // 4)))


def allocation_threads() -> int | None:
    """The CPUs SLURM gave this task: SLURM_CPUS_PER_TASK, else the node's CPUs over its tasks; None outside a job."""
    per_task = os.environ.get("SLURM_CPUS_PER_TASK")
    if per_task and per_task.isdigit():
        return max(1, int(per_task))
    on_node, tasks = os.environ.get("SLURM_CPUS_ON_NODE"), os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    if on_node and on_node.isdigit():
        return max(1, int(on_node) // (int(tasks) if tasks.isdigit() and int(tasks) else 1))
    return None
