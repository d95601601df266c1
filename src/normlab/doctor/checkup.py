"""The checkup: one forward and backward of trained weights on sample text, read as findings.

The model is a normlab run or checkpoint, or a transformers folder (the normlab class, or an architecture
normlab converts exactly: Llama, Mistral, Qwen 3, OLMo 2/3, Gemma 2/3, GPT-2), loaded as the `NormLM`
that computes the same function, so every measurement of `normlab.diagnostics.probes` applies. Each
finding states its value, the threshold it was judged by and where:

- fp16 headroom: 65504 / the largest activation anywhere (every module's output); warn / fail: < 10 / < 1
- first fp16 overflow: the first site, in execution order, that would be inf with activations stored in fp16
  (`forensics.first_break`); warn / fail: any
- massive activations: max / median of the block outputs' magnitudes (Sun et al. 2024); warn / fail: > 1000
- gradient spread: largest / smallest per-layer gradient norm (all of a block's matrices); warn / fail: > 100
- gradient reaching the blocks: the largest per-layer gradient norm; warn / fail: fail < 1e-8
- attention logits: the largest q.k/sqrt(d) of any head (Wortsman et al. 2024: logit growth precedes divergence); warn /
  fail: > 50
- norm gains: the largest and smallest |gain| of any norm; warn / fail: > 10 or < 0.05
- block Jacobians: max ||dX_(l+1)/dX_l||_2 on the sample (Kan et al. Sec. 4, `screen.backward`); warn / fail: > 10

The thresholds are normlab's, chosen to flag what the papers describe, and printed with each finding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from normlab.diagnostics.forensics import first_break
from normlab.diagnostics.probe_store import ProbeRow
from normlab.diagnostics.probes import Probes
from normlab.diagnostics.stats import FP16_MAX
from normlab.model.lm import NormLM
from normlab.model.storage import NO_STORAGE, for_run
from normlab.runs.convert import SAMPLE_TEXTS as TEXTS
from normlab.runs.files import RunDir
from normlab.runs.metrics import ProbeMetric
from normlab.runs.model import RunModel, load_run_model, run_tokenizer
from normlab.screen.backward import sensitivities

HEADROOM_WARN, HEADROOM_FAIL = 10.0, 1.0
MASSIVE_RATIO = 1000.0
GRAD_SPREAD = 100.0
MAX_LOGIT = 50.0
GAIN_HIGH, GAIN_LOW = 10.0, 0.05
JACOBIAN = 10.0
VANISHED = 1e-8


@dataclass
class Finding:
    name: str
    value: float
    threshold: str
    verdict: str  # ok | warn | fail
    where: str = ""

    def line(self) -> str:
        if self.where == "none":
            return f"{self.verdict.upper():5s} {self.name}: none ({self.threshold})"
        v = f"{self.value:.4g}" if isinstance(self.value, float) else str(self.value)
        return (
            f"{self.verdict.upper():5s} {self.name}: {v}{f' at {self.where}' if self.where else ''} ({self.threshold})"
        )


class Loaded(NamedTuple):
    """What `load_model` read: the NormLM, its tokenizer (None: bytes mod the vocabulary), what it was in
    words, and for a run or checkpoint the loaded run (its config and step, for a copy written back)."""

    model: NormLM
    tok: Any
    kind: str
    run: RunModel | None = None


def load_model(source: str | Path) -> Loaded:
    """A NormLM for a run, a checkpoint or a transformers folder, with its tokenizer and what it was."""
    src = Path(source)
    folder = RunDir(src)
    if src.is_dir() and folder.config_file.is_file() and not folder.has_checkpoints():
        from normlab.hf.folder import check_folder, load_tokenizer

        model_type = check_folder(src).get("model_type")
        tok = load_tokenizer(src)  # before the weights: a tokenizer it refuses costs no load
        if model_type == "normlab":
            from normlab.hf import from_hf

            model = from_hf(src)
        else:
            from normlab.hf import from_native

            model = from_native(src)
        return Loaded(model.eval(), tok, f"transformers folder ({model_type})")
    run = load_run_model(src)
    return Loaded(
        run.model.eval(), run_tokenizer(run.config, run.run_dir), f"normlab run ({run.config.model.layout_label})", run
    )


def sample_tokens(model: NormLM, tok: Any, texts: tuple[str, ...] = TEXTS, max_len: int = 64) -> torch.Tensor:
    """The sample texts as ids for ``model`` (its tokenizer ``tok``, else bytes), at most its context long."""
    from normlab.hf.scan import encode_samples

    return encode_samples(texts, model.config.vocab_size, tok, min(max_len, model.config.max_seq_len), min_len=3)


@torch.no_grad()
def module_maxima(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """The largest |output| of every leaf module and capture point, by path, in execution order."""
    found: dict[str, float] = {}
    handles = []
    for path, mod in model.named_modules():
        # leaves, but not an off site's plain nn.Identity (its "output" is the stream under a misleading name);
        # the capture points (Tap: resid_mid, resid_post, ...) are kept
        if path and not list(mod.children()) and type(mod) is not nn.Identity:

            def hook(m, a, o, path=path):  # noqa: ANN001, ANN202
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    found[path] = max(found.get(path, 0.0), float(o.detach().abs().max()))

            handles.append(mod.register_forward_hook(hook))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return found


def _judge(name: str, value: float, warn: bool, fail: bool, threshold: str, where: str = "") -> Finding:
    return Finding(name, value, threshold, "fail" if fail else "warn" if warn else "ok", where)


def _headroom(maxima: dict[str, float]) -> Finding:
    top_path, top = max(maxima.items(), key=lambda kv: kv[1]) if maxima else ("", 0.0)
    headroom = FP16_MAX / top if top > 0 else math.inf
    return _judge(
        "fp16 headroom",
        headroom,
        headroom < HEADROOM_WARN,
        headroom < HEADROOM_FAIL,
        f"65504 / largest activation {top:.4g}; warn < {HEADROOM_WARN:g}, fail < {HEADROOM_FAIL:g}",
        top_path,
    )


def _first_fp16_break(model: NormLM, x: torch.Tensor) -> tuple[Finding, dict[str, Any] | None]:
    """The first site whose value would be inf stored in fp16, found with fp16 storage switched on."""
    model.set_storage(for_run("fp32", "fp16"))
    try:
        brk = first_break(model, [(x[:, :-1], x[:, 1:])])
    finally:
        model.set_storage(NO_STORAGE)
    first = brk.get("forward")
    where = f"block {first.get('layer')}: {first.get('site')}" if first else ""
    finding = _judge(
        "first fp16 overflow",
        float(first.get("before") or math.nan) if first else 0.0,
        False,
        first is not None,
        "the first site whose value would be inf stored in fp16 (value: the largest finite one flowing in)",
        f"{where} ({first['module']})" if first else "none",
    )
    return finding, first


def _gradient(rows: list[ProbeRow]) -> tuple[list[Finding], dict[int, float]]:
    """The per-layer gradient norms over the projections: vanished (fail) or spread (warn)."""
    per_layer: dict[int, float] = {}
    for r in rows:
        if r["metric"] == ProbeMetric.GRAD_NORM and "_proj" in r["site"] and r["layer"] is not None:
            per_layer[r["layer"]] = per_layer.get(r["layer"], 0.0) + r["value"] ** 2
    norms = {k: math.sqrt(v) for k, v in per_layer.items()}
    if not norms:
        return [], norms
    if max(norms.values()) < VANISHED:  # e.g. a saturated final DyT: tanh' = 0 for every entry
        text = f"the largest per-layer gradient norm; fail < {VANISHED:g} (nothing trains)"
        return [_judge("gradient reaching the blocks", max(norms.values()), False, True, text)], norms
    lo, hi = min(norms, key=lambda k: norms[k]), max(norms, key=lambda k: norms[k])
    spread = norms[hi] / max(norms[lo], 1e-30)
    finding = _judge(
        "gradient spread",
        spread,
        spread > GRAD_SPREAD,
        False,
        f"largest / smallest per-layer gradient norm; warn > {GRAD_SPREAD:g}",
        f"blocks {hi} (largest) and {lo} (smallest)",
    )
    return [finding], norms


def _logits_and_gains(rows: list[ProbeRow]) -> list[Finding]:
    """The largest attention logit of any head, and the largest and smallest norm gain."""
    out: list[Finding] = []
    heads = [
        (r["value"], r["layer"], r["site"])
        for r in rows
        if r["metric"] == ProbeMetric.MAX_LOGIT and r["site"].startswith("attn.head")
    ]
    if heads:
        v, layer, site = max(heads)
        text = f"largest q.k/sqrt(d) of any head; warn > {MAX_LOGIT:g}"
        out.append(_judge("attention logits", v, v > MAX_LOGIT, False, text, f"block {layer} {site}"))
    gains = [
        (r["value"], r["layer"], r["site"], r["metric"]) for r in rows if r["metric"] in ("gamma_max", "gamma_min")
    ]
    if gains:
        big = max(gains, key=lambda g: abs(g[0]))
        small = min(gains, key=lambda g: abs(g[0]))
        big_at, small_at = f"{big[2]} (block {big[1]})", f"{small[2]} (block {small[1]})"
        out.append(
            _judge(
                "norm gain, largest |gamma|",
                abs(big[0]),
                abs(big[0]) > GAIN_HIGH,
                False,
                f"warn > {GAIN_HIGH:g}",
                big_at,
            )
        )
        out.append(
            _judge(
                "norm gain, smallest |gamma|",
                abs(small[0]),
                abs(small[0]) < GAIN_LOW,
                False,
                f"warn < {GAIN_LOW:g}",
                small_at,
            )
        )
    return out


def _jacobian(model: NormLM, x: torch.Tensor, iters: int) -> tuple[Finding, list[float]]:
    """The largest block Jacobian's spectral norm (Kan et al.), in float64."""
    with torch.no_grad():
        x0 = model.embed_tokens(x[:1, :-1]).double()
    sens = sensitivities(model.double(), x0, iters)
    model.float()
    worst = max(range(len(sens)), key=sens.__getitem__)
    text = f"max ||dX_(l+1)/dX_l||_2 (Kan et al.); warn > {JACOBIAN:g}"
    return _judge("block Jacobian", sens[worst], sens[worst] > JACOBIAN, False, text, f"block {worst}"), sens


