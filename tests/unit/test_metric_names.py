"""One vocabulary of metric names (normlab.runs.metrics): every key a short training run writes to metrics.jsonl,
every probe metric in probes.jsonl and every per-step tier column in layers.jsonl is a name of the vocabulary."""

from __future__ import annotations

import json

import pytest

from normlab.config.train import TrainConfig
from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric, ProbeMetric, known_probe_metric
from normlab.train import train

# DyT (alpha, saturation), gated attention (the gates), hyper-connections (the streams' mixing), MoE (the load)
RUNS = [
    {"layout": "pre-dyt"},
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


def test_the_names_are_their_strings_in_json_and_in_lookups():
    assert json.dumps({Metric.GRAD_NORM: 1.0}) == '{"grad_norm": 1.0}'
    assert {"max_logit": 2}[ProbeMetric.MAX_LOGIT] == 2
    assert known_probe_metric("gate_below_0.01") and not known_probe_metric("gate_below")
    assert not known_probe_metric("grad_nrom")
    assert len({m.value for m in Metric}) == len(Metric) and len({m.value for m in ProbeMetric}) == len(ProbeMetric)
