"""`normlab train --init-from` a transformers folder takes every setting the folder states (issue 51, item 1).

Each folder is a tiny random stock transformers model saved with settings other than normlab's defaults (norm
epsilon 1e-4, RoPE base 3000, a RoPE base per layer type, tied embeddings, soft-caps, windows, a head width of
its own). The model `normlab train` builds from it, by the trainer's own code path, must compute the stock
model's logits on the same tokens (float32, 1e-5); a run trained from it records those settings, so the model
rebuilt from its checkpoint (what resume, export and eval build) and its export compute them too. A flag that
contradicts the folder is refused in one line, exit 2, before anything is written.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

tf = pytest.importorskip("transformers")

from normlab.cli import build_parser, main  # noqa: E402
from normlab.config.overrides import settings_keys, train_config  # noqa: E402
from normlab.errors import ConfigError  # noqa: E402
from normlab.runs.model import build_run_model, load_run_model  # noqa: E402
from normlab.runs.start import recorded_shape  # noqa: E402
from normlab.train.init_from import folder_settings, read_init_weights  # noqa: E402

VOCAB = 300  # above the byte tokenizer's 257 ids, so the test corpus trains on every folder
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-4,
    eos_token_id=None,
)
LOCAL_GLOBAL = {  # OLMo 3 / Gemma 3: one RoPE base per layer type, neither of them the class's default
    "full_attention": {"rope_type": "default", "rope_theta": 3000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 700.0},
}
FOLDERS = {  # name: (config class, model class, config fields)
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(COMMON, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 3000.0}),
    ),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(COMMON, num_hidden_layers=4, sliding_window=4, rope_parameters=LOCAL_GLOBAL),
    ),
    "gemma2": (  # tied embeddings (Gemma's default), both soft-caps small enough to bend, windows, head width 16
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=2.0,
            rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            rope_parameters=LOCAL_GLOBAL,
        ),
    ),
    "qwen3": (  # a head width other than d_model / n_heads
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(COMMON, num_hidden_layers=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 3000.0}),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            COMMON, num_hidden_layers=2, sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 3e3}
        ),
    ),
}
# what each folder states that normlab's defaults (eps 1e-6, RoPE 10,000, untied, no caps) would get wrong
STATED = {
    "llama": dict(norm_eps=1e-4, rope_theta=3000.0, tie_embeddings=False),
    "olmo3": dict(norm_eps=1e-4, rope_theta=3000.0, rope_local_theta=700.0, sliding_window=4, full_attention_every=4),
    "gemma2": dict(tie_embeddings=True, attn_softcap=0.5, logit_softcap=2.0, attn_scale=12.0, d_head=16),
    "gemma3": dict(rope_theta=3000.0, rope_local_theta=700.0, full_attention_every=3, d_head=16, tie_embeddings=True),
    "qwen3": dict(d_head=16, rope_theta=3000.0),
    "mistral": dict(sliding_window=4, full_attention_every=0, rope_theta=3000.0),
}


def stock_model(name: str):
    config_class, model_class, fields = FOLDERS[name]
    torch.manual_seed(0)
    model = getattr(tf, model_class)(getattr(tf, config_class)(**fields)).eval()
    low, high = (-0.5, 0.5) if "gemma" in name else (0.5, 1.5)  # Gemma's gains are stored as w in (1 + w)
    with torch.no_grad():  # norm gains away from their init, so that a misplaced or mis-parametrized norm shows
        for key, p in model.named_parameters():
            if "norm" in key:
                p.uniform_(low, high)
    return model


def logits(model, x=TOKENS):
    with torch.no_grad():
        out = model(input_ids=x) if isinstance(model, tf.PreTrainedModel) else model(x)
    return out.logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each stock model saved with save_pretrained, and its logits on TOKENS."""
    root = tmp_path_factory.mktemp("hf")
    saved = {}
    for name in FOLDERS:
        model = stock_model(name)
        model.save_pretrained(root / name)
        saved[name] = (root / name, logits(model))
    return saved


