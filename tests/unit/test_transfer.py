"""The transfer study: its ranking rule, Kendall's tau and top-k agreement on hand-made rankings, failures
predicted vs seen, the command, and its recipes against recommend's proxy definition."""

import json
import math
from itertools import combinations

import pandas as pd
import pytest

from normlab.cli import main
from normlab.experiments.recipes import load_recipe
from normlab.experiments.summary import load_sweep
from normlab.experiments.transfer import (
    FP16_MAX,
    HEADROOM,
    compare,
    failure_cells,
    rank_sweep,
    report,
    shared_lrs,
    warned_cells,
)
from tests.helpers import synthetic_store

INIT = 5.5


def frame(cells: dict[tuple[str, float], list[tuple[str, float | None]]]) -> pd.DataFrame:
    """A `load_sweep`-shaped table: (layout, lr) -> one (status, final loss) per seed."""
    rows = [
        {"layout": layout, "lr": lr, "seed": seed, "status": status, "final_loss": loss, "initial_loss": INIT}
        for (layout, lr), seeds in cells.items()
        for seed, (status, loss) in enumerate(seeds)
    ]
    return pd.DataFrame(rows)


def ok(*losses: float) -> list[tuple[str, float]]:
    return [("ok", x) for x in losses]


def kendall(order_a: list[str], order_b: list[str]) -> float:
    """Kendall's tau without ties: (concordant - discordant) / pairs."""
    pos = {x: i for i, x in enumerate(order_b)}
    signs = [1 if pos[x] < pos[y] else -1 for x, y in combinations(order_a, 2)]
    return sum(signs) / len(signs)


def test_rank_failures_first_then_best_loss_then_expected_loss():
    runs = frame(
        {
            ("a", 1e-2): ok(2.0, 2.2),
            ("a", 3e-2): ok(2.5, 2.5),
            ("b", 1e-2): ok(1.8, 1.8),
            ("b", 3e-2): [("diverged", 1.0), ("ok", 2.0)],  # lowest loss, one failure
            ("c", 1e-2): ok(2.1, 2.1),
            ("c", 3e-2): ok(3.5, 3.5),  # a's best loss, a worse lr curve
            ("d", 1e-2): [("pending", None), ("pending", None)],
        }
    )  # nothing finished: not ranked
    c_best = 2.1
    table = rank_sweep(runs).set_index("layout")
    a_best = (2.0 + 2.2) / 2
    assert math.isclose(a_best, c_best)  # a tie on best loss: the expected loss over the lrs decides
    a_expected, c_expected = (a_best + 2.5) / 2, (c_best + 3.5) / 2
    assert a_expected < c_expected
    assert list(table.index) == ["a", "c", "b"]
    assert list(table["rank"]) == [1, 2, 3]
    assert table.loc["b", "failed"] == 1 and table.loc["b", "finished"] == 4 and table.loc["b", "failure_rate"] == 0.25
    assert table.loc["a", "best_lr"] == 1e-2 and math.isclose(table.loc["a", "best_loss_std"], math.sqrt(0.02))
    b_expected = (1.8 + (INIT + 2.0) / 2) / 2  # a diverged run counts at its initial loss (Wortsman et al.)
    assert math.isclose(table.loc["b", "expected_loss"], b_expected)
    assert math.isclose(table.loc["a", "expected_loss"], a_expected)


def test_tau_top1_top3_and_discordance_beyond_noise_on_hand_made_rankings():
    proxy_losses = {"a": 1.0, "b": 1.1, "c": 1.2, "d": 1.3, "e": 1.4}
    other_losses = {"b": 1.0, "a": 1.005, "c": 1.2, "e": 1.3, "d": 1.4}  # a/b swapped within noise, d/e beyond
    proxy = frame({(x, 1e-2): ok(v, v) for x, v in proxy_losses.items()})
    other = frame({(x, 1e-2): ok(v, v) for x, v in other_losses.items()})
    agree = compare(proxy, other)
    p_order, o_order = sorted(proxy_losses, key=proxy_losses.get), sorted(other_losses, key=other_losses.get)
    assert agree.proxy_order == p_order and agree.other_order == o_order
    assert math.isclose(agree.tau, kendall(p_order, o_order)) and math.isclose(agree.tau, (8 - 2) / 10)
    assert agree.top1 is False  # a first in the proxy, b in the other
    assert agree.k == 3 and agree.top3 == len(set(p_order[:3]) & set(o_order[:3])) / 3 == 1.0
    assert agree.discordant == [("a", "b"), ("d", "e")] and agree.pairs == 10
    assert agree.discordant_beyond_noise == [("d", "e")]  # |1.005 - 1.0| is below the 0.01 noise floor
    reverse = compare(proxy, frame({(x, 1e-2): ok(3 - v, 3 - v) for x, v in proxy_losses.items()}))
    assert math.isclose(reverse.tau, -1.0) and reverse.top1 is False and reverse.top3 == 1 / 3  # only c in both top 3


