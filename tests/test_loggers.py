"""Optional sinks: TensorBoard event files and an offline W&B run; a clear error when missing."""

import sys

import pytest

from normlab.model.config import ConfigError
from normlab.train import TrainConfig, train


def cfg(corpus, out, **kw):
    return TrainConfig.of(data=str(corpus), size="nano", seq_len=32, batch_size=8, steps=4, eval_every=2,
                       eval_batches=1, out=str(out), progress=False, **kw)


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
