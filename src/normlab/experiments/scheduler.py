"""What the scheduler accepts and gives, read without submitting anything: the [slurm] table's keys and values
checked (before any folder is written), the USR2 signal's delay before a time limit, the limits of a partition
and the pending reasons that mean a job can never start, and the CPUs an allocation holds (torch's threads inside
a job). Below `sweep` (which checks a sweep's options), `cluster` (which submits) and `job` (which runs inside the
allocation); imports none of them.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any

from normlab.errors import ConfigError
from normlab.settings import build, nonneg, positive, setting

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
# a generic option and its slurm_ twin set the same sbatch flag (submitit takes the slurm_ one silently): one of each
TWINS = {
    "timeout_min": "slurm_time",
    "mem_gb": "slurm_mem",
    "nodes": "slurm_nodes",
    "tasks_per_node": "slurm_ntasks_per_node",
    "cpus_per_task": "slurm_cpus_per_task",
    "gpus_per_node": "slurm_gpus_per_node",
    "name": "slurm_job_name",
    "stderr_to_stdout": "slurm_stderr_to_stdout",
}
# sbatch flags that normlab or submitit set for every job (the held submission, its token, the array, the logs, the
# USR2 warning): slurm_additional_parameters may not set them
RESERVED_FLAGS = ("array", "comment", "error", "hold", "open-mode", "output", "parsable", "signal", "test-only", "wrap")
# the line a job prints (its log) when it found its run held by another process and recorded nothing
# (`normlab.experiments.job`): the coordinator tells such a job from one that ended without a word
HELD_LINE = "held by another process; this job recorded nothing"
# the comment words a job of normlab carries (normlab.experiments.submission): a user's comment may not hold them
TOKEN_WORDS = ("normlab:", "normlab-sweep:")


def _text(value: Any) -> str | None:
    """A value written into the job script: non-empty text on one line."""
    if not value.strip():
        return "must not be empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"must be one line of text without control characters, got {value!r}"
    return None


def _one(value: Any) -> str | None:
    return None if value == 1 else "must be 1: each run of a sweep trains in one process, one job per run"


def _memory(value: Any) -> str | None:
    if _text(value) or not re.fullmatch(r"[0-9]+([KMGTkmgt][Bb]?)?", value.strip()):
        return f"must be a memory size as sbatch reads it (4096, 4096M, 16G, 1T), got {value!r}"
    return None


def _lines(value: Any) -> str | None:
    bad = next((v for v in value if _text(v)), None)
    return None if bad is None else f"must be a list of one-line strings, got {bad!r}"


def _exclusive(value: Any) -> str | None:
    if value is True or (isinstance(value, str) and not _text(value)):
        return None
    return f"must be true or sbatch's --exclusive word (user, mcs; leave it out for false), got {value!r}"


def _comment(value: Any) -> str | None:
    problem = _text(value)
    if problem is None and any(w.startswith(TOKEN_WORDS) for w in value.split()):
        return f"may not hold a word starting {' or '.join(TOKEN_WORDS)} (normlab names its jobs with them)"
    return problem


def _additional(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"must be a table of sbatch flags (flag = value), got {value!r} ({type(value).__name__})"
    for flag, v in value.items():
        name = str(flag).replace("_", "-")
        if name in RESERVED_FLAGS:
            return f"may not set --{name}: normlab sets it for every job (reserved: {', '.join(RESERVED_FLAGS)})"
        if v is True:  # a flag without a value (--requeue)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, str)) or (isinstance(v, str) and _text(v)):
            return f"{flag} must be one line of text, a number or true (leave a false flag out), got {v!r}"
    return None


@dataclass(frozen=True)
class SlurmTable:
    """A sweep's [slurm] table, typed: submitit's parameters (its AutoExecutor's generic names and its
    SlurmExecutor's, prefixed slurm_; github.com/facebookincubator/submitit, slurm/slurm.py `_make_sbatch_string`),
    which become sbatch's flags (slurm.schedmd.com/sbatch.html). Every value is checked once, before anything is
    written; the table itself is passed to submitit as given."""

    timeout_min: int | None = setting(None, "each job's time limit in minutes (sbatch --time)", check=positive)
    mem_gb: float | None = setting(None, "memory per node in GB (sbatch --mem)", check=positive)
    nodes: int | None = setting(None, "nodes per job (1)", check=_one)
    tasks_per_node: int | None = setting(None, "tasks per node (1)", check=_one)
    cpus_per_task: int | None = setting(None, "CPUs per task: the run's torch threads", check=positive)
    gpus_per_node: int | None = setting(None, "GPUs per node", check=nonneg)
    name: str | None = setting(None, "the jobs' name (default normlab-SWEEP)", check=_text)
    stderr_to_stdout: bool | None = setting(None, "one log per job")
    slurm_time: int | None = setting(None, "timeout_min's sbatch name", check=positive)
    slurm_mem: str | None = setting(None, "memory per node (4096M, 16G)", check=_memory)
    slurm_nodes: int | None = setting(None, "nodes' sbatch name (1)", check=_one)
    slurm_ntasks_per_node: int | None = setting(None, "tasks_per_node's sbatch name (1)", check=_one)
    slurm_cpus_per_task: int | None = setting(None, "cpus_per_task's sbatch name", check=positive)
    slurm_gpus_per_node: int | None = setting(None, "gpus_per_node's sbatch name", check=nonneg)
    slurm_job_name: str | None = setting(None, "name's sbatch name", check=_text)
    slurm_stderr_to_stdout: bool | None = setting(None, "stderr_to_stdout's submitit name")
    slurm_partition: str | None = setting(None, "partition (or several, comma-separated)", check=_text)
    slurm_qos: str | None = setting(None, "quality of service", check=_text)
    slurm_account: str | None = setting(None, "account charged", check=_text)
    slurm_comment: str | None = setting(None, "the jobs' comment (normlab adds its tokens after it)", check=_comment)
    slurm_constraint: str | None = setting(None, "node features required", check=_text)
    slurm_exclude: str | None = setting(None, "nodes to avoid", check=_text)
    slurm_nodelist: str | None = setting(None, "nodes required", check=_text)
    slurm_dependency: str | None = setting(None, "sbatch --dependency", check=_text)
    slurm_gres: str | None = setting(None, "generic resources (gpu:2)", check=_text)
    slurm_mail_type: str | None = setting(None, "sbatch --mail-type", check=_text)
    slurm_mail_user: str | None = setting(None, "sbatch --mail-user", check=_text)
    slurm_wckey: str | None = setting(None, "workload characterization key", check=_text)
    slurm_cpus_per_gpu: int | None = setting(None, "CPUs per GPU (needs slurm_gpus_per_task)", check=positive)
    slurm_num_gpus: int | None = setting(None, "submitit's old name of gpus_per_node", check=nonneg)
    slurm_gpus_per_task: int | None = setting(None, "GPUs per task", check=nonneg)
    slurm_mem_per_gpu: str | None = setting(None, "memory per GPU (16G)", check=_memory)
    slurm_mem_per_cpu: str | None = setting(None, "memory per CPU (2G)", check=_memory)
    slurm_setup: tuple[str, ...] = setting((), "shell lines run before the job's command", check=_lines)
    slurm_teardown: tuple[str, ...] = setting((), "shell lines run after it", check=_lines)
    slurm_srun_args: tuple[str, ...] = setting((), "srun's extra arguments", check=_lines)
    slurm_signal_delay_s: int | None = setting(None, "USR2 this many seconds before the time limit", check=nonneg)
    slurm_exclusive: Any = setting(None, "sbatch --exclusive (true or its word)", check=_exclusive)
    slurm_array_parallelism: int | None = setting(None, "array tasks running at once", check=positive)
    slurm_use_srun: bool | None = setting(None, "run the job's command through srun")
    slurm_additional_parameters: dict[str, Any] | None = setting(
        None, "other sbatch flags, flag = value", check=_additional
    )
    slurm_max_num_timeout: int | None = setting(None, "how many time limits a run is requeued after", check=nonneg)


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
    """Refuse, before anything is written, a missing submitit, an unknown [slurm] key (did you mean ...), a value of
    the wrong type or range (`SlurmTable`), a generic option given with its slurm_ twin, an sbatch flag normlab sets
    itself, and a USR2 warning not shorter than the time limit."""
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
    typed = {k: v for k, v in options.items() if k in SlurmTable.__dataclass_fields__}
    for key in set(options) - set(typed):  # an option of a newer submitit than normlab declares: one line of text
        value = options[key]
        if not isinstance(value, (bool, int, float, str)) or (isinstance(value, str) and _text(value)):
            raise ConfigError(f"the [slurm] table: {key} must be one line of text, a number or true, got {value!r}")
    build(SlurmTable, typed, "the [slurm] table")  # each value against its type and range (one line, exit 2)
    for generic, twin in TWINS.items():
        if generic in options and twin in options:
            raise ConfigError(
                f"the [slurm] table gives both {generic} and {twin}, which set the same sbatch flag; keep one"
            )
    if "slurm_cpus_per_gpu" in options and "slurm_gpus_per_task" not in options:
        raise ConfigError(
            "the [slurm] table: slurm_cpus_per_gpu needs slurm_gpus_per_task (submitit ignores it otherwise); "
            "give slurm_gpus_per_task, or cpus_per_task instead"
        )
    extra = options.get("slurm_additional_parameters") or {}
    if "time" in extra:
        given = next((k for k in ("timeout_min", "slurm_time") if k in options), None)
        if given:
            raise ConfigError(
                f"the [slurm] table gives both {given} and slurm_additional_parameters' time, which set the same "
                "sbatch flag (--time); keep one"
            )
        value = extra["time"]
        if isinstance(value, bool) or (
            time_limit(options) is None and str(value).strip().upper() not in ("UNLIMITED", "INFINITE")
        ):
            raise ConfigError(
                f"the [slurm] table: slurm_additional_parameters' time must be a duration as sbatch reads it "
                f"(minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED), got {value!r}"
            )
    limit, delay = time_limit(options), options.get("slurm_signal_delay_s")
    limit_key = time_key(options)
    if isinstance(limit, (int, float)) and isinstance(delay, (int, float)) and delay >= limit * 60:
        raise ConfigError(
            f"slurm_signal_delay_s = {delay} is not shorter than {limit_key} = {limit:g} "
            f"({limit * 60:g} s): SLURM would send the USR2 that saves and requeues a run the moment "
            "its job starts; give "
            f"slurm_signal_delay_s below {limit * 60:g} (or leave it out: a quarter of the limit, at "
            f"most {SIGNAL_DELAY_S} s)"
        )


def time_limit(options: dict[str, Any]) -> float | None:
    """The jobs' time limit in minutes as the table gives it: slurm_additional_parameters' `time` (submitit writes
    it after, so over, its own --time), else timeout_min or its twin slurm_time; None: the partition's default (or
    a `time` of UNLIMITED)."""
    extra = options.get("slurm_additional_parameters")
    if isinstance(extra, dict) and "time" in extra:
        value = extra["time"]
        if isinstance(value, bool):
            return None
        return float(value) if isinstance(value, (int, float)) else slurm_minutes(str(value))
    value = options.get("timeout_min", options.get("slurm_time"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def time_key(options: dict[str, Any]) -> str:
    """The [slurm] key that sets the jobs' time limit (`time_limit`), as the messages name it."""
    extra = options.get("slurm_additional_parameters")
    if isinstance(extra, dict) and "time" in extra:
        return "slurm_additional_parameters' time"
    return "timeout_min" if "timeout_min" in options else "slurm_time"


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


