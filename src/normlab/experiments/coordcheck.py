"""`normlab coordcheck`: the coordinate check of Yang et al. 2022 (Tensor Programs V, Sec. 5 and Fig. 5; the
`mup` package's `get_coord_data`): train the same layout at several widths for a few steps at one learning rate
and record, at every step, the size of each activation. Under a parametrization that transfers (muP) the
lines against width are flat; under SP the updates and the logits grow with width and the run blows up first at
the widest model.

What is recorded, per width, step and site, averaged over seeds: the RMS of the activation (``rms``) and of its
change since step 0 (``delta_rms``, the part training added: where SP's growth shows first). Sites: the embedding's
output, each block's attention and MLP updates (exactly the tensors added to the stream, under every layout), each
block's output (the stream) and the logits. The steps use a constant learning rate (no warm-up, as the mup
package's check), one fixed batch, the layout's optimizer and parametrization from the settings.

``slope``: the least-squares exponent s of rms ~ width^s over the widths, per site and step (0: flat). Written to
OUT/coordcheck.json and drawn in OUT/index.html.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import torch.nn.functional as F

from normlab.config.commands import COORDCHECK_BASE, CoordCheckConfig, check_no_fault
from normlab.config.train import TrainConfig, resolve_key
from normlab.data.dataset import TokenData, batch_at
from normlab.errors import ConfigError
from normlab.io import atomic_write_json, own_folder, staged_folder
from normlab.model.build import build_model
from normlab.pages import figure_html, fmt, legend, panels, table_html, write_page
from normlab.train.optim import make_optimizer, set_lr
from normlab.train.trainer import load_run_data

KINDS = ("embedding", "attn_update", "mlp_update", "block_output", "logits")


class CoordRow(TypedDict):
    """One site at one width and step, averaged over seeds: the RMS of its output and of its change since step 0."""

    width: int
    step: int
    site: str
    kind: str
    layer: int  # -1: not in a block (embedding, logits)
    rms: float
    delta_rms: float


@dataclass(frozen=True)
class CoordCheck:
    """What one check measured: rows {width, step, site, kind, layer, rms, delta_rms} and the slopes."""

    settings: dict[str, Any]
    rows: list[CoordRow]
    slopes: list[dict[str, Any]]  # per site and step
    kind_slopes: list[dict[str, Any]]  # per kind of site and step, of the mean over its layers

    def to_dict(self) -> dict[str, Any]:
        return {**self.settings, "rows": self.rows, "slopes": self.slopes, "kind_slopes": self.kind_slopes}

    def slope(self, kind: str, step: int, key: str = "slope") -> float:
        """The exponent s of (the mean over layers of) ``kind``'s RMS ~ width^s at ``step``."""
        return next(s[key] for s in self.kind_slopes if s["kind"] == kind and s["step"] == step)

    def worst(self, kind: str, step: int, key: str = "slope") -> float:
        """The largest |exponent| over the sites of ``kind`` at ``step``."""
        return max(abs(s[key]) for s in self.slopes if s["kind"] == kind and s["step"] == step)


def _config_at(cfg: TrainConfig, width: int, base: int) -> TrainConfig:
    settings: dict[str, Any] = {"model.d_model": width}
    if cfg.model.config.parametrization != "sp" and cfg.model.config.base_d_model is None:
        settings["model.base_d_model"] = base
    return cfg.with_(settings, f"coordcheck width {width}")


def _sites(n_layers: int) -> dict[str, tuple[str, int]]:
    """The capture points: module path -> (kind, layer; -1 for the model-level ones); the logits last."""
    sites = {"embed_out": ("embedding", -1)}
    for i in range(n_layers):
        sites[f"blocks.{i}.attn_update"] = ("attn_update", i)
        sites[f"blocks.{i}.mlp_update"] = ("mlp_update", i)
        sites[f"blocks.{i}.resid_post"] = ("block_output", i)
    return {**sites, "logits": ("logits", -1)}


def _rms(x: torch.Tensor) -> float:
    return float(x.detach().double().pow(2).mean().sqrt())


