"""The newer precursors (issue 66 item 2): the QK spectral entropy against its formula in float64, the
per-head max-logit and entropy-fall rules on rows worked out by hand, the probe in a run, and an alert that
carries its detector's measured record."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from normlab.diagnostics import precursors, qk_spectrum, warning_record
from normlab.diagnostics.early_warning import EarlyWarnings, replay
from normlab.errors import ConfigError

EPS64 = float(np.finfo(np.float64).eps)


def _entropy_by_hand(m: np.ndarray, r: int) -> float:
    """(Q3) written out over the r largest singular values (m's rank bound): p_i = s_i / sum s,
    H = -sum p log p, over log r."""
    s = np.linalg.svd(m, compute_uv=False)[:r]
    p = s / s.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / math.log(r))


def test_normalized_entropy_is_one_for_equal_singular_values_and_zero_for_one():
    flat = torch.ones(5, dtype=torch.float64)
    one = torch.tensor([3.0, 0, 0, 0, 0], dtype=torch.float64)
    assert qk_spectrum.normalized_entropy(flat, 5).item() == pytest.approx(1.0, abs=8 * EPS64)
    assert qk_spectrum.normalized_entropy(one, 5).item() == 0.0
    two = torch.tensor([1.0, 1.0, 0, 0], dtype=torch.float64)  # p = (1/2, 1/2): log 2 / log 4 = 1/2
    assert qk_spectrum.normalized_entropy(two, 4).item() == pytest.approx(0.5, abs=8 * EPS64)


def test_the_form_entropy_matches_the_svd_of_wq_h_transposed_times_wk_h():
    """B_h = (W_q^h)^T W_k^h (Q1), its singular values by a full SVD in float64 (numpy), against the QR route;
    grouped-query attention: key head h // 2 for query heads h with 4 query and 2 key heads."""
    g = np.random.default_rng(0)
    d, hd, heads, kv = 12, 3, 4, 2
    wq, wk = g.standard_normal((heads * hd, d)), g.standard_normal((kv * hd, d))
    got = qk_spectrum.form_entropy(torch.from_numpy(wq), torch.from_numpy(wk), heads, kv)
    for h in range(heads):
        q, k = wq[h * hd : (h + 1) * hd], wk[(h // 2) * hd : (h // 2 + 1) * hd]
        # the QR route and the full SVD differ by a few roundings of a d x hd factorization
        assert got[h].item() == pytest.approx(_entropy_by_hand(q.T @ k, hd), abs=64 * d * EPS64)


def test_the_update_entropy_is_that_of_the_first_order_term():
    """T_h = dW_q^T W_k + W_q^T dW_k (Q2) built by hand, its entropy over min(2 d_head, d_model)."""
    g = np.random.default_rng(1)
    d, hd, heads = 10, 2, 3
    wq, wk = g.standard_normal((heads * hd, d)), g.standard_normal((heads * hd, d))
    dq, dk = 1e-2 * g.standard_normal((heads * hd, d)), 1e-2 * g.standard_normal((heads * hd, d))
    t = [torch.from_numpy(a) for a in (wq, wk, dq, dk)]
    got = qk_spectrum.update_entropy(*t, heads, heads)
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        term = dq[sl].T @ wk[sl] + wq[sl].T @ dk[sl]  # d x d, rank <= 2 hd
        want = _entropy_by_hand(term, 2 * hd)
        assert got[h].item() == pytest.approx(want, abs=64 * d * EPS64)


def test_a_rank_one_form_has_zero_entropy():
    """Every head's W_q^h rows the same vector: B_h has one nonzero singular value, entropy 0."""
    d, hd = 8, 4
    u = torch.arange(1.0, d + 1, dtype=torch.float64)
    wq = u.repeat(hd, 1)
    wk = torch.randn(hd, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # a rank-1 B_h: its other singular values are roundings of size eps * |B_h|
    assert qk_spectrum.form_entropy(wq, wk, 1, 1).item() == pytest.approx(0.0, abs=1e-10)


def test_the_probe_hook_writes_a_row_per_probed_step_with_the_steps_update(tmp_path):
    import normlab

    model = normlab.build_model("pre", "nano", seed=0)
    log = (tmp_path / precursors.QK_SPECTRUM).open("a")
    hook = qk_spectrum.QKSpectrumHook(qk_spectrum.QKSpectrum(model), log, every=2)
    attn = model.blocks[0].attn
    for step in range(4):
        hook.pre_step(step)
        with torch.no_grad():
            attn.q_proj.weight.mul_(1.5)  # the "update": W_q x 1.5, so dW_q = W_q / 2
        hook.post_step(step, True)
    hook.close()
    rows = [json.loads(x) for x in (tmp_path / precursors.QK_SPECTRUM).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2]
    assert len(rows[0]["qk_entropy"]) == len(model.blocks)
    wq, wk = attn.q_proj.weight.detach(), attn.k_proj.weight.detach()
    heads = attn.n_heads
    want = qk_spectrum.update_entropy(wq / 1.5, wk, wq - wq / 1.5, torch.zeros_like(wk), heads, attn.n_kv_heads)
    assert rows[1]["qk_update_entropy"][0] == pytest.approx(want.tolist(), abs=1e-6)  # rounded to 6 places
    # block 1's weights did not move: no first-order term, entropy 0 (all singular values zero)
    assert rows[1]["qk_update_entropy"][1] == [0.0] * heads


def test_the_head_logit_rule_fires_on_the_third_row_in_a_row_at_or_past_tau():
    rule = precursors.HeadLogit(tau=100.0)
    seq = [[[50.0, 100.0]], [[50.0, 120.0]], [[150.0, 90.0]], [[160.0, 130.0]], [[170.0, 10.0]]]
    fired = [rule.feed(s, {"max_logit": row}) for s, row in enumerate(seq)]
    # head 1: 100, 120 then 90 (broken); head 0: 150, 160, 170 from step 2: its third is step 4
    assert [f is not None for f in fired] == [False, False, False, False, True]
    assert fired[4][0] == "block 0 head 0" and fired[4][1] == 170.0


W = precursors.ENTROPY_WINDOW
SWAY = [0.9, 0.8] * (W // 2)  # a full window: mean 0.85, population std 0.05; 6 std below: 0.55


def _fall(last: float, sigmas: float = 6.0) -> list:
    rule = precursors.EntropyFall("qk entropy", "qk_entropy", "QK-form spectral entropy", sigmas)
    return [rule.feed(s, {"qk_entropy": [[v, v]]}) for s, v in enumerate([*SWAY, last])]


def test_the_entropy_rule_fires_more_than_its_sigmas_below_the_windows_mean():
    fired = _fall(0.54)
    assert all(f is None for f in fired[:W]) and fired[W][0] == "layer 0" and fired[W][1] == pytest.approx(0.54)
    assert _fall(0.56)[W] is None  # 5.8 std below: not past 6
    assert _fall(0.56, sigmas=5.0)[W] is not None  # past 5
    early = precursors.EntropyFall("qk entropy", "qk_entropy", "QK-form spectral entropy")
    assert early.feed(0, {"qk_entropy": [[0.9]]}) is None and early.feed(1, {"qk_entropy": [[0.1]]}) is None


def test_early_warnings_read_the_merged_row_and_refuse_bad_qk_rows():
    warn = EarlyWarnings("bf16", {"qk entropy": 6.0})
    for s, v in enumerate([*SWAY, 0.5]):
        qk = {"step": s, "qk_entropy": [[v]]}
        warn.feed(s, precursors.merge({"step": s}, qk, s), {"loss": 2.0, "grad_norm": 1.0})
    assert [(a.signal, a.step) for a in warn.alerts] == [("qk entropy", W)]
    with pytest.raises(ConfigError, match="qk_entropy"):
        EarlyWarnings("bf16").feed(0, {"qk_entropy": [0.5]}, {})
    with pytest.raises(ConfigError, match="is no detector"):
        EarlyWarnings("bf16", {"nope": 1.0})
    with pytest.raises(ConfigError, match="positive number"):
        EarlyWarnings("bf16", {"head logit": -1.0})


def test_an_alert_carries_its_detectors_measured_precision_and_what_to_do():
    record = {
        "about": "warn-late-*",
        "detectors": {
            "logit growth": {"threshold": 50.0, "warnings": 9, "preceded": 8, "horizon": 500, "lead_median": 140}
        },
    }
    said = warning_record.advice("logit growth", 50.0, record)
    assert said.startswith("logit growth: 8 of 9 such warnings preceded a divergence within 500 steps, median 140")
    assert "add QK-norm or QK-clip" in said
    # measured at another threshold than the one in use: no borrowed figures, the action alone
    assert warning_record.advice("logit growth", 25.0, record) == "to do: " + warning_record.ACTIONS["logit growth"]


def test_the_packaged_record_reaches_the_live_alert():
    """The record in the package (written by `normlab leadtime --record`) at each detector's default: the
    alert's line quotes the same count of warnings and events."""
    rec = warning_record.load()
    dets = rec.get("detectors") or {}
    quoted = [
        s for s, m in dets.items() if m.get("threshold") == warning_record.THRESHOLDS[s].default and m.get("warnings")
    ]
    assert quoted, "the package's warning_record.json quotes no detector at its default threshold"
    warn = EarlyWarnings("bf16")
    seen = []
    for s in range(14):  # a head at 2^s: logit growth at step 8 (256), head logit at 12 (1024, 2048, 4096 past 800)
        seen += warn.feed(s, {"max_logit": [[2.0**s]]}, {"loss": 2.0, "grad_norm": 1.0})
    assert [(a.signal, a.step) for a in seen] == [("logit growth", 8), ("head logit", 12)]
    for a in seen:  # both measured by the study at their defaults: each alert quotes its own figures
        m = dets[a.signal]
        assert m["threshold"] == warning_record.THRESHOLDS[a.signal].default
        assert f"{a.signal}: {m['preceded']} of {m['warnings']} such warnings preceded a divergence" in a.line()
        assert warning_record.ACTIONS[a.signal] in a.line()


def test_replay_reads_the_qk_spectrum_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 2.0, "grad_norm": 1.0}) + "\n" for s in range(W + 1))
    )
    rows = [{"step": s, "qk_update_entropy": [[v]]} for s, v in enumerate([*SWAY, 0.5])]
    (run / precursors.QK_SPECTRUM).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(a.signal, a.step) for a in replay(run, "bf16")] == [("qk update entropy", W)]
