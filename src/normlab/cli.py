"""The `normlab` command line.

    normlab layouts                  the preset table: name, string form, equation, source
    normlab show LAYOUT [--size S]   the resolved per-layer layout and parameter count
    normlab demo                     forward/backward of a few layouts at init, side by side
    normlab train --layout peri ...  train one model into a run directory
    normlab screen LAYOUT...         stability screen before training (Kan et al. App. B)
    normlab report RUN_DIR...        figures and an HTML page comparing runs
    normlab compare                  post, pre, peri, hybrid trained side by side, then the report
    normlab sweep FILE | --recipe R  a grid of runs in parallel, resumable, into one SQLite store
    normlab summarize SWEEP_DIR      U-curves, divergences k/n, mean +/- std, LR sensitivity
    normlab recipes                  the papers' studies as ready-made sweeps
    normlab scan MODEL_DIR           hidden states by depth of a local transformers causal LM
    normlab export RUN_OR_CKPT DIR   a trained model as a transformers checkpoint (normlab class or native)
    normlab data fetch               fetch and cache the default corpus
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from normlab.errors import USER_ERRORS, ConfigError
from normlab.layout import PRESETS
from normlab.model.config import SIZES


def _layouts(args: argparse.Namespace) -> int:
    rows = [(p.name, p.layout.to_string(), p.equation, p.source) for p in PRESETS.values()]
    if args.names:
        print("\n".join(r[0] for r in rows))
        return 0
    if args.markdown:
        print("| preset | string form | equation | source |\n|---|---|---|---|")
        for name, form, eq, src in rows:
            print(f"| `{name}` | `{form}` | {eq} | {src} |")
        return 0
    heads = ("preset", "string form", "equation", "source")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads[:3])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*heads))
    for r in rows:
        print(fmt.format(*r))
    return 0


def _show(args: argparse.Namespace) -> int:
    from normlab.model.describe import describe
    from normlab.config.train import TrainConfig

    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"--layers {args.layers}: the number of layers is a positive integer")
    from normlab.layout import parse_layout

    parse_layout(args.layout)  # a bad layout is named in the layout grammar's own words
    pairs = _pairs(args.set, "--set", "model.n_layers=12")
    other = [k for k in pairs if not k.startswith(("model.", "layout."))]
    if other:
        raise ConfigError(f"show takes model.* and layout.* settings (the model's shape and placement), not "
                          f"{', '.join(other)}")
    given = {"layout": args.layout, "size": args.size, **({"model.n_layers": args.layers} if args.layers else {}), **pairs}
    cfg = TrainConfig().with_(given, "command line", from_text=True)  # the keys train takes (layout.h, model.*)
    print(describe(cfg.model.layout, cfg.size, **cfg.model.options))  # no model built, no torch: instant
    return 0


def _demo(args: argparse.Namespace) -> int:
    from normlab.demo import run_demo

    layouts = [x.strip() for x in args.layouts.split(";" if ";" in args.layouts else ",") if x.strip()]
    if not layouts:
        raise ConfigError("--layouts needs at least one layout, e.g. post,pre,peri")
    run_demo(layouts, size=args.size, seed=args.seed)
    return 0


def _pairs(items: list[str] | None, flag: str, example: str) -> dict[str, str]:
    """KEY=VALUE arguments as a dict of strings (parsed later by each setting's type)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{flag} takes KEY=VALUE (e.g. {flag} {example}), got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _settings(items: list[str] | None) -> dict:
    """--set KEY=VALUE pairs, typed by each key's setting (model.NAME, layout.NAME too)."""
    from normlab.config.train import typed_settings

    return typed_settings(_pairs(items, "--set", "steps=500"), "--set", from_text=True)


def _add_train_args(s: argparse.ArgumentParser) -> None:
    """One flag per setting of TrainConfig, generated from its declaration (doc, choices, type)."""
    from normlab.config.train import LEAVES

    s.add_argument("--config", help="a TOML file of settings (key = value; [model] table for model options); "
                   "flags and --set override it")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                   help="any setting by its key: lr=1e-3, model.n_layers=8, layout.h=0.5 (repeatable)")
    s.add_argument("--model", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE",
                   help="a model option, repeatable: --model n_layers=8 --model mlp=relu (= --set model.KEY=VALUE)")
    for name, leaf in LEAVES.items():
        if name == "options":
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{leaf.doc} (default: {leaf.default if name != 'layout' else 'peri'})".replace("%", "%%")
        if leaf.type is bool:
            s.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_text)
        else:
            s.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(), help=help_text,
                           choices=leaf.choices)


