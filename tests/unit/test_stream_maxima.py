"""TrainingMonitor's per-step stream maxima (normlab.diagnostics.stream_maxima) for a model normlab did not build:
the rows against the block boundaries' max |x| computed here, no-grad and probe forwards left out, and the
stream-growth alert raised from a foreign loop whose stream grows toward fp16's maximum."""

from __future__ import annotations

import json

import torch

from normlab.diagnostics.training_monitor import TrainingMonitor


class Residual(torch.nn.Module):
    """A block that returns the stream, as a transformers decoder layer does: h + W h."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, h):
        return h + self.linear(h)


class Stack(torch.nn.Module):
    """A foreign residual stack of `Residual` blocks on the embedding times ``gain``, a buffer the test raises."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(3))
        self.head = torch.nn.Linear(8, 16)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        h = self.embed(x) * self.gain
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def boundaries(model: Stack, x: torch.Tensor) -> list[float]:
    """max |h| entering block 0 and leaving each block, by hand (the same arithmetic as the forward)."""
    with torch.no_grad():
        h = model.embed(x) * model.gain
        out = [h.abs().max().item()]
        for block in model.blocks:
            h = h + block.linear(h)
            out.append(h.abs().max().item())
    return out


def test_rows_are_each_steps_boundary_maxima_over_its_training_forwards(tmp_path):
    model = Stack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=100, spike=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    want = []
    for step in range(3):
        micro = [torch.randint(0, 16, (2, 5), generator=gen) for _ in range(2)]  # two micro-batches a step
        want.append([max(a, b) for a, b in zip(*(boundaries(model, x) for x in micro))])
        for x in micro:
            model(x).float().logsumexp(-1).mean().backward()
        with torch.no_grad():  # an evaluation forward between: not the step's
            model.gain.fill_(100.0)
            model(micro[0])
            model.gain.fill_(1.0)
        monitor.step(step)
        opt.step()
        opt.zero_grad()
    monitor.close()  # its last probe pass (no grad, paused) writes no row
    rows = [json.loads(line) for line in (tmp_path / "m" / "layers.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row, expected in zip(rows, want):
        assert row["stream_max"] == [float(torch.tensor(v)) for v in expected]  # the same float32 values
        assert len(row["stream_max"]) == 4  # entering block 0, then leaving each of the 3


def test_a_step_without_a_training_forward_writes_no_row(tmp_path):
    model = Stack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=100, spike=None)
    x = torch.randint(0, 16, (2, 5))
    model(x).float().mean().backward()
    monitor.step(0)
    with torch.no_grad():
        model(x)
    monitor.step(1)  # no training forward since step 0
    monitor.close()
    rows = [json.loads(line) for line in (tmp_path / "m" / "layers.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]


def test_a_growing_stream_raises_the_stream_growth_alert_in_a_foreign_loop(tmp_path, capsys):
    """The stream's scale doubles every few steps toward fp16's 65,504: the alert fires before the maximum is
    reached, names the layer, and is in warnings.jsonl, the summary and on stderr."""
    model = Stack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=100, spike=None, precision="fp16")
    x = torch.randint(0, 16, (2, 5))
    base = boundaries(model, x)[-1]
    fired_at, crossed_at = None, None
    for step in range(200):
        model.gain.fill_(2 ** (step / 4))
        model(x).float().mean().backward()
        monitor.step(step)
        model.zero_grad()
        if crossed_at is None and base * 2 ** (step / 4) > 65504:
            crossed_at = step
        if fired_at is None and (tmp_path / "m" / "warnings.jsonl").exists():
            fired_at = step
    summary = monitor.close()
    alerts = [json.loads(line) for line in (tmp_path / "m" / "warnings.jsonl").read_text().splitlines()]
    growth = [a for a in alerts if a["signal"] == "stream growth"]
    assert growth and "stream layer" in growth[0]["where"]
    assert fired_at is not None and crossed_at is not None and fired_at < crossed_at
    assert any(a["signal"] == "stream growth" for a in summary["warnings"])
    assert "stream growth" in capsys.readouterr().err
