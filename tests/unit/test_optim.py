"""The optimizers (Muon beside AdamW) and QK-clip, against their formulas computed here."""

from __future__ import annotations

import math

import pytest
import torch

import normlab
from normlab.config.train import TrainConfig
from normlab.diagnostics.stats import update_ratio
from normlab.errors import ConfigError
from normlab.train.optim import make_optimizer, muon_matrices, set_lr
from normlab.train.qk_clip import QKClip


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Jordan et al.'s quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, from X = G / ||G||_F, in
    bf16, on the wide orientation (Keller Jordan's muon.py; torch.optim.Muon's coefficients), each product
    fused as torch's addmm rounds it."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.shape[0] > g.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = normlab.build_model("peri", "nano", linear_bias=True)
    taken = {id(p) for p in muon_matrices(model)}
    for block in model.blocks:
        for lin in (
            block.attn.q_proj,
            block.attn.k_proj,
            block.attn.v_proj,
            block.attn.o_proj,
            block.mlp.gate_proj,
            block.mlp.up_proj,
            block.mlp.down_proj,
        ):
            assert id(lin.weight) in taken and id(lin.bias) not in taken
        assert id(block.attn_norms.input.weight) not in taken
    assert id(model.embed.weight) not in taken and id(model.lm_head.weight) not in taken
    assert len(taken) == 7 * len(model.blocks)
    opt = make_optimizer(model, TrainConfig.of(optimizer="muon", lr=0.02, muon_adamw_lr=0.004))
    adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert adamw.isdisjoint(taken) and len(adamw) + len(taken) == len(list(model.parameters()))
    set_lr(opt, 0.01)  # the schedule at half the peak: each group at half its own peak
    assert [g["lr"] for g in opt.adamw.param_groups] == pytest.approx([0.002] * len(opt.adamw.param_groups))
    assert {g["lr"] for g in opt.muon.param_groups} == {0.01}


def test_moe_routers_stay_with_adamw_and_experts_are_taken_one_by_one():
    model = normlab.build_model("peri", "moe-micro", n_layers=1)
    moe = model.blocks[0].mlp
    taken = {id(p) for p in muon_matrices(model)}
    assert id(moe.router.weight) not in taken and id(moe.experts.gate_proj) in taken
    opt = make_optimizer(model, TrainConfig.of(optimizer="muon", lr=0.02, muon_adjust_lr="original"))
    w = moe.experts.down_proj  # (E, f, d), used as x @ W: expert e's nn.Linear weight is W[e].T, (d, f)
    g = torch.randn_like(w)
    before = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    w.grad = g.clone()
    opt.step()
    # first step, Nesterov: buffer (1 - mu) g, update g + mu (buffer - g); original lr rule on (out, in) = (d, f)
    mu, lr, wd = 0.95, 0.02, 0.1
    d, f = w.shape[2], w.shape[1]
    for e in range(w.shape[0]):
        ge = g[e].T
        upd = newton_schulz(ge.lerp((1 - mu) * ge, mu), 5)  # g + mu (buffer - g), rounded as torch.lerp
        want = before[e].T * (1 - lr * wd) - lr * math.sqrt(max(1, d / f)) * upd.float()
        torch.testing.assert_close(w.detach()[e].T, want, rtol=0, atol=1e-6)