def train_config_from_args(args: argparse.Namespace):  # noqa: ANN201 - TrainConfig
    """Defaults, then --config FILE (typed TOML), then flags and --set (text): one override function."""
    from normlab.io import read_toml
    from normlab.config.train import LEAVES, TrainConfig, flatten_settings

    cfg = TrainConfig()
    if args.config:
        cfg = cfg.with_(flatten_settings(read_toml(args.config, "config file"), args.config), args.config)
    given: dict = {k: v for k, v in vars(args).items() if k in LEAVES}
    given.update({f"model.{k}": v for k, v in _pairs(getattr(args, "model", None), "--model", "n_layers=8").items()})
    given.update(_pairs(getattr(args, "set", None), "--set", "steps=500"))
    return cfg.with_(given, "command line", from_text=True) if given else cfg


def _train(args: argparse.Namespace) -> int:
    from normlab.train import TrainingFailed, train

    cfg = train_config_from_args(args)
    try:
        summary = train(cfg)
    except TrainingFailed as err:
        print(f"normlab: {err}", file=sys.stderr)
        return 1
    if summary:
        from normlab.runs.outcome import describe

        print(f"{cfg.out}: {describe(summary)}")
    return 0


def _screen(args: argparse.Namespace) -> int:
    import json

    from normlab.io import atomic_write_json
    from normlab.screen import ScreenConfig, format_table, load_layout_arg, parse_stresses, screen_layout

    from tqdm import tqdm

    from normlab.config.train import TrainConfig

    # the size flags through the run configuration's one override function: same keys, same checks
    flags = {"size": args.size, "model.n_layers": args.layers, "model.d_model": args.width, "model.n_heads": args.heads}
    given = {k: v for k, v in flags.items() if v is not None}
    given.update(_pairs(args.set, "--set", "model.n_layers=12"))
    model = TrainConfig().with_(given, "screen", from_text=True).model
    cfg = ScreenConfig(size=model.size, model=dict(model.options), stresses=parse_stresses(args.stress), mode=args.mode,
                       h_factor=args.h_factor, batch=args.batch, seq_len=args.seq_len, seed=args.seed)
    layouts = [load_layout_arg(a) for a in args.layouts]  # all parsed before any work: typos fail fast
    results = []
    bar = tqdm(layouts, desc="screen", unit="layout", disable=None, leave=False)
    for layout, extra in bar:
        bar.set_postfix_str(layout.name or layout.to_string())
        results.append(screen_layout(layout, cfg, extra))
    print(format_table(results))
    if args.json:
        atomic_write_json(args.json, {"results": results})
        print(f"wrote {args.json}")
    if args.verbose:
        for r in results:
            print(f"\n[{r['layout']}] {r['string']}: {r['wellposedness']['verdict']}")
            for v in r["wellposedness"]["sublayers"]:
                print(f"  layers {v['layers']} {v['sublayer']}: {v['kind']}: {v['why']}")
            print("  " + json.dumps(r["verdict"]))
    return 0


def _report(args: argparse.Namespace) -> int:
    from normlab.diagnostics.report import make_report
    from normlab.runs.files import REPORT_DIR, RunDir, SweepDir

    runs: list[Path] = []
    for r in args.runs:  # a sweep folder stands for its runs (those that logged a step)
        folder = SweepDir(r)
        runs += [run.path for run in folder.logged_runs()] if folder.is_sweep() else [Path(r)]
    for r in runs:
        RunDir(r).check_logged()
    first = Path(args.runs[0])
    sweep_given = len(args.runs) == 1 and SweepDir(first).is_sweep()
    out = args.out or (SweepDir(first).report_dir if sweep_given else first.parent / REPORT_DIR)
    index = make_report(runs, out)
    print(f"report: {index}")
    return 0


