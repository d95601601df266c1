"""Diagnostics with known answers, the no-effect guarantee, storage, the report and the library API."""

from __future__ import annotations

import base64
import json
import math
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import normlab
from normlab.diagnostics import Probes, StreamProbe, find_blocks, probing
from normlab.diagnostics.prop31 import bound, last_mlp_gradient
from normlab.diagnostics.run_report import make_report
from normlab.diagnostics.stats import (
    FP16_MAX,
    angular_distance,
    attention_stats,
    fp16_headroom,
    hidden_stats,
    top_k_abs,
)
from normlab.train import TrainConfig, train
from tests.helpers import PATIENCE_S


def doubling_model(n_layers=4, d=16):
    """'none' layout, attention output zeroed, ReLU MLP computing relu(x) - relu(-x) = x: x' = 2x."""
    model = normlab.build_model(
        "none", "nano", seed=0, mlp="relu", d_model=d, n_heads=2, d_ff=2 * d, n_layers=n_layers
    ).double()
    eye = torch.eye(d, dtype=torch.float64)
    with torch.no_grad():
        for b in model.blocks:
            b.attn.o_proj.weight.zero_()
            b.mlp.up_proj.weight.copy_(torch.cat([eye, -eye], 0))
            b.mlp.down_proj.weight.copy_(torch.cat([eye, -eye], 1))
    return model


def rows_of(rows, site, metric):
    return {r["layer"]: r["value"] for r in rows if r["site"] == site and r["metric"] == metric}


def test_variance_times_four_per_doubling_layer():
    model = doubling_model()
    x = torch.randint(0, 256, (2, 8))
    rows = Probes(model, (x, x)).record(0)
    var, mean_abs = rows_of(rows, "stream", "var"), rows_of(rows, "stream", "mean_abs")
    for layer in range(1, 5):
        assert var[layer] / var[layer - 1] == pytest.approx(4.0, rel=1e-9)
        assert mean_abs[layer] / mean_abs[layer - 1] == pytest.approx(2.0, rel=1e-9)
    # the same stream through the generic probe
    generic = StreamProbe(model).record(0, x)
    assert rows_of(generic, "stream", "var") == pytest.approx(var, rel=1e-9)
    # a doubled stream points the same way: angular distance 0 between layers
    assert max(rows_of(rows, "stream", "angular_next").values()) < 1e-6


def test_top_k_and_fp16_headroom_on_planted_values():
    x = torch.zeros(4, 10, 32)
    x[0, 0, 0], x[1, 2, 3], x[3, 9, 31] = 70000.0, -1000.0, 5.0
    x[2] = 0.5
    top = top_k_abs([x], k=3)
    assert top.tolist() == [70000.0, 1000.0, 5.0]
    st = hidden_stats(x)
    assert st["max_abs"] == 70000.0 and fp16_headroom(st["max_abs"]) == pytest.approx(FP16_MAX / 70000.0)
    assert fp16_headroom(st["max_abs"]) < 1  # would overflow FP16
    y = torch.ones(100)
    y[7] = 300.0
    assert hidden_stats(y)["max_median_ratio"] == 300.0


def test_angular_distance_identical_orthogonal_opposite():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert angular_distance(a, 3 * a) == pytest.approx(0.0, abs=1e-7)
    assert angular_distance(a, torch.tensor([[0.0, 5.0], [-1.0, 0.0]])) == pytest.approx(0.5)
    assert angular_distance(a, -a) == pytest.approx(1.0)


def test_attention_stats_by_hand():
    q = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])  # (1, 1, 2, 2)
    k = torch.tensor([[[[3.0, 0.0], [1.0, 1.0]]]])
    max_logit, entropy = attention_stats(q, k)
    # causal logits: row 0 sees k0: 3/sqrt2; row 1 sees k0: 0, k1: 2/sqrt2
    assert max_logit[0] == pytest.approx(3 / math.sqrt(2))
    p = torch.softmax(torch.tensor([0.0, 2 / math.sqrt(2)]), 0)
    assert entropy[0] == pytest.approx((0.0 - (p * p.log()).sum().item()) / 2)
    assert attention_stats(q, k, scale=0.25)[0][0] == pytest.approx(0.75)  # the model's own scale (Gemma's)


