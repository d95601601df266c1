"""`normlab convert RUN --layout NEW`: a trained run's weights moved to another placement, with the change
of function measured.

Every layout has the same module paths (a site that is off holds `nn.Identity`), so a weight the new layout
also has keeps its name and is copied; a site only the new layout turns on starts at its init, stated per
parameter (a norm's gamma 1 and beta 0, a centered gain's w 0, DyT's alpha at alpha0, a learned step at h,
a head scale 1, a gate's projection drawn as the run's init draws it, Admin's omega profiled); a site only
the old layout had is dropped. A new output norm (B) or embedding norm starts, by default, with gamma set
to the mean RMS of what it normalizes in the old model (``match_scale``): it then keeps the scale of the
update it replaces on average instead of forcing every update to RMS 1. On a trained Pre-LN micro run
(6 layers, 200 steps) to Peri-LN: KL 0.091 nats/token and top-1 unchanged on 76% of tokens with matched
gammas, against KL 0.728 and 35% with gamma = 1 (docs/training.md). Where a kept norm changes only how its gain is
stored, the conversion is exact: gamma <-> centered (w = gamma - 1). Pre-LN with LayerNorm to RMSNorm input norms
(``--layout 'RUN_LAYOUT,norm.A=rms'``) is rewritten exactly as Jiang et al. 2023 do (`_rms_rewrite`: the stream
re-centred, each beta moved into the next projections' biases), or refused with the reason. The seeds' migration (Kim
et al.: Pre-LN -> Peri-LN keeps the input norms and adds output norms) is ``--layout peri`` on a ``pre`` run.

The residual stream's parts start as their layouts' inits do (`_INITS`): GPAS's gate at 0 (nothing subtracted),
skip lambdas at 1, SeeDNorm's beta at 0, and hyper-connections at their static maps (HC: the branch reads one
stream, each stream keeps itself, the update goes to every stream; mHC: its gates at 0.01), so a one-stream run
moved to ``streams=n`` carries n equal copies of its stream, whose sum the final norm reads as it read the one:
the function is kept up to the norms' eps (HC) or up to mHC's 0.01-gated maps (KL below 1e-6 either way,
`tests/integration/test_train.py`). Back to one stream, the connections are dropped and the KL says what that
changed. A parameter whose shape changes (4 streams to 2, a per-channel gain to a scalar) starts at its init and
the old one is listed as dropped. nGPT is refused either way, in one line with the reason: its weights live on the
unit sphere and its stream is a lerp between normalized states, so no weight means the same across.

How much the function changed: the KL divergence KL(p_old || p_new) of the next-token distributions, mean
over the tokens of held-out text (the run's validation split when its data can be read, else built-in
sample texts), with the share of tokens whose top-1 prediction is unchanged. The result is a folder with a
checkpoint that `normlab train --init-from OUT --layout NEW ...` continues from, and ``convert.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from normlab.config.commands import ConvertConfig
from normlab.config.train import TrainConfig
from normlab.errors import ConfigError, DataError
from normlab.io import atomic_write_json, own_folder
from normlab.layout import as_layout
from normlab.model.lm import NormLM
from normlab.model.mlp import MLP
from normlab.model.norms import is_norm
from normlab.runs.checkpoint import save_checkpoint
from normlab.runs.files import RunDir
from normlab.runs.model import build_run_model, load_run_model, run_tokenizer
from normlab.runs.start import default_out

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog, and the dog, being lazy, does not mind at all.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings.",
    "In 1905, Albert Einstein published four papers that changed physics and the way we think of time.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
)


@dataclass
class Conversion:
    source: str
    old_layout: str
    new_layout: str
    kept: list[str] = field(default_factory=list)
    rewritten: dict[str, str] = field(default_factory=dict)  # exact reparametrizations: name -> how
    new: dict[str, str] = field(default_factory=dict)  # name -> its stated init
    dropped: list[str] = field(default_factory=list)
    kl: float = math.nan  # mean KL(p_old || p_new) per token, nats
    top1_agreement: float = math.nan
    tokens: int = 0
    text: str = ""  # where the held-out tokens came from
    checkpoint: str = ""
    command: str = ""  # the complete `normlab train` command that continues from the converted weights

    def lines(self) -> list[str]:
        out = [
            f"converted {self.source}: {self.old_layout} -> {self.new_layout}",
            f"  kept {len(self.kept)} tensors; rewritten exactly: {len(self.rewritten)}; new: {len(self.new)}; "
            f"dropped: {len(self.dropped)}",
        ]
        out += [f"  rewritten {k}: {v}" for k, v in self.rewritten.items()]
        out += [f"  new {k}: {v}" for k, v in self.new.items()]
        out += [f"  dropped {k}" for k in self.dropped]
        out.append(
            f"  change of function on {self.tokens} held-out tokens ({self.text}): KL(old || new) = "
            f"{self.kl:.4g} nats/token, top-1 unchanged on {100 * self.top1_agreement:.1f}%"
        )
        out.append(f"  checkpoint: {self.checkpoint}")
        out.append(f"  continue with: {self.command}")
        return out


def _continue_command(cfg: TrainConfig, folder: Path) -> str:
    """`normlab train` from the converted weights with the source run's settings (its size, model options, data,
    tokenizer, sequence length, optimizer) and the new layout, into FOLDER-train: the whole command, nothing elided."""
    import shlex

    train = cfg.with_({"init_from": str(folder), "out": f"{folder}-train", "resume": True})
    return "normlab train " + " ".join(shlex.quote(a) for a in train.to_args())


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


# how the parameters of the residual stream's parts start, (type name, attribute) -> words (ending in "=": the
# value follows; the values a layout's own init gives them)
_INITS: dict[tuple[str, str], str] = {
    ("Block", "attn_gpas"): "GPAS gate a (SiLU(0) = 0: nothing subtracted) =",
    ("Block", "mlp_gpas"): "GPAS gate a (SiLU(0) = 0: nothing subtracted) =",
    ("Block", "attn_skip"): "learned skip lambda (the unit skip) =",
    ("Block", "mlp_skip"): "learned skip lambda (the unit skip) =",
    ("SeeDNorm", "self_scale"): "SeeDNorm beta (no input-dependent gain yet) =",
    ("SeeDNorm", "dyn_gain"): "SeeDNorm alpha =",
    ("HyperConnection", "static_pre"): "hyper-connection A_m0 = e_(k mod n): sublayer k reads stream k mod n",
    ("HyperConnection", "static_res"): "hyper-connection A_r0 = I: each stream keeps itself",
    ("HyperConnection", "static_post"): "hyper-connection B0 (the update added to every stream) =",
    ("HyperConnection", "dynamic_pre"): "hyper-connection dynamic W_m =",
    ("HyperConnection", "dynamic_res"): "hyper-connection dynamic W_r =",
    ("HyperConnection", "dynamic_post"): "hyper-connection dynamic W_b =",
    ("HyperConnection", "scale_a"): "hyper-connection scale s_alpha =",
    ("HyperConnection", "scale_b"): "hyper-connection scale s_beta =",
    ("ManifoldHyperConnection", "bias"): "mHC bias b =",
    ("ManifoldHyperConnection", "gates"): "mHC gating factors alpha =",
}


def _stated_init(model: torch.nn.Module, name: str, value: torch.Tensor) -> str:
    """How a new parameter starts, in words with its value."""
    mod, attr = _owner(model, name)
    kind = type(mod).__name__
    if (kind, attr) in _INITS:
        words = _INITS[kind, attr]
        return f"{words} {float(value.flatten()[0]):g}" if words.endswith("=") else words
    if is_norm(mod):
        if attr == "weight" and bool(getattr(mod, "offset", 0.0)):
            return f"{kind} centered gain w = 0 (applied 1 + w = 1)"
        if attr == "alpha":
            return f"{kind} alpha = {float(value.flatten()[0]):g} (its alpha0)"
        if attr == "shift":
            return f"Derf shift s = {float(value.flatten()[0]):g}"
        if attr == "weight" and getattr(mod, "gain", None) == "scalar":
            return f"{kind} scalar gain = {float(value.flatten()[0]):g}"
        return f"{kind} {'gamma' if attr == 'weight' else 'beta'} = {float(value.flatten()[0]):g}"
    if attr in ("attn_h", "mlp_h"):
        return f"learned residual step = {float(value.flatten()[0]):g} (the layout's h)"
    if attr in ("attn_omega", "mlp_omega"):
        return f"Admin omega = {float(value.flatten()[0]):.4g} (profiled on the converted weights)"
    if attr == "head_scale":
        return "head scale = 1"
    if attr == "sinks":
        return "sink logit = 0 per head (the off-by-one softmax until it trains)"
    return f"{kind}.{attr} drawn as the run's init draws it (std {float(value.float().std()):.3g})"


def _gain_rewrite(old: torch.nn.Module, new: torch.nn.Module) -> str | None:
    """How a kept norm weight must change when only its gain's storage differs (None: copied as is)."""
    if not (is_norm(old) and is_norm(new)) or type(old) is not type(new):
        return None
    o, n = getattr(old, "offset", 0.0), getattr(new, "offset", 0.0)
    if o == n:
        return None
    return "gamma -> centered: w = gamma - 1" if n else "centered -> gamma: gamma = 1 + w"


