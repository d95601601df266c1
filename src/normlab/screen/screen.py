"""`normlab screen`: Kan et al.'s four-step stability workflow (App. B) on any layout, before training.

For each layout: build the model at initialization (float64), then for each stress s
1. well-posedness from the layout data (`wellposed`),
2. hidden-state mean|h| and variance over depth, their shape, and Theorem 4's linear bound (`forward`),
3. each block's Jacobian norm and their product over depth (`backward`),
4. the W_2 amplification of an input perturbation to the terminal states (`uncertainty`),
5. with n > 1 residual streams (hyper-connections), the composite mixing gain over depth: the largest absolute
   row and column sums of res_l ... res_1 (Xie et al. 2025's Amax gain, which mHC's doubly stochastic res bounds by 1),
and the same at a smaller residual step h (Kan Sec. 5). The verdicts compare s = min and s = max.
"""

from __future__ import annotations

import math
import time
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab.config.commands import ScreenConfig
from normlab.errors import ConfigError
from normlab.layout import Layout, LayoutError, as_layout
from normlab.model import build_model
from normlab.model.config import CROSS_LAYER_ATTENTION
from normlab.model.lm import NormLM
from normlab.model.streams import composite_gain
from normlab.screen.backward import sensitivities
from normlab.screen.forward import fit_growth, output_norm_bound, profile, stressed, with_h
from normlab.screen.uncertainty import amplification
from normlab.screen.wellposed import all_output_normalized, wellposedness
from normlab.settings import check_leaf, leaves

GROWS, INVARIANT = 1.5, 0.05  # sensitivity ratio s_max/s_min above 1.5: grows; within 5%: invariant


def parse_stresses(text: str) -> tuple[float, ...]:
    """Comma-separated stress factors, checked as the `stresses` setting."""
    return check_leaf(leaves(ScreenConfig)["stresses"], text, key="stress", from_text=True)


def load_layout_arg(arg: str) -> tuple[Layout, dict[str, Any]]:
    """A preset, a string form, or a TOML file with ``layout`` (and optionally ``size``, ``[model]``)."""
    if arg.endswith(".toml"):
        path = Path(arg)
        if not path.is_file():
            raise LayoutError(f"layout file {path} does not exist")
        data = tomllib.loads(path.read_text())
        if "layout" not in data:
            raise LayoutError(f"{path} has no 'layout' key (a preset name or string form)")
        return as_layout(data["layout"]), {k: data[k] for k in ("size", "model") if k in data}
    return as_layout(arg), {}


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def hc_gain(model: NormLM) -> dict[str, list[float]]:
    """The composite mixing gain after each hyper-connection of the last forward (normlab.model.streams)."""
    mixes = []
    for b in model.block_list():
        for c in (b.attn_hc, b.mlp_hc):
            assert c is not None and c.last_res is not None  # after a forward of a model with hyper-connections
            mixes.append(c.last_res)
    return composite_gain(mixes)


def _measured(m: NormLM, x0: torch.Tensor, cfg: ScreenConfig, hyper: bool, bounded_premise: bool) -> dict[str, Any]:
    """One stressed model's row: the profile over depth and its shape, the block Jacobians, the uncertainty
    amplification, the hyper-connections' composite gain (``hyper``), and Thm 4's bound where it applies."""
    with torch.no_grad():
        _, hidden = m.run_blocks(x0, return_hidden_states=True)
    assert hidden is not None  # asked for
    prof = profile(hidden)
    # hyper-connections: the composite mixing's gain over depth (mHC's Amax), from this forward's res matrices
    gain = hc_gain(m) if hyper else None
    sens = sensitivities(m, x0, cfg.iters)
    row: dict[str, Any] = {
        **prof,
        # the shape over depth is fit on the block outputs (l = 1..L), as the papers plot them
        "shape_mean_abs": fit_growth(prof["mean_abs"][1:]),
        "shape_var": fit_growth(prof["var"][1:]),
        "sensitivity": sens,
        "sensitivity_mean": float(np.mean(sens)),
        "sensitivity_product": float(np.prod(sens)),
        "uncertainty": amplification(m, x0, cfg.noise, cfg.seed),
    }
    if gain is not None:
        row["hc_gain"] = gain
    if bounded_premise:
        bound = output_norm_bound(m, prof["mean_abs"][0])
        row["thm4_bound"] = bound
        row["thm4_holds"] = all(v <= b * (1 + 1e-9) + 1e-12 for v, b in zip(prof["mean_abs"], bound))
    return row