@pytest.mark.parametrize("seed", range(20))
def test_prop31_bound_holds_on_random_peri_mlps(seed):
    g = torch.Generator().manual_seed(seed)
    d, hdim = 8, 16
    scale = 10.0 ** (seed % 4)  # up to massive activations
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x, w1, b1, w2, b2 = r(d) * scale, r(d, hdim) * scale, r(hdim), r(hdim, d), r(d)
    gamma = 0.5 + torch.rand(d, generator=g, dtype=torch.float64)
    out = last_mlp_gradient(x, w1, b1, w2, b2, gamma, y=seed % d, layout="peri")
    measured = out["grad"].abs().max().item()
    assert measured <= bound(gamma.max().item(), d, out["h"].norm().item(), out["a"].norm().item())
    post = last_mlp_gradient(x, w1, b1, w2, b2, gamma, y=seed % d, layout="post")
    assert post["grad"].abs().max().item() <= bound(
        gamma.max().item(), d, post["h"].norm().item(), post["x_plus_a"].norm().item()
    )


def test_prop31_pre_gradient_is_h_times_residual_and_grows_with_h():
    g = torch.Generator().manual_seed(0)
    d, hdim = 8, 16
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x, w1, b1, w2, b2, gamma = (
        r(d),
        r(d, hdim),
        torch.zeros(hdim, dtype=torch.float64),
        r(hdim, d) * 0.01,
        r(d) * 0.0,
        torch.ones(d, dtype=torch.float64),
    )
    out = last_mlp_gradient(x, w1, b1, w2, b2, gamma, y=3, layout="pre")
    p = torch.softmax(x + out["a"], 0)
    onehot = torch.zeros(d, dtype=torch.float64)
    onehot[3] = 1
    torch.testing.assert_close(out["grad"], torch.outer(out["h"], p - onehot))  # Prop. C.1 eq. 11
    grads = [last_mlp_gradient(x, w1 * c, b1, w2, b2, gamma, 3, "pre")["grad"].norm().item() for c in (1, 10, 100)]
    assert grads[0] < grads[1] < grads[2]


@pytest.mark.parametrize("layout", ["pre", "peri"])
def test_prop31_per_token_probe_equals_each_tokens_own_gradient(layout):
    """The probe's per-token numbers equal a loop that back-propagates each token's loss alone to
    the last down projection: max_ij |dl_t/dW2_ij|, the bound 4 gamma sqrt(D) ||h_t|| / ||a_t|| (Peri),
    and the log-log slope of ||dl_t/dW2|| on ||h_t|| fitted by hand."""
    torch.manual_seed(0)
    model = normlab.build_model(layout, "nano", seed=0, mlp="relu").double()
    x = torch.randint(0, 256, (2, 6))
    y = torch.randint(0, 256, (2, 6))
    y[1, :2] = -100  # ignored targets (SFT prompts) are not tokens of the loss
    rows = Probes(model, (x, y)).record(0)
    got = {r["metric"]: r["value"] for r in rows if r["site"] == "prop31"}

    down = model.blocks[-1].mlp.down_proj
    captured = {}
    hook = down.register_forward_hook(lambda m, a, o: captured.update(h=a[0].detach(), a=o.detach()))
    entry_max, g_norms, h_norms, bounds = [], [], [], []
    gamma = model.blocks[-1].mlp_norms.output.weight.abs().max().item() if layout == "peri" else None
    for b in range(2):
        for t in range(6):
            if y[b, t] == -100:
                continue
            logits = model(x).logits
            loss_t = torch.nn.functional.cross_entropy(logits[b, t][None], y[b, t][None])
            (g,) = torch.autograd.grad(loss_t, down.weight)
            entry_max.append(g.abs().max().item())
            g_norms.append(g.norm().item())
            h_t, a_t = captured["h"][b, t], captured["a"][b, t]
            h_norms.append(h_t.norm().item())
            if gamma is not None:
                bounds.append(4 * gamma * math.sqrt(a_t.numel()) * h_t.norm().item() / a_t.norm().item())
    hook.remove()
    assert got["tok_grad_max"] == pytest.approx(max(entry_max), rel=1e-6)  # the loss is taken in float32
    assert got["tok_grad_mean"] == pytest.approx(sum(entry_max) / len(entry_max), rel=1e-6)
    lx = [math.log(v) for v in h_norms]
    ly = [math.log(v) for v in g_norms]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    assert got["grad_h_slope"] == pytest.approx(slope, rel=1e-6)
    if layout == "peri":
        assert got["tok_bound"] == pytest.approx(sum(bounds) / len(bounds), rel=1e-6)
        within = sum(e <= bd for e, bd in zip(entry_max, bounds)) / len(bounds)
        assert got["tok_within_bound"] == pytest.approx(within)
    else:
        assert "tok_bound" not in got
    # the batch gradient is not any token's: its largest entry differs from the per-token maximum
    assert got["grad_max"] != pytest.approx(got["tok_grad_max"], rel=1e-3)


