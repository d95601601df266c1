"""Run under torchrun by tests/integration/test_hf.py (2 processes, gloo on CPU), or in one process for the
reference: TrainingMonitor on a tiny Llama sharded with FSDP2's fully_shard in a plain loop ("monitor"), and
NormlabCallback in a transformers Trainer with FSDP through accelerate ("trainer").

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integration/sharded_monitor.py monitor OUT
    python tests/integration/sharded_monitor.py trainer OUT      # one process, FSDP2 (see trainer())
"""

from __future__ import annotations

import os
import sys

import torch
import transformers as tf

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
TOKENS = torch.randint(0, 96, (4, 5, 16), generator=torch.Generator().manual_seed(1))  # 4 steps of 4+1 sequences


def monitor(out: str) -> None:
    from normlab.diagnostics.training_monitor import SpikeRule, TrainingMonitor
    from normlab.hf.callback import site_names

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    names = site_names(model)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mon = TrainingMonitor(
        model,
        out,
        every=2,
        site_names=names,
        spike=SpikeRule(window=4, min_history=2),
        probe_batch={"input_ids": TOKENS[0, 4:]},
    )
    for step in range(4):
        x = TOKENS[step, :4]
        share = x[rank * 4 // world : (rank + 1) * 4 // world]  # each rank its share of the global batch
        model(input_ids=share, labels=share).loss.backward()
        mon.step(step)
        opt.step()
        opt.zero_grad()
    mon.close()
    if world > 1:
        torch.distributed.destroy_process_group()


def trainer(out: str) -> None:
    # accelerate enables FSDP for GPUs only (its MULTI_CPU type is DDP), so on CPU the model is sharded with
    # FSDP2's fully_shard before the Trainer sees it, in one process (a Trainer under torchrun on CPU would wrap
    # it in DDP, and so would one under torchrun): the monitor then reads DTensor parameters and gradients, as
    # under accelerate's FSDP2 on GPUs
    import socket

    from torch.distributed.fsdp import fully_shard

    from normlab.hf.callback import NormlabCallback

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    data = [{"input_ids": t, "labels": t} for t in TOKENS.reshape(-1, 16)]
    args = tf.TrainingArguments(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=100,
        use_cpu=True,
        disable_tqdm=True,
    )
    t = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[NormlabCallback(every=2)])
    t.train()  # the report of a callback's run: test_trainer_callback_writes_a_run_the_report_reads
    torch.distributed.destroy_process_group()


def reference(out: str) -> None:
    """Both in one process (one start of transformers): the 1-process monitor run, then the Trainer's."""
    monitor(os.path.join(out, "one"))
    trainer(os.path.join(out, "hf"))


if __name__ == "__main__":
    {"monitor": monitor, "trainer": trainer, "reference": reference}[sys.argv[1]](sys.argv[2])
