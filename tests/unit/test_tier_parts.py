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


def test_the_per_layer_spike_rule_is_olmos_rule_on_each_series_own_window():
    """`TierSpikes` keeps every series in one array and computes the thresholds of equally long windows together;
    it fires exactly where the rule written per series fires: value > mean + 6 std (population) of that series'
    previous finite values, the last 16 of them, once 4 are known. Non-finite values never fire and never enter a
    window (their series' windows fall out of step with the others'); a layer first seen late starts empty."""
    from collections import deque

    from normlab.diagnostics.tier import TierSpikes

    g = torch.Generator().manual_seed(0)
    tier = TierSpikes(sigmas=6.0, window=16, min_history=4)
    windows: dict[str, deque] = {}
    fired_somewhere = 0
    for step in range(60):
        layers = 2 if step < 10 else 3
        row = {
            "grad_norm": (1.0 + 0.1 * torch.rand(layers, generator=g)).tolist(),
            "stream_max": (5.0 + torch.rand(layers + 1, generator=g)).tolist(),
        }
        if step in (2, 30, 55):
            row["grad_norm"][1] = 50.0  # a spike (the first before its window is long enough)
        if step == 45:
            row["stream_max"][2] = 100.0  # a layer first seen at step 10
        if step % 11 == 5:
            row["stream_max"][0] = math.inf if step % 2 else math.nan
        want = []
        for key in ("grad_norm", "stream_max"):
            for layer, v in enumerate(row[key]):
                h = windows.setdefault(f"{key}[{layer}]", deque(maxlen=16))
                if math.isfinite(v) and len(h) >= 4:
                    xs = torch.tensor(list(h), dtype=torch.float64)
                    if v > float(xs.mean() + 6.0 * xs.std(correction=0)):
                        want.append(f"{key}[{layer}]")
                if math.isfinite(v):
                    h.append(v)
        assert tier.check(row) == want
        fired_somewhere += len(want)
    assert fired_somewhere == 3
    assert tier.history("stream_max[0]") == list(windows["stream_max[0]"]) and tier.history("nothing") == []


def _tier_rows(budget: int, checkpointing: bool) -> list[dict]:
    """Two training steps of a 4-block GQA model (4 query heads on 2 key heads), two micro-batches each, an
    inference-mode forward first (the tier's window is open from its construction): each step's tier row."""
    model = normlab.build_model("peri", "nano", seed=0, n_layers=4, n_heads=4, n_kv_heads=2)
    model.activation_checkpointing = checkpointing
    tier = StepTier(model)
    tier._sample.budget = budget
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (6, 16), generator=g) for _ in range(4)]
    with torch.inference_mode():
        model(batches[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = []
    for step in range(2):
        tier.reset()
        opt.zero_grad(set_to_none=True)
        for x in batches[2 * step : 2 * step + 2]:
            model(x, targets=x).loss.backward()
        tier.before_step()
        tier.read()
        opt.step()
        rows.append(tier.after_step(True))
    tier.remove()
    return rows


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_layers_logits_computed_together_equal_each_layers_own(checkpointing):
    """Eager: a buffer large enough for every layer (`LogitSample` computes the 4 together at each micro-batch's
    end) and one too small for two (each layer where it lies) give the same rows, over two micro-batches a step,
    with activation checkpointing's recompute too, after an inference-mode forward made the buffer."""
    together, apart = _tier_rows(2**28, checkpointing), _tier_rows(1, checkpointing)
    for a, b in zip(together, apart):
        for key in ("stream_max", "grad_norm", "update_rms"):
            assert a[key] == pytest.approx(b[key], rel=1e-6)
        for key in ("max_logit", "max_logit_bound"):
            assert [len(h) for h in a[key]] == [4] * 4
            assert sum(a[key], []) == pytest.approx(sum(b[key], []), rel=1e-5)
            assert all(math.isfinite(v) for v in sum(a[key], []))
    exact, bound = sum(together[0]["max_logit"], []), sum(together[0]["max_logit_bound"], [])
    assert all(e <= b + 1e-5 for e, b in zip(exact, bound))


def test_a_float64_model_has_its_norms_read():
    model = normlab.build_model("pre", "nano", seed=0).double()
    tier = StepTier(model)
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    model(x, targets=x).loss.backward()
    tier.before_step()
    norms = tier.read()["grad_norm"]
    by_hand = [math.sqrt(sum(float(p.grad.pow(2).sum()) for p in b.parameters())) for b in model.blocks]
    assert norms == pytest.approx(by_hand, rel=1e-5)