def test_failures_predicted_vs_seen_on_the_shared_learning_rates():
    proxy = frame(
        {
            ("pre", 1e-2): ok(2.0, 2.0),
            ("pre", 0.1): [("diverged", 3.0), ("diverged", 3.0)],
            ("peri", 1e-2): ok(2.1, 2.1),
            ("peri", 0.1): ok(2.6, 2.6),
            ("post", 1e-2): [("stalled", 3.3), ("ok", 2.9)],
        }
    )
    other = frame(
        {
            ("pre", 1e-2): [("diverged", 2.5), ("ok", 2.2)],
            ("peri", 1e-2): ok(2.1, 2.1),
            ("post", 1e-2): [("stalled", 3.3), ("stalled", 3.3)],
        }
    )
    assert shared_lrs(proxy, other) == [1e-2]
    assert failure_cells(proxy) == {
        ("peri", 0.01): (0, 2),
        ("peri", 0.1): (0, 2),
        ("post", 0.01): (1, 2),
        ("pre", 0.01): (0, 2),
        ("pre", 0.1): (2, 2),
    }
    common = compare(proxy, other)  # lr 0.1, which the other sweep never ran, is left out of both rankings
    assert common.lrs == [1e-2] and common.proxy_order == ["pre", "peri", "post"]
    assert common.other_order == ["peri", "pre", "post"]
    assert common.failures == {"predicted_and_seen": 1, "predicted_only": 0, "seen_only": 1, "neither": 1}
    assert common.cells_disagreeing == ["pre @ lr 0.01: proxy 0/2 failed, other 1/2"]
    every = compare(proxy, other, lrs="all")  # the proxy ranked on all it ran: pre's divergences at 0.1 count
    assert every.lrs is None and every.proxy_order == ["peri", "pre", "post"] and math.isclose(every.tau, 1.0)
    assert every.failures == common.failures  # failures are compared where both ran
    with pytest.raises(ValueError, match="'common' or 'all'"):
        compare(proxy, other, lrs="some")


def test_fp16_headroom_predicts_the_failures_a_wider_stream_reaches():
    """A proxy seed whose largest activation reached 65504 / 8 warns of its cell failing at width (Pre-LN at
    lr 3e-2: 8,172 and 9,360 at d 64 on the CPU, one seed overflowed at d 128); below that bound, or
    without fp16 storage (no `storage_max`), only divergences predict."""
    proxy = frame({("pre", 3e-3): ok(2.4, 2.4), ("pre", 3e-2): ok(2.9, 3.1), ("peri", 3e-2): ok(2.3, 2.3)})
    below, above = 0.9 * FP16_MAX / HEADROOM, 1.1 * FP16_MAX / HEADROOM
    proxy["max_activation"] = [11.0, 14.0, below, above, 40.0, FP16_MAX / HEADROOM - 1]
    other = frame(
        {
            ("pre", 3e-3): ok(2.3, 2.3),
            ("pre", 3e-2): [("diverged", 3.4), ("diverged", 3.2)],
            ("peri", 3e-2): ok(2.2, 2.2),
        }
    )
    assert 9360.0 > FP16_MAX / HEADROOM > 8172.0 and HEADROOM == 8  # the CPU case: one seed is enough to warn
    assert warned_cells(proxy, FP16_MAX) == {("peri", 0.03): (0, 2), ("pre", 0.003): (0, 2), ("pre", 0.03): (1, 2)}
    plain = compare(proxy, other)
    assert plain.failures == {"predicted_and_seen": 0, "predicted_only": 0, "seen_only": 1, "neither": 2}
    assert plain.failures_with_headroom is None
    warned = compare(proxy, other, storage_max=FP16_MAX)
    assert warned.failures == plain.failures  # the divergence-only tally is kept as it was
    assert warned.failures_with_headroom == {"predicted_and_seen": 1, "predicted_only": 0, "seen_only": 0, "neither": 2}