def test_prop31_regimes_in_the_propositions_setting():
    """Scaling W1 by c scales h by c. Pre-LN: dl/dW2 = h (p - y) grows with ||h||; Peri-LN: the output
    norm cancels the scale, the gradient is unchanged (ReLU, no biases)."""
    g = torch.Generator().manual_seed(1)
    d, hdim = 8, 16
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x, w1, w2 = r(d), r(d, hdim), r(hdim, d)
    zeros_h, zeros_d, gamma = (
        torch.zeros(hdim, dtype=torch.float64),
        torch.zeros(d, dtype=torch.float64),
        torch.ones(d, dtype=torch.float64),
    )
    peri = [
        last_mlp_gradient(x, w1 * c, zeros_h, w2, zeros_d, gamma, 3, "peri")["grad"].norm().item() for c in (1, 10, 100)
    ]
    assert peri == pytest.approx([peri[0]] * 3, rel=1e-9)
    pre = [
        last_mlp_gradient(x, w1 * c, zeros_h, w2 * 1e-3, zeros_d, gamma, 3, "pre")["grad"].norm().item()
        for c in (1, 10)
    ]
    assert pre[1] / pre[0] == pytest.approx(10.0, rel=0.05)  # ~ ||h||: p barely moves with a tiny W2


def test_probes_do_not_change_training(corpus, tmp_path):
    base = dict(
        data=str(corpus), size="nano", seq_len=32, batch_size=8, steps=8, eval_every=4, eval_batches=1, progress=False
    )
    train(TrainConfig.of(**base, out=str(tmp_path / "on"), probe_every=2))
    train(TrainConfig.of(**base, out=str(tmp_path / "off"), probe_every=0))
    on, off = (normlab.load_run(tmp_path / n) for n in ("on", "off"))
    assert on.metrics.loss.tolist() == off.metrics.loss.tolist()
    assert on.metrics.grad_norm.tolist() == off.metrics.grad_norm.tolist()
    assert sorted(on.probes.step.unique()) == [0, 2, 4, 6, 8] and off.probes.empty
    upd = on.probes[on.probes.metric == "update_norm"]
    assert sorted(upd.step.unique()) == [0, 2, 4, 6] and (upd.value > 0).all()
    var = on.probe("stream", "var")
    assert list(var.columns) == [0, 1, 2] and list(var.index) == [0, 2, 4, 6, 8]
    gam = on.probe("attn_norms.output", "gamma_mean")
    assert gam.loc[0].tolist() == [1.0, 1.0] and gam.loc[8].tolist() != [1.0, 1.0]


def test_probes_record_the_update_ratio_of_a_muon_run(corpus, tmp_path):
    from normlab.train.optim import lr_at
    from tests.helpers import small

    train(small(corpus, tmp_path / "m", optimizer="muon", lr=0.02, steps=3, probe_every=1, eval_every=0))
    p = normlab.load_run(tmp_path / "m").probes
    at = p[(p.step == 1) & (p.layer == 0) & (p.site == "mlp.up_proj")].set_index("metric").value
    assert at["update_ratio"] == pytest.approx(at["update_norm"] / at["weight_norm"], rel=1e-6)
    # Muon's step on a (128, 32) matrix is lr' ||O||_F, O's 32 singular values in Newton-Schulz's band
    # (0.5, 1.5) around 1 (Jordan et al.), lr' = lr_t 0.2 sqrt(128) (match_rms_adamw); weight decay adds ~1%
    lr = lr_at(1, small(corpus, tmp_path / "m", optimizer="muon", lr=0.02, steps=3)) * 0.2 * math.sqrt(128)
    assert 0.5 * lr * math.sqrt(32) * 0.95 < at["update_norm"] < 1.5 * lr * math.sqrt(32) * 1.05


