"""Helpers shared by the test modules: a small training config on the test corpus, a run's metrics rows
and losses, the planted fp16 overflow model, a nano export, a run interrupted mid-way, a synthetic
sweep store. (Fixtures are in conftest.py.)"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import normlab
from normlab.experiments.runner import prepare
from normlab.experiments.sweep import SweepConfig
from normlab.train import TrainConfig, train

REPO = Path(__file__).resolve().parents[1]

# How long a test waits for a child process or an awaited event before it calls it a hang: generous enough for a
# machine ten times slower than the 2-core VM (CI runs under a load average of 15). A bound, never a measurement:
# no test asserts how fast something happened, and a passing test never waits this long.
# A tiny Llama for the transformers-side tests (its config's keyword arguments)
TINY_LLAMA = dict(
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
PATIENCE_S = 900.0


def wait_until(what: str, condition: Callable[[], object], timeout: float = PATIENCE_S, every: float = 0.05) -> None:
    """Poll ``condition`` until it is true (it may itself fail the test, e.g. when the process it waits on has
    ended); after ``timeout`` seconds fail, naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting for {what} after {timeout:g} s (the bound for a machine 10x slower): a hang?")
        time.sleep(every)


def small(corpus, out, **kw) -> TrainConfig:
    base = dict(
        data=str(corpus),
        size="nano",
        layout="peri",
        seq_len=32,
        batch_size=8,
        steps=12,
        lr=3e-3,
        eval_every=6,
        eval_batches=2,
        out=str(out),
        progress=False,
        device="cpu",
    )
    return TrainConfig.of(**{**base, **kw})


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def losses(run) -> list[float]:
    return [r["loss"] for r in rows(run)]


def planted_overflow(layout: str = "pre") -> torch.nn.Module:
    """A nano model whose stream is 4e4 after the embedding and whose MLP adds 4e4: the MLP's residual
    add is 8e4, past fp16's maximum, while every earlier tensor is representable."""
    torch.manual_seed(0)
    model = normlab.build_model(layout, size="nano", linear_bias=True)
    with torch.no_grad():
        model.embed.weight.fill_(4e4)
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.attn.o_proj.bias.zero_()
            block.mlp.down_proj.weight.zero_()
            block.mlp.down_proj.bias.fill_(4e4)
    return model


def export_nano(tmp_path: Path) -> Path:
    import normlab
    from normlab.hf import save_hf

    return save_hf(normlab.build_model("peri", "nano", seed=0), tmp_path / "export")


def interrupt_at(monkeypatch, step):
    from normlab.data import TokenData

    real = TokenData.train_window

    def failing(self, s, *a, **k):
        if s == step:
            raise KeyboardInterrupt("simulated kill")
        return real(self, s, *a, **k)

    monkeypatch.setattr(TokenData, "train_window", failing)
    return lambda: monkeypatch.setattr(TokenData, "train_window", real)


def interrupted(corpus, tmp_path, monkeypatch, probe_every: int):
    """A 12-step run trained whole, and the same run interrupted at step 10 (checkpoints at 3, 6, 9)."""
    full = small(corpus, tmp_path / "full", steps=12, probe_every=probe_every)
    train(full)
    cut = small(corpus, tmp_path / "cut", steps=12, ckpt_every=3, keep_last=3, probe_every=probe_every)
    restore = interrupt_at(monkeypatch, 10)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    restore()
    return full, cut


def synthetic_store(tmp_path: Path) -> Path:
    """pre/peri x lr {1e-3, 1e-2} x seeds {0, 1, 2}, with chosen outcomes."""
    sweep = SweepConfig(
        name="syn", base={"size": "nano"}, grid={"layout": ["pre", "peri"], "lr": [1e-3, 1e-2], "seed": [0, 1, 2]}
    )
    store, specs = prepare(sweep, tmp_path / "syn")
    outcome = {  # (layout, lr) -> per seed (status, final, val)
        ("pre", 1e-3): [("ok", 3.0, 3.1), ("ok", 3.2, 3.3), ("ok", 3.4, 3.5)],
        # a diverged run records the last finite loss it logged, as the trainer does (here below its initial loss)
        ("pre", 1e-2): [("diverged", 3.4, None), ("ok", 2.9, 3.0), ("failed", None, None)],
        ("peri", 1e-3): [("ok", 3.1, 3.2), ("ok", 3.1, 3.2), ("stalled", 3.3, 3.4)],
        ("peri", 1e-2): [("ok", 2.6, 2.7), ("ok", 2.8, 2.9), ("ok", 2.7, 2.8)],
    }
    for s in specs:
        status, final, val = outcome[(s.axes["layout"], s.axes["lr"])][s.axes["seed"]]
        store.mark_running(s.run_id, "test")
        store.record(
            s.run_id,
            {
                "status": status,
                "final_loss": final,
                "final_val_loss": val,
                "initial_loss": 5.5,
                "reason": None if status == "ok" else status,
                "steps": 10,
            },
        )
    return tmp_path / "syn"


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]):
    """A fixture's files built once per test session, also when pytest-xdist runs the tests in several
    workers (each has its own session-scoped fixtures): the workers share the parent of their base temp
    folders, the first to take the lock runs ``build(folder)`` and the others read what it returned (kept as
    JSON in the folder)."""
    from filelock import FileLock  # transformers' own dependency

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, value = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not value.exists():
            folder.mkdir()
            value.write_text(json.dumps(build(folder)))
    return json.loads(value.read_text())


def a_plan(**fields):
    """A recommend plan (`Plan`) of two candidates at the stress learning rate, `fields` set over it."""
    from normlab.recommend.planning.plan_record import Plan

    base = dict(
        order=["pre", "peri"], screened=["pre", "peri"], screen_width=64, depth=12, steps=150, stress_lr=0.1,
        seed0=0, finalists=0, lrs=[0.1], seeds=[0], extend=False, predicted={"total": 60.0}, budget_s=600.0,
        workers=1,
    )  # fmt: skip
    return Plan(**{**base, **fields})


def a_recommendation(**fields):
    """A recommend `Recommendation` with nothing ranked, checked or sized, `fields` set over it."""
    from normlab.recommend.stages.records import FinalRecord, PlanRecord, Recommendation, StressRecord

    plan = PlanRecord(64, 12, StressRecord(12, False, [], 0.1), FinalRecord([], [0.1], [0]), [], {}, [], [])
    base = dict(
        model="a model", notes=[], precision="bf16", current=None, winner=None, ranking=[], recipe_checks=[],
        settings={}, limits=[], optimizer="adamw", verify={"status": "not asked"}, transfer_record={}, plan=plan,
        rounds=[], movement=[], minutes=1.0, budget_minutes=3.0, call_minutes=[1.0], files={},
    )  # fmt: skip
    return Recommendation(**{**base, **fields})
