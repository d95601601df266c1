"""The SLURM sweep's state machine (`normlab.experiments.slurm_states`): the transition table, the table that reads a
job's end, and the coordinator's refusal rule, without a scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from normlab.experiments.cluster import TRANSITIONS, Runs
from normlab.experiments.slurm_states import ENDED, JobEnd, Phase, decide


def _end(lines=(), **kw):
    base = dict(
        jid="7",
        word="FAILED",
        state="FAILED",
        worker="7",
        by_this_job=True,
        stopped=False,
        saved=None,
        job=SimpleNamespace(paths=SimpleNamespace(stderr="/x/7.err", stdout="/x/7.out")),
        retry=True,
        timeouts=3,
    )
    base.update(kw)
    end = JobEnd(**base)
    end.__dict__["lines"] = tuple(lines)  # the job's logs, as `JobEnd.lines` would read them
    return end


def test_a_run_moves_only_along_the_table():
    runs = Runs(["a", "b"])
    assert runs.waiting == ["a", "b"]
    assert runs.move("a", "submit") is Phase.SUBMITTED and runs.waiting == ["b"]
    assert runs.move("a", "start") is Phase.RUNNING
    assert runs.move("a", "end:requeued") is Phase.REQUEUED and runs.waiting == ["b", "a"]
    assert runs.move("a", "submit") is Phase.SUBMITTED
    assert runs.move("a", "end:ended ok") is Phase.OK and runs.ended() == 1
    with pytest.raises(RuntimeError, match="no move 'submit' from ended ok"):
        runs.move("a", "submit")  # an ended run is never submitted again by this coordinator
    with pytest.raises(RuntimeError, match="no move 'start' from pending"):
        runs.move("b", "start")


def test_every_ended_phase_is_final_and_reached_from_a_job():
    for phase in ENDED:
        assert not [event for (p, event) in TRANSITIONS if p is phase]  # nothing leaves an ended phase
        assert (Phase.RUNNING, f"end:{phase.value}") in TRANSITIONS
    assert {to for to in TRANSITIONS.values()} >= set(ENDED) | {Phase.PENDING, Phase.SUBMITTED, Phase.RUNNING}


@pytest.mark.parametrize(
    ("end", "phase", "reason"),
    [
        (
            _end(word="CANCELLED", state="CANCELLED by 0", stopped=True, saved=120),
            Phase.CANCELLED,
            "job 7 was cancelled by uid 0 and saved the run at step 120; the next run of this sweep submits it "
            "again, continuing from step 120",
        ),
        (
            _end(stopped=True, saved=120, lines=("Job not requeued because: timed-out too many times.",)),
            Phase.TIMEOUT,
            "job 7 timed out 4 times (slurm_max_num_timeout = 3), saved at step 120; run the same command again to "
            "continue from step 120 (or raise timeout_min or slurm_max_num_timeout)",
        ),
        (
            _end(stopped=True, saved=120),
            Phase.REQUEUED,
            "job 7 saved the run at step 120 and ended FAILED without requeueing itself; submitted again",
        ),
        (
            _end(word="NODE_FAIL", retry=False),
            Phase.PREEMPTED,
            "job 7 ended NODE_FAIL; see /x/7.err; submitted again 3 times already: run the same command again",
        ),
        (
            _end(lines=("ValueError: the data ran out",)),
            Phase.FAILED,
            "job 7 ended FAILED: ValueError: the data ran out; see /x/7.err",
        ),
    ],
)
def test_the_first_row_that_applies_reads_the_end(end, phase, reason):
    assert decide(end) == (phase, reason)


def test_a_refusal_halves_the_array_then_waits_longer_then_gives_up(monkeypatch, tmp_path):
    """A refusal that passes (a limit on waiting jobs): the array halves down to one run, then the wait doubles from
    10 s to at most 300 s; the seventh refusal of a single run with no job of the sweep running stops the sweep."""
    from normlab.experiments import cluster

    monkeypatch.setattr(cluster, "_executor", lambda *a: None)
    monkeypatch.setattr(cluster.time, "time", lambda: 0.0)
    lines: list[str] = []
    sweep = cluster.SweepJobs(tmp_path, None, "slurm")  # type: ignore[arg-type]  # no store: nothing is written
    co = cluster.Coordinator(sweep, ["a", "b", "c", "d"], {}, "t", lines.append)
    co.chunk = 4
    co._refused("QOSMaxSubmitJobPerUserLimit")
    co._refused("QOSMaxSubmitJobPerUserLimit")
    assert co.chunk == 1 and not lines
    waits = []
    for _ in range(6):
        co._refused("QOSMaxSubmitJobPerUserLimit")
        waits.append(co.next_try)
    assert waits == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0] and co.fatal is None
    co._refused("QOSMaxSubmitJobPerUserLimit")
    assert co.fatal == (
        "the scheduler refused the jobs 7 times with none of this sweep's running: QOSMaxSubmitJobPerUserLimit"
    )
    co.fatal = None
    co._refused("Invalid partition name specified")
    assert co.fatal == "the scheduler refused the jobs: Invalid partition name specified"
