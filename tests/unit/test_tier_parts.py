"""Parts of the per-step tier: its step vector (`StepTier._extremes`: stream maxima, 0 where no hook ran, then each
block's per-head logits and bounds, padded with -inf to the widest block's heads only where a block has fewer, -inf
where no hook ran; a block reporting more heads than its attention declares is refused), and the flat copy of the
weights (`WeightCopy`) whose per-group slices give the weight norms and, after the step, the update's."""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.diagnostics.tier import StepTier, WeightCopy


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


def test_the_flat_copy_keeps_each_group_in_one_slice_a_dtype_and_becomes_minus_the_update():
    g = torch.Generator().manual_seed(0)
    groups = [
        [torch.randn(3, 4, generator=g), torch.randn(5, generator=g).bfloat16(), torch.randn(2, generator=g)],
        [torch.randn(6, generator=g).bfloat16(), torch.randn(4, 2, generator=g)],
    ]
    copy = WeightCopy(groups)
    copy.load(groups)
    for group, slices in zip(groups, copy.slices):
        assert len(slices) == 2  # one fp32 slice and one bf16 slice a group
        by_hand = sum(float(t.double().pow(2).sum()) for t in group)
        assert sum(float(s.double().pow(2).sum()) for s in slices) == pytest.approx(by_hand, rel=1e-12)
    after = [[t + 0.5 * (i + 1) for i, t in enumerate(ts)] for ts in groups]  # each tensor moved by its own step
    copy.subtract(after)
    for ts, moved, views in zip(groups, after, copy.views):
        for t, m, v in zip(ts, moved, views):
            assert v.shape == t.shape and v.dtype == t.dtype
            assert torch.equal(v, t - m)  # the copy is -dW, exactly in each dtype


def test_the_cpus_stream_maximum_is_the_largest_magnitude_over_the_micro_batches():
    """Eager on the CPU each site keeps its smallest and largest value (`StepTier._stream`), |x|'s maximum taken for
    every site at once in `_extremes`: a negative extreme counts, the larger of two micro-batches is kept, and a
    site no hook reached reads 0."""
    tier = StepTier(normlab.build_model("pre", "nano", seed=0), hooks=False)  # 2 blocks: 3 sites
    tier.reset()
    tier._stream(0, torch.tensor([[1.0, -7.0], [2.0, 3.0]]))
    tier._stream(0, torch.tensor([[6.0, -2.0]]))  # a second micro-batch: its maximum is smaller
    tier._stream(2, torch.tensor([4.0, -1.0]).bfloat16())
    tier._stream(2, torch.tensor([-0.5, 5.0]).bfloat16())
    assert tier._extremes()[:3].tolist() == [7.0, 0.0, 5.0]
