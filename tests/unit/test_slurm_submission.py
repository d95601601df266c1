"""The SLURM coordinator's reading and its submission's store writes, without a scheduler: a job's state as
`slurm_poll.Watcher.states` reads it from sacct's answer and squeue's, and the announcements
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
    """Watcher.states over jobs 1.. (run r1 holds job 1, ...) whose sacct words are `sacct`, squeue listing the ids
    in `listed`, each first watched `age` seconds ago; returns (states, alive, the ids squeue was asked about)."""
    asked: list[str] = []

    def job_alive(jid: str) -> bool:
        asked.append(jid)
        return jid in listed

    monkeypatch.setattr(slurm_poll, "job_alive", job_alive)
    monkeypatch.setattr(slurm_poll.time, "time", lambda: 1000.0)
    watcher = Sacct(sacct)
    watch = Watcher(tmp_path, "slurm")
    watch.seen = {jid: 1000.0 - age.get(jid, 0.0) for jid in sacct}
    jobs = {f"r{jid}": SimpleNamespace(job_id=jid, watcher=watcher) for jid in sacct}
    states, alive = watch.states(jobs)
    assert watcher.updates == 1
    return states, alive, asked


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
    states, lives, asked = _states(monkeypatch, tmp_path, {"7": word}, {"7"} if listed else set(), {"7": age})
    assert states == {"r7": state}
    assert lives == {"r7": alive}
    assert asked == ([] if word in ("RUNNING", "PENDING") else ["7"])  # squeue only for a word that is not live


def test_squeue_is_asked_once_per_job_not_live_in_the_jobs_order(monkeypatch, tmp_path):
    sacct = {"1": "RUNNING", "2": "COMPLETED", "3": "UNKNOWN", "4": "FAILED", "5": "PENDING"}
    states, alive, asked = _states(monkeypatch, tmp_path, sacct, {"2"}, {})
    assert asked == ["2", "3", "4"]
    assert states == {
        "r1": "RUNNING",
        "r2": "COMPLETING (ended COMPLETED)",
        "r3": "PENDING",
        "r4": "FAILED",
        "r5": "PENDING",
    }
    assert alive == {"r1": True, "r2": True, "r3": True, "r4": False, "r5": True}
    assert alive == {rid: slurm_poll.live(s) for rid, s in states.items()}  # the state's own liveness


def test_no_job_asks_nothing(tmp_path):
    assert Watcher(tmp_path, "slurm").states({}) == ({}, {})


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


def test_release_held_drops_only_the_announcements_released(monkeypatch, tmp_path):
    store = SweepStore(tmp_path / "sweep.db")
    for token, ids in {"a": ["r0"], "b": ["r1"], "c": ["r2"]}.items():
        store.add_meta_entry(submission.KEY, token, ids)
    monkeypatch.setattr(submission, "release", lambda ids: ids != ["12"])  # scontrol leaves job 12 held
    left = submission.release_held(store, {"a": ["11"], "b": ["12"]})
    assert left == {"b": ["12"]}
    assert store.get_meta(submission.KEY) == {"b": ["r1"], "c": ["r2"]}