def test_report_html_and_figures(corpus, tmp_path):
    runs = []
    for layout in ("pre", "peri"):
        out = tmp_path / layout
        train(
            TrainConfig.of(
                data=str(corpus),
                size="nano",
                layout=layout,
                seq_len=32,
                batch_size=8,
                steps=6,
                probe_every=3,
                eval_every=3,
                eval_batches=1,
                progress=False,
                out=str(out),
            )
        )
        runs.append(out)
    index = make_report(runs, tmp_path / "report")
    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert pngs == sorted(
        [
            "loss.png",
            "variance_by_depth.png",
            "mean_abs_by_depth.png",
            "grad_by_layer.png",
            "top100_fp16.png",
            "angular_distance.png",
            "output_gamma.png",
            "attention_logits.png",
            "layers_per_step.png",
        ]
    )

    class Check(HTMLParser):
        def __init__(self):
            super().__init__()
            self.images, self.stack, self.cells = [], [], []

        def handle_starttag(self, tag, attrs):
            if tag == "img":
                self.images.append(dict(attrs)["src"])
            elif tag not in ("meta", "wbr"):  # void elements
                self.stack.append(tag)

        def handle_endtag(self, tag):
            assert self.stack and self.stack.pop() == tag, f"unbalanced </{tag}>"

        def handle_data(self, data):
            if self.stack and self.stack[-1] == "td":
                self.cells.append(data)

    parser = Check()
    parser.feed(index.read_text())
    assert not parser.stack and len(parser.images) == 9  # eight probe figures and the per-step tier
    for src in parser.images:
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"  # self-contained
    assert "pre" in parser.cells and "peri" in parser.cells and "ok" in parser.cells
    # the Prop. 3.1 per-token table: each run at its first and last probe (steps 0 and 6)
    from normlab.diagnostics.run_report import prop31_rows

    rows = prop31_rows([normlab.load_run(r) for r in runs], ["pre", "peri"])
    assert [(r["run"], r["step"]) for r in rows] == [("pre", 0), ("pre", 6), ("peri", 0), ("peri", 6)]
    assert rows[0]["tok_within_bound"] is None and 0 <= rows[2]["tok_within_bound"] <= 1  # peri has the bound
    assert 'id="prop31"' in index.read_text()


def test_probing_context_manager_and_generic_module(tmp_path):
    model = normlab.build_model("peri", "nano", seed=0)
    x = torch.randint(0, 256, (2, 8))
    with probing(model, (x, x), every=5, path=tmp_path / "p.jsonl") as probe:
        for step in range(11):
            probe.step(step)
    assert sorted({r["step"] for r in probe.rows}) == [0, 5, 10]
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    assert len(lines) == len(probe.rows) and json.loads(lines[0])["step"] == 0

    class Plain(torch.nn.Module):  # not normlab: a stack of residual MLPs
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.head = torch.nn.ModuleList([torch.nn.Linear(8, 2)])

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head[0](x)

    plain = Plain()
    name, blocks = find_blocks(plain)
    assert name == "layers" and len(blocks) == 3
    rows = StreamProbe(plain).record(0, torch.randn(5, 4))
    assert sorted(rows_of(rows, "stream", "rms")) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        find_blocks(torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def overflowed(tmp_path_factory):
    """Two real runs shared by the report's tests: fp16 Post-LN on micro-deep at lr 0.2, whose MLP output
    overflows within 12 steps (it diverges, with forensics), and a nano Peri-LN run that trains."""
    from tests.conftest import SENTENCES

    root = tmp_path_factory.mktemp("overflowed")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)))
    base = dict(
        data=str(corpus),
        seq_len=32,
        batch_size=8,
        steps=12,
        probe_every=3,
        eval_every=6,
        eval_batches=1,
        activation_dtype="fp16",
        weight_decay=0.0,
        progress=False,
        device="cpu",
    )
    post = train(TrainConfig.of(**base, layout="post", size="micro-deep", lr=0.2, out=str(root / "post")))
    assert post["status"] == "diverged" and post["forensics"]["forward"]["kind"] == "overflow"
    train(TrainConfig.of(**base, layout="peri", size="nano", lr=3e-3, out=str(root / "peri")))
    return [root / "post", root / "peri"]


def legend_entries_drawn(fig) -> list[str]:
    """Every legend label of ``fig`` whose artist draws nothing finite (a label that says "not drawn" is honest)."""
    import matplotlib.collections
    import matplotlib.lines

    bad = []
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if "not drawn" in label:
                continue
            if isinstance(handle, matplotlib.lines.Line2D):
                y = np.asarray(handle.get_ydata(), dtype=float)
                ok = np.isfinite(y).any() or (
                    handle.get_linestyle() != "None" and len(handle.get_xdata()) == 0 and label.startswith("FP16")
                )
            elif isinstance(handle, matplotlib.collections.Collection):
                ok = np.isfinite(np.asarray(handle.get_offsets(), dtype=float)).all() and len(handle.get_offsets()) > 0
            else:
                ok = True
            if not ok:
                bad.append(f"{ax.get_title()}: {label}")
    return bad