def _grid_args(items: list[str] | None) -> dict:
    """--grid AXIS=V1,V2 (or V1;V2 when a value has commas, as layout strings may), typed per axis."""
    from normlab.config.train import typed_settings

    grid = {}
    for item in items or []:
        axis, eq, values = item.partition("=")
        if not eq or not values.strip() or not axis.strip():
            raise ConfigError(f"--grid takes AXIS=V1,V2,... (e.g. --grid lr=1e-3,3e-3), got {item!r}")
        sep = ";" if ";" in values else ","
        texts = [v.strip() for v in values.split(sep) if v.strip()]
        grid[axis.strip()] = [typed_settings({axis.strip(): v}, f"--grid {axis.strip()}", from_text=True)[axis.strip()]
                              for v in texts]
    return grid


def _check_workers(workers: int | None) -> None:
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers {workers}: give a positive number of parallel runs (default: one per CPU core)")


def _merge_base(base: dict, extra: dict) -> dict:
    from normlab.config.train import flatten_settings

    return {**flatten_settings(base), **flatten_settings(extra)}


def _sweep(args: argparse.Namespace) -> int:
    from normlab.experiments import SweepConfig, load_recipe, run_sweep, summarize

    if args.file and args.recipe:
        raise ConfigError("give a sweep file or --recipe, not both")
    if not (args.file or args.recipe or args.grid):
        raise ConfigError("give a sweep file, --recipe NAME (see `normlab recipes`) or --grid AXIS=VALUES")
    sweep = SweepConfig.from_toml(args.file) if args.file else load_recipe(args.recipe) if args.recipe else SweepConfig()
    data = sweep.to_dict()
    data["base"] = _merge_base(data["base"], _settings(args.set or []))
    data["grid"] = {**data["grid"], **_grid_args(args.grid or [])}
    if args.name:
        data["name"] = args.name
    sweep = SweepConfig.from_dict(data)
    out = args.out or f"runs/sweeps/{sweep.name}"
    _check_workers(args.workers)
    counts = run_sweep(sweep, out, workers=args.workers, executor=args.executor)
    result = summarize(out)
    print(result["markdown"].read_text())
    print(f"summary: {result['markdown']}\nreport: {result['html']}")
    return 0 if not counts["failed"] else 1


