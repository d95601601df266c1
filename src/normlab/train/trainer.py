"""The training loop and its run directory.

    runs/NAME/
    ├── config.json      resolved TrainConfig, the command line that reproduces it, model/layout/data facts
    ├── metrics.jsonl    one row per optimizer step (loss, lr, pre-clip grad_norm, tokens, tok/s; val rows)
    ├── summary.json     status ok | diverged | failed, reason and step, final losses, steps, tokens, time
    └── checkpoints/     step_XXXXXXXX.pt, the last `keep_last`, written atomically

A run resumes from its newest checkpoint when started again with the same settings, and then
reproduces the uninterrupted loss curve exactly on CPU (batches are a function of (seed, step)).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import normlab
from normlab.data import load_data
from normlab.data.sft import load_sft_data
from normlab.train.init_from import load_init_weights
from normlab.diagnostics.probes import Probes
from normlab.diagnostics.store import ProbeWriter
from normlab.io import atomic_write_json, truncate_jsonl
from normlab.model import build_model, count_params
from normlab.model.config import ConfigError
from normlab.train import distributed
from normlab.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    remove_stale_temp_files,
    save_checkpoint,
    set_rng_state,
)
from normlab.train.config import TrainConfig
from normlab.train.loggers import Sinks
from normlab.train.monitor import DivergenceMonitor
from normlab.train.optim import lr_at, make_optimizer

# Settings a resumed run must share with the checkpoint's run (the rest only affects reporting).
TRAJECTORY_FIELDS = ("layout", "size", "model", "data", "tokenizer", "seq_len", "batch_size", "grad_accum",
                     "optimizer", "lr", "min_lr", "warmup", "weight_decay", "seed", "steps", "precision", "val_fraction",
                     "task", "init_from")


class TrainingFailed(RuntimeError):
    """The run crashed; its summary.json says why (status "failed")."""


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    out = model(x, targets=y)
    loss = out.loss
    if cfg.z_loss:
        loss = loss + cfg.z_loss * out.logits.float().logsumexp(-1).pow(2).mean()
    return loss


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, cfg: TrainConfig, info: distributed.DistInfo) -> float:
    """Mean validation loss over fixed windows (eval_batches x batch_size of them, whatever the
    world size or accumulation); each rank scores its share of every batch in micro-batches."""
    model.eval()
    total, n = 0.0, 0
    for x, y in batches:
        share = slice(info.rank * len(x) // info.world, (info.rank + 1) * len(x) // info.world)
        x, y = x[share], y[share]
        micro = max(1, cfg.batch_size // (info.world * cfg.grad_accum))
        for i in range(0, len(x), micro):
            xb, yb = x[i : i + micro].to(info.device), y[i : i + micro].to(info.device)
            with _autocast(cfg, info.device):
                total += model(xb, targets=yb).loss.item() * len(xb)
            n += len(xb)
    model.train()
    total, n = distributed.sum_across([total, float(n)], info)
    return total / n


def _state(model: nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig) -> tuple[dict, dict]:
    if cfg.fsdp and torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)
    return _unwrap(model).state_dict(), opt.state_dict()


def _load_state(model: nn.Module, opt: torch.optim.Optimizer, ckpt: dict, cfg: TrainConfig) -> None:
    if cfg.fsdp and torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(model, ckpt["model"], options=opts)
        set_optimizer_state_dict(model, opt, ckpt["optimizer"], options=opts)
        return
    _unwrap(model).load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training as configured; returns the summary (also written to summary.json)."""
    cfg.validate()
    info = distributed.setup(cfg.device)
    try:
        summary = _train(cfg, info)
    except BaseException:
        distributed.teardown(info, clean=False)  # a barrier could wait forever on a rank that died
        raise
    distributed.teardown(info)
    return summary


