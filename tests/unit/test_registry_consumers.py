"""The registries as the one source, checked through their consumers (issue 65 item 3): a toy point-wise norm
kind and two toy optimizers are registered through the public API (normlab.model.registry,
normlab.train.optim_registry), and every consumer that decides by kind or by optimizer must react to their
facts: the screen, the probes' saturated share, recommend's answer, the sweep's disk budget, the FSDP check and
recommend's costing. A consumer that tests names ("dyt", "muon", isinstance(m, DyT)) instead of reading the
facts misses the toys and fails here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import nn

import normlab
from normlab.config.optimizers import OPTIMIZERS, OptimizerFacts
from normlab.config.train import TrainConfig
from normlab.diagnostics.probes import Probes
from normlab.errors import ConfigError
from normlab.experiments.sweep import SweepConfig
from normlab.layout import as_layout
from normlab.layout.norm_kinds import NORM_FACTS, NormKindFacts
from normlab.model.config import ModelConfig
from normlab.model.norms import NORM_MODULES, NormModule
from normlab.model.params import analytic_params
from normlab.model.registry import register_norm_kind, unregister_norm_kind
from normlab.recommend.evidence import answer
from normlab.recommend.planning.shape import UserModel
from normlab.recommend.planning.work import muon_shapes, optimizer_work
from normlab.screen.wellposed import wellposedness
from normlab.train.mfu import newton_schulz_flops
from normlab.train.optim import OPTIMIZER_BUILDERS
from normlab.train.optim_registry import register_optimizer, unregister_optimizer

TOY_BOUND = "the toy squash bounds u entry by entry (a test's kind)"


class SoftSign(nn.Module):
    """y = gamma * z / (1 + |z|) + beta, z = alpha x: a point-wise squash that is not DyT's class."""

    SATURATED = 0.05  # d/dz z/(1+|z|) = 1/(1+|z|)^2 relative to its slope at 0: < 0.05 past |z| = sqrt(20) - 1

    def __init__(self, dim: int, alpha0: float) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha0)))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.alpha * x
        return self.weight * z / (1 + z.abs()) + self.bias

    def saturated_share(self, x: torch.Tensor) -> torch.Tensor:
        z = (self.alpha * x).abs()
        return ((1 + z) ** -2 < self.SATURATED).float().mean()


TOY_KIND = NormKindFacts(
    name="toysquash",
    title="ToySquash",
    source="a test's kind",
    params=(("alpha", "one"), ("weight", "gain"), ("bias", "bias")),
    pointwise=True,
    gained=False,
    output_bound=TOY_BOUND,
    after_add="the toy squash boxes the stream",
    rescalable=False,
)
TOY_MODULE = NormModule(SoftSign, lambda dim, eps, bias, compute, alpha0, gain: SoftSign(dim, alpha0))


def _adamw_like(model: nn.Module, cfg: TrainConfig, fused: bool):  # the builder: AdamW's, under another name
    return OPTIMIZER_BUILDERS["adamw"](model, cfg, fused)


# three float32 numbers of state a parameter (where AdamW keeps two), Newton-Schulz on the matrices, no FSDP
TOY_WHOLE = OptimizerFacts(
    name="toywhole",
    title="ToyWhole",
    source="a test's optimizer",
    takes="all",
    state_floats=3,
    settings=(),
    step_flops="newton_schulz",
    unsharded="needs each matrix whole for its toy step",
)
# Muon's name test would refuse nothing here and cost nothing; an elementwise one shards
TOY_FLAT = replace(TOY_WHOLE, name="toyflat", state_floats=0, step_flops="none", unsharded=None)


@pytest.fixture
def toys() -> Iterator[None]:
    register_norm_kind(TOY_KIND, TOY_MODULE)
    register_optimizer(TOY_WHOLE, _adamw_like)
    register_optimizer(TOY_FLAT, _adamw_like)
    try:
        yield
    finally:
        unregister_optimizer(TOY_FLAT.name)
        unregister_optimizer(TOY_WHOLE.name)
        unregister_norm_kind(TOY_KIND.name)


TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)


