"""Resuming from a checkpoint this normlab does not resume: refused in one line (exit 2), nothing lost.

An FSDP run of an older release saved one gathered file per checkpoint, its optimizer state in the form of
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` (keyed by parameter name); the trainer's
branch that read it is gone. A whole-model file of today's normlab (one process, DDP) does not resume under
torchrun with --fsdp, which reads sharded checkpoints only (`normlab.train.trainer.resume_refusal`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from normlab.cli import main
from normlab.runs.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from normlab.runs.model import load_run_model
from normlab.runs.start import Start
from normlab.train import TrainConfig, train
from normlab.train.distributed import DistInfo
from normlab.train.optim import make_optimizer
from normlab.train.trainer import resume_refusal
from tests.helpers import small


def _as_old_release(run: Path, step: int) -> Path:
    """Rewrite checkpoint ``step`` of ``run`` as an FSDP run of the older release saved it (trainer.py before
    sharded checkpoints: `get_optimizer_state_dict(model, opt, StateDictOptions(full_state_dict=True,
    cpu_offload=True))`, the flat configuration, world size 2) and drop what came after it (a run killed
    there). Returns the checkpoint's path."""
    path = next(p for p in list_checkpoints(run) if p.name == f"step_{step:08d}.pt")
    for later in list_checkpoints(run):
        if later.name > path.name:
            later.unlink()
            later.with_name(later.name + ".sha256").unlink()
    (run / "summary.json").unlink()
    ckpt = load_checkpoint(path)
    loaded = load_run_model(path)
    opt = make_optimizer(loaded.model, loaded.config)
    opt.load_state_dict(ckpt["optimizer"])
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ckpt["optimizer"] = get_optimizer_state_dict(loaded.model, opt, options=opts)
    flat = {**loaded.config.to_flat(), "fsdp": True}
    ckpt["config"] = flat
    save_checkpoint(run, step, ckpt, keep_last=5)
    record = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**record, "config": flat, "world_size": 2}))
    return path


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"  # the lock file: its holder while held, nothing once released
    }


def test_a_checkpoint_of_an_old_release_fsdp_run_is_refused_in_one_line(corpus, tmp_path, capsys):
    cfg = small(corpus, tmp_path / "old", steps=4, ckpt_every=2, keep_last=5, eval_every=2, seq_len=16, batch_size=4)
    train(cfg)
    path = _as_old_release(Path(cfg.run.out), 2)
    names = load_checkpoint(path)["optimizer"]["param_groups"][0]["params"]
    assert names and all(isinstance(n, str) for n in names)  # keyed by name, as that release saved it
    before = _digests(Path(cfg.run.out))
    capsys.readouterr()

    assert main(["train", *cfg.to_args()]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no "resuming from" note before the refusal
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "was written by an old normlab release" in err and f"--init-from {path}" in err
    assert _digests(Path(cfg.run.out)) == before  # nothing written, nothing lost

    # what the line advises runs: a new run from the old checkpoint's weights
    fresh = tmp_path / "fresh"
    assert main(["train", *small(corpus, fresh, steps=2, eval_every=0, seq_len=16, batch_size=4).to_args(),
                 "--init-from", str(path)]) == 0  # fmt: skip
    assert json.loads((fresh / "summary.json").read_text())["status"] == "ok"


def _adamw_state(by_name: bool) -> dict:
    """A real optimizer state after one step: numbered (`Optimizer.state_dict`, what normlab saves) or keyed
    by parameter name (`get_optimizer_state_dict`, what the older release's FSDP runs saved)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return get_optimizer_state_dict(model, opt) if by_name else opt.state_dict()


@pytest.mark.parametrize(
    ("by_name", "fsdp", "world", "refused"),
    [
        (False, False, 1, None),  # today's whole-model file, one process
        (False, False, 2, None),  # ... under DDP
        (False, True, 1, None),  # ... --fsdp in one process (nothing to shard: whole files)
        (False, True, 2, "is a whole-model checkpoint"),  # ... under torchrun --fsdp: sharded ones only
        (True, False, 1, "was written by an old normlab release"),  # the older release's FSDP file, anywhere
        (True, True, 2, "was written by an old normlab release"),
    ],
)
def test_which_whole_model_checkpoints_resume_where(by_name, fsdp, world, refused):
    ckpt = {"step": 2, "model": {}, "optimizer": _adamw_state(by_name)}
    start = Start(step=2, path=Path("run/checkpoints/step_00000002.pt"), checkpoint=ckpt)
    cfg = TrainConfig.of(fsdp=fsdp)
    said = resume_refusal(start, cfg, DistInfo(world=world))
    if refused is None:
        assert said is None
    else:
        assert said is not None and refused in said and "--init-from run/checkpoints/step_00000002.pt" in said
    # no checkpoint, a sharded folder: nothing to refuse; a whole file without optimizer state (a final one):
    # refused only where a file of today's is
    assert resume_refusal(Start(), cfg, DistInfo(world=world)) is None
    sharded = Start(step=2, path=start.path, checkpoint={**ckpt, "sharded": Path("step_00000002.dcp")})
    assert resume_refusal(sharded, cfg, DistInfo(world=world)) is None
    bare = Start(step=2, path=start.path, checkpoint={"step": 2, "model": {}})
    assert (resume_refusal(bare, cfg, DistInfo(world=world)) is None) == (fsdp is False or world == 1)
