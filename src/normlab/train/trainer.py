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
and the gradient norm, after the backward: the hooks (the divergence hook, `normlab.train.step_hooks`)
must decide before the optimizer step whether it may be applied (non-finite values are skipped or
stop the run), and the metrics row needs both. The loss of each micro-batch stays on the device until
then. fp16 reads the loss scale once more after the scaler's update (the divergence hook's collapse rule).
Evaluation reads one value per evaluation; probes, every `probe_every` steps, read many (they are for insight,
not speed). On CPU a sync costs nothing.

The loop asks its hooks (`normlab.diagnostics.hooks.StepHooks`), never a particular component, whether a step's
update is applied (`before_update`), what the row adds (`row_metrics`), whether the run stops (`stop_request`: the
divergence hook once the run diverged) and whether it saves (`checkpoint_due`: the checkpoint schedule's hook); it
saves on its own only when a scheduler's signal (`stop`) arrives.
"""

from __future__ import annotations

import contextlib
import math
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from normlab._version import __version__
from normlab.config.train import TrainConfig
from normlab.data.dataset import TokenData, load_data
from normlab.data.sft import SFTData, load_sft_data
from normlab.diagnostics.forensics import describe as describe_break
from normlab.diagnostics.forensics import first_break, gradient_break
from normlab.diagnostics.hooks import StepHook, Stop
from normlab.errors import CheckpointError, ConfigError
from normlab.io import truncate_jsonl
from normlab.model import count_params, storage
from normlab.runs.checkpoint import (
    load_checkpoint,
    remove_stale_temp_files,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from normlab.runs.files import RunDir
from normlab.runs.lock import RunLock
from normlab.runs.metrics import Metric
from normlab.runs.model import build_run_model
from normlab.runs.start import Start, check_out, plan_start
from normlab.runs.summary import Forensics
from normlab.train import distributed, faults
from normlab.train.divergence import monitor_for
from normlab.train.handle import RunHandle, StepActions
from normlab.train.hook_registry import LoggerHook, build_hooks
from normlab.train.init_from import read_init_weights
from normlab.train.memory import check_fits, device_capacity
from normlab.train.mfu import flops_per_token, optimizer_flops, peak_flops
from normlab.train.optim import lr_at, make_optimizer, set_lr
from normlab.train.qk_clip import QKClip
from normlab.train.resume import load_state, resume_refusal
from normlab.train.run_state import RunState
from normlab.train.run_summary import max_activation, speed_summary, write_summary  # noqa: F401 - their old home
from normlab.train.step_hooks import QKClipHook
from normlab.train.taper import TaperHook


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
    torch.backends.cudnn.conv.fp32_precision = mode  # type: ignore[attr-defined]  # set at import, not in torch's stubs


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on the device: pinned and copied asynchronously on CUDA (the copy overlaps compute)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Any], cfg: TrainConfig, info: distributed.DistInfo) -> float:
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
    loss_sum, count = distributed.sum_across([total.item(), float(n)], info)  # the one sync of an evaluation
    return loss_sum / count


def train(
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    lock: RunLock | None = None,
    hooks: Sequence[StepHook] = (),
) -> dict[str, Any]:
    """Run training as configured; returns the summary (also written to summary.json). `stop`, once set (from
    another thread), ends the run after its current step with a checkpoint: `Stopped` is raised. `lock`: the
    run's lock, already taken by the caller (a sweep's worker, which takes it before it marks the run running);
    it stays the caller's to release. `hooks`: the user's own step hooks (`normlab.diagnostics.hooks.StepHook`
    instances), run after the built-in ones; one with a ``bind(handle)`` method is given the run's handle
    (`normlab.train.handle.RunHandle`) before the first step.

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
        summary = start.finished if start.finished is not None else _train(cfg, info, start, stop, hooks)
    except BaseException:
        distributed.teardown(info, clean=False)  # a barrier could wait forever on a rank that died
        raise
    finally:
        if own is not None:
            own.release()
    distributed.teardown(info)
    return summary if info.is_main else {}


