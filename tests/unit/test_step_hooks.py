"""The step-hook protocol (normlab.diagnostics.hooks): the order its events reach the hooks, the veto, state
kept under each hook's checkpoint key, and TrainingMonitor driving hooks from someone else's loop."""

import json

import pytest
import torch

from normlab.diagnostics.hooks import StepHook, StepHooks, Stop, Update
from normlab.diagnostics.training_monitor import TrainingMonitor
from normlab.errors import ConfigError


class Recorder(StepHook):
    """Appends (name, event, args) to a shared log on every event."""

    def __init__(self, name, log, priority=0, state_key=None, record=None):
        self.name, self.log, self.record = name, log, record
        self.priority, self.state_key = priority, state_key  # per instance: the class defaults are 0 / None
        self.loaded = None

    def pre_step(self, step):
        self.log.append((self.name, "pre_step", step))

    def post_backward(self, step):
        self.log.append((self.name, "post_backward", step))

    def veto(self, step, loss, grad_norm):
        self.log.append((self.name, "veto", step))
        return self.record

    def post_step(self, step, applied):
        self.log.append((self.name, "post_step", step, applied))

    def post_train(self, step):
        self.log.append((self.name, "post_train", step))

    def summary(self):
        return {f"{self.name}_seen": len([e for e in self.log if e[0] == self.name])}

    def state_dict(self):
        return {"name": self.name}

    def load_state_dict(self, state):
        self.loaded = state

    def close(self):
        self.log.append((self.name, "close"))


def test_events_run_by_priority_before_the_update_and_in_reverse_after_it():
    log = []
    hooks = StepHooks()
    for name, priority in [("spikes", 0), ("qk", 10), ("probes", 30), ("tier", 20), ("later0", 0)]:
        hooks.add(Recorder(name, log, priority))
    hooks.pre_step(4)
    hooks.post_backward(4)
    hooks.post_step(4, True)
    order = ["probes", "tier", "qk", "spikes", "later0"]  # equal priorities keep their order of addition
    assert log == (
        [(n, "pre_step", 4) for n in order]
        + [(n, "post_backward", 4) for n in order]
        + [(n, "post_step", 4, True) for n in reversed(order)]
    )


def test_the_first_record_vetoes_and_later_hooks_are_not_asked():
    log = []
    skip = {"action": "skipped", "kinds": ["loss"]}
    hooks = StepHooks(
        [Recorder("a", log, 2), Recorder("b", log, 1, record=skip), Recorder("c", log, 0, record={"x": 1})]
    )
    assert hooks.veto(7, 2.5, 1.0) is skip
    assert log == [("a", "veto", 7), ("b", "veto", 7)]
    assert StepHooks([Recorder("a", [], 0)]).veto(7, 2.5, 1.0) is None


class Decider(StepHook):
    """Admits or not, asks for a stop or a checkpoint, adds a key to the row; logs each question it is asked."""

    def __init__(self, name, log, admit=True, stop=None, save=False, keys=None):
        self.name, self.log, self.ok, self.stop, self.save, self.keys = name, log, admit, stop, save, keys or {}

    def admit(self, step, loss, grad_norm, scaled):
        self.log.append((self.name, "admit", step, scaled))
        return self.ok

    def veto(self, step, loss, grad_norm):
        self.log.append((self.name, "veto", step))
        return None

    def row_metrics(self, step, applied, row):
        return {k: (v, applied, row["loss"]) for k, v in self.keys.items()}

    def stop_request(self):
        self.log.append((self.name, "stop_request"))
        return self.stop

    def checkpoint_due(self, step, finishing):
        self.log.append((self.name, "checkpoint_due", step, finishing))
        return self.save