@torch.no_grad()
def _held_out(cfg: TrainConfig, run_dir: Path | None, max_len: int) -> tuple[list[torch.Tensor], str]:
    """Token sequences to compare the two models on: the run's validation split, else the sample texts."""
    tok = run_tokenizer(cfg, run_dir)
    if tok is None:
        raise ConfigError("this run trained on pre-tokenized .bin data: convert needs its tokenizer to read text")
    try:
        from normlab.data import load_data

        data = load_data(cfg.data.data, cfg.data.tokenizer, cfg.data.val_fraction, cfg.data.text_field)
        val = data.val[: 8 * max_len]
        if len(val) >= 2 * max_len:
            seqs = [
                torch.from_numpy(val[i : i + max_len].astype("int64"))
                for i in range(0, len(val) - max_len + 1, max_len)
            ]
            return seqs[:8], f"the run's validation split, {min(len(seqs), 8)} x {max_len}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, DataError):
        pass  # data not readable here (moved, another machine): the sample texts
    seqs = [torch.tensor(tok.encode(t)[:max_len], dtype=torch.long) for t in SAMPLE_TEXTS]
    return [s for s in seqs if len(s) >= 2], "built-in sample texts"


def token_kl(old_logits: torch.Tensor, new_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_old || p_new) of the next-token distributions, per token (float64, the vocabulary summed)."""
    lp_old, lp_new = F.log_softmax(old_logits.double(), -1), F.log_softmax(new_logits.double(), -1)
    return (lp_old.exp() * (lp_old - lp_new)).sum(-1)


@torch.no_grad()
def function_change(old: torch.nn.Module, new: torch.nn.Module, seqs: list[torch.Tensor]) -> tuple[float, float, int]:
    """Mean KL(p_old || p_new) per token over ``seqs``, the share of tokens whose argmax agrees, the token count."""
    kl_sum, agree, n = 0.0, 0, 0
    for s in seqs:
        x = s[None]
        old_logits, new_logits = old(x).logits, new(x).logits
        kl_sum += float(token_kl(old_logits, new_logits).sum())
        agree += int((old_logits.argmax(-1) == new_logits.argmax(-1)).sum())
        n += x.shape[1]
    return kl_sum / max(n, 1), agree / max(n, 1), n


@torch.no_grad()
def _matched_gains(old: NormLM, new: NormLM, seqs: list[torch.Tensor]) -> dict[str, float]:
    """For each norm the new layout adds on a stream the old model already computed, the mean RMS of what it will
    normalize, measured on the old model: an output norm (B) gets the RMS of the sublayer's update, the embedding
    norm that of the embedded tokens. A gamma of that size keeps each site's scale on average."""
    taps = {}
    for i, (ob, nb) in enumerate(zip(old.block_list(), new.block_list())):
        for sub in ("attn", "mlp"):
            new_norm = getattr(nb, f"{sub}_norms").output
            old_norms = getattr(ob, f"{sub}_norms")
            if is_norm(new_norm) and not is_norm(old_norms.output) and not is_norm(old_norms.after_add):
                taps[f"blocks.{i}.{sub}_norms.output.weight"] = getattr(ob, f"{sub}_update")
    if is_norm(new.embed_norm) and not is_norm(old.embed_norm):
        taps["embed_norm.weight"] = old.embed_out
    sums: dict[str, list[float]] = {k: [] for k in taps}
    handles = [
        tap.register_forward_hook(lambda m, a, o, k=k: sums[k].append(float(o.double().pow(2).mean(-1).sqrt().mean())))
        for k, tap in taps.items()
    ]
    try:
        for s in seqs:
            old(s[None])
    finally:
        for h in handles:
            h.remove()
    return {k: sum(v) / len(v) for k, v in sums.items() if v}


