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
    declared,
    model_settings,
    overrides,
    settings_keys,
    train_config,
    typed,
)
from normlab.errors import USER_ERRORS, without_unsafe_advice
from normlab.layout.presets import presets_table
from normlab.subcommands import (
    Command,
    add_command,
    data_extra,
    export_extra,
    screen_extra,
    sweep_extra,
    train_extra,
)

# --- the commands: each returns what it prints (exit status 0) or its exit status ----------------------


def _layouts(args: argparse.Namespace) -> str:
    """The presets, then the attention kinds a layout combines with (`model.attention`), unless only names."""
    from normlab.model.config import ATTENTION_KIND_FACTS

    table = presets_table(args.names, args.markdown)
    if args.names:
        return table
    rows = [(k, *facts) for k, facts in ATTENTION_KIND_FACTS.items()]
    if args.markdown:
        kinds = ["| attention | chosen by | equation | source |", "|---|---|---|---|"]
        return "\n".join([table, "", *kinds, *(f"| `{k}` | `{how}` | {eq} | {src} |" for k, how, eq, src in rows)])
    pad = max(len(k) for k, *_ in rows)  # the kinds' names in one column, as wide as the longest
    kinds = [f"{k:<{pad}}  {how}\n{'':{pad + 2}}{eq}\n{'':{pad + 2}}{src}" for k, how, eq, src in rows]
    return table + "\n\nattention kinds (any layout above, with --set model.attention=KIND):\n\n" + "\n".join(kinds)


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
    from normlab.train.train_command import train_command, user_hooks

    return train_command(train_config(args), settings_keys(args), user_hooks(args.hook, args.config))


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


_COMMANDS = (
    Command("layouts"),
    Command(
        "show",
        run=("size",),
        shortcuts=("layers",),
        set_help="a model or layout setting as train takes it: model.n_layers=12, model.mlp=relu, layout.h=0.5",
    ),
    Command("demo", c.DemoConfig),
    Command("train", extra=train_extra),
    Command("plan", extra=add_run_settings),
    Command("screen", c.ScreenConfig, extra=screen_extra),
    Command("report"),
    Command(
        "compare",
        c.CompareConfig,
        run=("size", "steps"),
        preset=c.COMPARE_BASE,
        set_help="any training setting, e.g. --set lr=1e-3",
    ),
    Command("sweep", set_help="a base setting (repeatable; model.NAME for model options)", extra=sweep_extra),
    Command(
        "coordcheck",
        c.CoordCheckConfig,
        run=("size", "lr", "optimizer"),
        preset=c.COORDCHECK_BASE,
        set_help="a run setting, e.g. --set model.parametrization=mup (repeatable)",
    ),
    Command("summarize"),
    Command("transfer"),
    Command("leadtime"),
    Command("recipes"),
    Command(
        "recommend",
        c.RecommendConfig,
        run=("steps",),
        preset=c.RECOMMEND_BASE,
        set_help="a proxy run setting, e.g. --set data=PATH (repeatable)",
    ),
    Command("scan", c.ScanConfig),
    Command("doctor", c.DoctorConfig),
    Command("convert", c.ConvertConfig),
    Command("export", extra=export_extra),
    Command("eval", c.EvalConfig),
    Command("data", c.PrepareConfig, extra=data_extra),
)


def build_parser() -> argparse.ArgumentParser:
    """Every command of `_COMMANDS`, in order, under the global --version and --debug."""
    import normlab
    from normlab.settings import Parser

    p = Parser(
        prog="normlab", description="Normalization placement in Transformer LMs: build, compare and inspect layouts."
    )
    p.add_argument("--version", action="version", version=f"normlab {normlab.__version__}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)
    for cmd in _COMMANDS:
        add_command(sub, cmd)
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
            # the command's handler, `_<command>`, looked up when called (one replaced on the module is the one run)
            said = getattr(sys.modules[__name__], f"_{args.command.replace('-', '_')}")(args)
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
