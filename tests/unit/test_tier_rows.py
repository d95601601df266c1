"""The per-step tier's step vector (`StepTier._extremes`): stream maxima (0 where no hook ran), then each block's
per-head logits and bounds, padded with -inf to the widest block's heads only where a block has fewer, -inf where
no hook ran; a block reporting more heads than its attention declares is refused."""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.diagnostics.tier import StepTier


def test_the_step_vector_pads_only_what_is_short_and_marks_what_did_not_run():
    tier = StepTier(normlab.build_model("pre", "nano", seed=0), hooks=False)  # 2 blocks of 2 heads
    tier.reset()
    tier._streams = [torch.tensor(1.0), None, torch.tensor(3.0)]
    tier._logits = [torch.tensor([5.0, 6.0]), torch.tensor([7.0])]
    tier._bounds = [None, torch.tensor([8.0, 9.0])]
    inf = -math.inf
    assert tier._extremes().tolist() == [1.0, 0.0, 3.0, 5.0, 6.0, 7.0, inf, inf, inf, 8.0, 9.0]
    tier._logits = [torch.tensor([5.0, 6.0, 7.0]), None]
    with pytest.raises(ValueError, match="more than the 2 heads"):
        tier._extremes()
