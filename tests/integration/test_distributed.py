"""torchrun on CPU (gloo): DDP and FSDP2 train on exactly what one process would, and resume."""

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
from normlab.runs.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, load_model_state
from normlab.train import TrainConfig, train
from tests.helpers import PATIENCE_S

REPO = Path(__file__).resolve().parents[2]
COMMON = dict(
    size="nano",
    seq_len=32,
    batch_size=8,
    steps=6,
    eval_every=3,
    eval_batches=2,
    progress=False,
    ckpt_every=3,
    keep_last=5,
    device="cpu",
)


def torchrun(cfg: TrainConfig, nproc: int = 2) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "normlab",
        "train",
        *cfg.to_args(),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PATIENCE_S)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def assert_same_probes(a, b, rel=1e-5, abs_=1e-6) -> int:
    """Every probe row of run ``b`` equals run ``a``'s (same keys, values within float32 rounding); returns
    the number of rows compared and the largest relative difference seen."""

    def rows(run):
        lines = (Path(run) / "probes.jsonl").read_text().splitlines()
        return {(r["step"], r["layer"], r["site"], r["metric"]): r["value"] for r in map(json.loads, lines)}

    ra, rb = rows(a), rows(b)
    assert ra and set(ra) == set(rb), sorted(set(ra) ^ set(rb))[:10]
    worst = 0.0
    for key, v in ra.items():
        assert rb[key] == pytest.approx(v, rel=rel, abs=abs_), key
        if v:
            worst = max(worst, abs(rb[key] - v) / abs(v))
    return len(ra), worst


