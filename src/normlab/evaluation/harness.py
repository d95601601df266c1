"""`normlab eval`: lm-evaluation-harness on a run, an export or every finished run of a sweep.

Kim et al. 2025 (Table 1) and Zhuo et al. 2025 (Tables 1-2) compare layouts on zero-shot benchmarks
through lm-evaluation-harness; this runs the same harness (the optional extra ``normlab[eval]``,
pinned) on normlab models:

- a run directory (or one checkpoint): its newest checkpoint as `NormLabForCausalLM` in memory, with
  the run's tokenizer (special tokens set); results go to ``RUN/eval.json``;
- an export folder (``normlab export``, or any transformers causal LM folder): loaded as lm-eval's
  own ``--model hf`` would; code in the folder runs only if it is the ``modeling_normlab.py`` this
  normlab writes, or with ``--trust-remote-code`` (`remote_code`); results go to ``FOLDER/eval.json``;
- a sweep folder: every run that finished ``ok`` (diverged runs are excluded, as Kim et al. do);
  `normlab summarize` then shows the scores per cell (mean ± std over seeds).

Tasks: any lm-eval task or group name. normlab ships its own (``normlab/evaluation/tasks``, added
with lm-eval's ``include_path``): three offline tasks on held-out Shakespeare (group
``normlab_local``) and the papers' task lists as groups (``normlab_kim2025``,
``normlab_zhuo2025_dense``, ``normlab_zhuo2025_moe``; their datasets come from the Hub, so they run
where the user's lm-eval can reach it).

``eval.json`` holds one entry per task, merged over invocations (a later evaluation of other tasks
adds to it; of the same task, replaces it), written atomically.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.config.commands import EvalConfig
from normlab.data.corpus import DataError
from normlab.errors import ConfigError
from normlab.evaluation.local_tasks import TASKS_DIR
from normlab.io import atomic_write_bytes, check_writable
from normlab.runs.files import RunDir, SweepDir
from normlab.runs.outcome import TRAINED

LM_EVAL_PIN = "lm_eval[hf]==0.4.13"


def task_groups() -> dict[str, tuple[str, ...]]:
    """normlab's lm-eval groups, read from their YAML files in `TASKS_DIR` (the one place they are
    defined; lm-eval reads the same files)."""
    import yaml  # PyYAML: a dependency of transformers and of lm-eval

    groups = {}
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"^group:", text, re.MULTILINE):  # task files hold `!function` tags; group files do not
            spec = yaml.safe_load(text)
            groups[spec["group"]] = tuple(spec["task"])
    return groups


GROUPS = task_groups()
LOCAL_TASKS = GROUPS["normlab_local"]


class EvalError(DataError):
    """An evaluation that cannot run; the message says what was wrong and what is valid."""


def _lm_eval() -> Any:
    try:
        import lm_eval
        import lm_eval.models.huggingface
    except ImportError as err:
        raise EvalError(
            f"normlab eval needs lm-evaluation-harness: pip install '{LM_EVAL_PIN}' "
            f"(or pip install 'normlab[eval]'); import failed: {err}"
        ) from None
    return lm_eval


@functools.lru_cache(maxsize=2)
def _task_manager(local_only: bool = False) -> Any:
    """lm-eval's task index with normlab's folder on its include path; built once per process, so a
    sweep's runs share it. Indexing every task YAML lm-eval ships takes about 10 s of CPU; ``local_only``
    (every task asked for is one of normlab's local tasks) indexes normlab's folder alone."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=not local_only)


def _unknown_ours(tasks: list[str]) -> list[str]:
    """The names in normlab's namespace (``normlab_*``) that are none of its tasks or groups: lm-eval ships no
    task of that name, so a typo there is answered without indexing lm-eval's task YAML (about 10 s)."""
    ours = set(GROUPS) | set(LOCAL_TASKS)
    return [t for t in tasks if t.startswith("normlab_") and t not in ours]


def _manager_for(tasks: list[str]) -> Any:
    """The task index that knows ``tasks``: normlab's folder alone when they are all its local tasks."""
    return _task_manager(local_only=all(t == "normlab_local" or t in LOCAL_TASKS for t in tasks))


def kind_of(source: Path) -> str:
    """'sweep' | 'run' | 'checkpoint' | 'export', or an error naming what is valid."""
    if source.is_dir() and SweepDir(source).is_sweep():
        return "sweep"
    if source.is_dir() and RunDir(source).has_checkpoints():
        return "run"
    if source.is_dir() and RunDir(source).is_export_like():
        return "export"
    if source.is_file() or source.name.endswith(".dcp"):
        return "checkpoint"
    raise EvalError(
        f"{source}: not a run directory (with checkpoints/), a checkpoint, an export folder (with "
        "config.json) or a sweep folder (with sweep.db)"
    )


def remote_code(folder: Path, trust: bool = False) -> bool:
    """Whether loading the export ``folder`` runs code from it (``trust_remote_code``), and whether that
    is allowed: a native architecture (no ``auto_map``) runs none; normlab's own class runs the
    folder's ``modeling_normlab.py`` only if it is byte for byte what this normlab writes
    (`normlab.hf.bundle`); any other code only with ``trust`` (``--trust-remote-code``)."""
    from normlab.hf.bundle import bundle_source
    from normlab.hf.folder import NORMLAB_MODULE, code_modules

    modules = code_modules(folder)
    if not modules:
        return False
    if trust:
        return True
    bundled = folder / "modeling_normlab.py"
    if modules == {NORMLAB_MODULE} and bundled.is_file() and bundled.read_bytes() == bundle_source().encode():
        return True
    which = ", ".join(f"{m}.py" for m in sorted(modules))
    why = (
        "its modeling_normlab.py differs from what this normlab writes (edited, or exported by another "
        "version: re-export it)"
        if modules == {NORMLAB_MODULE} and bundled.is_file()
        else f"normlab did not write it ({which})"
    )
    raise EvalError(
        f"{folder} carries model code that would run when it loads, and {why}; pass "
        "--trust-remote-code only if you trust that code"
    )


def _model_for(
    source: Path, kind: str, device: str, batch_size: int | str, max_length: int | None, trusted: bool = False
) -> tuple[Any, dict, Path]:
    """lm-eval's HFLM for the source, facts about it, and the folder results go to. ``trusted``: an
    export's own model code may run (`remote_code`'s verdict, taken before this is called)."""
    from lm_eval.models.huggingface import HFLM

    if kind == "export":
        lm = HFLM(
            pretrained=str(source),
            trust_remote_code=trusted,
            device=device,
            batch_size=batch_size,
            max_length=max_length,
            backend="causal",
        )
        return lm, {"source": str(source)}, source
    from normlab.hf import to_hf
    from normlab.hf.tokenizer import to_hf_tokenizer
    from normlab.runs.model import load_run_model, run_tokenizer

    run = load_run_model(source)
    tok = run_tokenizer(run.config, run.run_dir)
    if tok is None:
        raise EvalError(
            f"{source} was trained on pre-tokenized .bin data, whose tokenizer normlab does not know: "
            "export the model, save the tokenizer beside it, and evaluate the export folder"
        )
    hf_tok = to_hf_tokenizer(tok, run.model.config.max_seq_len)
    model = to_hf(run.model, hf_tok)
    lm = HFLM(
        pretrained=model,
        tokenizer=hf_tok,
        device=device,
        batch_size=batch_size,
        backend="causal",
        max_length=max_length or run.model.config.max_seq_len,
    )
    facts = {
        "source": str(source),
        "checkpoint": str(run.checkpoint),
        "step": run.step,
        "layout": run.model.layout.to_string(),
    }
    return lm, facts, run.run_dir or run.checkpoint.parent


_TRUNCATED = re.compile(
    r"Combined length of context \((\d+)\) and continuation \((\d+)\) exceeds model's maximum "
    r"length \((\d+)\)\. Truncating (\d+) tokens"
)


class _Truncations(logging.Handler):
    """Counts lm-eval's "Truncating N tokens from the left" warnings (one per request whose context and
    continuation exceed the model's length): what the evaluation cut, measured rather than scrolled past."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.requests, self.cut, self.length = 0, 0, 0
        self.max_length: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        m = _TRUNCATED.search(record.getMessage())
        if m:
            ctx, cont, max_len, cut = map(int, m.groups())
            self.requests += 1
            self.cut += cut
            self.length += ctx + cont
            self.max_length = max_len

    def summary(self) -> dict[str, Any] | None:
        if not self.requests:
            return None
        return {
            "requests": self.requests,
            "max_length": self.max_length,
            "mean_tokens_cut": self.cut / self.requests,
            "mean_request_tokens": self.length / self.requests,
        }


class _Captured:
    """What lm-eval and transformers wrote to stderr (fd 2: progress bars, notices, a git subprocess's
    complaint) while they ran quietly; kept as ``eval_log.txt`` beside the results."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the capture (read by text())

    def text(self) -> str:
        self.file.seek(0)
        return self.file.read().decode(errors="replace")


@contextlib.contextmanager
def _lm_eval_output(verbose: bool) -> Iterator[tuple[_Truncations, _Captured | None]]:
    """Quiet by default: everything lm-eval and transformers write to stderr goes to a capture (kept as
    eval_log.txt; its tail is shown if the evaluation fails); ``verbose`` lets it through. lm-eval's
    truncation warnings are counted either way."""
    counter = _Truncations()
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    saved_level = hf_log.level
    hf_log.addHandler(counter)
    hf_log.setLevel(logging.WARNING)
    captured, saved_fd = None, None
    redirect: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if not verbose:
        captured = _Captured()
        sys.stderr.flush()
        saved_fd = os.dup(2)
        os.dup2(captured.file.fileno(), 2)  # subprocesses and C code
        stream = open(captured.file.fileno(), "w", closefd=False, buffering=1, errors="replace")  # noqa: SIM115
        redirect = contextlib.redirect_stderr(stream)  # Python code, whatever sys.stderr is now (a test's capture)

    def restore() -> None:
        nonlocal saved_fd
        if saved_fd is not None:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            saved_fd = None

    bar = _one_bar(saved_fd) if saved_fd is not None else contextlib.nullcontext()
    try:
        with redirect, bar:
            yield counter, captured
    except BaseException:
        restore()
        if captured is not None:
            tail = captured.text().strip().splitlines()[-15:]
            if tail:
                print("lm-eval's log (last lines):\n  " + "\n  ".join(tail), file=sys.stderr)
        raise
    finally:
        restore()
        hf_log.removeHandler(counter)
        hf_log.setLevel(saved_level)


@contextlib.contextmanager
def _one_bar(fd: int) -> Iterator[None]:
    """While lm-eval's own bars are captured: one bar on the terminal (none in a log or pipe) counting
    the model's forward batches, the unit of its work."""
    if not os.isatty(fd):
        yield
        return
    from lm_eval.models.huggingface import HFLM
    from tqdm import tqdm

    stream = open(os.dup(fd), "w")  # noqa: SIM115 - closed below
    progress = tqdm(desc="lm-eval", unit=" batches", file=stream)
    call, generate = HFLM._model_call, HFLM._model_generate

    def counted(method):  # noqa: ANN001, ANN202 - wraps an HFLM method
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            progress.update(1)
            return method(self, *args, **kwargs)

        return wrapper

    HFLM._model_call, HFLM._model_generate = counted(call), counted(generate)
    try:
        yield
    finally:
        HFLM._model_call, HFLM._model_generate = call, generate
        progress.close()
        stream.close()


def describe_truncation(trunc: dict[str, Any] | None) -> str:
    if not trunc:
        return "no request was truncated"
    return (
        f"{trunc['requests']} requests were longer than the model's {trunc['max_length']} tokens and lost "
        f"{trunc['mean_tokens_cut']:.0f} of their {trunc['mean_request_tokens']:.0f} tokens on average, "
        "cut from the left of the context (lm-eval's rule); their scores rest on what was left"
    )


@dataclass(frozen=True)
class EvalOptions:
    """How `evaluate` scores: lm-eval's limit, batch size, device, few-shot count, the model's context
    (``max_length``), the seed, whether to keep every item (``samples``), whether an export's own code may run
    (``trust_remote_code``) and whether lm-eval's own output is shown (``verbose``)."""

    limit: float | None = None
    batch_size: int | str = 1
    device: str = "cpu"
    num_fewshot: int | None = None
    max_length: int | None = None
    seed: int = 1234
    samples: bool = False
    trust_remote_code: bool = False
    verbose: bool = False


def _entries(res: dict[str, Any], limit: float | None, common: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """eval.json's entry per task or group with metrics: its metrics and their standard errors (lm-eval's
    "metric,filter" keys), items scored, few-shot count, and ``common`` (the limit, versions, truncation, facts)."""
    entries = {}
    for name, values in {**res.get("results", {}), **res.get("groups", {})}.items():
        metrics, stderr = {}, {}
        for key, v in values.items():
            if key == "alias" or not isinstance(v, (int, float)) or "," not in key:
                continue
            metric, _filter = key.split(",", 1)
            if metric.endswith("_stderr"):
                stderr[metric.removesuffix("_stderr")] = float(v) if math.isfinite(float(v)) else None
            else:
                metrics[metric] = float(v)
        if not metrics:  # a group without aggregate metrics: its tasks carry the numbers
            continue
        entries[name] = {
            "metrics": metrics,
            "stderr": stderr,
            "n": res.get("n-samples", {}).get(name, {}).get("effective"),
            "num_fewshot": res.get("n-shot", {}).get(name),
            "limit": limit,
            **common,
        }
    return entries


def _checked_source(source: Path, kind: str, trust_remote_code: bool) -> bool:
    """Refuse a sweep and an unwritable folder before minutes of evaluation; judge an export's folder before
    lm-eval is imported, indexes its tasks or opens it. Whether its own code may run."""
    if kind == "sweep":
        raise EvalError(f"{source} is a sweep: use evaluate_sweep")
    check_writable(source if source.is_dir() else source.parent, "the eval.json of")
    if kind != "export":
        return False
    from normlab.hf.folder import check_folder

    trusted = remote_code(source, trust_remote_code)
    check_folder(source, trust_remote_code=trusted)  # bounded JSON, readable safetensors headers
    return trusted


def evaluate(source: str | Path, tasks: list[str], **options: Any) -> dict[str, Any]:
    """Evaluate one run, checkpoint or export on ``tasks`` with `EvalOptions` ``options``; write and return its
    ``eval.json`` entries (``{"tasks": {task: {...}}, "table": str, "path": Path}``). ``samples``: also write every
    request and response to ``eval_samples/TASK.jsonl`` (what the model generated, per item).
    ``trust_remote_code``: run an export's own model code even where normlab did not write it
    (`remote_code`)."""
    o = EvalOptions(**options)
    source = Path(source)
    kind = kind_of(source)
    trusted = _checked_source(source, kind, o.trust_remote_code)
    lm_eval = _lm_eval()
    from lm_eval.utils import make_table

    unknown = _unknown_ours(tasks) or [t for t in tasks if t not in _manager_for(tasks).all_tasks]
    if unknown:
        raise EvalError(
            f"unknown task(s) {', '.join(unknown)}: give lm-eval task or group names (`lm_eval ls tasks`), "
            f"or normlab's: {', '.join(GROUPS)}, {', '.join(LOCAL_TASKS)}"
        )
    with _lm_eval_output(o.verbose) as (truncations, captured):
        lm, facts, out_dir = _model_for(source, kind, o.device, o.batch_size, o.max_length, trusted)
        res = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=_manager_for(tasks),  # built once above (cached)
            limit=o.limit,
            num_fewshot=o.num_fewshot,
            log_samples=o.samples,
            random_seed=o.seed,
            numpy_random_seed=o.seed,
            torch_random_seed=o.seed,
            fewshot_random_seed=o.seed,
        )
    trunc = truncations.summary()
    target = RunDir(out_dir)
    if captured is not None:
        atomic_write_bytes(target.eval_log_file, captured.text().encode())
    common = {
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
        "evaluated_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "truncation": trunc,
        **facts,
    }
    entries = _entries(res, o.limit, common)
    for task, items in (res.get("samples") or {}).items():
        lines = "".join(json.dumps(item, default=str) + "\n" for item in items)
        atomic_write_bytes(target.eval_samples_file(task), lines.encode())
    merged = target.evals()
    merged.update(entries)
    target.write_evals(merged)
    items = ", ".join(f"{t} {e['n']}" for t, e in entries.items() if isinstance(e.get("n"), int))
    note = f"items scored: {items}" + (f" (--limit {o.limit:g})" if o.limit is not None else "")
    return {
        "tasks": entries,
        "table": make_table(res)
        + (make_table(res, "groups") if res.get("groups") else "")
        + f"{note}\ntruncation: {describe_truncation(trunc)}\n",
        "path": target.evals_file,
        "truncation": trunc,
    }


def evaluate_sweep(sweep: str | Path, tasks: list[str], **kwargs: Any) -> list[dict[str, Any]]:
    """Evaluate every run of a sweep that finished ok or stalled (diverged ones are excluded, Kim Table 1)."""
    from normlab.experiments.summary import load_sweep

    sweep = Path(sweep)
    df, _ = load_sweep(sweep)
    done = [r for r in df.itertuples() if r.status in TRAINED]
    if not done:
        raise EvalError(f"{sweep}: no run finished (ok or stalled) yet (statuses: {dict(df.status.value_counts())})")
    return [evaluate(SweepDir(sweep).run(r.run_id).path, tasks, **kwargs) for r in done]


def tasks_text() -> str:
    """`normlab eval --list`: normlab's tasks and the papers' task groups, with the include path."""
    lines = [f"normlab's lm-eval tasks (include path {TASKS_DIR}):", *(f"  {t}" for t in LOCAL_TASKS)]
    return "\n".join(lines + [f"  {g}: {', '.join(members)}" for g, members in GROUPS.items()])


def export_eval_line(out: Path, remote: bool) -> str:
    """How to score an export with lm-eval (normlab's task folder on its include path)."""
    import shlex

    model_args = f"pretrained={out}" + (",trust_remote_code=True" if remote else "")
    return (
        f"evaluate: lm_eval --model hf --model_args {shlex.quote(model_args)} --tasks normlab_local "
        f"--include_path {shlex.quote(str(TASKS_DIR))}  (or: normlab eval {shlex.quote(str(out))})"
    )


def eval_command(source: str | None, cfg: EvalConfig) -> str:
    """`normlab eval SOURCE`: a run directory, checkpoint or export folder, or every finished run of a sweep
    folder, scored on ``cfg.tasks``; each result's table and where its eval.json went."""
    if not source:
        raise ConfigError("normlab eval needs a run directory, checkpoint, export folder or sweep folder (or --list)")
    tasks, kw, path = list(cfg.tasks), cfg.options(), Path(source)
    if not cfg.verbose:
        print(
            f"evaluating {path} on {', '.join(tasks)} (lm-eval's own output goes to eval_log.txt beside the "
            "results; --verbose shows it)",
            flush=True,
        )
    results = evaluate_sweep(path, tasks, **kw) if kind_of(path) == "sweep" else [evaluate(path, tasks, **kw)]
    return "\n".join(f"{r['table']}\n-> {r['path']}" for r in results)
