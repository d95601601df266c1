"""Trustworthy runs: safe loading, nothing lost, one config declaration, one-line errors, fuzzing."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from normlab.cli import main
from normlab.experiments import SweepConfig
from normlab.layout import LayoutError, parse_layout
from normlab.model import build_model
from normlab.model.config import ConfigError
from normlab.train import TrainConfig, train
from normlab.train import trainer as trainer_mod
from normlab.runs.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from normlab.train.monitor import DivergenceMonitor
from normlab.runs.start import RunLock
from tests.helpers import REPO, losses, rows, small


class Evil:
    """Unpickling this runs `touch MARKER`: what a malicious .pt does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_checkpoint(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.zeros(2)}, "payload": Evil(marker), "step": 1}, path)
    return path


# --- safe loading -----------------------------------------------------------------------------

def test_a_malicious_checkpoint_is_refused_and_never_executes(corpus, tmp_path, capsys):
    marker = tmp_path / "pwned"
    bad = evil_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError, match="could run code"):
        load_checkpoint(bad)
    # through every door: export, --init-from, and resume of a run whose newest checkpoint is evil
    assert main(["export", str(bad), str(tmp_path / "exp")]) == 2
    assert main(["train", "--data", str(corpus), "--size", "nano", "--steps", "2", "--seq-len", "16",
                 "--batch-size", "4", "--init-from", str(bad), "--out", str(tmp_path / "ft"), "--no-progress"]) == 2
    run = tmp_path / "run"
    train(small(corpus, run, steps=3))
    evil_checkpoint(run / "checkpoints" / "step_00000009.pt", marker)
    (run / "summary.json").unlink()  # as if the run had been killed
    with pytest.raises(CheckpointError, match="could run code"):
        train(small(corpus, run, steps=3))
    assert not marker.exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "could run code" in err and "posix.system" in err
    assert "weights_only` set to `False" not in err


def test_a_malicious_sharded_checkpoint_is_refused_and_never_executes(corpus, tmp_path, capsys):
    """DCP reads a sharded checkpoint's .metadata with plain pickle: normlab checks it first."""
    import pickle

    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    train(small(corpus, run, steps=3))
    bad = run / "checkpoints" / "step_00000009.dcp"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    torch.save({"step": 9}, bad / "extra.pt")
    with pytest.raises(CheckpointError, match="could run code"):
        load_checkpoint(bad)
    assert main(["export", str(bad), str(tmp_path / "exp")]) == 2
    assert main(["export", str(run), str(tmp_path / "exp2")]) == 2
    (run / "summary.json").unlink()
    with pytest.raises(CheckpointError, match="could run code"):
        train(small(corpus, run, steps=3))
    assert not marker.exists()
    assert "posix.system" in capsys.readouterr().err
    # an incomplete folder (killed before its metadata) is corrupt, not unsafe: the previous one is used
    (bad / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="incomplete sharded checkpoint"):
        load_checkpoint(bad)


