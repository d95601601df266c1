"""The run configuration as one typed tree: built and validated once, stored nested, and the flat form
that config.json, checkpoints and sweep.db held before read through the one migration (with the run ids
it had)."""

from __future__ import annotations

import json
import pickle
import sqlite3

import pytest

from normlab.config.sections import ModelSettings, resolve_layout
from normlab.config.train import TrainConfig, migrate
from normlab.errors import ConfigError
from normlab.layout.sites import Layout
from normlab.model.config import SIZES, ModelConfig

# A run's config exactly as normlab wrote it before the nested form (main at 5986c0e: `SweepConfig(name="old",
# base={"size": "nano", "steps": 3, "model.n_layers": 1}, grid={"layout": ["pre", "peri,h=0.5"], "lr": [1e-3]})`,
# each RunSpec's config and run id printed with json.dumps(sort_keys=True)).
FLAT = {
    "activation_checkpointing": False,
    "activation_dtype": "auto",
    "batch_size": 32,
    "beta1": 0.9,
    "beta2": 0.95,
    "ckpt_every": 0,
    "compile": None,
    "data": "shakespeare",
    "device": "auto",
    "diverge_final_loss": None,
    "diverge_patience": 50,
    "early_warnings": True,
    "eps": 1e-08,
    "eval_batches": 8,
    "eval_every": 100,
    "fault": "none",
    "fault_scale": 10.0,
    "fault_step": 0,
    "fsdp": False,
    "grad_accum": 1,
    "grad_clip": 1.0,
    "init_from": None,
    "keep_last": 1,
    "keep_optimizer": False,
    "layer_stats": True,
    "layer_stats_every": 1,
    "layout": "pre",
    "loss_chunk": 4096,
    "loss_scale_init": 65536.0,
    "lr": 0.001,
    "lr_input_gains": 1.0,
    "lr_output_gains": 1.0,
    "max_overflow_streak": 20,
    "max_skipped": 0.1,
    "min_loss_scale": 1.0,
    "min_lr": None,
    "model": {"n_layers": 1},
    "momentum": 0.9,
    "muon_adamw_lr": None,
    "muon_adjust_lr": "match_rms_adamw",
    "muon_momentum": 0.95,
    "muon_nesterov": True,
    "muon_ns_steps": 5,
    "muon_ns_dtype": "bf16",
    "muon_weight_decay": None,
    "on_nonfinite": "stop",
    "on_spike": "count",
    "optimizer": "adamw",
    "precision": "auto",
    "probe_batch": 8,
    "probe_every": 100,
    "prompt_field": "prompt",
    "qk_clip": None,
    "qk_spectrum_every": 0,
    "response_field": "response",
    "resume": True,
    "seed": 0,
    "seq_len": 128,
    "size": "nano",
    "spike_sigmas": 6.0,
    "spike_window": 128,
    "stall_margin": 0.05,
    "steps": 3,
    "task": "lm",
    "tensorboard": False,
    "text_field": "text",
    "tf32": True,
    "token_dtype": "uint16",
    "tokenizer": "bytes",
    "val_fraction": 0.1,
    "vocab_size": None,
    "wandb": False,
    "warmup": 0.1,
    "wd_exclude": "norms,biases,embeddings",
    "wd_input_gains": None,
    "wd_output_gains": None,
    "weight_decay": 0.1,
    "z_loss": 0.0,
}
OLD_IDS = {"pre": "pre_lr0.001-054b690f", "peri,h=0.5": "peri-h-0.5_lr0.001-4dca754b"}


def _expected(layout: str = "pre") -> TrainConfig:
    return TrainConfig.of(
        size="nano", steps=3, lr=1e-3, layout=layout, keep_last=1, keep_optimizer=False, **{"model.n_layers": 1}
    )


def test_the_tree_holds_a_model_config_and_a_layout_built_once():
    cfg = TrainConfig.of(size="nano", **{"model.n_layers": 3, "model.d_ff": 48, "layout": "peri", "layout.h": 0.5})
    assert isinstance(cfg.model.config, ModelConfig) and isinstance(cfg.model.layout, Layout)
    assert cfg.model.config == SIZES["nano"].with_(n_layers=3, d_ff=48)
    assert cfg.model.model_config() is cfg.model.config  # the one built when the section was made
    assert len(cfg.model.resolved.blocks) == 3 and cfg.model.resolved is resolve_layout(cfg.model.layout, 3)
    with pytest.raises(ConfigError, match="did you mean n_layers"):
        ModelSettings(size="nano", options={"n_layerz": 3})


def test_the_stored_form_is_nested_and_round_trips():
    cfg = TrainConfig.of(size="nano", lr=0.01, optimizer="muon", **{"model.n_layers": 3, "layout": "pre,h=0.5"})
    stored = json.loads(json.dumps(cfg.to_dict()))
    assert set(stored) == {"model", "data", "optim", "run"}
    assert stored["model"] == {"layout": "pre,h=0.5", "size": "nano", "options": {"n_layers": 3}, "init_from": None}
    assert stored["optim"]["lr"] == 0.01 and stored["optim"]["optimizer"] == "muon" and "lr" not in stored["run"]
    assert TrainConfig.from_dict(stored) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # crosses a process boundary whole
    bad = {**stored, "optim": {**stored["optim"], "lrr": 0.1}}
    with pytest.raises(ConfigError, match="unknown key 'lrr' in optim.*did you mean lr"):
        TrainConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="lr must be > 0"):
        TrainConfig.from_dict({**stored, "optim": {**stored["optim"], "lr": -1.0}})


