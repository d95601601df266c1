"""Generation through transformers: KV cache, padding, end-of-text, activation checkpointing, and an
export that loads where normlab is not installed.

Every check compares against a computation without the feature: cached decoding against re-running
the prefix, a padded row against the sequence alone, the bundled remote code against normlab.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

import normlab
from normlab.model.decoding import make_decoding

tf = pytest.importorskip("transformers")

from normlab.hf import save_hf, to_hf  # noqa: E402
from normlab.hf.bundle import BundleError, bundle_source  # noqa: E402
from tests.helpers import built_once  # noqa: E402

CASES = [  # layout, size, overrides: RoPE, learned positions, inner norms, GQA, soft-capping, windows, MLA, MoDA,
    # Depth-Attention, MoE
    ("peri", "nano", {}),
    ("hybrid", "nano", {"n_kv_heads": 2}),
    ("pre,norm=layer", "nano", {"position": "learned"}),
    ("gemma2", "nano", {"attn_softcap": 20.0}),
    ("qwen3", "nano", {"d_head": 16, "sliding_window": 4, "full_attention_every": 2}),  # windows shorter than the text
    ("qwen3", "nano", {"attention": "mla", "q_lora_rank": 8, "qk_rope_head_dim": 4}),  # MLA with QK-norm
    ("post", "nano", {"attention": "moda", "n_kv_heads": 1, "moda_ffn_kv": True}),  # MoDA: new tokens' depth keys
    ("pre", "nano", {"attention": "depth_value", "n_kv_heads": 1}),  # Depth-Attention: mixed values in the cache
    ("pre", "moe-micro", {}),
]
DENSE = CASES[:-1]


def greedy_by_hand(model, prompt, n):
    """Greedy decoding that re-runs the whole prefix each step, with normlab's own forward."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    return seq


@pytest.mark.parametrize("layout, size, opts", CASES)
def test_cached_generation_equals_rerunning_the_prefix(layout, size, opts):
    model = normlab.build_model(layout, size, seed=0, **opts).eval()
    hf = to_hf(model)
    prompt = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    lengths = []
    hook = hf.normlab.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    cached = hf.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    hook.remove()
    assert lengths == [6] + [1] * 9  # the prompt once, then one token per step: the cache is used
    uncached = hf.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False, pad_token_id=0)
    torch.testing.assert_close(cached, greedy_by_hand(model, prompt, 10), rtol=0, atol=0)
    torch.testing.assert_close(uncached, cached, rtol=0, atol=0)


@pytest.mark.parametrize("layout, size, opts", DENSE)
def test_prefill_in_chunks_with_the_cache_gives_the_full_forward_logits(layout, size, opts):
    """Past > 0 and several new tokens: the explicit causal mask over cached + new keys."""
    model = normlab.build_model(layout, size, seed=0, **opts).eval()
    hf = to_hf(model)
    x = torch.randint(1, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    cache = tf.DynamicCache()
    with torch.no_grad():
        a = hf(input_ids=x[:, :5], past_key_values=cache, use_cache=True).logits
        b = hf(input_ids=x[:, 5:9], past_key_values=cache, use_cache=True).logits
        c = hf(input_ids=x[:, 9:], past_key_values=cache, use_cache=True).logits
        full = model(x).logits
    torch.testing.assert_close(torch.cat([a, b, c], 1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 11


@pytest.mark.parametrize("layout, size, opts", DENSE)
def test_a_left_padded_batch_computes_each_sequence_alone(layout, size, opts):
    model = normlab.build_model(layout, size, seed=0, **opts).eval()
    hf = to_hf(model)
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(1, 256, (1, 8), generator=g), torch.randint(1, 256, (1, 5), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()  # padding queries see themselves: no empty softmax rows
    torch.testing.assert_close(logits[1:, 3:], model(short).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:1], model(long).logits, rtol=1e-5, atol=1e-5)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(out[1:, 3:], greedy_by_hand(model, short, 6), rtol=0, atol=0)
    torch.testing.assert_close(out[:1], greedy_by_hand(model, long, 6), rtol=0, atol=0)


def test_decoding_mask_written_out():
    """Two cached tokens, two new ones, row 0 left-padded by one: the mask by hand."""

    class Cache:
        def get_seq_length(self) -> int:
            return 2

    dec = make_decoding(2, 2, torch.device("cpu"), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), Cache())
    assert dec.positions.tolist() == [[1, 2], [2, 3]]
    assert dec.mask[:, 0].int().tolist() == [
        [[0, 1, 1, 0], [0, 1, 1, 1]],  # row 0: key 0 is padding
        [[1, 1, 1, 0], [1, 1, 1, 1]],  # row 1: causal over past and new keys
    ]
    plain = make_decoding(2, 1, torch.device("cpu"), torch.ones(2, 3, dtype=torch.long), Cache())
    assert plain.mask is None and plain.positions.tolist() == [[2], [2]]  # one query, no padding: no mask
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, past \+ new tokens\) = \(2, 4\)"):
        make_decoding(2, 2, torch.device("cpu"), torch.ones(2, 3), Cache())


def test_generation_stops_at_the_exported_end_of_text(tmp_path):
    """A head of zeros makes every logit equal, so greedy picks id 0, the byte tokenizer's end-of-text;
    the export's generation_config makes generate() stop there."""
    from normlab.data import ByteTokenizer
    from normlab.hf.tokenizer import to_hf_tokenizer

    model = normlab.build_model("peri", "nano", seed=0, tie_embeddings=False).eval()
    torch.nn.init.zeros_(model.lm_head.weight)
    save_hf(model, tmp_path / "out", to_hf_tokenizer(ByteTokenizer(), model.config.max_seq_len))
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, 0, 0)
    prompt = torch.tensor([list(b"Once")])
    assert hf.generate(prompt, max_new_tokens=8, do_sample=False).tolist() == [list(b"Once") + [0]]
    control = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert control.shape[1] == 4 + 8  # without the end-of-text id it would not stop


