"""The settings of each command besides `train` (whose settings are `TrainConfig`), declared once
with the engine: `normlab <command> --help`, the checks and the docs come from here. No torch is
imported: the command line builds every parser from these declarations before any work starts.

- `ScreenConfig`: the stability screen (Kan et al. App. B);
- `CompareConfig`: `normlab compare` (the runs' own settings are `COMPARE_BASE` plus the user's);
- `CoordCheckConfig`: `normlab coordcheck` (its runs' settings are `COORDCHECK_BASE` plus the user's);
- `DemoConfig`, `ScanConfig`, `PrepareConfig`, `EvalConfig`: demo, scan, data prepare and eval;
- `RecommendConfig`: `normlab recommend` (its proxy runs' settings are `RECOMMEND_BASE` plus the user's).
`SweepConfig` (normlab.experiments.sweep) is declared the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from normlab.config.optimizers import OPTIMIZER_NAMES
from normlab.model.config import SIZES
from normlab.settings import check_fields, nonneg, open_unit, positive, setting

STRESS_MODES = ("output", "all")  # output: scale W_O and W_down; all: every attention/MLP weight
VAL_SPLITS = ("tail", "hash")
COMPARE_LAYOUTS = ("post", "pre", "peri", "hybrid")
# normlab compare's run settings: Kim et al.'s failure on a CPU in minutes (normlab.experiments.comparison)
COMPARE_BASE: dict[str, Any] = {
    "size": "micro-deep",
    "lr": 0.1,
    "steps": 150,
    "batch_size": 16,
    "seq_len": 128,
    "weight_decay": 0.0,
    "activation_dtype": "fp16",
    "probe_every": 10,
    "eval_every": 50,
}


def _some(values: tuple[Any, ...]) -> str | None:
    return None if values else "needs at least one value"


def _stresses(values: tuple[float, ...]) -> str | None:
    if not values:
        return "needs at least one stress value, e.g. 1,2,4,8"
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    return f"must be finite numbers > 0, e.g. 1,2,4,8 (invalid stress value {bad[0]})" if bad else None


def _h_factor(v: float) -> str | None:
    return None if 0 < v <= 1 else "must lie in (0, 1]"


def _limit(text: str) -> str | None:
    """--limit: a count (a positive integer) or a fraction in (0, 1]."""
    try:
        value = float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        return "is not a number; give examples per task (an integer, e.g. 50) or a fraction (e.g. 0.1)"
    if isinstance(value, int) and value < 1 or isinstance(value, float) and not 0 < value <= 1:
        return "is out of range; give a positive integer or a fraction in (0, 1]"
    return None


def _batch_size(text: str) -> str | None:
    return None if text == "auto" or (text.isdigit() and int(text) > 0) else "must be a positive integer or auto"


@dataclass(frozen=True)
class ScreenConfig:
    """The screen's settings (the model's shape comes from a size preset and model options, checked by
    the run configuration's engine: the same keys as `normlab train`)."""

    size: str = setting("tiny", "size preset", choices=tuple(SIZES), metavar="SIZE")
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides (n_layers, d_model, ...)
    stresses: tuple[float, ...] = setting(
        (1.0, 2.0, 4.0, 8.0), "weight stress factors s > 0, comma-separated", check=_stresses, metavar="S1,S2,..."
    )
    mode: str = setting(
        "output",
        "output: scale W_O and W_down by s (module outputs x s); all: scale every attention/MLP weight",
        choices=STRESS_MODES,
    )
    h_factor: float = setting(0.5, "also screen at h times this", check=_h_factor)
    batch: int = setting(2, "sequences in the screen's batch", check=positive)
    seq_len: int = setting(64, "tokens per sequence", check=positive)
    noise: float = setting(0.1, "input perturbation for the W2 step, relative to RMS(x0)", check=positive)
    iters: int = setting(10, "power iterations per block (Jacobian spectral norm)", check=positive)
    seed: int = setting(0, "seed of the init, the tokens and the perturbation", check=nonneg)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class CompareConfig:
    """`normlab compare`'s own settings; the runs' settings are COMPARE_BASE with the user's on top."""

    layouts: tuple[str, ...] = setting(
        COMPARE_LAYOUTS,
        "the layouts trained side by side, comma-separated (;-separated when a layout string holds commas)",
        check=_some,
        metavar="L1,L2,...",
    )
    workers: int | None = setting(None, "parallel runs (none: one per CPU core)", check=positive)
    out: str = setting("runs/compare", "output folder (a sweep folder: run it again and finished layouts are kept)")

    def __post_init__(self) -> None:
        check_fields(self)


# `normlab coordcheck`'s runs: micro's depth, a batch of 8 x 64, Adam at a learning rate where SP's widest
# models drift (the mup package's check uses a few steps at one such rate), no warm-up, fp32
COORDCHECK_BASE: dict[str, Any] = {"size": "micro", "lr": 1e-2, "batch_size": 8, "seq_len": 64, "weight_decay": 0.0}