def checkup(model: NormLM, x: torch.Tensor, jacobian_iters: int = 10) -> tuple[list[Finding], dict[str, Any]]:
    """Findings for ``model`` (a NormLM) on tokens ``x`` (B, T); and the raw measurements."""
    model = model.eval()
    rows = Probes(model, (x[:, :-1], x[:, 1:])).record(0)
    maxima = module_maxima(model, x[:, :-1])
    overflow, first = _first_fp16_break(model, x)
    ratio = {r["layer"]: r["value"] for r in rows if r["site"] == "global" and r["metric"] == "max_median_ratio"}
    massive = ratio.get(None, math.nan)
    findings = [
        _headroom(maxima),
        overflow,
        _judge(
            "massive activations",
            massive,
            massive > MASSIVE_RATIO,
            False,
            f"max / median |h| over the block outputs; warn > {MASSIVE_RATIO:g}",
        ),
    ]
    gradient, norms = _gradient(rows)
    findings += gradient + _logits_and_gains(rows)
    jacobian, sens = _jacobian(model, x, jacobian_iters)
    findings.append(jacobian)
    raw = {
        "module_max": maxima,
        "first_fp16_break": first,
        "grad_norm_by_layer": norms,
        "jacobian_by_block": sens,
        "probe_rows": len(rows),
    }
    return findings, raw


