"""`TrainingMonitor` on a torchtitan 0.3.0 Llama in a plain training loop (`make test-frameworks`).

torchtitan keeps its blocks in ``model.layers``, an ``nn.ModuleDict`` keyed "0", "1", ..., calls them
positionally (``layer(h, attention_masks, positions)``), computes the loss outside the model, and clips with
``dist_utils.clip_grad_norm_`` before its optimizer step. The loop below does the same, with the monitor's step
after the clip: the monitor must still record the norm the clip returned, per block the norms of each weight
and of the whole block before the clip, the stream at every depth and each norm's gain.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from normlab.diagnostics.training_monitor import TrainingMonitor

pytest.importorskip("torchtitan", reason="torchtitan is not installed (make test-frameworks installs it)")

from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

DIM, LAYERS, VOCAB, SEQ = 32, 2, 64, 12
CLIP = 0.01  # the gradient norm of this model at init is ~1.8: every step is clipped
STEPS = [1, 2, 3, 4, 5]  # torchtitan counts steps from 1
WEIGHTS = {  # a block's weight matrices, by their path in the block
    "attention.qkv_linear.wq",
    "attention.qkv_linear.wk",
    "attention.qkv_linear.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
}


def llama() -> torch.nn.Module:
    """A tiny torchtitan Llama 3 (GQA, RMSNorm before attention and MLP, RoPE): the config normlab prints for
    "pre" (normlab.recommend.frameworks.snippets), with SDPA as the inner attention (flex has no backward on a CPU)."""
    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=1e-5, param_init={"weight": torch.nn.init.ones_})

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        norm=norm(DIM),
        layers=[
            Llama3TransformerBlock.Config(
                attention_norm=norm(DIM),
                ffn_norm=norm(DIM),
                attention=make_gqa_config(
                    dim=DIM,
                    n_heads=2,
                    n_kv_heads=1,
                    head_dim=16,
                    wqkv_param_init=init,
                    wo_param_init=init,
                    inner_attention=ScaledDotProductAttention.Config(),
                    rope=CosSinRoPE.Config(dim=16, max_seq_len=32, theta=10000.0),
                    qk_norm=None,
                ),
                feed_forward=make_ffn_config(dim=DIM, hidden_dim=48, w1_param_init=init, w2w3_param_init=init),
            )
            for _ in range(LAYERS)
        ],
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Five steps of a torchtitan-style loop with the monitor attached (probes every 2 steps): the folder, the
    norms clip_grad_norm_ returned, each step's loss, and each block's gradient norm before the clip."""
    out = tmp_path_factory.mktemp("tt") / "monitor"
    model = llama()
    assert isinstance(model.layers, torch.nn.ModuleDict) and list(model.layers) == ["0", "1"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TrainingMonitor(model, out, every=2, name="torchtitan-llama3")
    gen = torch.Generator().manual_seed(1)
    returned, losses, blocks = [], [], []
    for step in STEPS:
        x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        logits = model(x[:, :-1])  # logits out; the loss is the loop's (torchtitan's loss_fn)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        blocks.append(
            [
                torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()]).item()
                for layer in model.layers.values()
            ]
        )
        # torchtitan's dist_utils.clip_grad_norm_ without pipeline or expert parallelism: this, the norm before
        returned.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        monitor.step(step, loss=loss)  # after the clip, before the optimizer step
        opt.step()
        opt.zero_grad()
    monitor.close()
    return out, returned, losses, blocks


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_have_the_norm_the_clip_returned(trained):
    out, returned, losses, _ = trained
    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == STEPS
    assert min(returned) > 30 * CLIP  # the clip bites
    assert [r["grad_norm"] for r in metrics] == pytest.approx(returned, rel=1e-4)
    assert [r["loss"] for r in metrics] == pytest.approx(losses, rel=1e-6)
    record = json.loads((out / "config.json").read_text())
    assert record["blocks"] == "layers (2)" and "block_names" not in record
    assert "before any clipping" in record["grad_norm"]["at"]
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"


def test_probes_have_rows_for_every_block(trained):
    out, _, _, blocks = trained
    probes = rows(out / "probes.jsonl")
    # the first step recorded, every 2 steps, and the final weights at close
    assert sorted({r["step"] for r in probes}) == [1, 2, 4, 6]
    grads = [r for r in probes if r["metric"] == "grad_norm"]
    assert {r["step"] for r in grads} == {1, 2, 4}  # no gradients at close
    for step in (1, 2, 4):
        for layer in range(LAYERS):
            mine = {r["site"]: r["value"] for r in grads if r["step"] == step and r["layer"] == layer}
            assert set(mine) == WEIGHTS | {"block"}
            assert mine["block"] == pytest.approx(blocks[STEPS.index(step)][layer], rel=1e-4)  # before the clip
            assert mine["block"] > math.sqrt(sum(v * v for s, v in mine.items() if s != "block"))  # + the norms
    stream = [r for r in probes if r["site"] == "stream" and r["metric"] == "rms" and r["step"] == 2]
    assert sorted(r["layer"] for r in stream) == list(range(LAYERS + 1))  # entering block 0, then each block's output
    assert all(r["value"] > 0 for r in stream)
    gains = {(r["layer"], r["site"]) for r in probes if r["metric"] == "gamma_mean" and r["step"] == 2}
    assert gains == {(i, s) for i in range(LAYERS) for s in ("attention_norm", "ffn_norm")}
