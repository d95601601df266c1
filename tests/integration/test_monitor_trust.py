"""What `TrainingMonitor` and the Trainer and Lightning callbacks measure, against the trainers' own numbers
(issue 51, items 2 and 3).

Each trainer here clips hard (a clip norm about 1/100 of the gradient norm), so a norm read after the clip, or
over the blocks only, is off by far more than the tolerance: the recorded ``grad_norm`` must equal the norm
the trainer clipped from, over every parameter, to 1e-4 relative. Then the blocks a monitor attaches to
(torchtitan's ModuleDict, ``blocks=``) and the steps and models it refuses.
"""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import normlab
from normlab.diagnostics.training_monitor import TrainingMonitor
from normlab.errors import ConfigError
from tests.helpers import TINY_LLAMA

tf = pytest.importorskip("transformers")

SMALL = TINY_LLAMA
CLIP = 0.01  # a tiny Llama's gradient norm at init is ~0.8: every step is clipped by ~80x
REL = 1e-4


def llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))


def total_norm(model: torch.nn.Module) -> float:
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


class TinyStack(torch.nn.Module):
    """torchtitan's layout in miniature: blocks in an nn.ModuleDict keyed "0", "1", ..., a head outside them,
    logits out (the loss is computed by the loop)."""

    def __init__(self, keys=("0", "1", "2")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleDict(
            {k: torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)) for k in keys}
        )
        self.output = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = h + layer(h)
        return self.output(h)


