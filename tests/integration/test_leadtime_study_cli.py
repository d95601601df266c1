"""`normlab leadtime`'s threshold study from the command line (issue 66): over a finished sweep with the QK
spectral-entropy probe on, the table per detector and kind, the record alerts quote and the figure, each
written only as a new file (or over its own), the same answer twice."""

from __future__ import annotations

import json

import pytest

from normlab.cli import main
from normlab.diagnostics.early_warning import replay
from normlab.diagnostics.precursors import QK_SPECTRUM
from normlab.diagnostics.warning_record import THRESHOLDS
from normlab.experiments.sweep import SweepConfig
from tests.integration.test_untrusted_input import one_line_refusal


@pytest.fixture(scope="module")
def probed_sweep(tmp_path_factory):
    """2 nano runs of 4 steps, the QK-spectrum probe every step."""
    from normlab.experiments.runner import run_sweep
    from tests.conftest import SENTENCES

    root = tmp_path_factory.mktemp("sweep")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)))
    base = {"data": str(corpus), "size": "nano", "seq_len": 16, "batch_size": 4, "steps": 4, "eval_every": 0}
    sweep = SweepConfig(
        name="kind-a",
        base={**base, "eval_batches": 1, "probe_every": 0, "device": "cpu", "qk_spectrum_every": 1},
        grid={"layout": ["pre", "peri"], "seed": [0]},
    )
    run_sweep(sweep, root / "folder", workers=1, log=lambda *a: None)
    return root / "folder"


def test_the_study_prints_per_kind_and_writes_its_record_and_figure(probed_sweep, tmp_path, capsys):
    runs = sorted((probed_sweep / "runs").iterdir())
    rows = [json.loads(x) for x in (runs[0] / QK_SPECTRUM).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and len(rows[1]["qk_update_entropy"]) == 2  # 2 layers
    for run in runs:  # the live alerts (the tier's row and the probe's merged) are the replay's
        lines = (run / "warnings.jsonl").read_text().splitlines() if (run / "warnings.jsonl").exists() else []
        live = [(a["signal"], a["step"]) for a in map(json.loads, lines)]
        assert live == [(a.signal, a.step) for a in replay(run)]

    mine = tmp_path / "mine.json"
    mine.write_text("notes\n")
    one_line_refusal(["leadtime", probed_sweep, "--record", mine], "mine.json exists; name a new file", capsys)
    one_line_refusal(["leadtime", probed_sweep, "--figure", tmp_path / "f.pdf"], "give a .png file", capsys)
    one_line_refusal(["leadtime", probed_sweep, "--horizon", "0"], "--horizon 0", capsys)
    assert mine.read_text() == "notes\n"

    record, fig = tmp_path / "rec.json", tmp_path / "f.png"
    args = ["leadtime", str(probed_sweep), "--record", str(record), "--figure", str(fig), "--horizon", "100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # the kind is the sweep's name, not its folder's
    assert "2 runs over 1 seed(s) in 1 kind(s) (kind-a); 0 events" in out
    assert "| qk update entropy (4) | kind-a | 0/0 -" in out
    data = json.loads(record.read_text())
    assert set(data["detectors"]) == set(THRESHOLDS) and data["about"] == "kind-a: 2 runs, 1 seeds"
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = record.read_text()
    assert main(args[:4] + args[6:]) == 0  # its own record: written again, the same
    assert record.read_text() == first
    # a figure carries no mark of its maker: an existing one is refused, as any other file
    one_line_refusal(args, "f.png exists; name a new file", capsys)
