"""Bad input is one clear line: every entry point checks settings through one declaration, typed
TOML and grid values, argparse's own errors, --debug, and a fuzz of the layout grammar and config loader."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys

import pytest
import torch

from normlab.cli import main
from normlab.errors import ConfigError
from normlab.experiments import SweepConfig
from normlab.layout import LayoutError, parse_layout
from normlab.model import build_model
from normlab.train import TrainConfig
from tests.helpers import REPO


def test_eval_limit_is_checked(tmp_path, capsys):
    for bad in ("abc", "-1", "0", "1.5"):
        assert main(["eval", str(tmp_path), "--limit", bad]) == 2
        assert "--limit" in capsys.readouterr().err


def test_probe_loss_is_the_model_loss_with_softcaps():
    from normlab.diagnostics.probes import Probes

    model = build_model("peri", "nano", seed=0, logit_softcap=2.0, attn_softcap=5.0)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    rows_ = Probes(model, (x, y)).record(0)
    probe_loss = next(r["value"] for r in rows_ if r["metric"] == "probe_loss")
    assert probe_loss == pytest.approx(model(x, targets=y).loss.item(), rel=1e-6)


def test_one_override_function_behind_every_entry_point(corpus, tmp_path):
    from normlab.cli import build_parser
    from normlab.config.overrides import train_config as train_config_from_args

    want = TrainConfig.of(layout="peri", lr=1e-3, **{"model.n_layers": 3, "layout.h": 0.5})
    assert want.model.layout.h == 0.5 and want.model.layout_label == "peri,h=0.5"
    assert parse_layout(want.model.layout_label) == want.model.layout  # the label reads back as the Layout
    args = build_parser().parse_args(
        ["train", "--set", "optim.lr=1e-3", "--set", "layout.h=0.5", "--model", "n_layers=3"]
    )
    assert train_config_from_args(args) == want
    toml = tmp_path / "c.toml"
    toml.write_text("lr = 0.001\n[model]\nn_layers = 3\n[layout]\nh = 0.5\n")
    assert TrainConfig.from_toml(toml) == want
    sweep = SweepConfig(
        name="one", base={"model.n_layers": 3, "layout": "peri"}, grid={"layout.h": [0.5], "lr": [1e-3]}
    )
    spec = sweep.expand()[0]
    assert spec.train_config("x").identity() == want.identity()
    assert TrainConfig.from_dict(want.to_dict()) == want  # the edge form round-trips


def test_grid_values_are_typed_by_their_setting():
    from normlab.config.overrides import grid_values as _grid_args

    grid = _grid_args(["layout=pre,none", "lr=1e-3,3e-3", "min_lr=none,1e-4", "model.n_layers=2,3"])
    assert grid == {"layout": ["pre", "none"], "lr": [1e-3, 3e-3], "min_lr": [None, 1e-4], "model.n_layers": [2, 3]}
    specs = SweepConfig(name="g", base={"size": "nano"}, grid={"layout": grid["layout"]}).expand()
    assert [s.config.model.layout_label for s in specs] == ["pre", "none"]
    for name in ("../escape", "a/b", ""):
        with pytest.raises(ConfigError, match="sweep name"):
            SweepConfig(name=name, grid={"lr": [1e-3]})


def test_toml_values_must_have_their_types(tmp_path):
    for text, needle in (
        ('weight_decay = "x"', "weight_decay: expected a number"),
        ("steps = true", "steps: expected an integer, got True"),
        ('compile = "no"', "compile: expected true or false"),
        ("lr = nan", "lr: expected a finite number"),
        ("[model]\nn_layers = 2.5", "model.n_layers: expected an integer"),
        ("[optim]\nlrr = 1.0", "unknown setting 'optim.lrr'"),
    ):
        p = tmp_path / "c.toml"
        p.write_text(text + "\n")
        with pytest.raises(ConfigError, match=needle.replace("(", "\\(").replace(")", "\\)")):
            TrainConfig.from_toml(p)


@pytest.fixture
def bad_inputs(corpus, tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("steps = true\n")
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
        [
            "train",
            "--data",
            "/dev/zero",
            "--size",
            "nano",
            "--steps",
            "2",
            "--no-progress",
            "--out",
            str(tmp_path / "z"),
        ],
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


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["summarize", str(tmp_path / "nowhere")]) == 2  # plain: one line, no traceback
    assert "Traceback" not in capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}  # --debug: the interpreter prints the traceback
    debug = subprocess.run(
        [sys.executable, "-m", "normlab", "--debug", "summarize", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_fuzz_layout_grammar_and_config_loader():
    rng = random.Random(1234)
    alphabet = "attnmlp=ABCSqkvc-,[]:0123456789.%emb final norm=rms layer inner=head full h=alpha deepnorm frozen-out"
    tokens = [
        "attn=",
        "mlp=",
        "A",
        "B",
        "C",
        "S",
        "q",
        "k",
        "v",
        "c",
        "-",
        ",",
        "[",
        "]",
        ":",
        "0",
        "1",
        "-1",
        "0.5",
        "25%",
        "emb",
        "final",
        "-emb",
        "qk",
        "norm=",
        "rms",
        "layer",
        "inner=",
        "h=",
        "alpha=",
        "deepnorm",
        "frozen-out",
        "init=",
        "peri",
        "pre",
        "post",
        "hybrid*",
        "none",
        "nan",
        "inf",
        "1e309",
    ]
    for _ in range(600):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 8)))
        if rng.random() < 0.2:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        try:
            layout = parse_layout(text)
        except LayoutError:
            continue
        assert parse_layout(layout.to_string()) == layout
    keys = [
        "lr",
        "steps",
        "seed",
        "layout",
        "model.n_layers",
        "model.d_model",
        "layout.h",
        "beta1",
        "precision",
        "optim.lr",
        "run.out",
        "grad_clip",
        "min_lr",
        "model.mlp",
        "compile",
        "wd_exclude",
        "nope",
        "model.nope",
    ]
    values = [
        0,
        1,
        -1,
        0.5,
        1e300,
        float("nan"),
        float("inf"),
        True,
        False,
        None,
        "",
        "x",
        "peri",
        "1e-3",
        [1],
        {"a": 1},
        2**70,
        "none",
        "fp16",
    ]
    for _ in range(1500):
        settings = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(1, 4))}
        for from_text in (False, True):
            vals = {k: (str(v) if from_text and not isinstance(v, (list, dict)) else v) for k, v in settings.items()}
            with contextlib.suppress(ConfigError):
                TrainConfig().with_(vals, "fuzz", from_text=from_text)


# the third adversarial pass (issue 35): crafted transformers folders, non-UTF-8 text, an over-long record


def _edit_json(name: str, **changes):
    import json

    def edit(folder):
        data = json.loads((folder / name).read_text())
        data.update(changes)
        (folder / name).write_text(json.dumps(data))

    return edit


def _safetensors_header(header: bytes):
    def edit(folder):
        body = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(header + body[len(header) :])

    return edit


def _no_unknown_token(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"the": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


DEEP = "nests its JSON deeper than 64 levels"
CRAFTED = {  # name: (edit of a good folder, what the one line says, which commands read that part)
    "config nested 100,000 deep": (
        lambda d: (d / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000),
        DEEP,
        "doctor scan init recommend",
    ),
    "generation config nested deep": (
        lambda d: (d / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000),
        DEEP,
        "doctor scan init",
    ),
    "model_type a list": (
        _edit_json("config.json", model_type=["llama"]),
        '"model_type" must be a string such as "llama"',
        "doctor scan init recommend",
    ),
    "hidden_size a string": (
        _edit_json("config.json", hidden_size="64"),
        "'hidden_size' expected int, got str",
        "doctor scan init",
    ),
    "safetensors header not JSON": (
        _safetensors_header(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"),
        "not a readable safetensors file",
        "doctor scan init",
    ),
    "safetensors header past the file": (
        _safetensors_header((2**62).to_bytes(8, "little")),
        "not a readable safetensors file",
        "doctor scan init",
    ),
    "binary tokenizer.json": (
        lambda d: (d / "tokenizer.json").write_bytes(bytes(range(256)) * 4),
        "tokenizer.json is not UTF-8 text",
        "doctor scan",
    ),
    "tokenizer.json of no known model": (
        lambda d: (d / "tokenizer.json").write_text('{"model": {"type": "Nope"}}'),
        "is not a Hugging Face tokenizer.json",
        "doctor scan",
    ),
    "tokenizer.json without its unknown token": (
        _no_unknown_token,
        "Missing [UNK] token from the vocabulary",
        "doctor scan",
    ),
}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A nano Llama folder with a tokenizer, as save_pretrained writes it: the base of the crafted ones."""
    from normlab.data.tokenizer import ByteTokenizer
    from normlab.hf import save_native
    from normlab.hf.tokenizer import to_hf_tokenizer

    return save_native(
        build_model("pre", "nano", seed=0),
        tmp_path_factory.mktemp("hf") / "llama",
        "llama",
        to_hf_tokenizer(ByteTokenizer(), 64),
    )


