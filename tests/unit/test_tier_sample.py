"""The per-step tier's logit sample (normlab.diagnostics.tier.sampled_logits): at most ``sequences`` sequences of
the batch, every ceil(B / sequences)-th from the first, and ``queries`` query positions of each, evenly spaced to
the last; the
exact causal logits of that sample and the Cauchy-Schwarz bound over every token of the sampled sequences,
against the logits written out by hand (GQA: query head h reads key head h // group)."""

from __future__ import annotations

import math

import pytest
import torch

from normlab.diagnostics.tier import sampled_logits


def _qk(b: int, h: int, hkv: int, t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the attention makes them: (B, H, T, d) views of (B, T, H, d)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    return q, k


def _by_hand(q, k, scale, seqs, rows):
    """Per head: the largest causal logit of the query rows of the given sequences, and max ||q|| max ||k|| |scale|
    over every token of those sequences."""
    h, group = q.shape[1], q.shape[1] // k.shape[1]
    exact, bound = [], []
    for i in range(h):
        qi, ki = q[seqs, i], k[seqs, i // group]  # (S, T, d)
        logits = torch.einsum("std,sud->stu", qi, ki) * scale  # (S, T, T)
        best = max(logits[s, t, : t + 1].max().item() for s in range(len(seqs)) for t in rows)
        exact.append(best)
        bound.append(qi.norm(dim=-1).max().item() * ki.norm(dim=-1).max().item() * abs(scale))
    return exact, bound


@pytest.mark.parametrize("scale", [0.3, -0.3])
def test_the_sample_spreads_over_a_batch_of_twenty_and_its_logits_are_exact(scale):
    q, k = _qk(20, 4, 2, 24, 8)
    exact, bound = sampled_logits(q, k, scale, queries=5, sequences=8)
    # every ceil(20 / 8) = 3rd sequence from the first: 7 of them, the last at 18; positions 0, 6, 12, 17, 23
    # (linspace, rounded)
    want_exact, want_bound = _by_hand(q, k, scale, [0, 3, 6, 9, 12, 15, 18], [0, 6, 12, 17, 23])
    assert exact.tolist() == pytest.approx(want_exact, rel=1e-5)
    assert bound.tolist() == pytest.approx(want_bound, rel=1e-5)
    everything, _ = _by_hand(q, k, scale, list(range(20)), list(range(24)))
    assert all(e <= b + 1e-5 for e, b in zip(exact.tolist(), bound.tolist()))
    assert all(e <= full + 1e-5 for e, full in zip(exact.tolist(), everything))


def test_nine_sequences_give_every_other_one():
    q, k = _qk(9, 2, 1, 6, 4)
    exact, bound = sampled_logits(q, k, 0.5, queries=6, sequences=8)
    want_exact, want_bound = _by_hand(q, k, 0.5, [0, 2, 4, 6, 8], list(range(6)))
    assert exact.tolist() == pytest.approx(want_exact, rel=1e-5)
    assert bound.tolist() == pytest.approx(want_bound, rel=1e-5)


def test_a_batch_no_larger_than_the_sample_is_read_whole():
    q, k = _qk(3, 2, 2, 10, 4)
    exact, bound = sampled_logits(q, k, 0.5, queries=10, sequences=8)
    want_exact, want_bound = _by_hand(q, k, 0.5, [0, 1, 2], list(range(10)))
    assert exact.tolist() == pytest.approx(want_exact, rel=1e-5)
    assert bound.tolist() == pytest.approx(want_bound, rel=1e-5)


def test_an_overflowed_head_leaves_the_other_heads_finite():
    """fp16 storage overflows one head's q: that head reads inf (or NaN), the others their own logits."""
    q, k = _qk(4, 4, 4, 8, 4)
    q = q.clone()
    q[1, 2, 3, 0] = math.inf
    exact, bound = sampled_logits(q, k, 0.5, queries=8, sequences=8)
    assert not math.isfinite(exact[2].item()) and not math.isfinite(bound[2].item())
    want_exact, want_bound = _by_hand(q, k, 0.5, [0, 1, 2, 3], list(range(8)))
    for i in (0, 1, 3):
        assert exact[i].item() == pytest.approx(want_exact[i], rel=1e-5)
        assert bound[i].item() == pytest.approx(want_bound[i], rel=1e-5)


def test_an_overflowed_key_head_reaches_only_its_group():
    """GQA, 4 query heads on 2 key heads: key head 1 overflows; query heads 2 and 3 (its group) read it, 0 and 1 not."""
    q, k = _qk(4, 4, 2, 8, 4)
    k = k.clone()
    k[0, 1, 5, 2] = math.inf
    exact, bound = sampled_logits(q, k, 0.5, queries=8, sequences=8)
    assert not any(math.isfinite(bound[i].item()) for i in (2, 3))
    want_exact, want_bound = _by_hand(q, k, 0.5, [0, 1, 2, 3], list(range(8)))
    for i in (0, 1):
        assert exact[i].item() == pytest.approx(want_exact[i], rel=1e-5)
        assert bound[i].item() == pytest.approx(want_bound[i], rel=1e-5)


def test_the_tier_refuses_an_empty_sample():
    import normlab
    from normlab.diagnostics.tier import StepTier

    with pytest.raises(ValueError, match="at least one query and one sequence"):
        StepTier(normlab.build_model("pre", "nano", seed=0), hooks=False, sequences=0)


def _layers(n: int, b: int, h: int, hkv: int, t: int, d: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, t, h, d, generator=g).transpose(1, 2), torch.randn(b, t, hkv, d, generator=g).transpose(1, 2))
        for _ in range(n)
    ]