def _rms_rewrite_refusal(old: NormLM, new_layout: Any) -> str | None:
    """None if ``new_layout`` is ``old``'s Pre-LN with LayerNorm and the input norms (A) turned RMSNorm, and
    the rewrite below is exact for this model; else why not (or "" when the conversion is another one)."""
    lay = old.layout
    if lay.norm != "layer" or new_layout != as_layout(lay.to_string() + ",norm.A=rms"):
        return ""
    for i, blk in enumerate(old.resolved.blocks):
        for name, sites in (("attn", blk.attn), ("mlp", blk.mlp)):
            if not sites.input or sites.output or sites.after_add or sites.skip_normed:
                return f"block {i} {name} is not Pre-LN (A only): the stream's mean is read elsewhere"
    if lay.ln_scaling or lay.h_learned or lay.alpha != 1.0 or lay.embed_norm:
        return "LayerNorm Scaling, learned steps, skip scales or an embedding norm: not the plain Pre-LN rewrite"
    if old.config.tie_embeddings:
        return "tied embeddings: re-centring the embedding would change the head's logits too"
    if old.config.n_experts:
        return "mixture-of-experts layers: each expert's W_down would be re-centred (not built)"
    if old.config.attention == "mla":
        return "attention=mla: the input norm feeds the latents' projections (W^DQ, W^DKV, W^KR), not q/k/v (not built)"
    for i, block in enumerate(old.block_list()):
        mlp = block.mlp
        assert isinstance(mlp, MLP)  # dense: mixture-of-experts returned above
        for norm, consumers in (
            (block.attn_norms.input, (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)),
            (block.mlp_norms.input, (mlp.gate_proj, mlp.up_proj)),
        ):
            if getattr(norm, "bias", None) is not None and any(c is not None and c.bias is None for c in consumers):
                return (
                    f"block {i}: LayerNorm's beta must move into the next projections' biases, and they have none "
                    "(linear_bias / qkv_bias); exact only with them or with norm_bias=False"
                )
    return None