def test_activation_checkpointing_through_transformers_gives_the_same_gradients():
    model = normlab.build_model("peri", "nano", seed=0)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    grads = []
    for enable in (False, True):
        hf = to_hf(model).train()
        if enable:
            hf.activation_checkpointing_enable()
            assert hf.normlab.activation_checkpointing and hf.is_activation_checkpointing
        calls = []
        hook = hf.normlab.blocks[0].attn.q_proj.register_forward_hook(lambda m, a, o, calls=calls: calls.append(1))
        hf(input_ids=x, labels=x, use_cache=False).loss.backward()
        hook.remove()
        assert len(calls) == (2 if enable else 1)  # the block ran again in the backward
        grads.append(hf.normlab.blocks[0].attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)
    hf.activation_checkpointing_disable()
    assert not hf.normlab.activation_checkpointing


def test_bundle_imports_only_torch_transformers_and_the_standard_library():
    import ast

    tree = ast.parse(bundle_source())
    tops = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    tops |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "normlab" not in tops
    assert tops - set(sys.stdlib_module_names) == {"torch", "transformers"}


def test_bundle_refuses_a_name_defined_twice(monkeypatch):
    import normlab.hf.bundle as bundle

    monkeypatch.setattr(bundle, "MODULES", ("model/rope.py", "model/config.py", "model/rope.py"))
    with pytest.raises(
        BundleError, match="'Rotary' is defined in both normlab/model/rope.py and normlab/model/rope.py"
    ):
        bundle.bundle_source()


def _venv_without_normlab(path):
    """A real virtual environment that sees this environment's torch and transformers (its
    site-packages added by a .pth line, whose own .pth files, normlab's editable install among them,
    are therefore not run) but not normlab."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "parent_site.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    return python


SCRIPT = r"""
import importlib.util, json, sys, torch
assert importlib.util.find_spec("normlab") is None, "normlab is importable here"
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)  # as docs/huggingface.md shows
    ids = tok("To be, or not", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    print(json.dumps({"cls": type(model).__module__ + "." + type(model).__name__, "ids": ids.tolist(),
                      "logits": logits[0, -1].tolist(), "generated": out.tolist(),
                      "eos": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]}))
