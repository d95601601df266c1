"""Optional sinks: TensorBoard event files and an offline W&B run; a clear error when missing."""

import sys
from pathlib import Path

import pytest

from normlab.errors import ConfigError
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


def test_progress_in_a_pipe_is_lines_not_carriage_returns(corpus, tmp_path):
    """A run whose stderr is a pipe: no tqdm redraws, only `LineProgress` lines, the last one at the end with
    the loss. How many lines a minute brings is the clock's business (next test), not this machine's speed."""
    import re
    import subprocess

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
    assert lines and lines[-1].startswith("r: step 12/12") and "loss " in lines[-1]
    assert all(re.fullmatch(r"r: step \d+/12(, ETA \d+\.\d min)?(; .*)?", x) for x in lines), lines


def test_progress_lines_come_every_minute_of_the_clock_with_the_eta_it_implies():
    """`LineProgress` (a run) and `SweepProgress` (a sweep) on a planted clock: a line once `every` seconds of
    it have passed since the last (and at the end), the ETA = elapsed / steps done x steps left."""
    import sys

    from normlab.experiments.progress import SweepProgress
    from normlab.train.loggers import LineProgress

    now = [1000.0]
    clock = lambda: now[0]
    printed = []

    class Stderr:
        def write(self, text):
            printed.append(text)

        def flush(self):
            pass

    bar = LineProgress(10, 0, "r", every=60.0, clock=clock)
    real, sys.stderr = sys.stderr, Stderr()
    try:
        for _ in range(10):
            now[0] += 25.0  # a step of 25 s: a line at steps 3 (75 s), 6 (150 s) and 9 (225 s), then the end
            bar.set_postfix({"loss": "2.5000"})
            bar.update(1)
        bar.close()
        resumed = LineProgress(10, 4, "q", every=60.0, clock=clock)  # resumed at step 4: ETA from its own steps
        now[0] += 90.0
        resumed.update(2)
    finally:
        sys.stderr = real
    lines = [x.strip() for x in printed if x.strip()]
    assert lines == [
        f"r: step 3/10, ETA {75 / 3 * 7 / 60:.1f} min; loss 2.5000",
        f"r: step 6/10, ETA {150 / 6 * 4 / 60:.1f} min; loss 2.5000",
        f"r: step 9/10, ETA {225 / 9 * 1 / 60:.1f} min; loss 2.5000",
        "r: step 10/10, ETA 0.0 min; loss 2.5000",
        f"q: step 6/10, ETA {90 / 2 * 4 / 60:.1f} min",
    ]

    said = []
    quiet = dict(log=said.append, every=60.0, tty=False, clock=clock)
    sweep = SweepProgress(Path("unused"), {"a-1": 10, "b-2": 10}, "s", **quiet)
    sweep.started("a-1")
    sweep.started("b-2")
    now[0] += 59.0
    sweep.finished("a-1", {"status": "ok"})  # 59 s: no line yet
    assert said == []
    now[0] += 11.0
    sweep.finished("b-2", {"status": "diverged"})  # 70 s, 20 of 20 steps
    assert said == ["progress: 2/2 runs done, 20/20 steps, ETA 0.0 min; ok 1, diverged 1"]
    half = SweepProgress(Path("unused"), {"a-1": 10, "b-2": 30}, "s", **quiet)
    half.started("b-2")
    now[0] += 80.0
    half.finished("a-1", {"status": "ok"})  # 10 of 40 steps in 80 s: 30 left, 240 s
    assert said[-1] == f"progress: 1/2 runs done, 10/40 steps, ETA {240 / 60:.1f} min; ok 1; b 0/30"