def _judged(
    per_stress: dict[str, Any], a: dict[str, Any], b: dict[str, Any], wp: dict[str, Any], bounded: bool
) -> dict[str, Any]:
    """The verdict from the lowest (``a``) and highest (``b``) stress: backward (the Jacobians' growth with s),
    forward (Thm 4, flat, or growth of the final activation), and overall with the well-posedness."""
    sens_ratio = _ratio(b["sensitivity_mean"], a["sensitivity_mean"])
    if sens_ratio > GROWS:
        backward = f"grows with s (x{sens_ratio:.2f})"
    elif abs(sens_ratio - 1) <= INVARIANT:
        backward = "invariant to s"
    else:
        backward = f"mild (x{sens_ratio:.2f})"
    fwd_ratio = _ratio(b["mean_abs"][-1], a["mean_abs"][-1])
    if bounded and all(r.get("thm4_holds") for r in per_stress.values()):
        forward = "bounded (Thm 4 holds)"
    elif all(r["shape_var"]["shape"] == "flat" for r in per_stress.values()):
        forward = "flat in depth"
    elif fwd_ratio > GROWS:
        forward = f"grows with s (x{fwd_ratio:.2f})"
    else:
        forward = f"{b['shape_var']['shape']} in depth, ~s-invariant (x{fwd_ratio:.2f})"
    if wp["worst"] == "bounded" and backward == "invariant to s":
        overall = "stable"
    elif wp["worst"] == "unbounded" and sens_ratio > GROWS:
        overall = "unstable"
    else:
        overall = "caution"
    return {
        "wellposedness": wp["verdict"],
        "forward": forward,
        "forward_final_mean_abs_ratio": fwd_ratio,
        "backward": backward,
        "sensitivity_ratio": sens_ratio,
        "uncertainty_ratio_growth": _ratio(b["uncertainty"]["ratio"], a["uncertainty"]["ratio"]),
        "overall": overall,
    }


