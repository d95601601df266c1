"""Memory for large models: the chunked loss and activation checkpointing compute the same numbers
while keeping far fewer bytes for the backward (measured with autograd's saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from normlab.model import build_model
from normlab.model.loss import lm_loss
from normlab.train import train
from tests.helpers import rows, small


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``fn()`` runs its forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _head_case(vocab=512, d=16, n=(3, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=g) * 0.3)
    h = torch.randn(*n, d, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, n, generator=g)
    y[0, :7] = -100  # ignored positions (SFT prompts)
    return head, h, y


@pytest.mark.parametrize("softcap,z", [(None, 0.0), (30.0, 1e-3)])
def test_chunked_loss_equals_the_formula_and_its_gradients(softcap, z):
    head, h, y = _head_case()
    # the formula, written out: CE over non-ignored targets + z * mean over all positions of logsumexp^2
    logits = head(h)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    flat = logits.flatten(0, 1).double()
    keep = y.flatten() != -100
    ce = -(flat.log_softmax(-1)[keep, y.flatten()[keep]]).mean()
    want = ce + z * flat.logsumexp(-1).pow(2).mean()
    g_want = torch.autograd.grad(want, [h, head.weight])
    for chunk in (0, 7, 40, 1000):  # one pass, chunks that do not divide 120 tokens, exact, larger than all
        loss, out_logits = lm_loss(head, h, y, softcap, z, chunk)
        assert (out_logits is None) == (0 < chunk < 120)
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        for a, b in zip(torch.autograd.grad(loss, [h, head.weight]), g_want):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-7)


def test_chunked_loss_keeps_no_float32_logits_for_the_backward():
    head, h, y = _head_case(vocab=4096, n=(4, 128))
    whole, _ = saved_bytes(lambda: lm_loss(head, h, y, chunk=0))
    chunked, _ = saved_bytes(lambda: lm_loss(head, h, y, chunk=64))
    logits_bytes = 4 * 128 * 4096 * 4
    assert whole >= logits_bytes  # the unchunked loss keeps the whole batch's float32 logits (softmax)
    assert chunked < logits_bytes / 10  # chunked: each chunk's input only; the logits are recomputed


def test_activation_checkpointing_same_numbers_far_less_saved():
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    plain = build_model("peri", "nano", seed=0, n_layers=6)
    ckpt = build_model("peri", "nano", seed=0, n_layers=6)
    ckpt.activation_checkpointing = True
    b_plain, out_plain = saved_bytes(lambda: plain(x, targets=x).loss)
    b_ckpt, out_ckpt = saved_bytes(lambda: ckpt(x, targets=x).loss)
    assert out_ckpt.item() == out_plain.item()
    out_plain.backward()
    out_ckpt.backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)
    # the checkpointed forward keeps each block's input only (and the head); the plain one every activation
    assert b_ckpt < b_plain / 4, (b_ckpt, b_plain)


def test_activation_checkpointing_is_off_for_probes_and_evaluation():
    m = build_model("peri", "nano", seed=0)
    m.activation_checkpointing = True
    x = torch.randint(0, 256, (1, 16))
    out = m(x, targets=x, return_hidden_states=True)  # probes take gradients w.r.t. the hidden states
    grads = torch.autograd.grad(out.loss, list(out.hidden_states))
    assert all(g is not None for g in grads)
    with torch.no_grad():
        assert m(x, targets=x).loss.item() == pytest.approx(out.loss.item())


def test_training_with_checkpointing_and_a_chunked_loss_follows_the_same_curve(corpus, tmp_path):
    base = dict(steps=6, eval_every=3, probe_every=3, z_loss=1e-4, grad_accum=2)
    train(small(corpus, tmp_path / "plain", loss_chunk=0, **base))
    train(small(corpus, tmp_path / "lean", activation_checkpointing=True, loss_chunk=48, **base))
    a, b = rows(tmp_path / "plain"), rows(tmp_path / "lean")
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        assert y.get("val_loss", 0) == pytest.approx(x.get("val_loss", 0), rel=1e-5)


def test_reference_cross_entropy_is_what_F_computes():
    # guards the hand formula above against a sign or indexing slip
    head, h, y = _head_case()
    logits = head(h).flatten(0, 1)
    keep = y.flatten() != -100
    manual = -(logits.log_softmax(-1)[keep, y.flatten()[keep]]).mean()
    assert manual.item() == pytest.approx(F.cross_entropy(logits, y.flatten(), ignore_index=-100).item(), rel=1e-6)


@pytest.mark.slow  # quick: test_train's compiled-vs-eager test and the checkpointed, chunked run above
def test_compiled_bf16_with_checkpointing_and_chunks_follows_eager(corpus, tmp_path):
    """torch.compile traces the norms' autocast switch, the recomputed blocks and the loss chunks."""
    base = dict(steps=4, eval_every=4, probe_every=0, precision="bf16")
    train(small(corpus, tmp_path / "eager", loss_chunk=0, **base))
    train(small(corpus, tmp_path / "compiled", compile=True, activation_checkpointing=True, loss_chunk=48, **base))
    for x, y in zip(rows(tmp_path / "eager"), rows(tmp_path / "compiled")):
        assert y["loss"] == pytest.approx(x["loss"], rel=2e-2)