def test_synthetic_store_ranked_and_compared_with_itself(tmp_path):
    root = synthetic_store(tmp_path)
    runs, _ = load_sweep(root)
    table = rank_sweep(runs).set_index("layout")
    # peri: 1 stalled of 6 finished; pre: 1 diverged of 5 finished (its crashed run is not a result)
    assert (table.loc["peri", "failed"], table.loc["peri", "finished"]) == (1, 6)
    assert (table.loc["pre", "failed"], table.loc["pre", "finished"]) == (1, 5)
    assert list(table.index) == ["peri", "pre"]  # 1/6 < 1/5
    assert math.isclose(table.loc["peri", "best_loss"], (2.6 + 2.8 + 2.7) / 3)
    assert math.isclose(table.loc["peri", "best_loss_std"], 0.1)
    assert math.isclose(table.loc["pre", "best_loss"], 2.9)  # lr 1e-2: its one trained seed
    assert math.isclose(table.loc["pre", "expected_loss"], ((3.0 + 3.2 + 3.4) / 3 + (INIT + 2.9) / 2) / 2)
    assert math.isclose(table.loc["peri", "expected_loss"], ((3.1 + 3.1 + 3.3) / 3 + 2.7) / 2)
    agree = compare(runs, runs)
    assert math.isclose(agree.tau, 1.0) and agree.top1 and agree.top3 == 1.0 and not agree.discordant
    assert agree.failures == {"predicted_and_seen": 2, "predicted_only": 0, "seen_only": 0, "neither": 2}
    text = report(root, [root])
    steps, batch, seq = 300, 32, 128  # TrainConfig's defaults: the synthetic sweep sets none of them
    assert f"{steps} steps ({steps * batch * seq:,} tokens a run); 11 of 12 runs finished" in text
    assert "| syn | 2 | +1.00 (1.00) | yes | 2/2 | 0/1 (0) | 2 / 0 / 0 / 2 |" in text
    assert "| peri | 1 | 1/6 | 2.700 ± 0.100 @ 0.01 | 1 | 1/6 | 2.700 ± 0.100 @ 0.01 |" in text


