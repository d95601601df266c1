"""Resumable everything (issue 51, item 5): a folder written whole or not at all (an export killed with -9
leaves none, and the same command run again completes it, byte for byte), a rerun on a read-only mount is
one line and exit 2, and a library's warning never adds lines to a refusal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.cli import main
from normlab.errors import ConfigError, DataError
from normlab.io import MARKER, staged_folder, storage_refusal
from normlab.train import train
from tests.conftest import SENTENCES
from tests.helpers import small

STEPS = 2
PATIENCE_S = 900  # a bound on a child process, never a measurement: a passing test never waits this long


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step nano run of the pre layout (transformers' own Llama class exports it exactly), its
    corpus, and the settings it trained with (as `normlab train` flags: the same command run again)."""
    root = tmp_path_factory.mktemp("resumable")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NORMLAB_CACHE", str(root / "cache"))
        summary = train(small(corpus, root / "run", layout="pre", steps=STEPS, eval_every=0, probe_every=0))
    assert summary["status"] == "ok"
    flags = ["--data", str(corpus), "--size", "nano", "--layout", "pre", "--seq-len", "32", "--batch-size", "8"]
    flags += ["--steps", str(STEPS), "--lr", "3e-3", "--set", "eval_every=0", "--set", "probe_every=0"]
    flags += ["--set", "eval_batches=2", "--device", "cpu", "--no-progress"]
    return root / "run", corpus, flags


def files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included: the marker too) -> its SHA-256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def ended_pid() -> int:
    """The pid of a process that has ended (and been reaped): what a killed writer leaves in its staging name."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=PATIENCE_S)
    return proc.pid


# The export as `normlab export` runs it, killed with SIGKILL at a known point: after the weights and config are
# written into the staging folder, as the tokenizer's files are written (`normlab.hf.export.save_tokenizer`)
KILLED_EXPORT = """
import os, signal, sys
import normlab.hf.export as export

def killed(tokenizer, out):
    os.kill(os.getpid(), signal.SIGKILL)

export.save_tokenizer = killed
from normlab.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.long  # a second interpreter imports torch and transformers: 5-25 s on 2 busy cores
def test_an_export_killed_with_9_leaves_no_folder_and_the_rerun_completes_it_byte_for_byte(finished, tmp_path, capsys):
    """`normlab export` killed with SIGKILL mid-write leaves only its hidden staging folder; the same command
    then removes it and writes the folder whole, file for file what an export never interrupted writes; run a
    third time it answers the same and writes nothing."""
    run, _, _ = finished
    parent = tmp_path / "out"
    parent.mkdir()
    dest = parent / "exp"
    script = tmp_path / "killed_export.py"
    script.write_text(KILLED_EXPORT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "export", str(run), str(dest)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    _, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert not dest.exists()  # nothing, not a half-written folder the rerun would refuse
    (staging,) = [p for p in parent.iterdir()]
    assert staging.name.startswith(f".exp.{proc.pid}.") and staging.name.endswith(".tmp")
    assert (staging / "model.safetensors").is_file()  # killed mid-write, its weights written
    marker = json.loads((staging / MARKER).read_text())
    assert marker["kind"] == "export" and marker["staging"]["pid"] == proc.pid  # not finished: no weights' digest
    # folders that only look like a killed export's staging folder are never touched: a user's, another kind's
    lookalikes = {
        f".exp.{proc.pid}.abcdefgh.tmp": {"notes.txt": "the user's notes"},
        f".exp.{proc.pid}.ijklmnop.tmp": {MARKER: json.dumps({"kind": "scan"}), "table.md": "a scan's table"},
        f".exp.{proc.pid}.old": {"notes.txt": "the user's old notes"},
    }
    for name, held in lookalikes.items():
        (parent / name).mkdir()
        for file, text in held.items():
            (parent / name / file).write_text(text)
    capsys.readouterr()
    assert main(["export", str(run), str(dest)]) == 0  # the same command again: completes
    rerun = capsys.readouterr().out
    assert not staging.exists()  # recognised as the killed export's own, and removed
    assert sorted(p.name for p in parent.iterdir()) == sorted(["exp", *lookalikes])
    for name, held in lookalikes.items():
        assert {f: (parent / name / f).read_text() for f in held} == held
    reference = tmp_path / "reference"  # the same export, never interrupted
    assert main(["export", str(run), str(reference)]) == 0
    assert rerun.replace(str(dest), "DEST") == capsys.readouterr().out.replace(str(reference), "DEST")
    got = files(dest)
    assert got == files(reference)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER} <= set(got)
    # and once more: the finished export answers as before and writes nothing
    written = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    assert main(["export", str(run), str(dest)]) == 0
    assert capsys.readouterr().out == rerun and files(dest) == got
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == written


