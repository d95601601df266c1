"""The SLURM coordinator's reading and its submission's store writes, without a scheduler: a job's state as
`slurm_poll.Watcher` reads it from sacct's answer and squeue's, and the announcements
(`normlab.experiments.submission`) recorded and dropped in the store, each in one transaction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from normlab.experiments import slurm_poll, submission
from normlab.experiments.slurm_poll import UNKNOWN_GRACE_S, Watcher
from normlab.runs.store import SweepStore


class Sacct:
    """submitit's watcher as `Watcher.states` uses it: one update, then each job's state from its answer."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states, self.updates = states, 0

    def update(self) -> None:
        self.updates += 1

    def get_state(self, job_id: str, mode: str) -> str:
        assert mode == "cache"  # read from the one update's answer, no sacct call per job
        return self.states[job_id]


def _states(monkeypatch, tmp_path, sacct: dict[str, str], listed: set[str], age: dict[str, float]):
    """A Watcher's reading of jobs 1.. (run r1 holds job 1, ...) whose sacct words are `sacct`, squeue listing the
    ids in `listed`, each first watched `age` seconds ago; returns (states, alive)."""
    monkeypatch.setattr(slurm_poll.time, "time", lambda: 1000.0)
    watcher = Sacct(sacct)
    watch = Watcher(tmp_path, "slurm")
    watch.seen = {jid: 1000.0 - age.get(jid, 0.0) for jid in sacct}
    jobs = {f"r{jid}": SimpleNamespace(job_id=jid, watcher=watcher) for jid in sacct}
    words = watch.sacct(jobs)
    assert watcher.updates == 1
    assert words == {f"r{jid}": word for jid, word in sacct.items()}
    return watch.states(jobs, words, {jid: ("RUNNING", "None", "") for jid in listed})


@pytest.mark.parametrize(
    ("word", "listed", "age", "state", "alive"),
    [
        ("RUNNING", False, 0.0, "RUNNING", True),
        ("PENDING", False, 0.0, "PENDING", True),
        ("UNKNOWN", True, UNKNOWN_GRACE_S * 10, "PENDING", True),  # squeue holds it, sacct has no record yet
        ("UNKNOWN", False, UNKNOWN_GRACE_S / 2, "PENDING", True),  # just submitted: neither knows it yet
        ("UNKNOWN", False, UNKNOWN_GRACE_S * 2, "UNKNOWN", False),  # unknown past the grace: ended
        ("COMPLETED", True, 0.0, "COMPLETING (ended COMPLETED)", True),  # processes not gone yet (KillWait)
        ("COMPLETED", False, 0.0, "COMPLETED", False),
        ("CANCELLED by 0", True, 0.0, "COMPLETING (ended CANCELLED by 0)", True),
        ("TIMEOUT", False, 0.0, "TIMEOUT", False),
    ],
)
def test_a_jobs_state_reads_sacct_then_squeue_for_a_job_sacct_does_not_call_live(
    monkeypatch, tmp_path, word, listed, age, state, alive
):
    states, lives = _states(monkeypatch, tmp_path, {"7": word}, {"7"} if listed else set(), {"7": age})
    assert states == {"r7": state}
    assert lives == {"r7": alive}


def test_squeue_decides_only_for_the_jobs_sacct_does_not_call_live(monkeypatch, tmp_path):
    sacct = {"1": "RUNNING", "2": "COMPLETED", "3": "UNKNOWN", "4": "FAILED", "5": "PENDING", "6": "TIMEOUT"}
    states, alive = _states(monkeypatch, tmp_path, sacct, {"1", "2", "4"}, {"6": UNKNOWN_GRACE_S * 2})
    assert states == {
        "r1": "RUNNING",
        "r2": "COMPLETING (ended COMPLETED)",
        "r3": "PENDING",  # no record yet, first watched just now
        "r4": "COMPLETING (ended FAILED)",
        "r5": "PENDING",  # sacct's word stands, listed or not
        "r6": "TIMEOUT",
    }
    assert alive == {"r1": True, "r2": True, "r3": True, "r4": True, "r5": True, "r6": False}
    assert alive == {rid: slurm_poll.live(s) for rid, s in states.items()}  # the state's own liveness
    watch = Watcher(tmp_path, "slurm")
    words = {"r2": "COMPLETED"}
    assert watch.states({"r2": SimpleNamespace(job_id="2")}, words, None) == ({"r2": "COMPLETED"}, {"r2": False})


def test_no_job_asks_nothing(tmp_path):
    assert Watcher(tmp_path, "slurm").sacct({}) == {}
    assert Watcher(tmp_path, "slurm").states({}, {}, None) == ({}, {})