def _widths(values: tuple[int, ...]) -> str | None:
    if len(values) < 2 or list(values) != sorted(set(values)) or values[0] < 1:
        return "must be two or more positive widths in increasing order (e.g. 32,64,128,256)"
    return None


@dataclass(frozen=True)
class CoordCheckConfig:
    """`normlab coordcheck`'s own settings; the runs' settings are COORDCHECK_BASE with the user's on top."""

    widths: tuple[int, ...] = setting(
        (32, 64, 128, 256), "the widths (d_model) compared, increasing", check=_widths, metavar="W1,W2,..."
    )
    steps: int = setting(4, "training steps after init (each recorded)", check=positive)
    seeds: int = setting(2, "seeds averaged per width", check=positive)
    out: str = setting("runs/coordcheck", "output folder: coordcheck.json and index.html (a folder normlab makes)")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DemoConfig:
    """`normlab demo`'s settings."""

    layouts: tuple[str, ...] = setting(
        COMPARE_LAYOUTS,
        "layouts to compare, comma-separated (;-separated when a layout string holds commas)",
        check=_some,
        metavar="L1,L2,...",
    )
    size: str = setting("tiny", "size preset", choices=tuple(SIZES), metavar="SIZE")
    seed: int = setting(0, "seed of the init and the batch", check=nonneg)

    def __post_init__(self) -> None:
        check_fields(self)


def _at_least_one(v: Any) -> str | None:
    return None if v >= 1 else "must be >= 1 (65504 / the largest activation wanted)"