def test_one_muon_step_is_the_formula():
    torch.manual_seed(0)
    model = normlab.build_model("peri", "nano")
    cfg = TrainConfig.of(optimizer="muon", lr=0.02, weight_decay=0.1, muon_ns_steps=3, muon_nesterov=False)
    opt = make_optimizer(model, cfg)
    w = model.blocks[0].mlp.gate_proj.weight  # (128, 32): tall, so Newton-Schulz runs on its transpose
    before = w.detach().clone()
    x = torch.randint(0, 256, (2, 16))
    model(x, targets=x).loss.backward()
    g = w.grad.clone()
    opt.step()
    upd = newton_schulz((1 - 0.95) * g, 3)  # no Nesterov: the buffer itself
    want = before * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(128) * upd.float()  # match_rms_adamw
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-6)
    ratio = update_ratio(before, w.detach())
    assert ratio == pytest.approx((w.detach() - before).norm().item() / before.norm().item())


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"optimizer": "muon", "muon_ns_steps": 0}, "muon_ns_steps"),
        ({"optimizer": "muon", "muon_adjust_lr": "moonlight"}, "muon_adjust_lr"),
        ({"optimizer": "muon", "muon_momentum": 1.5}, "muon_momentum"),
        ({"optimizer": "muon", "fsdp": True, "probe_every": 0}, "FSDP2 shards"),
        ({"qk_clip": 0.0}, "qk_clip"),
        ({"qk_clip": 100.0, "fsdp": True, "probe_every": 0}, "FSDP2 shards"),
    ],
)
def test_bad_muon_settings(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.of(**kw)


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(H,) float64: max over batch and causal (i, j) of scale * q_i . k_j, by hand."""
    q, k = q.double(), k.double()
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    t = q.shape[2]
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return s.amax(dim=(0, 2, 3))


def _planted(layout: str, **overrides):
    torch.manual_seed(0)
    model = normlab.build_model(layout, "nano", n_heads=4, linear_bias=True, **overrides)
    attn = model.blocks[1].attn
    hd = attn.head_dim
    with torch.no_grad():  # head 2 of layer 1: its queries 30x larger, its max logit far above the others
        for b in (attn.q_proj.bias, attn.k_proj.bias):
            b.normal_(0, 0.02)
        if attn.q_norm.__class__.__name__ == "Identity":
            attn.q_proj.weight[2 * hd : 3 * hd] *= 30.0
        else:
            attn.q_norm.weight[2 * hd : 3 * hd] *= 30.0
    return model, attn


def _capture(model, x):
    seen = {}
    hooks = [
        model.blocks[1].attn.q.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o.detach())),
        model.blocks[1].attn.k.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o.detach())),
    ]
    model(x)
    for h in hooks:
        h.remove()
    return seen["q"], seen["k"]


def test_qk_clip_rescales_the_planted_head_by_the_formula():
    model, attn = _planted("peri")
    x = torch.randint(0, 256, (3, 24))
    q, k = _capture(model, x)
    s = _logits(q, k, attn.head_dim**-0.5)
    tau = float(s[2] / 4)  # between the planted head's max and the others'
    assert s[2] > tau and (s[[0, 1, 3]] < tau).all()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip = QKClip(model, tau)
    clip.reset()
    model(x)
    torch.testing.assert_close(clip.max[1].double(), s, rtol=1e-5, atol=1e-6)
    assert clip.apply() == 1 and clip.interventions == 1
    factor = math.sqrt(tau / s[2].item())  # sqrt(gamma) on W_q and on W_k, head 2's rows only
    hd, rows = attn.head_dim, slice(2 * attn.head_dim, 3 * attn.head_dim)
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
        key = f"blocks.1.attn.{name}"
        now, was = dict(model.named_parameters())[key].detach(), before[key]
        torch.testing.assert_close(now[rows], was[rows] * factor, rtol=1e-6, atol=0)
        assert torch.equal(now[: 2 * hd], was[: 2 * hd]) and torch.equal(now[3 * hd :], was[3 * hd :])
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert sorted(changed) == [
        f"blocks.1.attn.{n}" for n in ("k_proj.bias", "k_proj.weight", "q_proj.bias", "q_proj.weight")
    ]
    q2, k2 = _capture(model, x)  # the same batch's max logit is now tau exactly (RoPE is linear)
    assert _logits(q2, k2, hd**-0.5)[2].item() == pytest.approx(tau, rel=1e-5)
    # a head whose largest logit is negative (tau / S < 0) is below tau: untouched (a stress run once got NaN here)
    clip.max = [None, torch.tensor([-0.5, 0.1, 0.2, 0.3])]
    w = attn.q_proj.weight.detach().clone()
    assert clip.apply() == 0 and torch.equal(attn.q_proj.weight, w)


def test_qk_clip_with_qk_norm_scales_the_gains_and_with_gqa_the_group():
    model, attn = _planted("peri,qk,inner=full")  # QK-norm over all heads: one gain slice per head
    x = torch.randint(0, 256, (2, 16))
    q, k = _capture(model, x)
    s = _logits(q, k, attn.head_dim**-0.5)
    tau = float(s[2] / 9)
    w_q, w_k = attn.q_proj.weight.detach().clone(), attn.k_norm.weight.detach().clone()
    g_q = attn.q_norm.weight.detach().clone()
    clip = QKClip(model, tau)
    model(x)
    clip.apply()
    rows = slice(2 * attn.head_dim, 3 * attn.head_dim)
    assert torch.equal(attn.q_proj.weight, w_q)  # with a QK-norm W_q does not set the logit's scale
    torch.testing.assert_close(attn.q_norm.weight[rows], g_q[rows] * math.sqrt(tau / s[2].item()))
    torch.testing.assert_close(attn.k_norm.weight[rows], w_k[rows] * math.sqrt(tau / s[2].item()))
    assert torch.equal(attn.q_norm.weight[: rows.start], g_q[: rows.start])

    model, attn = _planted("peri", n_kv_heads=2)  # GQA: q heads 2, 3 share k head 1 (Megatron's rule)
    q, k = _capture(model, x)
    s = _logits(q, k, attn.head_dim**-0.5)
    tau = float(s[2] / 4)
    w_q, w_k = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    clip = QKClip(model, tau)
    model(x)
    assert clip.apply() == 2  # both query heads of the group
    hd, root = attn.head_dim, math.sqrt(tau / s[2].item())
    torch.testing.assert_close(attn.q_proj.weight[2 * hd :], w_q[2 * hd :] * root)
    torch.testing.assert_close(attn.k_proj.weight[hd:], w_k[hd:] * root)
    assert torch.equal(attn.q_proj.weight[: 2 * hd], w_q[: 2 * hd]) and torch.equal(attn.k_proj.weight[:hd], w_k[:hd])


@pytest.mark.parametrize(
    "layout, size, kw",
    [
        ("peri", "nano", {}),
        ("attn=gAB,mlp=AB,final", "nano", {"n_kv_heads": 1}),
        ("pre", "moe-micro", {"n_layers": 2, "moe_shared_expert": True}),
    ],
    ids=["peri", "gate+gqa", "moe"],
)
def test_muon_cost_in_memory_and_flops(layout, size, kw):
    from torch.optim._muon import _zeropower_via_newtonschulz
    from torch.utils.flop_counter import FlopCounterMode

    from normlab.model.params import analytic_matrices
    from normlab.train.memory import plan_memory
    from normlab.train.mfu import newton_schulz_flops, optimizer_flops

    model = normlab.build_model(layout, size, **kw)
    measured = sum(p.numel() for p in muon_matrices(model))
    assert analytic_matrices(model.config, model.resolved) == measured
    cfg = TrainConfig.of(layout=layout, size=size, model=kw, optimizer="muon", vocab_size=256)
    n = sum(p.numel() for p in model.parameters())
    assert plan_memory(cfg).optimizer == 4 * measured + 8 * (n - measured)  # momentum; AdamW's two moments
    # Newton-Schulz's FLOPs as torch's own counter sees torch's iteration, against k (4 m^2 n + 2 m^3)
    for shape in ((64, 24), (24, 64)):
        with FlopCounterMode(display=False) as counter:
            _zeropower_via_newtonschulz(torch.randn(shape), (3.4445, -4.7750, 2.0315), 3, 1e-7)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 3) == 3 * (4 * 24 * 24 * 64 + 2 * 24**3)
    per_matrix = [tuple(p.shape[-2:]) for p in muon_matrices(model) for _ in range(p.shape[0] if p.ndim > 2 else 1)]
    assert optimizer_flops(model, "muon", 5) == sum(newton_schulz_flops(s, 5) for s in per_matrix) > 0
    assert optimizer_flops(model, "adamw", 5) == 0


def test_the_optimizer_and_the_softmax_are_sweep_axes():
    from normlab.experiments.sweep import SweepConfig

    sweep = SweepConfig(
        name="s",
        base={"size": "nano", "layout": "pre"},
        grid={"optimizer": ["adamw", "muon"], "layout.softmax": ["softmax", "sink"]},
    )
    cfgs = [s.train_config("x") for s in sweep.expand()]
    assert sorted((c.optim.optimizer, c.model.layout.softmax) for c in cfgs) == [
        ("adamw", "sink"),
        ("adamw", "softmax"),
        ("muon", "sink"),
        ("muon", "softmax"),
    ]
    assert len({s.run_id for s in sweep.expand()}) == 4
    assert {c.model.layout_label for c in cfgs} == {"pre,softmax=softmax", "pre,softmax=sink"}


def test_checkpoint_interval_stretches_only_for_saves_of_a_second_or_more(monkeypatch):
    """ckpt_every 0: the base interval, times ceil(save / (5% x step x base)) once a save takes 1 s or more
    (normlab.train.ckpt_schedule), at most half the run; the multiple only grows; the saves stay at multiples of
    the base; a set ckpt_every never changes."""
    from normlab.train import ckpt_schedule
    from normlab.train.ckpt_schedule import CheckpointSchedule, stretch
    from normlab.train.distributed import DistInfo

    assert stretch(100, 4.0, 0.07) == 12  # gpu-126m on an H200: 4 / (0.05 x 0.07 x 100) = 11.4
    assert stretch(10, 0.9, 0.001) == 1  # under a second: the base, whatever the steps cost
    assert stretch(10, 1.0, 1.0) == 2  # ten 1 s steps allow a 0.5 s save: a 1 s save needs twenty
    # start; 10 steps of 0.82 s, a 2 s save (k = 2 / (0.05 x 0.82 x 10) = 4.9 -> 5); 50 steps of 0.8 s and a quick
    # save (0.1 s: k stays 5); 50 steps and a 3 s save (k = 3 / (0.05 x 0.8 x 10) = 7.5 -> 8)
    clock = iter([0.0, 10.2, 50.3, 93.3])
    monkeypatch.setattr(ckpt_schedule, "_clock", lambda: next(clock))
    sched = CheckpointSchedule(10, True, 1000, DistInfo())
    assert [s for s in range(1, 11) if sched.due(s)] == [10]
    assert sched.saved(10, 2.0) == (50, 2.0)
    assert [s for s in range(11, 111) if sched.due(s)][:1] == [60]  # 50 steps after the last save
    assert sched.saved(60, 0.1) is None and sched.every == 50  # a quick save never shortens it
    assert sched.saved(110, 3.0) == (80, 3.0) and [s for s in range(111, 200) if sched.due(s)][:1] == [190]
    clock = iter([0.0, 15.0])  # 10 steps of 1 s, a 5 s save: k = 10, but at most half of a 60-step run
    short = CheckpointSchedule(10, True, 60, DistInfo())
    assert short.saved(10, 5.0) == (30, 5.0)
    monkeypatch.setattr(ckpt_schedule, "_clock", lambda: 0.0)
    fixed = CheckpointSchedule(3, False, 1000, DistInfo())
    assert (
        fixed.saved(3, 2.0) is None and fixed.every == 3 and [s for s in range(4, 10) if fixed.due(s)] == [6, 7, 8, 9]
    )
    assert fixed.saved(6, 2.0) is None and not fixed.due(8) and fixed.due(9)