def train_args(folder, corpus, out, *extra) -> list[str]:
    return [
        "train",
        "--init-from",
        str(folder),
        "--data",
        str(corpus),
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--probe-every",
        "0",
        "--no-layer-stats",
        "--no-progress",
        "--device",
        "cpu",
        "--out",
        str(out),
        *map(str, extra),
    ]


def built_as_train_builds(argv: list[str], vocab: int = 257):
    """The model `normlab train ARGV` starts from: its configuration as the command builds it (flags, the
    folder's settings), the model as the trainer builds it (`build_run_model` at the data's vocabulary), the
    folder's weights read and loaded as the trainer loads them."""
    args = build_parser().parse_args(argv)
    given = settings_keys(args)
    cfg = folder_settings(recorded_shape(train_config(args), given), given)
    init = read_init_weights(cfg.model.init_from)
    init.check_vocab(vocab)
    model = build_run_model(cfg.model.layout, cfg.model.size, cfg.model.options, cfg.data.seq_len, vocab)
    init.load_into(model)
    return cfg, model.eval()


@pytest.mark.parametrize("name", list(FOLDERS))
def test_the_model_train_builds_computes_the_stock_logits(name, folders, corpus, tmp_path, capsys):
    folder, expected = folders[name]
    cfg, model = built_as_train_builds(train_args(folder, corpus, tmp_path / "run"))
    for option, value in STATED[name].items():
        assert getattr(model.config, option) == value, option
        assert cfg.model.options[option] == value, option  # what config.json records
    assert model.config.vocab_size == VOCAB and model.config.norm_eps == 1e-4
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=1e-5)
    kind = getattr(tf, FOLDERS[name][0]).model_type
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"normlab train: --init-from {folder}: the folder's settings ({kind}")
    assert f"layout {cfg.model.layout_label}" in said[0] and "norm_eps=0.0001" in said[0]


def test_olmo3_rope_as_transformers_fills_it_in(folders, tmp_path):
    """An OLMo 3 config.json with a flat rope_parameters: transformers leaves OLMo 3's own 500,000 on both layer
    types (its `convert_rope_params_to_dict`), whatever the flat dict's rope_theta says; normlab reads what the
    stock model computes with."""
    import shutil

    folder = tmp_path / "flat"
    shutil.copytree(folders["olmo3"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 3000.0}
    (folder / "config.json").write_text(json.dumps(config))
    stock = tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert float(stock.model.rotary_emb.full_attention_inv_freq[1]) == pytest.approx(500_000.0 ** (-2 / 8))
    _, model = built_as_train_builds(train_args(folder, tmp_path / "c.txt", tmp_path / "run"))
    assert (model.config.rope_theta, model.config.rope_local_theta) == (500_000.0, None)
    torch.testing.assert_close(logits(model), logits(stock), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "olmo3"])
def test_a_run_records_the_folders_settings_for_resume_and_export(name, folders, corpus, tmp_path, capsys):
    """One step at a learning rate of 1e-12 (the weights move by about that): the model rebuilt from the run's
    checkpoint and config.json (what resume, export and eval build) computes the stock logits, and so does the
    export in the stock class; the same command again finds the run finished (same settings, same identity)."""
    folder, expected = folders[name]
    run = tmp_path / "run"
    argv = train_args(folder, corpus, run, "--steps", "1", "--lr", "1e-12", "--warmup", "0")
    assert main(argv) == 0
    recorded = json.loads((run / "config.json").read_text())["config"]["model"]
    assert recorded["layout"] == {"llama": "pre", "olmo3": "olmo2"}[name]
    assert {k: recorded["options"][k] for k in STATED[name]} == STATED[name]
    rebuilt = load_run_model(run).model
    torch.testing.assert_close(logits(rebuilt), expected, atol=1e-5, rtol=1e-5)
    assert main(["export", str(run), str(tmp_path / "export"), "--arch", name]) == 0
    exported = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True).eval()
    assert type(exported).__name__ == FOLDERS[name][1]
    torch.testing.assert_close(logits(exported), expected, atol=1e-5, rtol=1e-5)
    capsys.readouterr()
    assert main(argv) == 0 and "already finished" in capsys.readouterr().out