# squeue's pending reasons for a job that can never start as it was submitted: a limit of its partition, QOS or
# association, or a request none of the partition's nodes can meet (squeue(1), JOB REASON CODES;
# slurm.schedmd.com/resource_limits.html). ReqNodeNotAvail and Resources are not among them: a drained node comes
# back, a busy one frees up.
NEVER_STARTS = {
    "PartitionTimeLimit": "its time limit is over the partition's MaxTime",
    "PartitionNodeLimit": "its node count is outside the partition's limits",
    "PartitionConfig": "it asks for more than the partition's nodes have (CPUs, memory, GPUs)",
    "BadConstraints": "no node has the features it asks for",
    "QOSMaxWallDurationPerJobLimit": "its time limit is over the QOS's MaxWall",
    "AssocMaxWallDurationPerJobLimit": "its time limit is over the association's MaxWall",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than the QOS allows a job",
    "AssocMaxCpuPerJobLimit": "it asks for more CPUs than the association allows a job",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than the QOS allows a job",
    "AssocMaxNodePerJobLimit": "it asks for more nodes than the association allows a job",
    "QOSMaxGRESPerJob": "it asks for more GPUs than the QOS allows a job",
    "QOSMaxMemoryPerJob": "it asks for more memory than the QOS allows a job",
    "InvalidQOS": "its QOS is not valid for this user or partition",
    "InvalidAccount": "its account is not valid",
}


