"""Optional sinks: TensorBoard event files and an offline W&B run; a clear error when missing."""

import sys

import pytest

from normlab.model.config import ConfigError
from normlab.train import TrainConfig, train


def cfg(corpus, out, **kw):
    return TrainConfig.of(
        data=str(corpus),
        size="nano",
        seq_len=32,
        batch_size=8,
        steps=4,
        eval_every=2,
        eval_batches=1,
        out=str(out),
        progress=False,
        **kw,
    )


def test_tensorboard_scalars(corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(cfg(corpus, tmp_path / "tb", tensorboard=True))
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    assert {"loss", "lr", "grad_norm", "val_loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2, 3]


def test_wandb_offline(corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(cfg(corpus, tmp_path / "wb", wandb=True))
    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.parametrize("extra, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_extra_is_explained(corpus, tmp_path, monkeypatch, extra, module):
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=f"needs the {extra} package"):
        train(cfg(corpus, tmp_path / extra, **{extra: True}))


def test_progress_in_a_pipe_is_a_line_a_minute_not_carriage_returns(corpus, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "normlab",
            "train",
            "--data",
            str(corpus),
            "--size",
            "nano",
            "--steps",
            "12",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--probe-every",
            "0",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src)},
    )
    assert res.returncode == 0, res.stderr[-1000:]
    assert "\r" not in res.stderr  # tqdm's per-step redraws would fill a log
    lines = [x for x in res.stderr.splitlines() if x.startswith("r: step ")]
    assert lines == [lines[-1]] and lines[-1].startswith("r: step 12/12") and "loss " in lines[-1]
