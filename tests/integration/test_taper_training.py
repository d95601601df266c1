"""TaperNorm through the trainer (Kanavalau et al. 2026, arXiv 2602.10408): the step hook tapers the gate to 0 by the
run's end, the calibration and gate are saved with the weights, a resumed run follows the same schedule, and the
trained model folds away with its logits."""

from __future__ import annotations

import pytest
import torch

import normlab
from normlab.data import TokenData
from normlab.model.norms import TaperNorm
from normlab.model.taper_fold import fold_tapered
from normlab.runs.checkpoint import load_checkpoint
from normlab.train import train
from tests.helpers import losses, small

EPS32 = torch.finfo(torch.float32).eps


def test_a_taper_run_ends_tapered_and_resumes_on_the_same_schedule(corpus, tmp_path, monkeypatch):
    full = small(corpus, tmp_path / "full", layout="pre-taper")
    train(full)
    state = load_checkpoint(tmp_path / "full" / "checkpoints" / "step_00000012.pt")["model"]
    gates = {k: v for k, v in state.items() if k.endswith(".gate")}
    assert gates and all(v.item() == 0.0 for v in gates.values())  # 12 steps: the taper ends at step 9
    assert all(state[k.replace(".gate", ".calibrated")].item() == 1.0 for k in gates)
    assert all(state[k.replace(".gate", ".coeff")].item() != 1.0 for k in gates)

    real = TokenData.train_window

    def failing(self, step, *a, **k):
        if step == 8:  # inside the taper, after the calibration at step 4
            raise KeyboardInterrupt("simulated interruption")
        return real(self, step, *a, **k)

    cut = small(corpus, tmp_path / "cut", layout="pre-taper", ckpt_every=3)
    monkeypatch.setattr(TokenData, "train_window", failing)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    monkeypatch.setattr(TokenData, "train_window", real)
    train(cut)
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")

    model = normlab.build_model("pre-taper", "nano", vocab_size=state["embed.weight"].shape[0]).eval()
    model.load_state_dict(state)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        before = model(x).logits
        assert fold_tapered(model) == 2 * model.config.n_layers
        after = model(x).logits
    assert not any(isinstance(m, TaperNorm) for m in model.modules())
    scale = before.abs().max().item()
    torch.testing.assert_close(after, before, rtol=0, atol=4 * model.config.d_model * 2 * EPS32 * scale)