def refused(argv, needle, capsys) -> str:
    """``argv`` ends with exit status 2 and exactly one line on stderr that says ``needle``; no traceback."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, (argv, code, err[-800:])
    assert len(lines) == 1 and lines[0].startswith("normlab: error: ") and needle in lines[0], (argv, err[-800:])
    assert "Traceback" not in out + err and "weights_only" not in out + err
    return lines[0]


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_transformers_folder_is_one_line_in_every_reader(case, llama_folder, corpus, tmp_path, capsys):
    """One check of a transformers folder (`normlab.hf.folder`) before transformers reads it: doctor, scan,
    train --init-from and recommend refuse the same folder in the same words."""
    import shutil

    edit, needle, readers = CRAFTED[case]
    folder = tmp_path / "model"
    shutil.copytree(llama_folder, folder)
    edit(folder)
    argvs = {
        "doctor": ["doctor", folder],
        "scan": ["scan", folder, "--out", tmp_path / "scan"],
        "init": [
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
        "recommend": ["recommend", folder / "config.json", "--out", tmp_path / "rec"],
    }
    for reader in readers.split():
        refused(argvs[reader], needle, capsys)
    assert not (tmp_path / "scan").exists()  # the folder is checked before scan claims its output


def test_the_same_tokenizer_rule_in_doctor_scan_and_train(llama_folder, corpus, tmp_path, capsys):
    """`data.tokenizer.read_tokenizer_json` is the one rule: --tokenizer refuses what doctor and scan refuse."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(llama_folder, folder)
    _no_unknown_token(folder)
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
            "--tokenizer",
            folder / "tokenizer.json",
            "--out",
            tmp_path / "t",
        ],
    ):
        refused(argv, "Missing [UNK] token from the vocabulary", capsys)