def test_the_report_tells_the_truth_of_a_run_that_overflowed(overflowed):
    """The summary table says what each run's summary.json says (an overflow, never an inf headroom); every
    figure draws each run its legend names, a diverged run to its last finite step with its divergence marked."""
    from normlab.diagnostics.figures import FIGURES, fig_grad_by_layer, fig_loss
    from normlab.diagnostics.run_report import summary_rows

    runs = [normlab.load_run(p) for p in overflowed]
    post, peri = (r.summary for r in runs)
    rows = {r["run"]: r for r in summary_rows(runs, ["post", "peri"])}
    # the post run: its summary's numbers; the headroom cell names the overflow and the last finite probe's max
    tops = {int(st): v for st, v in zip(*[runs[0].probe("global", "max_abs").reset_index().iloc[:, i] for i in (0, 1)])}
    last = max(st for st, v in tops.items() if math.isfinite(v))
    assert rows["post"]["status"] == f"diverged at step {post.diverged_step}"
    assert rows["post"]["steps"] == post.steps and rows["post"]["final loss"] == post.final_loss
    assert rows["post"]["max |x| in run"] == post.max_activation
    assert rows["post"]["FP16 headroom"] == (
        f"overflowed (step {post.forensics.step}); last finite max {tops[last]:.4g} (step {last})"
    )
    assert rows["peri"]["status"] == "ok" and rows["peri"]["FP16 headroom"] == pytest.approx(
        FP16_MAX / peri.max_activation
    )
    # the loss: each run to its last finite step, the diverged run's end marked at that step
    fig = fig_loss(runs, ["post", "peri"])
    loss_ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in loss_ax.get_lines()}
    finite_steps = runs[0].metrics.step[np.isfinite(runs[0].metrics.loss.to_numpy(dtype=float))].tolist()
    assert (
        list(lines["post train (mean of 10 steps)"].get_xdata()) == finite_steps
        and finite_steps[-1] <= post.diverged_step
    )
    assert lines["post train (mean of 10 steps)"].get_ydata()[-1] == pytest.approx(post.final_loss)
    marks = {c.get_label(): c.get_offsets() for c in loss_ax.collections}
    assert marks[f"post diverged at step {post.diverged_step}"][0][0] == finite_steps[-1]
    raw = next(
        ln for ln in loss_ax.get_lines() if ln.get_label().startswith("_") and list(ln.get_xdata()) == finite_steps
    )
    assert np.mean(raw.get_ydata()[-10:]) == pytest.approx(post.final_loss)  # the summary's final loss, drawn
    assert list(lines["peri train (mean of 10 steps)"].get_xdata()) == list(range(peri.steps))
    assert lines["peri train (mean of 10 steps)"].get_ydata()[-1] == pytest.approx(peri.final_loss)
    # the gradient norm by layer at the end: both runs drawn, the diverged one at its last finite probe, said so
    end = fig_grad_by_layer(runs, ["post", "peri"]).axes[1]
    labels = [ln.get_label() for ln in end.get_lines() if not ln.get_label().startswith("_")]
    assert len(labels) == 2 and labels[1] == f"peri (step {peri.steps})"
    assert (
        labels[0].startswith("post (step ")
        and f"the last finite probe; diverged at step {post.diverged_step}" in labels[0]
    )
    for figure in FIGURES:
        if figure.shown(runs):
            assert legend_entries_drawn(figure.draw(runs, ["post", "peri"])) == [], figure.key
    page = make_report(overflowed, overflowed[0].parent / "report").read_text()
    assert ">inf<" not in page and "overflowed (step" in page


