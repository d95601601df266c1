"""The training loop's hooks: built by name from their own sections, old flat keys migrated, and a user's hook
taken by the Python API (instances) and by `normlab train --hook module:Class` (settings from [hook.Class])."""

from __future__ import annotations

import json
import textwrap
from dataclasses import fields

import pytest
import torch

from normlab.cli import main
from normlab.config.hooks import HOOK_SECTIONS, MOVED, RUN_ORDER
from normlab.config.train import TrainConfig, migrate
from normlab.diagnostics.hooks import StepHook, Stop
from normlab.runs.checkpoint import list_checkpoints, load_checkpoint
from normlab.train import train
from normlab.train.hook_registry import HOOKS, CheckpointHook, FaultHook, LoggerHook, WarningsHook
from normlab.train.step_hooks import DivergenceHook, ProbeHook, TierHook
from tests.helpers import rows, small

HOOK_VALUES = {
    "on_spike": "skip",
    "spike_window": 64,
    "spike_sigmas": 4.0,
    "max_skipped": 0.2,
    "ckpt_every": 5,
    "keep_last": 3,
    "progress": False,
    "early_warnings": False,
    "fault": "lr_jump",
    "fault_step": 7,
    "fault_scale": 3.0,
}


def _sections(cfg: TrainConfig) -> dict[str, dict]:
    return {
        name: {f.name: getattr(getattr(cfg, name), f.name) for f in fields(cls)} for name, cls in HOOK_SECTIONS.items()
    }


def test_every_registered_hook_has_its_own_section():
    assert set(HOOKS) == set(HOOK_SECTIONS)
    for name, (settings, _) in HOOKS.items():
        assert HOOK_SECTIONS[name] is settings and isinstance(getattr(TrainConfig(), name), settings)
    # the run section lost what the hooks own: 37 fields before (38 with the QK-spectrum probe), 13 now, every one
    # of them still stored
    run = [f.name for f in fields(TrainConfig().run)]
    assert len(run) + len(MOVED) == len(RUN_ORDER) == 38 and not set(run) & set(MOVED)


def test_an_old_config_file_gives_the_same_hook_settings(tmp_path):
    """The flat keys a TOML file held (top level, or in [run]) and the new sections give the same settings; so
    does a stored config of either form (config.json's nested "run" table, the older flat form)."""
    old_flat, old_run, new = tmp_path / "flat.toml", tmp_path / "run.toml", tmp_path / "new.toml"
    text = {k: json.dumps(v) if not isinstance(v, bool) else str(v).lower() for k, v in HOOK_VALUES.items()}
    old_flat.write_text("".join(f"{k} = {v}\n" for k, v in text.items()))
    old_run.write_text("[run]\n" + "".join(f"{k} = {v}\n" for k, v in text.items()))
    new.write_text(
        "".join(
            f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in text.items() if MOVED[k] == section)
            for section in HOOK_SECTIONS
        )
    )
    cfgs = [TrainConfig.from_toml(p) for p in (old_flat, old_run, new)]
    assert _sections(cfgs[0]) == _sections(cfgs[1]) == _sections(cfgs[2])
    assert cfgs[0].divergence.on_spike == "skip" and cfgs[0].checkpointing.ckpt_every == 5
    assert cfgs[0].faults.fault_step == 7 and cfgs[0].loggers.progress is False
    stored = cfgs[0].to_dict()
    assert list(stored["run"]) == list(RUN_ORDER)  # the stored form as before: the hooks' keys in "run"
    assert TrainConfig.from_dict(stored) == cfgs[0]
    flat = {**cfgs[0].to_flat()}
    assert TrainConfig.from_dict(migrate(flat)) == cfgs[0]
    assert TrainConfig.of(**{"run.on_spike": "skip"}) == TrainConfig.of(**{"divergence.on_spike": "skip"})


def test_hooks_are_built_by_name_from_their_sections(corpus, tmp_path):
    """Defaults: the probe pass, the tier, the spike policy, the early warnings, the checkpoint schedule and the
    loggers; a fault's hook only where the faults section asks for logit_growth; none with settings that leave it
    off."""
    seen: dict[str, list[type]] = {}
    kinds = (ProbeHook, TierHook, DivergenceHook, WarningsHook, CheckpointHook, LoggerHook, FaultHook)

    class Kinds(StepHook):
        def bind(self, handle):
            seen["kinds"] = [k for k in kinds if handle.find(k) is not None]

    train(small(corpus, tmp_path / "a", steps=2), log=lambda *a: None, hooks=[Kinds()])
    assert seen["kinds"] == [ProbeHook, TierHook, DivergenceHook, WarningsHook, CheckpointHook, LoggerHook]
    cfg = small(corpus, tmp_path / "b", steps=2, early_warnings=False, fault="logit_growth", fault_scale=1.0)
    train(cfg.with_({"probes.probe_every": 0, "tier.layer_stats": False}), log=lambda *a: None, hooks=[Kinds()])
    assert seen["kinds"] == [DivergenceHook, CheckpointHook, LoggerHook, FaultHook]