def test_the_command_prints_the_table_and_refuses_a_folder_without_a_sweep(tmp_path, capsys):
    root = synthetic_store(tmp_path)
    assert main(["transfer", str(root), str(root)]) == 0
    out = capsys.readouterr().out
    assert "Kendall tau" in out and "| syn | 2 | +1.00" in out
    (tmp_path / "empty").mkdir()
    assert main(["transfer", str(root), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no sweep.db" in err[0]
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == []  # nothing written


def test_the_record_keeps_the_numbers_the_command_and_the_status(tmp_path, capsys):
    """--record FILE: the agreement numbers beside the command that produced them and "in progress, N of M
    runs" while any run is pending; a file that is not a record is refused and left as it was."""
    import json

    root = synthetic_store(tmp_path)
    rec_file = tmp_path / "record.json"
    assert main(["transfer", str(root), str(root), "--record", str(rec_file)]) == 0
    assert "record: " in capsys.readouterr().out
    rec = json.loads(rec_file.read_text())
    (c,) = rec["comparisons"]
    assert rec["status"] == "in progress, 11 of 12 runs"  # one sweep, 11 of its 12 runs finished
    assert c["tau"] == 1.0 and c["top1"] is True and c["top3"] == 1.0 and c["placements"] == 2
    assert c["failures"] == {"predicted_and_seen": 2, "predicted_only": 0, "seen_only": 0, "neither": 2}
    assert c["command"] == f"normlab transfer {root} {root}"
    # what the rungs trained under and at what shape, and each placement's best lr at both (issue 54)
    assert c["parametrization"] == "sp" and c["proxy_shape"] == c["other_shape"]
    assert set(c["proxy_shape"]) == {"d_model", "n_layers", "tokens", "parametrization", "precision", "optimizer"}
    assert c["best_lr"]["proxy"] == c["best_lr"]["other"] and set(c["best_lr"]["proxy"]) == {"pre", "peri"}
    # where between the grid's rates each optimum lies (normlab.experiments.lr_optimum): a sweep against itself
    # moved by x1, and the grid's best rate is kept beside the fitted one
    assert set(c["lr_optimum"]) == {"pre", "peri"}
    for layout, moved in c["lr_optimum"].items():
        assert moved["factor"] == 1.0 and moved["proxy"] == moved["other"]
        assert moved["proxy"]["grid_lr"] == c["best_lr"]["proxy"][layout]
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    assert main(["transfer", str(root), str(root), "--record", str(other)]) == 2
    assert "is not a transfer record" in capsys.readouterr().err and other.read_text() == '{"mine": 1}'


def test_the_rungs_name_the_devices_their_runs_trained_on(tmp_path, capsys):
    """Each finished run's summary.json names its device (`device_name`); the report's rung line and the record's
    shapes list them, whichever lease ran which runs (issue 54 item 5); a run without the name adds none."""
    from normlab.runs.files import SweepDir
    from normlab.runs.store import open_store

    root = synthetic_store(tmp_path)
    sweep = SweepDir(root)
    done = [r for r in open_store(sweep).rows() if r["status"] in ("ok", "diverged", "stalled")]
    for row, name in zip(done, ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200", None]):
        folder = sweep.run(row["run_id"]).path
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "summary.json").write_text(json.dumps({"status": row["status"], "device_name": name}))
    text = report(root, [root])
    assert "11 of 12 runs finished on NVIDIA H100 80GB HBM3 + NVIDIA H200 (8 of them name no device)" in text
    rec_file = tmp_path / "record.json"
    assert main(["transfer", str(root), str(root), "--record", str(rec_file)]) == 0
    (c,) = json.loads(rec_file.read_text())["comparisons"]
    assert c["proxy_shape"]["devices"] == c["other_shape"]["devices"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert c["proxy_shape"]["unnamed_runs"] == 8  # 11 finished, 3 named


LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("key,config,ffn,gqa,depth", [("llama1b", LLAMA_1B, 4, 4, 16), ("qwen3", QWEN3_06B, 3, 2, 28)])
def test_recipes_train_recommends_proxy_and_widen_it_alone(tmp_path, key, config, ffn, gqa, depth):
    """The proxy rungs are recommend's proxy for the config (if recommend's proxy changes, the study's
    recipes must follow); the wider rungs change the width (heads of 16, the FFN and GQA ratios kept)
    and the steps, nothing else; the current placement is among the candidates."""
    from normlab.config.commands import RECOMMEND_BASE, RECOMMEND_CANDIDATES
    from normlab.model.config import ModelConfig
    from normlab.recommend.planning.shape import proxy_shape, read_user_model

    (tmp_path / "config.json").write_text(json.dumps(config))
    user = read_user_model(str(tmp_path / "config.json"))

    def first(name):
        r = load_recipe(name)
        return r, r.expand()[0].train_config("unused")

    stress, cfg = first(f"transfer-{key}-stress")
    # the study trains the defaults it began with; issue 42's placements (from peri-derf on) came after it
    studied = RECOMMEND_CANDIDATES[: RECOMMEND_CANDIDATES.index("peri-derf")]
    assert set(stress.grid["layout"]) == set(studied) and stress.grid["lr"] == [0.1]
    assert cfg.model.model_config() == ModelConfig(**proxy_shape(user.config, 12))
    for k, v in RECOMMEND_BASE.items():
        assert stress.base[k] == v, k
    assert stress.base["activation_dtype"] == "fp16"
    names = {
        64: f"transfer-{key}-w64",
        128: f"transfer-{key}-w128",
        256: f"gpu-transfer-{key}-w256",
        1024: f"gpu-transfer-{key}-w1024",
    }
    times_tokens = {64: 1, 128: 4, 256: 4, 1024: 16}  # at least 4x the proxy's tokens at every wider rung
    rungs = {w: first(name) for w, name in names.items()}
    proxy, proxy_cfg = rungs[64]
    assert proxy_cfg.model.model_config() == ModelConfig(**proxy_shape(user.config, 6))
    assert {k: proxy.base[k] for k in RECOMMEND_BASE} == RECOMMEND_BASE
    assert user.layout in proxy.grid["layout"]
    gpu_proxy, gpu_cfg = first(f"gpu-transfer-{key}-w64")
    assert gpu_cfg.model.model_config() == ModelConfig(**proxy_shape(user.config, depth))  # the user's depth on a GPU
    for w, (recipe, cfg) in rungs.items():
        base = gpu_cfg if recipe.machine == "gpu" else proxy_cfg
        heads = w // 16
        want = base.model.model_config().with_(d_model=w, n_heads=heads, n_kv_heads=heads // gqa, d_ff=ffn * w)
        assert cfg.model.model_config() == want, recipe.name
        tokens = cfg.optim.steps * cfg.data.batch_size * cfg.data.seq_len
        proxy_tokens = RECOMMEND_BASE["steps"] * RECOMMEND_BASE["batch_size"] * RECOMMEND_BASE["seq_len"]
        assert tokens == times_tokens[w] * proxy_tokens, recipe.name
        assert recipe.grid["layout"] == proxy.grid["layout"] and recipe.grid["seed"] == [0, 1]
        assert set(recipe.grid["lr"]) <= set(proxy.grid["lr"]) and 1e-2 in recipe.grid["lr"]