def test_announcements_are_added_and_dropped_keeping_the_others(tmp_path):
    store = SweepStore(tmp_path / "sweep.db")
    store.drop_meta_entries(submission.KEY, ["none"])  # nothing announced: the key holds an empty mapping
    assert store.get_meta(submission.KEY) == {}
    store.add_meta_entry(submission.KEY, "a", ["r0", "r1"])
    store.add_meta_entry(submission.KEY, "b", ["r2"])
    store.add_meta_entry(submission.KEY, "a", ["r3"])  # the same token again: its runs replaced
    assert store.get_meta(submission.KEY) == {"a": ["r3"], "b": ["r2"]}
    store.drop_meta_entries(submission.KEY, ["a", "c"])
    assert store.get_meta(submission.KEY) == {"b": ["r2"]}


def test_release_held_names_the_announcements_released_and_keeps_the_others(monkeypatch):
    monkeypatch.setattr(submission, "release", lambda ids: ids != ["12"])  # scontrol leaves job 12 held
    released, left = submission.release_held({"a": ["11"], "b": ["12"], "c": ["13"]})
    assert released == ["a", "c"]
    assert left == {"b": ["12"]}


@pytest.fixture
def coordinator(tmp_path):
    """A SLURM coordinator over a three-run sweep's store, built without an executor (only its writing and its
    Ctrl-C handling are exercised): what it says goes to `said`."""
    from normlab.experiments import SweepConfig
    from normlab.experiments.cluster import Coordinator, Runs
    from normlab.experiments.runner import prepare

    sweep = SweepConfig(name="t", base={"size": "nano", "steps": 2}, grid={"seed": [0, 1, 2]}, executor="slurm")
    store, specs = prepare(sweep, tmp_path / "sw")
    coord = Coordinator.__new__(Coordinator)
    coord.said = []
    coord.root, coord.store, coord.kind, coord.log = tmp_path / "sw", store, "slurm", coord.said.append
    coord.todo = [s.run_id for s in specs]
    coord.runs, coord.jobs, coord.fatal, coord.unsure = Runs(coord.todo), {}, None, False
    coord.writes, coord.lines, coord.to_release = [], [], {}
    return coord


def test_an_interrupted_write_is_applied_again_and_its_lines_said(coordinator, monkeypatch):
    """Ctrl-C inside the pass's write (after its first write, before the new ids): nothing it held is lost; the
    handler's write applies every write (again: the first changes nothing the second time) and says every line."""
    store, (a, b, _) = coordinator.store, coordinator.todo
    coordinator.writes = [("pending_again", (a, "saved at step 3")), ("set_job", ([b], ["12"]))]
    coordinator.lines = [("submitted 1 run(s) as job(s) 12", None)]
    real, calls = store.set_job, []

    def set_job_interrupted_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(store, "set_job", set_job_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        coordinator._write()
    assert coordinator.said == [] and store.row(b)["job"] is None
    coordinator._write()
    assert coordinator.said == ["submitted 1 run(s) as job(s) 12"]
    assert store.row(b)["job"] == "12"
    assert (store.row(a)["status"], store.row(a)["reason"]) == ("pending", "saved at step 3")
    assert coordinator.writes == [] and coordinator.lines == []


def test_ctrl_c_releases_the_held_jobs_whose_ids_it_wrote(coordinator, monkeypatch):
    """Ctrl-C after an array was sent held, before its release: the handler writes its ids, then releases it, so
    the jobs it says it leaves running do run (not held until a rerun)."""
    store, (a, _, _) = coordinator.store, coordinator.todo
    coordinator.writes = [("set_job", ([a], ["11_0"]))]
    coordinator.to_release = {"tok": ["11"]}
    order: list[str] = []

    def poll(*args):
        raise KeyboardInterrupt

    coordinator.watch = SimpleNamespace(poll=poll)
    monkeypatch.setattr(
        submission, "release", lambda ids: order.append(f"release {ids} with job {store.row(a)['job']}")
    )
    with pytest.raises(KeyboardInterrupt):
        coordinator.run()
    assert order == ["release ['11'] with job 11_0"]


def test_a_failure_mid_pass_keeps_what_the_pass_had_decided(coordinator):
    """An error other than Ctrl-C in a pass (here the next poll's): the pass's writes are applied and its lines
    said before the error goes on up, unchanged."""
    store, (a, _, _) = coordinator.store, coordinator.todo
    coordinator.writes = [("pending_again", (a, "job 11_0 ended TIMEOUT; submitted again"))]
    coordinator.lines = [("a: job 11_0 ended TIMEOUT; submitted again (1/3)", None)]

    def poll(*args):
        raise RuntimeError("database is locked")

    coordinator.watch = SimpleNamespace(poll=poll)
    with pytest.raises(RuntimeError, match="database is locked"):
        coordinator.run()
    assert store.row(a)["reason"] == "job 11_0 ended TIMEOUT; submitted again"
    assert coordinator.said == ["a: job 11_0 ended TIMEOUT; submitted again (1/3)"]
