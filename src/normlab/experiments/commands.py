"""`normlab sweep`, `summarize` and `transfer` as calls: a sweep from its file, recipe or grid with the command
line's overrides (built by normlab.config.overrides), run and summarized; the summary of a sweep folder; a
proxy sweep's ranking against wider or longer sweeps. Each refuses a folder that no sweep wrote before reading
it."""

from __future__ import annotations

from normlab.config.overrides import grid_values, typed
from normlab.errors import ConfigError
from normlab.experiments.recipes import load_recipe
from normlab.experiments.sweep import SweepConfig
from normlab.runs.files import STORE, SweepDir


def sweep_command(
    file: str | None,
    recipe: str | None,
    grid: list[str] | None,
    out: str | None,
    settings: dict[str, str],
    base: dict[str, str],
    cancel: str | None = None,
) -> int:
    """Run the sweep of a TOML ``file``, a ``recipe`` or ``grid`` axes alone (--grid AXIS=V1,V2, added or
    replaced), with its declared ``settings`` replaced and ``base`` settings added (all text, as given); print
    its summary. ``out`` defaults to runs/sweeps/NAME. ``cancel``: cancel the scheduler jobs of the sweep in
    that folder instead. Returns the exit status: 1 when a run failed."""
    from normlab.experiments.runner import run_sweep

    if cancel:
        from normlab.experiments.cluster import cancel_sweep

        cancel_sweep(cancel)
        return 0
    if file and recipe:
        raise ConfigError("give a sweep file or --recipe, not both")
    if not (file or recipe or grid):
        raise ConfigError("give a sweep file, --recipe NAME (see `normlab recipes`) or --grid AXIS=VALUES")
    sweep = SweepConfig.from_toml(file) if file else load_recipe(recipe) if recipe else SweepConfig()
    sweep = sweep.with_(settings, base=typed(base, "--set"), grid=grid_values(grid), from_text=True)
    folder = out or f"runs/sweeps/{sweep.name}"
    counts = run_sweep(sweep, folder, workers=sweep.workers, executor=sweep.executor)
    print(summary_text(folder))
    return 0 if not counts["failed"] else 1


def summarize_command(folder: str, out: str | None = None) -> str:
    """`normlab summarize`: `summary_text` of a folder a sweep or compare wrote (refused before any reading
    otherwise; one whose store was lost is rebuilt from its sweep file and run folders)."""
    check_sweep_folders([folder], "a folder written by normlab sweep or compare", lost_ok=True)
    return summary_text(folder, out)


def summary_text(folder: str, out: str | None = None) -> str:
    """A sweep folder's summary (written to ``out``, default the folder): its cell table in Markdown and where
    the files are."""
    from normlab.experiments.summary import summarize

    result = summarize(folder, out)
    return f"{result['markdown'].read_text()}\nsummary: {result['markdown']}\nreport: {result['html']}"


def check_sweep_folders(paths: list[str], what: str, lost_ok: bool = False) -> None:
    """Refuse a folder that holds no sweep store (``lost_ok``: one whose store was lost but whose sweep file
    remains, as summarize rebuilds it from the sweep file and the run folders); ``what``: what to give."""
    for path in paths:
        if not (SweepDir(path).is_sweep() or (lost_ok and SweepDir(path).sweep_file.is_file())):
            raise ConfigError(f"{path} holds no {STORE}; give {what}")


def leadtime_command(sweeps: list[str], json_out: str | None) -> None:
    """`normlab leadtime`: the early warnings' lead times and false alarms over ``sweeps``
    (normlab.experiments.leadtime); ``json_out``: also as JSON."""
    from normlab.experiments import leadtime

    check_sweep_folders(sweeps, "folders written by normlab sweep (e.g. the warn-* recipes')")
    if json_out and not json_out.endswith(".json"):
        raise ConfigError(f"--json {json_out}: give a .json file")
    print(leadtime.report(sweeps, json_out), flush=True)


def transfer_command(proxy: str, others: list[str], lrs: str, record: str | None) -> None:
    """`normlab transfer`: print the proxy sweep's ranking against each of ``others``
    (normlab.experiments.transfer); ``record``: a transfer record (.json) to write or update, said after."""
    from normlab.experiments import transfer

    check_sweep_folders([proxy, *others], "folders written by normlab sweep (layout x lr x seed)")
    if record and not record.endswith(".json"):
        raise ConfigError(f"--record {record}: give a .json file (a transfer record, new or to update)")
    print(transfer.report(proxy, others, lrs=lrs), flush=True)
    if record:
        print(f"record: {record} ({transfer.record(record, proxy, others, lrs=lrs)['status']})")