def test_non_utf8_text_is_one_line_in_data_prepare_with_a_bpe(tmp_path, capsys):
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_text("hello world\n" * 20)
    (latin / "b.txt").write_bytes(b"caf\xe9 au lait\n" * 20)
    for tok in ("bytes", "bpe:300"):
        refused(
            ["data", "prepare", latin, "--tokenizer", tok, "--out", tmp_path / f"prep-{tok[:3]}"],
            "b.txt is not UTF-8 text (invalid byte at offset 3)",
            capsys,
        )
        assert not (tmp_path / f"prep-{tok[:3]}").exists()


def test_a_record_longer_than_the_limit_is_refused_unread(corpus, tmp_path, capsys, monkeypatch):
    """A JSONL file is streamed: a record over io.MAX_RECORD_BYTES (here 1 KiB) is refused with its line number
    and the limit, as soon as that many bytes are read (a 300 MB line is never loaded whole)."""
    import json

    import normlab.io

    monkeypatch.setattr(normlab.io, "MAX_RECORD_BYTES", 1024)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"text": "ok " * 100}) + "\n" for _ in range(5)) + json.dumps({"text": "x" * 2000}) + "\n"
    )
    sft = tmp_path / "s.jsonl"
    sft.write_text(
        json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "a" * 2000, "response": "b"})
    )
    common = ["--size", "nano", "--steps", "1", "--no-progress", "--seq-len", "16"]
    refused(
        ["train", "--data", data, *common, "--out", tmp_path / "o"],
        "d.jsonl line 6 is longer than 1,024 bytes, the most one record may hold",
        capsys,
    )
    refused(
        ["train", "--data", sft, "--task", "sft", *common, "--out", tmp_path / "s"],
        "s.jsonl line 2 is longer than 1,024 bytes",
        capsys,
    )


