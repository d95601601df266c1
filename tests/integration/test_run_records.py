"""summary.json and its forensics as typed records (normlab.runs.summary): read from the files a short training run
writes and written again, they are the same bytes; an older file without the newer keys stays without them."""

from __future__ import annotations

import json

import pytest

from normlab.runs.files import RunDir
from normlab.runs.summary import Forensics, RunSummary
from normlab.train import train
from tests.helpers import small


def _config(corpus, out, **kw):
    """helpers.small's run as a Pre-LN of 4 steps, probed every 2, no evaluation."""
    return small(
        corpus, out, **{"layout": "pre", "steps": 4, "eval_every": 0, "eval_batches": 1, "probe_every": 2, **kw}
    )


def _text(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True)


def _rewritten(run: RunDir, tmp_path) -> bytes:
    """The run's summary read as a record and written back by the run folder's own writer, elsewhere."""
    record = run.read_summary()
    assert record is not None
    again = RunDir(tmp_path / "again")
    again.path.mkdir()
    again.write_summary(record.to_json())
    return again.summary_file.read_bytes()


def test_a_diverged_runs_summary_and_forensics_round_trip_byte_for_byte(corpus, tmp_path):
    """Init std 3000 in fp16 storage: the stream passes 65504 at step 0, so the summary holds a forensics record
    (the setting of tests/integration/test_fp16_storage.py)."""
    big = {"model.init_std": 3000.0, "model.init": "normal", "activation_dtype": "fp16"}
    written = train(_config(corpus, tmp_path / "run", **big))
    run = RunDir(tmp_path / "run")
    record = run.read_summary()
    assert record is not None and record.status == "diverged" and record.diverged_step == 0
    assert _text(record.to_json()) == _text(written)  # as text: NaN (a diverged run's val loss) != NaN
    assert list(record.to_json()) == list(json.loads(run.summary_file.read_text()))  # the keys in the file's order
    assert _rewritten(run, tmp_path) == run.summary_file.read_bytes()
    f = record.forensics
    assert isinstance(f, Forensics) and f.step == 0 and f.overflowed and f.dtype == "fp16"
    assert f.site == record.first_break == written["first_break"] and f.text == written["forensics"]["text"]
    assert _text(f.to_json()) == _text(written["forensics"]) and not f.extra  # every key forensics writes is typed
    assert record.finished(4) is False and record.finished() is True  # diverged at step 0: one row, not 4


def test_a_trained_runs_summary_round_trips_and_keeps_the_keys_it_does_not_name(corpus, tmp_path):
    written = train(_config(corpus, tmp_path / "run"))
    run = RunDir(tmp_path / "run")
    record = run.read_summary()
    assert record is not None and record.trained and record.finished(4) and record.forensics is None
    assert record.final_loss == written["final_loss"] and record.steps == 4 == written["steps"]
    assert _text(record.to_json()) == _text(written) and _rewritten(run, tmp_path) == run.summary_file.read_bytes()
    assert "spike_score" in record.extra or "spikes" in record.extra  # the monitor's keys: kept, not typed


@pytest.mark.parametrize(
    "old",
    [
        {"status": "ok", "steps": 4, "final_loss": 2.5},  # before tokens, devices, forensics were written
        {"status": "diverged", "reason": "non-finite loss", "forensics": {"step": 3, "forward": None}},  # no text
        {"status": "ok", "steps": "4", "final_loss": None, "device_name": 7},  # wrong types: kept as written
    ],
)
def test_an_older_file_reads_and_writes_back_without_the_newer_keys(old):
    record = RunSummary.from_json(old)
    assert record.to_json() == old and list(record.to_json()) == list(old)
    assert record.tokens is None and record.device_name is None  # absent or mistyped: None, never a guess
    if old.get("forensics"):
        assert record.forensics is not None and record.forensics.site is None and record.forensics.gradients is None
        assert record.forensics.to_json() == old["forensics"]  # no gradients, rank or text added
    if old.get("steps") == "4":
        assert record.steps is None and record.extra["steps"] == "4" and not record.finished(4)


def test_a_record_made_in_code_writes_the_fields_it_was_given():
    assert RunSummary(status="ok", steps=3).to_json() == {"status": "ok", "steps": 3}
    made = RunSummary(status="diverged", forensics=Forensics(step=1, forward={"layer": 2, "site": "logits"}))
    assert made.to_json() == {"status": "diverged", "forensics": {"step": 1, "forward": {"layer": 2, "site": "logits"}}}
    assert made.forensics is not None and made.forensics.site == "block 2: logits"