def test_a_flat_config_json_is_read_through_the_migration(tmp_path):
    from normlab.runs.files import RunDir

    assert migrate(FLAT) == _expected().to_dict()
    assert TrainConfig.from_dict(FLAT) == _expected()
    run = RunDir(tmp_path / "old")
    run.path.mkdir()
    (run.config_file).write_text(json.dumps({"config": FLAT, "layout": "pre", "versions": {"normlab": "0.1.0"}}))
    saved = run.train_config()
    assert saved == _expected() and saved.identity() == _expected().identity()
    flat = saved.to_flat()  # the canonical flat form: the old file's (a sweep's row left out `out` and `progress`)
    assert (flat.pop("out"), flat.pop("progress")) == ("runs/run", True) and flat == FLAT


def test_an_old_sweep_db_is_read_with_the_ids_it_had(tmp_path):
    """Rows written by the previous normlab (flat configs) read as TrainConfigs, and the same sweep today
    gives the same run ids (the hash of the canonical flat form): a study in progress is resumed, not rerun."""
    from normlab.experiments import SweepConfig
    from normlab.experiments.sweep import run_id
    from normlab.runs.store import SweepStore

    db = tmp_path / "sweep.db"
    SweepStore(db).rows()  # the schema
    with sqlite3.connect(db) as con:
        for i, (layout, rid) in enumerate(OLD_IDS.items()):
            con.execute(
                "insert into runs (run_id, idx, axes, config) values (?, ?, ?, ?)",
                (rid, i, json.dumps({"layout": layout, "lr": 1e-3}), json.dumps({**FLAT, "layout": layout})),
            )
    rows = SweepStore(db).rows()
    assert [r["config"] for r in rows] == [_expected(layout) for layout in OLD_IDS]
    assert [run_id(r["axes"], r["config"]) for r in rows] == list(OLD_IDS.values())
    sweep = SweepConfig(
        name="old", base={"size": "nano", "steps": 3, "model.n_layers": 1}, grid={"layout": list(OLD_IDS), "lr": [1e-3]}
    )
    assert [s.run_id for s in sweep.expand()] == list(OLD_IDS.values())


def test_a_sweep_resolves_each_layout_once(monkeypatch, tmp_path):
    """12 runs over 2 layouts: each layout resolved once while the sweep is built, expanded, stored and read
    back (the flat form: 36 while the sweep was built, 96 once each run had its config)."""
    from normlab.experiments import SweepConfig
    from normlab.layout import parse_layout
    from normlab.runs.store import SweepStore

    calls = []
    real = Layout.resolve
    monkeypatch.setattr(Layout, "resolve", lambda self, n: calls.append((self.to_string(), n)) or real(self, n))
    resolve_layout.cache_clear()
    TrainConfig()  # the defaults (peri at tiny's depth): resolved once, as any layout
    calls.clear()
    sweep = SweepConfig(
        name="count",
        base={"size": "nano", "steps": 3},
        grid={"layout": ["pre", "post,h=0.5"], "lr": [1e-3, 3e-3, 1e-2], "seed": [0, 1]},
    )
    specs = sweep.expand()
    store = SweepStore(tmp_path / "sweep.db")
    store.add(specs)
    assert [r["config"] for r in store.rows()] == [s.config for s in specs] and len(specs) == 12
    assert all(len(s.config.model.resolved.blocks) == 2 for s in specs)
    assert sorted(calls) == sorted((parse_layout(x).to_string(), 2) for x in ("pre", "post,h=0.5"))


def test_the_store_round_trips_a_sweeps_configs(tmp_path):
    from normlab.experiments import SweepConfig
    from normlab.runs.store import SweepStore

    sweep = SweepConfig(name="rt", base={"size": "nano", "steps": 3}, grid={"layout.h": [0.5, 1.0]})
    store = SweepStore(tmp_path / "sweep.db")
    store.add(sweep.expand())
    assert [r["config"] for r in store.rows()] == [s.config for s in sweep.expand()]
    assert store.row(sweep.expand()[1].run_id)["config"].model.layout_label == "peri,h=1.0"


def test_model_config_fields_are_declared_settings():
    assert ModelConfig(rope_theta=500_000).rope_theta == 500_000.0  # an int given for a float is stored as one
    with pytest.raises(ConfigError, match="tie_embeddings: expected true or false"):
        ModelConfig(tie_embeddings=1)
    with pytest.raises(ConfigError, match="n_layers is beyond any model normlab builds"):
        ModelConfig(n_layers=20_000)
    with pytest.raises(ConfigError, match="position: 'alibi' is not valid; valid: rope, learned"):
        ModelConfig(position="alibi")
