"""Foreign code and crafted files are refused, never run: pickled checkpoints (one file and DCP),
remote model code, crafted sweep stores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab.cli import main
from normlab.experiments import SweepConfig
from normlab.model import build_model
from normlab.runs.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from normlab.train import train
from tests.helpers import PATIENCE_S, REPO, export_nano, small


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


def test_a_malicious_checkpoint_is_refused_and_never_executes(corpus, tmp_path, capsys):
    marker = tmp_path / "pwned"
    bad = evil_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError, match="could run code"):
        load_checkpoint(bad)
    # through every door: export, --init-from, and resume of a run whose newest checkpoint is evil
    assert main(["export", str(bad), str(tmp_path / "exp")]) == 2
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--size",
                "nano",
                "--steps",
                "2",
                "--seq-len",
                "16",
                "--batch-size",
                "4",
                "--init-from",
                str(bad),
                "--out",
                str(tmp_path / "ft"),
                "--no-progress",
            ]
        )
        == 2
    )
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
    assert isinstance(ckpt["rng"]["numpy"]["keys"], torch.Tensor) and ckpt["config"]["optim"]["steps"] == 2


def test_eval_runs_only_the_model_code_normlab_wrote(tmp_path, capsys):
    """An export's modeling_normlab.py runs on load (trust_remote_code): only if it is what this normlab
    writes. An edited one, or a foreign folder whose auto_map names its own module, is refused."""
    from normlab.evaluation.harness import remote_code

    export = export_nano(tmp_path)
    assert remote_code(export) is True  # normlab's own bundle, verified byte for byte
    marker = tmp_path / "pwned"
    bundled = export / "modeling_normlab.py"
    bundled.write_text(bundled.read_text() + f"\nimport os; os.system('touch {marker}')\n")
    assert main(["eval", str(export), "--limit", "2"]) == 2
    assert "differs from what this normlab writes" in capsys.readouterr().err and not marker.exists()
    assert remote_code(export, trust=True) is True  # the user's explicit decision
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(
        json.dumps({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "evil.EvilForCausalLM"}})
    )
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
    (foreign / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evilarch",
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
            }
        )
    )
    (foreign / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    (foreign / "evil.py").write_text(f"import os; os.system('touch {marker}')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for argv in (
        ["scan", str(foreign)],
        [
            "train",
            "--data",
            str(corpus),
            "--size",
            "nano",
            "--steps",
            "1",
            "--init-from",
            str(foreign),
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "normlab", *argv],
            input="y\ny\n",
            capture_output=True,
            text=True,
            env=env,
            timeout=PATIENCE_S,
        )
        assert res.returncode == 2 and "Do you wish" not in res.stdout + res.stderr, res.stderr[-500:]
        assert len(res.stderr.strip().splitlines()) == 1
        # normlab's refusal, from the folder's config.json, before transformers is imported
        assert "names model code of its own (evil.py)" in res.stderr, res.stderr
    assert not marker.exists()


def test_run_ids_from_a_store_never_leave_the_sweep(corpus, tmp_path, capsys):
    import sqlite3

    from normlab.experiments.runner import run_sweep

    sweep = SweepConfig(
        name="t",
        base={
            "data": str(corpus),
            "size": "nano",
            "seq_len": 16,
            "batch_size": 4,
            "steps": 2,
            "eval_every": 0,
            "eval_batches": 1,
            "probe_every": 0,
            "device": "cpu",
        },
        grid={"layout": ["pre"]},
    )
    root = tmp_path / "sw"
    run_sweep(sweep, root, workers=1, log=lambda *a: None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with sqlite3.connect(root / "sweep.db") as con:
        con.execute("update runs set run_id = '../../elsewhere'")
    for argv in (
        ["summarize", str(root)],
        ["eval", str(root), "--limit", "2"],
        ["sweep", str(root / "sweep.toml"), "--out", str(root)],
    ):
        assert main(argv) == 2, argv
        assert "invalid run id '../../elsewhere'" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []


def test_crafted_store_rows_are_one_line_errors(corpus, tmp_path, capsys):
    import shutil
    import sqlite3

    from normlab.experiments.runner import run_sweep

    sweep = SweepConfig(
        name="t",
        base={
            "data": str(corpus),
            "size": "nano",
            "seq_len": 16,
            "batch_size": 4,
            "steps": 2,
            "eval_every": 0,
            "eval_batches": 1,
            "probe_every": 0,
            "device": "cpu",
        },
        grid={"layout": ["pre"]},
    )
    run_sweep(sweep, tmp_path / "sw", workers=1, log=lambda *a: None)
    for i, change in enumerate(("axes = '\"x\"'", "config = '[1]'", "axes = '{bad'", "status = 'weird'")):
        root = tmp_path / f"c{i}"
        shutil.copytree(tmp_path / "sw", root)
        with sqlite3.connect(root / "sweep.db") as con:
            con.execute(f"update runs set {change}")
        for argv in (["summarize", str(root)], ["report", str(root)]):
            assert main(argv) == 2, (change, argv)
            assert "has an unreadable row" in capsys.readouterr().err


# the third adversarial pass (issue 35)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A nano Llama folder with a tokenizer, as save_pretrained writes it."""
    from normlab.data.tokenizer import ByteTokenizer
    from normlab.hf import save_native
    from normlab.hf.tokenizer import to_hf_tokenizer

    return save_native(
        build_model("pre", "nano", seed=0),
        tmp_path_factory.mktemp("hf") / "llama",
        "llama",
        to_hf_tokenizer(ByteTokenizer(), 64),
    )


