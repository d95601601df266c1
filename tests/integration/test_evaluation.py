"""`normlab eval`: lm-evaluation-harness on runs, exports and sweeps, scored against hand computations.

The shipped local tasks are scored by hand with normlab's own forward (log-likelihoods of the
choices, rolling log-likelihood of the passages, greedy generation to the newline) and compared with
what lm-eval reports, through `normlab eval` and through lm-eval's own command line on an export.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import normlab

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from normlab.data import ByteTokenizer
from normlab.evaluation.harness import LOCAL_TASKS, TASKS_DIR, EvalError, evaluate
from normlab.hf import save_hf
from normlab.hf.tokenizer import to_hf_tokenizer
from normlab.runs.evals import headline_scores
from normlab.runs.files import RunDir

N = 3  # items per task


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / f"{name}.jsonl").read_text().splitlines()[:N]]


def logprob(model, context: bytes, continuation: bytes) -> float:
    """log p(continuation | context) under byte tokens, by hand."""
    ids = torch.tensor([list(context + continuation)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1]).logits.double(), -1)[0]
    start = len(context) - 1
    return float(sum(logp[start + i, b] for i, b in enumerate(continuation)))


def scores_by_hand(model) -> dict[str, float]:
    acc, acc_norm = [], []
    for item in rows("next_line"):
        # lm-eval moves the context's trailing whitespace (our newline) to the front of each continuation
        ctx = item["context"].rstrip().encode()
        ll = [logprob(model, ctx, ("\n" + c).encode()) for c in item["choices"]]
        acc.append(max(range(4), key=lambda i: ll[i]) == item["label"])
        acc_norm.append(max(range(4), key=lambda i: ll[i] / len(item["choices"][i])) == item["label"])
    total_ll, total_bytes, total_words = 0.0, 0, 0
    for item in rows("passages"):
        text = item["text"].encode()  # one window (max_seq_len 2048), after the end-of-text prefix
        total_ll += logprob(model, bytes([0]), text)
        total_bytes += len(text)
        total_words += len(item["text"].split())
    hits, gens = [], []
    for item in rows("speaker"):
        seq = torch.tensor([list(item["context"].encode())])
        with torch.no_grad():
            for _ in range(32):
                nxt = model(seq).logits[:, -1:].argmax(-1)
                seq = torch.cat([seq, nxt], 1)
                if nxt.item() in (ord("\n"), 0):
                    break
        text = (
            bytes(seq[0, len(item["context"].encode()) :].tolist())
            .split(b"\n")[0]
            .split(b"\x00")[0]
            .decode(errors="replace")
        )
        gens.append(text)
        hits.append(text.strip() == item["target"])
    return {
        "acc": sum(acc) / N,
        "acc_norm": sum(acc_norm) / N,
        "bits_per_byte": -total_ll / total_bytes / math.log(2),
        "byte_perplexity": math.exp(-total_ll / total_bytes),
        "exact_match": sum(hits) / N,
        "gens": gens,
    }


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A nano peri model with a long context (no truncation) as a normlab export with its byte tokenizer."""
    model = normlab.build_model("peri", "nano", seed=0, max_seq_len=2048).eval()
    out = tmp_path_factory.mktemp("eval") / "export"
    save_hf(model, out, to_hf_tokenizer(ByteTokenizer(), 2048))
    return model, out


def test_local_tasks_through_normlab_eval_match_hand_computation(export):
    model, out = export
    res = evaluate(out, list(LOCAL_TASKS), limit=N, samples=True)
    want = scores_by_hand(model)
    got = RunDir(out).evals()
    mc, gen, ppl = (got[f"normlab_shakespeare_{t}"]["metrics"] for t in ("next_line", "speaker", "ppl"))
    assert mc["acc"] == pytest.approx(want["acc"]) and mc["acc_norm"] == pytest.approx(want["acc_norm"])
    assert ppl["bits_per_byte"] == pytest.approx(want["bits_per_byte"], rel=1e-4)
    assert ppl["byte_perplexity"] == pytest.approx(want["byte_perplexity"], rel=1e-4)
    assert gen["exact_match"] == pytest.approx(want["exact_match"])
    generated = [
        json.loads(line)["filtered_resps"][0]
        for line in (out / "eval_samples" / "normlab_shakespeare_speaker.jsonl").read_text().splitlines()
    ]
    assert [g.split("\n")[0] for g in generated] == want["gens"]  # the same greedy text, stopped at the newline
    assert got["normlab_shakespeare_next_line"]["n"] == N and res["path"] == out / "eval.json"
    assert "normlab_shakespeare_ppl" in res["table"]