def refused(argv, needle, capsys) -> str:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, err[-800:])
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize(
    "name, flags, needles",
    [
        (
            "llama",
            ["--model", "norm_eps=1e-6"],
            ["the folder's rms_norm_eps is 0.0001", "model.norm_eps=1e-06 was given", "leave model.norm_eps out"],
        ),
        ("llama", ["--set", "model.rope_theta=10000"], ["rope_parameters rope_theta is 3000", "rope_theta=10000"]),
        ("llama", ["--model", "tie_embeddings=true"], ["tie_word_embeddings is False", "tie_embeddings=True"]),
        (
            "llama",
            ["--layout", "peri"],
            ["class (llama) computes layout pre", "--layout peri asks", "leave the layout out"],
        ),
        ("llama", ["--size", "tiny"], ["hidden_size is 32", "--size tiny has d_model=128", "leave --size out"]),
        ("llama", ["--model", "max_seq_len=32"], ["max_position_embeddings is 64", "model.max_seq_len=32 was given"]),
        ("olmo3", ["--model", "rope_local_theta=10000"], ["sliding_attention rope_theta is 700", "rope_local_theta"]),
        ("gemma2", ["--model", "logit_softcap=30"], ["final_logit_softcapping is 2", "model.logit_softcap=30"]),
        ("gemma2", ["--model", "tie_embeddings=false"], ["tie_word_embeddings is True", "tie_embeddings=False"]),
        ("gemma3", ["--model", "d_head=8"], ["head_dim is 16", "model.d_head=8"]),
    ],
)
def test_a_flag_that_contradicts_the_folder_is_one_line_and_writes_nothing(
    name, flags, needles, folders, corpus, tmp_path, capsys
):
    line = refused(train_args(folders[name][0], corpus, tmp_path / "run", *flags), needles[0], capsys)
    assert all(n in line for n in needles), line
    assert not (tmp_path / "run").exists()


def test_flags_that_agree_with_the_folder_are_taken(folders, corpus, tmp_path):
    """Explicit flags stating the folder's own values (another spelling of the head width included), the
    options that only say how to train (the init scheme), and a longer RoPE table than the folder's pass."""
    folder, expected = folders["qwen3"]
    argv = train_args(folder, corpus, tmp_path / "run", "--layout", "qwen3", "--model", "norm_eps=0.0001")
    cfg, model = built_as_train_builds([*argv, "--model", "d_head=16", "--model", "init=normal"])
    assert cfg.model.options["init"] == "normal" and model.config.head_dim == 16
    assert model.config.max_seq_len == 64  # the folder's max_position_embeddings, longer than --seq-len 16
    _, longer = built_as_train_builds([*argv, "--seq-len", "128"])
    assert longer.config.max_seq_len == 128
    _, table = built_as_train_builds([*argv, "--model", "max_seq_len=96"])
    assert table.config.max_seq_len == 96
    torch.testing.assert_close(logits(longer), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=1e-5)


def test_a_normlab_class_folder_states_its_layout_and_options(corpus, tmp_path, capsys):
    """A normlab-class folder (what `normlab export` writes where no stock class is exact) states its layout and
    every option: a Peri-LN model with a residual scale, eps 1e-4, RoPE 3000 and tied embeddings comes back as
    it was saved, and another layout is refused."""
    import normlab
    from normlab.hf.modeling import NormLabConfig, NormLabForCausalLM

    saved = normlab.build_model(
        "peri,h=0.5", "nano", seed=0, vocab_size=VOCAB, norm_eps=1e-4, rope_theta=3000.0, tie_embeddings=True
    ).eval()
    folder = tmp_path / "normlab"
    hf = NormLabForCausalLM(NormLabConfig(layout=saved.layout.to_string(), model=saved.config.to_dict()))
    hf.normlab.load_state_dict(saved.state_dict())
    hf.save_pretrained(folder)
    cfg, model = built_as_train_builds(train_args(folder, corpus, tmp_path / "run"))
    assert model.layout.to_string() == "attn=AB,mlp=AB,emb,final,h=0.5" and model.config.tie_embeddings
    torch.testing.assert_close(logits(model), logits(saved), atol=1e-5, rtol=1e-5)
    capsys.readouterr()  # save_pretrained's progress bar
    refused(
        train_args(folder, corpus, tmp_path / "run", "--layout", "peri"),
        "the folder's class (normlab) computes layout attn=AB,mlp=AB,emb,final,h=0.5, but --layout peri asks",
        capsys,
    )
    assert not (tmp_path / "run").exists()