def train_tiny(model, monitor, steps, clip=CLIP, start=0, scaler=None):
    """A plain loop that clips and then calls monitor.step (after the clip, as a torchtitan loop may):
    clip_grad_norm_'s returned norms, per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    returned = []
    for step in range(start, start + steps):
        x = torch.randint(0, 16, (4, 6), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        returned.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        monitor.step(step, loss=loss)
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        opt.zero_grad()
    return returned


# -- HF Trainer --


def test_trainer_callback_records_the_norm_the_trainer_clipped_from(tmp_path):
    """transformers clips before on_pre_optimizer_step (the gradients there have norm max_grad_norm); the
    callback's grad_norm is the Trainer's own logged grad_norm (the pre-clip norm over every parameter), under
    gradient accumulation; the blocks' norms are only part of it."""
    from normlab.hf.callback import NormlabCallback

    at_event = []

    class SeesClipped(tf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            at_event.append(total_norm(model))

    model = llama()
    args = tf.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        max_grad_norm=CLIP,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    data = [{"input_ids": t, "labels": t} for t in tokens(32)]
    trainer = tf.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[NormlabCallback(every=2), SeesClipped()]
    )
    trainer.train()
    theirs = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    ours = metrics(tmp_path / "hf" / "normlab")
    logged = [r["step"] for r in trainer.state.log_history if "grad_norm" in r]
    assert [r["step"] for r in ours] == logged == [1, 2, 3, 4]  # the Trainer's step numbers
    assert min(theirs) > 30 * CLIP  # the clip bites
    assert at_event == pytest.approx([CLIP] * 4, rel=1e-3)  # what the event itself sees: the clipped gradients
    for mine, logged in zip(ours, theirs):
        assert mine["grad_norm"] == pytest.approx(logged, rel=REL)
    record = json.loads((tmp_path / "hf" / "normlab" / "config.json").read_text())
    assert "before any clipping" in record["grad_norm"]["at"] and "every parameter" in record["grad_norm"]["of"]
    run = normlab.load_run(tmp_path / "hf" / "normlab")
    blocks = run.probe("block", "grad_norm").loc[1]  # the first step's
    assert math.sqrt((blocks**2).sum()) < 0.999 * ours[0]["grad_norm"]  # embeddings and head count too


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_trainer_callback_warns_through_a_blow_up_from_its_first_steps(precision, tmp_path, capsys):
    """A tiny Llama trained by the Trainer at lr 1.0 blows up in its first steps (the loss from ~ln 96 to past
    15 at step 2), long before any spike rule has its history. The callback reads the precision from the
    Trainer's fp16 / bf16 argument (on the CPU no GradScaler is made) and warns from the first steps on the
    absolute rules: the loss-rise rule at the first step whose loss is more than LOSS_RISE above step 1's,
    and in fp16 the stream at the first step whose largest |x| is within 8x of 65,504: each at the step the
    rule gives on the Trainer's own numbers, on stderr, in warnings.jsonl and in summary.json (status
    warned, not ok). Steps are the Trainer's: row N holds the loss the Trainer logged at global_step N."""
    from normlab.diagnostics.early_warning import LOSS_RISE
    from normlab.diagnostics.stats import FP16_MAX, OVERFLOW_HEADROOM
    from normlab.hf.callback import NormlabCallback

    args = tf.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=40,
        per_device_train_batch_size=4,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **{precision: True},
    )
    data = [{"input_ids": t, "labels": t} for t in tokens(160)]
    trainer = tf.Trainer(model=llama(), args=args, train_dataset=data, callbacks=[NormlabCallback(every=10)])
    trainer.train()
    err = capsys.readouterr().err
    folder = tmp_path / "hf" / "normlab"
    theirs = {r["step"]: r["loss"] for r in trainer.state.log_history if "grad_norm" in r}
    ours = metrics(folder)
    assert [r["step"] for r in ours] == sorted(theirs) == list(range(1, 41))
    for row in ours:
        assert row["loss"] == pytest.approx(theirs[row["step"]], rel=1e-3)  # same step, same loss

    rise = next(s for s in sorted(theirs) if theirs[s] > theirs[1] + LOSS_RISE)  # the rule on their numbers
    streams = {r["step"]: max(r["stream_max"]) for r in map(json.loads, (folder / "layers.jsonl").open())}
    expected = {"loss rise": rise}
    if precision == "fp16":
        expected["stream growth"] = next(s for s in sorted(streams) if streams[s] * OVERFLOW_HEADROOM >= FP16_MAX)
    live = [json.loads(line) for line in (folder / "warnings.jsonl").read_text().splitlines()]
    assert {a["signal"]: a["step"] for a in live} == expected and max(expected.values()) <= 40
    for a in live:
        assert f"normlab warning at step {a['step']}: {a['signal']}" in err
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "warned" and summary["precision"] == precision
    assert summary["reason"].startswith(f"normlab warning at step {rise}: loss rise")
    assert summary["spikes"] == 1  # the loss-rise step's batch is captured, as a spike's is
    assert (folder / "spikes" / f"step_{rise}.pt").is_file()
    from normlab.diagnostics.run_report import reading_lines

    said = reading_lines([normlab.load_run(folder)], ["hf"])
    assert f"hf trained with early warnings: {summary['reason']}." in said


def test_trainer_callback_precision_from_its_argument_the_trainers_or_the_model(tmp_path):
    from normlab.hf.callback import NormlabCallback, precision_of

    model = llama()
    assert precision_of(SimpleNamespace(fp16=True, bf16=False), model) == "fp16"
    assert precision_of(SimpleNamespace(fp16=False, bf16=True), model) == "bf16"
    assert precision_of(SimpleNamespace(), model) == "fp32"
    assert precision_of(SimpleNamespace(), model.to(torch.bfloat16)) == "bf16"
    assert precision_of(SimpleNamespace(), model.to(torch.float16)) == "fp16"
    with pytest.raises(ConfigError, match=r"^NormlabCallback: precision must be one of fp16, bf16, fp32 .*'fp8'$"):
        NormlabCallback(tmp_path / "x", precision="fp8")
    callback = NormlabCallback(tmp_path / "given", precision="fp16")
    callback.on_train_begin(SimpleNamespace(output_dir=str(tmp_path), bf16=True), None, None, model=llama())
    assert callback.monitor.warnings.precision == "fp16"  # the parameter wins over the Trainer's arguments
    callback.on_train_end(None, None, None)


