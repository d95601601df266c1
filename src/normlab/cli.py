"""The `normlab` command line.

    normlab layouts                  the preset table: name, string form, equation, source
    normlab show LAYOUT [--size S]   the resolved per-layer layout and parameter count
    normlab demo                     forward/backward of a few layouts at init, side by side
    normlab train --layout peri ...  train one model into a run directory
    normlab plan --size gpu-126m ... the device memory a run needs (weights, optimizer, activations)
    normlab screen LAYOUT...         stability screen before training (Kan et al. App. B)
    normlab report RUN_DIR...        figures and an HTML page comparing runs
    normlab compare                  post, pre, peri, hybrid trained side by side, then the report
    normlab sweep FILE | --recipe R  a grid of runs in parallel, resumable, into one SQLite store
    normlab summarize SWEEP_DIR      U-curves, divergences k/n, mean +/- std, LR sensitivity
    normlab recipes                  the papers' studies as ready-made sweeps
    normlab transfer PROXY OTHER...  does a proxy sweep's ranking hold in wider/longer sweeps (Kendall's tau, top-k)
    normlab recommend MODEL          a placement for your model (size, TOML or config.json), with the evidence
    normlab scan MODEL_DIR           hidden states by depth of a local transformers causal LM
    normlab export RUN_OR_CKPT DIR   a trained model as a transformers checkpoint (normlab class or native)
    normlab data fetch               fetch and cache the default corpus
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from normlab.settings import given as settings_given
from normlab.errors import USER_ERRORS, ConfigError, without_unsafe_advice
from normlab.layout import PRESETS


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
    from normlab.config.train import TrainConfig
    from normlab.layout import parse_layout
    from normlab.model.describe import describe

    parse_layout(args.layout)  # a bad layout is named in the layout grammar's own words
    pairs = {**_shortcuts(args), **_pairs(args.set, "--set", "model.n_layers=12")}
    other = [k for k in pairs if not k.startswith(("model.", "layout."))]
    if other:
        raise ConfigError(f"show takes model.* and layout.* settings (the model's shape and placement), not "
                          f"{', '.join(other)}")
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


# Flags that stand for a model option (the model's shape), for the commands that take one.
MODEL_SHORTCUTS = {"layers": ("model.n_layers", "number of layers (depth)"),
                   "width": ("model.d_model", "d_model, the width of the residual stream"),
                   "heads": ("model.n_heads", "attention heads, must divide the width")}


def _add_shortcuts(s: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    for name in names:
        key, doc = MODEL_SHORTCUTS[name]
        s.add_argument(f"--{name}", metavar="N", default=argparse.SUPPRESS, help=f"{doc} (= --set {key}=N)")


def _shortcuts(args: argparse.Namespace) -> dict[str, str]:
    return {MODEL_SHORTCUTS[k][0]: v for k, v in vars(args).items() if k in MODEL_SHORTCUTS}


def _add_declared(s: argparse.ArgumentParser, cls: type) -> None:
    """A command's flags from its configuration's declarations (normlab.settings)."""
    from normlab.settings import add_flags, leaves

    add_flags(s, leaves(cls))


def _declared(cls: type, args: argparse.Namespace, source: str, skip: tuple[str, ...] = (),  # noqa: ANN202 - a cls
              **fixed: object):
    """The command's configuration from the flags it was given (text, parsed by each setting's type);
    ``skip``: declared settings the command decides itself (passed in ``fixed``)."""
    from normlab.settings import build, given, leaves

    values = {k: v for k, v in given(args, leaves(cls)).items() if k not in skip}
    return build(cls, values, source, from_text=True, as_flags=True, **fixed)


def _add_run_settings(s: argparse.ArgumentParser, names: tuple[str, ...], defaults: dict | None = None) -> None:
    """Flags for some of the run settings (TrainConfig's declarations), with this command's defaults."""
    from normlab.settings import add_flags
    from normlab.config.train import LEAVES

    add_flags(s, {k: LEAVES[k] for k in names}, defaults=defaults)


def _add_train_args(s: argparse.ArgumentParser) -> None:
    """One flag per setting of TrainConfig, generated from its declaration (doc, choices, type)."""
    from normlab.settings import add_flags
    from normlab.config.train import LEAVES

    s.add_argument("--config", help="a TOML file of settings (key = value; [model] table for model options); "
                   "flags and --set override it")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                   help="any setting by its key: lr=1e-3, model.n_layers=8, layout.h=0.5 (repeatable)")
    s.add_argument("--model", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE",
                   help="a model option, repeatable: --model n_layers=8 --model mlp=relu (= --set model.KEY=VALUE)")
    add_flags(s, {k: v for k, v in LEAVES.items() if k != "options"}, defaults={"out": "runs/LAYOUT-SIZE"})


def default_out(*parts: str) -> str:
    """An output folder named after what the command makes (train: runs/LAYOUT-SIZE; convert:
    runs/SOURCE-LAYOUT), for a command given no --out: every command that writes has a default, printed."""
    import re

    return "runs/" + "-".join(re.sub(r"[^A-Za-z0-9._+-]+", "_", p).strip("_") or "run" for p in parts)


def _settings_keys(args: argparse.Namespace) -> set[str]:
    """The names of the run settings the user gave (flags, --set, --model, the --config file), e.g. {"lr", "out"}."""
    from normlab.io import read_toml
    from normlab.config.train import LEAVES, flatten_settings, resolve_key

    keys = [k for k in vars(args) if k in LEAVES] + list(_pairs(getattr(args, "set", None), "--set", "steps=500"))
    keys += [f"model.{k}" for k in _pairs(getattr(args, "model", None), "--model", "n_layers=8")]
    if getattr(args, "config", None):
        keys += list(flatten_settings(read_toml(args.config, "config file"), args.config))
    return {resolve_key(k)[1] if resolve_key(k)[0] == "leaf" else k for k in keys}


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
    given = _settings_keys(args)
    if cfg.model.init_from:
        cfg = _recorded_shape(cfg, given)
    if "out" not in given:
        cfg = cfg.with_({"out": default_out(cfg.model.layout_label, cfg.model.size)}, "command line")
        print(f"normlab train: no --out given: the run goes to {cfg.run.out}", flush=True)
    try:
        summary = train(cfg)
    except TrainingFailed as err:
        print(f"normlab: {err}", file=sys.stderr)
        return 1
    if summary:
        from normlab.runs.outcome import describe

        print(f"{cfg.run.out}: {describe(summary)}")
    return 0


def _recorded_shape(cfg, given: set[str]):  # noqa: ANN001, ANN202 - a TrainConfig
    """--init-from a run or a converted folder: the source's recorded size, model options and layout (its
    config.json) where the command gave none of them, so its weights fit the model built here."""
    from normlab.runs.files import RunDir

    source = Path(cfg.model.init_from)
    folder = source.parent.parent if source.is_file() else source  # a checkpoint file: its run folder
    recorded = RunDir(folder).train_config() if RunDir(folder).config_file.is_file() else None
    if recorded is None:
        return cfg  # a transformers folder: its shape is read with its weights, or the mismatch is named
    shape: dict = {} if "size" in given else {"size": recorded.model.size}
    if not any(k.startswith("model.") for k in given):
        shape.update({f"model.{k}": v for k, v in recorded.model.options.items()})
    if "layout" not in given and not any(k.startswith("layout.") for k in given):
        shape["layout"] = recorded.model.layout_label
    if not shape:
        return cfg
    print(f"normlab train: --init-from {source}: its recorded shape ({', '.join(f'{k}={v}' for k, v in shape.items())})",
          flush=True)
    return cfg.with_(shape, f"{source} (recorded shape)")


def _plan(args: argparse.Namespace) -> int:
    from normlab.train.memory import GIB, fitting_options, plan_memory

    cfg = train_config_from_args(args)
    if args.world < 1 or (args.gpu_memory is not None and args.gpu_memory <= 0):
        raise ConfigError("--world is a positive number of ranks and --gpu-memory a positive number of GiB")
    plan = plan_memory(cfg, args.world)
    print(f"{cfg.model.layout_label} at {cfg.model.size}{' ' + str(cfg.model.options) if cfg.model.options else ''}: "
          f"{plan.params / 1e6:.1f}M parameters; micro-batch {plan.micro_batch} x {plan.seq_len} on each of "
          f"{args.world} rank(s), {cfg.for_device('cuda').precision}, activations stored in "
          f"{cfg.for_device('cuda').stored_dtype}"
          + (", activation checkpointing" if cfg.run.activation_checkpointing else ""))
    print(plan.table())
    if args.gpu_memory is not None:
        capacity = int(args.gpu_memory * GIB)
        if plan.total <= capacity:
            print(f"fits {args.gpu_memory:g} GiB ({int(0.9 * capacity // plan.total)} such runs side by side)")
        else:
            options = fitting_options(cfg, capacity, args.world)
            print(f"does not fit {args.gpu_memory:g} GiB; " + ("these fit: " + "; ".join(options) if options else
                                                                "nothing tried fits: FSDP over more devices, or a smaller model"))
    return 0


def _screen(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from normlab.config.commands import ScreenConfig
    from normlab.config.train import TrainConfig
    from normlab.io import atomic_write_json
    from normlab.screen import format_table, load_layout_arg, screen_layout

    # the model's shape through the run configuration's one override function: same keys, same checks
    given = {**settings_given(args, ("size",)), **_shortcuts(args), **_pairs(args.set, "--set", "model.n_layers=12")}
    model = TrainConfig().with_(given, "screen", from_text=True).model
    cfg = _declared(ScreenConfig, args, "screen", skip=("size",), size=model.size, model=dict(model.options))
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
    from normlab.runs.store import logged_runs

    runs: list[Path] = []
    for r in args.runs:  # a sweep folder stands for its runs (those that logged a step)
        folder = SweepDir(r)
        if folder.is_sweep():
            runs += [run.path for run in logged_runs(folder)]
            continue
        path = Path(r)
        # a folder holding run folders one level down (a transformers Trainer's output_dir: its normlab/ folder)
        inner = ([c for c in sorted(path.iterdir()) if c.is_dir() and RunDir(c).has_metrics()]
                 if path.is_dir() and not RunDir(path).has_metrics() else [])
        if inner:
            print(f"reading {', '.join(str(c) for c in inner)} (the run folder{'s' if len(inner) > 1 else ''} in {path})")
        runs += inner or [path]
    for r in runs:
        RunDir(r).check_logged()
    first = Path(args.runs[0])
    sweep_given = len(args.runs) == 1 and SweepDir(first).is_sweep()
    out = args.out or (SweepDir(first).report_dir if sweep_given else runs[0].parent / REPORT_DIR)
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


def _sweep(args: argparse.Namespace) -> int:
    from normlab.settings import given, leaves
    from normlab.experiments import SweepConfig, load_recipe, run_sweep, summarize

    if args.cancel:
        from normlab.experiments.cluster import cancel_sweep

        cancel_sweep(args.cancel)
        return 0
    if args.file and args.recipe:
        raise ConfigError("give a sweep file or --recipe, not both")
    if not (args.file or args.recipe or args.grid):
        raise ConfigError("give a sweep file, --recipe NAME (see `normlab recipes`) or --grid AXIS=VALUES")
    sweep = SweepConfig.from_toml(args.file) if args.file else load_recipe(args.recipe) if args.recipe else SweepConfig()
    sweep = sweep.with_(given(args, leaves(SweepConfig)), base=_settings(args.set or []),
                        grid=_grid_args(args.grid or []), from_text=True)
    out = args.out or f"runs/sweeps/{sweep.name}"
    counts = run_sweep(sweep, out, workers=sweep.workers, executor=sweep.executor)
    result = summarize(out)
    print(result["markdown"].read_text())
    print(f"summary: {result['markdown']}\nreport: {result['html']}")
    return 0 if not counts["failed"] else 1


def _transfer(args: argparse.Namespace) -> int:
    from normlab.experiments.transfer import report
    from normlab.runs.files import STORE, SweepDir

    for path in [args.proxy, *args.others]:
        if not SweepDir(path).is_sweep():
            raise ConfigError(f"{path} holds no {STORE}; give folders written by normlab sweep (layout x lr x seed)")
    print(report(args.proxy, args.others, lrs=args.lrs))
    return 0


def _summarize(args: argparse.Namespace) -> int:
    from normlab.experiments import summarize

    from normlab.runs.files import STORE, SweepDir

    if not (SweepDir(args.sweep).is_sweep() or SweepDir(args.sweep).sweep_file.is_file()):  # (a lost store: rebuilt)
        raise ConfigError(f"{args.sweep} holds no {STORE}; give a folder written by normlab sweep or compare")
    result = summarize(args.sweep, args.out)
    print(result["markdown"].read_text())
    print(f"summary: {result['markdown']}\nreport: {result['html']}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import time

    from normlab.config.commands import CompareConfig
    from normlab.experiments import compare

    t0 = time.perf_counter()
    cfg = _declared(CompareConfig, args, "compare")
    base = {**settings_given(args, ("size", "steps")), **_pairs(args.set, "--set", "lr=1e-3")}
    from normlab.config.train import typed_settings

    index = compare(list(cfg.layouts), out=cfg.out, workers=cfg.workers,
                    **typed_settings(base, "compare", from_text=True))  # logs the runs, the cell table, the reading
    print(f"done in {time.perf_counter() - t0:.0f}s\nreport: {index}")
    return 0


def _recommend(args: argparse.Namespace) -> int:
    import time

    started = time.time()  # the budget counts from here
    from normlab.config.commands import RecommendConfig, check_recommend_settings
    from normlab.config.train import typed_settings

    cfg = _declared(RecommendConfig, args, "recommend")
    extra = {**settings_given(args, ("steps",)), **_pairs(args.set, "--set", "steps=100")}
    check_recommend_settings(extra)
    print(f"recommend: reading {args.model} (budget {cfg.budget:g} min)", flush=True)  # a line in the first second
    from normlab.recommend import read_user_model, recommend

    recommend(read_user_model(args.model), cfg, typed_settings(extra, "recommend", from_text=True), started=started)
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _recipes(args: argparse.Namespace) -> int:
    from normlab.experiments import RECIPES, load_recipe

    recipes = {name: load_recipe(name) for name in RECIPES}
    recipes = {n: r for n, r in recipes.items() if args.machine in (None, r.machine)}
    if args.names:
        print("\n".join(recipes))
        return 0
    for name, r in recipes.items():
        final, flight = r.disk_budget()
        print(f"{name}  ({len(r.expand())} runs, {r.machine})\n  source: {r.source}\n  scale:  {r.scale}\n  claim:  {r.claim}\n"
              f"  disk:   checkpoints {_size(final)} once finished ({_size(flight)} per run in flight)\n")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    import json
    from normlab.doctor import checkup, load_model, rescalable, rescale_for_fp16, sample_tokens, write_copy
    from normlab.doctor.checkup import findings_json

    from normlab.config.commands import DoctorConfig

    cfg = _declared(DoctorConfig, args, "doctor")
    if cfg.fp16_copy:
        from normlab.io import own_folder

        own_folder(cfg.fp16_copy, "doctored", claim=False)  # a folder holding someone's files fails before any work
    model, tok, kind, run = load_model(args.model)
    x = sample_tokens(model, tok)
    findings, _ = checkup(model, x)
    if args.json:
        print(json.dumps(findings_json(findings), indent=1))
    else:
        print(f"# doctor: {args.model} ({kind}; layout {model.layout.label}), {x.shape[0]} x {x.shape[1]} tokens")
        print("\n".join(f.line() for f in findings))
    why = rescalable(model)
    if cfg.fp16_copy:
        if why is not None:
            raise ConfigError(f"no exact fp16-safe copy for this layout: {why}")
        r = rescale_for_fp16(model, x[:, :-1], cfg.headroom)
        out = write_copy(r.model, args.model, kind, cfg.fp16_copy, run)
        print(f"fp16-safe copy: stream x {r.factor:.4g}, largest activation {r.max_before:.4g} -> {r.max_after:.4g}; "
              f"logits changed by at most {r.max_logit_change:.3g} (KL {r.kl:.3g} nats/token) -> {out}")
    elif not args.json:
        print("an exact fp16-safe rescaled copy: " + ("available (--fp16-copy OUT)" if why is None else f"not exact here ({why})"))
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
    from normlab.hf.scan import scan

    cfg = _declared(ScanConfig, args, "scan")
    texts = None
    if cfg.text_file:
        if not Path(cfg.text_file).is_file():
            raise ConfigError(f"--text-file {cfg.text_file} does not exist")
        texts = [t for t in Path(cfg.text_file).read_text(errors="replace").split("\n\n") if t.strip()]
        if not texts:
            raise ConfigError(f"{cfg.text_file} has no text (texts are separated by blank lines)")
    result = scan(args.model, cfg.out or str(Path(args.model) / "scan"), texts, cfg.max_len)
    print(result["table"])
    print(f"report: {result['html']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    import shlex

    from normlab.evaluation.local_tasks import TASKS_DIR
    from normlab.hf.export import export
    from normlab.hf.tokenizer import to_hf_tokenizer
    from normlab.runs.model import load_run_model, run_tokenizer

    dest = Path(args.out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"export destination {dest} {'is a file' if not dest.is_dir() else 'is not empty'}; "
                          "nothing there is overwritten: give a new or empty folder")
    run = load_run_model(args.source)
    tok = run_tokenizer(run.config, run.run_dir)
    tokenizer = to_hf_tokenizer(tok, run.model.config.max_seq_len) if tok is not None else None
    out, arch, why = export(run.model, args.out, args.arch, tokenizer)
    remote = arch == "normlab"
    print(f"{run.checkpoint} -> {out} ({arch}: {why})")
    print(f"load: AutoModelForCausalLM.from_pretrained({str(out)!r}{', trust_remote_code=True' if remote else ''})")
    if tokenizer is not None:  # stock files; AutoTokenizer on a normlab-class folder would first ask about its code
        print(f"tokenizer: {'PreTrainedTokenizerFast' if remote else 'AutoTokenizer'}.from_pretrained({str(out)!r})"
              + (" (stock; no custom code)" if remote else ""))
    model_args = f"pretrained={out}" + (",trust_remote_code=True" if remote else "")
    print(f"evaluate: lm_eval --model hf --model_args {shlex.quote(model_args)} --tasks normlab_local "
          f"--include_path {shlex.quote(str(TASKS_DIR))}  (or: normlab eval {shlex.quote(str(out))})")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from normlab.config.commands import EvalConfig
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
    cfg = _declared(EvalConfig, args, "eval")
    tasks, kw = list(cfg.tasks), cfg.options()
    source = Path(args.source)
    if not cfg.verbose:
        print(f"evaluating {source} on {', '.join(tasks)} (lm-eval's own output goes to eval_log.txt beside the "
              "results; --verbose shows it)", flush=True)
    results = evaluate_sweep(source, tasks, **kw) if kind_of(source) == "sweep" else [evaluate(source, tasks, **kw)]
    for r in results:
        print(r["table"])
        print(f"-> {r['path']}")
    return 0


def _data(args: argparse.Namespace) -> int:
    from normlab.config.commands import PrepareConfig
    from normlab.data.corpora import get_corpus

    cfg = _declared(PrepareConfig, args, "data prepare")
    if args.action == "fetch":
        print(get_corpus(args.source or "shakespeare").fetch(False))
        return 0
    from normlab.data.prepare import prepare

    if not args.source or not cfg.out:
        raise ConfigError("normlab data prepare SOURCE --out DIR: give the text/JSONL/datasets source and a new folder")
    meta = prepare(args.source, cfg.out, cfg.tokenizer, cfg.text_field, cfg.val_fraction, cfg.val_split)
    print(f"{meta['source']} -> {cfg.out}: {meta['train']['documents']:,} + {meta['val']['documents']:,} documents, "
          f"{meta['train']['tokens']:,} train + {meta['val']['tokens']:,} val tokens ({meta['dtype']}), tokenizer "
          f"{meta['tokenizer']} (vocab {meta['vocab_size']}, end-of-text id {meta['eos_id']}); train with --data {cfg.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with normlab's rule for bad input: one line and exit status 2 (not the whole usage); an unknown
    flag is named by the command it was given to, with the closest of that command's own flags."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._commands().get(getattr(ns, "command", None) or "", self)
            command.error("unrecognized arguments: " + " ".join(extras) + _did_you_mean(command, extras))
        return ns

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(subs[0].choices) if subs else {}


def _did_you_mean(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The closest of ``parser``'s own flags to each unknown one (difflib over the flags and over the words of
    their help: --learning-rate is close to lr's "peak learning rate")."""
    import difflib

    names: dict[str, str] = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                names.setdefault(flag, flag)
                words = (action.help or "").split(";")[0].split("(")[0].split(",")[0].split(":")[0].split()
                if 0 < len(words) <= 4:
                    names.setdefault("--" + "-".join(w.lower() for w in words), flag)
    bare = {name[2:]: flag for name, flag in names.items()}  # compared without the "--" every flag shares
    said = []
    for extra in extras:
        flag = extra.split("=")[0]
        close = difflib.get_close_matches(flag[2:], list(bare), n=1, cutoff=0.6) if flag.startswith("--") else []
        if close:
            said.append((flag, bare[close[0]]))
    if len(said) == 1:
        return f" (did you mean {said[0][1]}?)"
    return f" (did you mean {', '.join(f'{b} for {a}' for a, b in said)}?)" if said else ""