def load_run_data(cfg: TrainConfig) -> TokenData | SFTData:
    """The token data a run with ``cfg`` trains on (its data section: source, tokenizer, split, task)."""
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
    """Data, model, optimizer, scaler and divergence monitor, restored from the start's checkpoint if it has one
    (the hooks' own entries are restored once they are built: `open_records`)."""
    if cfg.data.batch_size % (info.world * cfg.data.grad_accum):
        raise ConfigError(
            f"batch_size={cfg.data.batch_size} must divide into {info.world} ranks x grad_accum={cfg.data.grad_accum}"
        )
    torch.manual_seed(cfg.optim.seed)
    data = load_run_data(cfg)
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
    wrapped = distributed.wrap(model, info, cfg.run.fsdp)
    opt = make_optimizer(wrapped, cfg, fused=info.device.type == "cuda")
    state = RunState(
        cfg=cfg,
        info=info,
        run=Path(cfg.run.out),
        data=data,
        model=wrapped,
        # torch.compile of a module returns one (OptimizedModule); its stub says a Callable
        fwd=cast(nn.Module, torch.compile(wrapped)) if cfg.run.compile else wrapped,
        opt=opt,
        scaler=torch.amp.GradScaler(info.device.type, init_scale=cfg.run.loss_scale_init, enabled=cfg.loss_scaled),
        monitor=monitor_for(cfg.divergence, data.unigram_loss() if cfg.divergence.stall_margin else None),
        params=params,
        val=data.val_windows(cfg.run.eval_batches, cfg.data.batch_size, cfg.data.seq_len),
        trainable=[p for p in wrapped.parameters() if p.requires_grad],
        flops_per_token=fpt,
        peak_flops=peak_flops(info.device, cfg.precision, cfg.run.tf32),
        memory_plan=memory_plan,
    )
    if cfg.optim.qk_clip is not None:
        state.hooks.add(QKClipHook(QKClip(distributed.unwrap(wrapped), cfg.optim.qk_clip)))
    if (taper := TaperHook.for_model(distributed.unwrap(wrapped), cfg.optim.steps)) is not None:
        state.hooks.add(taper)  # TaperNorm's gate on the step's schedule (normlab.train.taper)
    if start.checkpoint is not None:
        ckpt = start.checkpoint
        load_state(wrapped, opt, ckpt, cfg)
        state.scaler.load_state_dict(ckpt["scaler"])
        state.monitor.load_state_dict(ckpt["monitor"])
        set_rng_state(ckpt["rng"])
        state.step, state.tokens, state.wall_before = ckpt["step"], ckpt["tokens"], ckpt["wall_time"]
    return state


def _tokenizer_facts(tok: Any) -> dict[str, Any] | None:
    if tok is None:  # pre-tokenized .bin data
        return None
    return {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "eos_token": tok.eos_token}


def open_records(
    state: RunState, user_hooks: Sequence[StepHook] = (), checkpoint: dict[str, Any] | None = None
) -> None:
    """config.json and the metrics files cut back to the start step (main rank only), then the run's step hooks,
    each built by name from its own section (`normlab.train.hook_registry`: the probe pass, the per-step tier, the
    divergence monitor's decisions and the spike policy, the early warnings, a fault, the checkpoint schedule, the
    loggers), then the user's hooks; each hook with `bind` is given the run's handle. A resumed run's
    ``checkpoint``: each stateful hook's entry restored (QK-clip's "qk_clip")."""
    if state.info.is_main:
        _write_run_record(state, RunDir(state.run))
    handle = RunHandle(state, StepActions(replay, global_batch, micro_batches))
    built = build_hooks(state.cfg, handle)
    logger = built.get("loggers")
    state.sinks = logger.sinks if isinstance(logger, LoggerHook) else None
    for hook in [*built.values(), *user_hooks]:
        bind = getattr(hook, "bind", None)
        if callable(bind):
            bind(handle)
        state.hooks.add(hook)
    if checkpoint is not None:
        state.hooks.load_state_dict(checkpoint)