def test_a_sharded_checkpoint_whose_optimizer_entry_is_a_pickle_payload_is_refused(corpus, tmp_path, capsys):
    """DCP stores non-tensor entries (an optimizer's param_groups) as torch.save blobs and torch's
    default planner reads them with weights_only=False: normlab's planner reads them weights-only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from normlab.runs.checkpoint import load_sharded_state
    from normlab.train.optim import make_optimizer

    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    cfg = small(corpus, run, steps=3)
    train(cfg)
    model = build_model(cfg.model.layout, cfg.model.size, seed=0, vocab_size=256, max_seq_len=64)
    opt = make_optimizer(model, cfg, fused=False)
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = Evil(marker)  # a float in a real checkpoint
    bad = run / "checkpoints" / "step_00000009.dcp"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=bad, no_dist=True)
    torch.save({"step": 9, "tokens": 0, "wall_time": 0.0}, bad / "extra.pt")
    with pytest.raises(CheckpointError, match="could run code"):
        load_sharded_state(bad, model, opt)
    (run / "summary.json").unlink()  # resume picks the crafted folder: refused, never run
    with pytest.raises(CheckpointError, match="could run code"):
        train(small(corpus, run, steps=3))
    assert not marker.exists()


def test_checkpoints_hold_only_safe_types(corpus, tmp_path):
    train(small(corpus, tmp_path / "r", steps=2))
    ckpt = torch.load(list_checkpoints(tmp_path / "r")[-1], weights_only=True)  # plain torch, no allowlist
    assert isinstance(ckpt["rng"]["numpy"]["keys"], torch.Tensor) and ckpt["config"]["steps"] == 2


# --- foreign code and foreign paths -----------------------------------------------------------

def _export(tmp_path: Path) -> Path:
    import normlab
    from normlab.hf import save_hf

    return save_hf(normlab.build_model("peri", "nano", seed=0), tmp_path / "export")


def test_eval_runs_only_the_model_code_normlab_wrote(tmp_path, capsys):
    """An export's modeling_normlab.py runs on load (trust_remote_code): only if it is what this normlab
    writes. An edited one, or a foreign folder whose auto_map names its own module, is refused."""
    from normlab.evaluation.harness import remote_code

    export = _export(tmp_path)
    assert remote_code(export) is True  # normlab's own bundle, verified byte for byte
    marker = tmp_path / "pwned"
    bundled = export / "modeling_normlab.py"
    bundled.write_text(bundled.read_text() + f"\nimport os; os.system('touch {marker}')\n")
    assert main(["eval", str(export), "--limit", "2"]) == 2
    assert "differs from what this normlab writes" in capsys.readouterr().err and not marker.exists()
    assert remote_code(export, trust=True) is True  # the user's explicit decision
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {
        "AutoModelForCausalLM": "evil.EvilForCausalLM"}}))
    (foreign / "evil.py").write_text(f"import os; os.system('touch {marker}')\n")
    assert main(["eval", str(foreign), "--limit", "2"]) == 2
    assert "normlab did not write it (evil.py)" in capsys.readouterr().err and not marker.exists()
    tok_only = tmp_path / "tok"
    tok_only.mkdir()
    (tok_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tok_only / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    with pytest.raises(Exception, match="normlab did not write it"):
        remote_code(tok_only)
    native = tmp_path / "native"
    native.mkdir()
    (native / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert remote_code(native) is False  # no code in the folder: nothing to trust


def test_scan_and_init_from_never_offer_to_run_a_folders_code(corpus, tmp_path):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is unset:
    a user answering y (here: stdin says y) would run it. normlab never asks: it refuses."""
    marker = tmp_path / "pwned"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "evilarch", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    (foreign / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    (foreign / "evil.py").write_text(f"import os; os.system('touch {marker}')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for argv in (["scan", str(foreign)], ["train", "--data", str(corpus), "--size", "nano", "--steps", "1",
                                          "--init-from", str(foreign), "--out", str(tmp_path / "o"), "--no-progress"]):
        res = subprocess.run([sys.executable, "-m", "normlab", *argv], input="y\ny\n", capture_output=True, text=True,
                             env=env, timeout=120)
        assert res.returncode == 2 and "Do you wish" not in res.stdout + res.stderr, res.stderr[-500:]
        assert len(res.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_run_ids_from_a_store_never_leave_the_sweep(corpus, tmp_path, capsys):
    import sqlite3

    from normlab.experiments.runner import run_sweep

    sweep = SweepConfig(name="t", base={"data": str(corpus), "size": "nano", "seq_len": 16, "batch_size": 4,
                                        "steps": 2, "eval_every": 0, "eval_batches": 1, "probe_every": 0,
                                        "device": "cpu"}, grid={"layout": ["pre"]})
    root = tmp_path / "sw"
    run_sweep(sweep, root, workers=1, log=lambda *a: None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with sqlite3.connect(root / "sweep.db") as con:
        con.execute("update runs set run_id = '../../elsewhere'")
    for argv in (["summarize", str(root)], ["eval", str(root), "--limit", "2"], ["sweep", str(root / "sweep.toml"),
                                                                              "--out", str(root)]):
        assert main(argv) == 2, argv
        assert "invalid run id '../../elsewhere'" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []


def test_no_command_writes_over_files_it_did_not_write(corpus, tmp_path, capsys, monkeypatch):
    """sweep, report, summarize and scan write only into folders normlab made (or new, empty ones)."""
    from normlab.io import MARKER

    mine = tmp_path / "project"
    mine.mkdir()
    user_files = {"sweep.toml": "# my sweep, with comments\nname = 'mine'\n[grid]\nlayout = ['pre']\n",
                  "summary.md": "my notes", "report.html": "<p>mine</p>", "runs.csv": "a,b\n"}
    for name, text in user_files.items():
        (mine / name).write_text(text)
    monkeypatch.chdir(mine)
    base = ["--set", f"data={corpus}", "--set", "size=nano", "--set", "steps=2", "--set", "seq_len=16",
            "--set", "batch_size=4", "--set", "probe_every=0", "--set", "device=cpu"]
    assert main(["sweep", "sweep.toml", "--out", ".", *base]) == 2
    assert "holds files normlab did not write" in capsys.readouterr().err
    assert main(["sweep", "sweep.toml", "--out", str(tmp_path / "sw"), *base]) == 0  # a new folder: fine
    assert (tmp_path / "sw" / MARKER).is_file()
    assert main(["sweep", "sweep.toml", "--out", str(tmp_path / "sw"), *base]) == 0  # its own folder: reused
    assert main(["summarize", str(tmp_path / "sw"), "--out", "."]) == 2
    run = next((tmp_path / "sw" / "runs").iterdir())
    report_dir = tmp_path / "rep"
    report_dir.mkdir()
    (report_dir / "index.html").write_text("<p>the user's page</p>")
    assert main(["report", str(run), "--out", str(report_dir)]) == 2
    assert (report_dir / "index.html").read_text() == "<p>the user's page</p>"
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 0  # its own report: rewritten
    (tmp_path / "rep2" / MARKER).unlink()  # a report an older normlab wrote (no marker): recognized
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 0
    export = _export(tmp_path)
    (export / "scan").mkdir()
    (export / "scan" / "table.md").write_text("the user's table")
    assert main(["scan", str(export)]) == 2
    assert (export / "scan" / "table.md").read_text() == "the user's table"
    assert main(["scan", str(run)]) == 2  # a run folder is not a transformers folder: one line
    assert "normlab run directory" in capsys.readouterr().err
    for name, text in user_files.items():
        assert (mine / name).read_text() == text
    assert sorted(p.name for p in mine.iterdir()) == sorted(user_files)


def test_a_refused_model_option_leaves_nothing_that_blocks_the_corrected_command(corpus, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--size", "nano", "--steps", "2", "--seq-len", "32",
                 "--no-progress", "--model", "max_seq_len=8", "--out", str(run)]) == 2
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    assert main(["train", "--data", str(corpus), "--size", "nano", "--steps", "2", "--seq-len", "32",
                 "--no-progress", "--out", str(run)]) == 0


def test_crafted_store_rows_are_one_line_errors(corpus, tmp_path, capsys):
    import shutil
    import sqlite3

    from normlab.experiments.runner import run_sweep

    sweep = SweepConfig(name="t", base={"data": str(corpus), "size": "nano", "seq_len": 16, "batch_size": 4,
                                        "steps": 2, "eval_every": 0, "eval_batches": 1, "probe_every": 0,
                                        "device": "cpu"}, grid={"layout": ["pre"]})
    run_sweep(sweep, tmp_path / "sw", workers=1, log=lambda *a: None)
    for i, change in enumerate(("axes = '\"x\"'", "config = '[1]'", "axes = '{bad'", "status = 'weird'")):
        root = tmp_path / f"c{i}"
        shutil.copytree(tmp_path / "sw", root)
        with sqlite3.connect(root / "sweep.db") as con:
            con.execute(f"update runs set {change}")
        for argv in (["summarize", str(root)], ["report", str(root)]):
            assert main(argv) == 2, (change, argv)
            assert "has an unreadable row" in capsys.readouterr().err


def test_eval_limit_is_checked(tmp_path, capsys):
    for bad in ("abc", "-1", "0", "1.5"):
        assert main(["eval", str(tmp_path), "--limit", bad]) == 2
        assert "--limit" in capsys.readouterr().err


# --- nothing lost -----------------------------------------------------------------------------

def test_out_refuses_folders_that_are_not_runs(corpus, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="not a normlab run"):
        train(small(corpus, export, steps=2))
    assert json.loads((export / "config.json").read_text()) == {"model_type": "llama"}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a normlab run"):
        train(small(corpus, plain, steps=2))
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train(small(corpus, afile, steps=2))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(small(corpus, empty, steps=2))["status"] == "ok"


def _interrupt_at(monkeypatch, step):
    from normlab.data import TokenData

    real = TokenData.train_batch

    def failing(self, s, *a, **k):
        if s == step:
            raise KeyboardInterrupt("simulated kill")
        return real(self, s, *a, **k)

    monkeypatch.setattr(TokenData, "train_batch", failing)
    return lambda: monkeypatch.setattr(TokenData, "train_batch", real)


def test_a_run_killed_before_its_first_checkpoint_restarts_cleanly(corpus, tmp_path, monkeypatch):
    full = small(corpus, tmp_path / "full", steps=12, eval_every=4, probe_every=4)
    train(full)
    cut = small(corpus, tmp_path / "cut", steps=12, eval_every=4, probe_every=4)
    restore = _interrupt_at(monkeypatch, 5)  # the first checkpoint (auto: every 10 steps) is never reached
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    restore()
    assert not list_checkpoints(cut.run.out) and len(rows(cut.run.out)) == 5
    s = train(cut)
    assert s["status"] == "ok" and [r["step"] for r in rows(cut.run.out)] == list(range(12))
    assert losses(cut.run.out) == losses(full.run.out)


def _interrupted(corpus, tmp_path, monkeypatch, probe_every: int):  # noqa: ANN202 - (full, cut) configs
    """A 12-step run trained whole, and the same run interrupted at step 10 (checkpoints at 3, 6, 9)."""
    full = small(corpus, tmp_path / "full", steps=12, probe_every=probe_every)
    train(full)
    cut = small(corpus, tmp_path / "cut", steps=12, ckpt_every=3, keep_last=3, probe_every=probe_every)
    restore = _interrupt_at(monkeypatch, 10)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    restore()
    return full, cut


def test_corrupt_newest_checkpoint_falls_back_and_torn_jsonl_is_cut(corpus, tmp_path, monkeypatch, capsys):
    full, cut = _interrupted(corpus, tmp_path, monkeypatch, probe_every=3)
    newest = list_checkpoints(cut.run.out)[-1]
    assert newest.name == "step_00000009.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # torn by a full disk
    for name in ("metrics.jsonl", "probes.jsonl"):
        with open(Path(cut.run.out) / name, "a") as f:
            f.write('{"step": 10, "loss": 1.2')  # a torn last line
    s = train(cut, log=print)
    assert "skipping checkpoint step_00000009.pt" in capsys.readouterr().out
    assert s["status"] == "ok" and losses(cut.run.out) == losses(full.run.out)
    assert [r["step"] for r in rows(cut.run.out)] == list(range(12))


def test_a_bit_flipped_checkpoint_is_caught_by_its_checksum_and_skipped(corpus, tmp_path, monkeypatch, capsys):
    full, cut = _interrupted(corpus, tmp_path, monkeypatch, probe_every=0)
    newest = list_checkpoints(cut.run.out)[-1]
    assert (newest.parent / (newest.name + ".sha256")).is_file()
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, inside a tensor's bytes: torch.load alone would not notice
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        load_checkpoint(newest)
    s = train(cut, log=print)
    assert "skipping checkpoint step_00000009.pt" in capsys.readouterr().out
    assert s["status"] == "ok" and losses(cut.run.out) == losses(full.run.out)
    assert sorted(p.name for p in (Path(cut.run.out) / "checkpoints").iterdir() if p.name.endswith(".sha256")) == \
        sorted(p.name + ".sha256" for p in list_checkpoints(cut.run.out))  # pruned together


def test_a_kill_during_the_first_config_write_does_not_block_the_run(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("")
    (run / ".config.json.k2x9abcd.tmp").write_text('{"config": {"ste')  # killed mid-write
    s = train(small(corpus, run, steps=3))
    assert s["status"] == "ok" and not list(run.glob("*.tmp"))
    assert (run / ".lock").read_text() == ""  # a finished run's lock names no process


def test_a_kill_after_the_last_checkpoint_keeps_the_final_validation_loss(corpus, tmp_path):
    run = tmp_path / "run"
    s = train(small(corpus, run, steps=6, probe_every=0))
    (run / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    again = train(small(corpus, run, steps=6, probe_every=0))
    assert again["final_val_loss"] == s["final_val_loss"] is not None
    assert again["final_loss"] == s["final_loss"] and again["steps"] == s["steps"]


def test_resume_refuses_any_identity_change(corpus, tmp_path, monkeypatch):
    cut = small(corpus, tmp_path / "r", steps=12, ckpt_every=3)
    restore = _interrupt_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    restore()
    for change, name in ((dict(grad_clip=0.01), "grad_clip"), (dict(beta2=0.5), "beta2"), (dict(eps=1e-6), "eps"),
                         (dict(z_loss=1e-4), "z_loss"), (dict(wd_exclude="norms"), "wd_exclude"), (dict(beta1=0.8), "beta1")):
        with pytest.raises(ConfigError, match=f"different settings \\({name}:"):
            train(small(corpus, tmp_path / "r", steps=12, ckpt_every=3, **change))
    # reporting settings are not identity: a resume may change them
    assert train(small(corpus, tmp_path / "r", steps=12, ckpt_every=4, eval_every=3))["status"] == "ok"


def test_a_finished_run_is_not_rewritten(corpus, tmp_path):
    cfg = small(corpus, tmp_path / "r", steps=3)
    first = train(cfg)
    before = (tmp_path / "r" / "summary.json").read_bytes()
    again = train(cfg)
    assert again == first and again["final_val_loss"] is not None
    assert (tmp_path / "r" / "summary.json").read_bytes() == before


def test_a_run_never_executes_twice_at_once(tmp_path):
    held = RunLock(tmp_path / "r")
    try:
        with pytest.raises(ConfigError, match="being trained by pid"):
            RunLock(tmp_path / "r", wait=0.3)
    finally:
        held.release()
    RunLock(tmp_path / "r", wait=0.3).release()  # free again once released


def test_skipping_most_steps_is_divergence(corpus, tmp_path, monkeypatch):
    real = trainer_mod._loss
    monkeypatch.setattr(trainer_mod, "_loss", lambda *a: (real(*a)[0] * float("nan"), None))
    s = train(small(corpus, tmp_path / "nan", steps=15, on_nonfinite="skip"))
    assert s["status"] == "diverged" and "10 of 10 steps skipped" in s["reason"]
    m = DivergenceMonitor(max_skipped=0.1)
    for step in range(20):  # one skip in 20 steps is within the 10% allowed
        if step == 3:
            assert not m.check_finite(step, float("nan"), 1.0, "skip")
        else:
            m.update(step, 2.0, 1.0)
    m.finish(20)
    assert m.status == "ok" and m.skipped_steps == [3]


def test_probe_loss_is_the_model_loss_with_softcaps():
    from normlab.diagnostics.probes import Probes
    from normlab.model import build_model

    model = build_model("peri", "nano", seed=0, logit_softcap=2.0, attn_softcap=5.0)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    rows_ = Probes(model, (x, y)).record(0)
    probe_loss = next(r["value"] for r in rows_ if r["metric"] == "probe_loss")
    assert probe_loss == pytest.approx(model(x, targets=y).loss.item(), rel=1e-6)


# --- one declaration ----------------------------------------------------------------------------

def test_one_override_function_behind_every_entry_point(corpus, tmp_path):
    from normlab.cli import build_parser, train_config_from_args

    want = TrainConfig.of(layout="peri", lr=1e-3, **{"model.n_layers": 3, "layout.h": 0.5})
    assert want.model.layout.h == 0.5 and want.model.layout_label == "peri,h=0.5"
    assert parse_layout(want.model.layout_label) == want.model.layout  # the label reads back as the Layout
    args = build_parser().parse_args(["train", "--set", "optim.lr=1e-3", "--set", "layout.h=0.5", "--model", "n_layers=3"])
    assert train_config_from_args(args) == want
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 0.001\n[model]\nn_layers = 3\n[layout]\nh = 0.5\n')
    assert TrainConfig.from_toml(toml) == want
    sweep = SweepConfig(name="one", base={"model.n_layers": 3, "layout": "peri"}, grid={"layout.h": [0.5], "lr": [1e-3]})
    spec = sweep.expand()[0]
    assert spec.train_config("x").identity() == want.identity()
    assert TrainConfig.from_dict(want.to_dict()) == want  # the edge form round-trips


def test_grid_values_are_typed_by_their_setting():
    from normlab.cli import _grid_args

    grid = _grid_args(["layout=pre,none", "lr=1e-3,3e-3", "min_lr=none,1e-4", "model.n_layers=2,3"])
    assert grid == {"layout": ["pre", "none"], "lr": [1e-3, 3e-3], "min_lr": [None, 1e-4], "model.n_layers": [2, 3]}
    specs = SweepConfig(name="g", base={"size": "nano"}, grid={"layout": grid["layout"]}).expand()
    assert [s.config["layout"] for s in specs] == ["pre", "none"]
    for name in ("../escape", "a/b", ""):
        with pytest.raises(ConfigError, match="sweep name"):
            SweepConfig(name=name, grid={"lr": [1e-3]})


def test_toml_values_must_have_their_types(tmp_path):
    for text, needle in (('weight_decay = "x"', "weight_decay: expected a number"),
                         ("steps = true", "steps: expected an integer, got True"),
                         ('compile = "no"', "compile: expected true or false"),
                         ("lr = nan", "lr: expected a finite number"),
                         ("[model]\nn_layers = 2.5", "model.n_layers: expected an integer"),
                         ("[optim]\nlrr = 1.0", "unknown setting 'optim.lrr'")):
        p = tmp_path / "c.toml"
        p.write_text(text + "\n")
        with pytest.raises(ConfigError, match=needle.replace("(", "\\(").replace(")", "\\)")):
            TrainConfig.from_toml(p)


# --- one-line errors ----------------------------------------------------------------------------

@pytest.fixture
def bad_inputs(corpus, tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('steps = true\n')
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "metrics.jsonl").write_text("not json\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    sft = tmp_path / "sft.jsonl"
    sft.write_text('["a", "b"]\n' * 20)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "caf\xe9"}\n')
    common = ["--data", str(corpus), "--size", "nano", "--steps", "2", "--no-progress", "--out", str(tmp_path / "o")]
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)) * 8)
    typed_garbage = tmp_path / "typed"
    typed_garbage.mkdir()
    (typed_garbage / "metrics.jsonl").write_text('{"step": "x", "loss": [1]}\n')
    bad_store = tmp_path / "store"
    bad_store.mkdir()
    (bad_store / "sweep.db").write_bytes(bytes(range(256)) * 20)
    return [
        ["train", *common, "--beta1", "1.5"],
        ["train", *common, "--eps", "-1"],
        ["train", *common, "--seed", str(2**70)],
        ["train", *common, "--grad-clip", "nan"],
        ["train", *common, "--lr", "inf"],
        ["train", *common, "--z-loss", "nan"],
        ["train", *common, "--weight-decay", "nan"],
        ["train", *common, "--config", str(toml)],
        ["train", *common, "--config", str(tmp_path / "missing.toml")],
        ["train", *common, "--layout", "perri"],
        ["train", *common, "--model", "d_modle=3"],
        ["train", *common, "--set", "nope=1"],
        ["train", "--data", "/dev/zero", "--size", "nano", "--steps", "2", "--no-progress", "--out", str(tmp_path / "z")],
        ["train", "--data", str(corpus), "--size", "nano", "--steps", "2", "--out", str(afile)],
        ["train", "--data", str(sft), "--task", "sft", "--size", "nano", "--steps", "2", "--out", str(tmp_path / "s")],
        ["train", "--data", str(latin), "--size", "nano", "--steps", "2", "--out", str(tmp_path / "l")],
        ["summarize", str(tmp_path / "nowhere")],
        ["report", str(garbage)],
        ["report", str(tmp_path / "nowhere")],
        ["scan", str(tmp_path / "nowhere")],
        ["demo", "--layouts", "pre,perri"],
        ["screen", "peri", "--layers", "two"],
        ["screen", "perri"],
        ["sweep", "--name", "../escape", "--grid", "lr=1e-3"],
        ["sweep", "--grid", "out=a,b"],
        ["sweep", "--grid", "lr=fast"],
        ["compare", "--set", "lr=-1", "--out", str(tmp_path / "cmp")],
        ["export", str(tmp_path / "nowhere"), str(tmp_path / "e")],
        *([] if torch.cuda.is_available() else [["train", *common, "--device", "cuda"]]),
        # the second adversarial pass (issue 23): binary files, garbage stores, out-of-range counts
        ["train", *common, "--config", str(binary)],
        ["train", *common, "--tokenizer", str(binary)],
        ["report", str(typed_garbage)],
        ["summarize", str(bad_store)],
        ["eval", str(bad_store)],
        ["screen", "pre", "--batch", "0"],
        ["train", *common, "--model", "vocab_size=10"],
        ["train", *common, "--seq-len", "32", "--model", "max_seq_len=8"],
        ["sweep", "--grid", "layout=pre", "--workers", "0", "--out", str(tmp_path / "w0")],
        ["sweep", "--grid", "layout=pre", "--workers", "-1", "--out", str(tmp_path / "w1")],
        ["compare", "--workers", "0", "--out", str(tmp_path / "cw")],
        ["show", "pre", "--layers", "0"],
        ["eval", str(tmp_path), "--limit", "abc"],
        ["eval", str(tmp_path), "--limit", "-1"],
    ]