@dataclass(frozen=True)
class DoctorConfig:
    """`normlab doctor`'s settings."""

    fp16_copy: str | None = setting(
        None, "write an fp16-safe rescaled copy here (refused, with the reason, where not exact)", metavar="OUT"
    )
    headroom: float = setting(16.0, "the copy's target: 65504 / largest activation", check=_at_least_one)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ConvertConfig:
    """`normlab convert`'s settings."""

    layout: str | None = setting(None, "the new layout (preset or string form), e.g. peri; required")
    out: str | None = setting(None, "output folder, new or empty (none: runs/SOURCE-LAYOUT, printed)")
    seed: int = setting(0, "seed of the new sites' init", check=nonneg)
    unit_gamma: bool = setting(
        False,
        "new output and embedding norms start at gamma 1 instead of the RMS of what they normalize in the old model",
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ScanConfig:
    """`normlab scan`'s settings."""

    out: str | None = setting(None, "output folder (default MODEL/scan)")
    text_file: str | None = setting(None, "texts to run, separated by blank lines (default: four built-in texts)")
    max_len: int = setting(64, "tokens per text", check=positive)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PrepareConfig:
    """`normlab data prepare`'s settings."""

    out: str | None = setting(None, "prepare: a new or empty folder for train.bin, val.bin, tokenizer.json, meta.json")
    tokenizer: str = setting("bytes", "bytes | bpe:VOCAB (trained on the source) | a tokenizer.json")
    text_field: str = setting("text", "the text field of JSONL records / dataset rows")
    val_fraction: float = setting(0.1, "fraction of documents held out", check=open_unit)
    val_split: str = setting(
        "tail",
        "tail: the last documents; hash: a fixed sample of documents by the SHA-256 of their text",
        choices=VAL_SPLITS,
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class EvalConfig:
    """`normlab eval`'s settings (lm-evaluation-harness)."""

    tasks: tuple[str, ...] = setting(
        ("normlab_local",),
        "lm-eval task or group names, comma-separated (default normlab_local: three offline tasks)",
        check=_some,
        metavar="T1,T2,...",
    )
    limit: str | None = setting(None, "examples per task (an integer, or a fraction like 0.1)", check=_limit)
    batch_size: str = setting("1", "lm-eval batch size (an integer, or auto)", check=_batch_size)
    device: str = setting("cpu", "cpu, cuda, cuda:0, ...")
    num_fewshot: int | None = setting(
        None, "few-shot examples (none: each task's own, zero for normlab's)", check=nonneg
    )
    samples: bool = setting(False, "also write each item's request and response to eval_samples/TASK.jsonl")
    verbose: bool = setting(
        False,
        "show lm-eval's and transformers' log and progress bars (default: the results, "
        "the items scored and what was truncated)",
    )
    trust_remote_code: bool = setting(
        False,
        "let an export folder's own model code run (needed only where normlab "
        "did not write it: a normlab export's modeling_normlab.py is verified against "
        "this version's and runs without it)",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def limit_value(self) -> int | float | None:
        if self.limit is None:
            return None
        return float(self.limit) if "." in self.limit or "e" in self.limit.lower() else int(self.limit)

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `normlab.evaluation.harness.evaluate`."""
        return dict(
            limit=self.limit_value,
            batch_size=self.batch_size,
            device=self.device,
            num_fewshot=self.num_fewshot,
            samples=self.samples,
            trust_remote_code=self.trust_remote_code,
            verbose=self.verbose,
        )


# normlab recommend's default candidates: the families of the papers (Post-, Pre-, Peri-LN and OLMo 2's
# reordered Peri-LN; HybridNorm; DeepNorm; Mix-LN; QK-norm) and the newer methods (gated attention, LayerNorm
# Scaling, LayerScale, ReZero, Admin, NormFormer, DyT); then issue 42's (Derf, nGPT, SeeDNorm, single-scale
# RMSNorm, GPAS, learned skip/branch lambdas, hyper-connections and mHC) last, the dearest to train (HC, mHC)
# at the end: within each of the cheap screen's families the order given is the order tried, so a small budget
# keeps the answer it gave before them (docs/experiments.md, "Recommend")
RECOMMEND_CANDIDATES = (
    "pre",
    "peri",
    "post",
    "olmo2",
    "hybrid",
    "deepnorm",
    "mix-ln",
    "qwen3",
    "pre-gate",
    "pre-lns",
    "pre-layerscale",
    "rezero",
    "admin",
    "normformer",
    "pre-dyt",
    "peri-derf",
    "ngpt",
    "pre-derf",
    "pre-seednorm",
    "pre-ssrms",
    "pre-gpas",
    "pre-lambda",
    # issue 56's 2026 forms, after the others (a small budget keeps its answer): Keel reached the lowest loss of
    # lr-2026 at 3e-2, SpanNorm tied Peri-LN's best, AttnRes trained at every rate (docs/results.md)
    "keel",
    "spannorm",
    "attnres",
    # issue 67's norms, after issue 56's: GatedNorm as marin ships it and its sandwich form, TaperNorm
    "pre-gatednorm",
    "sandwich-gatednorm",
    "pre-taper",
    # SiameseNorm (issue 67): below Pre-LN at every rate from 3e-3 up in siamese-verdict, its best under Peri-LN's
    "siamese",
    "pre-hc",
    "pre-mhc",
)
# the proxy runs' settings (normlab.recommend): the recipes' stress settings (stress-kim-fp16), probes every
# 25 steps for the largest activation, no weight decay (Kan et al. Table 1's divergence setting); never
# compiled (on CUDA torch.compile would cost each 150-step proxy more than its training)
RECOMMEND_BASE: dict[str, Any] = {
    "size": "micro-deep",
    "steps": 150,
    "batch_size": 16,
    "seq_len": 128,
    "weight_decay": 0.0,
    "probe_every": 25,
    "eval_every": 0,
    "eval_batches": 4,
    "compile": False,
}
PRECISIONS = ("bf16", "fp16")
RECOMMEND_OPTIMIZERS = tuple(sorted(OPTIMIZER_NAMES))  # optim.optimizer's choices (normlab.config.optimizers), a-z
RECOMMEND_BUDGET = 15.0  # minutes, the default
QUICK_BUDGET = 3.0  # minutes, the default of --quick (issue 53: two candidates answered within 3 minutes)


def _lrs(values: tuple[Any, ...]) -> str | None:
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    return f"must be learning rates > 0 (invalid: {bad[0]})" if bad else None


def _seeds(values: tuple[Any, ...]) -> str | None:
    return "must be integers >= 0" if any(v < 0 for v in values) else None


# --set keys recommend decides itself, and where they come from instead (the proxies' shape is the user's model's)
RECOMMEND_DECIDES = {
    "layout": "--candidates",
    "lr": "--lrs",
    "seed": "--seeds",
    "out": "--out",
    "progress": "the command",
    "size": "your model file",
    "tokenizer": "nothing: the proxies read bytes (vocabulary 256)",
    "vocab_size": "nothing: the proxies read bytes (vocabulary 256)",
    "optimizer": "--optimizer",
    "optim.optimizer": "--optimizer",
}


FAULT_SETTINGS = ("fault", "fault_step", "fault_scale")  # run.*: a fault injected on purpose (normlab.train.faults)


def check_no_fault(extra: dict[str, Any], command: str) -> None:
    """Refuse a fault setting (run.fault, run.fault_step, run.fault_scale) in a command that measures healthy
    runs (recommend's proxies, coordcheck's widths): one line, ConfigError. Unknown keys are left to the typed
    settings, which refuse them with their own line."""
    from normlab.config.train import resolve_key
    from normlab.errors import ConfigError

    for key in extra:
        try:
            kind, name = resolve_key(key)
        except ConfigError:
            continue
        if kind == "leaf" and name in FAULT_SETTINGS:
            raise ConfigError(
                f"--set {key}=...: {command} measures runs trained as given, and run.fault, run.fault_step and "
                "run.fault_scale inject a fault on purpose (the early-warning study: normlab train, the warn-* "
                "recipes); drop it"
            )


def check_recommend_settings(extra: dict[str, Any]) -> None:
    """Refuse --set keys recommend decides: the proxies' shape, tokenizer, layouts, lrs, seeds, folder; and
    a fault (`check_no_fault`)."""
    from normlab.errors import ConfigError
    from normlab.model.config import ModelConfig

    check_no_fault(extra, "recommend")
    shape = set(ModelConfig.__dataclass_fields__)
    for key in extra:
        if key in RECOMMEND_DECIDES or key in shape or key.startswith("model."):
            how = RECOMMEND_DECIDES.get(key, "your model file (and --depth for the proxies' depth)")
            raise ConfigError(f"--set {key}=... is decided by recommend: give it through {how}")


@dataclass(frozen=True)
class RecommendConfig:
    """`normlab recommend`'s settings."""

    precision: str | None = setting(
        None,
        "the precision you train in: bf16 or fp16 (none: the config's torch_dtype, "
        "else bf16); fp16 stores the proxies' activations in fp16",
        choices=PRECISIONS,
    )
    budget: float = setting(
        RECOMMEND_BUDGET,
        "minutes for all of it: screen, proxy runs, report; a small budget buys a smaller "
        "answer (fewer candidates, rounds, seeds), stated as such",
        check=positive,
        metavar="MIN",
    )
    candidates: tuple[str, ...] = setting(
        RECOMMEND_CANDIDATES,
        "layouts to consider, comma-separated (;-separated "
        "when a layout string holds commas); your current placement is added",
        check=_some,
        metavar="L1,L2,...",
    )
    out: str = setting("runs/recommend", "output folder (run the same command again to resume)")
    workers: int | None = setting(None, "parallel proxy runs (none: one per CPU core)", check=positive)
    lrs: tuple[float, ...] = setting(
        (),
        "the final round's learning rates (empty: planned from the budget, "
        "1e-2 ... 1e-1); the largest is the stress round's",
        check=_lrs,
        metavar="LR1,LR2,...",
    )
    seeds: tuple[int, ...] = setting(
        (), "the final round's seeds (empty: planned, 2 or 3)", check=_seeds, metavar="S1,S2,..."
    )
    depth: int | None = setting(
        None,
        "the proxies' depth, at most yours (none: planned: 12, deeper up to yours as the "
        "budget allows, 8 or 6 only where 12 does not fit)",
        check=positive,
        metavar="LAYERS",
    )
    optimizer: str = setting(
        "adamw",
        "the optimizer your proxies train with, as you will: adamw | muon (Muon on the "
        "blocks' matrices, AdamW on the rest) | sgd",
        choices=RECOMMEND_OPTIMIZERS,
    )
    verify: bool = setting(
        False,
        "spend part of the budget training the best k candidates (k >= 2, from the budget) "
        "at the widest width that fits, and say whether the proxy's order held there",
    )
    tokens: int | None = setting(
        None,
        "the tokens your run will train on (e.g. 2e11): where the evidence ends is said against it, and for "
        "DyT/Derf candidates whether your budget lies in another regime than the proxies' (arXiv 2604.23434)",
        check=positive,
        metavar="N",
    )
    tax_compiled: bool = setting(
        True,
        "also time the norm tax under torch.compile (its compilation takes 30-100 s on a CPU) where at least 150 s "
        "of the budget are left; --no-tax-compiled times it eager only",
    )
    ladder: str = setting(
        "auto",
        "the proxy widths the effective speedup is measured at beside the proxy's 64: auto (32 and 128 where the "
        "budget holds them, else 16 and 32), wide (32, 128), narrow (16, 32: a fraction of a proxy run's cost), "
        "none (the proxy alone)",
        choices=("auto", "wide", "narrow", "none"),
    )
    quick: bool = setting(
        False,
        "the quick question: your model against only the --candidates given (default: yours+out, your model with "
        "output norms; where it has them, yours+emb, else yours-qk), no screen, 2 seeds first; with the default "
        "budget, 3 minutes",
    )
    recalibrate: bool = setting(
        False,
        "measure this machine's speed again before planning (a few seconds) and keep the faster of that and "
        "the cached calibration: for a calibration measured while the machine was busy",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def with_quick_defaults(self) -> RecommendConfig:
        """--quick's defaults where the user left them: 3 minutes; unchanged without --quick. Its candidate where
        none is given depends on the user's placement: `normlab.recommend.planning.derived.quick_default`, chosen with
        the candidates (`normlab.recommend.planning.inputs.choose`)."""
        from dataclasses import replace

        if not self.quick:
            return self
        return replace(self, budget=QUICK_BUDGET if self.budget == RECOMMEND_BUDGET else self.budget)
