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


def leadtime_command(
    sweeps: list[str],
    json_out: str | None,
    record: str | None = None,
    figure: str | None = None,
    horizon: int = 500,
) -> None:
    """`normlab leadtime`: the early warnings' lead times and false alarms over ``sweeps``
    (normlab.experiments.leadtime) and the threshold study (normlab.experiments.leadtime_study); ``json_out``:
    also as JSON; ``record``: the measured record alerts quote; ``figure``: its PR curves and lead times."""
    from normlab.experiments import leadtime, leadtime_study

    check_sweep_folders(sweeps, "folders written by normlab sweep (e.g. the warn-* recipes')", lost_ok=True)
    if not isinstance(horizon, int) or horizon < 1:
        raise ConfigError(f"--horizon {horizon}: give a whole number of steps >= 1")
    for flag, path, suffix, mine in (
        ("--json", json_out, ".json", leadtime.wrote),
        ("--record", record, ".json", leadtime_study.wrote_record),
        ("--figure", figure, ".png", lambda p: False),
    ):
        if path:
            if not path.endswith(suffix):
                raise ConfigError(f"{flag} {path}: give a {suffix} file")
            check_new_file(path, flag, update=mine(path))  # its own file: the same answer again
    print(leadtime.report(sweeps, json_out), flush=True)
    runs = [r for s in sweeps for r in leadtime_study.gather(s)]
    print(leadtime_study.markdown(runs, horizon), flush=True)
    if record:
        leadtime_study.write_record(leadtime_study.record(runs, horizon, sweeps), record)
    if figure:
        leadtime_study.figure(runs, horizon, figure)


def check_new_file(path: str, flag: str, update: bool = False) -> None:
    """Refuse, in one line before any work, an output file normlab may not write: a symbolic link (its target
    is someone's), one in a folder that does not exist (no command makes folders for a file) or that is
    read-only, and an existing file unless ``update`` (a file the command itself reads and rewrites)."""
    from pathlib import Path

    from normlab.io import writable

    p = Path(path)
    if p.is_symlink():
        raise ConfigError(f"{flag} {path} is a symbolic link; name a new file (normlab does not write through links)")
    if p.exists() and not update:
        raise ConfigError(f"{flag} {path} exists; name a new file (normlab does not overwrite a file it did not make)")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag} {path} is not a file; name a new .json file")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {parent} does not exist; make it first, or name a file in one")
    if not writable(parent):
        raise ConfigError(f"{flag} {path}: the folder {parent} is read-only; name a file in a writable folder")


def transfer_command(proxy: str, others: list[str], lrs: str, record: str | None) -> None:
    """`normlab transfer`: print the proxy sweep's ranking against each of ``others``
    (normlab.experiments.transfer); ``record``: a transfer record (.json) to write or update, said after."""
    from normlab.experiments import transfer

    check_sweep_folders([proxy, *others], "folders written by normlab sweep (layout x lr x seed)")
    if record:
        if not record.endswith(".json"):
            raise ConfigError(f"--record {record}: give a .json file (a transfer record, new or to update)")
        check_new_file(record, "--record", update=True)  # an existing record is updated (transfer.record checks it)
    print(transfer.report(proxy, others, lrs=lrs), flush=True)
    if record:
        print(f"record: {record} ({transfer.record(record, proxy, others, lrs=lrs)['status']})")