def build_parser() -> argparse.ArgumentParser:
    """Every command's flags: from its configuration's declarations (normlab.config), display switches
    (--names, --json, --list, ...) and positional inputs aside."""
    import normlab
    from normlab.config.commands import (COMPARE_BASE, CompareConfig, ConvertConfig, DemoConfig, DoctorConfig,
                                         EvalConfig, PrepareConfig, RECOMMEND_BASE, RecommendConfig,
                                         ScanConfig, ScreenConfig)
    from normlab.experiments.sweep import SweepConfig
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
    _add_run_settings(s, ("size",))
    _add_shortcuts(s, ("layers",))
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a model or layout setting as train takes it: model.n_layers=12, model.mlp=relu, layout.h=0.5")
    s.set_defaults(func=_show)
    s = sub.add_parser("demo", help="compare layouts at initialization on real text: loss, RMS and grad norm by depth")
    _add_declared(s, DemoConfig)
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
        "plan", help="device memory a run needs: weights, gradients, optimizer state, activations (measured), logits",
        description="Estimate the memory of `normlab train` with these settings on one device (rank), before "
        "renting one: weights, gradients and optimizer state from the parameter count, activations measured on "
        "this CPU for the run's own layout, width, precision and storage (scaled to its micro-batch and depth), "
        "the loss's logits. Example: normlab plan --size gpu-126m --layout peri --precision bf16 --seq-len 1024 "
        "--batch-size 32 --vocab-size 8192 --gpu-memory 80. On CUDA, train refuses a run that does not fit and "
        "a sweep runs as many runs side by side as fit.")
    _add_train_args(s)
    s.add_argument("--gpu-memory", type=float, metavar="GIB", help="the device's memory: say whether the run fits, "
                   "and which settings would")
    s.add_argument("--world", type=int, default=1, help="ranks the run is split over (DDP; with --fsdp the "
                   "weights, gradients and optimizer state are sharded over them)")
    s.set_defaults(func=_plan)
    s = sub.add_parser(
        "screen",
        help="screen layouts for stability before training (Kan et al.'s four steps)",
        description="Screen layouts before training (Kan et al. 2025, App. B): well-posedness from the layout "
        "data; hidden-state growth over depth under a weight stress s; each block's Jacobian norm; W2 "
        "amplification of an input perturbation; and the effect of a smaller residual step h. "
        "Example: normlab screen post pre peri hybrid --json screen.json",
    )
    s.add_argument("layouts", nargs="+", help="preset names, string forms, or .toml files with a 'layout' key")
    _add_declared(s, ScreenConfig)
    s.add_argument("--stress", dest="stresses", default=argparse.SUPPRESS, metavar="S1,S2,...",
                   help="= --stresses")
    _add_shortcuts(s, ("layers", "width", "heads"))
    s.add_argument("--set", action="append", metavar="model.NAME=VALUE", help="any model option (repeatable)")
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
    _add_declared(s, CompareConfig)
    _add_run_settings(s, ("size", "steps"), defaults=COMPARE_BASE)
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="any training setting, e.g. --set lr=1e-3")
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
    s.add_argument("--out", help="sweep folder (default runs/sweeps/NAME)")
    s.add_argument("--cancel", metavar="DIR", help="cancel the scheduler jobs of the sweep in DIR (executor slurm)")
    _add_declared(s, SweepConfig)  # --name, --workers, --executor, ...: over the file's or recipe's
    s.set_defaults(func=_sweep)
    s = sub.add_parser("summarize", help="tables and figures from a sweep: U-curves, divergences k/n, mean ± std, LR sensitivity")
    s.add_argument("sweep", help="a sweep folder (holding sweep.db)")
    s.add_argument("--out", help="where to write summary.md, the CSVs and report.html (default: the sweep folder)")
    s.set_defaults(func=_summarize)
    s = sub.add_parser("transfer", help="does a proxy sweep's ranking hold in wider or longer sweeps: Kendall's tau, "
                       "top-1/top-3 agreement, failures predicted vs seen (e.g. the transfer-* recipes)")
    s.add_argument("proxy", help="the proxy's sweep folder (layout x lr x seed)")
    s.add_argument("others", nargs="+", help="the sweeps to compare it with")
    s.add_argument("--lrs", choices=["common", "all"], default="common",
                   help="rank both on the learning rates they share, or each on all it ran (default: common)")
    s.set_defaults(func=_transfer)
    s = sub.add_parser("recipes", help="list the ready-made sweeps reproducing the papers' studies")
    s.add_argument("--names", action="store_true", help="print the names only")
    s.add_argument("--machine", choices=["cpu", "gpu"], help="only the recipes that run on this machine kind "
                   "(gpu: the gpu-* recipes, CUDA at the gpu-126m size on the English corpus)")
    s.set_defaults(func=_recipes)
    s = sub.add_parser(
        "recommend", help="a placement for your model: screen, proxy grid under stress, ranking with its evidence",
        description="Which placement should your model use? Screens every candidate at your depth (and width "
        "where the budget allows), trains proxies at your depth where possible under stress (the stress "
        "learning rate, your precision stored), the best over learning rates x seeds, and ranks them by "
        "divergences and stalls, best loss, the screen's verdict and LR sensitivity, each with its numbers; "
        "states what the proxy cannot predict, checks the ranking against the recipes, and writes the winner's "
        "settings for normlab, transformers, OLMo-core, torchtitan and litgpt. Within --budget minutes; run the "
        "same command again to resume. docs/experiments.md#recommend.")
    s.add_argument("model", help="a size preset (e.g. kim-400m), a .toml (size, layout, [model] options) or a "
                   "transformers config.json (or its folder)")
    _add_declared(s, RecommendConfig)
    _add_run_settings(s, ("steps",), defaults=RECOMMEND_BASE)
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a proxy run setting, e.g. --set data=PATH (repeatable)")
    s.set_defaults(func=_recommend)
    s = sub.add_parser("scan", help="hidden states, massive activations and angular distance by depth of a local causal LM",
                       description="Scan a local transformers causal LM (offline; needs transformers): per layer "
                       "RMS, variance, mean |h|, max |h|, median, max/median; top-100 and FP16 headroom; angular "
                       "distance. Writes table.md, scan.json, PNGs and index.html.")
    s.add_argument("model", help="a local folder with config.json and weights (and a tokenizer, optionally)")
    _add_declared(s, ScanConfig)
    s.set_defaults(func=_scan)
    s = sub.add_parser("doctor", help="a stability check of trained weights (and an fp16-safe copy where exact)",
                       description="One forward and backward on sample text through a run, a checkpoint or a "
                       "transformers folder: fp16 headroom and the first module that would overflow, massive "
                       "activations, per-layer gradient spread, attention logits, norm gains, per-block Jacobians; "
                       "each finding with its threshold. --fp16-copy writes a rescaled copy whose logits are "
                       "unchanged, where the layout makes the stream's scale irrelevant.")
    s.add_argument("model", help="a run directory, a checkpoint file or a local transformers folder")
    _add_declared(s, DoctorConfig)
    s.add_argument("--json", action="store_true", help="print the findings as JSON")
    s.set_defaults(func=_doctor)
    s = sub.add_parser("convert", help="move a trained run to another layout, the change of function measured",
                       description="Copy a run's newest weights into a model of another layout (same size and "
                       "options): weights the new layout shares are kept, new sites start at their stated init, "
                       "gamma <-> centered gains are rewritten exactly; reports KL(old || new) of the next-token "
                       "distributions on held-out text and writes a checkpoint folder for --init-from.")
    s.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint file")
    _add_declared(s, ConvertConfig)
    s.set_defaults(func=_convert)
    s = sub.add_parser("export", help="save a trained normlab model as a transformers checkpoint",
                       description="Export a run's newest checkpoint. By default (--arch auto) transformers' own "
                       "class where one computes the layout exactly (llama for pre, olmo2, gemma2 with "
                       "mlp=geglu-tanh, qwen3, gemma3, ...: no custom code), else the normlab class, for any "
                       "layout (load with trust_remote_code=True). --arch normlab or an architecture forces one; an "
                       "architecture that does not compute the layout is refused with the difference. The "
                       "tokenizer is stock transformers files either way.")
    s.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint file")
    s.add_argument("out", help="output folder")
    s.add_argument("--arch", default="auto", choices=["auto", "normlab", *EXPORTABLE],
                   help=f"auto (default: transformers' own class where exact, else normlab), normlab (any layout), or "
                   f"transformers' own class for the layout it computes: "
                   f"{', '.join(f'{a} ({p})' for a, p in EXPORTABLE.items())}")
    s.set_defaults(func=_export)
    s = sub.add_parser("eval", help="lm-evaluation-harness on a run, checkpoint, export or sweep (results into eval.json)",
                       description="Score models with lm-evaluation-harness (pip install 'normlab[eval]'). A run "
                       "directory or checkpoint is evaluated in memory with its tokenizer; an export folder as "
                       "lm-eval's --model hf loads it; a sweep folder: every run that finished ok. Results go to "
                       "eval.json beside the model and show in normlab report and normlab summarize.")
    s.add_argument("source", nargs="?", help="run directory, checkpoint, export folder or sweep folder")
    _add_declared(s, EvalConfig)
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
    _add_declared(s, PrepareConfig)
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
    text = without_unsafe_advice(" ".join(str(err).split()))
    return text if len(text) <= 2000 else text[:2000] + " ..."


if __name__ == "__main__":
    raise SystemExit(main())