"""

FOREIGN = {"hybrid*": ("nano", {}), "peri,h=0.5": ("moe-micro", {})}


def _foreign_model(layout: str) -> torch.nn.Module:
    size, opts = FOREIGN[layout]
    return normlab.build_model(layout, size, seed=0, **opts).eval()


@pytest.fixture(scope="module")
def loaded_without_normlab(tmp_path_factory):
    """Each FOREIGN model exported, then loaded and run in ONE process of a venv without normlab (one
    interpreter start and one torch import for all of them, once per session): {layout: (model, what that
    process saw)}."""
    from normlab.data import ByteTokenizer
    from normlab.hf.tokenizer import to_hf_tokenizer

    def build(root):
        folders = []
        for i, layout in enumerate(FOREIGN):
            model = _foreign_model(layout)
            folders.append(root / f"export{i}")
            save_hf(model, folders[-1], to_hf_tokenizer(ByteTokenizer(), model.config.max_seq_len))
        python = _venv_without_normlab(root / "venv")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
            "HF_MODULES_CACHE": str(root / "modules"),
            "HF_HUB_OFFLINE": "1",
        }
        res = subprocess.run(
            [str(python), "-c", SCRIPT, *map(str, folders)],
            capture_output=True,
            text=True,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert "Do you wish to run the custom code" not in res.stdout  # the model asked for trust; the tokenizer never
        seen = [json.loads(line) for line in res.stdout.strip().splitlines() if line.startswith("{")]
        assert len(seen) == len(FOREIGN)
        return dict(zip(FOREIGN, seen))

    seen = built_once(tmp_path_factory, "loaded_without_normlab", build)
    return {layout: (_foreign_model(layout), seen[layout]) for layout in FOREIGN}


@pytest.mark.parametrize("layout", list(FOREIGN))
def test_export_loads_and_generates_in_a_venv_without_normlab(layout, loaded_without_normlab):
    model, got = loaded_without_normlab[layout]
    assert got["cls"].startswith("transformers_modules.") and got["cls"].endswith("modeling_normlab.NormLabForCausalLM")
    ids = torch.tensor(got["ids"])
    assert ids[0].tolist() == list(b"To be, or not")
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(got["logits"]), model(ids).logits[0, -1], rtol=1e-5, atol=1e-5)
    assert got["generated"] == greedy_by_hand(model, ids, 8).tolist()
    assert got["eos"] == [0, 0, 0]


def test_exported_tokenizers_and_configs_name_the_end_of_text(corpus, tmp_path):
    from normlab.data import ByteTokenizer, load_data
    from normlab.hf import save_native
    from normlab.hf.tokenizer import to_hf_tokenizer

    byte = to_hf_tokenizer(ByteTokenizer(), 64)
    text = "To be, or not — to bé.\n"
    assert byte(text)["input_ids"] == list(text.encode()) and byte.decode(list(text.encode())) == text
    assert byte("a<|endoftext|>b")["input_ids"] == [97, 0, 98]
    assert (byte.bos_token_id, byte.eos_token_id, byte.pad_token_id, byte.model_max_length) == (0, 0, 0, 64)
    assert byte(["ab", "abcd"], padding=True)["attention_mask"] == [[1, 1, 0, 0], [1, 1, 1, 1]]
    bpe_tok = load_data(str(corpus), "bpe:300").tokenizer
    bpe = to_hf_tokenizer(bpe_tok)
    assert bpe.eos_token == "<|endoftext|>" and bpe.eos_token_id == 0
    assert bpe("The quick brown fox")["input_ids"] == bpe_tok.encode("The quick brown fox")
    # the llama export: the tokenizer's ids, not LlamaConfig's defaults (bos 1, eos 2 are bytes here)
    model = normlab.build_model("pre", "nano", seed=0)
    save_native(model, tmp_path / "llama", "llama", byte)
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    gen = json.loads((tmp_path / "llama" / "generation_config.json").read_text())
    assert [cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]] == [0, 0, 0]
    assert [gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]] == [0, 0, 0]


def test_a_bpe_run_from_before_end_of_text_is_not_silently_retokenized(tmp_path):
    from normlab.data import DataError
    from normlab.runs.model import run_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"config": {}, "layout": "pre"}))  # no "tokenizer" facts
    from normlab.train import TrainConfig

    cfg = TrainConfig.of(tokenizer="bpe:300", data="x.txt", val_fraction=0.1, text_field="text")
    with pytest.raises(DataError, match="from before normlab's tokenizers had an end-of-text token"):
        run_tokenizer(cfg, tmp_path)