def test_plan_never_builds_what_it_plans(capsys, monkeypatch):
    """`normlab plan` on a 10,000-layer model of width 131,072 answers from the shape: the activations
    are measured on two narrower copies and extrapolated (linear in the widths, so exact: the same bytes
    as measured on the model itself where that fits). What it built is counted, not timed."""
    from normlab.model import build as build_mod
    from normlab.train import memory

    built: list[int] = []
    real = build_mod.build_model

    def counted(*a, **k):
        model = real(*a, **k)
        built.append(sum(p.numel() for p in model.parameters()))
        return model

    monkeypatch.setattr(build_mod, "build_model", counted)
    assert main(["plan", "--set", "model.n_layers=10000", "--set", "model.d_model=131072"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "GiB" in out
    assert built and max(built) <= memory.PROBE_PARAMS  # narrow two-layer copies only, never the planned model
    monkeypatch.setattr(build_mod, "build_model", real)
    for layout in ("pre", "peri"):
        cfg = TrainConfig.of(size="tiny", layout=layout, **{"model.d_model": 512, "model.n_heads": 8})
        direct = memory.plan_memory(cfg).activations
        monkeypatch.setattr(memory, "PROBE_PARAMS", 600_000)  # its two-layer copy (1.6M) is now too large
        assert memory.plan_memory(cfg).activations == direct
        monkeypatch.setattr(memory, "PROBE_PARAMS", 64 * 2**20)


# issue 63 items 18-19: settings that would make a command measure something else than it says


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["recommend", "nano", "--set", "run.fault=lr_jump"], "--set run.fault=...: recommend measures runs"),
        (["recommend", "nano", "--set", "fault_scale=3"], "--set fault_scale=...: recommend"),
        (["recommend", "nano", "--set", "run.fault_step=3"], "inject a fault on purpose"),
        (["coordcheck", "pre", "--set", "run.fault=corrupt_batch"], "--set run.fault=...: coordcheck measures runs"),
        (
            ["coordcheck", "pre", "--set", "model.d_model=64"],
            "coordcheck sets each run's width (d_model) from --widths",
        ),
        (
            ["train", "--size", "nano", "--set", "model.parametrization=mup", "--set", "model.base_d_model=4096"],
            "base_d_model=4096 is more than 4x wider than the model (d_model=32)",
        ),
        (
            ["train", "--size", "nano", "--set", "model.parametrization=completep", "--set", "model.base_n_layers=64"],
            "base_n_layers=64 is deeper than the model (n_layers=2)",
        ),
        (
            ["train", "--size", "nano", "--layout", "hybrid", "--set", "model.parametrization=completep"],
            "does not combine with a normed skip (HybridNorm's",
        ),
    ],
)
def test_faults_and_parametrizations_out_of_range_are_refused_before_anything_is_written(
    argv, needle, tmp_path, capsys
):
    out = tmp_path / "out"
    refused([*argv, "--out", out], needle, capsys)
    assert not out.exists()


def test_a_fault_from_a_config_file_is_said_at_the_start_and_in_the_summary(corpus, tmp_path, capsys):
    """run.fault in a config file (not on the command line) still reaches the terminal's first line, the
    one-line outcome and summary.json."""
    import json

    config = tmp_path / "f.toml"
    config.write_text('[run]\nfault = "corrupt_batch"\nfault_step = 1\nfault_scale = 1.0\n')
    out = tmp_path / "run"
    argv = ["train", "--config", config, "--data", corpus, "--size", "nano", "--steps", "2", "--no-progress"]
    assert main([str(a) for a in [*argv, "--set", "eval_every=0", "--out", out]]) == 0
    said = capsys.readouterr().out.splitlines()
    words = "corrupt_batch from step 1: 1 step(s) of batches of one repeated token"
    assert said[0] == f"normlab train: FAULT INJECTED: {words} (run.fault, injected on purpose)"
    assert f"FAULT INJECTED: {words}" in said[-1] and said[-1].startswith(f"{out}: ok; ")
    fault = json.loads((out / "summary.json").read_text())["fault"]
    assert (fault["fault"], fault["fault_step"], fault["fault_scale"]) == ("corrupt_batch", 1, 1.0)
    clean = tmp_path / "clean"
    assert (
        main(["train", "--data", str(corpus), "--size", "nano", "--steps", "1", "--no-progress", "--out", str(clean)])
        == 0
    )
    assert "FAULT" not in capsys.readouterr().out and json.loads((clean / "summary.json").read_text())["fault"] is None