def _write_run_record(state: RunState, run: RunDir) -> None:
    """The main rank's config.json and tokenizer, its metrics and per-step files cut back to the start step."""
    cfg = state.cfg
    run.path.mkdir(parents=True, exist_ok=True)
    lay = distributed.unwrap(state.model).layout if not cfg.run.fsdp else cfg.model.layout
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
        if path.exists() or (path == run.layers_file and cfg.tier.layer_stats):
            truncate_jsonl(path, state.step)


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
    x, y = faults.corrupt(step, cfg, x, y)  # as read unless a corrupt_batch fault is injected (run.fault)
    return [(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) for i in range(cfg.data.grad_accum)]


def find_break(state: RunState, step: int) -> Forensics:
    """Where the diverged run first broke: its failing ``step``'s batch re-run, hooked, through the weights
    in memory (the failing update was never applied), on every rank; the first rank that broke."""
    model = distributed.unwrap(state.model)  # DDP: each rank alone (no collective in a forward); FSDP2: all together
    found = first_break(model, micro_batches(state, step), autocast=lambda: _autocast(state.cfg, state.info.device))
    found["gradients"] = gradient_break(model)
    ranks = distributed.gather_object(found, state.info)
    broke = [(r, f) for r, f in enumerate(ranks) if f["forward"] is not None]
    rank, chosen = broke[0] if broke else (0, ranks[0])
    others = [g for f in ranks for g in f["gradients"] if g not in chosen["gradients"]]
    chosen = {"step": step, **chosen, "rank": rank, "gradients": chosen["gradients"] + list(dict.fromkeys(others))}
    chosen["text"] = describe_break(chosen)
    return Forensics.from_json(chosen)


