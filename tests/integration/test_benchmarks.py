"""The benchmark scripts run (tiny arguments) and print the tables docs/benchmarks.md quotes.

Timings are never asserted here (they live in docs/benchmarks.md); these tests keep the commands
working from a fresh checkout. The peer benchmark needs the optional transformers/x-transformers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import PATIENCE_S

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str) -> str:
    """The script as `python benchmarks/SCRIPT ARGS` runs it, but in this process (an interpreter start and
    torch's import cost more than the tiny benchmark itself); its stdout, and torch's thread count restored."""
    threads, argv = torch.get_num_threads(), sys.argv
    sys.argv = [str(BENCH / script), *args]
    sys.path.insert(0, str(BENCH))  # as for a script: its folder first (the scripts share bench_device.py)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (0, None), out.getvalue()
    finally:
        sys.argv = argv
        sys.path.remove(str(BENCH))
        torch.set_num_threads(threads)
    return out.getvalue()


def test_layout_cost_prints_time_and_memory_per_layout():
    text = run("layout_cost.py", "--widths", "32", "--layers", "2", "--seq", "16", "--batch", "2", "--turns", "2")
    rows = [line for line in text.splitlines() if line.startswith("| 32 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["pre", "peri", "hybrid"]
    assert rows[0].split("|")[5].strip() == "1.000"  # pre against itself
    # peri saves more activations than pre (its extra output norms), never fewer
    act = {r.split("|")[2].strip(): float(r.split("|")[6]) for r in rows}
    assert act["peri"] > act["pre"]


def test_norm_tax_prints_each_pair_and_mode_with_its_interval_and_device():
    text = run("norm_tax.py", "--sizes", "nano", "--pairs", "pre:peri,pre:pre", "--modes", "eager", "--turns", "3")
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| nano |")]
    assert [r[2].strip() for r in rows] == ["pre -> peri", "pre -> pre"] and all(r[3].strip() == "eager" for r in rows)
    assert all(r[8].strip() == "3" and "cores" in r[9] for r in rows)
    assert all(r[5].strip().startswith("[") for r in rows)  # the interval over the turns


@pytest.mark.slow  # compile and bf16 autocast of every layout: tests/integration/test_memory.py and test_train.py
def test_layout_cost_under_bf16_autocast_and_compile():
    text = run(
        "layout_cost.py",
        "--widths",
        "32",
        "--layers",
        "1",
        "--seq",
        "16",
        "--batch",
        "2",
        "--turns",
        "1",
        "--layouts",
        "pre,peri",
        "--precision",
        "bf16",
        "--compile",
    )
    modes = [(r.split("|")[2].strip(), r.split("|")[3].strip()) for r in text.splitlines() if r.startswith("| 32 |")]
    assert modes == [("pre", "eager"), ("peri", "eager"), ("pre", "compiled"), ("peri", "compiled")]
    assert "bf16" in text.splitlines()[0]


def test_norm_kernels_compare_ours_with_torch():
    text = run("norm_kernels.py", "--rows", "64", "--widths", "32", "--reps", "4")
    assert "| rms | 32 | normlab |" in text and "| layer | 32 | functional |" in text
    low = run("norm_kernels.py", "--rows", "64", "--widths", "32", "--reps", "4", "--precision", "bf16")
    paths = [r.split("|")[3].strip() for r in low.splitlines() if r.startswith("| rms | 32 |")]
    assert paths == ["normlab (input)", "normlab (fp32)", "torch module, fp32 weight", "functional"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where there is no GPU")
def test_benchmarks_refuse_cuda_without_a_gpu():
    out = subprocess.run(
        [sys.executable, str(BENCH / "norm_kernels.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )
    assert out.returncode != 0 and "CUDA is not available" in out.stderr


@pytest.mark.skipif(
    not (importlib.util.find_spec("transformers") and importlib.util.find_spec("x_transformers")),
    reason="the peer benchmark needs transformers and x-transformers (make bench installs them)",
)
def test_peers_build_identical_configurations():
    text = run(
        "peers.py",
        "--width",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seq",
        "16",
        "--batch",
        "2",
        "--turns",
        "1",
        "--no-compile",
    )
    counts = {
        line.split(":")[0][2:]: line.split(":")[1].split()[0]
        for line in text.splitlines()
        if line.startswith("# ") and "parameters" in line
    }
    assert counts["normlab"] == counts["transformers"]  # the same model, parameter for parameter
    assert "| normlab |" in text


def test_memory_benchmark_shows_what_checkpointing_and_chunking_save():
    text = run("memory.py", "--size", "nano", "--seq", "32", "--batch", "4", "--vocab", "512", "--chunk", "32")
    saved = [float(r.split("|")[4]) for r in text.splitlines() if r.startswith("| o")]  # vs neither
    assert len(saved) == 4 and saved[3] < saved[1] < saved[0] and saved[2] < saved[0]


def test_moe_benchmark_compares_with_the_dense_model_of_equal_active_params():
    text = run("moe.py", "--batch", "2", "--seq", "16", "--turns", "1")
    rows = [r for r in text.splitlines() if r.startswith("| dense") or r.startswith("| moe")]
    assert len(rows) == 3 and "0.43M / 0.43M" in rows[0] and "1.31M / 0.43M" in rows[1]


def test_generation_benchmark_compares_cache_and_recompute():
    pytest.importorskip("transformers")
    text = run("generation.py", "--size", "nano", "--prompt", "8", "--new", "8", "--turns", "1")
    assert "| KV cache |" in text and "| re-run prefix |" in text and "same tokens: True" in text


def test_tier_overhead_prints_both_figures_and_a_profile():
    text = run("tier_overhead.py", "--size", "nano", "--steps", "3", "--batch", "2", "--seq", "16", "--profile", "3")
    assert "direct: tier's own time" in text and "A/B: on / off =" in text
    assert "## profile, one step, tier off" in text and "## profile, one step, tier on" in text


@pytest.mark.long
def test_gpu_check_plan_orders_its_checks_and_rewrites_its_sections(tmp_path, monkeypatch):
    """make gpu-check's plan holds every GPU check (tests/gpu, each key layout in bf16 and fp16 at gpu-126m, the
    benchmarks with MFU, FSDP2 on one device, the tier's cost end to end) in order of priority, each within the
    budget; --out refuses a folder that exists; its dry run records what each item's process returned (here a
    scripted process, so that nothing depends on how fast this machine trains: an item that ran and wrote its
    summary, one that ran past its limit, recorded as timed out with exit 124), writes an item past the budget
    as not run, and replaces the marked section it finds, never touching the repository's docs; a page without
    the section gets it appended."""
    sys.path.insert(0, str(BENCH.parent / "scripts"))
    import gpu_check

    started: list[list[str]] = []
    outcome = {"FSDP2": "ok"}

    def scripted(cmd, *args, timeout=None, **kwargs):
        if cmd[:2] == ["git", "rev-parse"]:
            return subprocess.CompletedProcess(cmd, 0, "abc1234\n", "")
        started.append(list(cmd))
        if outcome["FSDP2"] == "slow":
            raise subprocess.TimeoutExpired(cmd, timeout, output=b"step 1/8", stderr=b"")
        run = Path(cmd[cmd.index("--out") + 1])
        run.mkdir(parents=True)
        (run / "summary.json").write_text('{"status": "ok", "final_loss": 5.5, "tok_per_s": 1000.0}')
        return subprocess.CompletedProcess(cmd, 0, "trained\n", "")

    monkeypatch.setattr(gpu_check.subprocess, "run", scripted)

    items = gpu_check.plan(False, tmp_path)
    names = [it.name for it in items]
    assert all(it.limit_s <= gpu_check.BUDGET_S for it in items)
    runs = [f"gpu-126m {lay} {p}" for lay in ("pre", "peri", "post", "hybrid") for p in ("bf16", "fp16")]
    assert names[0] == "pytest tests/gpu" and names[1:9] == runs and names[9] == "peers (MFU)"
    assert names.index("FSDP2 on one device, probes on") < names.index("train throughput")
    tier10, off = names.index("gpu-126m pre bf16, tier every 10 steps"), names.index("gpu-126m pre bf16, tier off")
    ckpt = names.index("gpu-126m pre bf16, default checkpoint interval")
    assert names.index("FSDP2 on one device, probes on") < tier10 < off < ckpt < names.index("train throughput")
    every = items[tier10].cmd
    assert every[every.index("--layer-stats-every") + 1] == "10" and "--no-layer-stats" in items[off].cmd
    # every run saves once, at the end, but the one that shows the default (stretched) checkpoint interval
    assert "--ckpt-every" not in items[ckpt].cmd
    assert all("--ckpt-every" in it.cmd for it in items if it.run and it is not items[ckpt])
    tax = items[names.index("norm tax, eager and compiled")].cmd
    assert "gpu-126m,kim-400m" in tax and names.index("per-step tier by cadence, compiled") < names.index(
        "norm tax, eager and compiled"
    )
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 2  # a folder it did not make
    fsdp = items[names.index("FSDP2 on one device, probes on")].cmd
    assert "--fsdp" in fsdp and fsdp[fsdp.index("--nproc_per_node") + 1] == "1" and "cuda" in fsdp
    docs = tmp_path / "docs"
    before = (BENCH.parent / "docs" / "results.md").read_text()
    docs.mkdir()
    (docs / "results.md").write_text("# Results\n\n" + gpu_check.BEGIN + "\nan older section\n" + gpu_check.END + "\n")
    (docs / "benchmarks.md").write_text("# Benchmarks\n")
    assert gpu_check.main(["--dry-run", "--docs-dir", str(docs), "--only", "FSDP2", "--out", str(tmp_path / "a")]) == 0
    planned = {it.name: it.cmd for it in gpu_check.plan(True, tmp_path / "a" / "runs")}
    assert started == [planned["FSDP2 on one device, probes on"]]  # the item's own command, once
    results = (docs / "results.md").read_text()
    assert results.count(gpu_check.BEGIN) == 1 and results.count(gpu_check.END) == 1
    section = results[results.index(gpu_check.BEGIN) :]
    assert "CPU dry run" in section and "| FSDP2 on one device, probes on | ok |" in section
    assert "an older section" not in results
    outcome["FSDP2"] = "slow"  # the process runs past its limit: a failed item, said so, with exit 124
    assert gpu_check.main(["--dry-run", "--docs-dir", str(docs), "--only", "FSDP2", "--out", str(tmp_path / "b")]) == 1
    log = (tmp_path / "b" / "logs" / "FSDP2_on_one_device_probes_on.log").read_text()
    assert log.startswith("step 1/8") and "timed out after" in log
    assert "### FSDP2 on one device, probes on: FAILED (exit 124)" in (docs / "results.md").read_text()
    assert (BENCH.parent / "docs" / "results.md").read_text() == before
    assert gpu_check.main(["--dry-run", "--docs-dir", str(docs), "--only", "peers", "--budget-s", "0"]) == 0
    assert "### peers (MFU): not run (the check's time budget was spent)" in (docs / "benchmarks.md").read_text()
    page = tmp_path / "page.md"
    page.write_text("# Title\n\ntext\n")
    gpu_check.replace_section(page, "one\n")
    gpu_check.replace_section(page, "two\n")
    assert page.read_text() == f"# Title\n\ntext\n\n{gpu_check.BEGIN}\ntwo\n{gpu_check.END}\n"


def test_tier_cadence_prints_each_cadence_and_the_tiers_own_time():
    """Eager on the CPU: the step-time columns and the direct measure (the seconds inside the tier's hooks and
    calls): positive, and its cadence-10 share below its cadence-1 share (a step between costs the hooks' early
    return only); the same by part, each of the timed functions named once with its median; the forwards alone
    (``--forwards``) with their two-standard-error spread."""
    args = ("--sizes", "nano", "--modes", "eager", "--repeats", "3", "--warmup", "1", "--forwards", "4")
    text = run("tier_cadence.py", *args)
    (row,) = [r for r in text.splitlines() if r.startswith("| nano | eager |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 12 and all(c.endswith("%") for c in cells[5:8])
    own_ms, own_1, own_10 = float(cells[9]), float(cells[10].rstrip("%")), float(cells[11].rstrip("%"))
    assert own_ms > 0 and 0 < own_10 < own_1
    (parts,) = [r for r in text.splitlines() if r.startswith("# nano, eager: the tier step's own time by part")]
    by_part = dict(p.rsplit(" ", 1) for p in parts.split("ms): ", 1)[1].split(", "))
    assert set(by_part) == {"pre_step", "_entering", "_tap", "_leaving", "post_backward", "fired", "post_step"}
    assert all(float(v) >= 0 for v in by_part.values()) and float(by_part["_tap"]) > 0
    (forwards,) = [r for r in text.splitlines() if r.startswith("# nano, eager: hooks returning at once ")]
    assert "(two standard errors)" in forwards and forwards.endswith("4 each)")
