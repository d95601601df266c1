"""normlab's pre layout against transformers' LlamaForCausalLM and x-transformers' Decoder on the
identical configuration: training tokens/s (forward + backward + AdamW), eager and torch.compile.

    pip install transformers x-transformers     # benchmark-only extras: pip install -e .[bench]
    python benchmarks/peers.py [--width 256] [--layers 4] [--heads 4] [--seq 256] [--batch 8] [--vocab 256]
                               [--device cuda] [--precision bf16]

    # the GPU comparison of docs/benchmarks.md (Kim et al.'s 400M shape):
    python benchmarks/peers.py --device cuda --precision bf16 --width 1024 --layers 24 --heads 8 \
        --seq 2048 --batch 8 --vocab 32768

The configuration, identical in all three: RMSNorm before each sublayer and at the end (Pre-LN),
RoPE over the full head dimension (theta 10,000), SwiGLU MLP with hidden width 4d, no biases,
untied embedding and head, SDPA attention, the same vocabulary (bytes by default); float32 or
autocast bf16/fp16 with float32 weights; AdamW (fused on CUDA); one loop, the float32 cross-entropy
over the logits each model returns. Parameter counts are printed so the match can be checked. Models
are measured in turns (A B C A B C ...) so drift on a shared machine lands on all of them; each number
is the median step time over the turns. On a GPU with a known peak the table adds MFU
(6N + 12 L H Q T FLOPs per token, `normlab.train.mfu`, the same for all three).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import torch
from bench_device import Bench, add_args, setup
from torch import nn

import normlab
from normlab.train.mfu import flops_per_token


class _Logits(nn.Module):
    """A common interface: tokens -> logits, so one training step serves all three."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "hf":
            return self.model(input_ids=x, use_cache=False).logits
        if self.kind == "x":
            return self.model(x)
        return self.model(x).logits


def build(name: str, d: int, layers: int, heads: int, seq: int, vocab: int = 256) -> nn.Module:
    torch.manual_seed(0)
    if name == "normlab":
        return _Logits(
            normlab.build_model(
                "pre",
                "tiny",
                seed=0,
                d_model=d,
                n_layers=layers,
                n_heads=heads,
                d_ff=4 * d,
                max_seq_len=seq,
                vocab_size=vocab,
            ),
            "normlab",
        )
    if name == "transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=d,
            intermediate_size=4 * d,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=seq,
            rms_norm_eps=1e-6,
            rope_theta=10_000.0,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            attn_implementation="sdpa",
        )
        return _Logits(LlamaForCausalLM(cfg), "hf")
    if name == "x-transformers":
        from x_transformers import Decoder, TransformerWrapper

        dec = Decoder(
            dim=d,
            depth=layers,
            heads=heads,
            attn_dim_head=d // heads,
            rotary_pos_emb=True,
            rotary_emb_dim=d // heads,
            use_rmsnorm=True,
            ff_glu=True,
            ff_swish=True,
            ff_mult=4,
            ff_no_bias=True,
            attn_flash=True,
        )
        return _Logits(
            TransformerWrapper(
                num_tokens=vocab, max_seq_len=seq, attn_layers=dec, use_abs_pos_emb=False, tie_embedding=False
            ),
            "x",
        )
    raise ValueError(name)


def one_step(b: Bench, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    return b.timed_step(opt, lambda: nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--turns", type=int, default=12, help="measured steps per model (interleaved)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--no-compile", action="store_true")
    add_args(p)
    args = p.parse_args()
    b = setup(args)
    names = ["normlab", "transformers", "x-transformers"]
    if importlib.util.find_spec("x_transformers") is None:  # an optional peer (the GPU image lacks it)
        names.remove("x-transformers")
        print("# x-transformers: not installed here, left out")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(b.device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(b.device)
    print(b.header("peers"))
    print(
        f"# d={args.width} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch} "
        f"vocab={args.vocab} AdamW"
    )
    flops = None
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    results: dict[tuple[str, str], float] = {}
    for mode in modes:
        runs = {}
        for name in names:
            model = build(name, args.width, args.layers, args.heads, args.seq, args.vocab).to(b.device)
            n = sum(q.numel() for q in model.parameters())
            if name == "normlab":
                flops = flops_per_token(model.model, args.seq)
            fwd = torch.compile(model) if mode == "compiled" else model
            opt = b.adamw(model.parameters())
            for _ in range(3):  # warm-up (and compilation)
                one_step(b, fwd, opt, x, y)
            runs[name] = (fwd, opt, [])
            if mode == "eager":
                print(f"# {name}: {n:,} parameters")
        for _ in range(args.turns):
            for fwd, opt, times in runs.values():
                times.append(one_step(b, fwd, opt, x, y))
        for name, (_, _, times) in runs.items():
            results[(name, mode)] = args.batch * args.seq / statistics.median(times)
        del runs  # free the GPU memory before the next mode
    peak = b.peak_flops
    mfu = (lambda tok_s: f" | {tok_s * flops / peak:.1%}") if peak else (lambda tok_s: "")
    extra = " | eager MFU | compiled MFU" if peak else ""
    print(
        f"\n| model | eager tok/s | compiled tok/s | compiled / eager | eager vs transformers | "
        f"compiled vs transformers{extra} |"
    )
    print("|---|---|---|---|---|---|" + ("---|---|" if peak else ""))
    base = results[("transformers", "eager")]
    base_c = results.get(("transformers", "compiled"))
    for name in names:
        e = results[(name, "eager")]
        c = results.get((name, "compiled"))
        cells = (
            f"| {name} | {e:,.0f} | {'-' if c is None else f'{c:,.0f}'} | {'-' if c is None else f'{c / e:.2f}x'} | "
            f"{e / base:.2f}x | {'-' if c is None else f'{c / base_c:.2f}x'}"
        )
        if peak:
            cells += mfu(e) + (mfu(c) if c else " | -")
        print(cells + " |")
    if ("normlab", "compiled") in results:
        print(
            "\nnormlab compiled / normlab eager: "
            f"{results[('normlab', 'compiled')] / results[('normlab', 'eager')]:.2f}x (target 1.3x); "
            f"normlab eager / LlamaForCausalLM eager: {results[('normlab', 'eager')] / base:.2f}x (target 1.0x)"
        )


if __name__ == "__main__":
    main()
