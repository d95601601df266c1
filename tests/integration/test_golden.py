"""Golden loss curve (as torchtitan keeps one): a short run's per-step numbers against a stored file.

Any change to the training loop that changes what it computes (step order, accumulation, clipping,
z-loss, schedule, evaluation, what the probes touch) moves these numbers far beyond the tolerance,
which only absorbs last-bit differences between CPUs. Regenerate deliberately, after checking why
the numbers moved: `NORMLAB_REGEN_GOLDEN=1 pytest tests/integration/test_golden.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from normlab.train import train
from tests.helpers import rows, small

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "train_nano.json"
KEYS = ("loss", "grad_norm", "lr", "val_loss")
CASES = {
    # accumulation, clipping below the norm, z-loss, probes and evaluation all inside the 16 steps
    "peri": dict(layout="peri", grad_accum=2, grad_clip=0.5, z_loss=1e-4, steps=16, eval_every=8, probe_every=8),
    "post-sgd": dict(layout="post", optimizer="sgd", lr=0.05, steps=16, eval_every=8, probe_every=0),
}


def _curve(corpus, out, settings) -> list[dict]:
    train(small(corpus, out, **settings))
    return [{k: r[k] for k in ("step", *KEYS) if k in r} for r in rows(out)]


@pytest.mark.parametrize("name", list(CASES))
def test_loss_curve_matches_the_golden_file(corpus, tmp_path, name):
    got = _curve(corpus, tmp_path / name, CASES[name])
    if os.environ.get("NORMLAB_REGEN_GOLDEN"):
        data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        data[name] = got
        GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
        pytest.skip("golden file regenerated")
    want = json.loads(GOLDEN.read_text())[name]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), g["step"]
        for k in KEYS:
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (name, g["step"], k)