def test_learned_positions_bound_the_sequence_length(corpus, tmp_path, capsys):
    """GPT-2's positions are weights, one row per position: the folder's n_positions is the run's too, and a
    longer --seq-len is refused in one line, before anything is written (a RoPE table may grow: above)."""
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=24, layer_norm_epsilon=1e-4)
    ).eval()
    gpt2.save_pretrained(tmp_path / "gpt2")
    cfg, model = built_as_train_builds(train_args(tmp_path / "gpt2", corpus, tmp_path / "run"))
    assert (model.config.position, model.config.max_seq_len, model.config.norm_eps) == ("learned", 24, 1e-4)
    assert cfg.model.layout_label == "pre,norm=layer"
    torch.testing.assert_close(logits(model), logits(gpt2), atol=1e-5, rtol=1e-5)
    capsys.readouterr()
    line = refused(
        train_args(tmp_path / "gpt2", corpus, tmp_path / "run", "--seq-len", "32"),
        "--seq-len 32 is longer than the folder's n_positions 24",
        capsys,
    )
    assert "give --seq-len 24 or less" in line and not (tmp_path / "run").exists()


def test_rope_normlab_does_not_compute_is_refused_before_anything_is_written(folders, corpus, tmp_path, capsys):
    """Scaled RoPE (linear, here) is not computed by normlab: one line naming it, not a model that drops it."""
    import shutil

    folder = tmp_path / "scaled"
    shutil.copytree(folders["llama"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 3000.0}
    (folder / "config.json").write_text(json.dumps(config))
    line = refused(train_args(folder, corpus, tmp_path / "run"), "rope_type 'linear'", capsys)
    assert "normlab implements default RoPE" in line and not (tmp_path / "run").exists()


def test_a_config_built_elsewhere_is_checked_when_the_weights_load(folders, corpus, tmp_path):
    """A TrainConfig made in Python (or a sweep's) does not pass through `normlab train`'s flags: the weights of a
    transformers folder load only into a model that computes what the folder states."""
    from normlab.train import TrainConfig, train

    folder = folders["llama"][0]
    shape = {f"model.{k}": v for k, v in dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48).items()}
    base = dict(data=str(corpus), init_from=str(folder), layout="pre", seq_len=16, batch_size=2, steps=1)
    base.update(device="cpu", progress=False, eval_every=0, probe_every=0, **shape)
    with pytest.raises(ConfigError, match="the folder states vocab_size=300"):
        train(TrainConfig.of(**base, out=str(tmp_path / "a")))
    with pytest.raises(ConfigError, match=r"the folder states rope_theta=3000, this run's model has 10000"):
        train(TrainConfig.of(**base, out=str(tmp_path / "b"), **{"model.vocab_size": VOCAB}))
    stated = {"model.vocab_size": VOCAB, "model.rope_theta": 3e3}
    with pytest.raises(ConfigError, match=r"the folder states norm_eps=0.0001, this run's model has 1e-06"):
        train(TrainConfig.of(**base, out=str(tmp_path / "c"), **stated))
    summary = train(TrainConfig.of(**base, out=str(tmp_path / "d"), **stated, **{"model.norm_eps": 1e-4}))
    assert summary["status"] == "ok" and math.isfinite(summary["final_loss"])
