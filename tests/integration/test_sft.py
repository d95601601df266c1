"""Supervised fine-tuning: response-only loss masking, and starting from trained weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import normlab
from normlab.data import ByteTokenizer, DataError
from normlab.data.sft import IGNORE, encode_pair, load_sft
from normlab.errors import ConfigError
from normlab.runs.checkpoint import list_checkpoints, load_checkpoint
from normlab.train import TrainConfig, train
from normlab.train.init_from import load_init_weights

PAIRS = [{"prompt": f"Q: what is {i} plus {i}?\nA: ", "response": f"{2 * i}.\n"} for i in range(40)]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_encode_pair_masks_prompt_and_padding():
    x, y = encode_pair(ByteTokenizer(), "ab", "cd", seq_len=6)
    a, b, c, d = (ord(ch) for ch in "abcd")
    eos = ByteTokenizer().eos_id
    assert x.tolist() == [a, b, c, d, eos, eos]
    # targets: the response tokens c, d and the end-of-text after them (so generation learns to stop)
    assert y.tolist() == [IGNORE, c, d, eos, IGNORE, IGNORE]
    x, y = encode_pair(ByteTokenizer(), "abcdef", "gh", seq_len=4)  # the response truncated away
    assert (y == IGNORE).all()


def test_prompt_tokens_contribute_nothing_to_the_loss_or_gradient():
    model = normlab.build_model("peri", "nano", seed=0)
    tok = ByteTokenizer()
    x, y = encode_pair(tok, "Q: two plus two?\nA: ", "four", seq_len=32)
    x, y = torch.from_numpy(x)[None], torch.from_numpy(y)[None]
    logits = model(x).logits.detach().requires_grad_(True)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    loss.backward()
    resp = y[0] != IGNORE
    assert resp.sum() == len("four") + 1  # and the end-of-text token
    assert logits.grad[0, ~resp].abs().max() == 0  # prompt and padding positions: no gradient at all
    assert logits.grad[0, resp].abs().min() > 0
    by_hand = -torch.log_softmax(logits[0, resp], -1).gather(1, y[0, resp][:, None]).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert model(x, targets=y).loss.item() == pytest.approx(loss.item(), rel=1e-6)  # the model's own loss agrees
    # changing the prompt's *targets* cannot change the loss: they are ignored
    assert model(x, targets=torch.where(resp, y, torch.full_like(y, IGNORE))).loss.item() == pytest.approx(loss.item())


def test_sft_data_errors_name_the_line(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"question": "x"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: an SFT record needs string fields 'prompt' and 'response'"):
        load_sft(bad, ByteTokenizer(), 16, 0.1)
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    with pytest.raises(DataError, match="x.jsonl line 2 is not JSON"):
        load_sft(tmp_path / "x.jsonl", ByteTokenizer(), 16, 0.1)


def test_pretrain_then_sft_from_the_checkpoint(corpus, tmp_path):
    common = dict(
        size="nano",
        layout="peri",
        seq_len=48,
        batch_size=8,
        eval_every=0,
        eval_batches=1,
        probe_every=0,
        progress=False,
    )
    train(TrainConfig.of(data=str(corpus), steps=4, out=str(tmp_path / "pre"), **common))
    pretrained = load_checkpoint(list_checkpoints(tmp_path / "pre")[-1])["model"]
    fresh = normlab.build_model("peri", "nano", seed=5)
    load_init_weights(fresh, tmp_path / "pre")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, pretrained[k]), k
    data = write_jsonl(tmp_path / "sft.jsonl", PAIRS)
    s = train(
        TrainConfig.of(
            data=str(data),
            task="sft",
            init_from=str(tmp_path / "pre"),
            steps=6,
            lr=1e-3,
            out=str(tmp_path / "sft"),
            **common,
        )
    )
    assert s["status"] == "ok" and s["final_val_loss"] is not None
    cfg = json.loads((tmp_path / "sft" / "config.json").read_text())
    assert "(SFT)" in cfg["data"] and cfg["config"]["model"]["init_from"] == str(tmp_path / "pre")
    with pytest.raises(ConfigError, match="do not fit the model built from this run"):
        train(
            TrainConfig.of(
                data=str(data),
                task="sft",
                init_from=str(tmp_path / "pre"),
                steps=2,
                out=str(tmp_path / "bad"),
                **{**common, "layout": "pre"},
            )
        )
