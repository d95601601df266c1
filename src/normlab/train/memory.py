"""How much device memory a run needs, before it runs: `normlab plan`, the trainer's check on CUDA, and
the sweep's worker count on a GPU.

    weights     4 N bytes (float32 masters; FSDP2: / world size)
    gradients   4 N
    optimizer   8 N for AdamW (two float32 moments), 4 N for SGD with momentum; Muon: 4 M for the momentum of
                the M matrix weights it takes (normlab.model.params.analytic_matrices) + 8 (N - M) for AdamW's
                moments on the rest (its Newton-Schulz temporaries, a bf16 matrix and two Gram matrices of
                the largest matrix, are transient and inside the overhead)
    autocast    2 N: the bf16/fp16 copy of each weight autocast keeps for the step
    activations what the backward keeps, per micro-batch (measured, below)
    logits      the loss's transient: chunk x V x 10 bytes (float32 logits, their gradient, a 16-bit copy);
                without chunking the whole micro-batch's logits are kept for the backward instead
    overhead    1 GiB: the CUDA context, cuBLAS workspaces and allocator slack

Activations are *measured*, not modelled: every layout keeps different tensors (each norm site keeps
its input, Peri-LN's output norms keep f(u), QK-norm keeps q and k, ...), and the dtype each is kept
in follows the precision and the activation storage. The plan runs the run's own model on the CPU at
the run's width under the run's autocast and storage, at one and two layers and at two lengths, with
`torch.autograd.graph.saved_tensors_hooks` counting the bytes kept for the backward (each storage
once); the differences give the bytes per token per block and per token outside the blocks. That is
exact for fused attention (flash / memory-efficient SDPA keep O(T) per head, not the T x T scores);
the total is scaled to the run's micro-batch and depth; a model too wide to build is measured on two
narrower copies and extrapolated (`_slopes`): the plan never builds what it plans. With activation checkpointing a
block keeps its input only, and the backward recomputes one
block at a time: that block's full activations are added once. tests/integration/test_memory.py
checks the plan against the same measurement on whole models.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from normlab.config.optimizers import OPTIMIZERS
from normlab.config.train import TrainConfig
from normlab.errors import ConfigError
from normlab.model import storage
from normlab.model.config import ModelConfig, get_size

GIB = 2**30
OVERHEAD = 1 * GIB
PROBE_TOKENS = 64  # the measurement's sequence length (activations scale linearly in tokens)
PROBE_PARAMS = 64 * 2**20  # the measurement's two-layer models at most this large; wider ones are scaled
PROBE_HEAD_DIM = 8  # the narrowest head a scaled measurement uses


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device for one run (one rank), by what holds them."""

    params: int
    weights: int
    gradients: int
    optimizer: int
    autocast_copies: int
    activations: int
    logits: int
    overhead: int
    micro_batch: int  # sequences per micro-batch on this rank
    seq_len: int

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.autocast_copies
            + self.activations
            + self.logits
            + self.overhead
        )

    def table(self) -> str:
        rows = [(k, v) for k, v in asdict(self).items() if k not in ("params", "micro_batch", "seq_len")]
        lines = [f"{k:16s} {v / GIB:8.2f} GiB" for k, v in rows] + [f"{'total':16s} {self.total / GIB:8.2f} GiB"]
        return "\n".join(lines)


def _saved_bytes(
    cfg: TrainConfig, n_layers: int, tokens: int, recompute: bool, vocab: int, widths: dict[str, int] | None = None
) -> int:
    """Bytes the backward keeps after one forward + loss of the run's model at ``n_layers`` on ``tokens``
    tokens (one sequence), measured on the CPU; ``widths``: the model options of a narrower copy."""
    from normlab.model.build import build_model

    options: dict[str, Any] = {
        **cfg.model.options,
        "n_layers": n_layers,
        "vocab_size": vocab,
        "max_seq_len": max(tokens, get_size(cfg.model.size).max_seq_len),
        **(widths or {}),
    }
    model = build_model(cfg.model.layout, cfg.model.size, seed=0, **options).train()
    model.activation_checkpointing = recompute
    model.set_storage(storage.for_run(cfg.precision, cfg.stored_dtype))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":  # parameters are left out below, by storage
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    x = torch.randint(0, vocab, (1, tokens))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}  # resident already
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=dtype, enabled=dtype is not None),
    ):
        model(x, targets=x, z_loss=cfg.optim.z_loss, loss_chunk=cfg.run.loss_chunk)  # as the trainer's step
    return sum(n for ptr, n in seen.items() if ptr not in params)


def _slopes_at(cfg: TrainConfig, recompute: bool, vocab: int, widths: dict[str, int] | None) -> tuple[float, float]:
    short, long = PROBE_TOKENS // 2, PROBE_TOKENS
    m = {(n, t): _saved_bytes(cfg, n, t, recompute, vocab, widths) for n in (1, 2) for t in (short, long)}
    block = ((m[2, long] - m[1, long]) - (m[2, short] - m[1, short])) / (long - short)
    model = (m[1, long] - m[1, short]) / (long - short) - block
    return max(0.0, model), max(0.0, block)


