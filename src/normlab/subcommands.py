"""The subcommands of `normlab` as data (normlab.cli's table): each a `Command` naming its handler, its
configuration, the run settings it takes and its preset, and `add_command` building its argparse parser. The
extras are what a command adds beyond its declarations (screen's --stress, sweep's sweep settings, export's
--arch, data's action and source)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from normlab.config.overrides import add_run_settings, add_set, add_shortcuts


@dataclass(frozen=True)
class Command:
    """One subcommand as data: its name (its handler is normlab.cli's `_<name>`), its configuration (flags
    generated from the declarations), the run settings it takes with its preset's defaults, its shortcuts, its
    --set help, and what else it adds."""

    name: str  # its handler is normlab.cli's `_<name>`
    config: type | None = None
    run: tuple[str, ...] = ()
    preset: dict[str, Any] | None = None
    shortcuts: tuple[str, ...] = ()
    set_help: str | None = None
    extra: Callable[[argparse.ArgumentParser], None] | None = None


def train_extra(s: argparse.ArgumentParser) -> None:
    add_run_settings(s, hooks=True)  # and --hook module:Class


def screen_extra(s: argparse.ArgumentParser) -> None:
    s.add_argument("--stress", dest="stresses", default=argparse.SUPPRESS, metavar="S1,S2,...", help="= --stresses")
    add_shortcuts(s, ("layers", "width", "heads"))
    add_set(s, "any model option (repeatable)", metavar="model.NAME=VALUE")


def sweep_extra(s: argparse.ArgumentParser) -> None:
    from normlab.experiments.sweep import SweepConfig
    from normlab.settings import add_flags, leaves

    add_flags(s, leaves(SweepConfig))  # --name, --workers, --executor, ...: over the file's or recipe's


def export_extra(s: argparse.ArgumentParser) -> None:
    from normlab.hf.archs import EXPORTABLE

    s.add_argument(
        "--arch",
        default="auto",
        choices=["auto", "normlab", *EXPORTABLE],
        help=f"auto (default: transformers' own class where exact, else normlab), normlab (any layout), or "
        f"transformers' own class for the layout it computes: "
        f"{', '.join(f'{a} ({p})' for a, p in EXPORTABLE.items())}",
    )


def data_extra(s: argparse.ArgumentParser) -> None:
    from normlab.data.corpora import CORPORA

    s.description = (
        "fetch [NAME]: download, verify and cache a named corpus ("
        + "; ".join(f"{x.name}: {x.what}" for x in CORPORA.values())
        + "; docs/training.md). prepare: tokenize a "
        "text file, folder, .jsonl or local datasets folder (save_to_disk) into OUT/{train,val}.bin + "
        "tokenizer.json + meta.json, end-of-text between documents, the last --val-fraction of the documents "
        "held out; train on it with --data OUT."
    )
    s.add_argument("action", choices=["fetch", "prepare"])
    s.add_argument(
        "source",
        nargs="?",
        help=f"fetch: a corpus name ({', '.join(CORPORA)}; default shakespeare); "
        "prepare: text file, folder, .jsonl, datasets folder or a corpus name",
    )


def add_command(sub: Any, cmd: Command) -> None:
    """One subcommand's parser: its help (normlab.config.help), its flags, shortcuts, --set, extras and inputs
    (plan's and screen's inputs come after their extras)."""
    from normlab.config.help import HELP, INPUTS
    from normlab.config.train import LEAVES
    from normlab.settings import add_flags, leaves

    help_, about = HELP.get(cmd.name, (None, None))
    s = sub.add_parser(cmd.name, help=help_, description=about)
    if cmd.config is not None:
        add_flags(s, leaves(cmd.config))
    add_flags(s, {k: LEAVES[k] for k in cmd.run}, defaults=cmd.preset)
    add_shortcuts(s, cmd.shortcuts)
    if cmd.set_help:
        add_set(s, cmd.set_help)
    late = cmd.name in ("plan", "screen")
    for flags, options in () if late else INPUTS.get(cmd.name, ()):
        s.add_argument(*flags, **options)
    if cmd.extra is not None:
        cmd.extra(s)
    for flags, options in INPUTS.get(cmd.name, ()) if late else ():
        s.add_argument(*flags, **options)