def screen_layout(layout: Layout | str, cfg: ScreenConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    lay = as_layout(layout)
    extra = extra or {}
    size = extra.get("size", cfg.size)
    model = build_model(lay, size, seed=cfg.seed, **{**cfg.model, **extra.get("model", {})}).double().eval()
    if model.config.attention in CROSS_LAYER_ATTENTION:
        # a block's attention reads the earlier layers' keys and values of the same forward (MoDA, Depth-Attention):
        # called alone, as the Jacobians and the W2 probe call it, it would read a store another forward left
        raise ConfigError(
            f"screen: model.attention={model.config.attention} makes each block read the earlier layers' keys and "
            "values within one forward, so a block is not screened alone; screen the placement with "
            "model.attention=mha (or mla)"
        )
    resolved = model.resolved
    g = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, model.config.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    with torch.no_grad():
        x0 = model.embed_tokens(tokens)
    wp = wellposedness(resolved)
    bounded_premise = all_output_normalized(resolved)
    hyper = lay.streams > 1

    per_stress = {}
    for s in cfg.stresses:
        row = _measured(stressed(model, s, cfg.mode), x0, cfg, hyper, bounded_premise)
        per_stress[repr(float(s))] = {"stress": float(s), **row}
    lo, hi = min(cfg.stresses), max(cfg.stresses)
    a, b = per_stress[repr(float(lo))], per_stress[repr(float(hi))]
    h_small = lay.h * cfg.h_factor
    h_row = _measured(with_h(stressed(model, hi, cfg.mode), h_small), x0, cfg, hyper, bounded_premise)
    verdict = _judged(per_stress, a, b, wp, bounded_premise)
    if hyper:  # the gain reported: the last stress measured's
        last = list(per_stress.values())[-1]
        gain = max(max(last["hc_gain"]["forward"]), max(last["hc_gain"]["backward"]))
        verdict = {
            **{k: v for k, v in verdict.items() if k != "overall"},
            "hc_gain": gain,
            "overall": verdict["overall"],
        }
    return {
        "layout": lay.label,
        "string": lay.to_string(),
        "n_layers": model.config.n_layers,
        "d_model": model.config.d_model,
        "config": {**asdict(cfg), "size": size},
        "wellposedness": wp,
        "stresses": per_stress,
        "h_effect": {
            "h": lay.h,
            "h_small": h_small,
            "stress": hi,
            "final_mean_abs": [b["mean_abs"][-1], h_row["mean_abs"][-1]],
            "final_var": [b["var"][-1], h_row["var"][-1]],
            "sensitivity_mean": [b["sensitivity_mean"], h_row["sensitivity_mean"]],
            "uncertainty_ratio": [b["uncertainty"]["ratio"], h_row["uncertainty"]["ratio"]],
        },
        "verdict": verdict,
        "seconds": time.perf_counter() - t0,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    lo_hi = lambda r, key: (r["stresses"][min(r["stresses"], key=float)], r["stresses"][max(r["stresses"], key=float)])
    heads = (
        "layout",
        "well-posedness",
        "forward",
        "shape var(l)",
        "sens mean",
        "sens prod",
        "W2 out/in",
        "h→h/2 last|h|",
        "verdict",
    )
    rows = []
    for r in results:
        a, b = lo_hi(r, None)
        h = r["h_effect"]
        rows.append(
            (
                r["layout"],
                r["wellposedness"]["verdict"],
                r["verdict"]["forward"],
                f"{a['shape_var']['shape']}→{b['shape_var']['shape']}",
                f"{a['sensitivity_mean']:.3g}→{b['sensitivity_mean']:.3g}",
                f"{a['sensitivity_product']:.3g}→{b['sensitivity_product']:.3g}",
                f"{a['uncertainty']['ratio']:.3g}→{b['uncertainty']['ratio']:.3g}",
                f"{h['final_mean_abs'][0]:.3g}→{h['final_mean_abs'][1]:.3g}",
                r["verdict"]["overall"],
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(heads, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    first = results[0]["stresses"] if results else {}
    note = ""
    if results:
        s = sorted(float(k) for k in first)
        note = (
            f"\n(a→b: stress s={s[0]:g} → s={s[-1]:g}; sens = ||dX_(l+1)/dX_l||_2 per block; W2 out/in = "
            f"terminal over input Wasserstein-2 of a {results[0]['config']['noise']:g}-RMS perturbation; "
            f"h→h/2: final mean|h| at s={s[-1]:g})"
        )
    gains = [
        f"\n{r['layout']}: hyper-connections' composite mixing gain (largest abs row / column sum of "
        f"res_l..res_1 over depth and tokens, Xie et al.'s Amax): "
        + "; ".join(
            f"s={row['stress']:g}: {max(row['hc_gain']['forward']):.4g} / {max(row['hc_gain']['backward']):.4g}"
            for row in r["stresses"].values()
        )
        for r in results
        if "hc_gain" in next(iter(r["stresses"].values()))
    ]
    return "\n".join([line(heads), line(["-" * w for w in widths]), *map(line, rows)]) + note + "".join(gains)


def screen_command(
    layout_args: list[str], cfg: ScreenConfig, json_path: str | None = None, verbose: bool = False
) -> str:
    """`normlab screen`: every layout argument parsed first (typos fail before any work), each screened
    with a progress bar; the table (with each sublayer's verdict when `verbose`), the measurements written
    to `json_path` when given."""
    import json

    from tqdm import tqdm

    from normlab.io import atomic_write_json

    layouts = [load_layout_arg(a) for a in layout_args]
    results = []
    bar = tqdm(layouts, desc="screen", unit="layout", disable=None, leave=False)
    for layout, extra in bar:
        bar.set_postfix_str(layout.name or layout.to_string())
        results.append(screen_layout(layout, cfg, extra))
    lines = [format_table(results)]
    if json_path:
        atomic_write_json(json_path, {"results": results})
        lines.append(f"wrote {json_path}")
    if verbose:
        for r in results:
            lines.append(f"\n[{r['layout']}] {r['string']}: {r['wellposedness']['verdict']}")
            lines += [
                f"  layers {v['layers']} {v['sublayer']}: {v['kind']}: {v['why']}"
                for v in r["wellposedness"]["sublayers"]
            ]
            lines.append("  " + json.dumps(r["verdict"]))
    return "\n".join(lines)
