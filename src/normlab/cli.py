"""The `normlab` command line: each command is its configuration (declared in normlab.config, its flags
generated from the declarations; its defaults a preset) plus one list of overrides (a file, flags,
--set), and a call into the layer that does the work. Its help texts are normlab.config.help.

    normlab layouts | show | demo | train | plan | screen | report | compare | sweep | summarize | transfer |
            recipes | recommend | scan | doctor | convert | export | eval | data
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from normlab.errors import USER_ERRORS, ConfigError, without_unsafe_advice
from normlab.layout import PRESETS
from normlab.settings import given as settings_given

# Flags that stand for a model option (the model's shape), for the commands that take one.
MODEL_SHORTCUTS = {
    "layers": ("model.n_layers", "number of layers (depth)"),
    "width": ("model.d_model", "d_model, the width of the residual stream"),
    "heads": ("model.n_heads", "attention heads, must divide the width"),
}


# --- the override list: flags, --set, --model, --config ----------------------------------------------


def _pairs(items: list[str] | None, flag: str, example: str) -> dict[str, str]:
    """KEY=VALUE arguments as a dict of strings (parsed later by each setting's type)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{flag} takes KEY=VALUE (e.g. {flag} {example}), got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _typed(settings: dict[str, Any], source: str) -> dict[str, Any]:
    from normlab.config.train import typed_settings

    return typed_settings(settings, source, from_text=True)


def _shortcuts(args: argparse.Namespace) -> dict[str, str]:
    return {MODEL_SHORTCUTS[k][0]: v for k, v in vars(args).items() if k in MODEL_SHORTCUTS}


def _overrides(args: argparse.Namespace, *flags: str) -> dict[str, str]:
    """The run settings a command was given: its run-setting flags, the model shortcuts, --model and --set."""
    given = {**settings_given(args, flags), **_shortcuts(args)}
    given.update(
        {f"model.{k}": v for k, v in _pairs(getattr(args, "model_options", None), "--model", "n_layers=8").items()}
    )
    return {**given, **_pairs(getattr(args, "set", None), "--set", "steps=500")}


def _declared(cls: type, args: argparse.Namespace, source: str, skip: tuple[str, ...] = (), **fixed: object) -> Any:
    """The command's configuration from the flags it was given (text, parsed by each setting's type);
    ``skip``: declared settings the command decides itself (passed in ``fixed``)."""
    from normlab.settings import build, given, leaves

    values = {k: v for k, v in given(args, leaves(cls)).items() if k not in skip}
    return build(cls, values, source, from_text=True, as_flags=True, **fixed)


def default_out(*parts: str) -> str:
    """An output folder named after what the command makes (train: runs/LAYOUT-SIZE; convert:
    runs/SOURCE-LAYOUT), for a command given no --out: every command that writes has a default, printed."""
    import re

    return "runs/" + "-".join(re.sub(r"[^A-Za-z0-9._+-]+", "_", p).strip("_") or "run" for p in parts)


def _settings_keys(args: argparse.Namespace) -> set[str]:
    """The names of the run settings the user gave (flags, --set, --model, the --config file), e.g. {"lr", "out"}."""
    from normlab.config.train import LEAVES, flatten_settings, resolve_key
    from normlab.io import read_toml

    keys = list(_overrides(args, *LEAVES))
    if getattr(args, "config", None):
        keys += list(flatten_settings(read_toml(args.config, "config file"), args.config))
    return {resolve_key(k)[1] if resolve_key(k)[0] == "leaf" else k for k in keys}


def train_config_from_args(args: argparse.Namespace) -> Any:
    """Defaults, then --config FILE (typed TOML), then flags and --set (text): one override function."""
    from normlab.config.train import LEAVES, TrainConfig

    cfg = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    given = _overrides(args, *LEAVES)
    return cfg.with_(given, "command line", from_text=True) if given else cfg


def _grid_args(items: list[str] | None) -> dict[str, list[Any]]:
    """--grid AXIS=V1,V2 (or V1;V2 when a value has commas, as layout strings may), typed per axis."""
    grid = {}
    for item in items or []:
        axis, eq, values = (x.strip() for x in item.partition("="))
        if not eq or not values or not axis:
            raise ConfigError(f"--grid takes AXIS=V1,V2,... (e.g. --grid lr=1e-3,3e-3), got {item!r}")
        texts = [v.strip() for v in values.split(";" if ";" in values else ",") if v.strip()]
        grid[axis] = [_typed({axis: v}, f"--grid {axis}")[axis] for v in texts]
    return grid


# --- the commands -----------------------------------------------------------------------------------


def _layouts(args: argparse.Namespace) -> int:
    rows = [(p.name, p.layout.to_string(), p.equation, p.source) for p in PRESETS.values()]
    if args.names:
        print("\n".join(r[0] for r in rows))
    elif args.markdown:
        print("| preset | string form | equation | source |\n|---|---|---|---|")
        print("\n".join(f"| `{name}` | `{form}` | {eq} | {src} |" for name, form, eq, src in rows))
    else:
        heads = ("preset", "string form", "equation", "source")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads[:3])]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
        print("\n".join(fmt.format(*r) for r in [heads, *rows]))
    return 0


