"""Every optimizer's facts in one torch-free row: the one place a new optimizer is described (its builder,
normlab.train.optim.OPTIMIZER_BUILDERS, is the other).

A row says which parameters the optimizer takes (all, or the blocks' 2-D hidden matrices with another optimizer on
the rest), how many float32 numbers of state it keeps per parameter it takes (what `normlab plan` and a sweep's disk
budget count, normlab.train.memory), what its step costs beyond the elementwise update (normlab.train.mfu,
normlab.recommend.planning.cost), whether its step runs on FSDP2's shards (the settings' check,
normlab.config.train) and the
settings (`OptimSettings` fields) it reads. The settings' choices (``optim.optimizer``, ``normlab recommend
--optimizer``) are the rows' names. tests/unit/test_registries.py checks the rows against the builders, the settings
and the plan; tests/unit/test_registry_consumers.py registers a toy optimizer (normlab.train.optim_registry) and
checks that every consumer reads its facts.

Sources: AdamW, Loshchilov & Hutter 2019 (two moments per parameter); SGD with momentum (Kim et al. 2025 App. I; one
buffer per parameter, none without momentum); Muon, Jordan et al. 2024 (torch.optim.Muon: one momentum buffer per
matrix entry, Newton-Schulz iterations each step; AdamW on the parameters it does not take).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OptimizerTakes = Literal["all", "matrices"]
StepFlops = Literal["none", "newton_schulz"]


@dataclass(frozen=True)
class OptimizerFacts:
    """One optimizer, as data.

    name: its ``optim.optimizer`` value; title: its name in prose; source: the paper or code it follows;
    takes: "all" parameters, or "matrices": the blocks' 2-D hidden matrices (normlab.train.optim.muon_matrices,
    normlab.model.params.analytic_matrices), with ``rest`` (another row's name) on every other parameter;
    state_floats: float32 numbers of state per parameter it takes; state_if: the setting whose value 0 means it keeps
    no state (SGD without momentum), None: always; step_flops: what its step adds beyond the elementwise update
    ("newton_schulz": Newton-Schulz iterations on each matrix it takes, normlab.train.mfu.newton_schulz_flops);
    settings: the `OptimSettings` fields it reads; unsharded: why its step needs each matrix whole, so that
    FSDP2's shards (each rank a slice of every matrix) cannot run it (None: it updates entry by entry and shards).
    """

    name: str
    title: str
    source: str
    takes: OptimizerTakes
    state_floats: int
    settings: tuple[str, ...]
    rest: str | None = None
    state_if: str | None = None
    step_flops: StepFlops = "none"
    unsharded: str | None = None


_ADAMW_SETTINGS = ("beta1", "beta2", "eps")

OPTIMIZER_FACTS: tuple[OptimizerFacts, ...] = (
    OptimizerFacts(
        name="adamw",
        title="AdamW",
        source="Loshchilov & Hutter 2019 (torch.optim.AdamW)",
        takes="all",
        state_floats=2,  # exp_avg, exp_avg_sq
        settings=_ADAMW_SETTINGS,
    ),
    OptimizerFacts(
        name="sgd",
        title="SGD with momentum",
        source="Kim et al. 2025 App. I (torch.optim.SGD)",
        takes="all",
        state_floats=1,  # momentum_buffer, only with momentum
        settings=("momentum",),
        state_if="momentum",
    ),
    OptimizerFacts(
        name="muon",
        title="Muon",
        source="Jordan et al. 2024 (torch.optim.Muon on the matrices, AdamW on the rest)",
        takes="matrices",
        state_floats=1,  # momentum_buffer
        settings=(
            "muon_momentum",
            "muon_nesterov",
            "muon_ns_steps",
            "muon_ns_dtype",
            "muon_adjust_lr",
            "muon_adamw_lr",
            "muon_weight_decay",
            *_ADAMW_SETTINGS,
        ),
        rest="adamw",
        step_flops="newton_schulz",
        unsharded="orthogonalizes whole matrices",
    ),
)

OPTIMIZERS: dict[str, OptimizerFacts] = {f.name: f for f in OPTIMIZER_FACTS}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