class StepRecorder(StepHook):
    """A toy user hook: the steps it saw, applied or not, and the run folder its handle names."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, bool]] = []
        self.folder = None

    def bind(self, handle) -> None:
        self.folder = handle.run.path

    def post_step(self, step: int, applied: bool) -> None:
        self.steps.append((step, applied))


def test_the_python_api_takes_a_users_hook(corpus, tmp_path):
    hook = StepRecorder()
    summary = train(small(corpus, tmp_path / "r", steps=4), log=lambda *a: None, hooks=[hook])
    assert hook.steps == [(0, True), (1, True), (2, True), (3, True)] and summary["status"] == "ok"
    assert hook.folder == tmp_path / "r"


TOY = """
from dataclasses import dataclass
from pathlib import Path

from normlab.diagnostics.hooks import StepHook


class Steps(StepHook):
    @dataclass
    class Settings:
        path: str
        every: int = 1

    def __init__(self, settings):
        self.settings = settings

    def post_step(self, step, applied):
        if step % self.settings.every == 0:
            with Path(self.settings.path).open("a") as f:
                f.write(f"{step}\\n")
"""


def test_normlab_train_takes_a_users_hook_with_its_settings(corpus, tmp_path, monkeypatch, capsys):
    """--hook module:Class imports the user's module; the [hook.Class] table of --config gives its settings."""
    (tmp_path / "toy_hook_module.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = tmp_path / "seen.txt"
    config = tmp_path / "run.toml"
    config.write_text(f'steps = 5\n[hook.Steps]\npath = "{seen}"\nevery = 2\n')
    args = ["train", "--config", str(config), "--data", str(corpus), "--size", "nano", "--seq-len", "32"]
    args += ["--batch-size", "4", "--no-progress", "--out", str(tmp_path / "run"), "--hook", "toy_hook_module:Steps"]
    assert main(args) == 0
    assert seen.read_text().split() == ["0", "2", "4"]
    config.write_text(f'steps = 5\n[hook.Steps]\npath = "{seen}"\nevry = 2\n')
    assert main([*args[:-2], "--out", str(tmp_path / "run2"), "--hook", "toy_hook_module:Steps"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "evry" in err and "valid: path, every" in err
    assert not (tmp_path / "run2").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("no_colon", "--hook takes module:Class"),
        ("no_such_module_here:Hook", "cannot import it"),
        ("json:JSONDecoder", "not a StepHook subclass"),
    ],
)
def test_a_bad_hook_is_refused_in_one_line(spec, said, capsys):
    assert main(["train", "--size", "nano", "--steps", "1", "--hook", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err


class Steering(StepHook):
    """A toy user hook through the loop's decision points: refuses step 1's update, asks for a checkpoint after
    step 2 (off the schedule) and stops the run after step 4 (not as a failure)."""

    def admit(self, step, loss, grad_norm, scaled):
        return step != 1

    def checkpoint_due(self, step, finishing):
        return step == 3  # after 3 steps (0, 1, 2)

    def post_step(self, step, applied):
        self.last = step

    def stop_request(self):
        return Stop(4, "enough", failed=False) if getattr(self, "last", None) == 4 else None


def test_a_users_hook_decides_updates_checkpoints_and_the_stop_through_the_loops_points(corpus, tmp_path):
    """The loop asks its hooks, not a component: a user's hook's refusal skips the update (the weights stay), its
    request saves a checkpoint off the schedule, its Stop ends the run after that step with the last checkpoint (a
    stop that is not a failure: no divergence, nothing located)."""
    cfg = small(corpus, tmp_path / "s", steps=12, ckpt_every=100, eval_every=0, probe_every=0)
    summary = train(cfg, log=lambda *a: None, hooks=[Steering()])
    r = rows(tmp_path / "s")
    assert [x["step"] for x in r] == [0, 1, 2, 3, 4] and [bool(x.get("skipped")) for x in r] == [0, 1, 0, 0, 0]
    assert summary["status"] == "ok" and summary["steps"] == 5 and summary["forensics"] is None
    assert [p.name for p in list_checkpoints(cfg.run.out)] == ["step_00000003.pt", "step_00000005.pt"]
    first, second = (load_checkpoint(p)["model"] for p in list_checkpoints(cfg.run.out))
    assert any(not torch.equal(first[k], second[k]) for k in first)  # steps 3 and 4 were applied


class Counter(StepHook):
    """A user's stateful hook: the applied steps it saw, kept in each checkpoint under "counter"."""

    state_key = "counter"

    def __init__(self):
        self.seen, self.loaded = 0, None

    def post_step(self, step, applied):
        self.seen += int(applied)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.loaded, self.seen = dict(state), state["seen"]


def test_a_users_stateful_hook_is_saved_and_restored_when_the_run_resumes(corpus, tmp_path):
    """The scheduler's signal (train(stop=...)) saves a checkpoint at once and raises Stopped; the same command
    resumes, and a user's hook built anew gets its state back from the checkpoint's entry under its key."""
    import threading

    from normlab.train.trainer import Stopped

    signal = threading.Event()

    class Signal(StepHook):
        def post_step(self, step, applied):
            if step == 2:
                signal.set()

    cfg = small(corpus, tmp_path / "c", steps=6, ckpt_every=100, eval_every=0, probe_every=0)
    first = Counter()
    with pytest.raises(Stopped) as stopped:
        train(cfg, log=lambda *a: None, stop=signal, hooks=[first, Signal()])
    assert stopped.value.step == 3 and [p.name for p in list_checkpoints(cfg.run.out)] == ["step_00000003.pt"]
    assert load_checkpoint(list_checkpoints(cfg.run.out)[0])["counter"] == {"seen": 3}
    again = Counter()
    assert train(cfg, log=lambda *a: None, hooks=[again])["status"] == "ok"
    assert again.loaded == {"seen": 3} and again.seen == 6


class RowReader(StepHook):
    """A user's logger: the finished rows the loop hands its hooks (`row_done`)."""

    def __init__(self):
        self.rows = []

    def row_done(self, row):
        self.rows.append(dict(row))


def test_a_users_hook_gets_each_finished_row_as_the_loggers_write_it(corpus, tmp_path):
    """The loggers are a hook: the loop hands every hook the step's finished row (the validation loss on an
    evaluating step included), and what a user's hook receives is row for row what metrics.jsonl holds."""
    cfg = small(corpus, tmp_path / "r", steps=4, ckpt_every=100, eval_every=2, probe_every=0)
    reader = RowReader()
    train(cfg, log=lambda *a: None, hooks=[reader])
    assert reader.rows == rows(tmp_path / "r")
    assert [("val_loss" in x) for x in reader.rows] == [False, True, False, True]


class Breaker(StepHook):
    """A user's hook that judges the run failed after step 2 (its own divergence rule)."""

    def post_step(self, step, applied):
        self.last = step

    def stop_request(self):
        return Stop(2, "my rule: loss too high", failed=True) if getattr(self, "last", None) == 2 else None


def test_a_users_failed_stop_is_the_runs_divergence_in_its_summary(corpus, tmp_path):
    """A failed Stop from a hook other than the divergence hook ends the run as the monitor's divergence would: no
    last checkpoint, the break located at its step, and the summary says diverged at that step for its reason."""
    cfg = small(corpus, tmp_path / "f", steps=8, ckpt_every=100, eval_every=0, probe_every=0)
    summary = train(cfg, log=lambda *a: None, hooks=[Breaker()])
    assert [x["step"] for x in rows(tmp_path / "f")] == [0, 1, 2]
    assert summary["status"] == "diverged" and summary["diverged_step"] == 2
    assert summary["reason"] == "my rule: loss too high" and summary["forensics"] is not None
    assert list_checkpoints(cfg.run.out) == []
    saved = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert (saved["status"], saved["diverged_step"], saved["reason"]) == ("diverged", 2, "my rule: loss too high")


def test_a_users_stop_that_is_no_failure_is_noted_with_its_reason(corpus, tmp_path, capsys):
    cfg = small(corpus, tmp_path / "n", steps=12, ckpt_every=100, eval_every=0, probe_every=0)
    assert train(cfg, log=lambda *a: None, hooks=[Steering()])["status"] == "ok"
    assert "stopped after step 4 by a hook: enough" in capsys.readouterr().err