def one_line_refusal(argv, needle, capsys, after_work: bool = False) -> None:
    """Exit status 2 and one line that says ``needle``; ``after_work``: a refusal after the model was loaded and
    checked, whose progress bars and findings came first, so the line is the last and the only error."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    lines = lines[-1:] if after_work and sum(x.startswith("normlab: error:") for x in lines) == 1 else lines
    assert code == 2 and len(lines) == 1 and needle in lines[0], (argv, code, err[-800:])
    assert "Traceback" not in out + err and "weights_only" not in out + err and "arbitrary code" not in out + err


def test_a_pickled_weight_file_is_refused_without_torchs_advice(llama_folder, corpus, tmp_path, capsys):
    """transformers reads a pytorch_model.bin weights-only; the refusal is normlab's one line, naming the
    refused global, never torch's advice to re-run with weights_only=False; the payload never runs."""
    import shutil

    marker = tmp_path / "pwned"
    folder = tmp_path / "evil"
    shutil.copytree(llama_folder, folder)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": Evil(marker)}, folder / "pytorch_model.bin")
    for argv in (
        ["doctor", folder],
        ["scan", folder, "--out", tmp_path / "scan"],
        [
            "train",
            "--data",
            corpus,
            "--size",
            "nano",
            "--steps",
            "1",
            "--no-progress",
            "--init-from",
            folder,
            "--out",
            tmp_path / "ft",
        ],
    ):
        one_line_refusal(argv, "posix.system", capsys)
    assert not marker.exists()


def test_the_unsafe_advice_never_reaches_the_last_line_of_defence(monkeypatch, capsys):
    """Even an error nobody mapped is printed without torch's advice (cli._one_line)."""
    import argparse

    import normlab.cli as cli

    def boom(args):
        raise RuntimeError(
            "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will "
            "likely succeed, but it can result in arbitrary code execution. Do it only if you got the "
            "file from a trusted source. Unsupported global: GLOBAL posix.system"
        )

    monkeypatch.setattr(cli, "_boom", boom, raising=False)  # the handler of a command "boom" (cli.main: `_<command>`)
    monkeypatch.setattr(
        cli,
        "build_parser",
        lambda: type("P", (), {"parse_args": lambda self, a: argparse.Namespace(command="boom", debug=False)})(),
    )
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert "posix.system" in err and "weights_only" not in err and "arbitrary code" not in err


def test_a_tokenizer_naming_its_own_code_is_refused_by_doctor_and_scan(llama_folder, tmp_path, capsys):
    import shutil

    marker = tmp_path / "pwned"
    folder = tmp_path / "evil"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import os; os.system('touch {marker}')\n")
    for argv in (["doctor", folder], ["scan", folder, "--out", tmp_path / "scan"]):
        one_line_refusal(argv, "names tokenizer code of its own (auto_map", capsys)
    assert not marker.exists() and not (tmp_path / "scan").exists()