def _train(cfg: TrainConfig, info: distributed.DistInfo) -> dict[str, Any]:
    run = Path(cfg.out)
    if cfg.batch_size % (info.world * cfg.grad_accum):
        raise ConfigError(f"batch_size={cfg.batch_size} must divide into {info.world} ranks x grad_accum={cfg.grad_accum}")
    ckpts = list_checkpoints(run)
    if (run / "metrics.jsonl").exists() and not (cfg.resume and ckpts):
        raise ConfigError(
            f"{run} already holds a run{' with no checkpoint to resume from' if cfg.resume else ''}; "
            "choose another --out (nothing there is overwritten)"
        )
    torch.manual_seed(cfg.seed)
    if cfg.task == "sft":
        data = load_sft_data(cfg.data, cfg.tokenizer, cfg.seq_len, cfg.val_fraction, cfg.prompt_field,
                             cfg.response_field, cfg.vocab_size)
    else:
        data = load_data(cfg.data, cfg.tokenizer, cfg.val_fraction, cfg.text_field, cfg.token_dtype, cfg.vocab_size)
    overrides = {"vocab_size": data.vocab_size, **cfg.model}
    overrides.setdefault("max_seq_len", max(cfg.seq_len, normlab.model.get_size(cfg.size).max_seq_len))
    model = build_model(cfg.layout, cfg.size, seed=cfg.seed, **overrides)
    if cfg.init_from and not (cfg.resume and ckpts):  # a resumed run's own checkpoint takes precedence
        load_init_weights(model, cfg.init_from)
    model = model.to(info.device)
    params = count_params(model)
    model = distributed.wrap(model, info, cfg.fsdp)
    opt = make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.precision == "fp16")
    monitor = DivergenceMonitor(patience=cfg.diverge_patience, final_loss=cfg.diverge_final_loss)
    fwd = torch.compile(model) if cfg.compile else model

    start, tokens_seen, wall_before = 0, 0, 0.0
    if cfg.resume and ckpts:
        ckpt = load_checkpoint(ckpts[-1])
        saved = ckpt["config"]
        diff = [k for k in TRAJECTORY_FIELDS if saved.get(k) != getattr(cfg, k)]
        if diff:
            raise ConfigError(
                f"{run} holds a checkpoint of a run with different {', '.join(diff)}; "
                "resume with the same settings or choose another --out"
            )
        _load_state(model, opt, ckpt, cfg)
        scaler.load_state_dict(ckpt["scaler"])
        monitor.load_state_dict(ckpt["monitor"])
        set_rng_state(ckpt["rng"])
        start, tokens_seen, wall_before = ckpt["step"], ckpt["tokens"], ckpt["wall_time"]

    per_rank = cfg.batch_size // info.world
    micro = per_rank // cfg.grad_accum
    val = data.val_windows(cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    metrics_path = run / "metrics.jsonl"
    sinks: Sinks | None = None
    if info.is_main:
        run.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(run)
        lay = _unwrap(model).layout if not cfg.fsdp else normlab.parse_layout(cfg.layout)
        atomic_write_json(run / "config.json", {
            "config": cfg.to_dict(),
            "command": "normlab train " + " ".join(cfg.to_args()),
            "layout": lay.to_string(),
            "params": {"total": params.total, "non_embedding": params.non_embedding},
            "data": data.describe(),
            "world_size": info.world,
            "versions": {"normlab": normlab.__version__, "torch": torch.__version__, "python": platform.python_version()},
        })
        truncate_jsonl(metrics_path, start)  # drop rows past the checkpoint: the curve is replayed
        sinks = Sinks(cfg, run, start)
    probes: Probes | None = None
    probe_log: ProbeWriter | None = None
    if info.is_main and cfg.probe_every:
        px, py = data.val_windows(1, cfg.probe_batch, cfg.seq_len)[0]
        probes = Probes(_unwrap(model), (px, py))
        probe_log = ProbeWriter(run / "probes.jsonl", start)

    params_list = [p for p in model.parameters() if p.requires_grad]
    final_val = None
    t_run = time.perf_counter()
    step = start
    try:
        for step in range(start, cfg.steps):
            if monitor.diverged:
                break
            probing = probes is not None and step % cfg.probe_every == 0
            if probing:
                probe_log.write(probes.record(step))
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = data.train_batch(step, cfg.batch_size, cfg.seq_len, cfg.seed)
            x, y = x[info.rank * per_rank : (info.rank + 1) * per_rank], y[info.rank * per_rank : (info.rank + 1) * per_rank]
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for i in range(cfg.grad_accum):
                xb, yb = x[i * micro : (i + 1) * micro].to(info.device), y[i * micro : (i + 1) * micro].to(info.device)
                sync = contextlib.nullcontext()
                if isinstance(model, nn.parallel.DistributedDataParallel) and i < cfg.grad_accum - 1:
                    sync = model.no_sync()
                with sync:
                    with _autocast(cfg, info.device):
                        loss = _loss(fwd, xb, yb, cfg) / cfg.grad_accum
                    scaler.scale(loss).backward()
                loss_sum += loss.item()
            scaler.unscale_(opt)
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params_list, max_norm))
            loss_val = distributed.mean_across(loss_sum, info)
            apply = monitor.check_finite(step, loss_val, grad_norm, cfg.on_nonfinite)
            if probing:
                probes.snapshot()
            if apply:
                scaler.step(opt)
            scaler.update()
            if probing:
                probe_log.write(probes.updates(step))
            dt = time.perf_counter() - t0
            tokens_seen += cfg.batch_size * cfg.seq_len
            row: dict[str, Any] = {
                "step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm, "tokens": tokens_seen,
                "tok_per_s": cfg.batch_size * cfg.seq_len / dt, "time": wall_before + time.perf_counter() - t_run,
            }
            if cfg.precision == "fp16":
                row["loss_scale"] = scaler.get_scale()
            if not apply:
                row["skipped"] = True
            else:
                row.update({k: True for k, v in monitor.update(step, loss_val, grad_norm).items() if v})
            last = step == cfg.steps - 1 or monitor.diverged
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last:
                final_val = evaluate(fwd, val, cfg, info)
                row["val_loss"] = final_val
                row["val_ppl"] = math.exp(min(final_val, 50.0))
            if sinks is not None:
                sinks.log(row)
            if (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or (last and not monitor.diverged):
                _checkpoint(run, model, opt, scaler, monitor, cfg, step + 1, tokens_seen,
                            wall_before + time.perf_counter() - t_run, info)
        else:
            step = cfg.steps
        if probes is not None:  # the end state (also of a diverged run, at the step it stopped)
            probe_log.write(probes.record(step))
        monitor.finish(step)
    except Exception as err:  # a crash is recorded, then raised
        if sinks is not None:
            sinks.close()
        if info.is_main:
            _write_summary(run, cfg, monitor, step, tokens_seen, wall_before + time.perf_counter() - t_run,
                           final_val, params, status="failed", error=f"{type(err).__name__}: {err}")
        raise TrainingFailed(f"run {run} failed at step {step}: {type(err).__name__}: {err}") from err
    finally:
        if sinks is not None:
            sinks.close()  # also on KeyboardInterrupt; closing twice is harmless
        if probe_log is not None:
            probe_log.close()
    summary: dict[str, Any] = {}
    if info.is_main:
        summary = _write_summary(run, cfg, monitor, step, tokens_seen, wall_before + time.perf_counter() - t_run, final_val, params)
    return summary


def _checkpoint(run, model, opt, scaler, monitor, cfg, step, tokens, wall, info) -> None:  # noqa: ANN001
    model_sd, opt_sd = _state(model, opt, cfg)
    if info.is_main:
        save_checkpoint(run, step, {
            "model": model_sd, "optimizer": opt_sd, "scaler": scaler.state_dict(), "monitor": monitor.state_dict(),
            "config": cfg.to_dict(), "tokens": tokens, "wall_time": wall,
        }, cfg.keep_last)


def _write_summary(run: Path, cfg: TrainConfig, monitor: DivergenceMonitor, step: int, tokens: int, wall: float,
                   final_val: float | None, params, status: str | None = None, error: str | None = None) -> dict:  # noqa: ANN001
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").exists() else []
    finite = [r["loss"] for r in rows if math.isfinite(r["loss"])]
    summary = {
        **monitor.summary(),
        "layout": cfg.layout,
        "steps": len(rows),
        "tokens": tokens,
        "wall_time_s": wall,
        "initial_loss": finite[0] if finite else None,
        "final_loss": sum(finite[-10:]) / len(finite[-10:]) if finite else None,
        "final_val_loss": final_val,
        "params_non_embedding": params.non_embedding,
    }
    if status is not None:
        summary["status"] = status
    if error is not None:
        summary["reason"] = error
        summary["failed_step"] = step
    atomic_write_json(run / "summary.json", summary)
    return summary