def never_starts(reason: str) -> str | None:
    """Why a job pending for `reason` (squeue %r) can never start; None when it may (waiting is normal)."""
    word = reason.split(",")[0].strip()
    return NEVER_STARTS.get(word)


def never_passes(text: str) -> str | None:
    """Why a refusal by sbatch (its error lines) can never pass by waiting: it names a limit on each job (a QOS's or
    an association's MaxWall, MaxTRESPerJob, ... with DenyOnLimit: `sbatch: error: QOSMaxWallDurationPerJobLimit`)
    or another reason of `NEVER_STARTS`; None when it names none (a MaxSubmitJobs limit, a busy controller: those
    pass as the sweep's jobs end)."""
    for word in re.findall(r"[A-Za-z]+", text):
        if word in NEVER_STARTS:
            return f"{word}: {NEVER_STARTS[word]}"
    match = re.search(r"\b(QOS|Assoc)Max\w*PerJob\w*", text)
    if match:
        whose = "QOS" if match.group(1) == "QOS" else "association"
        return f"{match.group(0)}: the job asks for more than the {whose} allows any one job"
    return None


def slurm_minutes(text: str) -> float | None:
    """A SLURM duration as scontrol and sinfo print it ([D-]HH:MM:SS, MM:SS, D-HH, minutes) in minutes; None for
    UNLIMITED, infinite, NONE or anything unreadable."""
    text = text.strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        return None
    day, first, *rest = match.groups()
    parts = [int(first)] + [int(x) for x in rest if x]  # the colon-separated numbers, the first always there
    if len(parts) == 3:  # H:M:S
        hours, minutes, seconds = parts
    elif len(parts) == 2:  # D-H:M, else M:S
        hours, minutes, seconds = (parts[0], parts[1], 0) if day else (0, parts[0], parts[1])
    else:  # D-H, else minutes
        hours, minutes, seconds = (parts[0], 0, 0) if day else (0, parts[0], 0)
    return int(day or 0) * 1440 + hours * 60 + minutes + seconds / 60


