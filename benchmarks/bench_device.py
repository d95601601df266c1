"""What every benchmark shares: --device and --precision, a clock that waits for the GPU, the header.

--device cpu | cuda      where the models run (cuda: the first GPU)
--precision fp32 | bf16 | fp16
                         fp32: float32 (TF32 matmuls on CUDA, as `normlab train` uses by default);
                         bf16/fp16: autocast with float32 weights, as `normlab train` trains
                         (timing only: no loss scaler in the benchmark loops)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import time
from dataclasses import dataclass

import torch

from normlab.train.mfu import device_name, hbm_bandwidth, peak_flops


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")


@dataclass
class Bench:
    device: torch.device
    precision: str

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        """perf_counter after the device has finished what was queued (CUDA runs asynchronously)."""
        self.sync()
        return time.perf_counter()

    def timed_step(self, opt: torch.optim.Optimizer, loss_fn) -> float:
        """Seconds of one training step: zero the gradients, ``loss_fn()`` under autocast, backward, step."""
        t0 = self.clock()
        opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = loss_fn()
        loss.backward()
        opt.step()
        return self.clock() - t0

    def adamw(self, params) -> torch.optim.Optimizer:
        """AdamW as `normlab train` makes it: fused on CUDA."""
        return torch.optim.AdamW(params, lr=1e-3, fused=self.cuda or None)

    @property
    def peak_flops(self) -> float | None:
        return peak_flops(self.device, self.precision)

    @property
    def hbm(self) -> float | None:
        return hbm_bandwidth(self.device)

    def header(self, name: str) -> str:
        where = device_name(self.device) + (f", CUDA {torch.version.cuda}" if self.cuda else "")
        return f"# {name}, {datetime.date.today()}, {where}, torch {torch.__version__}, {self.precision}"


def setup(args: argparse.Namespace) -> Bench:
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda, but CUDA is not available here (torch {torch.__version__})")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        return Bench(torch.device("cuda", 0), args.precision)
    return Bench(torch.device("cpu"), args.precision)
