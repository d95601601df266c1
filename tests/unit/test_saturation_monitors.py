"""The monitors the newer layouts need (issue 55 item 6): the saturated share of DyT/Derf inputs and gate
saturation in the probe rows, by formula."""

from __future__ import annotations

import pytest
import torch

import normlab
from normlab.diagnostics.probes import Probes
from normlab.model.norms import Derf, DyT


def test_saturated_share_by_formula():
    """tanh'(z) < 0.05 past |z| = 2.178; erf'(z)/erf'(0) = exp(-z^2) < 0.05 past |z| = 1.731."""
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, -5.0])
    dyt = DyT(5, alpha0=1.0)
    assert dyt.saturated_share(x).item() == pytest.approx(2 / 5)  # 3 and -5
    derf = Derf(5, alpha0=1.0)
    assert derf.saturated_share(x).item() == pytest.approx(3 / 5)  # 2, 3 and -5
    with torch.no_grad():
        derf.shift.fill_(1.0)  # z = x + 1: 1, 2, 3, 4, -4
    assert derf.saturated_share(x).item() == pytest.approx(4 / 5)


def test_the_probe_rows_carry_the_saturated_share_and_gate_saturation():
    model = normlab.build_model("pre-dyt", "nano", seed=0)
    with torch.no_grad():
        model.blocks[0].attn_norms.input.alpha.fill_(1e4)  # every nonzero input saturates
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = Probes(model, (x, x)).record(0)
    share = {(r["layer"], r["site"]): r["value"] for r in rows if r["metric"] == "saturated_share"}
    assert share[(0, "attn_norms.input")] > 0.99 and share[(0, "mlp_norms.input")] < 0.01
    gated = normlab.build_model("pre-gate", "nano", seed=0)
    rows = Probes(gated, (x, x)).record(0)
    metrics = {r["metric"] for r in rows if r["site"] == "attn.gate"}
    assert {"gate_below_0.1", "gate_below_0.01", "gate_below_0.001"} <= metrics
