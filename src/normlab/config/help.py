"""Each command's one-line help, its `--help` description and its inputs besides its settings (positional
arguments, display switches): the words of `normlab COMMAND --help`, kept beside the commands'
configurations (normlab.config.commands) so the command line only wires them."""

from __future__ import annotations

from typing import Any

HELP: dict[str, tuple[str, str | None]] = {
    "layouts": ("list the preset layouts with their equations and sources", None),
    "show": ("print a layout resolved per layer, with the parameter count", None),
    "demo": ("compare layouts at initialization on real text: loss, RMS and grad norm by depth", None),
    "train": (
        "train a model with a layout and record the run (metrics, checkpoints, summary)",
        "Train one model. Example: normlab train --layout peri --size tiny --lr 3e-3 --steps 300 --out "
        "runs/peri. Settings come from defaults, then --config FILE.toml, then flags. Under torchrun it "
        "trains data parallel (DDP, or FSDP2 with --fsdp).",
    ),
    "plan": (
        "device memory a run needs: weights, gradients, optimizer state, activations (measured), logits",
        "Estimate the memory of `normlab train` with these settings on one device (rank), before renting one:"
        " weights, gradients and optimizer state from the parameter count, activations measured on this CPU "
        "for the run's own layout, width, precision and storage (scaled to its micro-batch and depth), the "
        "loss's logits. Example: normlab plan --size gpu-126m --layout peri --precision bf16 --seq-len 1024 "
        "--batch-size 32 --vocab-size 8192 --gpu-memory 80. On CUDA, train refuses a run that does not fit "
        "and a sweep runs as many runs side by side as fit.",
    ),
    "screen": (
        "screen layouts for stability before training (Kan et al.'s four steps)",
        "Screen layouts before training (Kan et al. 2025, App. B): well-posedness from the layout data; "
        "hidden-state growth over depth under a weight stress s; each block's Jacobian norm; W2 amplification"
        " of an input perturbation; and the effect of a smaller residual step h. Example: normlab screen post"
        " pre peri hybrid --json screen.json",
    ),
    "report": ("figures and one HTML page comparing run directories", None),
    "compare": (
        "train post, pre, peri and hybrid side by side in fp16 with probes on, then write the report",
        "The main job (what `make demo` runs): the layouts trained with the same settings on the default "
        "corpus, in parallel, with activations stored in fp16 and probes on; then one HTML report that opens "
        "with a reading of the runs. The defaults (micro-deep: d 64, 12 layers; lr 0.1, no weight decay, 150 "
        "steps, fp16 activations) provoke Pre-LN's fp16 overflow in about two minutes on 2 cores. Resumable: "
        "run it again and finished layouts are not retrained.",
    ),
    "sweep": (
        "run a grid of trainings in parallel into one SQLite store (resumable)",
        "Run a sweep: a base config and a grid (the product of the axes). Example: normlab sweep --recipe "
        "kim-lr; normlab sweep my.toml --workers 2; normlab sweep --grid layout=pre,peri --grid lr=1e-3,3e-3 "
        "--grid seed=0,1 --set size=micro --set steps=200. Re-running skips finished runs.",
    ),
    "summarize": ("tables and figures from a sweep: U-curves, divergences k/n, mean ± std, LR sensitivity", None),
    "transfer": (
        "does a proxy sweep's ranking hold in wider or longer sweeps: Kendall's tau, top-1/top-3 agreement, "
        "failures predicted vs seen (e.g. the transfer-* recipes)",
        None,
    ),
    "leadtime": (
        "how early each early-warning signal fires before a run diverges, and its false alarms on healthy runs",
        "Replay every run of the sweeps through the early warnings (the live alerts' detectors: stream and "
        "attention-logit growth against the precision, gradient-norm, loss and update/weight spikes, the spike "
        "score) and tabulate per signal and placement the events warned of, the lead in steps and the false "
        "alarms; then per detector and failure kind (the sweep folder) recall, precision, false alarms per 1,000 "
        "healthy steps and lead with 95% intervals, and each detector's precision-recall curve over its threshold "
        "(the QK spectral entropy and per-head max logit too). Example: normlab leadtime "
        "runs/recipes/warn-lr-jump runs/recipes/warn-logit-growth",
    ),
    "coordcheck": (
        "the coordinate check: activation sizes after a few steps across widths (muP's flat lines, SP's growth)",
        "Train LAYOUT at each width for a few steps at one learning rate and record the RMS of every block's "
        "updates and outputs and of the logits, and of their change since init (Yang et al. 2022, Tensor Programs"
        " V). Under a parametrization that transfers the lines are flat across widths. Example: normlab "
        "coordcheck peri --set model.parametrization=mup --widths 32,64,128,256 --steps 4 --out runs/cc-peri-mup."
        " Writes OUT/coordcheck.json (rows width, step, site, rms) and OUT/index.html.",
    ),
    "recipes": ("list the ready-made sweeps reproducing the papers' studies", None),
    "recommend": (
        "a placement for your model: screen, proxy grid under stress, ranking with its evidence",
        "Which placement should your model use? Screens every candidate at your depth (and width where the "
        "budget allows), trains proxies at your depth where possible under stress (the stress learning rate, "
        "your precision stored), the best over learning rates x seeds, and ranks them by divergences and "
        "stalls, best loss, the screen's verdict and LR sensitivity, each with its numbers; states what the "
        "proxy cannot predict, checks the ranking against the recipes, and writes the winner's settings for "
        "normlab, transformers, OLMo-core, torchtitan and litgpt. Within --budget minutes; run the same "
        "command again to resume. docs/experiments.md#recommend.",
    ),
    "scan": (
        "hidden states, massive activations and angular distance by depth of a local causal LM",
        "Scan a local transformers causal LM (offline; needs transformers): per layer RMS, variance, mean "
        "|h|, max |h|, median, max/median; top-100 and FP16 headroom; angular distance. Writes table.md, "
        "scan.json, PNGs and index.html.",
    ),
    "doctor": (
        "a stability check of trained weights (and an fp16-safe copy where exact)",
        "One forward and backward on sample text through a run, a checkpoint or a transformers folder: fp16 "
        "headroom and the first module that would overflow, massive activations, per-layer gradient spread, "
        "attention logits, norm gains, per-block Jacobians; each finding with its threshold. --fp16-copy "
        "writes a rescaled copy whose logits are unchanged, where the layout makes the stream's scale "
        "irrelevant.",
    ),
    "convert": (
        "move a trained run to another layout, the change of function measured",
        "Copy a run's newest weights into a model of another layout (same size and options): weights the new "
        "layout shares are kept, new sites start at their stated init, gamma <-> centered gains are rewritten"
        " exactly; reports KL(old || new) of the next-token distributions on held-out text and writes a "
        "checkpoint folder for --init-from.",
    ),
    "export": (
        "save a trained normlab model as a transformers checkpoint",
        "Export a run's newest checkpoint. By default (--arch auto) transformers' own class where one "
        "computes the layout exactly (llama for pre, olmo2, gemma2 with mlp=geglu-tanh, qwen3, gemma3, ...: "
        "no custom code), else the normlab class, for any layout (load with trust_remote_code=True). --arch "
        "normlab or an architecture forces one; an architecture that does not compute the layout is refused "
        "with the difference. The tokenizer is stock transformers files either way.",
    ),
    "eval": (
        "lm-evaluation-harness on a run, checkpoint, export or sweep (results into eval.json)",
        "Score models with lm-evaluation-harness (pip install 'normlab[eval]'). A run directory or checkpoint"
        " is evaluated in memory with its tokenizer; an export folder as lm-eval's --model hf loads it; a "
        "sweep folder: every run that finished ok. Results go to eval.json beside the model and show in "
        "normlab report and normlab summarize.",
    ),
    "data": ("fetch a corpus, or prepare token files from text/JSONL/datasets", None),
}