@pytest.mark.long
def test_report_in_headless_chromium_fits_a_1400px_window(overflowed, tmp_path):
    """The report rendered by Chromium at 1400 px: no table wider than the window (measured in the browser),
    every figure embedded, no script error; the screenshot is a 1400 px wide PNG."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "screenshot_report", Path(__file__).parents[2] / "scripts" / "screenshot_report.py"
    )
    shot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shot)
    if shot.find_browser() is None:
        pytest.skip("no headless Chromium on this machine (Debian: apt-get install chromium)")
    index = make_report(overflowed, tmp_path / "report")
    facts = shot.measure(index, 1400)
    assert facts["viewport"] == 1400 and len(facts["tables"]) >= 2
    assert shot.cut_tables(facts) == []
    summary = facts["tables"][0]
    assert summary["head"][:3] == ["run", "layout", "status"] and summary["right"] <= 1400
    png = shot.screenshot(index, tmp_path / "report.png", 1400)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png.read_bytes()[16:20], "big") == 1400
    res = subprocess.run(
        [shot.find_browser(), *shot.FLAGS, "--enable-logging=stderr", "--dump-dom", index.as_uri()],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )
    assert "<h1>normlab report</h1>" in res.stdout and res.stdout.count("<img") == 9
    assert "Uncaught" not in res.stderr


def test_angular_distance_at_the_last_token_by_default():
    """Gromov et al. (cited by Kim Fig. 9) measure at the last token; 'all' averages every token."""
    a = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # (B=1, T=3, d=2)
    b = torch.tensor([[[0.0, 1.0], [0.0, 1.0], [0.0, 2.0]]])  # orthogonal except at the last token
    assert angular_distance(a, b) == pytest.approx(0.0, abs=1e-7)
    assert angular_distance(a, b, tokens="all") == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    with pytest.raises(ValueError, match="valid: last, all"):
        angular_distance(a, b, tokens="first")


def test_report_of_a_sweep_and_of_runs_without_probes(corpus, tmp_path, capsys):
    """`normlab report SWEEP` reports its runs; runs without probes get the loss only, no empty axes
    and no matplotlib warnings."""
    import warnings

    from normlab.cli import main
    from normlab.experiments.runner import run_sweep
    from normlab.experiments.sweep import SweepConfig

    sweep = SweepConfig(
        name="r",
        base={
            "data": str(corpus),
            "size": "nano",
            "seq_len": 16,
            "batch_size": 4,
            "steps": 3,
            "eval_every": 0,
            "eval_batches": 1,
            "probe_every": 0,
            "device": "cpu",
        },
        grid={"layout": ["pre", "peri"]},
    )
    run_sweep(sweep, tmp_path / "sw", workers=1, log=lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["report", str(tmp_path / "sw")]) == 0
    page = (tmp_path / "sw" / "report" / "index.html").read_text()
    assert "No run recorded probes" in page and 'id="loss"' in page and 'id="top100_fp16"' not in page
    assert page.count("<tr>") == 3  # the summary table: a header and the two runs
    assert "report: " + str(tmp_path / "sw" / "report" / "index.html") in capsys.readouterr().out


def test_probes_record_the_learnable_scalars_and_the_report_plots_them(corpus, tmp_path):
    """DyT's alpha (per site, final norm included), a learned h, Admin's omega and NormFormer's head scales are
    recorded at their parameters' values; the report draws them only for runs that have them."""
    from normlab.diagnostics.probes import Probes

    model = normlab.build_model("normformer,attn=gsAB,norm.A=dyt,alpha0.mlp.A=0.3,alpha=admin,h-scalar", "nano", seed=0)
    with torch.no_grad():
        model.blocks[1].attn.head_scale.copy_(torch.tensor([0.5, -3.0]))  # nano: 2 heads
    x = torch.randint(0, 256, (2, 8))
    rows = {(r["layer"], r["site"], r["metric"]): r["value"] for r in Probes(model, (x, x)).record(0)}
    b = model.blocks[1]
    assert rows[(1, "mlp_norms.input", "alpha")] == pytest.approx(0.3)
    assert rows[(1, "attn_norms.input", "alpha")] == pytest.approx(model.config.dyt_alpha)
    assert rows[(1, "attn.head_scale", "head_scale_mean")] == pytest.approx(-1.25)
    assert rows[(1, "attn.head_scale", "head_scale_abs_max")] == pytest.approx(3.0)
    assert rows[(1, "mlp_omega", "omega_mean")] == pytest.approx(b.mlp_omega.mean().item())
    assert rows[(0, "attn_h", "h_mean")] == pytest.approx(1.0)
    assert (1, "mlp.hidden_norm", "gamma_mean") in rows  # the hidden norm H is a probed norm site
    with torch.no_grad():  # the gate's scores, sigmoid(N(x) W_theta), by hand
        u = b.attn_norms.input(model.blocks[0](model.embed_tokens(x)))  # block 1 reads block 0's output
        scores = torch.sigmoid(b.attn.gate_proj(u))
    assert rows[(1, "attn.gate", "gate_mean")] == pytest.approx(scores.mean().item(), rel=1e-5)
    assert rows[(1, "attn.gate", "gate_below_0.1")] == pytest.approx((scores < 0.1).float().mean().item())

    runs = []
    for layout in ("pre", "rezero"):
        out = tmp_path / layout
        train(
            TrainConfig.of(
                data=str(corpus),
                size="nano",
                layout=layout,
                seq_len=32,
                batch_size=8,
                steps=4,
                probe_every=2,
                eval_every=0,
                progress=False,
                out=str(out),
            )
        )
        runs.append(out)
    make_report(runs, tmp_path / "both")
    make_report(runs[:1], tmp_path / "pre-only")
    assert (tmp_path / "both" / "learned_scalars.png").exists()
    assert not (tmp_path / "pre-only" / "learned_scalars.png").exists()
    h = normlab.load_run(runs[1]).probe("mlp_h", "h_mean")
    assert h.loc[0].tolist() == [0.0, 0.0] and (h.loc[4].abs() > 0).all()  # ReZero: from 0, then learned