def test_before_update_asks_every_hook_to_admit_and_vetoes_only_an_admitted_step():
    """One refusal keeps the update from being applied, yet every hook is asked (each keeps its own count: the
    divergence hook's skipped and overflow steps); the veto is asked only of an admitted step."""
    log = []
    hooks = StepHooks([Decider("a", log, admit=False), Decider("b", log)])
    update = hooks.before_update(3, float("nan"), 1.0, True)
    assert update == Update(admitted=False, record=None) and not update.applied and not update.vetoed
    assert log == [("a", "admit", 3, True), ("b", "admit", 3, True)]
    log.clear()
    skip = {"action": "skipped", "kinds": ["loss"]}
    update = StepHooks([Decider("a", log), Recorder("spikes", log, record=skip)]).before_update(4, 2.0, 1.0, False)
    assert update.admitted and update.vetoed and not update.applied and update.record is skip
    assert log == [("a", "admit", 4, False), ("a", "veto", 4), ("spikes", "veto", 4)]
    counted = {"action": "applied", "kinds": ["loss"]}  # a spike counted, not skipped: the update is applied
    assert StepHooks([Recorder("spikes", [], record=counted)]).before_update(5, 2.0, 1.0, False).applied


def test_the_hooks_are_asked_to_stop_and_to_save_and_add_to_the_row():
    """stop_request: the first hook's Stop; checkpoint_due: any hook's request, every hook asked; row_metrics: each
    hook's keys merged in the hooks' order (a later hook's key wins)."""
    log = []
    diverged = Stop(step=7, reason="non-finite loss", failed=True)
    hooks = StepHooks(
        [
            Decider("a", log, keys={"x": 1}),
            Decider("b", log, stop=diverged, save=True, keys={"x": 2, "y": 3}),
            Decider("c", log, stop=Stop(8, "later")),
        ]
    )
    assert hooks.stop_request() is diverged
    assert log == [("a", "stop_request"), ("b", "stop_request")]  # the first Stop decides
    log.clear()
    assert hooks.checkpoint_due(8, finishing=False)
    assert log == [
        ("a", "checkpoint_due", 8, False),
        ("b", "checkpoint_due", 8, False),
        ("c", "checkpoint_due", 8, False),
    ]
    assert not StepHooks([Decider("a", [])]).checkpoint_due(8, True) and StepHooks().stop_request() is None
    assert hooks.row_metrics(7, True, {"loss": 2.5}) == {"x": (2, True, 2.5), "y": (3, True, 2.5)}


def test_state_lives_under_each_hooks_key_and_an_older_checkpoint_without_it_still_loads():
    log = []
    clip, plain = Recorder("clip", log, state_key="qk_clip"), Recorder("plain", log)
    hooks = StepHooks([clip, plain])
    assert hooks.state_dict() == {"qk_clip": {"name": "clip"}}  # a hook without a key saves nothing
    hooks.load_state_dict({"model": {}, "step": 3})  # a checkpoint written before the hook existed
    assert clip.loaded is None and plain.loaded is None
    hooks.load_state_dict({"qk_clip": {"interventions": 5}})
    assert clip.loaded == {"interventions": 5} and plain.loaded is None
    hooks.pre_step(0)
    assert hooks.summary() == {"clip_seen": 1, "plain_seen": 1}
    hooks.close()
    assert log[-2:] == [("clip", "close"), ("plain", "close")]


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_training_monitor_drives_step_hooks_from_a_foreign_loop(tmp_path):
    log = []
    model = Stack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=10, hooks=[Recorder("mine", log)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in (0, 1, 2):
        x = torch.randint(0, 16, (2, 5), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        monitor.step(step, loss=loss)
        opt.step()
        opt.zero_grad()
    summary = monitor.close()
    assert log == [
        ("mine", "post_step", 0, True),
        ("mine", "post_step", 1, True),
        ("mine", "post_step", 2, True),
        ("mine", "post_train", 3),
        ("mine", "close"),
    ]
    assert summary["mine_seen"] == 4  # the hook's summary() ran after post_train, before close
    assert json.loads((tmp_path / "m" / "summary.json").read_text())["mine_seen"] == 4
    with pytest.raises(ConfigError, match="hooks must be a list of step hooks"):
        TrainingMonitor(Stack(), tmp_path / "bad", hooks=[object()])
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        TrainingMonitor(Stack(), tmp_path / "bad", nonsense=1)
    assert not (tmp_path / "bad").exists()
