"""`normlab coordcheck` (normlab.experiments.coordcheck): the rows it writes, and muP flatter than SP across widths."""

from __future__ import annotations

import json
import math

import pytest

from normlab.cli import main
from normlab.config.train import TrainConfig
from normlab.experiments.coordcheck import coordcheck

WIDTHS = [32, 64, 128]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """Pre-LN at nano's depth, 3 widths, 3 steps at lr 1e-2, one seed: under SP and under muP (base 32)."""
    text = tmp_path_factory.mktemp("cc") / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    base = {"size": "nano", "lr": 1e-2, "batch_size": 4, "seq_len": 32, "weight_decay": 0.0, "data": str(text)}
    out = {}
    for par in ("sp", "mup"):
        cfg = TrainConfig().with_({**base, "layout": "pre", "model.parametrization": par}, "test")
        out[par] = coordcheck(cfg, WIDTHS, steps=3, seeds=1)
    return out


def test_rows_cover_every_width_step_and_site(checks):
    check = checks["mup"]
    sites = {r["site"] for r in check.rows}
    assert {"embed_out", "blocks.0.attn_update", "blocks.1.mlp_update", "blocks.1.resid_post", "logits"} <= sites
    assert len(check.rows) == len(WIDTHS) * 4 * len(sites)  # steps 0..3
    assert all(r["rms"] > 0 and math.isfinite(r["rms"]) for r in check.rows)
    step0 = [r for r in check.rows if r["step"] == 0]
    assert all(r["delta_rms"] == 0.0 for r in step0)  # the change since init starts at zero
    assert check.settings["base_d_model"] == 32 and checks["sp"].settings["base_d_model"] is None


def test_mup_is_flatter_than_sp_across_widths(checks):
    """SP with Adam: each hidden matrix's update moves every coordinate by ~lr, so a block's update grows with
    width (Yang et al. 2022, Fig. 5 left) and the logits with it; muP divides the hidden lr by the width and the
    logits' input by the width multiplier, and the lines flatten (exponents measured: SP about 1-2, muP under 0.5)."""
    sp, mu = checks["sp"], checks["mup"]
    for kind in ("attn_update", "mlp_update", "logits"):
        assert sp.slope(kind, 3, "delta_slope") > 0.6, kind  # SP grows with width
        assert abs(mu.slope(kind, 3, "delta_slope")) < sp.slope(kind, 3, "delta_slope") / 2, kind


def test_command_writes_json_and_page_and_refuses_a_folder_it_did_not_make(tmp_path, capsys, corpus):
    out = tmp_path / "cc"
    args = ["coordcheck", "peri", "--widths", "32,64", "--steps", "1", "--seeds", "1", "--out", str(out)]
    args += ["--set", f"data={corpus}", "--set", "size=nano", "--set", "model.parametrization=mup"]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "coordcheck peri (mup, base width 32)" in said and "logits" in said
    data = json.loads((out / "coordcheck.json").read_text())
    assert {"width", "step", "site", "rms"} <= set(data["rows"][0]) and data["parametrization"] == "mup"
    assert "<img" in (out / "index.html").read_text()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main([*args[:-8], "--out", str(theirs), *args[-6:]]) == 2
    assert (theirs / "notes.txt").read_text() == "mine" and len(list(theirs.iterdir())) == 1
    assert main(["coordcheck", "pre", "--widths", "64,32", "--out", str(tmp_path / "x")]) == 2
    assert "increasing order" in capsys.readouterr().err