@pytest.mark.parametrize(
    "layout,size,dtype,seq",
    [
        ("pre", "micro-deep", "fp32", 128),
        ("peri", "micro-deep", "fp16", 128),
        ("olmo2", "nano", "fp32", 48),
        ("hybrid", "nano", "fp16", 48),
    ],
)
def test_the_memory_plan_matches_a_whole_model_measurement(layout, size, dtype, seq):
    """The plan measures one and two layers on short sequences and scales to the run; here the whole
    model, at the run's depth, batch and length, is measured directly: the activations agree to 5%."""
    from normlab.config.train import TrainConfig
    from normlab.model import build_model
    from normlab.model import storage as storage_mod
    from normlab.train.memory import plan_memory

    cfg = TrainConfig.of(
        layout=layout, size=size, batch_size=4, seq_len=seq, precision="fp32", activation_dtype=dtype, vocab_size=256
    )
    plan = plan_memory(cfg)
    model = build_model(layout, size, seed=0, vocab_size=256).train()
    model.set_storage(storage_mod.for_run(cfg.run.precision, cfg.stored_dtype))
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}  # resident already
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    x = torch.randint(0, 256, (4, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, targets=x, loss_chunk=cfg.run.loss_chunk)
    measured = sum(seen.values())
    assert abs(plan.activations - measured) <= 0.05 * measured, (plan.activations, measured)
    assert plan.weights == 4 * plan.params and plan.optimizer == 8 * plan.params  # AdamW, float32 masters


def test_a_run_that_cannot_fit_is_refused_before_it_starts_with_options_that_fit():
    from normlab.config.train import TrainConfig
    from normlab.train.memory import GIB, fitting_options, plan_memory, plan_workers

    cfg = TrainConfig.of(layout="peri", size="micro-deep", batch_size=64, seq_len=128)
    need = plan_memory(cfg).total
    capacity = int(need - 0.5 * (need - plan_memory(cfg.with_({"activation_checkpointing": True})).total))
    options = fitting_options(cfg, capacity)
    assert options and all(float(o.rsplit(": ", 1)[1].split()[0]) * GIB <= capacity + 0.05 * GIB for o in options), (
        options
    )
    # a sweep on GPUs: as many workers as fit by memory, one per device at least, never more than runs
    assert plan_workers([10 * GIB] * 8, [80 * GIB], None, 16) == 7
    assert plan_workers([100 * GIB] * 8, [80 * GIB], None, 16) == 1
    assert plan_workers([10 * GIB] * 8, [80 * GIB, 80 * GIB], None, 16) == 8
    assert plan_workers([10 * GIB] * 3, [], None, 16) == 3  # CPU: one per core, at most the runs


def test_a_sweep_on_cuda_plans_its_workers_by_memory(monkeypatch):
    """What the runner does when its runs ask for CUDA (a CPU stand-in for the device's memory): the
    largest run's plan and the device's memory decide how many run side by side, not the CPU count."""
    from types import SimpleNamespace

    from normlab.experiments.runner import _gpu_plan
    from normlab.experiments.sweep import SweepConfig
    from normlab.train.memory import plan_memory

    sweep = SweepConfig(
        name="g",
        base={"size": "micro-deep", "batch_size": 64, "seq_len": 128, "device": "cuda"},
        grid={"layout": ["pre", "peri"], "seed": [0, 1, 2]},
    )
    specs = sweep.expand()
    need = max(plan_memory(s.train_config("x")).total for s in specs)
    lines = []
    for capacity, expected in ((int(need * 3.5), 3), (int(need * 0.5), 1)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, c=capacity: SimpleNamespace(total_memory=c))
        assert _gpu_plan(specs, None, lines.append) == (expected, 1)
    assert "side by side" in lines[0]
    cpu = SweepConfig(name="c", base={"size": "nano", "device": "cpu"}, grid={"seed": [0, 1]}).expand()
    assert _gpu_plan(cpu, None, lines.append) is None  # CPU runs: one per core, as before