def test_layers_copied_together_give_each_layers_own_logits():
    """`LogitSample` (eager): GQA layers of 4 query heads on 2 key heads, a buffer that holds 2 layers' samples:
    layers 0-1 are computed when it fills, 2 when a layer of another scale comes, 3 and 4 at the blocks' end (a
    partial buffer), a longer layer 5 alone (its sample alone fills the buffer: computed where it lies); each
    layer's logits and bound as the by-hand ones of its own sample (every 2nd of 5 sequences, every position)."""
    from normlab.diagnostics.tier import LogitSample

    got: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    per_layer = (4 + 2) * 3 * 6 * 8 * 4  # (H + H_kv) heads x 3 sequences x T x d, float32
    sample = LogitSample(
        lambda ls, e, b: got.append((ls, e, b)), layers=6, queries=6, sequences=3, budget=2 * per_layer
    )
    layers = _layers(5, 5, 4, 2, 6, 8) + _layers(1, 5, 4, 2, 12, 8, seed=2)
    scales = [0.5, 0.5, -0.25, 0.5, 0.5, 0.5]
    for i, ((q, k), scale) in enumerate(zip(layers, scales)):
        sample.add(i, q, k, scale)
        if i == 4:
            sample.flush()
    assert [ls for ls, _, _ in got] == [[0, 1], [2], [3, 4], [5]]
    assert sample._flat is not None and sample._flat.numel() * 4 == 2 * per_layer  # one buffer for every group
    rows = {layer: (e, b) for ls, es, bs in got for layer, e, b in zip(ls, es, bs)}
    for i, ((q, k), scale) in enumerate(zip(layers, scales)):
        t = q.shape[2]
        want_exact, want_bound = _by_hand(q, k, scale, [0, 2, 4], sorted({round(x * (t - 1) / 5) for x in range(6)}))
        assert rows[i][0].tolist() == pytest.approx(want_exact, rel=1e-5)
        assert rows[i][1].tolist() == pytest.approx(want_bound, rel=1e-5)


def test_a_new_step_forgets_what_the_buffer_held():
    from normlab.diagnostics.tier import LogitSample

    got = []
    sample = LogitSample(lambda ls, e, b: got.append(ls), layers=4)
    for i, (q, k) in enumerate(_layers(2, 2, 2, 2, 4, 4)):
        sample.add(i, q, k, 0.5)
    sample.discard()
    sample.flush()
    assert got == []