def test_a_write_killed_in_its_swap_gets_the_previous_copy_back_and_live_writers_are_left_alone(tmp_path):
    """Killed between moving the previous copy aside and moving the new one in: the next staged write of the
    folder puts the previous copy back first. Staging folders of a live writer, or of a writer on another host
    (which cannot be checked), are left where they are."""
    out = tmp_path / "rep"
    gone = ended_pid()
    previous = tmp_path / f".rep.{gone}.old"
    previous.mkdir()
    (previous / MARKER).write_text(json.dumps({"kind": "report"}))
    (previous / "index.html").write_text("the finished report")
    alive = tmp_path / f".rep.{os.getppid()}.abcdefgh.tmp"  # the process that started this test's: alive
    elsewhere = tmp_path / f".rep.{gone}.ijklmnop.tmp"
    for folder, host, pid in ((alive, socket.gethostname(), os.getppid()), (elsewhere, "another-host", gone)):
        folder.mkdir()
        (folder / MARKER).write_text(json.dumps({"kind": "report", "staging": {"host": host, "pid": pid}}))
        (folder / "index.html").write_text("being written")
    with pytest.raises(ConfigError, match="refused"), staged_folder(out, "report") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".rep.{os.getpid()}.")
        raise ConfigError("refused")  # the next write is refused: the previous copy is back all the same
    assert (out / "index.html").read_text() == "the finished report" and not previous.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rep", alive.name, elsewhere.name])
    with staged_folder(out, "report", {"runs": 1}) as tmp:
        (tmp / "index.html").write_text("the new report")
    assert (out / "index.html").read_text() == "the new report"
    assert json.loads((out / MARKER).read_text()) == {"kind": "report", "runs": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rep", alive.name, elsewhere.name])


def test_an_interrupted_data_prepare_leaves_no_folder_and_the_rerun_completes(tmp_path, monkeypatch):
    """`normlab data prepare` refuses a folder with files in it: a prepare stopped half-way must leave none (an
    exception: no folder; kill -9: only a staging folder, which the rerun removes)."""
    import normlab.data.prepare as prep

    source = tmp_path / "docs"
    source.mkdir()
    for i in range(6):
        (source / f"{i}.txt").write_text(f"document {i}: " + SENTENCES[i % len(SENTENCES)] * (3 + i))
    assert main(["data", "prepare", str(source), "--out", str(tmp_path / "reference")]) == 0
    real = prep._write_tokens

    def interrupted(path, *a, **k):
        written = real(path, *a, **k)
        if path.name == "val.bin":
            raise KeyboardInterrupt  # Ctrl-C, with train.bin and val.bin written
        return written

    monkeypatch.setattr(prep, "_write_tokens", interrupted)
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(source), "--out", str(out)]) == 130  # "normlab: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "reference"]
    monkeypatch.setattr(prep, "_write_tokens", real)
    killed = tmp_path / f".prepared.{ended_pid()}.abcdefgh.tmp"  # what kill -9 leaves
    killed.mkdir()
    (killed / MARKER).write_text(json.dumps({"kind": "data", "staging": {"host": socket.gethostname()}}))
    (killed / "train.bin").write_bytes(b"\x00" * 10)
    assert main(["data", "prepare", str(source), "--out", str(out)]) == 0
    assert files(out) == files(tmp_path / "reference")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "prepared", "reference"]
    assert main(["data", "prepare", str(source), "--out", str(out)]) == 2  # a finished folder: never overwritten


@pytest.fixture
def read_only(tmp_path):
    """``(src, ro)``: ``ro`` is ``src`` bind-mounted read-only (root cannot write there either, unlike a folder
    without write permission); unmounted afterwards whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    mounted = False

    def mount() -> Path:
        nonlocal mounted
        res = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"mount --bind -o ro failed: {res.stderr.strip()}")
        mounted = True
        return ro

    try:
        yield src, mount
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


def one_line(argv, capsys) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv, code, err[-1500:])
    return lines[0]


def test_reruns_on_a_read_only_mount_are_one_line_and_exit_2(finished, read_only, tmp_path, capsys):
    """A finished run, sweep and export on a read-only mount, run again (and every other command that writes a
    folder, pointed there): one line naming the folder and that it is read-only, exit 2; nothing changes. What
    needs no write still works: exporting from the mount to writable storage, and the finished export's rerun."""
    from normlab.experiments.runner import prepare
    from normlab.experiments.sweep import SweepConfig
    from normlab.io import own_folder

    run, corpus, flags = finished
    src, mount = read_only
    shutil.copytree(run, src / "run")
    assert main(["export", str(src / "run"), str(src / "exp")]) == 0
    sweep = src / "sweep"
    own_folder(sweep, "sweep")
    store, (spec,) = prepare(
        SweepConfig(name="s", base={"size": "nano", "steps": STEPS}, grid={"layout": ["pre"]}), sweep
    )
    store.mark_running(spec.run_id, "test")
    store.record(spec.run_id, json.loads((run / "summary.json").read_text()))
    (src / "docs").mkdir()
    for i in range(3):
        (src / "docs" / f"{i}.txt").write_text(SENTENCES[i])
    before = files(src)
    capsys.readouterr()
    ro = mount()
    for argv, folder in (
        (["train", *flags, "--out", ro / "run"], ro / "run"),
        (["sweep", ro / "sweep" / "sweep.toml", "--out", ro / "sweep"], ro / "sweep"),
        (["report", ro / "run"], ro),
        (["report", ro / "run", "--out", ro / "report"], ro),
        (["export", ro / "run", ro / "exp2"], ro),
        (["export", ro / "run", ro / "new" / "deeper"], ro),
        (["convert", ro / "run", "--layout", "peri", "--out", ro / "conv"], ro),
        (["eval", ro / "run"], ro / "run"),
        (["data", "prepare", ro / "docs", "--out", ro / "prepared"], ro),
        (["scan", ro / "exp"], ro / "exp"),
        (["doctor", ro / "exp", "--fp16-copy", ro / "fp16"], ro),
    ):
        line = one_line(argv, capsys)
        assert f"{folder} is on a read-only file system" in line and "nothing was written" in line, line
    # an OSError from a write no check foresaw (the command line's last guard): one line too, naming the folder
    with pytest.raises(OSError) as caught:
        (ro / "notes.txt").write_text("x")
    assert storage_refusal(caught.value) == (
        f"{ro} is on a read-only file system: writing {ro / 'notes.txt'} failed; "
        "give an output folder on writable storage"
    )
    assert files(src) == before
    # reading from the mount is fine, and the finished export's rerun writes nothing: the same answer
    assert main(["export", str(ro / "run"), str(tmp_path / "exp")]) == 0
    assert files(tmp_path / "exp") == files(src / "exp")
    capsys.readouterr()
    assert main(["export", str(ro / "run"), str(ro / "exp")]) == 0
    assert f"-> {ro / 'exp'} (llama:" in capsys.readouterr().out