def drive_callback(callback, folder, scaler=None, clip=CLIP, **given):
    """The Trainer's order of events, by hand, for two steps: the backward of the loss times the scale (the
    scaler's, else 1024: loss scaling the callback is not told of), unscaling, the clip, on_pre_optimizer_step.
    The norms clip_grad_norm_ returned."""
    model = llama()
    args = SimpleNamespace(output_dir=str(folder), max_grad_norm=clip, **given)
    callback.on_train_begin(args, None, None, model=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    returned = []
    for step in range(2):
        x = tokens(4, seed=step)
        loss = model(input_ids=x, labels=x).loss
        (scaler.scale(loss) if scaler else loss * 1024.0).backward()
        if scaler:
            scaler.unscale_(opt)
        else:
            for p in model.parameters():
                p.grad /= 1024.0
        returned.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        callback.on_pre_optimizer_step(args, SimpleNamespace(global_step=step), None)
        (scaler.step(opt), scaler.update()) if scaler else opt.step()
        opt.zero_grad()
    callback.on_train_end(args, None, None)
    return returned


def test_trainer_callback_under_loss_scaling(tmp_path):
    """fp16 loss scaling (accelerate's GradScaler, on any device but the CPU; no event passes it): given the
    scaler, the callback records the norm the clip started from; an fp16 run on a GPU without it records the
    clipped norm, warns, and config.json says so; loss scaling it was not told of is caught on a step the clip
    leaves alone (the gradients at the event are not the backward's), recorded as the event has them, once
    warned."""
    from normlab.hf.callback import AFTER_CLIP, NormlabCallback

    callback = NormlabCallback(tmp_path / "given", every=100)
    callback.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # as trainer.accelerator.scaler
    returned = drive_callback(callback, tmp_path / "given", scaler=callback.grad_scaler)
    assert min(returned) > 30 * CLIP
    assert [r["grad_norm"] for r in metrics(tmp_path / "given")] == pytest.approx(returned, rel=REL)

    gpu = dict(fp16=True, device=SimpleNamespace(type="cuda"))
    with pytest.warns(UserWarning, match=r"fp16 scales the gradients .* trainer\.accelerator\.scaler") as warned:
        drive_callback(NormlabCallback(tmp_path / "fp16", every=100), tmp_path / "fp16", **gpu)
    assert len(warned) == 1
    assert [r["grad_norm"] for r in metrics(tmp_path / "fp16")] == pytest.approx([CLIP, CLIP], rel=REL)
    assert json.loads((tmp_path / "fp16" / "config.json").read_text())["grad_norm"]["at"] == AFTER_CLIP

    with pytest.warns(UserWarning, match=r"are not the backward's .* clipped to max_grad_norm=1e\+09") as warned:
        returned = drive_callback(NormlabCallback(tmp_path / "untold", every=100), tmp_path / "untold", clip=1e9)
    assert len(warned) == 1
    assert [r["grad_norm"] for r in metrics(tmp_path / "untold")] == pytest.approx(returned, rel=REL)


def test_trainer_callback_refuses_a_missing_model(tmp_path):
    from normlab.hf.callback import NormlabCallback

    with pytest.raises(ConfigError, match=r"needs the model being trained .* got NoneType"):
        NormlabCallback(tmp_path / "m").on_train_begin(
            SimpleNamespace(output_dir=str(tmp_path)), None, None, model=None
        )
    assert not (tmp_path / "m").exists()


# -- Lightning --


def test_lightning_callback_records_the_norm_before_gradient_clip_val(tmp_path):
    """Lightning clips after on_before_optimizer_step: the callback's grad_norm is Lightning's own grad_norm
    utility in that hook (before the clip; the optimizer then sees norm gradient_clip_val), one row per
    optimizer step under accumulate_grad_batches=2, with the mean loss of the accumulated batches."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.utilities import grad_norm

    from normlab.diagnostics.lightning import NormlabLightningCallback

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = llama()
            self.before, self.stepped, self.losses = [], [], []

        def training_step(self, batch, i):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):  # after the callbacks' hook, before the clip
            self.before.append(grad_norm(self, norm_type=2)["grad_2.0_norm_total"].item())

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.stepped.append(total_norm(self))  # what the optimizer steps with

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lit = Lit()
    loader = torch.utils.data.DataLoader(tokens(16), batch_size=2)
    L.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[NormlabLightningCallback(tmp_path / "lit", every=100)],
        default_root_dir=str(tmp_path),
    ).fit(lit, loader)
    rows = metrics(tmp_path / "lit")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert min(lit.before) > 30 * CLIP and lit.stepped == pytest.approx([CLIP] * 4, rel=1e-3)  # the clip bites
    for row, before, pair in zip(rows, lit.before, zip(lit.losses[::2], lit.losses[1::2])):
        assert row["grad_norm"] == pytest.approx(before, rel=REL)
        assert row["loss"] == pytest.approx(sum(pair) / 2, rel=1e-6)


# -- TrainingMonitor in a plain loop --


def test_monitor_records_the_norm_before_the_loops_clip_over_every_parameter(tmp_path):
    """monitor.step called after clip_grad_norm_ still records the norm clip_grad_norm_ returned (the gradients
    as the backward left them), over every parameter: the head and the embedding included."""
    model = TinyStack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=1)
    returned = train_tiny(model, monitor, 3)
    monitor.close()
    rows = metrics(tmp_path / "m")
    assert min(returned) > 30 * CLIP
    assert [r["grad_norm"] for r in rows] == pytest.approx(returned, rel=REL)
    run = normlab.load_run(tmp_path / "m")
    assert run.probe("block", "grad_norm").columns.tolist() == [0, 1, 2]
    assert sorted(run.probes[run.probes.metric == "grad_norm"].site.unique()) == [
        "1",
        "block",
    ]  # layers.K.1: the Linear
    blocks = run.probe("block", "grad_norm").loc[1]  # the first step's
    assert math.sqrt((blocks**2).sum()) < 0.999 * rows[0]["grad_norm"]


def test_monitor_divides_by_the_grad_scalers_scale(tmp_path):
    """fp16 loss scaling: the backward leaves gradients times the scale (2**10 here); with grad_scaler the
    monitor records the unscaled norm, the one clip_grad_norm_ returns after unscale_."""
    model = TinyStack()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainingMonitor(model, tmp_path / "m", every=100, grad_scaler=scaler)
    returned = train_tiny(model, monitor, 3, scaler=scaler)
    monitor.close()
    assert [r["grad_norm"] for r in metrics(tmp_path / "m")] == pytest.approx(returned, rel=REL)
    with pytest.raises(ConfigError, match="grad_scaler must be"):
        TrainingMonitor(model, tmp_path / "bad", grad_scaler=2.0)


def test_module_dict_blocks_and_explicit_blocks(tmp_path):
    """A ModuleDict of blocks is found; blocks= takes the container, its path, or a list of modules, and its
    keys are kept in config.json when they are not 0..n-1 (a pipeline stage's layers "3", "4"); a blocks= that
    is not the model's is refused before any folder is made."""
    model = TinyStack(keys=("3", "4"))
    for i, blocks in enumerate([None, "layers", model.layers, list(model.layers.values())]):
        monitor = TrainingMonitor(model, tmp_path / f"m{i}", every=1, blocks=blocks)
        train_tiny(model, monitor, 1)
        monitor.close()
        record = json.loads((tmp_path / f"m{i}" / "config.json").read_text())
        assert record.get("block_names") == (["3", "4"] if i < 3 else None)  # a list: numbered as given
        assert sorted(normlab.load_run(tmp_path / f"m{i}").probe("stream", "rms").columns) == [0, 1, 2]
    other = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    for bad, match in [
        ("blocks", "has no submodule at that path"),
        (other, "each a module of the model"),
        (torch.nn.Linear(8, 8), "must be an nn.ModuleList"),
        ([], "at least one module"),
    ]:
        with pytest.raises(ConfigError, match=match):
            TrainingMonitor(model, tmp_path / "bad", blocks=bad)
    with pytest.raises(ConfigError, match="no nn.ModuleList or nn.ModuleDict"):
        TrainingMonitor(torch.nn.Linear(2, 2), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "bad, match",
    [
        (float("nan"), r"whole number >= 0 .* got nan"),
        (-1, r"whole number >= 0 .* got -1"),
        (2.5, r"whole number >= 0 .* got 2.5"),
        (3.0, r"whole number >= 0 .* got 3.0"),
        (True, r"whole number >= 0 .* got True"),
        ("4", r"whole number >= 0 .* got '4'"),
        (1, r"step 1 does not come after the last step recorded \(2\)"),
        (2, r"step 2 does not come after the last step recorded \(2\)"),
    ],
)
def test_nonsense_steps_are_refused_and_never_written(tmp_path, bad, match):
    model = TinyStack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=1)
    train_tiny(model, monitor, 3)  # steps 0, 1, 2
    before = (tmp_path / "m" / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=match) as caught:
        monitor.step(bad)
    assert "\n" not in str(caught.value)
    monitor.step(3)  # a refusal leaves the monitor usable
    summary = monitor.close()
    assert [r["step"] for r in metrics(tmp_path / "m")] == [0, 1, 2, 3]
    assert (tmp_path / "m" / "metrics.jsonl").read_bytes().startswith(before)
    assert monitor.close() == summary  # a second close writes nothing new


def test_a_step_after_close_a_bad_loss_and_a_missing_model_are_refused(tmp_path):
    model = TinyStack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=1)
    train_tiny(model, monitor, 2)
    with pytest.raises(ConfigError, match="loss must be a number"):
        monitor.step(5, loss="low")
    monitor.close()
    written = (tmp_path / "m" / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="this monitor was closed"):
        monitor.step(7)
    assert (tmp_path / "m" / "metrics.jsonl").read_bytes() == written
    assert [r["step"] for r in metrics(tmp_path / "m")] == [0, 1]
    for missing in (None, "model.pt"):
        with pytest.raises(ConfigError, match=r"needs the model being trained \(a torch.nn.Module\)"):
            TrainingMonitor(missing, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # steps of numpy and torch integer types are whole numbers
        np = pytest.importorskip("numpy")
        again = TrainingMonitor(model, tmp_path / "n", every=10)
        train_tiny(model, SimpleNamespace(step=lambda s, loss: again.step(np.int64(s), loss=loss)), 1)
        again.step(torch.tensor(4), loss=1.0)
        again.close()
    assert [r["step"] for r in metrics(tmp_path / "n")] == [0, 4]


def test_monitor_raises_live_early_warnings_in_another_loop(tmp_path, capsys):
    """The early warnings in someone else's loop: 40 steps of an ordinary loss, then one 30x as large: a loss
    spike (OLMo-core's rule over the previous 32) on stderr, in warnings.jsonl and in summary.json; a bad
    precision is refused in one line before anything is written."""
    model = TinyStack()
    monitor = TrainingMonitor(model, tmp_path / "m", every=100, precision="fp16")
    for step in range(41):
        x = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        (loss * (30.0 if step == 40 else 1.0)).backward()
        monitor.step(step, loss=loss.item() * (30.0 if step == 40 else 1.0))
        model.zero_grad()
    monitor.close()
    live = [json.loads(line) for line in (tmp_path / "m" / "warnings.jsonl").read_text().splitlines()]
    assert "loss spike" in [a["signal"] for a in live] and all(a["step"] == 40 for a in live)
    assert "normlab warning at step 40: loss spike" in capsys.readouterr().err
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert [a["signal"] for a in summary["warnings"]] == [a["signal"] for a in live]
    with pytest.raises(ConfigError, match="precision must be fp16, bf16 or fp32"):
        TrainingMonitor(model, tmp_path / "bad", precision="fp8")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "given, precision", [("16-mixed", "fp16"), ("16-true", "fp16"), ("bf16-mixed", "bf16"), ("32-true", "fp32")]
)
def test_lightning_callback_takes_the_trainers_precision(given, precision):
    pytest.importorskip("lightning")
    from normlab.diagnostics.lightning import NormlabLightningCallback, precision_of

    assert precision_of(SimpleNamespace(precision=given)) == precision
    with pytest.raises(ConfigError, match=r"precision must be one of fp16, bf16, fp32 or None .* got 'fp8'$"):
        NormlabLightningCallback("x", precision="fp8")
