"""Model FLOPs utilization: the FLOPs a step needs from the model's shape, over the GPU's peak.

    FLOPs per token = 6 N + 12 L H Q T                         PaLM (Chowdhery et al. 2022), App. B

N is the number of weights in matrix products (every `nn.Linear`, the LM head included, and in a
MoE model the router and the k experts a token uses; the embedding lookup is not a product), L layers, H query heads
of width Q, T the sequence length:
6 N for the forward and backward of the weights, 12 L H Q T for the attention scores and their
weighted sum. It counts causal attention in full, as PaLM, nanoGPT and torchtitan do, so the figures
compare with theirs; recomputation under activation checkpointing is not counted (that would be
hardware FLOPs utilization). MFU = tokens/s per device x FLOPs per token / the device's dense peak.

Muon adds its Newton-Schulz iterations, per step, not per token (`optimizer_flops`): on a matrix of
m x n (m <= n: torch runs it on the wide orientation), each iteration is X X^T (2 m^2 n FLOPs), b A + c A A
(2 m^3) and a X + B X (2 m^2 n), so k steps cost k (4 m^2 n + 2 m^3) (Jordan et al. 2024's quintic
iteration, as torch.optim.Muon's `_zeropower_via_newtonschulz` computes it with two addmm); the step's total
over its tokens joins the FLOPs per token of a Muon run. AdamW's and SGD's elementwise updates are not counted
(O(N) per step against 6 N per token).

The peaks are NVIDIA's datasheet figures for dense (not 2:4 sparse) tensor-core math; a device
not in the table, or the CPU, has no peak and its MFU is "unknown".
"""

from __future__ import annotations

import os
import platform

import torch
from torch import nn

from normlab.config.optimizers import OPTIMIZERS
from normlab.model.lm import NormLM
from normlab.train.optim import muon_matrices

# TFLOP/s, dense: (bf16, fp16, tf32, fp32 without tensor cores)
PEAK_TFLOPS: dict[str, tuple[float, float, float, float]] = {
    "H100 SXM": (989.4, 989.4, 494.7, 66.9),
    "H100 PCIe": (756.5, 756.5, 378.0, 51.2),
    "H200": (989.4, 989.4, 494.7, 66.9),
    "H100 NVL": (835.5, 835.5, 417.5, 60.0),  # the PCIe dual-card parts: lower clocks and power than SXM
    "H200 NVL": (835.5, 835.5, 417.5, 60.0),
    "A100": (312.0, 312.0, 156.0, 19.5),  # SXM and PCIe, 40 and 80 GB (HBM below: the 80 GB parts)
}

# HBM bandwidth, TB/s (datasheet), for the memory-bound kernels' benchmarks (norms)
HBM_TBPS: dict[str, float] = {
    "H100 SXM": 3.35,
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "H200": 4.8,
    "H200 NVL": 4.8,
    "A100": 2.0,
}


def flops_per_token(model: NormLM, seq_len: int) -> int:
    """6 N + 12 L H Q T for a `NormLM` (see the module docstring)."""
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)}
    cfg = model.config
    experts = cfg.n_layers * cfg.moe_top_k * cfg.expert_weights if cfg.n_experts else 0
    return 6 * (sum(weights.values()) + experts) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """k (4 m^2 n + 2 m^3) for an m x n matrix with m <= n (see the module docstring)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def optimizer_flops(model: nn.Module, optimizer: str, ns_steps: int) -> int:
    """The FLOPs an optimizer step adds beyond the elementwise update: Muon's Newton-Schulz on each matrix it
    takes (each expert's matrix on its own); 0 for AdamW and SGD."""
    if OPTIMIZERS[optimizer].step_flops != "newton_schulz":
        return 0
    shapes = [(p.shape[-2], p.shape[-1]) for p in muon_matrices(model) for _ in range(p.shape[0] if p.ndim > 2 else 1)]
    return sum(newton_schulz_flops(s, ns_steps) for s in shapes)


def device_model(name: str) -> str | None:
    """The `PEAK_TFLOPS` key for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "H100 SXM"), or None."""
    if "H200" in name:
        return "H200 NVL" if "NVL" in name else "H200"
    if "H100" in name:
        if "NVL" in name:
            return "H100 NVL"
        if "PCIe" in name or "PCIE" in name:
            return "H100 PCIe"
        return "H100 SXM"
    if "A100" in name:
        return "A100"
    return None


def device_name(device: torch.device) -> str:
    """What a figure ran on, in words: the GPU's name (``NVIDIA H200``) or the CPU's architecture, the machine's
    cores and the threads this process's torch uses (``x86_64, 2 cores, 1 thread``: a sweep worker's share), for
    summary.json and the transfer record ("each lease's figures with the device named")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"{platform.machine() or 'cpu'}, {os.cpu_count()} cores, {threads} thread{'s' if threads != 1 else ''}"


def hbm_bandwidth(device: torch.device) -> float | None:
    """The device's memory bandwidth in bytes/s; None where unknown."""
    key = device_model(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return HBM_TBPS[key] * 1e12 if key else None


def peak_flops(device: torch.device, precision: str, tf32: bool = True) -> float | None:
    """The device's dense peak in FLOP/s for the run's precision; None where unknown (CPU, other GPUs)."""
    if device.type != "cuda":
        return None
    key = device_model(torch.cuda.get_device_name(device))
    if key is None:
        return None
    bf16, fp16, tf32_peak, fp32 = PEAK_TFLOPS[key]
    tflops = {"bf16": bf16, "fp16": fp16}.get(precision, tf32_peak if tf32 else fp32)
    return tflops * 1e12