def test_registration_is_undone_and_refuses_a_second_row(toys: None) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_norm_kind(TOY_KIND, TOY_MODULE)
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer(TOY_WHOLE, _adamw_like)
    with pytest.raises(ValueError, match="saturated_share"):  # a point-wise kind's module measures its saturation
        register_norm_kind(replace(TOY_KIND, name="toy2"), NormModule(nn.Identity, lambda *a: nn.Identity()))
    unregister_optimizer(TOY_FLAT.name)
    unregister_norm_kind(TOY_KIND.name)
    assert TOY_KIND.name not in NORM_FACTS and TOY_KIND.name not in NORM_MODULES
    assert TOY_FLAT.name not in OPTIMIZERS and TOY_FLAT.name not in OPTIMIZER_BUILDERS
    with pytest.raises(normlab.LayoutError):
        as_layout("pre,norm=toysquash")
    with pytest.raises(ConfigError, match="is not valid"):
        TrainConfig().with_({"optimizer": "toyflat"})


def test_the_screen_reads_the_kinds_output_bound(toys: None) -> None:
    verdict = wellposedness(as_layout("peri,norm=toysquash").resolve(2))
    assert verdict["worst"] == "bounded"
    assert verdict["sublayers"] and all(TOY_BOUND in v["why"] for v in verdict["sublayers"])


def test_the_probes_measure_a_point_wise_kinds_saturation(toys: None) -> None:
    model = normlab.build_model("pre,norm=toysquash", "nano", seed=0)
    first = model.blocks[0].attn_norms.input
    assert isinstance(first, SoftSign)
    with torch.no_grad():
        first.alpha.fill_(1e4)  # |z| >> sqrt(20) - 1 for every nonzero input: all saturate
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = Probes(model, (x, x)).record(0)
    share = {(r["layer"], r["site"]): r["value"] for r in rows if r["metric"] == "saturated_share"}
    assert share[(0, "attn_norms.input")] > 0.99  # the embedding has no zero entry
    assert share[(0, "mlp_norms.input")] < 0.01  # alpha0 = 1 on an O(1) stream: none past |z| = 3.47


def test_recommends_answer_says_a_point_wise_kinds_regime(toys: None) -> None:
    from normlab.recommend.report.explain import transfer_record

    user = UserModel(TINY, "test", layout="pre")
    dom = answer.domain(user, "fp16", "adamw", 2, transfer_record(), tokens=2 * 10**11, winner="pre,norm=toysquash")
    assert any(d.startswith("regime: pre,norm=toysquash replaces norms") for d in dom["differences"])
    calm = answer.domain(user, "fp16", "adamw", 2, transfer_record(), tokens=2 * 10**11, winner="pre")
    assert not any(d.startswith("regime:") for d in calm["differences"])


def test_the_sweeps_disk_budget_counts_the_optimizers_state(toys: None) -> None:
    base = {"size": "nano", "steps": 2, "keep_last": 1, "keep_optimizer": True}
    sweep = SweepConfig.from_dict({"name": "toy", "base": {**base, "optimizer": "toywhole"}, "grid": {}})
    cfg = sweep.expand()[0].config
    n = analytic_params(cfg.model.model_config(vocab_size=cfg.expected_vocab), cfg.model.resolved).total
    assert sweep.disk_budget() == (4 * n + 4 * 3 * n, 4 * n + 4 * 3 * n)  # float32 weights + 3 floats of state
    flat = SweepConfig.from_dict({"name": "toy", "base": {**base, "optimizer": "toyflat"}, "grid": {}})
    assert flat.disk_budget() == (4 * n, 4 * n)  # no state


def test_fsdp_is_refused_by_the_optimizers_fact(toys: None) -> None:
    with pytest.raises(ConfigError, match="toywhole needs each matrix whole for its toy step and FSDP2 shards"):
        TrainConfig().with_({"optimizer": "toywhole", "fsdp": True})
    assert TrainConfig().with_({"optimizer": "toyflat", "fsdp": True}).run.fsdp


def test_recommends_cost_reads_the_optimizers_step_flops(toys: None) -> None:
    layout = "peri"
    ns = sum(newton_schulz_flops(s, 5) for s in muon_shapes(TINY, layout))
    assert ns > 0
    assert optimizer_work(TINY, layout, "toywhole", ns_steps=5) == pytest.approx(ns, rel=1e-12)
    assert optimizer_work(TINY, layout, "toyflat", ns_steps=5) == 0.0
    assert math.isclose(optimizer_work(TINY, layout, "muon"), optimizer_work(TINY, layout, "toywhole"))