def _show(args: argparse.Namespace) -> int:
    from normlab.config.train import TrainConfig
    from normlab.layout import parse_layout
    from normlab.model.describe import describe

    parse_layout(args.layout)  # a bad layout is named in the layout grammar's own words
    pairs = _overrides(args)
    other = [k for k in pairs if not k.startswith(("model.", "layout."))]
    if other:
        raise ConfigError(
            f"show takes model.* and layout.* settings (the model's shape and placement), not {', '.join(other)}"
        )
    given = {"layout": args.layout, **settings_given(args, ("size",)), **pairs}
    cfg = TrainConfig().with_(given, "command line", from_text=True)  # the keys train takes (layout.h, model.*)
    print(describe(cfg.model.layout, cfg.model.size, **cfg.model.options))  # no model built, no torch: instant
    return 0


def _demo(args: argparse.Namespace) -> int:
    from normlab.config.commands import DemoConfig
    from normlab.demo import run_demo

    cfg = _declared(DemoConfig, args, "demo")
    run_demo(list(cfg.layouts), size=cfg.size, seed=cfg.seed)
    return 0


def _train(args: argparse.Namespace) -> int:
    from normlab.runs.outcome import describe
    from normlab.runs.start import recorded_shape
    from normlab.train import TrainingFailed, train

    cfg = train_config_from_args(args)
    given = _settings_keys(args)
    if cfg.model.init_from:
        cfg = recorded_shape(cfg, given)
    if "out" not in given:
        cfg = cfg.with_({"out": default_out(cfg.model.layout_label, cfg.model.size)}, "command line")
        print(f"normlab train: no --out given: the run goes to {cfg.run.out}", flush=True)
    try:
        summary = train(cfg)
    except TrainingFailed as err:
        print(f"normlab: {err}", file=sys.stderr)
        return 1
    if summary:
        print(f"{cfg.run.out}: {describe(summary)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from normlab.train.memory import plan_text

    print(plan_text(train_config_from_args(args), args.world, args.gpu_memory))
    return 0


def _screen(args: argparse.Namespace) -> int:
    from normlab.config.commands import ScreenConfig
    from normlab.config.train import TrainConfig
    from normlab.screen.screen import screen_command

    # the model's shape through the run configuration's one override function: same keys, same checks
    model = TrainConfig().with_(_overrides(args, "size"), "screen", from_text=True).model
    cfg = _declared(ScreenConfig, args, "screen", skip=("size",), size=model.size, model=dict(model.options))
    print(screen_command(args.layouts, cfg, args.json, args.verbose))
    return 0


def _report(args: argparse.Namespace) -> int:
    from normlab.diagnostics.report import report_runs

    print(f"report: {report_runs(args.runs, args.out)}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from normlab.experiments import SweepConfig, load_recipe, run_sweep
    from normlab.settings import given, leaves

    if args.cancel:
        from normlab.experiments.cluster import cancel_sweep

        cancel_sweep(args.cancel)
        return 0
    if args.file and args.recipe:
        raise ConfigError("give a sweep file or --recipe, not both")
    if not (args.file or args.recipe or args.grid):
        raise ConfigError("give a sweep file, --recipe NAME (see `normlab recipes`) or --grid AXIS=VALUES")
    sweep = (
        SweepConfig.from_toml(args.file) if args.file else load_recipe(args.recipe) if args.recipe else SweepConfig()
    )
    sweep = sweep.with_(
        given(args, leaves(SweepConfig)),
        base=_typed(_overrides(args), "--set"),
        grid=_grid_args(args.grid),
        from_text=True,
    )
    out = args.out or f"runs/sweeps/{sweep.name}"
    counts = run_sweep(sweep, out, workers=sweep.workers, executor=sweep.executor)
    _summarize_into(out)
    return 0 if not counts["failed"] else 1


def _summarize_into(folder: str, out: str | None = None) -> None:
    from normlab.experiments import summarize

    result = summarize(folder, out)
    print(result["markdown"].read_text())
    print(f"summary: {result['markdown']}\nreport: {result['html']}")


def _sweep_folders(paths: list[str], what: str, lost_ok: bool = False) -> None:
    from normlab.runs.files import STORE, SweepDir

    for path in paths:  # (summarize: a lost store is rebuilt from the sweep file and the run folders)
        if not (SweepDir(path).is_sweep() or (lost_ok and SweepDir(path).sweep_file.is_file())):
            raise ConfigError(f"{path} holds no {STORE}; give {what}")


def _transfer(args: argparse.Namespace) -> int:
    from normlab.experiments.transfer import report

    _sweep_folders([args.proxy, *args.others], "folders written by normlab sweep (layout x lr x seed)")
    if args.record and not args.record.endswith(".json"):
        raise ConfigError(f"--record {args.record}: give a .json file (a transfer record, new or to update)")
    print(report(args.proxy, args.others, lrs=args.lrs))
    if args.record:
        from normlab.experiments.transfer import record

        print(f"record: {args.record} ({record(args.record, args.proxy, args.others, lrs=args.lrs)['status']})")
    return 0


def _summarize(args: argparse.Namespace) -> int:
    _sweep_folders([args.sweep], "a folder written by normlab sweep or compare", lost_ok=True)
    _summarize_into(args.sweep, args.out)
    return 0


def _compare(args: argparse.Namespace) -> int:
    import time

    from normlab.config.commands import CompareConfig
    from normlab.experiments import compare

    t0 = time.perf_counter()
    cfg = _declared(CompareConfig, args, "compare")
    index = compare(
        list(cfg.layouts), out=cfg.out, workers=cfg.workers, **_typed(_overrides(args, "size", "steps"), "compare")
    )  # logs the runs, the cells, the reading
    print(f"done in {time.perf_counter() - t0:.0f}s\nreport: {index}")
    return 0


def _recommend(args: argparse.Namespace) -> int:
    import time

    started = time.time()  # the budget counts from here
    from normlab.config.commands import RecommendConfig, check_recommend_settings

    cfg = _declared(RecommendConfig, args, "recommend")
    extra = _overrides(args, "steps")
    check_recommend_settings(extra)
    print(f"recommend: reading {args.model} (budget {cfg.budget:g} min)", flush=True)  # a line in the first second
    from normlab.recommend import read_user_model, recommend

    recommend(read_user_model(args.model), cfg, _typed(extra, "recommend"), started=started)
    return 0


def _recipes(args: argparse.Namespace) -> int:
    from normlab.experiments.recipes import recipes_text

    print(recipes_text(args.machine, args.names))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from normlab.config.commands import DoctorConfig
    from normlab.doctor.checkup import doctor

    print(doctor(args.model, _declared(DoctorConfig, args, "doctor"), args.json))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from normlab.config.commands import ConvertConfig
    from normlab.runs.convert import convert

    cfg = _declared(ConvertConfig, args, "convert")
    if not cfg.layout:
        raise ConfigError("convert needs --layout, the new layout (e.g. --layout peri)")
    out = cfg.out
    if not out:
        source = Path(args.source)
        out = default_out((source.parent.parent if source.is_file() else source).name, cfg.layout)
        print(f"normlab convert: no --out given: the converted weights go to {out}", flush=True)
    print("\n".join(convert(args.source, cfg.layout, out, seed=cfg.seed, match_scale=not cfg.unit_gamma).lines()))
    return 0


def _scan(args: argparse.Namespace) -> int:
    from normlab.config.commands import ScanConfig
    from normlab.hf.scan import scan_command

    result = scan_command(args.model, _declared(ScanConfig, args, "scan"))
    print(f"{result['table']}\nreport: {result['html']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from normlab.evaluation.harness import export_eval_line
    from normlab.hf.export import export_run

    lines, out, remote = export_run(args.source, args.out, args.arch)
    print("\n".join([*lines, export_eval_line(out, remote)]))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from normlab.config.commands import EvalConfig
    from normlab.evaluation.harness import TASKS_DIR, evaluate, evaluate_sweep, kind_of, tasks_text

    if args.tasks_dir or args.list:
        print(TASKS_DIR if args.tasks_dir else tasks_text())
        return 0
    if not args.source:
        raise ConfigError("normlab eval needs a run directory, checkpoint, export folder or sweep folder (or --list)")
    cfg = _declared(EvalConfig, args, "eval")
    tasks, kw, source = list(cfg.tasks), cfg.options(), Path(args.source)
    if not cfg.verbose:
        print(
            f"evaluating {source} on {', '.join(tasks)} (lm-eval's own output goes to eval_log.txt beside the "
            "results; --verbose shows it)",
            flush=True,
        )
    results = evaluate_sweep(source, tasks, **kw) if kind_of(source) == "sweep" else [evaluate(source, tasks, **kw)]
    print("\n".join(f"{r['table']}\n-> {r['path']}" for r in results))
    return 0


def _data(args: argparse.Namespace) -> int:
    from normlab.config.commands import PrepareConfig
    from normlab.data.corpora import get_corpus, source_path

    cfg = _declared(PrepareConfig, args, "data prepare")
    if args.action == "fetch":
        print(get_corpus(args.source or "shakespeare").fetch(False))
        return 0
    from normlab.data.prepare import prepare, prepared_line

    if not args.source or not cfg.out:
        raise ConfigError("normlab data prepare SOURCE --out DIR: give the text/JSONL/datasets source and a new folder")
    print(
        prepared_line(
            prepare(source_path(args.source), cfg.out, cfg.tokenizer, cfg.text_field, cfg.val_fraction, cfg.val_split),
            cfg.out,
        )
    )
    return 0


# --- the parser -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Every command: its help (normlab.config.help), its configuration's flags (generated from the
    declarations, with the command's preset as defaults), the override flags, its positional inputs."""
    import normlab
    from normlab.config import commands as c
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
        shortcut_flags(s, shortcuts)
        if set_help:
            s.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)
        if name not in ("plan", "screen"):
            inputs(s, name)
        return s

    def inputs(s: argparse.ArgumentParser, name: str) -> None:
        for flags, options in INPUTS.get(name, ()):
            s.add_argument(*flags, **options)

    def shortcut_flags(s: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
        for short in names:
            key, doc = MODEL_SHORTCUTS[short]
            s.add_argument(f"--{short}", metavar="N", default=argparse.SUPPRESS, help=f"{doc} (= --set {key}=N)")

    def run_settings(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--config",
            help="a TOML file of settings (key = value; [model] table for model options); flags and --set override it",
        )
        s.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            default=argparse.SUPPRESS,
            help="any setting by its key: lr=1e-3, model.n_layers=8, layout.h=0.5 (repeatable)",
        )
        s.add_argument(
            "--model",
            action="append",
            dest="model_options",
            default=argparse.SUPPRESS,
            metavar="KEY=VALUE",
            help="a model option, repeatable: --model n_layers=8 --model mlp=relu (= --set model.KEY=VALUE)",
        )
        add_flags(s, {k: v for k, v in LEAVES.items() if k != "options"}, defaults={"out": "runs/LAYOUT-SIZE"})

    command("layouts", _layouts)
    command(
        "show",
        _show,
        run=("size",),
        shortcuts=("layers",),
        set_help="a model or layout setting as train takes it: model.n_layers=12, model.mlp=relu, layout.h=0.5",
    )
    command("demo", _demo, c.DemoConfig)
    run_settings(command("train", _train))
    s = command("plan", _plan)
    run_settings(s)
    inputs(s, "plan")
    s = command("screen", _screen, c.ScreenConfig)
    s.add_argument("--stress", dest="stresses", default=argparse.SUPPRESS, metavar="S1,S2,...", help="= --stresses")
    shortcut_flags(s, ("layers", "width", "heads"))
    s.add_argument("--set", action="append", metavar="model.NAME=VALUE", help="any model option (repeatable)")
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
    command("summarize", _summarize)
    command("transfer", _transfer)
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
    valid, exit status 2; an unexpected error with one line and exit status 1; `--debug` (or
    NORMLAB_DEBUG=1) shows the traceback instead."""
    import os

    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("NORMLAB_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"normlab: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `normlab layouts | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        print("normlab: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        print(
            f"normlab: error: {type(err).__name__}: {_one_line(err)} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def _one_line(err: BaseException) -> str:
    text = without_unsafe_advice(" ".join(str(err).split()))
    return text if len(text) <= 2000 else text[:2000] + " ..."


if __name__ == "__main__":
    raise SystemExit(main())