def test_doctor_never_writes_its_copy_into_a_users_folder(llama_folder, tmp_path, capsys):
    """--fp16-copy into a folder holding someone's config.json and model.safetensors is refused, as the run
    source's copy is: nothing there changes."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama", "mine": true}')
    (mine / "model.safetensors").write_bytes(b"my weights")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    one_line_refusal(["doctor", llama_folder, "--fp16-copy", mine], "holds files normlab did not write", capsys)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before


@pytest.mark.parametrize("failure", ["safetensors", "oserror"])
def test_a_full_disk_during_the_fp16_copy_leaves_nothing_half_written(
    failure, llama_folder, tmp_path, capsys, monkeypatch
):
    """The copy is written into a hidden sibling and moved into place once whole (io.staged_folder): a disk
    that fills while model.safetensors is half written is one line, exit 2; a new folder is not left behind,
    and an earlier complete copy stays as it was."""
    import errno

    import transformers.modeling_utils
    from safetensors import SafetensorError

    copy = tmp_path / "copy"
    assert main(["doctor", str(llama_folder), "--fp16-copy", str(copy)]) == 0
    first = {p.name: p.read_bytes() for p in copy.iterdir()}
    assert {"config.json", "model.safetensors", ".normlab"} <= set(first)
    capsys.readouterr()
    real = transformers.modeling_utils.safe_save_file

    def full_disk(tensors, filename, *a, **k):
        real(tensors, filename, *a, **k)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])  # the disk filled mid-file
        if failure == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    for out in (tmp_path / "new", copy):
        one_line_refusal(
            ["doctor", llama_folder, "--fp16-copy", out], "No space left on device", capsys, after_work=True
        )
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no staging folder left beside it


def test_a_leftover_auto_map_on_a_shipped_model_type_loads_the_stock_class_and_runs_nothing(
    llama_folder, tmp_path, capsys
):
    """Hub snapshots of Phi-3 or Falcon keep an ``auto_map`` beside a model_type transformers ships: the
    stock class loads (trust_remote_code=False) and the folder's code never runs; the same auto_map on a
    model_type transformers does not ship is refused from config.json alone."""
    import shutil

    marker = tmp_path / "pwned"
    folder = tmp_path / "leftover"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import os; os.system('touch {marker}')\n")
    assert main(["scan", str(folder), "--out", str(tmp_path / "scan")]) == 0
    assert (tmp_path / "scan" / "scan.json").is_file() and not marker.exists()
    capsys.readouterr()  # the scan's own progress lines
    config["model_type"] = "evilarch"
    (folder / "config.json").write_text(json.dumps(config))
    one_line_refusal(["scan", folder, "--out", tmp_path / "scan2"], "which transformers does not ship", capsys)
    assert not marker.exists() and not (tmp_path / "scan2").exists()


# the fifth pass (issue 63 item 17): leadtime's and transfer's output files, damaged inputs, doctor's weights


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    """A finished sweep of layout x lr x seed (what both leadtime and transfer read), 4 nano runs of 3 steps."""
    from normlab.experiments.runner import run_sweep
    from tests.conftest import SENTENCES

    root = tmp_path_factory.mktemp("sweep")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)))
    base = {"data": str(corpus), "size": "nano", "seq_len": 16, "batch_size": 4, "steps": 3, "eval_every": 0}
    sweep = SweepConfig(
        name="t",
        base={**base, "eval_batches": 1, "probe_every": 0, "device": "cpu"},
        grid={"layout": ["pre", "peri"], "lr": [1e-3, 3e-3], "seed": [0]},
    )
    run_sweep(sweep, root / "sw", workers=1, log=lambda *a: None)
    return root / "sw"


def test_leadtime_writes_only_a_new_json_file_and_reads_damaged_sweeps(small_sweep, tmp_path, capsys):
    """--json: an existing file, a link (to a file, or dangling) and a file in a missing folder are refused in one
    line before any work, nothing written or made; a new file is written, and the same command writes its own
    file again. A hand-edited metrics.jsonl row is
    skipped and said; a 0-byte sweep.db is rebuilt from the run folders, as summarize does, not read as 0 runs."""
    import shutil

    mine = tmp_path / "mine.json"
    mine.write_text("my notes\n")
    (tmp_path / "link.json").symlink_to(mine)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "gone.json")
    for name, needle in (
        ("mine.json", "mine.json exists; name a new file"),
        ("link.json", "link.json is a symbolic link"),
        ("dangling.json", "dangling.json is a symbolic link"),
        ("nodir/x.json", "the folder " + str(tmp_path / "nodir") + " does not exist"),
    ):
        one_line_refusal(["leadtime", small_sweep, "--json", tmp_path / name], needle, capsys)
    assert mine.read_text() == "my notes\n" and not (tmp_path / "gone.json").exists()
    assert not (tmp_path / "nodir").exists()
    assert main(["leadtime", str(small_sweep), "--json", str(tmp_path / "new.json")]) == 0
    assert capsys.readouterr().out.startswith("4 runs (0 faulted: none; 4 healthy), 0 events")
    first = (tmp_path / "new.json").read_text()
    assert len(json.loads(first)["runs"]) == 4
    capsys.readouterr()
    assert main(["leadtime", str(small_sweep), "--json", str(tmp_path / "new.json")]) == 0  # its own file: again
    assert (tmp_path / "new.json").read_text() == first  # the same command, the same answer

    damaged = tmp_path / "damaged"
    shutil.copytree(small_sweep, damaged)
    run = sorted((damaged / "runs").iterdir())[0]
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": "x", "loss": "abc"}\n{"step": 1, "loss": [1]}\n')
    assert main(["leadtime", str(damaged)]) == 0
    out = capsys.readouterr().out
    assert f"skipped 2 unreadable row(s) of metrics.jsonl in {run.name} (2)" in out

    (damaged / "sweep.db").write_bytes(b"")
    assert main(["leadtime", str(damaged)]) == 0
    assert capsys.readouterr().out.startswith("4 runs (")


def test_transfer_record_is_never_written_into_a_folder_it_did_not_make(small_sweep, tmp_path, capsys):
    record = tmp_path / "missing" / "dir" / "x.json"
    one_line_refusal(["transfer", small_sweep, small_sweep, "--record", record], "does not exist", capsys)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    one_line_refusal(["transfer", small_sweep, small_sweep, "--record", tmp_path / "link.json"], "link", capsys)
    assert not (tmp_path / "elsewhere.json").exists()


@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="needs root to mount read-only")
def test_transfer_and_leadtime_read_sweeps_on_read_only_storage(small_sweep, tmp_path):
    import shutil as sh

    sw = tmp_path / "sw"
    sh.copytree(small_sweep, sw)
    listing = sorted(str(p.relative_to(sw)) for p in sw.rglob("*"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    script = (
        f"mount --bind {sw} {sw} && mount -o remount,bind,ro {sw} && "
        f"{sys.executable} -m normlab transfer {sw} {sw}; a=$?; "
        f"{sys.executable} -m normlab leadtime {sw}; echo codes $a $?"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=PATIENCE_S
    )
    assert "codes 0 0" in proc.stdout, proc.stdout + proc.stderr
    assert "4 runs (" in proc.stdout
    assert sorted(str(p.relative_to(sw)) for p in sw.rglob("*")) == listing  # nothing written into the sweep


def test_doctor_on_a_normlab_config_over_other_weights_is_one_line(llama_folder, tmp_path, capsys):
    """A folder whose config.json is normlab's class but whose model.safetensors is a Llama's (other names), or a
    wider normlab model's (other shapes): one line, exit 2, after nothing but the refusal (transformers' load
    report silenced); the folder's own weights load."""
    import shutil

    from normlab.hf.export import save_hf

    ours = save_hf(build_model("peri", "nano", seed=0), tmp_path / "ours")
    wider = save_hf(build_model("peri", "nano", seed=0, d_model=64), tmp_path / "wider")
    capsys.readouterr()  # the saves' progress bars
    for name, weights, needle in (
        ("llama", Path(llama_folder) / "model.safetensors", "unexpected (e.g. model.embed_tokens.weight)"),
        ("shapes", wider / "model.safetensors", "mismatched (e.g. normlab.blocks.0."),
    ):
        mixed = tmp_path / name
        shutil.copytree(ours, mixed)
        shutil.copy(weights, mixed / "model.safetensors")
        one_line_refusal(["doctor", mixed], "its weights are not the model its config.json describes", capsys)
        assert main(["doctor", str(mixed)]) == 2 and needle in capsys.readouterr().err
    assert main(["doctor", str(ours)]) == 0
