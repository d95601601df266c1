"""The `normlab` command line: the parser and a thin dispatch. Each command is its configuration (declared in
normlab.config, its flags generated from the declarations; its defaults a preset) plus one override list (a
file, flags, --set: normlab.config.overrides), and one call into the layer that does the work, which returns
what the command prints. Its help texts are normlab.config.help.

    normlab layouts | show | demo | train | plan | screen | report | compare | sweep | summarize | transfer | leadtime |
            recipes | recommend | scan | doctor | convert | export | eval | data
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from normlab.config import commands as c
from normlab.config.overrides import (
    add_run_settings,
    add_set,
    add_shortcuts,
    declared,
    model_settings,
    overrides,
    settings_keys,
    train_config,
    typed,
)
from normlab.errors import USER_ERRORS, without_unsafe_advice
from normlab.layout.presets import presets_table

# --- the commands: each returns what it prints (exit status 0) or its exit status ----------------------


def _layouts(args: argparse.Namespace) -> str:
    return presets_table(args.names, args.markdown)


def _show(args: argparse.Namespace) -> str:
    from normlab.model.describe import describe

    model = model_settings(args, "command line", shape_of="show", layout=args.layout)
    return describe(model.layout, model.size, **model.options)  # no model built, no torch: instant


def _demo(args: argparse.Namespace) -> int:
    from normlab.demo import run_demo

    cfg = declared(c.DemoConfig, args, "demo")
    run_demo(list(cfg.layouts), size=cfg.size, seed=cfg.seed)
    return 0


def _train(args: argparse.Namespace) -> int:
    from normlab.train.train_command import train_command

    return train_command(train_config(args), settings_keys(args))


def _plan(args: argparse.Namespace) -> str:
    from normlab.train.memory import plan_text

    return plan_text(train_config(args), args.world, args.gpu_memory)


def _screen(args: argparse.Namespace) -> str:
    from normlab.screen.screen import screen_command

    model = model_settings(args, "screen")  # the model's shape as train takes it: same keys, same checks
    cfg = declared(c.ScreenConfig, args, "screen", skip=("size",), size=model.size, model=dict(model.options))
    return screen_command(args.layouts, cfg, args.json, args.verbose)


def _report(args: argparse.Namespace) -> str:
    from normlab.diagnostics.run_report import report_runs

    return f"report: {report_runs(args.runs, args.out)}"


def _sweep(args: argparse.Namespace) -> int:
    from normlab.experiments.commands import sweep_command
    from normlab.experiments.sweep import SweepConfig
    from normlab.settings import given, leaves

    settings = given(args, leaves(SweepConfig))
    return sweep_command(args.file, args.recipe, args.grid, args.out, settings, overrides(args), args.cancel)


def _summarize(args: argparse.Namespace) -> str:
    from normlab.experiments.commands import summarize_command

    return summarize_command(args.sweep, args.out)


def _leadtime(args: argparse.Namespace) -> int:
    from normlab.experiments.commands import leadtime_command

    leadtime_command(args.sweeps, args.json, args.record, args.figure, args.horizon)
    return 0


def _transfer(args: argparse.Namespace) -> int:
    from normlab.experiments.commands import transfer_command

    transfer_command(args.proxy, args.others, args.lrs, args.record)
    return 0


def _compare(args: argparse.Namespace) -> str:
    from normlab.experiments.comparison import compare_command

    cfg = declared(c.CompareConfig, args, "compare")
    return compare_command(cfg, typed(overrides(args, "size", "steps"), "compare"))


def _coordcheck(args: argparse.Namespace) -> str:
    from normlab.experiments.coordcheck import coordcheck_command

    cfg = declared(c.CoordCheckConfig, args, "coordcheck")
    return coordcheck_command(args.layout, cfg, typed(overrides(args, "size", "lr", "optimizer"), "coordcheck"))


def _recommend(args: argparse.Namespace) -> int:
    import time

    started = time.time()  # the budget counts from here
    from normlab.recommend.cli_command import recommend_command

    recommend_command(args.model, declared(c.RecommendConfig, args, "recommend"), overrides(args, "steps"), started)
    return 0


def _recipes(args: argparse.Namespace) -> str:
    from normlab.experiments.recipes import recipes_text

    return recipes_text(args.machine, args.names)


def _doctor(args: argparse.Namespace) -> str:
    from normlab.doctor.checkup import doctor

    return doctor(args.model, declared(c.DoctorConfig, args, "doctor"), args.json)


def _convert(args: argparse.Namespace) -> str:
    from normlab.runs.convert import convert_command

    return convert_command(args.source, declared(c.ConvertConfig, args, "convert"))


def _scan(args: argparse.Namespace) -> str:
    from normlab.hf.scan import scan_command

    result = scan_command(args.model, declared(c.ScanConfig, args, "scan"))
    return f"{result['table']}\nreport: {result['html']}"


def _export(args: argparse.Namespace) -> str:
    from normlab.evaluation.harness import export_eval_line
    from normlab.hf.export import export_run

    lines, out, remote = export_run(args.source, args.out, args.arch)
    return "\n".join([*lines, export_eval_line(out, remote)])


def _eval(args: argparse.Namespace) -> str:
    from normlab.evaluation.harness import TASKS_DIR, eval_command, tasks_text

    if args.tasks_dir or args.list:
        return str(TASKS_DIR) if args.tasks_dir else tasks_text()
    return eval_command(args.source, declared(c.EvalConfig, args, "eval"))


def _data(args: argparse.Namespace) -> str:
    from normlab.data.corpora import data_command

    return data_command(args.action, args.source, declared(c.PrepareConfig, args, "data prepare"))


# --- the parser -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Every command: its help (normlab.config.help), its configuration's flags (generated from the
    declarations, with the command's preset as defaults), the override flags, its positional inputs."""
    import normlab
    from normlab.config.help import HELP, INPUTS
    from normlab.config.train import LEAVES
    from normlab.data.corpora import CORPORA
    from normlab.experiments.sweep import SweepConfig
    from normlab.hf.archs import EXPORTABLE
    from normlab.settings import Parser, add_flags, leaves

    p = Parser(
        prog="normlab", description="Normalization placement in Transformer LMs: build, compare and inspect layouts."
    )
    p.add_argument("--version", action="version", version=f"normlab {normlab.__version__}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)

    def command(
        name: str,
        func: Any,
        config: type | None = None,
        run: tuple[str, ...] = (),
        preset: dict[str, Any] | None = None,
        shortcuts: tuple[str, ...] = (),
        set_help: str | None = None,
        description: str | None = None,
    ) -> argparse.ArgumentParser:
        help_, about = HELP.get(name, (None, None))
        s = sub.add_parser(name, help=help_, description=description or about)
        s.set_defaults(func=func)
        if config is not None:
            add_flags(s, leaves(config))
        add_flags(s, {k: LEAVES[k] for k in run}, defaults=preset)
        add_shortcuts(s, shortcuts)
        if set_help:
            add_set(s, set_help)
        if name not in ("plan", "screen"):
            inputs(s, name)
        return s

    def inputs(s: argparse.ArgumentParser, name: str) -> None:
        for flags, options in INPUTS.get(name, ()):
            s.add_argument(*flags, **options)

    command("layouts", _layouts)
    command(
        "show",
        _show,
        run=("size",),
        shortcuts=("layers",),
        set_help="a model or layout setting as train takes it: model.n_layers=12, model.mlp=relu, layout.h=0.5",
    )
    command("demo", _demo, c.DemoConfig)
    add_run_settings(command("train", _train))
    s = command("plan", _plan)
    add_run_settings(s)
    inputs(s, "plan")
    s = command("screen", _screen, c.ScreenConfig)
    s.add_argument("--stress", dest="stresses", default=argparse.SUPPRESS, metavar="S1,S2,...", help="= --stresses")
    add_shortcuts(s, ("layers", "width", "heads"))
    add_set(s, "any model option (repeatable)", metavar="model.NAME=VALUE")
    inputs(s, "screen")
    command("report", _report)
    command(
        "compare",
        _compare,
        c.CompareConfig,
        run=("size", "steps"),
        preset=c.COMPARE_BASE,
        set_help="any training setting, e.g. --set lr=1e-3",
    )
    s = command("sweep", _sweep, set_help="a base setting (repeatable; model.NAME for model options)")
    add_flags(s, leaves(SweepConfig))  # --name, --workers, --executor, ...: over the file's or recipe's
    command(
        "coordcheck",
        _coordcheck,
        c.CoordCheckConfig,
        run=("size", "lr", "optimizer"),
        preset=c.COORDCHECK_BASE,
        set_help="a run setting, e.g. --set model.parametrization=mup (repeatable)",
    )
    command("summarize", _summarize)
    command("transfer", _transfer)
    command("leadtime", _leadtime)
    command("recipes", _recipes)
    command(
        "recommend",
        _recommend,
        c.RecommendConfig,
        run=("steps",),
        preset=c.RECOMMEND_BASE,
        set_help="a proxy run setting, e.g. --set data=PATH (repeatable)",
    )
    command("scan", _scan, c.ScanConfig)
    command("doctor", _doctor, c.DoctorConfig)
    command("convert", _convert, c.ConvertConfig)
    s = command("export", _export)
    s.add_argument(
        "--arch",
        default="auto",
        choices=["auto", "normlab", *EXPORTABLE],
        help=f"auto (default: transformers' own class where exact, else normlab), normlab (any layout), or "
        f"transformers' own class for the layout it computes: "
        f"{', '.join(f'{a} ({p})' for a, p in EXPORTABLE.items())}",
    )
    command("eval", _eval, c.EvalConfig)
    s = command(
        "data",
        _data,
        c.PrepareConfig,
        description="fetch [NAME]: download, verify and cache a named corpus ("
        + "; ".join(f"{x.name}: {x.what}" for x in CORPORA.values())
        + "; docs/training.md). prepare: tokenize a "
        "text file, folder, .jsonl or local datasets folder (save_to_disk) into OUT/{train,val}.bin + "
        "tokenizer.json + meta.json, end-of-text between documents, the last --val-fraction of the documents "
        "held out; train on it with --data OUT.",
    )
    s.add_argument("action", choices=["fetch", "prepare"])
    s.add_argument(
        "source",
        nargs="?",
        help=f"fetch: a corpus name ({', '.join(CORPORA)}; default shakespeare); "
        "prepare: text file, folder, .jsonl, datasets folder or a corpus name",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input ends with one line on stderr that names the problem and what is
    valid, exit status 2 (so does storage that refuses a write: a read-only mount, a full disk); an
    unexpected error with one line and exit status 1; `--debug` (or NORMLAB_DEBUG=1) shows the
    traceback instead. Python warnings raised while the command runs (transformers', torch's) are held
    (`_held_warnings`): shown once each after a command that ends normally (or is interrupted), dropped from
    an error's one line (`--debug` shows them)."""
    import os

    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("NORMLAB_DEBUG", "") not in ("", "0")
    held: list[Any] = []
    try:
        with _held_warnings(held):
            said = args.func(args)
        _show_warnings(held)
        if isinstance(said, str):
            print(said)
        return 0 if isinstance(said, str) else said
    except USER_ERRORS as err:
        if debug:
            _show_warnings(held)
            raise
        print(f"normlab: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `normlab layouts | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        _show_warnings(held)  # not a refusal: a long run stopped by hand, whose warnings may still matter
        if debug:
            raise
        print("normlab: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            _show_warnings(held)
            raise
        from normlab.io import storage_refusal

        refusal = storage_refusal(err) if isinstance(err, OSError) else None
        if refusal is not None:  # the user's storage, not a defect: one line, exit 2
            print(f"normlab: error: {_one_line(refusal)}", file=sys.stderr)
            return 2
        print(
            f"normlab: error: {type(err).__name__}: {_one_line(err)} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


HELD_WARNINGS = 100  # the most a command holds: a warning whose text changes every step must not fill memory


@contextlib.contextmanager
def _held_warnings(held: list[Any]) -> Iterator[None]:
    """Hold the Python warnings raised inside the block in ``held`` (the filters decide which, as always: -W,
    PYTHONWARNINGS, each place's first only), one per message and place, instead of printing them as they
    come: a library's deprecation notice must not turn a refusal's one line into three. A command that ends
    normally shows them afterwards (`_show_warnings`), so nothing useful is lost; the cost is that they come
    at its end, not as they were raised."""
    import warnings

    seen: set[tuple[Any, ...]] = set()

    def hold(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        key = (category, str(message), filename, lineno)
        if key not in seen and len(held) < HELD_WARNINGS:
            seen.add(key)
            held.append((message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.showwarning = hold
        yield


def _show_warnings(held: list[Any]) -> None:
    import warnings

    for message, category, filename, lineno, line in held:
        warnings.showwarning(message, category, filename, lineno, None, line)
    held.clear()


def _one_line(err: BaseException | str) -> str:
    text = without_unsafe_advice(" ".join(str(err).split()))
    return text if len(text) <= 2000 else text[:2000] + " ..."


if __name__ == "__main__":
    raise SystemExit(main())