def narrow_widths(model_cfg: ModelConfig, scale: int) -> dict[str, int]:
    """Model options of a copy 1/`scale` as wide: the width, each head's width and the FFN (and the
    experts') divided, the head counts kept; everything a token keeps per block is linear in those."""
    hd = model_cfg.head_dim // scale
    out = {"d_model": model_cfg.d_model // scale, "d_head": hd, "d_ff": max(1, model_cfg.ffn_dim // scale)}
    if model_cfg.n_experts:
        out["expert_d_ff"] = max(1, model_cfg.expert_ffn_dim // scale)
    return out


def _slopes(cfg: TrainConfig, recompute: bool, vocab: int) -> tuple[float, float]:
    """Bytes kept per token outside the blocks (embedding, final norm, loss) and per token per block.
    Measured at two depths and two lengths: the differences leave out what does not grow with tokens
    (autocast's weight copies, counted once in the plan) and what does not grow with depth.

    A model whose two-layer copy is larger than PROBE_PARAMS is never built: the same measurement runs
    on two copies 1/s and 1/2s as wide (`narrow_widths`; heads of at least PROBE_HEAD_DIM) and the bytes,
    linear in the widths, are extrapolated to the run's (the difference of the two measurements is
    what grows with width); a shape whose narrowest copy is still too large is refused."""
    from normlab.layout import as_layout
    from normlab.model.params import analytic_params

    model_cfg = cfg.model.model_config()

    def params(c: ModelConfig) -> int:
        c = c.with_(n_layers=2, vocab_size=min(vocab, 512))
        return analytic_params(c, as_layout(cfg.model.layout).resolve(2)).total

    if params(model_cfg) <= PROBE_PARAMS:
        return _slopes_at(cfg, recompute, vocab, None)
    scale = 1
    while scale == 1 or params(model_cfg.with_(**narrow_widths(model_cfg, scale))) > PROBE_PARAMS:
        if model_cfg.head_dim // (4 * scale) < PROBE_HEAD_DIM or model_cfg.d_model % (4 * scale):
            raise ConfigError(
                f"cannot plan d_model {model_cfg.d_model} with {model_cfg.n_heads} heads of "
                f"{model_cfg.head_dim}: even a copy narrow enough to measure has more than "
                f"{PROBE_PARAMS / 1e6:.1f}M parameters in two layers (the plan never builds what it "
                "plans)"
            )
        scale *= 2
    wide = _slopes_at(cfg, recompute, vocab, narrow_widths(model_cfg, scale))
    narrow = _slopes_at(cfg, recompute, vocab, narrow_widths(model_cfg, 2 * scale))
    # bytes = a + b / s over the scale s: through s and 2s, at s = 1
    return tuple(max(0.0, n + (w - n) * (2 * scale - 1)) for w, n in zip(wide, narrow))  # type: ignore[return-value]


def optimizer_state_bytes(cfg: TrainConfig, optimizer: str, params: int) -> int:
    """The bytes of state ``optimizer`` keeps for ``params`` parameters it takes: its facts' float32 numbers per
    parameter (normlab.config.optimizers), none where the setting its state needs is 0 (SGD without momentum)."""
    facts = OPTIMIZERS[optimizer]
    if facts.state_if is not None and not getattr(cfg.optim, facts.state_if):
        return 0
    return 4 * facts.state_floats * params


def plan_memory(cfg: TrainConfig, world: int = 1, vocab: int | None = None) -> MemoryPlan:
    """The memory plan of ``cfg`` on one of ``world`` ranks (see the module docstring); ``vocab``: the
    data's, once known (else from the settings, `TrainConfig.expected_vocab`)."""
    from normlab.model.params import analytic_matrices, analytic_params

    cfg = cfg.for_device("cuda")  # the plan is for a GPU: precision auto is bf16 there
    model_cfg = cfg.model.model_config()
    vocab = max(vocab or 0, cfg.expected_vocab)
    resolved = cfg.model.layout.resolve(model_cfg.n_layers)
    n = analytic_params(model_cfg.with_(vocab_size=vocab), resolved).total
    shard = world if cfg.run.fsdp else 1
    micro = cfg.data.batch_size // world // cfg.data.grad_accum
    tokens = micro * cfg.data.seq_len
    per_token, per_block = _slopes(cfg, recompute=False, vocab=vocab)
    if cfg.run.activation_checkpointing:
        kept_token, kept_block = _slopes(
            cfg, recompute=True, vocab=vocab
        )  # each block keeps its input; one is recomputed
        activations = (kept_token + model_cfg.n_layers * kept_block + per_block) * tokens
    else:
        activations = (per_token + model_cfg.n_layers * per_block) * tokens
    chunk = cfg.run.loss_chunk
    logits = (min(tokens, chunk) * vocab * 10) if chunk else tokens * vocab * (4 + 2 + 4)
    facts = OPTIMIZERS[cfg.optim.optimizer]
    taken = analytic_matrices(model_cfg, resolved) if facts.takes == "matrices" else n
    optim = optimizer_state_bytes(cfg, facts.name, taken)
    if facts.rest is not None:  # Muon: AdamW's moments on what it does not take
        optim += optimizer_state_bytes(cfg, facts.rest, n - taken)
    autocast = 2 * n if cfg.precision in ("bf16", "fp16") else 0
    return MemoryPlan(
        params=n,
        weights=4 * n // shard,
        gradients=4 * n // shard,
        optimizer=optim // shard,
        autocast_copies=autocast,
        activations=int(math.ceil(activations)),
        logits=int(logits),
        overhead=OVERHEAD,
        micro_batch=micro,
        seq_len=cfg.data.seq_len,
    )


def device_capacity(device: torch.device) -> int | None:
    """A CUDA device's memory in bytes (None elsewhere: a CPU run is not planned)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def check_fits(cfg: TrainConfig, capacity: int | None, world: int = 1, vocab: int | None = None) -> MemoryPlan | None:
    """Refuse, before the model is built, a run whose plan exceeds ``capacity``, naming what would fit."""
    if capacity is None:
        return None
    plan = plan_memory(cfg, world, vocab)
    if plan.total > capacity:
        options = fitting_options(cfg, capacity, world)
        raise ConfigError(
            f"this run needs about {plan.total / GIB:.1f} GiB per device (activations "
            f"{plan.activations / GIB:.1f} GiB for a micro-batch of {plan.micro_batch} x {plan.seq_len}) "
            f"and the device has {capacity / GIB:.1f} GiB; "
            + (
                "these fit: " + "; ".join(options)
                if options
                else "no accumulation or checkpointing fits: use FSDP over more devices or a smaller model"
            )
            + " (normlab plan shows the whole estimate)"
        )
    return plan


def fitting_options(cfg: TrainConfig, capacity: int, world: int = 1) -> list[str]:
    """Settings that bring ``cfg`` under ``capacity`` bytes, each with its planned total."""
    tried = []
    candidates: list[tuple[dict[str, int | bool], str]] = []  # (settings, the flags that set them)
    if not cfg.run.activation_checkpointing:
        candidates.append(({"activation_checkpointing": True}, "--activation-checkpointing"))
    accum = cfg.data.grad_accum
    while cfg.data.batch_size % (world * accum * 2) == 0 and accum < cfg.data.batch_size // world:
        accum *= 2
        candidates.append(
            ({"grad_accum": accum}, f"--grad-accum {accum} (micro-batch {cfg.data.batch_size // world // accum})")
        )
        if not cfg.run.activation_checkpointing:
            candidates.append(
                (
                    {"grad_accum": accum, "activation_checkpointing": True},
                    f"--grad-accum {accum} --activation-checkpointing",
                )
            )
    for change, text in candidates:
        total = plan_memory(cfg.with_(change), world).total
        if total <= capacity:
            tried.append(f"{text}: {total / GIB:.1f} GiB")
        if len(tried) >= 3:
            break
    return tried


def plan_workers(plans: list[int], device_bytes: list[int], requested: int | None, cores: int) -> int:
    """Parallel runs for a sweep on GPUs: as many as fit by memory on each device (the largest run's plan
    decides, with 10% kept free), at least one per device, never more than asked or than there are runs."""
    if not device_bytes:
        return max(1, min(requested or cores, len(plans)))
    largest = max(plans) if plans else 1
    per_device = max(1, int(0.9 * min(device_bytes) // largest))
    fit = per_device * len(device_bytes)
    return max(1, min(requested or fit, fit, len(plans)))


def plan_text(cfg: TrainConfig, world: int = 1, gpu_memory: float | None = None) -> str:
    """`normlab plan`: the run's memory per device as a table, and whether it fits `gpu_memory` GiB
    (else the settings that would)."""
    if world < 1 or (gpu_memory is not None and gpu_memory <= 0):
        raise ConfigError("--world is a positive number of ranks and --gpu-memory a positive number of GiB")
    plan = plan_memory(cfg, world)
    cuda = cfg.for_device("cuda")
    lines = [
        f"{cfg.model.layout_label} at {cfg.model.size}{' ' + str(cfg.model.options) if cfg.model.options else ''}: "
        f"{plan.params / 1e6:.1f}M parameters; micro-batch {plan.micro_batch} x {plan.seq_len} on each of "
        f"{world} rank(s), {cuda.precision}, activations stored in {cuda.stored_dtype}"
        + (", activation checkpointing" if cfg.run.activation_checkpointing else ""),
        plan.table(),
    ]
    if gpu_memory is not None:
        capacity = int(gpu_memory * GIB)
        if plan.total <= capacity:
            lines.append(f"fits {gpu_memory:g} GiB ({int(0.9 * capacity // plan.total)} such runs side by side)")
        else:
            options = fitting_options(cfg, capacity, world)
            lines.append(
                f"does not fit {gpu_memory:g} GiB; "
                + (
                    "these fit: " + "; ".join(options)
                    if options
                    else "nothing tried fits: FSDP over more devices, or a smaller model"
                )
            )
    return "\n".join(lines)