def _summarize(args: argparse.Namespace) -> int:
    from normlab.experiments import summarize

    from normlab.runs.files import STORE, SweepDir

    if not SweepDir(args.sweep).is_sweep():
        raise ConfigError(f"{args.sweep} holds no {STORE}; give a folder written by normlab sweep or compare")
    result = summarize(args.sweep, args.out)
    print(result["markdown"].read_text())
    print(f"summary: {result['markdown']}\nreport: {result['html']}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import time

    from normlab.experiments import compare

    t0 = time.perf_counter()
    _check_workers(args.workers)
    given = {k: v for k, v in (("size", args.size), ("steps", args.steps)) if v is not None}
    base = _merge_base(given, _settings(args.set or []))
    index = compare([x.strip() for x in args.layouts.split(";" if ";" in args.layouts else ",") if x.strip()],
                    out=args.out, workers=args.workers, **base)  # logs the runs, the cell table, the reading
    print(f"done in {time.perf_counter() - t0:.0f}s\nreport: {index}")
    return 0


def _recipes(args: argparse.Namespace) -> int:
    from normlab.experiments import RECIPES, load_recipe

    recipes = {name: load_recipe(name) for name in RECIPES}
    recipes = {n: r for n, r in recipes.items() if args.machine in (None, r.machine)}
    if args.names:
        print("\n".join(recipes))
        return 0
    for name, r in recipes.items():
        print(f"{name}  ({len(r.expand())} runs, {r.machine})\n  source: {r.source}\n  scale:  {r.scale}\n  claim:  {r.claim}\n")
    return 0


def _scan(args: argparse.Namespace) -> int:
    from normlab.hf.scan import scan

    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"{args.model} is not a local transformers model folder (no config.json); give a folder "
                          "written by save_pretrained or normlab export")
    texts = None
    if args.text_file:
        if not Path(args.text_file).is_file():
            raise ConfigError(f"--text-file {args.text_file} does not exist")
        texts = [t for t in Path(args.text_file).read_text(errors="replace").split("\n\n") if t.strip()]
        if not texts:
            raise ConfigError(f"{args.text_file} has no text (texts are separated by blank lines)")
    result = scan(args.model, args.out or str(Path(args.model) / "scan"), texts, args.max_len)
    print(result["table"])
    print(f"report: {result['html']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from normlab.hf import save_hf, save_native
    from normlab.runs.model import load_run_model, run_tokenizer
    from normlab.hf.tokenizer import to_hf_tokenizer

    dest = Path(args.out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"export destination {dest} {'is a file' if not dest.is_dir() else 'is not empty'}; "
                          "nothing there is overwritten: give a new or empty folder")
    run = load_run_model(args.source)
    tok = run_tokenizer(run.config, run.run_dir)
    tokenizer = to_hf_tokenizer(tok, run.model.config.max_seq_len) if tok is not None else None
    if args.arch == "normlab":
        out = save_hf(run.model, args.out, tokenizer)
    else:
        out = save_native(run.model, args.out, args.arch, tokenizer)
    remote = ", trust_remote_code=True" if args.arch == "normlab" else ""
    print(f"{run.checkpoint} -> {out} ({args.arch}); load with AutoModelForCausalLM.from_pretrained({str(out)!r}{remote})")
    from normlab.evaluation.local_tasks import TASKS_DIR

    import shlex

    model_args = f"pretrained={out}" + (",trust_remote_code=True" if args.arch == "normlab" else "")
    print(f"evaluate: lm_eval --model hf --model_args {shlex.quote(model_args)} --tasks normlab_local "
          f"--include_path {shlex.quote(str(TASKS_DIR))}  (or: normlab eval {shlex.quote(str(out))})")
    return 0


def _eval_limit(text: str | None) -> int | float | None:
    """--limit: a count (a positive integer) or a fraction in (0, 1]."""
    if text is None:
        return None
    try:
        value = float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        raise ConfigError(f"--limit {text!r} is not a number; give examples per task (an integer, e.g. 50) "
                          "or a fraction (e.g. 0.1)") from None
    if isinstance(value, int) and value < 1 or isinstance(value, float) and not 0 < value <= 1:
        raise ConfigError(f"--limit {text} is out of range; give a positive integer or a fraction in (0, 1]")
    return value


def _eval(args: argparse.Namespace) -> int:
    from normlab.evaluation.harness import GROUPS, LOCAL_TASKS, TASKS_DIR, evaluate, evaluate_sweep, kind_of

    if args.tasks_dir:
        print(TASKS_DIR)
        return 0
    if args.list:
        print(f"normlab's lm-eval tasks (include path {TASKS_DIR}):")
        for t in LOCAL_TASKS:
            print(f"  {t}")
        for g, members in GROUPS.items():
            print(f"  {g}: {', '.join(members)}")
        return 0
    if not args.source:
        raise ConfigError("normlab eval needs a run directory, checkpoint, export folder or sweep folder (or --list)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks is empty; give lm-eval task or group names, e.g. --tasks normlab_local")
    kw = dict(limit=_eval_limit(args.limit), batch_size=args.batch_size, device=args.device,
              num_fewshot=args.num_fewshot, samples=args.samples, trust_remote_code=args.trust_remote_code,
              verbose=args.verbose)
    source = Path(args.source)
    if not args.verbose:
        print(f"evaluating {source} on {', '.join(tasks)} (lm-eval's own output goes to eval_log.txt beside the "
              "results; --verbose shows it)", flush=True)
    results = evaluate_sweep(source, tasks, **kw) if kind_of(source) == "sweep" else [evaluate(source, tasks, **kw)]
    for r in results:
        print(r["table"])
        print(f"-> {r['path']}")
    return 0


def _data(args: argparse.Namespace) -> int:
    from normlab.data.corpora import get_corpus

    if args.action == "fetch":
        print(get_corpus(args.source or "shakespeare").fetch(False))
        return 0
    from normlab.data.prepare import prepare

    if not args.source or not args.out:
        raise ConfigError("normlab data prepare SOURCE --out DIR: give the text/JSONL/datasets source and a new folder")
    meta = prepare(args.source, args.out, args.tokenizer, args.text_field, args.val_fraction, args.val_split)
    print(f"{meta['source']} -> {args.out}: {meta['train']['documents']:,} + {meta['val']['documents']:,} documents, "
          f"{meta['train']['tokens']:,} train + {meta['val']['tokens']:,} val tokens ({meta['dtype']}), tokenizer "
          f"{meta['tokenizer']} (vocab {meta['vocab_size']}, end-of-text id {meta['eos_id']}); train with --data {args.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with normlab's rule for bad input: one line and exit status 2 (not the whole usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    import normlab
    from normlab.data.corpora import CORPORA
    from normlab.hf.archs import EXPORTABLE

    p = _Parser(
        prog="normlab",
        description="Normalization placement in Transformer LMs: build, compare and inspect layouts.",
    )
    p.add_argument("--version", action="version", version=f"normlab {normlab.__version__}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("layouts", help="list the preset layouts with their equations and sources")
    s.add_argument("--names", action="store_true", help="print the names only")
    s.add_argument("--markdown", action="store_true", help="print a Markdown table (as in the README)")
    s.set_defaults(func=_layouts)
    s = sub.add_parser("show", help="print a layout resolved per layer, with the parameter count")
    s.add_argument("layout", help="preset name or string form, e.g. peri or 'attn=AB,mlp=AB,final'")
    s.add_argument("--size", default="tiny", choices=list(SIZES), metavar="SIZE", help=f"size preset ({', '.join(SIZES)})")
    s.add_argument("--layers", type=int, default=None, help="override the number of layers")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a model or layout setting as train takes it: model.n_layers=12, model.mlp=relu, layout.h=0.5")
    s.set_defaults(func=_show)
    s = sub.add_parser("demo", help="compare layouts at initialization on real text: loss, RMS and grad norm by depth")
    s.add_argument("--layouts", default="post,pre,peri,hybrid", help="comma-separated preset names")
    s.add_argument("--size", default="tiny", choices=list(SIZES), metavar="SIZE", help=f"size preset ({', '.join(SIZES)})")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_demo)
    s = sub.add_parser(
        "train",
        help="train a model with a layout and record the run (metrics, checkpoints, summary)",
        description="Train one model. Example: normlab train --layout peri --size tiny --lr 3e-3 --steps 300 "
        "--out runs/peri. Settings come from defaults, then --config FILE.toml, then flags. Under torchrun it "
        "trains data parallel (DDP, or FSDP2 with --fsdp).",
    )
    _add_train_args(s)
    s.set_defaults(func=_train)
    s = sub.add_parser(
        "screen",
        help="screen layouts for stability before training (Kan et al.'s four steps)",
        description="Screen layouts before training (Kan et al. 2025, App. B): well-posedness from the layout "
        "data; hidden-state growth over depth under a weight stress s; each block's Jacobian norm; W2 "
        "amplification of an input perturbation; and the effect of a smaller residual step h. "
        "Example: normlab screen post pre peri hybrid --json screen.json",
    )
    s.add_argument("layouts", nargs="+", help="preset names, string forms, or .toml files with a 'layout' key")
    s.add_argument("--size", default="tiny", choices=list(SIZES), metavar="SIZE",
                   help=f"size preset ({', '.join(SIZES)}); default tiny")
    s.add_argument("--layers", help="number of layers (depth; = --set model.n_layers=N)")
    s.add_argument("--width", help="d_model (= --set model.d_model=N)")
    s.add_argument("--heads", help="attention heads, must divide the width (= --set model.n_heads=N)")
    s.add_argument("--set", action="append", metavar="model.NAME=VALUE", help="any model option (repeatable)")
    s.add_argument("--stress", default="1,2,4,8", help="weight stress factors s > 0, comma-separated (default 1,2,4,8)")
    s.add_argument("--mode", default="output", choices=["output", "all"],
                   help="output: scale W_O and W_down by s (module outputs x s); all: scale every attention/MLP weight")
    s.add_argument("--h-factor", type=float, default=0.5, help="also screen at h times this (default 0.5)")
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--seq-len", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", help="write every measurement to this JSON file")
    s.add_argument("-v", "--verbose", action="store_true", help="explain the well-posedness verdict per sublayer")
    s.set_defaults(func=_screen)
    s = sub.add_parser("report", help="figures and one HTML page comparing run directories")
    s.add_argument("runs", nargs="+", help="run directories written by normlab train, or a sweep folder (its runs)")
    s.add_argument("--out", help="output folder (default: report/ beside the first run)")
    s.set_defaults(func=_report)
    s = sub.add_parser(
        "compare", help="train post, pre, peri and hybrid side by side in fp16 with probes on, then write the report",
        description="The main job (what `make demo` runs): the layouts trained with the same settings on the "
        "default corpus, in parallel, with activations stored in fp16 and probes on; then one HTML report that "
        "opens with a reading of the runs. The defaults (micro-deep: d 64, 12 layers; lr 0.1, no weight decay, 150 "
        "steps, fp16 activations) "
        "provoke Pre-LN's fp16 overflow in about two minutes on 2 cores. Resumable: run it again and finished "
        "layouts are not retrained.")
    s.add_argument("--layouts", default="post,pre,peri,hybrid", help="comma-separated (or ;-separated) layouts")
    s.add_argument("--size", choices=list(SIZES), metavar="SIZE",
                   help=f"size preset ({', '.join(SIZES)}); default micro-deep (micro with 12 layers)")
    s.add_argument("--steps", type=int, help="training steps per layout (default 150)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="any training setting, e.g. --set lr=1e-3")
    s.add_argument("--workers", type=int, help="parallel runs (default: one per CPU core)")
    s.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    s.set_defaults(func=_compare)
    s = sub.add_parser(
        "sweep", help="run a grid of trainings in parallel into one SQLite store (resumable)",
        description="Run a sweep: a base config and a grid (the product of the axes). Example: normlab sweep "
        "--recipe kim-lr; normlab sweep my.toml --workers 2; normlab sweep --grid layout=pre,peri --grid "
        "lr=1e-3,3e-3 --grid seed=0,1 --set size=micro --set steps=200. Re-running skips finished runs.")
    s.add_argument("file", nargs="?", help="a sweep TOML file (name, [base], [grid]; see docs/experiments.md)")
    s.add_argument("--recipe", help="a ready-made sweep (see `normlab recipes`)")
    s.add_argument("--grid", action="append", metavar="AXIS=V1,V2", help="add or replace a grid axis (repeatable)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="a base setting (repeatable; model.NAME for model options)")
    s.add_argument("--name", help="sweep name (default: the file's or recipe's)")
    s.add_argument("--out", help="sweep folder (default runs/sweeps/NAME)")
    s.add_argument("--workers", type=int, help="parallel runs on this machine (default: one per CPU core)")
    s.add_argument("--executor", choices=["local", "slurm", "submitit-local"], help="where runs execute (default: the file's, else local)")
    s.set_defaults(func=_sweep)
    s = sub.add_parser("summarize", help="tables and figures from a sweep: U-curves, divergences k/n, mean ± std, LR sensitivity")
    s.add_argument("sweep", help="a sweep folder (holding sweep.db)")
    s.add_argument("--out", help="where to write summary.md, the CSVs and report.html (default: the sweep folder)")
    s.set_defaults(func=_summarize)
    s = sub.add_parser("recipes", help="list the ready-made sweeps reproducing the papers' studies")
    s.add_argument("--names", action="store_true", help="print the names only")
    s.add_argument("--machine", choices=["cpu", "gpu"], help="only the recipes that run on this machine kind "
                   "(gpu: the gpu-* recipes, CUDA at the gpu-126m size on the English corpus)")
    s.set_defaults(func=_recipes)
    s = sub.add_parser("scan", help="hidden states, massive activations and angular distance by depth of a local causal LM",
                       description="Scan a local transformers causal LM (offline; needs transformers): per layer "
                       "RMS, variance, mean |h|, max |h|, median, max/median; top-100 and FP16 headroom; angular "
                       "distance. Writes table.md, scan.json, PNGs and index.html.")
    s.add_argument("model", help="a local folder with config.json and weights (and a tokenizer, optionally)")
    s.add_argument("--out", help="output folder (default MODEL/scan)")
    s.add_argument("--text-file", help="texts to run, separated by blank lines (default: four built-in texts)")
    s.add_argument("--max-len", type=int, default=64, help="tokens per text (default 64)")
    s.set_defaults(func=_scan)
    s = sub.add_parser("export", help="save a trained normlab model as a transformers checkpoint",
                       description="Export a run's newest checkpoint: --arch normlab (default) writes the normlab "
                       "class, for any layout (load with trust_remote_code=True); --arch llama (layout pre), olmo2 "
                       "(layout olmo2) or gemma2 (layout gemma2 with mlp=geglu-tanh) writes transformers' own class, and other layouts are refused there because "
                       "no transformers class computes them.")
    s.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint file")
    s.add_argument("out", help="output folder")
    s.add_argument("--arch", default="normlab", choices=["normlab", *EXPORTABLE],
                   help=f"normlab (any layout; default), or transformers' own class for the layout it computes: "
                   f"{', '.join(f'{a} ({p})' for a, p in EXPORTABLE.items())}")
    s.set_defaults(func=_export)
    s = sub.add_parser("eval", help="lm-evaluation-harness on a run, checkpoint, export or sweep (results into eval.json)",
                       description="Score models with lm-evaluation-harness (pip install 'normlab[eval]'). A run "
                       "directory or checkpoint is evaluated in memory with its tokenizer; an export folder as "
                       "lm-eval's --model hf loads it; a sweep folder: every run that finished ok. Results go to "
                       "eval.json beside the model and show in normlab report and normlab summarize.")
    s.add_argument("source", nargs="?", help="run directory, checkpoint, export folder or sweep folder")
    s.add_argument("--tasks", default="normlab_local",
                   help="comma-separated lm-eval task/group names (default normlab_local: three offline tasks)")
    s.add_argument("--limit", help="examples per task (an integer, or a fraction like 0.1)")
    s.add_argument("--batch-size", default="1", help="lm-eval batch size (an integer, or auto)")
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0, ... (default cpu)")
    s.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own, zero for normlab's)")
    s.add_argument("--samples", action="store_true", help="also write each item's request and response to eval_samples/TASK.jsonl")
    s.add_argument("--verbose", action="store_true",
                   help="show lm-eval's and transformers' log and progress bars (default: the results, the items scored "
                   "and what was truncated)")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="let an export folder's own model code run (needed only where normlab did not write it: "
                   "a normlab export's modeling_normlab.py is verified against this version's and runs without it)")
    s.add_argument("--list", action="store_true", help="list normlab's tasks and the papers' task groups")
    s.add_argument("--tasks-dir", action="store_true",
                   help="print the folder of normlab's task YAMLs (for lm_eval --include_path) and exit")
    s.set_defaults(func=_eval)
    s = sub.add_parser("data", help="fetch a corpus, or prepare token files from text/JSONL/datasets",
                       description="fetch [NAME]: download, verify and cache a named corpus (" + "; ".join(
                           f"{c.name}: {c.what}" for c in CORPORA.values()) + "; docs/training.md). "
                       "prepare: tokenize a text file, folder, .jsonl or local datasets folder (save_to_disk) into "
                       "OUT/{train,val}.bin + tokenizer.json + meta.json, end-of-text between documents, the last "
                       "--val-fraction of the documents held out; train on it with --data OUT.")
    s.add_argument("action", choices=["fetch", "prepare"])
    s.add_argument("source", nargs="?", help=f"fetch: a corpus name ({', '.join(CORPORA)}; default shakespeare); "
                   "prepare: text file, folder, .jsonl, datasets folder or a corpus name")
    s.add_argument("--out", help="prepare: a new or empty folder")
    s.add_argument("--tokenizer", default="bytes", help="bytes | bpe:VOCAB (trained on the source) | a tokenizer.json")
    s.add_argument("--text-field", default="text", help="the text field of JSONL records / dataset rows (default text)")
    s.add_argument("--val-fraction", type=float, default=0.1, help="fraction of documents held out (default 0.1)")
    s.add_argument("--val-split", choices=["tail", "hash"], default="tail",
                   help="tail: the last documents; hash: a fixed sample of documents by the SHA-256 of their text")
    s.set_defaults(func=_data)
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
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if debug:
            raise
        print(f"normlab: error: {type(err).__name__}: {_one_line(err)} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 2000 else text[:2000] + " ..."


if __name__ == "__main__":
    raise SystemExit(main())
