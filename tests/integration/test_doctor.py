"""`normlab doctor`: findings on trained weights, the first fp16 overflow named, an exact fp16-safe copy."""

from __future__ import annotations

import pytest
import torch

import normlab
from normlab.doctor import checkup, rescalable, rescale_for_fp16, sample_tokens
from normlab.doctor.rescale import scale_stream
from tests.helpers import planted_overflow


def by_name(findings):
    return {f.name: f for f in findings}


def test_a_planted_overflow_is_found_and_named():
    """The planted model's MLP residual add reaches 8e4: headroom below 1 fails, and the first fp16 overflow is
    block 0's MLP residual add, with the stream that flowed in."""
    model = planted_overflow("pre")
    f = by_name(checkup(model, sample_tokens(model, None), jacobian_iters=3)[0])
    assert f["fp16 headroom"].verdict == "fail" and f["fp16 headroom"].value < 1
    assert f["first fp16 overflow"].verdict == "fail" and "block 0" in f["first fp16 overflow"].where
    assert "residual add" in f["first fp16 overflow"].where
    clean = normlab.build_model("pre", "nano", seed=0)
    g = by_name(checkup(clean, sample_tokens(clean, None), jacobian_iters=3)[0])
    assert g["fp16 headroom"].verdict == "ok" and g["first fp16 overflow"].verdict == "ok"
    assert {"massive activations", "gradient spread", "attention logits", "block Jacobian"} <= set(g)


@pytest.mark.parametrize("layout", ["pre", "peri", "pre,norm=layer,h-scalar,h=0.5", "gemma3"])
def test_rescaled_copy_keeps_the_logits_and_fits_fp16(layout):
    """Where every reader of the stream is a scale-invariant norm, scaling the stream by c leaves the logits
    unchanged: checked on a model with a planted 3e5 embedding (past fp16), rescaled to 65504/16."""
    model = normlab.build_model(layout, "nano", seed=0, norm_eps=1e-12)
    with torch.no_grad():
        if model.layout.embed_norm:  # Peri-LN's and Gemma's embedding norm sets the stream's scale
            model.embed_norm.weight.fill_(3e5)
        else:
            model.embed.weight.mul_(1.5e7)
    x = sample_tokens(model, None)[:, :-1]
    assert rescalable(model) is None
    r = rescale_for_fp16(model, x, headroom=16)
    assert r.max_before > 65504 and r.max_after == pytest.approx(65504 / 16, rel=1e-3) and r.factor < 1
    assert r.max_logit_change < 1e-3 * model(x).logits.abs().max().item() and r.kl < 1e-8
    f = by_name(checkup(r.model, sample_tokens(r.model, None), jacobian_iters=2)[0])
    assert f["first fp16 overflow"].verdict == "ok" and f["fp16 headroom"].value >= 10


@pytest.mark.parametrize(
    "layout, why",
    [("pre-dyt", "not scale-invariant"), ("post", "no input norm"), ("hybrid", "no input norm"), ("pre,tie", None)],
)
def test_rescaling_is_refused_where_it_would_change_the_function(layout, why):
    model = normlab.build_model(layout.removesuffix(",tie"), "nano", seed=0, tie_embeddings=layout.endswith(",tie"))
    reason = rescalable(model)
    if why is None:
        assert "tied embeddings" in reason
    else:
        assert why in reason
        with pytest.raises(ValueError, match="not free"):
            scale_stream(model, 0.5)


def test_doctor_cli_on_a_run_and_on_a_transformers_folder(corpus, tmp_path, capsys):
    from normlab.cli import main
    from normlab.hf import save_native
    from normlab.train import TrainConfig, train

    train(
        TrainConfig.of(
            data=str(corpus),
            size="nano",
            layout="pre",
            seq_len=32,
            batch_size=8,
            steps=3,
            eval_every=0,
            probe_every=0,
            progress=False,
            out=str(tmp_path / "run"),
        )
    )
    assert main(["doctor", str(tmp_path / "run"), "--fp16-copy", str(tmp_path / "copy")]) == 0
    out = capsys.readouterr().out
    assert "fp16 headroom" in out and "first fp16 overflow" in out and "fp16-safe copy" in out
    copy = normlab.runs.model.load_run_model(tmp_path / "copy").model
    assert copy.layout.to_string() == "attn=A,mlp=A,final"
    save_native(normlab.build_model("qwen3", "nano", seed=0, d_head=16), tmp_path / "q3", "qwen3")
    assert main(["doctor", str(tmp_path / "q3"), "--json"]) == 0
    assert '"name": "block Jacobian"' in capsys.readouterr().out


def test_a_saturated_final_dyt_is_found_as_no_gradient():
    """DyT as the final norm on a stream of 100s: tanh' = 0 for every entry, nothing trains (dyt-lr's stall)."""
    model = normlab.build_model("pre-dyt", "nano", seed=0)
    with torch.no_grad():
        model.embed.weight.fill_(100.0)  # every entry far into tanh's flat part
    f = by_name(checkup(model, sample_tokens(model, None), jacobian_iters=2)[0])
    assert f["gradient reaching the blocks"].verdict == "fail" and "gradient spread" not in f
    fine = by_name(
        checkup(
            normlab.build_model("pre-dyt,norm.final=rms", "nano", seed=0), sample_tokens(model, None), jacobian_iters=2
        )[0]
    )
    assert "gradient reaching the blocks" not in fine and fine["gradient spread"].verdict in ("ok", "warn")