def ask_scheduler(argv: list[str]) -> list[str] | None:
    """The lines a SLURM query command prints (scontrol, squeue), or None when it cannot answer: not installed,
    no controller (a non-zero exit), or no answer within a minute."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines() if out.returncode == 0 else None


def partitions() -> dict[str, dict[str, str]] | None:
    """Every partition's settings (scontrol show partition: MaxTime, Default, ...); None when scontrol cannot
    answer."""
    lines = ask_scheduler(["scontrol", "show", "partition", "-o"])
    if lines is None:
        return None
    found = {}
    for line in lines:
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if fields.get("PartitionName"):
            found[fields["PartitionName"]] = fields
    return found


def time_over_partition(options: dict[str, Any]) -> str | None:
    """A refusal when the jobs' time limit is over the MaxTime of every partition they may run in (SLURM accepts
    such a job when EnforcePartLimits is NO, and it waits forever: PartitionTimeLimit); None otherwise, or when
    scontrol cannot say."""
    limit = time_limit(options)
    if limit is None:
        return None
    known = partitions()
    if not known:
        return None
    extra = options.get("slurm_additional_parameters")
    asked = extra["partition"] if isinstance(extra, dict) and "partition" in extra else options.get("slurm_partition")
    names = [x.strip() for x in asked.split(",") if x.strip()] if isinstance(asked, str) else []
    names = names or [n for n, f in known.items() if f.get("Default") == "YES"]
    caps = {n: slurm_minutes(known[n].get("MaxTime", "")) for n in names if n in known}
    if not caps or len(caps) < len(names) or any(cap is None or limit <= cap for cap in caps.values()):
        return None  # an unknown partition is sbatch's to refuse; an unlimited one or one that fits can run it
    key = time_key(options)
    most = max(c for c in caps.values() if c is not None)
    where = ", ".join(f"{n}'s MaxTime is {c:g} min" for n, c in caps.items())
    shown = f"{limit:g}"
    if key.startswith("slurm_additional_parameters"):
        shown = f"{options['slurm_additional_parameters']['time']!r} ({limit:g} min)"
    return (
        f"{key} = {shown} is over the partition's time limit ({where}): SLURM would accept the jobs and never start "
        f"them (PartitionTimeLimit); give {key} <= {most:g}, or a partition whose MaxTime allows it"
    )
