"""The training loop: a run's state built from its config, stepped, checkpointed and summarized.

The run directory it writes (config.json, tokenizer.json, metrics.jsonl, probes.jsonl, summary.json,
checkpoints/) is `normlab.runs.files.RunDir`; where a run starts (resume, clean restart, finished)
and its lock are `normlab.runs.start`; its model is `normlab.runs.model.build_run_model`.

A run resumes from its newest checkpoint when started again with the same settings, and then
reproduces the uninterrupted loss curve exactly on CPU (batches are a function of (seed, step)).
This module builds the run's state (`RunState`) and steps it.

Host syncs: a GPU step is queued by the CPU ahead of its execution, and every value read back to
Python (`.item()`, `float(tensor)`) makes the CPU wait for the GPU to drain, so the next step's
kernels are not queued while the GPU finishes this one. A step here reads back one pair, the loss
and the gradient norm, after the backward: the divergence monitor must decide before the
optimizer step whether it may be applied (non-finite values are skipped or stop the run), and the
metrics row needs both. The loss of each micro-batch stays on the device until then. fp16 reads
the loss scale once more after the scaler's update (the monitor's collapse rule). Evaluation
reads one value per evaluation; probes, every `probe_every` steps, read many (they are for insight,
not speed). On CPU a sync costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab._version import __version__
from normlab.config.train import TrainConfig
from normlab.data import load_data
from normlab.data.sft import load_sft_data
from normlab.diagnostics.forensics import describe as describe_break
from normlab.diagnostics.forensics import first_break, gradient_break, site_of
from normlab.diagnostics.probes import Probes
from normlab.diagnostics.stats import spike_score
from normlab.diagnostics.store import ProbeWriter
from normlab.diagnostics.tier import StepTier, TierSpikes, tier_summary
from normlab.errors import CheckpointError, ConfigError
from normlab.io import truncate_jsonl
from normlab.model import count_params, storage
from normlab.runs.checkpoint import (
    load_checkpoint,
    load_sharded_state,
    remove_stale_temp_files,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from normlab.runs.files import RunDir
from normlab.runs.model import build_run_model
from normlab.runs.start import RunLock, Start, check_out, plan_start
from normlab.train import distributed
from normlab.train.ckpt_schedule import SAVE_SHARE, CheckpointSchedule
from normlab.train.init_from import read_init_weights
from normlab.train.loggers import Sinks
from normlab.train.memory import check_fits, device_capacity
from normlab.train.mfu import flops_per_token, optimizer_flops, peak_flops
from normlab.train.monitor import DivergenceMonitor, SkipRule
from normlab.train.optim import lr_at, make_optimizer, set_lr
from normlab.train.qk_clip import QKClip
from normlab.train.spikes import SpikeHandler


class TrainingFailed(RuntimeError):
    """The run crashed; its summary.json says why (status "failed")."""


class Stopped(BaseException):
    """The run was asked to stop (`train(stop=...)`: a scheduler's preemption or time-limit signal) and saved a
    checkpoint at step `step` first; the same command continues from it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at step {step}, checkpoint saved")
        self.step = step


def _autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the language-model loss, a MoE model's router auxiliary loss or None); the step minimizes their sum."""
    out = model(x, targets=y, z_loss=cfg.optim.z_loss, loss_chunk=cfg.run.loss_chunk)
    return out.loss, out.aux_loss


def set_tf32(enabled: bool) -> None:
    """float32 products on CUDA in TF32 (tensor cores, float32 accumulation) or in full IEEE float32,
    through torch's `fp32_precision` settings (the `allow_tf32` flags they replace are deprecated)."""
    mode = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on the device: pinned and copied asynchronously on CUDA (the copy overlaps compute)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, cfg: TrainConfig, info: distributed.DistInfo) -> float:
    """Mean validation loss over fixed windows (eval_batches x batch_size of them, whatever the
    world size or accumulation); each rank scores its share of every batch in micro-batches."""
    model.eval()
    total, n = torch.zeros((), dtype=torch.float64, device=info.device), 0
    for x, y in batches:
        share = slice(info.rank * len(x) // info.world, (info.rank + 1) * len(x) // info.world)
        x, y = to_device(x[share], info.device), to_device(y[share], info.device)
        micro = max(1, cfg.data.batch_size // (info.world * cfg.data.grad_accum))
        for i in range(0, len(x), micro):
            xb, yb = x[i : i + micro], y[i : i + micro]
            with _autocast(cfg, info.device):
                total += model(xb, targets=yb, loss_chunk=cfg.run.loss_chunk).loss.double() * len(xb)
            n += len(xb)
    model.train()
    total, n = distributed.sum_across([total.item(), float(n)], info)  # the one sync of an evaluation
    return total / n


def _optimizer_keyed_by_name(ckpt: dict[str, Any]) -> bool:
    """Whether a whole-model checkpoint's optimizer state names its parameters (FQNs), as
    `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` gathers it: the form an FSDP run
    of an older normlab release saved, before FSDP2 checkpoints were sharded. `Optimizer.state_dict`,
    which this normlab saves, numbers them."""
    optimizer = ckpt.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        return False  # no optimizer state (a final checkpoint), or Muon's pair of states
    return any(isinstance(p, str) for g in groups if isinstance(g, dict) for p in g.get("params", ()))


def resume_refusal(start: Start, cfg: TrainConfig, info: distributed.DistInfo) -> str | None:
    """Why the run cannot resume from ``start``'s checkpoint on this launch (one line), or None if it can.

    - A whole-model checkpoint whose optimizer state is keyed by parameter name was written by an FSDP
      run of an older release; it is not read (whatever the world size), its weights are: ``--init-from``.
    - Under torchrun with ``--fsdp`` only sharded checkpoints resume (`load_sharded_state`); a whole-model
      file (one process, DDP) resumes without ``--fsdp``.
    """
    ckpt, path = start.checkpoint, start.path
    if ckpt is None or "sharded" in ckpt:
        return None
    fresh = f"`normlab train --init-from {path} --out NEW_FOLDER` (its weights; the optimizer starts anew)"
    if _optimizer_keyed_by_name(ckpt):
        return (
            f"{path} was written by an old normlab release (an FSDP run's gathered checkpoint, its optimizer "
            f"state keyed by parameter name), which this normlab does not resume; start a new run from it with "
            f"{fresh}"
        )
    if cfg.run.fsdp and info.enabled:
        return (
            f"{path} is a whole-model checkpoint (of a run in one process or under DDP) and --fsdp under "
            f"torchrun resumes only sharded ones (step_N.dcp); resume this run without --fsdp, or start a "
            f"new run from it with {fresh}"
        )
    return None


def _load_state(model: nn.Module, opt: torch.optim.Optimizer, ckpt: dict, cfg: TrainConfig) -> None:
    """A checkpoint's model and optimizer state into the run's (`resume_refusal` has passed it)."""
    if "sharded" in ckpt:  # FSDP2's DCP folder: resharded onto this run's world size, whatever it is
        load_sharded_state(ckpt["sharded"], model, opt)
        return
    _unwrap(model).load_state_dict(ckpt["model"])
    if "optimizer" in ckpt:
        opt.load_state_dict(ckpt["optimizer"])
    elif ckpt["step"] < cfg.optim.steps:  # a final checkpoint saved without it (keep_optimizer off)
        raise CheckpointError(
            f"the checkpoint at step {ckpt['step']} holds no optimizer state (keep_optimizer was "
            f"off), so the run cannot continue to step {cfg.optim.steps}; start a new run with "
            "--init-from to train these weights further"
        )


def train(
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    lock: RunLock | None = None,
) -> dict[str, Any]:
    """Run training as configured; returns the summary (also written to summary.json). `stop`, once set (from
    another thread), ends the run after its current step with a checkpoint: `Stopped` is raised. `lock`: the
    run's lock, already taken by the caller (a sweep's worker, which takes it before it marks the run running);
    it stays the caller's to release.

    The main rank checks `--out`, takes the run's lock and decides where the run starts (`rundir`);
    the other ranks follow its decision and load the same checkpoint.
    """
    cfg.validate()
    info = distributed.setup(cfg.run.device)
    cfg = cfg.for_device(info.device.type, bf16=info.device.type != "cuda" or torch.cuda.is_bf16_supported())
    if info.device.type == "cpu":
        # subnormal floats (|x| < 1.2e-38) take the x86 FPU's slow path: a stalled Post-LN run with bf16 storage
        # (its tiny gradients and optimizer moments) trained 3.6x slower with them (135.8 s against 37.5 s, the same
        # loss 3.3220). GPUs compute them at full speed; on the CPU they are flushed to zero, for the whole process
        torch.set_flush_denormal(True)
    own, start = None, None  # the lock this call takes (none when the caller holds it)
    refusal: str | None = None  # the main rank's reason not to resume (resume_refusal)
    try:
        if info.is_main:
            check_out(Path(cfg.run.out))
            own = None if lock is not None else RunLock(Path(cfg.run.out))
            remove_stale_temp_files(cfg.run.out)  # of checkpoint writes that were killed
            start = plan_start(cfg, warn=log)
            refusal = resume_refusal(start, cfg, info)
            if start.note and refusal is None:
                log(start.note)
        plan = distributed.broadcast_object(
            None if start is None else (start.step, start.path, start.finished, refusal), info
        )
        if plan[3] is not None:  # every rank refuses (one line each), none waits on another
            raise CheckpointError(plan[3])
        if start is None:  # another rank: the main rank's decision, the checkpoint read from disk
            step, path, finished, _ = plan
            start = Start(
                step=step,
                path=path,
                finished=finished,
                checkpoint=load_checkpoint(path, verify=False) if path is not None else None,
            )
        summary = start.finished if start.finished is not None else _train(cfg, info, start, stop)
    except BaseException:
        distributed.teardown(info, clean=False)  # a barrier could wait forever on a rank that died
        raise
    finally:
        if own is not None:
            own.release()
    distributed.teardown(info)
    return summary if info.is_main else {}


@dataclass
class RunState:
    """Everything a training run holds between steps; `step` is the next step to run."""

    cfg: TrainConfig
    info: distributed.DistInfo
    run: Path
    data: Any
    model: nn.Module  # wrapped (DDP/FSDP) when distributed
    fwd: nn.Module  # what the step calls: the model, compiled or not
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    monitor: DivergenceMonitor
    params: Any  # count_params of the unwrapped model
    val: list
    trainable: list  # the parameters the clip and the optimizer see (frozen gammas excluded)
    step: int = 0
    tokens: int = 0
    wall_before: float = 0.0  # wall time of earlier sessions of this run (from the checkpoint)
    t_start: float = field(default_factory=time.perf_counter)
    final_val: float | None = None
    sinks: Sinks | None = None
    probes: Probes | None = None
    probe_log: ProbeWriter | None = None
    forensics: dict[str, Any] | None = None  # where a diverged run first broke (normlab.diagnostics.forensics)
    flops_per_token: int = 0  # 6N + 12 L H Q T (normlab.train.mfu)
    memory_plan: Any = None  # normlab.train.memory.MemoryPlan on CUDA (checked against the device before the start)
    peak_flops: float | None = None  # the device's dense peak for the run's precision; None: unknown
    tier: StepTier | None = None  # the per-step tier (normlab.diagnostics.tier), layers.jsonl
    tier_spikes: TierSpikes | None = None
    spikes: SpikeHandler | None = None  # the spike policy, rerun and records (normlab.train.spikes)
    layers_log: Any = None  # layers.jsonl, open for appending (main rank)
    qk_clip: QKClip | None = None  # MuonClip's rescale after each step (normlab.train.qk_clip); None: off
    tier_probed: int | None = None  # the last step whose tier spike ran the full probe pass
    ckpts: CheckpointSchedule | None = None  # the steps it saves at (normlab.train.ckpt_schedule)

    @property
    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()  # closing twice is harmless
        if self.probe_log is not None:
            self.probe_log.close()
        if self.layers_log is not None:
            self.layers_log.close()
        if self.tier is not None:
            self.tier.remove()


def _load_data(cfg: TrainConfig):  # noqa: ANN202 - TokenData | SFTData
    if cfg.data.task == "sft":
        return load_sft_data(
            cfg.data.data,
            cfg.data.tokenizer,
            cfg.data.seq_len,
            cfg.data.val_fraction,
            cfg.data.prompt_field,
            cfg.data.response_field,
            cfg.data.vocab_size,
        )
    return load_data(
        cfg.data.data,
        cfg.data.tokenizer,
        cfg.data.val_fraction,
        cfg.data.text_field,
        cfg.data.token_dtype,
        cfg.data.vocab_size,
    )


def build_state(cfg: TrainConfig, info: distributed.DistInfo, start: Start) -> RunState:
    """Data, model, optimizer, scaler and monitor, restored from the start's checkpoint if it has one."""
    if cfg.data.batch_size % (info.world * cfg.data.grad_accum):
        raise ConfigError(
            f"batch_size={cfg.data.batch_size} must divide into {info.world} ranks x grad_accum={cfg.data.grad_accum}"
        )
    torch.manual_seed(cfg.optim.seed)
    data = _load_data(cfg)
    # a run that cannot fit the device is refused before its model is built, with settings that fit
    memory_plan = check_fits(cfg, device_capacity(info.device), info.world, data.vocab_size)
    # the weights to start from are read first (a file that could run code is refused before anything else), and
    # a resumed run's own checkpoint takes precedence
    init = read_init_weights(cfg.model.init_from) if cfg.model.init_from and start.checkpoint is None else None
    if init is not None:
        init.check_vocab(data.vocab_size)
    # a bad vocabulary or context is refused before the run directory holds anything but its lock
    model = build_run_model(
        cfg.model.layout, cfg.model.size, cfg.model.options, cfg.data.seq_len, data.vocab_size, cfg.optim.seed
    )
    if init is not None:
        init.load_into(model)
        del init
    model = model.to(info.device)
    model.activation_checkpointing = cfg.run.activation_checkpointing
    model.set_storage(storage.for_run(cfg.precision, cfg.stored_dtype))
    if info.device.type == "cuda" and cfg.precision == "fp32":
        # TF32 products, float32 accumulation: about 7x the fp32 peak on an H100 (normlab.train.mfu)
        set_tf32(cfg.run.tf32)
    params = count_params(model)
    fpt = flops_per_token(model, cfg.data.seq_len) + optimizer_flops(
        model, cfg.optim.optimizer, cfg.optim.muon_ns_steps
    ) // (cfg.data.batch_size * cfg.data.seq_len)
    model = distributed.wrap(model, info, cfg.run.fsdp)
    opt = make_optimizer(model, cfg, fused=info.device.type == "cuda")
    state = RunState(
        cfg=cfg,
        info=info,
        run=Path(cfg.run.out),
        data=data,
        model=model,
        fwd=torch.compile(model) if cfg.run.compile else model,
        opt=opt,
        scaler=torch.amp.GradScaler(info.device.type, init_scale=cfg.run.loss_scale_init, enabled=cfg.loss_scaled),
        monitor=DivergenceMonitor(
            patience=cfg.run.diverge_patience,
            final_loss=cfg.run.diverge_final_loss,
            max_skipped=cfg.run.max_skipped,
            max_overflow_streak=cfg.run.max_overflow_streak,
            min_loss_scale=cfg.run.min_loss_scale,
            stall_margin=cfg.run.stall_margin,
            unigram_loss=data.unigram_loss() if cfg.run.stall_margin else None,
            skip_rule=SkipRule(window=cfg.run.spike_window, sigmas=cfg.run.spike_sigmas),
        ),
        params=params,
        val=data.val_windows(cfg.run.eval_batches, cfg.data.batch_size, cfg.data.seq_len),
        trainable=[p for p in model.parameters() if p.requires_grad],
        flops_per_token=fpt,
        peak_flops=peak_flops(info.device, cfg.precision, cfg.run.tf32),
        memory_plan=memory_plan,
    )
    if cfg.optim.qk_clip is not None:
        state.qk_clip = QKClip(_unwrap(model), cfg.optim.qk_clip)
    if start.checkpoint is not None:
        ckpt = start.checkpoint
        _load_state(model, opt, ckpt, cfg)
        if state.qk_clip is not None and "qk_clip" in ckpt:
            state.qk_clip.load_state_dict(ckpt["qk_clip"])
        state.scaler.load_state_dict(ckpt["scaler"])
        state.monitor.load_state_dict(ckpt["monitor"])
        set_rng_state(ckpt["rng"])
        state.step, state.tokens, state.wall_before = ckpt["step"], ckpt["tokens"], ckpt["wall_time"]
    return state


def _tokenizer_facts(tok: Any) -> dict[str, Any] | None:
    if tok is None:  # pre-tokenized .bin data
        return None
    return {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "eos_token": tok.eos_token}


def open_records(state: RunState) -> None:
    """config.json, the metrics/probe files cut back to the start step, the loggers (main rank only)."""
    cfg, run = state.cfg, RunDir(state.run)
    if cfg.run.probe_every and (state.info.is_main or cfg.run.fsdp):  # FSDP2: every rank runs the sharded probe
        px, py = state.data.val_windows(1, cfg.run.probe_batch, cfg.data.seq_len)[0]
        state.probes = Probes(_unwrap(state.model), (px, py), optimizer=state.opt)
    if cfg.run.layer_stats:
        state.tier = StepTier(_unwrap(state.model), hooks=not cfg.run.compile)
        state.tier.active = False  # each tier step's reset opens its hooks' window (not an evaluation before it)
        state.tier_spikes = TierSpikes()
    state.spikes = SpikeHandler(state.monitor, cfg.run.on_spike, run if state.info.is_main else None)
    if not state.info.is_main:
        return
    run.path.mkdir(parents=True, exist_ok=True)
    lay = _unwrap(state.model).layout if not cfg.run.fsdp else cfg.model.layout
    run.write_record(
        {
            "config": cfg.to_dict(),
            "command": "normlab train " + " ".join(cfg.to_args()),
            "layout": lay.to_string(),
            "params": {"total": state.params.total, "non_embedding": state.params.non_embedding},
            "data": state.data.describe(),
            "tokenizer": _tokenizer_facts(state.data.tokenizer),
            "world_size": state.info.world,
            "versions": {"normlab": __version__, "torch": torch.__version__, "python": platform.python_version()},
        }
    )
    if hasattr(state.data.tokenizer, "to_json"):
        run.write_tokenizer(state.data.tokenizer.to_json())
    truncate_jsonl(run.metrics_file, state.step)  # drop rows past the checkpoint (and torn lines): replayed
    for path in (run.layers_file, run.spikes_file):
        if path.exists() or (path == run.layers_file and cfg.run.layer_stats):
            truncate_jsonl(path, state.step)
    if cfg.run.layer_stats:
        state.layers_log = run.layers_file.open("a", buffering=1)
    state.sinks = Sinks(cfg, run, state.step)
    if cfg.run.probe_every:
        state.probe_log = ProbeWriter(run.probes_file, state.step)


def micro_batches(state: RunState, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of ``step`` (batches are a function of (seed, step)), on the device."""
    cfg, info = state.cfg, state.info
    per_rank = cfg.data.batch_size // info.world
    micro = per_rank // cfg.data.grad_accum
    mine = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
    window = getattr(state.data, "train_window", None)
    if window is not None:  # one contiguous window, pinned and copied once, split into inputs and targets here
        w = to_device(window(step, cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed)[mine], info.device)
        x, y = w[:, :-1], w[:, 1:]
    else:  # SFT: targets are masked, not a shifted window
        x, y = state.data.train_batch(step, cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed)
        x, y = to_device(x[mine], info.device), to_device(y[mine], info.device)
    return [(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) for i in range(cfg.data.grad_accum)]


def find_break(state: RunState) -> dict[str, Any]:
    """Where the diverged run first broke: its failing step's batch re-run, hooked, through the weights
    in memory (the failing update was never applied), on every rank; the first rank that broke."""
    step = state.monitor.diverged_step
    model = _unwrap(state.model)  # DDP: each rank alone (no collective in a forward); FSDP2: all ranks together
    found = first_break(model, micro_batches(state, step), autocast=lambda: _autocast(state.cfg, state.info.device))
    found["gradients"] = gradient_break(model)
    ranks = distributed.gather_object(found, state.info)
    broke = [(r, f) for r, f in enumerate(ranks) if f["forward"] is not None]
    rank, chosen = broke[0] if broke else (0, ranks[0])
    others = [g for f in ranks for g in f["gradients"] if g not in chosen["gradients"]]
    chosen = {"step": step, **chosen, "rank": rank, "gradients": chosen["gradients"] + list(dict.fromkeys(others))}
    chosen["text"] = describe_break(chosen)
    return chosen


def _forward_backward(state: RunState, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The step's micro-batches forward and backward into .grad (scaled under fp16): (the loss summed over
    them, the auxiliary loss summed, the last auxiliary loss or None), on the device."""
    cfg, info, model, scaler = state.cfg, state.info, state.model, state.scaler
    loss_sum = torch.zeros((), device=info.device)  # on the device: no sync per micro-batch
    aux_sum = torch.zeros((), device=info.device)
    aux = None
    for i, (xb, yb) in enumerate(micro_batches(state, step)):
        sync = contextlib.nullcontext()
        if isinstance(model, nn.parallel.DistributedDataParallel) and i < cfg.data.grad_accum - 1:
            sync = model.no_sync()
        with sync:
            with _autocast(cfg, info.device):
                loss, aux = _loss(state.fwd, xb, yb, cfg)
                loss = loss / cfg.data.grad_accum
                aux = aux / cfg.data.grad_accum if aux is not None else None
            scaler.scale(loss if aux is None else loss + aux).backward()
        loss_sum += loss.detach().float()
        if aux is not None:
            aux_sum += aux.detach().float()
    return loss_sum, aux_sum, aux


# --- the per-step tier and spikes (normlab.diagnostics.tier, normlab.train.spikes) ---


def _tier_step(state: RunState, step: int) -> bool:
    """Whether ``step`` is one of the per-step tier's (every run.layer_stats_every-th), where it is on."""
    return step % state.cfg.run.layer_stats_every == 0


def _spike_start(state: RunState, step: int) -> None:
    """Before a step's forward: on the tier's steps its maxima start again (its hooks record from here to
    `before_step`), and the loss-spike rule keeps the step's RNG state."""
    if state.tier is not None and _tier_step(state, step):
        state.tier.reset()
    if state.spikes is not None:
        state.spikes.start(state.info.device)


def _replay(state: RunState, step: int, same_rng: bool) -> tuple[float, float]:
    """Step ``step``'s forward and backward again on the weights as they are (its gradients kept aside and
    put back): its (loss, gradient norm), reduced over the ranks as the step's own."""
    kept = [p.grad for p in state.trainable]
    for p in state.trainable:
        p.grad = None
    try:
        if same_rng:
            state.spikes.restore_rng(state.info.device)
        loss_sum, aux_sum, _ = _forward_backward(state, step)
        norm = torch.nn.utils.clip_grad_norm_(state.trainable, math.inf)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        scale = state.scaler.get_scale() if state.scaler.is_enabled() else 1.0
        loss = distributed.mean_across_tensor(loss_sum.reshape(1), state.info).item()
        return loss, norm.item() / scale
    finally:
        for p, g in zip(state.trainable, kept):
            p.grad = g


def _global_batch(state: RunState, step: int) -> dict[str, torch.Tensor]:
    """The whole batch of ``step`` (every rank's share), recomputed from (seed, step)."""
    cfg = state.cfg
    window = getattr(state.data, "train_window", None)
    if window is not None:
        return {"tokens": window(step, cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed)}
    x, y = state.data.train_batch(step, cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed)
    return {"inputs": x, "targets": y}


def _spike_check(state: RunState, step: int, loss: float, grad_norm: float) -> dict[str, Any] | None:
    """Before the update of a finite step: the tier's values read (and its per-layer spike rule), the loss and
    gradient-norm rule with its rerun (normlab.train.spikes); on a spike of either, the full probe pass on
    this step's batch with the pre-step weights (sites prefixed spike:). Returns the spike's record or None."""
    fired = []
    if state.tier is not None and _tier_step(state, step):
        fired = state.tier_spikes.check(state.tier.read())
    record = (
        None
        if state.spikes is None
        else state.spikes.check(
            step, loss, grad_norm, lambda s, same: _replay(state, s, same), lambda s: _global_batch(state, s)
        )
    )
    # A per-layer tier spike (two series per layer: one fires often early on) runs the full pass at most once
    # per probe interval; a loss or gradient-norm spike always does.
    every = state.cfg.run.probe_every
    bounded = fired and record is None and state.tier_probed is not None and step - state.tier_probed < every
    if (record is not None or fired) and state.probes is not None:
        rows = []
        if not bounded:
            state.tier_probed = step if fired else state.tier_probed
            x, y = micro_batches(state, step)[0]
            rows = [
                {**r, "site": f"spike:{r['site']}"}
                for r in Probes(state.probes.model, (x, y), optimizer=state.opt).record(step)
            ]
        why = (record["kinds"] if record else []) + fired
        _write_probes(
            state,
            rows + [{"step": step, "layer": None, "site": "spike", "metric": f"fired:{w}", "value": 1.0} for w in why],
        )
    return record


def _tier_row(state: RunState, step: int, applied: bool) -> None:
    """After the update: the tier's row (update RMS and ratio added) to layers.jsonl."""
    if state.tier is None or not _tier_step(state, step):
        return
    row = state.tier.after_step(applied)
    if state.layers_log is not None:
        state.layers_log.write(json.dumps({"step": step, **row}) + "\n")


def _write_probes(state: RunState, rows: list[dict[str, Any]]) -> None:
    """Probe rows to probes.jsonl (the main rank's; under FSDP2 every rank computed the same rows)."""
    if state.probe_log is not None:
        state.probe_log.write(rows)


def train_step(state: RunState) -> dict[str, Any]:
    """One optimizer step (all micro-batches); returns its metrics row."""
    cfg, info, opt, scaler, step = state.cfg, state.info, state.opt, state.scaler, state.step
    probing = state.probes is not None and step % cfg.run.probe_every == 0
    if probing:
        _write_probes(state, state.probes.record(step))
    t0 = time.perf_counter()
    lr = lr_at(step, cfg)
    set_lr(opt, lr)
    opt.zero_grad(set_to_none=True)
    if state.qk_clip is not None:
        state.qk_clip.reset()  # the max logits of this step's micro-batches only
    _spike_start(state, step)
    loss_sum, aux_sum, aux = _forward_backward(state, step)
    scaler.unscale_(opt)  # fp16: the gradients unscaled, an overflow recorded on the device (no sync)
    if state.tier is not None and _tier_step(state, step):
        state.tier.before_step()  # per-block gradient and weight norms, before the clip
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm_t = torch.nn.utils.clip_grad_norm_(state.trainable, max_norm)
    if hasattr(grad_norm_t, "full_tensor"):  # FSDP2: a DTensor; the norm over every rank's shards
        grad_norm_t = grad_norm_t.full_tensor()
    # The step's one read-back (see the module docstring): the monitor decides before the update.
    losses = distributed.mean_across_tensor(torch.stack([loss_sum, aux_sum]), info)  # one collective for both
    loss_val, aux_val, grad_norm = torch.cat([losses, grad_norm_t.float().to(losses.device).reshape(1)]).tolist()
    scaled = scaler.is_enabled()
    apply = state.monitor.check_finite(step, loss_val, grad_norm, cfg.run.on_nonfinite, scaled=scaled)
    spike = _spike_check(state, step, loss_val, grad_norm) if apply else None
    spike_skip = spike is not None and spike["action"] == "skipped"
    apply = apply and not spike_skip
    if probing:
        state.probes.snapshot()
    if apply:
        opt.step()  # the gradients are unscaled and finite: what scaler.step would do, without its sync
        if state.qk_clip is not None:
            state.qk_clip.apply()
    scaler.update()  # fp16: halves the scale after an overflow, doubles it after 2000 clean steps
    _tier_row(state, step, apply)
    if probing:
        _write_probes(state, state.probes.updates(step))
    dt = time.perf_counter() - t0
    state.tokens += cfg.data.batch_size * cfg.data.seq_len
    tok_per_s = cfg.data.batch_size * cfg.data.seq_len / dt
    row: dict[str, Any] = {
        "step": step,
        "loss": loss_val,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": state.tokens,
        "tok_per_s": tok_per_s,
        "tok_per_s_per_device": tok_per_s / info.world,
        "time": state.wall,
    }
    if aux is not None:
        row["moe_aux_loss"] = aux_val  # the routers' load-balancing + z-losses, weighted; not in "loss"
    if state.peak_flops:
        row["mfu"] = tok_per_s / info.world * state.flops_per_token / state.peak_flops
    if scaled:
        row["loss_scale"] = scaler.get_scale()  # fp16's second read-back
        state.monitor.check_scale(step, row["loss_scale"])
    if spike is not None:
        row["spike"] = spike["verdict"]  # data | dynamics | hardware (normlab.train.spikes)
    if spike_skip:
        row["skipped"] = True
    elif not apply:
        row["overflow" if scaled and math.isfinite(loss_val) else "skipped"] = True
    else:
        row.update({k: True for k, v in state.monitor.update(step, loss_val, grad_norm).items() if v})
    return row


def _train(
    cfg: TrainConfig, info: distributed.DistInfo, start: Start, stop: threading.Event | None = None
) -> dict[str, Any]:
    state = build_state(cfg, info, start)
    open_records(state)
    ckpts = state.ckpts = CheckpointSchedule(
        cfg.checkpoint_every, cfg.run.ckpt_every == 0, cfg.optim.steps, info, state.step
    )
    try:
        while state.step < cfg.optim.steps and not state.monitor.diverged:
            row = train_step(state)
            last = state.step == cfg.optim.steps - 1 or state.monitor.diverged
            if (cfg.run.eval_every and (state.step + 1) % cfg.run.eval_every == 0) or last:
                state.final_val = evaluate(state.fwd, state.val, cfg, info)
                row["val_loss"] = state.final_val
                row["val_ppl"] = math.exp(min(state.final_val, 50.0))
            if state.sinks is not None:
                state.sinks.log(row)
            state.step += 1
            if ckpts.due(state.step) or (last and not state.monitor.diverged):
                _checkpoint(state)
            elif stop is not None and stop.is_set() and not last:
                _checkpoint(state)  # saved now: the scheduler's signal gives seconds, not another interval
            if stop is not None and stop.is_set() and not last:
                raise Stopped(state.step)
        if state.final_val is None and state.step >= cfg.optim.steps and not state.monitor.diverged:
            # resumed from the final checkpoint of a run killed before its summary: the last evaluation
            state.final_val = evaluate(state.fwd, state.val, cfg, info)
        if state.monitor.diverged:
            state.forensics = find_break(state)
        if state.probes is not None:  # the end state (also of a diverged run, at the step it stopped)
            _write_probes(state, state.probes.record(state.step))
        state.monitor.finish(state.step)
    except Exception as err:  # a crash is recorded, then raised
        state.close()
        if info.is_main:
            _write_summary(state, status="failed", error=f"{type(err).__name__}: {err}")
        raise TrainingFailed(f"run {state.run} failed at step {state.step}: {type(err).__name__}: {err}") from err
    finally:
        state.close()  # also on KeyboardInterrupt
    return _write_summary(state) if info.is_main else {}


def _checkpoint(state: RunState) -> None:
    """Save the run's state at ``state.step``; every rank calls it (a sharded save is collective), then the
    schedule learns what the save cost (`CheckpointSchedule.saved`), timed on the schedule's own clock."""
    if state.ckpts is None:
        _save(state)
        return
    t0 = state.ckpts.now()
    _save(state)
    grew = state.ckpts.saved(state.step, state.ckpts.now() - t0)
    if grew is not None and state.sinks is not None:
        every, save_s = grew
        state.sinks.note(
            f"checkpoints: a save took {save_s:.1f} s; every {every} steps from step {state.step} on "
            f"(saving at most {SAVE_SHARE:.0%} of the time; --ckpt-every N fixes it)"
        )


def _save(state: RunState) -> None:
    extra = {
        "scaler": state.scaler.state_dict(),
        "monitor": state.monitor.state_dict(),
        "config": state.cfg.to_dict(),
        "tokens": state.tokens,
        "wall_time": state.wall,
    }
    if state.qk_clip is not None:
        extra["qk_clip"] = state.qk_clip.state_dict()
    if state.cfg.run.fsdp and state.info.enabled:  # every rank writes its shards; nothing is gathered
        save_sharded_checkpoint(
            state.run, state.step, state.model, state.opt, extra, state.cfg.run.keep_last, state.info.is_main
        )
    elif state.info.is_main:
        final = state.step >= state.cfg.optim.steps
        optimizer = {} if final and not state.cfg.run.keep_optimizer else {"optimizer": state.opt.state_dict()}
        save_checkpoint(
            state.run,
            state.step,
            {"model": _unwrap(state.model).state_dict(), **optimizer, **extra},
            state.cfg.run.keep_last,
        )


def speed_summary(rows: list[dict], state: RunState) -> dict[str, Any]:
    """Median throughput and MFU over the steps after warm-up (the first 10%, at least one step:
    compilation, allocator growth), per run and per device; MFU "unknown" without a known peak."""
    steps = [r for r in rows if isinstance(r.get("tok_per_s"), (int, float))]
    steady = steps[max(1, len(steps) // 10) :] or steps
    if not steady:
        return {}
    tok_s = statistics.median(r["tok_per_s"] for r in steady)
    per_device = tok_s / state.info.world
    return {
        "tok_per_s": tok_s,
        "tok_per_s_per_device": per_device,
        "devices": state.info.world,
        "device": str(state.info.device),
        "flops_per_token": state.flops_per_token,
        "mfu": per_device * state.flops_per_token / state.peak_flops if state.peak_flops else "unknown",
    }


def max_activation(run: RunDir, forensics: dict[str, Any] | None) -> float | None:
    """The largest finite |activation| of the run: the probes' global top-100 maximum over their steps,
    and for a diverged run the largest finite value the forensic re-run saw (Kim Fig. 11's quantity)."""
    seen = [v for _, v in run.probe_series("global", "top100_max")]
    if forensics:
        seen += [(forensics.get("forward") or {}).get("before"), (forensics.get("largest") or {}).get("value")]
    finite = [float(v) for v in seen if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(finite) if finite else None


def _memory_summary(state: RunState) -> dict[str, float] | None:
    """On CUDA: the plan's total and activations against what the allocator held at most (GiB)."""
    if state.info.device.type != "cuda" or state.memory_plan is None:
        return None
    plan, gib = state.memory_plan, 2**30
    return {
        "planned_gib": round(plan.total / gib, 3),
        "planned_activations_gib": round(plan.activations / gib, 3),
        "max_allocated_gib": round(torch.cuda.max_memory_allocated(state.info.device) / gib, 3),
    }


def _write_summary(state: RunState, status: str | None = None, error: str | None = None) -> dict:
    run = RunDir(state.run)
    rows = run.metrics()
    finite = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    summary = {
        **state.monitor.summary(),
        "layout": state.cfg.model.layout_label,
        "steps": len(rows),
        "tokens": state.tokens,
        "wall_time_s": state.wall,
        **speed_summary(rows, state),
        "initial_loss": finite[0] if finite else None,
        "final_loss": sum(finite[-10:]) / len(finite[-10:]) if finite else None,
        "final_val_loss": state.final_val,
        "params_non_embedding": state.params.non_embedding,
        "activation_dtype": state.cfg.stored_dtype,
        "memory": _memory_summary(state),
        "precision": state.cfg.precision,  # auto decided by the device (config.json holds the resolved settings)
        "compiled": bool(state.cfg.run.compile),
        "max_activation": max_activation(run, state.forensics),
        "forensics": state.forensics,
        "first_break": site_of(state.forensics),
        "spikes": [
            {"step": r["step"], "verdict": r["verdict"], "action": r["action"]} for r in run.spikes() if "verdict" in r
        ],  # normlab.train.spikes: each spike's attribution
        "layer_stats": tier_summary(run.layers()),  # the per-step tier's largest values (normlab.diagnostics.tier)
        # OLMo-core's spike score: the share of steps whose loss or gradient norm jumped 6 sigma over the last 128
        **spike_score([r.get("loss") for r in rows], [r.get("grad_norm") for r in rows]),
    }
    if state.qk_clip is not None:
        summary["qk_clip"] = state.qk_clip.summary()
    if status is not None:
        summary["status"] = status
    if error is not None:
        summary["reason"] = error
        summary["failed_step"] = state.step
    run.write_summary(summary)
    return summary