def _one_width(
    cfg: TrainConfig, steps: int, seed: int, tokens: np.ndarray
) -> dict[tuple[str, int], tuple[float, float]]:
    """(site, step) -> (rms, delta_rms) for one width and seed."""
    model = build_model(cfg.model.layout, cfg.model.config, seed=seed)
    model.train()
    opt = make_optimizer(model, cfg)
    set_lr(opt, cfg.optim.lr)  # constant: the coordinate check's protocol
    x, y = batch_at(tokens, 0, cfg.data.batch_size, cfg.data.seq_len, seed)
    seen: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def hook(name: str):  # noqa: ANN202 - a forward hook
        def record(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            seen[name] = output.detach()

        return record

    handles = [modules[name].register_forward_hook(hook(name)) for name in _sites(len(model.blocks)) if name in modules]
    out: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        for step in range(steps + 1):
            seen.clear()
            logits = model(x).logits
            seen["logits"] = logits.detach()
            for name, value in seen.items():
                first.setdefault(name, value)
                out[(name, step)] = (_rms(value), _rms(value - first[name]))
            if step == steps:
                break
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if not torch.isfinite(loss):
                raise ConfigError(
                    f"coordcheck: the loss is {loss.item()} at width {cfg.model.config.d_model}, step {step}; "
                    f"lower the learning rate (lr={cfg.optim.lr})"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        for h in handles:
            h.remove()
    return out


def _slope(widths: list[int], values: list[float]) -> float:
    """s in values ~ widths^s, least squares in log-log."""
    xs = np.log2(np.asarray(widths, dtype=float))
    ys = np.log2(np.maximum(np.asarray(values, dtype=float), 1e-30))
    return float(np.polyfit(xs, ys, 1)[0])


def coordcheck(cfg: TrainConfig, widths: list[int], steps: int, seeds: int) -> CoordCheck:
    """The check: ``cfg`` trained at each width for ``steps`` steps with ``seeds`` seeds (the base width of muP and
    CompleteP: the smallest, unless the settings name one)."""
    if len(widths) < 2 or sorted(set(widths)) != list(widths):
        raise ConfigError(f"coordcheck needs two or more widths in increasing order, got {widths}")
    if cfg.data.task != "lm":
        raise ConfigError(f"--set task={cfg.data.task}: the coordinate check trains a language model on text (task lm)")
    data = load_run_data(cfg)
    assert isinstance(data, TokenData)  # task lm
    if data.vocab_size != cfg.model.config.vocab_size:
        cfg = cfg.with_({"model.vocab_size": data.vocab_size}, "coordcheck data")
    per: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for width in widths:
        at = _config_at(cfg, width, widths[0])
        for seed in range(seeds):
            for (site, step), v in _one_width(at, steps, seed, data.train).items():
                per.setdefault((width, site, step), []).append(v)
    sites = _sites(cfg.model.config.n_layers)
    rows = [
        CoordRow(
            width=width,
            step=step,
            site=site,
            kind=sites[site][0],
            layer=sites[site][1],
            rms=float(np.mean([v[0] for v in vals])),
            delta_rms=float(np.mean([v[1] for v in vals])),
        )
        for (width, site, step), vals in sorted(per.items())
    ]
    slopes = []
    for site, (kind, layer) in sites.items():
        for step in range(steps + 1):
            pick = [r for r in rows if r["site"] == site and r["step"] == step]
            if len(pick) < 2:
                continue
            ws = [r["width"] for r in pick]
            slopes.append(
                {
                    "site": site,
                    "kind": kind,
                    "layer": layer,
                    "step": step,
                    "slope": _slope(ws, [r["rms"] for r in pick]),
                    "delta_slope": _slope(ws, [r["delta_rms"] for r in pick]) if step else 0.0,
                }
            )
    kind_slopes = []  # per kind of site: the exponent of the mean over its layers (steadier than any one layer)
    for kind in KINDS:
        for step in range(steps + 1):
            means: dict[int, list[tuple[float, float]]] = {}
            for r in rows:
                if r["kind"] == kind and r["step"] == step:
                    means.setdefault(r["width"], []).append((r["rms"], r["delta_rms"]))
            ws = sorted(means)
            kind_slopes.append(
                {
                    "kind": kind,
                    "step": step,
                    "slope": _slope(ws, [float(np.mean([v[0] for v in means[w]])) for w in ws]),
                    "delta_slope": _slope(ws, [float(np.mean([v[1] for v in means[w]])) for w in ws]) if step else 0.0,
                }
            )
    m = cfg.model.config
    base = m.base_d_model if m.base_d_model is not None else widths[0]
    settings = {
        "layout": cfg.model.layout_label,
        "parametrization": m.parametrization,
        "base_d_model": base if m.parametrization != "sp" else None,
        "n_layers": m.n_layers,
        "widths": list(widths),
        "steps": steps,
        "seeds": seeds,
        "lr": cfg.optim.lr,
        "optimizer": cfg.optim.optimizer,
        "batch_size": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "data": cfg.data.data,
    }
    return CoordCheck(settings, rows, slopes, kind_slopes)


def _figure(check: CoordCheck):  # noqa: ANN202 - a matplotlib Figure
    """One panel per kind of site: RMS of the change since init against width, a line per step (the deepest
    block for the per-block kinds); flat lines: the widths agree."""
    fig, axes = panels(len(KINDS), share=False)
    steps = check.settings["steps"]
    deepest = check.settings["n_layers"] - 1
    for ax, kind in zip(axes, KINDS):
        for step in range(1, steps + 1):
            pick = [r for r in check.rows if r["kind"] == kind and r["step"] == step and r["layer"] in (-1, deepest)]
            ax.plot([r["width"] for r in pick], [r["delta_rms"] for r in pick], marker="o", label=f"step {step}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        values = [float(y) for line in ax.get_lines() for y in np.asarray(line.get_ydata(), dtype=float) if y > 0]
        if values and max(values) / min(values) < 10:  # at least a decade shown: flat lines look flat
            ax.set_ylim(min(values) / 3, max(values) * 3)
        ax.set_xlabel("width (d_model)")
        ax.set_ylabel("RMS of the change since init")
        where = "" if kind in ("embedding", "logits") else f" (block {deepest})"
        ax.set_title(f"{kind}{where}")
        legend(ax, fontsize=7)
    fig.suptitle(f"coordinate check: {check.settings['layout']}, {check.settings['parametrization']}")
    fig.tight_layout()
    return fig


def _summary_rows(check: CoordCheck) -> list[dict[str, Any]]:
    """Per kind of site: the largest |exponent| over its sites, of the RMS and of the change, at the last step."""
    last = check.settings["steps"]
    return [
        {
            "site": kind,
            "rms ~ width^s": check.slope(kind, last),
            "change ~ width^s": check.slope(kind, last, "delta_slope"),
            "largest |s| of one layer": check.worst(kind, last, "delta_slope"),
        }
        for kind in KINDS
    ]


def write_coordcheck(check: CoordCheck, out: str | Path) -> Path:
    """OUT/coordcheck.json and OUT/index.html (the figure and the slopes), written whole into a folder normlab
    makes (or its own earlier one)."""
    with staged_folder(out, "coordcheck") as folder:
        atomic_write_json(folder / "coordcheck.json", check.to_dict())
        s = check.settings
        body = (
            f"<h1>Coordinate check: {html.escape(s['layout'])} ({s['parametrization']})</h1>\n"
            f"<p>widths {', '.join(map(str, s['widths']))}; {s['steps']} steps at lr {s['lr']} ({s['optimizer']}, "
            f"constant); {s['seeds']} seeds; batch {s['batch_size']} x {s['seq_len']}; {s['n_layers']} layers. "
            "Exponent s of rms ~ width^s at the last step, of the mean over the layers (and the largest of one layer):"
            " 0 is flat (the widths agree); SP's updates and logits grow (s > 0).</p>\n"
            + table_html(_summary_rows(check))
            + figure_html(_figure(check), folder, "coordcheck", "The change since init against width")
        )
        write_page(folder / "index.html", f"coordcheck {s['layout']}", body)
    return Path(out)


def coordcheck_text(check: CoordCheck, out: Path) -> str:
    """What `normlab coordcheck` prints: the exponents at the last step per kind of site, and the files."""
    s = check.settings
    lines = [
        f"coordcheck {s['layout']} ({s['parametrization']}, base width {s['base_d_model'] or '-'}): widths "
        f"{', '.join(map(str, s['widths']))}, {s['steps']} steps at lr {s['lr']}, {s['seeds']} seeds",
        f"{'site':<14} {'rms ~ width^s':>14} {'change ~ width^s':>17} {'one layer, largest |s|':>23}",
    ]
    for row in _summary_rows(check):
        vals = list(row.values())
        lines.append(f"{vals[0]:<14} {fmt(vals[1]):>14} {fmt(vals[2]):>17} {fmt(vals[3]):>23}")
    lines.append(
        f"(s at step {s['steps']}, of the mean over the layers; 0 is flat: the widths agree) -> {out}/index.html"
    )
    return "\n".join(lines)


def coordcheck_command(layout: str, cfg: CoordCheckConfig, settings: dict[str, Any]) -> str:
    """`normlab coordcheck LAYOUT`: the check with the runs' ``settings`` (typed) over COORDCHECK_BASE, written to
    ``cfg.out``; what it prints."""
    check_no_fault(settings, "coordcheck")
    for key in settings:
        if resolve_key(key) == ("model", "d_model"):
            raise ConfigError(
                f"--set {key}=...: coordcheck sets each run's width (d_model) from --widths "
                f"({','.join(map(str, cfg.widths))}); give the widths there"
            )
    own_folder(cfg.out, "coordcheck", claim=False)  # refused before any training: someone's folder, read-only
    run = TrainConfig().with_({**COORDCHECK_BASE, **settings, "layout": layout}, "coordcheck")
    check = coordcheck(run, list(cfg.widths), cfg.steps, cfg.seeds)
    return coordcheck_text(check, write_coordcheck(check, cfg.out))
