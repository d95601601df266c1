"""Activation memory of one training step: activation checkpointing and the chunked loss, on and off.

    python benchmarks/memory.py [--size small] [--seq 1024] [--batch 8] [--vocab 32768]
        [--device cuda] [--precision bf16]

    # on a GPU, the shape the issue asks to fit (Kim et al.'s 1.5B at sequence 8192):
    python benchmarks/memory.py --device cuda --precision bf16 --size kim-1.5b --seq 8192 --batch 1 --vocab 100277

Measured, not estimated: the bytes autograd keeps for the backward during one forward (every tensor
given to `saved_tensors_hooks`, each storage counted once; recomputed blocks count only their
inputs), and on CUDA the peak allocated memory of a forward + backward. Layout: pre.
"""

from __future__ import annotations

import argparse

import torch
from bench_device import Bench, add_args, setup

import normlab


def measure(b: Bench, model: torch.nn.Module, x: torch.Tensor, chunk: int) -> tuple[int, int]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    if b.cuda:
        torch.cuda.synchronize(b.device)
        torch.cuda.reset_peak_memory_stats(b.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), b.autocast():
        loss = model(x, targets=x, loss_chunk=chunk).loss
    loss.backward()
    peak = torch.cuda.max_memory_allocated(b.device) if b.cuda else 0
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="override the size's depth (0: keep it); the saved "
        "bytes grow linearly with depth, so a shallow run measures a deep model's per-layer share",
    )
    p.add_argument("--chunk", type=int, default=4096, help="tokens per loss chunk when chunked (the trainer's default)")
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    depth = {"n_layers": args.layers} if args.layers else {}
    model = normlab.build_model(
        "pre",
        args.size,
        seed=0,
        vocab_size=args.vocab,
        **depth,
        max_seq_len=max(args.seq, normlab.model.get_size(args.size).max_seq_len),
    ).to(b.device)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(b.device)
    print(b.header("memory"))
    layers = f" with {args.layers} layers" if args.layers else ""
    print(
        f"# size={args.size}{layers} ({normlab.count_params(model)}) "
        f"seq={args.seq} batch={args.batch} vocab={args.vocab}\n"
    )
    print(
        "| activation checkpointing | loss | saved for backward MB | vs neither"
        + (" | peak GB" if b.cuda else "")
        + " |"
    )
    print("|---|---|---|---|" + ("---|" if b.cuda else ""))
    base = None
    for ckpt in (False, True):
        for chunk in (0, args.chunk):
            model.activation_checkpointing = ckpt
            saved, peak = measure(b, model, x, chunk)
            base = base or saved
            what = f"chunks of {chunk}" if chunk else "whole"
            print(
                f"| {'on' if ckpt else 'off'} | {what} | {saved / 2**20:,.0f} | {saved / base:.3f}"
                + (f" | {peak / 1e9:.1f}" if b.cuda else "")
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