def test_sink_mass_kurtosis_and_adam_moments_on_planted_cases():
    """Numbers computed by hand. Sink: q = 0 makes every causal row uniform, so the mass on the first token is
    the mean of 1/(t+1) over t = 1..T-1; a key 0 with a large logit draws all of it (1.0). Kurtosis of
    [1, -1, 1, -1] (mean 0, var 1, fourth moment 1) is 1; of [0, 0, 0, 4]: mean 1, var 3, m4 = (81 + 3) / 4 = 21,
    21 / 9. Adam after one step on gradient g: exp_avg = (1 - b1) g, exp_avg_sq = (1 - b2) g^2."""
    from normlab.diagnostics.stats import kurtosis, sink_mass

    t = 5
    q, k = torch.zeros(1, 2, t, 4), torch.randn(1, 2, t, 4)
    uniform = sum(1 / (i + 1) for i in range(1, t)) / (t - 1)
    assert sink_mass(q, k) == pytest.approx([uniform, uniform], rel=1e-6)
    q2 = torch.ones(1, 1, t, 4)
    k2 = torch.zeros(1, 1, t, 4)
    k2[0, 0, 0] = 100.0  # logit 400 * 0.5 = 200 on the first key, 0 elsewhere
    assert sink_mass(q2, k2) == pytest.approx([1.0])
    assert kurtosis(torch.tensor([1.0, -1.0, 1.0, -1.0])) == pytest.approx(1.0)
    assert kurtosis(torch.tensor([0.0, 0.0, 0.0, 4.0])) == pytest.approx(21 / 9)

    model = normlab.build_model("pre", "nano", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    opt.step()
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    rows = Probes(model, (x, x), optimizer=opt).record(0)
    got = {(r["layer"], r["metric"]): r["value"] for r in rows if r["site"] == "adam"}
    for i, block in enumerate(model.blocks):
        n = sum(p.numel() for p in block.parameters())
        assert got[(i, "exp_avg_norm")] == pytest.approx(0.1 * 2.0 * math.sqrt(n), rel=1e-5)
        assert got[(i, "exp_avg_sq_norm")] == pytest.approx(0.05 * 4.0 * math.sqrt(n), rel=1e-5)
    sinks = {(r["layer"], r["site"]): r["value"] for r in rows if r["metric"] in ("sink_mass", "sink_rate")}
    heads = model.config.n_heads
    for i in range(model.config.n_layers):
        masses = [sinks[(i, f"attn.head{h}")] for h in range(heads)]
        assert all(0 < m <= 1 for m in masses)
        assert sinks[(i, "attn")] == sum(m > 0.3 for m in masses) / heads
    kurt = [r for r in rows if r["site"] == "stream" and r["metric"] == "kurtosis"]
    assert len(kurt) == model.config.n_layers + 1 and all(v["value"] > 0 for v in kurt)


def test_step_tier_by_hand():
    """The per-step tier on a nano model: per block the gradient norm (the block's gradients together), the
    stream maximum (the hidden states' largest |x|), the sampled logits (exact when every query is sampled:
    attention_stats' maximum; fewer queries give at most that, the bound at least), the update RMS and
    update/weight ratio of an SGD step (dW = -lr g)."""
    from normlab.diagnostics.tier import StepTier

    model = normlab.build_model("pre", "nano", seed=0)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    full = StepTier(model, queries=16)
    few = StepTier(model, queries=3)
    caught = {}
    hooks = [
        model.blocks[i].attn.q.register_forward_hook(lambda m, a, o, i=i: caught.__setitem__(("q", i), o))
        for i in range(2)
    ] + [
        model.blocks[i].attn.k.register_forward_hook(lambda m, a, o, i=i: caught.__setitem__(("k", i), o))
        for i in range(2)
    ]
    out = model(x, targets=x, return_hidden_states=True)
    out.loss.backward()
    for h in hooks:
        h.remove()
    before = [torch.cat([p.detach().flatten() for p in b.parameters()]) for b in model.blocks]
    full.before_step()
    few.before_step()
    row, sample = full.read(), few.read()
    for i, block in enumerate(model.blocks):
        g = torch.cat([p.grad.flatten() for p in block.parameters()])
        assert row["grad_norm"][i] == pytest.approx(g.norm().item(), rel=1e-5)
        exact, _ = attention_stats(caught[("q", i)], caught[("k", i)], model.blocks[i].attn.scale)
        assert row["max_logit"][i] == pytest.approx(exact, rel=1e-5)
        assert all(s <= e + 1e-6 for s, e in zip(sample["max_logit"][i], exact))
        assert all(b >= e - 1e-6 for b, e in zip(row["max_logit_bound"][i], exact))
    assert row["stream_max"] == pytest.approx([h.abs().max().item() for h in out.hidden_states], rel=1e-6)
    lr = 0.1
    torch.optim.SGD(model.parameters(), lr=lr).step()
    after = full.after_step(applied=True)
    for i, block in enumerate(model.blocks):
        g = torch.cat([p.grad.flatten() for p in block.parameters()])
        assert after["update_rms"][i] == pytest.approx((lr * g).pow(2).mean().sqrt().item(), rel=1e-4)
        assert after["update_ratio"][i] == pytest.approx((lr * g).norm().item() / before[i].norm().item(), rel=1e-4)
    full.remove()
    few.remove()


def test_a_planted_loss_spike_is_skipped_attributed_and_its_batch_saved(corpus, tmp_path, monkeypatch):
    """A batch of garbage tokens at step 30: on_spike=skip does not apply it (spike_skipped_steps), reruns it
    on the pre-step weights (bitwise the same on CPU: reproduced), attributes it to the data (the previous
    step's batch on the same weights is within the rule), saves that batch, and probes it; the per-step
    tier's row of the step has no update. normlab report reads the tier."""
    from normlab.data.dataset import TokenData
    from tests.helpers import small

    original = TokenData.train_window
    garbage = {}

    def planted(self, step, batch, seq, seed):
        w = original(self, step, batch, seq, seed)
        if step == 30:
            garbage["w"] = torch.randint(0, self.vocab_size, w.shape, generator=torch.Generator().manual_seed(9))
            return garbage["w"]
        return w

    monkeypatch.setattr(TokenData, "train_window", planted)
    out = tmp_path / "spike"
    s = train(small(corpus, out, steps=40, on_spike="skip", spike_window=40, probe_every=20, eval_every=40))
    assert s["status"] == "ok" and s["spike_skipped_steps"] == [30] and s["skipped_steps"] == []
    assert s["layer_stats"]["stream_max"]["value"] > 0 and s["layer_stats"]["update_rms"]["step"] != 30
    spikes = [json.loads(line) for line in (out / "spikes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in spikes] == [30] and spikes[0]["action"] == "skipped"
    assert spikes[0]["rerun"]["reproduced"] and spikes[0]["rerun"]["loss"] == spikes[0]["loss"]
    assert spikes[0]["verdict"] == "data" and not spikes[0]["previous_batch"]["spikes"]
    assert s["spikes"] == [{"step": 30, "verdict": "data", "action": "skipped"}]
    saved = torch.load(out / "spikes" / "step_30.pt")
    assert torch.equal(saved["batch"]["tokens"], garbage["w"])
    run = normlab.load_run(out)
    assert run.metrics.set_index("step").loc[30, "skipped"] == True  # noqa: E712 - a pandas cell
    assert not run.probe("spike:stream", "max_abs").empty and run.probe("spike:stream", "max_abs").index.tolist() == [
        30
    ]
    tier = run.layers
    assert sorted(tier.step.unique().tolist()) == list(range(40))
    upd = tier[(tier.metric == "update_rms")].set_index(["step", "layer"]).value
    assert upd.loc[30].eq(0).all() and upd.loc[29].gt(0).all()
    make_report([out], tmp_path / "report")
    assert (tmp_path / "report" / "layers_per_step.png").exists()


def test_the_tier_every_third_step_writes_those_steps_rows_unchanged(corpus, tmp_path, monkeypatch):
    """run.layer_stats_every=3: layers.jsonl has the rows of steps 0, 3, 6, 9, each the same as the every-step
    run's row of that step, and training is the same step for step. The hooks stay in place and return at once
    outside a tier step's forward: the sampled logits are computed once per block on the tier's steps only (not
    on the steps between, nor in the final evaluation; `layer_logits` takes a group of layers at once)."""
    from normlab.diagnostics import tier
    from tests.helpers import losses, small

    calls = []
    original = tier.layer_logits
    monkeypatch.setattr(tier, "layer_logits", lambda q, *a, **k: calls.extend([1] * q.shape[0]) or original(q, *a, **k))
    layers = normlab.build_model("peri", "nano").config.n_layers
    runs = {}
    for every in (1, 3):
        calls.clear()
        out = tmp_path / f"every{every}"
        train(small(corpus, out, steps=10, eval_every=0, probe_every=0, ckpt_every=10, layer_stats_every=every))
        runs[every] = {r["step"]: r for r in map(json.loads, (out / "layers.jsonl").read_text().splitlines())}
        assert len(calls) == layers * len(runs[every])
    assert sorted(runs[1]) == list(range(10)) and sorted(runs[3]) == [0, 3, 6, 9]
    for step in (0, 3, 6, 9):
        assert runs[3][step] == runs[1][step]
    assert losses(tmp_path / "every3") == losses(tmp_path / "every1")
