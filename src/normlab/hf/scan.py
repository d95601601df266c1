"""`normlab scan MODEL_DIR`: look inside any local causal LM the way the papers do.

Runs the model on a few texts and reports, per layer of the residual stream (layer 0 = the stream
entering the first block, l = the output of block l-1, captured by hooks on the blocks, so the
final norm is never mixed in): RMS, variance, mean |h|, the largest |activation|, the median |h|
and their ratio; globally the top-100 activations and the headroom to the FP16 maximum 65504; and
the angular distance between every pair of layers (Kim et al. Figs. 1, 9, 11).

A layer is flagged "massive" when its largest |h| exceeds 100 and 1000x its median |h| (the scale of
Sun et al. 2024's massive activations), and the model is flagged "near FP16 limit" when the headroom
falls below 10x. Offline only: the model and its tokenizer come from a local folder; without a
tokenizer the texts are fed as bytes (mod the vocabulary).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import torch

from normlab.data.corpus import DataError
from normlab.diagnostics.attach import StreamProbe, find_blocks
from normlab.diagnostics.stats import FP16_MAX, angular_matrix, hidden_stats, massive_activations
from normlab.hf.folder import check_folder, load_tokenizer, reading
from normlab.hf.library import require_transformers
from normlab.io import atomic_write_bytes, atomic_write_json, own_folder
from normlab.runs.files import RunDir

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "In 1905, Albert Einstein published four papers that changed physics.",
    "def add(a, b):\n    return a + b\n",
)
MASSIVE_MIN, MASSIVE_RATIO, HEADROOM_WARN = 100.0, 1000.0, 10.0


def encode_samples(
    texts: list[str] | tuple[str, ...],
    vocab: int,
    tok: Any = None,
    max_len: int = 64,
    min_len: int = 2,
    where: str = "",
) -> torch.Tensor:
    """The sample texts as a (texts, n) batch of ids, cut to the shortest and to ``max_len``: with ``tok``
    (a transformers tokenizer, or a normlab one: `encode`, no `pad_token`), else bytes mod ``vocab``."""
    if tok is None:
        ids = [[b % vocab for b in t.encode()] for t in texts]
    elif hasattr(tok, "encode") and not hasattr(tok, "pad_token"):  # a normlab tokenizer
        ids = [list(tok.encode(t)) for t in texts]
    else:  # a transformers tokenizer
        ids = [tok(t, verbose=False)["input_ids"] for t in texts]  # cut to max_len below: no length warning
    n = min(min(len(i) for i in ids), max_len)
    if n < min_len:
        raise DataError(f"the sample texts gave {n} token(s){where}; give longer texts (--text-file)")
    return torch.tensor([i[:n] for i in ids], dtype=torch.long)


def _tokens(path: Path, model: Any, texts: list[str], max_len: int, tok: Any = None) -> torch.Tensor:
    return encode_samples(texts, model.config.vocab_size, tok, max_len, where=f" with {path}'s tokenizer")


def scan(path: str | Path, out: str | Path, texts: list[str] | None = None, max_len: int = 64) -> dict[str, Any]:
    """Scan the model in ``path``; write table.md, scan.json, figures and index.html into ``out`` (a new
    folder, or one a scan made: never over files normlab did not write)."""
    path, out = Path(path), Path(out)
    if not (path / "config.json").is_file():
        raise DataError(
            f"{path} is not a local transformers model folder (no config.json); give a folder written "
            "by save_pretrained or normlab export"
        )
    if RunDir(path).has_metrics() or RunDir(path).has_checkpoints():
        raise DataError(
            f"{path} is a normlab run directory, not a transformers folder: export it first "
            f"(normlab export {path} DIR) and scan DIR"
        )
    own_folder(out, "scan", claim=False)  # someone's files, read-only storage: refused before any work
    check_folder(path)  # bounded JSON, no code of its own, readable weights: before anything is written or loaded
    tf = require_transformers()
    import normlab.hf.modeling  # noqa: F401 - registers the normlab class, so exported normlab models scan too

    tok = load_tokenizer(path)  # the one rule doctor keeps too
    with reading(path, "a transformers causal LM"):  # unknown model type, a field of the wrong type, ...
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, trust_remote_code=False
        ).eval()
    x = _tokens(path, model, list(texts or TEXTS), max_len, tok)
    out = own_folder(out, "scan")  # claimed once every refusal is behind: a refused scan leaves no folder
    blocks_path, blocks = find_blocks(model)
    hidden = StreamProbe(model, list(blocks)).capture(input_ids=x)
    layers = []
    for i, h in enumerate(hidden):
        s = hidden_stats(h)
        flag = s["max_abs"] > MASSIVE_MIN and s["max_median_ratio"] >= MASSIVE_RATIO
        layers.append({"layer": i, **s, "massive": flag})
    glob = massive_activations(hidden[1:])
    ang = angular_matrix(hidden)
    result = {
        "model": str(path),
        "model_type": model.config.model_type,
        "blocks": blocks_path,
        "tokens": list(x.shape),
        "layers": layers,
        "global": glob,
        "angular": ang,
        "flags": {
            "massive_layers": [r["layer"] for r in layers if r["massive"]],
            "near_fp16_limit": glob["fp16_headroom"] < HEADROOM_WARN,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "scan.json", result)
    table = format_table(result)
    atomic_write_bytes(out / "table.md", table.encode())
    result["html"] = _page(out, result, table)
    result["table"] = table
    return result


def format_table(r: dict[str, Any]) -> str:
    g = r["global"]
    lines = [
        f"# scan of {r['model']} ({r['model_type']}, blocks at `{r['blocks']}`, "
        f"tokens {r['tokens'][0]} x {r['tokens'][1]})",
        "",
        "| layer | rms | var | mean abs | max abs | median abs | max/median | angular to next | flag |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["layers"]:
        i = row["layer"]
        nxt = f"{r['angular'][i][i + 1]:.3f}" if i + 1 < len(r["angular"]) else "-"
        lines.append(
            f"| {i} | {row['rms']:.4g} | {row['var']:.4g} | {row['mean_abs']:.4g} | {row['max_abs']:.4g} | "
            f"{row['median_abs']:.4g} | {row['max_median_ratio']:.4g} | {nxt} | {'MASSIVE' if row['massive'] else ''} |"
        )
    lines += [
        "",
        f"top-100 |h|: {g['top100_min']:.4g} .. {g['top100_max']:.4g}; FP16 headroom {g['fp16_headroom']:.4g}x "
        f"(65504 / max); max/median {g['max_median_ratio']:.4g}",
    ]
    flags = r["flags"]
    lines.append(
        "flags: "
        + (
            "; ".join(
                ([f"massive activations in layers {flags['massive_layers']}"] if flags["massive_layers"] else [])
                + (["near the FP16 limit"] if flags["near_fp16_limit"] else [])
            )
            or "none"
        )
    )
    return "\n".join(lines) + "\n"


def _page(out: Path, r: dict[str, Any], table: str) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    from normlab.pages import figure_html, write_page

    depth = [row["layer"] for row in r["layers"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, label in ((axes[0], "var", "variance"), (axes[1], "mean_abs", "mean |h|")):
        ax.plot(depth, [row[key] for row in r["layers"]], marker="o")
        ax.set_yscale("log")
        ax.set_xlabel("layer (0 = embedding output)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} by depth")
    ax = axes[2]
    ax.plot(depth, [row["max_abs"] for row in r["layers"]], marker="o", label="max |h|")
    ax.plot(depth, [row["median_abs"] for row in r["layers"]], marker=".", label="median |h|")
    ax.axhline(FP16_MAX, color="tab:red", ls="--", label="FP16 max 65504")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("|h|")
    ax.set_title("Largest and median activation by depth")
    ax.legend(fontsize=8)
    fig.tight_layout()
    sections = [figure_html(fig, out, "depth", "Hidden states by depth (Kim Figs. 1, 11)")]
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(np.array(r["angular"]), origin="lower", cmap="magma_r", vmin=0, vmax=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("layer")
    ax.set_title("Angular distance between layers")
    fig.colorbar(im, ax=ax, label="arccos(cos)/π")
    fig.tight_layout()
    sections.append(
        figure_html(fig, out, "angular_distance", "Angular distance at the last token (Gromov et al.; Kim Fig. 9)")
    )
    body = (
        f"<h1>normlab scan</h1><pre>{html.escape(table)}</pre>"
        + "\n".join(sections)
        + f"<script type='application/json' id='scan'>{html.escape(json.dumps(r['flags']))}</script>"
    )
    return write_page(out / "index.html", f"normlab scan: {r['model']}", body)


def scan_command(model: str, cfg: Any) -> dict[str, Any]:
    """`normlab scan` with its `ScanConfig`: texts from --text-file (separated by blank lines), into
    --out or MODEL/scan."""
    from normlab.errors import ConfigError

    texts = None
    if cfg.text_file:
        if not Path(cfg.text_file).is_file():
            raise ConfigError(f"--text-file {cfg.text_file} does not exist")
        texts = [t for t in Path(cfg.text_file).read_text(errors="replace").split("\n\n") if t.strip()]
        if not texts:
            raise ConfigError(f"{cfg.text_file} has no text (texts are separated by blank lines)")
    return scan(model, cfg.out or str(Path(model) / "scan"), texts, cfg.max_len)