def test_bad_input_is_one_line_with_exit_status_2(bad_inputs, capsys):
    for argv in bad_inputs:
        code = main(argv)
        out, err = capsys.readouterr()
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("normlab: warning")]
        assert code == 2, (argv, code, err)
        assert len(lines) == 1 and lines[0].startswith("normlab: error: "), (argv, err)
        assert "Traceback" not in err + out


def test_argparse_choices_and_version(capsys):
    with pytest.raises(SystemExit) as ex:
        main(["train", "--precision", "fp8"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "invalid choice: 'fp8'" in err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err  # one line, not argparse's whole usage
    with pytest.raises(SystemExit) as ex:
        main(["--version"])
    assert ex.value.code == 0 and capsys.readouterr().out.startswith("normlab 0.")


def test_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "normlab", "summarize", str(tmp_path / "nowhere")]
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env)
    debug = subprocess.run([*cmd[:3], "--debug", *cmd[3:]], capture_output=True, text=True, env=env)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert "Traceback" in debug.stderr and "ConfigError" in debug.stderr


# --- fuzzing ------------------------------------------------------------------------------------

def test_fuzz_layout_grammar_and_config_loader():
    rng = random.Random(1234)
    alphabet = "attnmlp=ABCSqkvc-,[]:0123456789.%emb final norm=rms layer inner=head full h=alpha deepnorm frozen-out"
    tokens = ["attn=", "mlp=", "A", "B", "C", "S", "q", "k", "v", "c", "-", ",", "[", "]", ":", "0", "1", "-1",
              "0.5", "25%", "emb", "final", "-emb", "qk", "norm=", "rms", "layer", "inner=", "h=", "alpha=",
              "deepnorm", "frozen-out", "init=", "peri", "pre", "post", "hybrid*", "none", "nan", "inf", "1e309"]
    for _ in range(600):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 8)))
        if rng.random() < 0.2:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        try:
            layout = parse_layout(text)
        except LayoutError:
            continue
        assert parse_layout(layout.to_string()) == layout
    keys = ["lr", "steps", "seed", "layout", "model.n_layers", "model.d_model", "layout.h", "beta1", "precision",
            "optim.lr", "run.out", "grad_clip", "min_lr", "model.mlp", "compile", "wd_exclude", "nope", "model.nope"]
    values = [0, 1, -1, 0.5, 1e300, float("nan"), float("inf"), True, False, None, "", "x", "peri", "1e-3", [1],
              {"a": 1}, 2**70, "none", "fp16"]
    for _ in range(1500):
        settings = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(1, 4))}
        for from_text in (False, True):
            vals = {k: (str(v) if from_text and not isinstance(v, (list, dict)) else v) for k, v in settings.items()}
            try:
                TrainConfig().with_(vals, "fuzz", from_text=from_text)
            except ConfigError:
                pass


