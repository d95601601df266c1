"""Sweeps, their store, their summaries, compare and the recipes.

The summary numbers are checked against formulas written here; the sweep's robustness against a
real kill -9 of the sweep process, a run forced to diverge and a run forced to crash.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.errors import ConfigError
from normlab.experiments import RECIPES, SweepConfig, compare, load_recipe, load_sweep, run_sweep, summarize
from normlab.experiments.runner import _to_toml, prepare
from normlab.experiments.summary import cells, lr_curves, lr_sensitivity
from normlab.runs.files import SweepDir
from normlab.runs.start import FolderLock
from normlab.runs.store import SweepStore
from tests.helpers import synthetic_store, wait_until

QUIET = lambda *a, **k: None


def nano_base(corpus: Path, **kw) -> dict:
    return {
        **dict(
            data=str(corpus),
            size="nano",
            seq_len=32,
            batch_size=8,
            steps=6,
            eval_every=0,
            eval_batches=1,
            probe_every=0,
        ),
        **kw,
    }


# --- the grid -------------------------------------------------------------------------------------


def test_grid_is_the_product_with_stable_ids():
    sweep = SweepConfig(
        name="g",
        base={"size": "nano", "steps": 5},
        grid={"layout": ["pre", "peri"], "lr": [1e-3, 3e-3], "model.n_layers": [1, 3]},
    )
    specs = sweep.expand()
    assert len(specs) == 2 * 2 * 2
    assert [s.axes for s in specs[:2]] == [
        {"layout": "pre", "lr": 1e-3, "model.n_layers": 1},
        {"layout": "pre", "lr": 1e-3, "model.n_layers": 3},
    ]
    assert specs[1].config.model.options == {"n_layers": 3} and specs[1].config.optim.lr == 1e-3
    assert specs[0].run_id.startswith("pre_lr0.001_n_layers1-")
    assert [s.run_id for s in sweep.expand()] == [s.run_id for s in specs]  # stable: resume finds them
    h = SweepConfig(name="h", base={"size": "nano"}, grid={"layout.h": [0.5], "layout": ["pre", "peri"]}).expand()
    assert [s.config.model.layout_label for s in h] == ["pre,h=0.5", "peri,h=0.5"] and h[0].run_id.startswith(
        "h0.5_pre-"
    )
    explicit = SweepConfig(name="g", base={"size": "nano", "steps": 5, "lr": 3e-3, "wandb": False}, grid=sweep.grid)
    assert [s.run_id for s in explicit.expand()] == [s.run_id for s in specs]  # a default spelled out: same run
    changed = SweepConfig(name="g", base={"size": "nano", "steps": 6}, grid=sweep.grid).expand()
    assert not {s.run_id for s in changed} & {s.run_id for s in specs}  # another setting: other runs


@pytest.mark.parametrize(
    "grid, match",
    [
        ({"lrr": [1e-3]}, "unknown setting 'lrr'; did you mean lr"),
        ({"out": ["a", "b"]}, "does not change what a run computes"),
        ({"probe_every": [0, 10]}, "cannot be an axis"),
        ({"lr": ["fast"]}, "expected a number"),
        ({"steps": [True]}, "expected an integer"),
        ({"lr": []}, "non-empty list"),
        ({"lr": [1e-3, 1e-3]}, "repeats a value"),
        ({"model.n_layer": [2]}, "not a model option"),
        ({"layout": ["pre", "perii"]}, "perii"),
        ({"layout.hh": [0.5]}, "unknown layout token .hh=0.5."),
        ({"layout.h": [-1.0]}, "h"),
        ({"lr": [-1.0]}, "lr must be > 0"),
    ],
)
def test_bad_grids_fail_before_anything_runs(grid, match):
    with pytest.raises(ConfigError, match=match):
        SweepConfig(name="bad", base={"size": "nano"}, grid=grid)


def test_sweep_file_round_trips_through_toml(tmp_path):
    sweep = SweepConfig(
        name="t",
        base={"size": "nano", "min_lr": None, "model": {"init": "normal"}},
        grid={"layout": ["pre", "peri,h=0.5"], "model.init_std": [0.02, 0.1]},
        source="Kim",
        scale="nano",
        claim="c",
    )
    path = tmp_path / "s.toml"
    path.write_text(_to_toml(sweep.to_dict()))
    again = SweepConfig.from_toml(path)
    assert [s.run_id for s in again.expand()] == [s.run_id for s in sweep.expand()]
    with pytest.raises(ConfigError, match="unknown key"):
        SweepConfig.from_dict({"name": "x", "grids": {}})


def test_every_recipe_expands_and_names_its_source():
    assert len(RECIPES) >= 15
    for name in RECIPES:
        r = load_recipe(name)
        assert r.source and r.scale and r.claim, name
        assert r.expand(), name
        # the recipe list says where each runs: gpu-* on CUDA at the gpu size on the English corpus
        assert r.machine == ("gpu" if name.startswith("gpu-") else "cpu"), name
        assert r.scale.startswith("gpu:") == (r.machine == "gpu"), name
        for spec in r.expand():
            cfg = spec.train_config("/tmp/unused")
            if r.machine == "gpu" and not name.startswith("gpu-transfer-"):  # the transfer study keeps its proxy's data
                assert cfg.data.data == "english" and cfg.model.size == "gpu-126m" and cfg.data.seq_len == 1024, name
    with pytest.raises(ConfigError, match="did you mean kim-lr"):
        load_recipe("kim-lrr")


# --- summaries against hand-computed values ------------------------------------------------------


def test_summaries_match_hand_computed_values(tmp_path):
    df, axes = load_sweep(synthetic_store(tmp_path))
    assert axes == ["layout", "lr", "seed"] and len(df) == 12

    sweep = SweepConfig(name="order", base={"size": "nano"}, grid={"seed": [0], "lr": [1e-3], "layout": ["pre"]})
    prepare(sweep, tmp_path / "order")
    assert load_sweep(tmp_path / "order")[1] == ["seed", "lr", "layout"]  # the grid's order, not sorted

    c = cells(df, axes).set_index(["layout", "lr"])
    assert c.loc[("pre", 1e-2), "divergences"] == "1/2"  # failed runs are not results: 1 of 2 finished
    assert c.loc[("pre", 1e-2), "failed"] == 1
    assert c.loc[("pre", 1e-3), "divergences"] == "0/3"
    assert c.loc[("pre", 1e-3), "final_loss_mean"] == pytest.approx((3.0 + 3.2 + 3.4) / 3)
    assert c.loc[("pre", 1e-3), "final_loss_std"] == pytest.approx(statistics.stdev([3.0, 3.2, 3.4]))  # ddof 1
    assert c.loc[("pre", 1e-2), "final_loss_mean"] == pytest.approx(2.9)  # the diverged seed excluded
    assert math.isnan(c.loc[("pre", 1e-2), "final_loss_std"])  # one value: no spread
    assert c.loc[("peri", 1e-3), "val_loss_mean"] == pytest.approx((3.2 + 3.2 + 3.4) / 3)  # the stalled seed counts
    assert c.loc[("peri", 1e-3), "stalls"] == "1/3" and c.loc[("peri", 1e-3), "divergences"] == "0/3"
    assert c.loc[("peri", 1e-3), "stalled"] == 1 and c.loc[("peri", 1e-3), "ok"] == 2

    curves = lr_curves(df, axes).set_index(["layout", "lr"])
    # capped loss: min(final, initial); a diverged run counts as the initial loss 5.5, whatever finite loss it
    # logged last (Wortsman et al. 2024, LR sensitivity: a run that diverged reached no loss below the initial)
    assert curves.loc[("pre", 1e-2), "capped_loss"] == pytest.approx((5.5 + 2.9) / 2)
    assert curves.loc[("peri", 1e-2), "capped_loss"] == pytest.approx((2.6 + 2.8 + 2.7) / 3)
    assert curves.loc[("peri", 1e-3), "stalls"] == "1/3" and curves.loc[("pre", 1e-2), "stalls"] == "0/2"
    sens = lr_sensitivity(lr_curves(df, axes), axes).set_index("layout")
    pre = [(3.0 + 3.2 + 3.4) / 3, (5.5 + 2.9) / 2]
    peri = [(3.1 + 3.1 + 3.3) / 3, (2.6 + 2.8 + 2.7) / 3]
    assert sens.loc["pre", "expected_capped_loss"] == pytest.approx(sum(pre) / 2)
    assert sens.loc["pre", "lr_sensitivity"] == pytest.approx(sum(pre) / 2 - min(pre))
    assert sens.loc["peri", "lr_sensitivity"] == pytest.approx(sum(peri) / 2 - min(peri))
    assert sens.loc["pre", "best_lr"] == 1e-2 and sens.loc["pre", "best_final_loss"] == pytest.approx(2.9)
    assert sens.loc["peri", "best_lr"] == 1e-2

    out = summarize(tmp_path / "syn")
    md = out["markdown"].read_text()
    assert "| pre | 0.01 | 1/2 | 0/2 | 1 | 2.9000 | 3.0000 |" in md
    assert "\n- base: size=nano\n" in md  # the settings every run shares (a recipe's --set shows here)
    assert "| pre | 0.001 | 0/3 | 0/3 | 0 | 3.2000 ± 0.2000 |" in md
    assert "| peri | 0.001 | 0/3 | 1/3 | 0 | 3.1667 ± 0.1155 |" in md
    assert "| peri | 3.1667 (1/3 stalled) | 2.7000 |" in md  # the lr table
    assert "| pre | 3.2000 | 2.9000 (1/2 diverged) |" in md
    assert (tmp_path / "syn" / "cells.csv").exists() and out["html"].exists()


def test_summary_of_model_and_layout_axes(tmp_path):
    sweep = SweepConfig(
        name="m", base={"size": "nano"}, grid={"layout": ["pre"], "model.init": ["he", "normal"], "layout.h": [0.5]}
    )
    store, specs = prepare(sweep, tmp_path / "m")
    for i, s in enumerate(specs):
        store.record(s.run_id, {"status": "ok", "final_loss": 3.0 + i, "initial_loss": 5.5, "steps": 1})
    md = summarize(tmp_path / "m")["markdown"].read_text()
    assert (
        "| layout | model.init | layout.h | divergences |" in md
        and "| pre | normal | 0.5 | 0/1 | 0/1 | 0 | 4.0000 |" in md
    )


# --- running sweeps ------------------------------------------------------------------------------


def test_diverged_and_crashed_runs_never_stop_the_sweep(corpus, tmp_path):
    """A run forced to diverge (lr 100) and one forced to crash (missing data file) are recorded; the
    others finish; the summary counts them."""
    sweep = SweepConfig(
        name="robust",
        base=nano_base(corpus, layout="peri", diverge_patience=3),
        grid={"data": [str(corpus), str(tmp_path / "missing.txt")], "lr": [1e-3, 100.0]},
    )
    counts = run_sweep(sweep, tmp_path / "sw", workers=2, log=QUIET)
    assert counts["ok"] == 1 and counts["diverged"] == 1 and counts["failed"] == 2
    rows = {(Path(r["axes"]["data"]).name, r["axes"]["lr"]): r for r in SweepStore(tmp_path / "sw" / "sweep.db").rows()}
    assert rows[("corpus.txt", 100.0)]["status"] == "diverged" and rows[("corpus.txt", 100.0)]["step"] is not None
    assert "missing.txt" in rows[("missing.txt", 1e-3)]["reason"]
    md = summarize(tmp_path / "sw")["markdown"].read_text()
    assert "| 100 | 1/1 | 0/1 | 0 |" in md and "| 0.001 | 0/0 | 0/0 | 1 |" in md
    # re-running retries the failed runs only; results already recorded stay as they were
    ok_before = rows[("corpus.txt", 1e-3)]
    run_sweep(sweep, tmp_path / "sw", workers=2, log=QUIET)
    after = {
        (Path(r["axes"]["data"]).name, r["axes"]["lr"]): r for r in SweepStore(tmp_path / "sw" / "sweep.db").rows()
    }
    assert after[("corpus.txt", 1e-3)] == ok_before
    assert after[("missing.txt", 1e-3)]["attempts"] == 2


@pytest.mark.slow  # test_run_guards' kill -9 test kills a sweep mid-run, resumes it and reruns it finished: quick
def test_sweep_killed_with_sigkill_resumes_without_redoing_or_losing_runs(corpus, tmp_path):
    sweep_file = tmp_path / "s.toml"
    base = nano_base(corpus, layout="pre", steps=8)
    sweep_file.write_text(_to_toml(SweepConfig(name="k", base=base, grid={"seed": [0, 1, 2, 3]}).to_dict()))
    out = tmp_path / "k"
    cmd = [sys.executable, "-m", "normlab", "sweep", str(sweep_file), "--out", str(out), "--workers", "1"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = out / "sweep.db"
    done_before: list[tuple] = []

    def a_run_finished() -> bool:
        nonlocal done_before
        if proc.poll() is not None:
            pytest.fail("the sweep ended before it could be killed; make the runs longer")
        if not db.exists():
            return False
        try:
            with sqlite3.connect(db) as con:
                done_before = con.execute(
                    "select run_id, status, final_loss, finished_at, attempts from runs "
                    "where status in ('ok', 'diverged')"
                ).fetchall()
        except sqlite3.OperationalError:  # the file exists a moment before its table does
            done_before = []
        return bool(done_before)

    try:
        wait_until("a first run of the sweep to finish", a_run_finished, every=0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its worker, mid-way
        proc.wait()
    counts = run_sweep(SweepConfig.from_toml(sweep_file), out, log=QUIET)
    assert counts["ok"] == 4 and counts["failed"] == 0
    with sqlite3.connect(db) as con:
        after = {r[0]: r for r in con.execute("select run_id, status, final_loss, finished_at, attempts from runs")}
    for row in done_before:
        assert after[row[0]] == row  # not redone, nothing lost
    assert len(after) == 4


def test_a_second_sweep_on_the_same_folder_is_refused(tmp_path):
    (tmp_path / "sw").mkdir()
    held = FolderLock(SweepDir(tmp_path / "sw").lock_file, wait=0, busy=str)
    try:
        with pytest.raises(ConfigError, match="another normlab sweep is running"):
            run_sweep(SweepConfig(name="x", base={"size": "nano"}, grid={"seed": [0]}), tmp_path / "sw", log=QUIET)
    finally:
        held.release()


def test_changed_base_settings_need_a_new_folder(tmp_path):
    prepare(SweepConfig(name="x", base={"size": "nano", "steps": 5}, grid={"seed": [0]}), tmp_path / "sw")
    prepare(SweepConfig(name="x", base={"size": "nano", "steps": 5}, grid={"seed": [0, 1]}), tmp_path / "sw")  # grows
    with pytest.raises(ConfigError, match="changed: steps"):
        prepare(SweepConfig(name="x", base={"size": "nano", "steps": 6}, grid={"seed": [0]}), tmp_path / "sw")


def test_submitit_local_executor_runs_and_records(corpus, tmp_path):
    pytest.importorskip("submitit")
    sweep = SweepConfig(name="s", base=nano_base(corpus, layout="peri"), grid={"seed": [0]}, executor="submitit-local")
    counts = run_sweep(sweep, tmp_path / "sw", log=QUIET)
    assert counts["ok"] == 1
    row = SweepStore(tmp_path / "sw" / "sweep.db").rows()[0]
    assert row["final_loss"] < row["initial_loss"] and row["attempts"] == 1


def test_compare_trains_the_layouts_and_writes_the_report(corpus, tmp_path):
    index = compare(
        ["post", "peri"],
        out=tmp_path / "cmp",
        workers=2,
        log=QUIET,
        **{**nano_base(corpus), "probe_every": 3, "eval_every": 3},
    )
    page = index.read_text()
    assert "variance_by_depth" in page and "post" in page and "peri" in page
    rows = SweepStore(tmp_path / "cmp" / "sweep.db").rows()
    assert [r["axes"]["layout"] for r in rows] == ["post", "peri"] and all(r["status"] == "ok" for r in rows)
    assert (tmp_path / "cmp" / "summary.md").exists()


def test_cli_sweep_from_flags_and_errors(corpus, tmp_path, capsys):
    from normlab.cli import main

    assert main(["sweep"]) == 2
    assert "--recipe" in capsys.readouterr().err
    assert main(["sweep", "--recipe", "kim-lr", "--grid", "lr=oops,1e-3"]) == 2
    code = main(
        [
            "sweep",
            "--grid",
            "layout=pre;peri,h=0.5",
            "--set",
            "size=nano",
            "--set",
            f"data={corpus}",
            "--set",
            "steps=3",
            "--set",
            "seq_len=32",
            "--set",
            "batch_size=8",
            "--set",
            "probe_every=0",
            "--set",
            "eval_every=0",
            "--set",
            "eval_batches=1",
            "--set",
            "model.n_layers=1",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "cli"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "| peri,h=0.5 | 0/1 |" in out and "report:" in out
    rows = SweepStore(tmp_path / "cli" / "sweep.db").rows()
    assert rows[0]["config"].model.options == {"n_layers": 1}


def test_a_grid_point_with_two_ids_counts_once(tmp_path):
    from normlab.experiments.sweep import RunSpec

    sweep = SweepConfig(name="d", base={"size": "nano"}, grid={"layout": ["pre"], "seed": [0]})
    store, (spec,) = prepare(sweep, tmp_path / "d")
    old = RunSpec("pre_seed0-oldhash0", spec.index, spec.axes, spec.config)  # e.g. recorded by an older normlab
    store.add([old])
    store.record(old.run_id, {"status": "ok", "final_loss": 2.0, "initial_loss": 5.5, "steps": 1})
    df, axes = load_sweep(tmp_path / "d")
    assert len(df) == 1 and df.iloc[0].final_loss == 2.0  # the finished row, not the pending one
    assert cells(df, axes).loc[0, "divergences"] == "0/1"


def test_angular_halves_reads_the_last_probe_of_the_stream():
    """Sun et al.'s depth test: mean angular step over the first and the second half of depth, last probe only."""
    from normlab.experiments.summary import angular_halves

    class Run:
        def probes(self):
            old = [{"step": 0, "layer": i, "site": "stream", "metric": "angular_next", "value": 9.0} for i in range(4)]
            new = [
                {"step": 10, "layer": i, "site": "stream", "metric": "angular_next", "value": v}
                for i, v in enumerate([0.4, 0.2, 0.1, 0.05])
            ]
            other = [{"step": 10, "layer": 0, "site": "stream", "metric": "var", "value": 7.0}]
            return old + new + other

    assert angular_halves(Run()) == {"angular_shallow": pytest.approx(0.3), "angular_deep": pytest.approx(0.075)}
    Run.probes = lambda self: []
    assert angular_halves(Run()) == {}