def findings_json(findings: list[Finding]) -> list[dict[str, Any]]:
    return [asdict(f) for f in findings]


def write_copy(model: NormLM, source: str | Path, kind: str, out: str | Path, run: RunModel | None = None) -> Path:
    """Save a doctored copy as its source was: a transformers folder again (its own class where normlab
    exports it exactly, else the normlab class), or a checkpoint folder for `--init-from` / `load_run_model`
    (``run``: the run `load_model` read, for its config and step; read again when not given). ``out`` is a
    new folder or one a doctor copy made (`io.staged_folder`: never someone's files, never half-written)."""
    from normlab.io import staged_folder

    out = Path(out)
    run = run if run is not None or kind.startswith("transformers") else load_run_model(source)
    with staged_folder(out, "doctored") as tmp:
        if kind.startswith("transformers"):
            _save_transformers(model, tmp, kind)
        else:
            from normlab.runs.checkpoint import save_checkpoint

            assert run is not None  # loaded just above for a run or checkpoint
            RunDir(tmp).write_record({"config": run.config.to_dict(), "doctored_from": str(source)})
            save_checkpoint(
                tmp, run.step or 0, {"model": model.state_dict(), "config": run.config.to_dict()}, keep_last=1
            )
    return out


def _save_transformers(model: NormLM, out: Path, kind: str) -> None:
    from normlab.hf import save_hf, save_native
    from normlab.hf.archs import EXPORTABLE

    model_type = kind.split("(")[-1].rstrip(")")
    name = next((n for n in EXPORTABLE if n == model_type or model_type.startswith(n)), None)
    if name is not None:
        try:
            save_native(model, out, name)
            return
        except ValueError:
            pass  # the rescaled model's options no longer map (they do today): the normlab class keeps any
    save_hf(model, out)


def doctor(source: str, cfg: Any, as_json: bool = False) -> str:
    """`normlab doctor`: the findings (as text or JSON) and, with `cfg.fp16_copy`, the fp16-safe copy where
    exact (a `DoctorConfig`)."""
    import json

    from normlab.doctor.rescale import rescalable, rescale_for_fp16
    from normlab.errors import ConfigError
    from normlab.io import own_folder

    if cfg.fp16_copy:
        own_folder(cfg.fp16_copy, "doctored", claim=False)  # a folder holding someone's files fails before any work
    model, tok, kind, run = load_model(source)
    x = sample_tokens(model, tok)
    findings, _ = checkup(model, x)
    if as_json:
        lines = [json.dumps(findings_json(findings), indent=1)]
    else:
        lines = [f"# doctor: {source} ({kind}; layout {model.layout.label}), {x.shape[0]} x {x.shape[1]} tokens"]
        lines += [f.line() for f in findings]
    why = rescalable(model)
    if cfg.fp16_copy:
        if why is not None:
            raise ConfigError(f"no exact fp16-safe copy for this layout: {why}")
        r = rescale_for_fp16(model, x[:, :-1], cfg.headroom)
        out = write_copy(r.model, source, kind, cfg.fp16_copy, run)
        lines.append(
            f"fp16-safe copy: stream x {r.factor:.4g}, largest activation {r.max_before:.4g} -> "
            f"{r.max_after:.4g}; logits changed by at most {r.max_logit_change:.3g} (KL {r.kl:.3g} "
            f"nats/token) -> {out}"
        )
    elif not as_json:
        lines.append(
            "an exact fp16-safe rescaled copy: "
            + ("available (--fp16-copy OUT)" if why is None else f"not exact here ({why})")
        )
    return "\n".join(lines)