@pytest.mark.slow  # normlab eval on the same export and tasks (test_local_tasks_through_normlab_eval_...) is fast
def test_lm_eval_command_line_on_an_export_agrees(export, tmp_path):
    """The user's route: lm-eval's own CLI on the export, loglikelihood and generate_until tasks,
    with no model arguments beyond the folder and trust_remote_code."""
    model, out = export
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={out},trust_remote_code=True",
            "--tasks",
            "normlab_shakespeare_next_line,normlab_shakespeare_speaker",
            "--include_path",
            str(TASKS_DIR),
            "--limit",
            str(N),
            "--device",
            "cpu",
            "--output_path",
            str(tmp_path / "lm_eval"),
            "--batch_size",
            str(N),
            "--log_samples",
        ],  # one batch: right padding for scores, left for generation
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())["results"]
    want = scores_by_hand(model)
    samples = [
        json.loads(line)
        for line in next((tmp_path / "lm_eval").rglob("samples_normlab_shakespeare_speaker_*.jsonl"))
        .read_text()
        .splitlines()
    ]
    generated = [s["filtered_resps"][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
    assert [g.split("\n")[0] for g in generated] == want["gens"]  # a left-padded batch generates what one prompt does
    assert results["normlab_shakespeare_next_line"]["acc,none"] == pytest.approx(want["acc"])
    assert results["normlab_shakespeare_next_line"]["acc_norm,none"] == pytest.approx(want["acc_norm"])
    assert results["normlab_shakespeare_speaker"]["exact_match,none"] == pytest.approx(want["exact_match"])


def test_a_run_is_evaluated_in_memory_merged_and_reported(corpus, tmp_path, capsys):
    from normlab.cli import main
    from normlab.diagnostics.run_report import make_report

    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--size",
                "nano",
                "--seq-len",
                "32",
                "--batch-size",
                "4",
                "--steps",
                "2",
                "--probe-every",
                "0",
                "--eval-every",
                "0",
                "--no-progress",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["eval", str(run), "--tasks", "normlab_shakespeare_next_line", "--limit", "2"]) == 0
    out, err = capsys.readouterr()
    # quiet: the table, the items scored and what was truncated; lm-eval's bars and notices in eval_log.txt
    assert "items scored: normlab_shakespeare_next_line 2 (--limit 2)" in out
    assert "requests were longer than the model's 64 tokens" in out  # seq 32 -> max_seq_len 64: contexts cut
    assert "Running loglikelihood" not in out + err and "Truncating" not in out + err and len(out.splitlines()) < 15
    assert "Running loglikelihood requests" in (run / "eval_log.txt").read_text()
    assert main(["eval", str(run), "--tasks", "normlab_shakespeare_ppl", "--limit", "1"]) == 0
    evals = RunDir(run).evals()
    trunc = evals["normlab_shakespeare_next_line"]["truncation"]
    assert trunc["requests"] == 2 * 4 and trunc["max_length"] == 64  # 2 items x 4 choices, every one cut
    assert set(evals) == {"normlab_shakespeare_next_line", "normlab_shakespeare_ppl"}  # merged, not replaced
    assert evals["normlab_shakespeare_next_line"]["step"] == 2 and evals["normlab_shakespeare_ppl"]["limit"] == 1
    # the export of the same run scores the same
    assert main(["export", str(run), str(tmp_path / "exp")]) == 0
    evaluate(tmp_path / "exp", ["normlab_shakespeare_next_line"], limit=2)
    assert (
        RunDir(tmp_path / "exp").evals()["normlab_shakespeare_next_line"]["metrics"]
        == evals["normlab_shakespeare_next_line"]["metrics"]
    )
    page = make_report([run], tmp_path / "report").read_text()
    assert "Downstream evaluation" in page and "normlab_shakespeare_ppl" in page and "bits_per_byte" in page
    # every score says how many items it rests on
    assert list(headline_scores(evals)) == [
        "normlab_shakespeare_next_line acc (n=2)",
        "normlab_shakespeare_ppl bits_per_byte (n=1)",
    ]


def test_bad_eval_input_is_explained(tmp_path, capsys):
    from normlab.cli import main

    with pytest.raises(EvalError, match="not a run directory .* an export folder .* or a sweep folder"):
        evaluate(tmp_path, ["normlab_local"])
    model = normlab.build_model("pre", "nano", seed=0)
    save_hf(model, tmp_path / "e", to_hf_tokenizer(ByteTokenizer(), 64))
    # a typo in normlab's own namespace is answered without indexing lm-eval's tasks
    assert main(["eval", str(tmp_path / "e"), "--tasks", "normlab_local,normlab_no_such_task"]) == 2
    err = capsys.readouterr().err
    assert "unknown task(s) normlab_no_such_task:" in err and "normlab_shakespeare_ppl" in err
    assert main(["eval", "--tasks-dir"]) == 0 and capsys.readouterr().out.strip() == str(TASKS_DIR)
    assert main(["eval", "--list"]) == 0
    assert "normlab_kim2025: arc_easy, hellaswag, piqa, social_iqa, winogrande" in capsys.readouterr().out


@pytest.mark.slow
def test_an_unknown_task_is_looked_up_in_lm_evals_whole_index(tmp_path, capsys):
    """A name outside normlab's namespace is checked against every task lm-eval ships (about 15 s to index);
    the quick test above covers the message through normlab's namespace."""
    from normlab.cli import main

    save_hf(normlab.build_model("pre", "nano", seed=0), tmp_path / "e", to_hf_tokenizer(ByteTokenizer(), 64))
    assert main(["eval", str(tmp_path / "e"), "--tasks", "no_such_task"]) == 2
    assert "unknown task(s) no_such_task" in capsys.readouterr().err


def test_sweep_summary_shows_eval_scores_per_cell(tmp_path):
    from normlab.experiments import load_sweep, summarize
    from tests.helpers import synthetic_store

    root = synthetic_store(tmp_path)
    df, _ = load_sweep(root)
    for r in df.itertuples():
        if r.status == "ok":
            score = 0.3 + 0.1 * r.seed if (r.layout, r.lr) == ("pre", 1e-3) else 0.9
            (root / "runs" / r.run_id).mkdir(parents=True, exist_ok=True)
            (root / "runs" / r.run_id / "eval.json").write_text(
                json.dumps({"normlab_shakespeare_next_line": {"metrics": {"acc": score, "acc_norm": 0.25}}})
            )
    md = summarize(root)["markdown"].read_text()
    assert (
        "| layout | lr | divergences | stalled | failed | final loss | val loss | normlab_shakespeare_next_line acc |"
        in md
    )
    assert "| pre | 0.001 | 0/3 | 0/3 | 0 | 3.2000 ± 0.2000 | 3.3000 ± 0.2000 | 0.4000 ± 0.1000 |" in md
    df, _ = load_sweep(root)
    assert "eval: normlab_shakespeare_next_line acc" in df.columns


def test_normlab_eval_on_a_sweep_scores_the_ok_runs_and_skips_the_diverged(corpus, tmp_path):
    from normlab.cli import main
    from normlab.experiments import SweepConfig, load_sweep, run_sweep, summarize

    base = dict(
        data=str(corpus),
        size="nano",
        seq_len=32,
        batch_size=4,
        steps=3,
        eval_every=0,
        eval_batches=1,
        probe_every=0,
        layout="peri",
        diverge_patience=1,
    )
    sweep = SweepConfig(name="ev", base=base, grid={"lr": [1e-3, 1e4]})  # lr 1e4 diverges
    counts = run_sweep(sweep, tmp_path / "sw", workers=1, log=lambda *a, **k: None)
    assert counts["ok"] == 1 and counts["diverged"] == 1
    assert main(["eval", str(tmp_path / "sw"), "--tasks", "normlab_shakespeare_next_line", "--limit", "2"]) == 0
    df, _ = load_sweep(tmp_path / "sw")
    scored = {r.status: RunDir(tmp_path / "sw" / "runs" / r.run_id).evals() for r in df.itertuples()}
    assert set(scored["ok"]) == {"normlab_shakespeare_next_line"} and scored["diverged"] == {}
    assert "normlab_shakespeare_next_line acc" in summarize(tmp_path / "sw")["markdown"].read_text()
