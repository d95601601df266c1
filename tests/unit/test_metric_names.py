"""One vocabulary of metric names (normlab.runs.metrics): every key a short training run (normlab's loop, and
TrainingMonitor on someone else's) writes to metrics.jsonl, every probe metric in probes.jsonl and every per-step
tier column in layers.jsonl is a name of the vocabulary; the modules of train/ and diagnostics/ that write and read
them spell them through it, never as bare strings."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from normlab import build_model
from normlab.config.train import TrainConfig
from normlab.diagnostics.training_monitor import TrainingMonitor
from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric, ProbeMetric, known_probe_metric, scale_metric
from normlab.train import train
from tests.helpers import REPO

# DyT (alpha, saturation), gated attention (the gates), hyper-connections (the streams' mixing), MoE (the load),
# ReZero (a learned scale that is not a norm: h_mean, h_abs_max)
RUNS = [
    {"layout": "pre-dyt"},
    {"layout": "rezero"},
    {"layout": "pre-gate", "activation_dtype": "fp16"},
    {"layout": "pre-mhc"},
    {"layout": "pre", "model.n_experts": 4},
]


@pytest.mark.parametrize("kw", RUNS, ids=lambda kw: str(kw["layout"]) + ("-moe" if "model.n_experts" in kw else ""))
def test_every_name_a_training_run_writes_is_in_the_vocabulary(corpus, tmp_path, kw):
    cfg = TrainConfig.of(
        data=str(corpus),
        size="nano",
        seq_len=32,
        batch_size=8,
        steps=3,
        eval_every=0,
        eval_batches=1,
        probe_every=1,
        layer_stats_every=1,
        out=str(tmp_path / "run"),
        progress=False,
        device="cpu",
        **kw,
    )
    train(cfg)
    run = RunDir(tmp_path / "run")
    keys = {k for row in run.metrics() for k in row}
    assert {Metric.STEP, Metric.LOSS, Metric.GRAD_NORM, Metric.LR} <= keys
    assert keys <= set(Metric), keys - set(Metric)
    probes = {row["metric"] for row in run.probes()}
    assert probes and {m for m in probes if not known_probe_metric(m)} == set()
    layers = {k for row in run.layers() for k in row} - {Metric.STEP}
    assert layers and layers <= set(ProbeMetric), layers - set(ProbeMetric)


def _names(rows, key=None):
    return {row[key] for row in rows} if key else {k for row in rows for k in row}


def test_every_name_training_monitor_writes_is_in_the_vocabulary(tmp_path):
    """TrainingMonitor (someone else's loop, its own writer of metrics.jsonl, probes.jsonl and layers.jsonl)."""
    model = build_model("pre", "nano", seed=0, vocab_size=64, max_seq_len=16)
    monitor = TrainingMonitor(model, tmp_path / "m", every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 64, (2, 16), generator=gen)
        out = model(x, targets=x)
        out.loss.backward()
        monitor.step(step, loss=out.loss)
        opt.step()
        opt.zero_grad()
    monitor.close()
    run = RunDir(tmp_path / "m")
    metrics, probes, layers = _names(run.metrics()), _names(run.probes(), "metric"), _names(run.layers())
    assert {Metric.STEP, Metric.LOSS, Metric.GRAD_NORM} <= metrics <= set(Metric), metrics - set(Metric)
    assert probes and {m for m in probes if not known_probe_metric(m)} == set()
    assert layers - {Metric.STEP} <= set(ProbeMetric), layers - set(ProbeMetric)


# the vocabulary's names that are also ordinary words (a site, a parameter group's key, a checkpoint's entry): the
# scan below looks for the others, which mean a metric wherever they appear
ORDINARY = {"step", "loss", "lr", "tokens", "time", "mfu", "spike", "skipped", "overflow", "var", "rms", "load"}
ORDINARY |= {"alpha", "shift", "bound", "entropy"}


def _bare_names(path: Path, names: set[str], root: Path = REPO) -> list[str]:
    """The string literals of ``path`` (outside f-strings and docstrings) that are one of ``names``."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names):
            continue
        up, in_fstring = parents.get(node), False
        while up is not None:
            in_fstring = in_fstring or isinstance(up, ast.JoinedStr)
            up = parents.get(up)
        if not in_fstring and not isinstance(parents.get(node), ast.Expr):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return found


def test_train_and_diagnostics_spell_metric_names_through_the_vocabulary(tmp_path):
    """No module of train/ or diagnostics/ writes or reads a metric by a bare string ("grad_norm", "max_logit"):
    each uses Metric / ProbeMetric, so a renamed or misspelt name fails at import, not in a reader's empty plot."""
    names = {m.value for m in Metric} | {m.value for m in ProbeMetric if not m.value.startswith("_")}
    names -= ORDINARY
    modules = sorted((REPO / "src/normlab/train").glob("*.py")) + sorted(
        (REPO / "src/normlab/diagnostics").glob("*.py")
    )
    assert len(modules) > 30
    assert [hit for path in modules for hit in _bare_names(path, names)] == []
    planted = tmp_path / "src" / "writer.py"  # the scan finds a bare name where a writer would put one
    planted.parent.mkdir()
    planted.write_text('"""docstring: grad_norm"""\nrow = {"grad_norm": 1.0, "note": f"{\'max_logit\'}"}\n')
    assert [h.split(": ")[1] for h in _bare_names(planted, names, tmp_path)] == ["'grad_norm'"]


def test_the_names_are_their_strings_in_json_and_in_lookups():
    assert json.dumps({Metric.GRAD_NORM: 1.0}) == '{"grad_norm": 1.0}'
    assert {"max_logit": 2}[ProbeMetric.MAX_LOGIT] == 2
    assert known_probe_metric("gate_below_0.01") and not known_probe_metric("gate_below")
    assert not known_probe_metric("grad_nrom")
    # a learned scale's: its prefix (normlab.model.block.SCALE_PARAMS) and the statistic; another prefix is not one
    assert scale_metric("h", ProbeMetric.SCALE_MEAN) == "h_mean" and known_probe_metric("h_mean")
    assert known_probe_metric("head_scale_abs_max") and not known_probe_metric("nonsense_mean")
    assert len({m.value for m in Metric}) == len(Metric) and len({m.value for m in ProbeMetric}) == len(ProbeMetric)