TRUE = "store_true"
# Each command's inputs besides its configuration's settings: positional arguments and display switches,
# as argparse takes them ((flags...), options).
INPUTS: dict[str, list[tuple[tuple[str, ...], dict[str, Any]]]] = {
    "layouts": [
        (("--names",), {"action": TRUE, "help": "print the names only"}),
        (("--markdown",), {"action": TRUE, "help": "print a Markdown table (as in docs/layouts.md)"}),
    ],
    "show": [(("layout",), {"help": "preset name or string form, e.g. peri or 'attn=AB,mlp=AB,final'"})],
    "plan": [
        (
            ("--gpu-memory",),
            {
                "type": float,
                "metavar": "GIB",
                "help": "the device's memory: say whether the run fits, and which settings would",
            },
        ),
        (
            ("--world",),
            {
                "type": int,
                "default": 1,
                "help": "ranks the run is split over (DDP; with --fsdp the "
                "weights, gradients and optimizer state are sharded over them)",
            },
        ),
    ],
    "screen": [
        (("layouts",), {"nargs": "+", "help": "preset names, string forms, or .toml files with a 'layout' key"}),
        (("--json",), {"help": "write every measurement to this JSON file"}),
        (("-v", "--verbose"), {"action": TRUE, "help": "explain the well-posedness verdict per sublayer"}),
    ],
    "report": [
        (("runs",), {"nargs": "+", "help": "run directories written by normlab train, or a sweep folder (its runs)"}),
        (("--out",), {"help": "output folder (default: report/ beside the first run)"}),
    ],
    "sweep": [
        (("file",), {"nargs": "?", "help": "a sweep TOML file (name, [base], [grid]; see docs/experiments.md)"}),
        (("--recipe",), {"help": "a ready-made sweep (see `normlab recipes`)"}),
        (("--grid",), {"action": "append", "metavar": "AXIS=V1,V2", "help": "add or replace a grid axis (repeatable)"}),
        (("--out",), {"help": "sweep folder (default runs/sweeps/NAME)"}),
        (("--cancel",), {"metavar": "DIR", "help": "cancel the scheduler jobs of the sweep in DIR (executor slurm)"}),
    ],
    "summarize": [
        (("sweep",), {"help": "a sweep folder (holding sweep.db)"}),
        (("--out",), {"help": "where to write summary.md, the CSVs and report.html (default: the sweep folder)"}),
    ],
    "transfer": [
        (("proxy",), {"help": "the proxy's sweep folder (layout x lr x seed)"}),
        (("others",), {"nargs": "+", "help": "the sweeps to compare it with"}),
        (
            ("--lrs",),
            {
                "choices": ["common", "all"],
                "default": "common",
                "help": "rank both on the learning rates they share, or each on all it ran (default: common)",
            },
        ),
        (
            ("--record",),
            {
                "metavar": "FILE.json",
                "help": "also write the agreement numbers, the command and "
                "the study's status into this transfer record (kept entries updated); recommend's "
                "report renders the package's copy, src/normlab/recommend/evidence/transfer_record.json",
            },
        ),
    ],
    "leadtime": [
        (("sweeps",), {"nargs": "+", "help": "sweep folders (e.g. the warn-* recipes')"}),
        (("--json",), {"metavar": "FILE.json", "help": "also write the table and every run's warnings as JSON"}),
        (
            ("--record",),
            {
                "metavar": "FILE.json",
                "help": "also write each detector's measured precision and lead at its default threshold, the "
                "record live alerts quote (the package's copy: src/normlab/diagnostics/warning_record.json)",
            },
        ),
        (("--figure",), {"metavar": "FILE.png", "help": "also draw the precision-recall curves and lead times"}),
        (
            ("--horizon",),
            {
                "type": int,
                "default": 500,
                "metavar": "STEPS",
                "help": "a warning counts when an event follows it within this many steps (default 500)",
            },
        ),
    ],
    "recipes": [
        (("--names",), {"action": TRUE, "help": "print the names only"}),
        (
            ("--machine",),
            {
                "choices": ["cpu", "gpu"],
                "help": "only the recipes that run on this machine kind "
                "(gpu: the gpu-* recipes, CUDA at the gpu-126m size on the English corpus)",
            },
        ),
    ],
    "recommend": [
        (
            ("model",),
            {
                "help": "a size preset (e.g. kim-400m), a .toml (size, layout, [model] options) or a "
                "transformers config.json (or its folder)"
            },
        )
    ],
    "scan": [(("model",), {"help": "a local folder with config.json and weights (and a tokenizer, optionally)"})],
    "doctor": [
        (("model",), {"help": "a run directory, a checkpoint file or a local transformers folder"}),
        (("--json",), {"action": TRUE, "help": "print the findings as JSON"}),
    ],
    "convert": [(("source",), {"help": "a run directory (its newest checkpoint) or a checkpoint file"})],
    "coordcheck": [(("layout",), {"help": "a preset name or string form (normlab layouts)"})],
    "export": [
        (("source",), {"help": "a run directory (its newest checkpoint) or a checkpoint file"}),
        (("out",), {"help": "output folder"}),
    ],
    "eval": [
        (("source",), {"nargs": "?", "help": "run directory, checkpoint, export folder or sweep folder"}),
        (("--list",), {"action": TRUE, "help": "list normlab's tasks and the papers' task groups"}),
        (
            ("--tasks-dir",),
            {"action": TRUE, "help": "print the folder of normlab's task YAMLs (for lm_eval --include_path) and exit"},
        ),
    ],
}