def test_the_command_lines_last_guard_maps_storage_errors_to_one_line(read_only, capsys, monkeypatch):
    """An OSError a read-only mount raises where no command checked first: exit 2 and one line (not exit 1
    with the OSError's repr); any other OSError stays what it is, a defect, exit 1."""
    import errno

    import normlab.cli as cli

    src, mount = read_only
    ro = mount()
    monkeypatch.setattr(cli, "_layouts", lambda args: (ro / "table.md").write_text("x"))
    line = one_line(["layouts"], capsys)
    assert line == (
        f"normlab: error: {ro} is on a read-only file system: writing {ro / 'table.md'} failed; "
        "give an output folder on writable storage"
    )

    def broken(args):
        raise OSError(errno.EIO, "Input/output error", str(src / "x"))

    monkeypatch.setattr(cli, "_layouts", broken)
    assert main(["layouts"]) == 1
    assert "OSError" in capsys.readouterr().err


@pytest.fixture(scope="module")
def warned_folder(tmp_path_factory):
    """A nano Llama folder whose generation_config.json still passes continuous_batching_config through:
    transformers 5.24 raises a FutureWarning ("deprecated and will be removed in v5.19") when it loads the model."""
    import normlab
    from normlab.data.tokenizer import ByteTokenizer
    from normlab.hf import save_native
    from normlab.hf.tokenizer import to_hf_tokenizer

    folder = save_native(
        normlab.build_model("pre", "nano", seed=0),
        tmp_path_factory.mktemp("warned") / "llama",
        "llama",
        to_hf_tokenizer(ByteTokenizer(), 64),
    )
    config = json.loads((folder / "generation_config.json").read_text())
    config["continuous_batching_config"] = {"block_size": 16}
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


DEPRECATION = "Passing ContinuousBatchingConfig through GenerationConfig is deprecated"


def test_a_library_warning_never_adds_lines_to_a_refusal(warned_folder, tmp_path, capsys, recwarn, monkeypatch):
    """scan loads the model (transformers warns), then refuses a one-token text: one line on stderr and no
    warning shown; --debug shows the warning (it was raised, and held); a scan that succeeds shows it, once.
    (pytest records what the command line shows; outside pytest it is printed to stderr.)"""
    import transformers.utils.logging

    monkeypatch.setattr(transformers.utils.logging, "_tqdm_active", False)  # the weights' progress bar: not tested
    short = tmp_path / "short.txt"
    short.write_text("a")
    argv = ["scan", warned_folder, "--text-file", short, "--out", tmp_path / "scan"]
    line = one_line(argv, capsys)
    assert line.startswith("normlab: error: the sample texts gave 1 token(s)")
    assert not [w for w in recwarn if DEPRECATION in str(w.message)]
    assert not (tmp_path / "scan").exists()  # the scan folder is claimed only once every refusal is behind
    with pytest.raises(DataError, match="gave 1 token"):
        main(["--debug", *map(str, argv)])
    assert [w.category for w in recwarn if DEPRECATION in str(w.message)] == [FutureWarning]
    recwarn.clear()
    assert main(["scan", str(warned_folder), "--out", str(tmp_path / "ok")]) == 0
    assert [w.category for w in recwarn if DEPRECATION in str(w.message)] == [FutureWarning]