def assert_same_curve(a, b, tol=1e-5):
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert x["loss"] == pytest.approx(y["loss"], abs=tol), x["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4), x["step"]
        assert x.get("val_loss", 0.0) == pytest.approx(y.get("val_loss", 0.0), abs=tol), x["step"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    corpus = root / "c.txt"
    corpus.write_text("\n".join(["To be, or not to be, that is the question.", "The quick brown fox."] * 400))
    os.environ.setdefault("NORMLAB_CACHE", str(root / "cache"))
    cfg = TrainConfig.of(data=str(corpus), out=str(root / "single"), **COMMON)
    train(cfg)
    return cfg, root


@pytest.mark.long
def test_ddp_matches_single_process(single):
    cfg, root = single
    # the default checkpoint interval: the ranks agree on it after each save (an all-reduce, ckpt_schedule)
    ddp = TrainConfig.of(**{**cfg.to_flat(), "out": str(root / "ddp"), "grad_accum": 2, "ckpt_every": 0})
    torchrun(ddp)
    assert_same_curve(cfg.run.out, ddp.run.out)
    assert_same_probes(cfg.run.out, ddp.run.out)  # rank 0 probes the unwrapped model
    assert json.loads((root / "ddp" / "config.json").read_text())["world_size"] == 2
    assert [p.name for p in list_checkpoints(ddp.run.out)] == ["step_00000006.pt"]  # 6 steps: the final one


@pytest.mark.long
def test_fsdp2_matches_single_process_and_resumes_exactly(single):
    cfg, root = single
    fsdp = TrainConfig.of(**{**cfg.to_flat(), "out": str(root / "fsdp"), "fsdp": True})
    torchrun(fsdp)
    assert_same_curve(cfg.run.out, fsdp.run.out)
    # probes from the DTensor shards (reduced per shard, scalars all-reduced; the weight gradients from each
    # matrix's input and output gradient): every row of step 0 and of the end equals the single process's
    n, worst = assert_same_probes(cfg.run.out, fsdp.run.out)
    assert n > 300 and worst < 1e-6, worst  # 3.2e-7 measured: the weight gradients formed as G^T X
    before = metrics(fsdp.run.out)
    # sharded checkpoints (torch.distributed.checkpoint): one folder a step, a shard file per rank
    ckpts = list_checkpoints(fsdp.run.out)
    assert [p.name for p in ckpts] == ["step_00000003.dcp", "step_00000006.dcp"]
    assert sorted(p.name for p in ckpts[-1].iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((Path(fsdp.run.out) / "checkpoints").glob(".*"))  # no temp folders left
    # every file of a sharded checkpoint has its SHA-256 in checksums.json: a flipped bit is caught
    sums = json.loads((ckpts[-1] / "checksums.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt"} <= set(sums)
    flipped = root / "flipped" / ckpts[-1].name
    shutil.copytree(ckpts[-1], flipped)
    data = bytearray((flipped / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (flipped / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        load_checkpoint(flipped)
    # A run killed after its step-3 checkpoint (the final checkpoint and the summary never written):
    # the next launch resumes from step 3 and replays steps 3-5.
    shutil.rmtree(ckpts[-1])
    (Path(fsdp.run.out) / "summary.json").unlink()
    shutil.copytree(fsdp.run.out, root / "fsdp-copy")
    torchrun(fsdp)
    after = metrics(fsdp.run.out)
    assert [r["loss"] for r in after] == [r["loss"] for r in before]
    assert [p.name for p in list_checkpoints(fsdp.run.out)] == ["step_00000003.dcp", "step_00000006.dcp"]

    # A different world size: the 2-rank checkpoint of step 3 resumed by one process (DCP reshards).
    one = TrainConfig.of(**{**fsdp.to_flat(), "out": str(root / "fsdp-copy")})
    assert train(one)["status"] == "ok"
    assert_same_curve(cfg.run.out, one.run.out)

    # The weights of a sharded checkpoint, whole, in one process (export, --init-from)
    weights = load_model_state(list_checkpoints(fsdp.run.out)[-1])
    single_final = load_checkpoint(list_checkpoints(cfg.run.out)[-1])["model"]
    assert set(weights) == set(single_final)
    for k, v in single_final.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-6, msg=k)
    assert main(["export", fsdp.run.out, str(root / "export")]) == 0
    assert (root / "export" / "model.safetensors").is_file()


# FSDP2 against one process: test_fsdp2_matches_single_process_...; MoE training: tests/unit/test_moe.py
@pytest.mark.slow
def test_moe_under_fsdp2_matches_single_process(single):
    """Routed experts under FSDP2 (the stacked expert weights sharded with their block) and under DDP
    (every stacked expert weight takes part in every step, so no parameter goes unused), 2 ranks."""
    cfg, root = single
    base = {**cfg.to_flat(), "size": "moe-micro", "steps": 4, "eval_every": 2, "probe_every": 0}
    one = TrainConfig.of(**{**base, "out": str(root / "moe-single")})
    train(one)
    for name, extra in (("moe-fsdp", {"fsdp": True}), ("moe-ddp", {})):
        run = TrainConfig.of(**{**base, **extra, "out": str(root / name)})
        torchrun(run)
        a, b = metrics(one.run.out), metrics(run.run.out)
        assert [r["step"] for r in a] == [r["step"] for r in b]
        # The balance loss E sum_e f_e P_e is computed on each rank's tokens (as OLMoE computes it per
        # micro-batch), and a product of means is not the mean of products: the curves agree closely,
        # not exactly. The first step's language-model loss (same weights, same tokens) is exact.
        assert b[0]["loss"] == pytest.approx(a[0]["loss"], abs=1e-5)
        for x, y in zip(a, b):
            assert y["loss"] == pytest.approx(x["loss"], abs=5e-3)
            assert y["moe_aux_loss"] == pytest.approx(x["moe_aux_loss"], rel=0.05)


@pytest.mark.slow  # checkpointing + chunked loss + bf16 in one process: test_memory.py; FSDP2: the test above
def test_fsdp2_with_activation_checkpointing_chunked_loss_and_bf16(single):
    """The large-model settings together under FSDP2 follow the plain one-process bf16 curve."""
    cfg, root = single
    base = {**cfg.to_flat(), "precision": "bf16", "probe_every": 0}
    one = TrainConfig.of(**{**base, "out": str(root / "bf16-single")})
    train(one)
    lean = TrainConfig.of(
        **{
            **base,
            "out": str(root / "bf16-fsdp-lean"),
            "fsdp": True,
            "activation_checkpointing": True,
            "loss_chunk": 32,
        }
    )
    torchrun(lean)
    for x, y in zip(metrics(one.run.out), metrics(lean.run.out)):
        assert y["loss"] == pytest.approx(x["loss"], abs=2e-3)


@pytest.mark.slow  # quick: DDP equals one process (above); one process's overflow forensics (test_fp16_storage)
def test_ddp_run_that_overflows_fp16_records_where_it_broke(single):
    """Each rank re-runs its share of the failing batch; the first rank that broke is reported, and the
    site is the one a single process finds on the same data."""
    cfg, root = single
    base = {
        **cfg.to_flat(),
        "layout": "pre",
        "activation_dtype": "fp16",
        "probe_every": 0,
        "model.init_std": 3000.0,
        "model.init": "normal",
    }
    one = TrainConfig.of(**{**base, "out": str(root / "fp16-single")})
    two = TrainConfig.of(**{**base, "out": str(root / "fp16-ddp")})
    s1 = train(one)
    torchrun(two)
    s2 = json.loads((Path(two.run.out) / "summary.json").read_text())
    assert s1["status"] == s2["status"] == "diverged" and s1["diverged_step"] == s2["diverged_step"] == 0
    assert s2["forensics"]["rank"] in (0, 1) and s2["forensics"]["forward"]["kind"] == "overflow"
    assert s2["first_break"] == s1["first_break"]