def _forward_backward(state: RunState, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The step's micro-batches forward and backward into .grad (scaled under fp16): (the loss summed over
    them, the auxiliary loss summed, the last auxiliary loss or None), on the device."""
    cfg, info, model, scaler = state.cfg, state.info, state.model, state.scaler
    loss_sum = torch.zeros((), device=info.device)  # on the device: no sync per micro-batch
    aux_sum = torch.zeros((), device=info.device)
    aux = None
    for i, (xb, yb) in enumerate(micro_batches(state, step)):
        sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
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


def replay(state: RunState, step: int, restore_rng: Callable[[], None] | None = None) -> tuple[float, float]:
    """Step ``step``'s forward and backward again on the weights as they are (its gradients kept aside and
    put back): its (loss, gradient norm), reduced over the ranks as the step's own; ``restore_rng()`` first,
    where given (the step's own RNG state: `normlab.train.spikes.SpikeHandler.restore_rng`)."""
    kept = [p.grad for p in state.trainable]
    for p in state.trainable:
        p.grad = None
    try:
        if restore_rng is not None:
            restore_rng()
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


def global_batch(state: RunState, step: int) -> dict[str, torch.Tensor]:
    """The whole batch of ``step`` (every rank's share), recomputed from (seed, step)."""
    cfg = state.cfg
    window = getattr(state.data, "train_window", None)
    if window is not None:
        return {"tokens": window(step, cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed)}
    x, y = state.data.train_batch(step, cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed)
    return {"inputs": x, "targets": y}


def train_step(state: RunState) -> dict[str, Any]:
    """One optimizer step (all micro-batches); returns its metrics row."""
    cfg, info, opt, scaler, step = state.cfg, state.info, state.opt, state.scaler, state.step
    state.hooks.pre_step(step)  # the probe pass (untimed), the tier's and QK-clip's resets, the step's RNG state
    t0 = time.perf_counter()
    lr = lr_at(step, cfg) * faults.lr_factor(step, cfg)  # x1 unless an lr_jump fault is injected (run.fault)
    set_lr(opt, lr)
    opt.zero_grad(set_to_none=True)
    loss_sum, aux_sum, aux = _forward_backward(state, step)
    # fp16: the gradients unscaled, an overflow recorded on the device (no sync)
    scaler.unscale_(opt)  # type: ignore[arg-type]  # MuonAdamW is read as torch's optimizers are (param_groups)
    state.hooks.post_backward(step)  # before the clip: the tier's gradient norms, the probes' pre-step weights
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm_t = torch.nn.utils.clip_grad_norm_(state.trainable, max_norm)
    if hasattr(grad_norm_t, "full_tensor"):  # FSDP2: a DTensor; the norm over every rank's shards
        grad_norm_t = grad_norm_t.full_tensor()
    # The step's one read-back (see the module docstring): the hooks decide before the update.
    losses = distributed.mean_across_tensor(torch.stack([loss_sum, aux_sum]), info)  # one collective for both
    loss_val, aux_val, grad_norm = torch.cat([losses, grad_norm_t.float().to(losses.device).reshape(1)]).tolist()
    scaled = scaler.is_enabled()
    # the divergence hook admits the step or not (non-finite values, fp16's overflow), then the spike policy's veto
    update = state.hooks.before_update(step, loss_val, grad_norm, scaled)
    apply, spike = update.applied, update.record
    if apply:
        opt.step()  # the gradients are unscaled and finite: what scaler.step would do, without its sync
    scaler.update()  # fp16: halves the scale after an overflow, doubles it after 2000 clean steps
    state.hooks.post_step(step, apply)  # QK-clip's rescale, the tier's row, the probes' update rows
    dt = time.perf_counter() - t0
    state.tokens += cfg.data.batch_size * cfg.data.seq_len
    tok_per_s = cfg.data.batch_size * cfg.data.seq_len / dt
    row: dict[str, Any] = {
        Metric.STEP: step,
        Metric.LOSS: loss_val,
        Metric.LR: lr,
        Metric.GRAD_NORM: grad_norm,
        Metric.TOKENS: state.tokens,
        Metric.TOK_PER_S: tok_per_s,
        Metric.TOK_PER_S_PER_DEVICE: tok_per_s / info.world,
        Metric.TIME: state.wall,
    }
    if aux is not None:
        row[Metric.MOE_AUX_LOSS] = aux_val  # the routers' load-balancing + z-losses, weighted; not in the loss
    if state.peak_flops:
        row[Metric.MFU] = tok_per_s / info.world * state.flops_per_token / state.peak_flops
    if scaled:
        row[Metric.LOSS_SCALE] = scaler.get_scale()  # fp16's second read-back
    if spike is not None:
        row[Metric.SPIKE] = spike["verdict"]  # data | dynamics | hardware (normlab.train.spikes)
    if update.vetoed:
        row[Metric.SKIPPED] = True
    elif not apply:
        # fp16's overflow: a finite loss, non-finite gradients; any other refusal (non-finite values, a hook's) skips
        overflow = scaled and math.isfinite(loss_val) and not math.isfinite(grad_norm)
        row[Metric.OVERFLOW if overflow else Metric.SKIPPED] = True
    row.update(state.hooks.row_metrics(step, apply, row))  # the divergence hook: the scale's check, its spike flags
    return row


def _train(
    cfg: TrainConfig,
    info: distributed.DistInfo,
    start: Start,
    stop: threading.Event | None = None,
    hooks: Sequence[StepHook] = (),
) -> dict[str, Any]:
    state = build_state(cfg, info, start)
    open_records(state, hooks, start.checkpoint)
    try:
        halt = _loop(state, stop)
        failed = halt is not None and halt.failed  # diverged
        if state.final_val is None and state.step >= cfg.optim.steps and not failed:
            # resumed from the final checkpoint of a run killed before its summary: the last evaluation
            state.final_val = evaluate(state.fwd, state.val, cfg, info)
        if halt is not None and halt.failed:
            state.forensics = find_break(state, halt.step)
        elif halt is not None and state.sinks is not None:  # a hook ended the run early, not as a failure
            state.sinks.note(f"stopped after step {halt.step} by a hook: {halt.reason}")
        # the probes' end state (also of a diverged run, where it stopped); the divergence hook's final rules
        state.hooks.post_train(state.step)
    except Exception as err:  # a crash is recorded, then raised
        state.close()
        if info.is_main:
            write_summary(state, status="failed", error=f"{type(err).__name__}: {err}")
        raise TrainingFailed(f"run {state.run} failed at step {state.step}: {type(err).__name__}: {err}") from err
    finally:
        state.close()  # also on KeyboardInterrupt
    return write_summary(state, halt=halt) if info.is_main else {}


def _loop(state: RunState, stop: threading.Event | None) -> Stop | None:
    """Step the run to its last step or until a hook asks it to stop (the divergence hook: diverged), evaluating,
    logging each row and saving where a hook asks (the checkpoint schedule; the last step unless the run failed)
    or where the scheduler's ``stop`` signal arrived (then `Stopped` is raised); returns the hooks' stop, or None."""
    cfg, info = state.cfg, state.info
    halt = state.hooks.stop_request()  # a checkpoint of a run that had diverged: nothing to step
    while state.step < cfg.optim.steps and halt is None:
        row = train_step(state)
        halt = state.hooks.stop_request()
        last = state.step == cfg.optim.steps - 1 or halt is not None
        if (cfg.run.eval_every and (state.step + 1) % cfg.run.eval_every == 0) or last:
            state.final_val = evaluate(state.fwd, state.val, cfg, info)
            row[Metric.VAL_LOSS] = state.final_val
            row[Metric.VAL_PPL] = math.exp(min(state.final_val, 50.0))
        state.hooks.row_done(row)  # the loggers' hook writes it (main rank)
        state.step += 1
        finishing = last and not (halt is not None and halt.failed)  # a diverged run saves no last checkpoint
        signalled = stop is not None and stop.is_set() and not last
        # saved on a signal even off the schedule: the scheduler's signal gives seconds, not another interval
        if state.hooks.checkpoint_due(state.step, finishing) or signalled:
            _checkpoint(state)
        if signalled:
            raise Stopped(state.step)
    return halt


def _checkpoint(state: RunState) -> None:
    """Save the run's state at ``state.step``; every rank calls it (a sharded save is collective), its hooks told
    before and after (the checkpoint schedule times the save and learns what it cost)."""
    state.hooks.pre_checkpoint(state.step)
    _save(state)
    state.hooks.post_checkpoint(state.step)


def _save(state: RunState) -> None:
    extra = {
        "scaler": state.scaler.state_dict(),
        "monitor": state.monitor.state_dict(),
        "config": state.cfg.to_dict(),
        "tokens": state.tokens,
        "wall_time": state.wall,
    }
    extra.update(state.hooks.state_dict())  # each stateful hook's entry (QK-clip's "qk_clip")
    if state.cfg.run.fsdp and state.info.enabled:  # every rank writes its shards; nothing is gathered
        assert isinstance(state.opt, torch.optim.Optimizer)  # FSDP2 refuses Muon (TrainConfig's validation)
        save_sharded_checkpoint(
            state.run, state.step, state.model, state.opt, extra, state.cfg.checkpointing.keep_last, state.info.is_main
        )
    elif state.info.is_main:
        final = state.step >= state.cfg.optim.steps
        optimizer = (
            {} if final and not state.cfg.checkpointing.keep_optimizer else {"optimizer": state.opt.state_dict()}
        )
        save_checkpoint(
            state.run,
            state.step,
            {"model": distributed.unwrap(state.model).state_dict(), **optimizer, **extra},
            state.cfg.checkpointing.keep_last,
        )