@torch.no_grad()
def _rms_rewrite(old: NormLM, conv: Conversion) -> dict[str, torch.Tensor]:
    """Pre-LN with LayerNorm as Pre-LN with RMSNorm input norms, exactly (Jiang et al. 2023, "Pre-RMSNorm and
    Pre-CRMSNorm Transformers", Sec. 3): make the residual stream zero-mean by re-centring everything added to
    it (each embedding row, each W_O / W_down column and its bias), so LN(x) = gamma x / RMS(x) + beta; beta
    moves into the following projections' biases (W (z + beta) = W z + W beta). The final LayerNorm stays (it
    is mean-invariant: the head keeps reading the same vector)."""
    state = {k: v.clone() for k, v in old.state_dict().items()}

    def centre(name: str, dim: int) -> None:
        state[name] = state[name] - state[name].mean(dim, keepdim=True)
        conv.rewritten[name] = "re-centred: zero mean over the model's channels"

    centre("embed.weight", -1)
    if old.pos_embed is not None:
        centre("pos_embed.weight", -1)
    for i in range(len(old.blocks)):
        for proj in ("attn.o_proj", "mlp.down_proj"):
            centre(f"blocks.{i}.{proj}.weight", 0)
            if f"blocks.{i}.{proj}.bias" in state:
                centre(f"blocks.{i}.{proj}.bias", 0)
        for sub, consumers in (
            ("attn", ("attn.q_proj", "attn.k_proj", "attn.v_proj")),
            ("mlp", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            beta = state.pop(f"blocks.{i}.{sub}_norms.input.bias", None)
            conv.rewritten[f"blocks.{i}.{sub}_norms.input.weight"] = (
                "LayerNorm gamma -> RMSNorm gamma (the stream is zero-mean)"
            )
            if beta is None:
                continue
            conv.dropped.append(f"blocks.{i}.{sub}_norms.input.bias")
            for c in consumers:
                key = f"blocks.{i}.{c}"
                if f"{key}.weight" in state:
                    state[f"{key}.bias"] = state[f"{key}.bias"] + state[f"{key}.weight"] @ beta
                    conv.rewritten[f"{key}.bias"] = "+ W beta (the input LayerNorm's beta, moved)"
    return state


_NGPT_REFUSAL = (
    "convert does not move {src} run to {dst}: nGPT (Loshchilov et al. 2024) keeps every weight row on the unit "
    "sphere and replaces the unit skip by its eigen-rate lerp between normalized states, so no weight means the "
    "same on the other side (each would be renormalized or read without s_qk, s_uv, s_z); train it from the start"
)


def convert(source: str | Path, layout: str, out: str | Path, seed: int = 0, match_scale: bool = True) -> Conversion:
    """Move ``source``'s newest checkpoint to ``layout``; write OUT/checkpoints and OUT/convert.json.

    ``match_scale``: a new output norm (B) or embedding norm starts with gamma = the mean RMS of what it
    normalizes in the old model (`_matched_gains`), so it keeps the scale the old model had; else gamma = 1."""
    own_folder(out, "conversion", claim=False)  # a folder with someone's files fails before any work
    run = load_run_model(source)
    cfg = run.config
    old = run.model
    new_layout = as_layout(layout)
    if old.layout.ngpt != new_layout.ngpt:
        raise ConfigError(_NGPT_REFUSAL.format(src="an nGPT" if old.layout.ngpt else "this", dst=layout))
    new = build_run_model(
        new_layout, cfg.model.size, cfg.model.options, cfg.data.seq_len, old.config.vocab_size, seed=seed
    ).eval()
    if new.config.to_dict() != old.config.to_dict():
        raise ConfigError("the converted model's options differ from the run's; convert changes the layout only")
    conv = Conversion(source=str(source), old_layout=old.layout.to_string(), new_layout=new_layout.to_string())
    refusal = _rms_rewrite_refusal(old, new_layout)
    if refusal:
        raise ConfigError(f"no exact LayerNorm -> RMSNorm rewrite for this run: {refusal}")
    folder = own_folder(out, "conversion")  # claimed once every refusal is behind: a refused call writes nothing
    ours, theirs = new.state_dict(), (_rms_rewrite(old, conv) if refusal is None else old.state_dict())
    state = {}
    for name, value in ours.items():
        if name in theirs and theirs[name].shape == value.shape:
            how = _gain_rewrite(_owner(old, name)[0], _owner(new, name)[0]) if name.endswith(".weight") else None
            if name in conv.rewritten:  # the LayerNorm -> RMSNorm rewrite already made it
                state[name] = theirs[name]
                continue
            if how is None:
                state[name] = theirs[name].clone()
                conv.kept.append(name)
            else:
                state[name] = theirs[name] - 1.0 if how.startswith("gamma ->") else theirs[name] + 1.0
                conv.rewritten[name] = how
        else:
            state[name] = value
            conv.new[name] = _stated_init(new, name, value)
    reshaped = {n for n in ours if n in theirs and theirs[n].shape != ours[n].shape}  # e.g. 4 streams -> 2
    conv.dropped = sorted(set(conv.dropped) | (set(theirs) - set(ours)) | reshaped)
    seqs, where = _held_out(cfg, run.run_dir, min(128, new.config.max_seq_len))
    if match_scale:
        for name, rms in _matched_gains(old, new, seqs).items():
            mod = _owner(new, name)[0]
            if name in conv.new and getattr(mod, "weight", None) is not None and not getattr(mod, "offset", 0.0):
                state[name] = torch.full_like(state[name], rms)
                conv.new[name] = (
                    f"{type(mod).__name__} gamma = {rms:.4g}: the mean RMS of what it normalizes in the "
                    "old model (its scale kept on average)"
                )
    new.load_state_dict(state)
    if any(getattr(b, "attn_omega", None) is not None for b in new.blocks):
        from normlab.model.admin import profile_admin

        profile_admin(new)  # Admin's omegas from the converted weights
        state = new.state_dict()
        for name in conv.new:
            if name.endswith(("attn_omega", "mlp_omega")):
                conv.new[name] = _stated_init(new, name, state[name])
    conv.kl, conv.top1_agreement, conv.tokens = function_change(old, new, seqs)
    conv.text = where
    new_cfg = cfg.with_({"layout": new_layout.to_string()})
    RunDir(folder).write_record({"config": new_cfg.to_dict(), "converted_from": str(source)})
    ckpt = save_checkpoint(folder, 0, {"model": new.state_dict(), "config": new_cfg.to_dict()}, keep_last=1)
    conv.checkpoint = str(ckpt)
    conv.command = _continue_command(new_cfg, folder)
    atomic_write_json(folder / "convert.json", {k: v for k, v in vars(conv).items()})
    return conv


def convert_command(source: str, cfg: ConvertConfig) -> str:
    """`normlab convert SOURCE --layout NEW`: the conversion's lines. With no --out the folder is named after
    the source run and the new layout (`default_out`), and said before any work."""
    if not cfg.layout:
        raise ConfigError("convert needs --layout, the new layout (e.g. --layout peri)")
    out = cfg.out
    if not out:
        path = Path(source)
        out = default_out((path.parent.parent if path.is_file() else path).name, cfg.layout)
        print(f"normlab convert: no --out given: the converted weights go to {out}", flush=True)
    return "\n".join(convert(source, cfg.layout, out, seed=cfg.seed, match_scale=not cfg.unit_gamma).lines())