# --- sweeps: kill -9 of the coordinator ------------------------------------------------------------

def _workers_of(root: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(root).encode() in cmd and any(b"PR_SET_PDEATHSIG" in c for c in cmd):
                pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the worker processes")
def test_kill_9_of_the_sweep_coordinator_takes_its_workers_and_nothing_runs_twice(corpus, tmp_path):
    root = tmp_path / "sw"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "normlab", "sweep", "--grid", "seed=0,1", "--set", "size=nano", "--set", "steps=400",
           "--set", f"data={corpus}", "--set", "seq_len=32", "--set", "batch_size=8", "--set", "eval_every=0",
           "--set", "probe_every=0", "--set", "ckpt_every=20", "--workers", "2", "--out", str(root)]
    def start_then_kill(ready) -> list[int]:  # noqa: ANN001
        coord = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and not (len(_workers_of(root)) == 2 and ready()):
            time.sleep(0.05)
        workers = _workers_of(root)
        assert len(workers) == 2
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        return workers

    def alive(pids: list[int]) -> list[int]:
        return [p for p in pids if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]

    # 1. killed while its workers are still importing torch: they must not live on
    workers = start_then_kill(lambda: True)
    time.sleep(4.0)  # longer than a worker's imports
    assert alive(workers) == []
    # 2. killed mid-training, after a checkpoint: the workers go with it, the rerun resumes
    workers = start_then_kill(lambda: bool(list((root / "runs").glob("*/checkpoints/step_*.pt"))))
    time.sleep(1.0)
    assert alive(workers) == []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    for run in (root / "runs").iterdir():
        assert [r["step"] for r in rows(run)] == list(range(400))  # resumed, each step once
