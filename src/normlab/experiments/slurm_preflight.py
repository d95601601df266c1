"""Before a SLURM sweep submits anything: the submitit executor for the [slurm] options, and whether the scheduler
could ever run such a job (`preflight`: `sbatch --test-only` with the job script, then the partitions' MaxTime); a
scheduler's refusal as one line (`_one_line`) and whether it may pass by waiting (`_passes`). See
`normlab.experiments.cluster` for the sweep on SLURM itself."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from normlab.errors import ConfigError
from normlab.experiments.scheduler import never_passes, signal_delay, time_limit, time_over_partition
from normlab.runs.files import SweepDir

# sbatch's words for a refusal that passes: a limit on how many jobs may wait, or a controller too busy to answer
TRANSIENT = (
    "MaxSubmit",
    "limit",
    "QOSMax",
    "AssocMax",
    "temporarily",
    "try again",
    "timed out",
    "Unable to contact",
    "Socket timed out",
    "busy",
)


def _executor(root: Path, kind: str, options: dict[str, Any], name: str) -> Any:
    import submitit

    folder = SweepDir(root).jobs_dir / "%j"
    if kind == "slurm":
        opts = dict(options)
        ex: submitit.Executor = submitit.AutoExecutor(
            folder=folder, cluster="slurm", slurm_max_num_timeout=int(opts.pop("slurm_max_num_timeout", 3))
        )
        opts.setdefault("name", f"normlab-{name}")
        opts.setdefault("slurm_signal_delay_s", signal_delay(time_limit(opts)))
        ex.update_parameters(**opts)
    else:
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=int(options.get("timeout_min", 60)))
    return ex


def _one_line(text: Any) -> str:
    """A scheduler's message as one line: its error and failure lines and sbatch's own complaints (`sbatch:
    unrecognized option '--x'`) joined ("sbatch: error: " dropped; sbatch's "Try sbatch --help" hint left out),
    else its last line."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    said = []
    for line in lines:
        if line.startswith("Try ") and "--help" in line:
            continue
        if "error:" in line:
            said.append(line.split("error:", 1)[1].strip())
        elif "error" in line.lower() or "fail" in line.lower():  # --test-only's "allocation failure: ..."
            said.append(line)
        elif re.match(r"^s(batch|run|queue|control): ", line):
            said.append(line.split(": ", 1)[1].strip())
    return ("; ".join(said) if said else (lines or ["no message"])[-1])[:400]


def _passes(why: str) -> bool:
    """Whether a refusal may pass by waiting (a limit on how many jobs may wait, a busy controller): never one that
    names a limit on each job (`scheduler.never_passes`), however it words it ("job submit limit, user's size and/or
    time limits")."""
    return never_passes(why) is None and any(word.lower() in why.lower() for word in TRANSIENT)


def preflight(options: dict[str, Any], name: str) -> None:
    """Ask the scheduler, submitting nothing, whether a job of these [slurm] options could ever start: `sbatch
    --test-only` with the job script submitit would write (a request none of the partition's nodes can meet: more
    CPUs, memory or GPUs than a node has, a partition or account that does not exist), then the partitions'
    MaxTime (a longer time limit SLURM accepts and never starts, when EnforcePartLimits is NO). A ConfigError in one
    line, sbatch's own words in it, if not. Nothing is written: the script goes to a temporary folder. A scheduler
    too busy to answer, or none here, is no refusal (the submission then speaks)."""
    if not shutil.which("sbatch") or not shutil.which("srun"):
        return
    with tempfile.TemporaryDirectory(prefix="normlab-test-only-") as tmp:
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit's warnings: the line below says it all
                inner = _executor(Path(tmp), "slurm", options, name)._executor
                script = Path(tmp) / "job.sh"
                script.write_text(inner._make_submission_file_text(inner._submitit_command_str, "test-only"))
        except Exception as err:  # noqa: BLE001 - submitit refused an option check_options let through
            raise ConfigError(f"submitit refused the [slurm] options: {_one_line(err)}") from None
        try:
            out = subprocess.run(
                ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return
    if out.returncode != 0:
        why = _one_line(out.stderr or out.stdout)
        if not _passes(why):
            meaning = never_passes(why)
            raise ConfigError(
                f"the scheduler can never run these jobs: {why}"
                + (f" ({meaning.split(': ', 1)[1]})" if meaning else "")
                + " (sbatch --test-only with the [slurm] options); fix "
                "the [slurm] table (slurm_partition, cpus_per_task, mem_gb, gpus_per_node, ...) and run the same "
                "command again"
            )
    over = time_over_partition(options)
    if over:
        raise ConfigError(over)
