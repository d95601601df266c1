"""The dtype activations are stored in: fp16 as the papers trained it.

Kim et al. 2025 (Sec. 7.2, App. H, Fig. 11) and Megatron-LM's fp16 mode keep every activation, the
residual stream included, in fp16: a hidden state past 65504 (the FP16 maximum) becomes inf, the
next norm turns it into NaN (inf / inf), and the loss is NaN. That is the failure the papers
describe for Pre-LN. Autocast alone does not reproduce it: under ``torch.autocast(float16)`` only
the products run in fp16, and ``stream + update`` promotes to the stream's float32, where 10^6 is
harmless. `Storage` rounds a tensor to the storage dtype at every point where a real fp16 run
would write it to memory:

    y_0 (embedding out) | each norm's output | each sublayer's output f(u) | q, k, v, context |
    the MLP hidden act(x W_gate) * (x W_up) | the scaled update h * N_B(f) | the residual sum |
    the logits

Two modes, picked once when a run starts (`for_run`):

- **exact**: the products already run in the storage dtype (CUDA or CPU autocast in fp16 with fp16
  storage, or bf16 with bf16): tensors *become* that dtype (``x.to(fp16)``), so the residual add
  itself runs in fp16 and overflows exactly as on the papers' hardware. Weights stay float32 master
  copies that autocast casts to fp16 at each use: the same round-to-nearest as Megatron's fp16 weight
  copy of the fp32 master, and the weight gradients come out of fp16 products and accumulate in
  float32, as Megatron's ``main_grad``. Only the memory differs (an fp16 cast per use instead of a
  kept fp16 copy).
- **emulated**: the products compute in float32 or bf16 (fp16 matrix products are about 50x slower
  than fp32 on a CPU) and each stored tensor is rounded to the storage dtype and carried on in its
  own dtype (``x.to(fp16).to(x.dtype)``). Range and rounding of every stored value are exactly
  fp16's (past 65504 is inf; 65519 rounds down, 65520 up); the products see float32 weights rather
  than their fp16 rounding, and attention's scores and softmax and the norms' statistics are not
  rounded in between. The backward of the round trip rounds the activation gradients to fp16 at
  the same points, as real fp16 training does, so loss scaling is needed (the trainer turns it on).

Rounding is idempotent, so storing a tensor twice changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Storage:
    """A callable that stores a tensor in ``dtype`` (None: as produced); see the module docstring."""

    dtype: torch.dtype | None = None
    exact: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or x.dtype == self.dtype or not x.is_floating_point():
            return x
        y = x.to(self.dtype)
        # exact only where autocast runs the next products in this dtype; elsewhere (a probe pass, a
        # caller without autocast) the same values, carried in the input's dtype
        if self.exact and torch.is_autocast_enabled(x.device.type):
            return y
        return y.to(x.dtype)

    @property
    def name(self) -> str:
        return "fp32" if self.dtype is None else {v: k for k, v in DTYPES.items()}[self.dtype]

    @property
    def max(self) -> float:
        """The largest finite value the storage dtype holds (65504 for fp16)."""
        return torch.finfo(self.dtype or torch.float32).max

    def describe(self) -> str:
        if self.dtype is None:
            return "activations as each op produces them (float32 stream)"
        mode = "exact: tensors are " + self.name if self.exact else "emulated: rounded to " + self.name
        return f"activations and residual stream stored in {self.name} ({mode}; |x| > {self.max:g} is inf)"


NO_STORAGE = Storage()


def for_run(precision: str, stored: str) -> Storage:
    """The storage of a run whose products compute in ``precision`` and whose activations are stored
    in ``stored`` (fp32, bf16 or fp16; `TrainConfig.stored_dtype` resolves ``auto``): none for float32,
    exact when autocast runs the products in the storage dtype, emulated otherwise."""
    if stored not in DTYPES:
        raise ValueError(f"unknown activation dtype {stored!r}; valid: {', '.join(DTYPES)}")
    if stored == "fp32":
        return NO_STORAGE
    return Storage(DTYPES[stored], exact=precision == stored)
