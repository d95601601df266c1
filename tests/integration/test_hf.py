"""Exact conversions with transformers: tiny random models built from configs (no download).

The test compares logits of the two implementations on the same tokens: a conversion is right
only if the function is the same.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import normlab

tf = pytest.importorskip("transformers")

from normlab.hf import NativeExportError, from_native, save_native, to_native  # noqa: E402
from tests.helpers import PATIENCE_S, TINY_LLAMA, built_once  # noqa: E402

TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
SMALL = TINY_LLAMA


def hf_logits(model, x=TOKENS):
    with torch.no_grad():
        return model(input_ids=x).logits


def ours(model, x=TOKENS):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize(
    "arch, cls, config",
    [
        ("llama", "LlamaForCausalLM", "LlamaConfig"),
        ("olmo2", "Olmo2ForCausalLM", "Olmo2Config"),
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_import_matches_transformers_logits(arch, cls, config, tied, tmp_path):
    torch.manual_seed(0)
    hf = getattr(tf, cls)(getattr(tf, config)(tie_word_embeddings=tied, **SMALL)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = from_native(hf)
    assert model.layout.to_string() == normlab.PRESETS[{"llama": "pre", "olmo2": "olmo2"}[arch]].layout.to_string()
    torch.testing.assert_close(ours(model), hf_logits(hf), atol=2e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path / "ckpt")  # and from a local folder
    torch.testing.assert_close(ours(from_native(tmp_path / "ckpt")), hf_logits(hf), atol=2e-5, rtol=1e-5)


GEMMA_OPTS = dict(mlp="geglu-tanh", attn_scale=12.0, attn_softcap=50.0, logit_softcap=30.0)  # Gemma 2 9B values


@pytest.mark.parametrize(
    "layout, arch, opts", [("pre", "llama", {}), ("olmo2", "olmo2", {}), ("gemma2", "gemma2", GEMMA_OPTS)]
)
def test_export_reloads_through_auto_classes_with_identical_logits(layout, arch, opts, tmp_path):
    model = normlab.build_model(layout, "nano", seed=0, n_kv_heads=1, vocab_size=96, **opts).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    save_native(model, tmp_path / "out", arch)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert (
        type(hf).__name__
        == {"llama": "LlamaForCausalLM", "olmo2": "Olmo2ForCausalLM", "gemma2": "Gemma2ForCausalLM"}[arch]
    )
    torch.testing.assert_close(hf_logits(hf), ours(model), atol=2e-5, rtol=1e-5)
    prompt = TOKENS[:1, :4]  # (an explicit mask: token 0 is Gemma's pad id, which generate() would mask out)
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    greedy = TOKENS[:1, :4]
    for _ in range(5):  # the same greedy continuation from normlab itself
        greedy = torch.cat([greedy, ours(model, greedy)[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, greedy)


@pytest.mark.parametrize(
    "layout, arch, match",
    [
        ("peri", "llama", "does not map exactly onto llama"),
        ("pre,h=0.5", "llama", "does not map exactly"),
        ("pre,norm=layer", "llama", "does not map exactly"),
        ("pre", "olmo2", "does not map exactly onto olmo2"),
        ("pre", "gemma2", "does not map exactly onto gemma2"),
        ("peri", "gpt2", "no native transformers class"),
        ("pre,softmax=sink", "llama", "softmax=sink has no exact llama counterpart"),
    ],
)
def test_layouts_that_do_not_map_are_refused(layout, arch, match):
    with pytest.raises(NativeExportError, match=match):
        to_native(normlab.build_model(layout, "nano", seed=0), arch)
    with pytest.raises(NativeExportError, match="mlp=gelu"):
        to_native(normlab.build_model("pre", "nano", seed=0, mlp="gelu"), "llama")
    with pytest.raises(NativeExportError, match="mlp=swiglu .needs geglu-tanh"):
        to_native(normlab.build_model("gemma2", "nano", seed=0), "gemma2")
    with pytest.raises(NativeExportError, match="position=learned"):
        to_native(normlab.build_model("pre", "nano", seed=0, position="learned"), "llama")


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_gpt2_imports_with_identical_logits(act, tmp_path):
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32, activation_function=act)
    ).eval()
    with torch.no_grad():
        for name, p in gpt2.named_parameters():
            if "ln_" in name:
                p.uniform_(0.5, 1.5)
    model = from_native(gpt2)
    assert model.layout.to_string() == "attn=A,mlp=A,final,norm=layer"
    assert model.config.position == "learned" and model.config.mlp == ("gelu-tanh" if act == "gelu_new" else "gelu")
    torch.testing.assert_close(ours(model), hf_logits(gpt2), atol=2e-5, rtol=1e-5)
    gpt2.save_pretrained(tmp_path / "g")
    torch.testing.assert_close(ours(from_native(tmp_path / "g")), hf_logits(gpt2), atol=2e-5, rtol=1e-5)
    odd = tf.GPT2LMHeadModel(
        tf.GPT2Config(
            n_embd=32, n_layer=1, n_head=4, vocab_size=96, n_positions=32, scale_attn_by_inverse_layer_idx=True
        )
    )
    with pytest.raises(NativeExportError, match="scale_attn_by_inverse_layer_idx"):
        from_native(odd)


def test_gemma2_imports_with_identical_logits(tmp_path):
    """Peri-LN with sqrt(d) embedding scale, (1 + w) norms, GeGLU-tanh, query_pre_attn_scalar, both
    soft-caps (small, so that the tanh actually bends the scores and logits) and the local layers."""
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=96,
        max_position_embeddings=64,
        sliding_window=4,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=2.0,
    )
    gemma = tf.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in gemma.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    model = from_native(gemma)
    assert model.layout.to_string() == normlab.PRESETS["gemma2"].layout.to_string()
    # Gemma 2 alternates local (window 4 here, on 12 tokens) and global layers
    assert (model.config.sliding_window, model.config.full_attention_every, model.config.max_seq_len) == (4, 2, 64)
    torch.testing.assert_close(ours(model), hf_logits(gemma), atol=2e-5, rtol=1e-5)
    assert hf_logits(gemma).abs().max() <= 2.0  # the final soft-cap is in force
    gemma.save_pretrained(tmp_path / "g")
    torch.testing.assert_close(ours(from_native(tmp_path / "g")), hf_logits(gemma), atol=2e-5, rtol=1e-5)


def test_checkpoints_that_do_not_map_are_refused():
    split = tf.Qwen3ForCausalLM(
        tf.Qwen3Config(
            **{**SMALL, "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
        )
    )
    with pytest.raises(NativeExportError, match="is not 'every k-th layer full'"):  # windows from layer 1 on
        from_native(split)
    scaled = tf.LlamaForCausalLM(
        tf.LlamaConfig(**{**SMALL, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}})
    )
    with pytest.raises(NativeExportError, match="rope_type"):
        from_native(scaled)


def test_core_package_does_not_import_transformers():
    code = "import sys, normlab; normlab.build_model('pre', 'nano'); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def planted(tmp_path, value: float | None):
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)).eval()
    if value is not None:  # one residual channel written huge by the first block's MLP
        with torch.no_grad():
            hf.model.layers[0].mlp.down_proj.weight[5].fill_(0.0)
            hf.model.layers[0].mlp.down_proj.weight[5, 0] = value
            hf.model.layers[0].mlp.gate_proj.weight[0].fill_(1.0)
            hf.model.layers[0].mlp.up_proj.weight[0].fill_(1.0)
    hf.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_scan_reports_by_depth_and_flags_a_planted_massive_activation(tmp_path, capsys):
    from normlab.cli import main
    from normlab.hf.scan import scan

    clean = scan(planted(tmp_path / "a", None), tmp_path / "a" / "scan")
    assert len(clean["layers"]) == SMALL["num_hidden_layers"] + 1 and clean["flags"]["massive_layers"] == []
    assert (tmp_path / "a" / "scan" / "depth.png").exists() and "<img" in clean["html"].read_text()
    assert clean["angular"][0][0] == pytest.approx(0.0, abs=1e-3)
    hot = scan(planted(tmp_path / "b", 3e4), tmp_path / "b" / "scan")
    assert hot["flags"]["massive_layers"] == [1, 2]  # from block 0's output on, carried by the residual
    assert hot["layers"][1]["max_abs"] > 1000 * hot["layers"][1]["median_abs"]
    assert hot["global"]["fp16_headroom"] < clean["global"]["fp16_headroom"]
    assert main(["scan", str(tmp_path / "b" / "m"), "--out", str(tmp_path / "cli")]) == 0
    assert "MASSIVE" in capsys.readouterr().out and (tmp_path / "cli" / "table.md").exists()


MUP = dict(parametrization="mup", base_d_model=32, d_model=64, n_heads=4)  # the shape: m = 2, d_head 8 -> 16
COMPLETEP = dict(MUP, parametrization="completep", n_layers=4, base_n_layers=2)  # and the branches x (4/2)^-1


def folded_tolerance(logits: torch.Tensor, model) -> float:
    """How far two float32 computations of one function may differ: each folded weight rounds once (half an ulp,
    eps/2 relative) and the two classes order their sums differently, an error growing like sqrt(d) per sum over
    the 2 L sublayers; 8 eps sqrt(d) L of the logits' scale bounds it with room (eps = float32's, 1.2e-7). A
    missing fold is off by the multiplier itself (x2, x0.71): orders of magnitude past it."""
    cfg = model.config
    return 8 * torch.finfo(torch.float32).eps * math.sqrt(cfg.d_model) * cfg.n_layers * float(logits.abs().max())


@pytest.mark.parametrize(
    "layout, arch, opts",
    [
        ("pre", "auto", MUP),
        ("pre", "llama", dict(MUP, tie_embeddings=True)),
        ("qwen3", "qwen3", MUP),
        ("qwen3", "auto", COMPLETEP),
        ("gemma2", "gemma2", dict(MUP, **GEMMA_OPTS)),
        ("gemma3", "gemma3", dict(COMPLETEP, mlp="geglu-tanh")),
        ("olmo2", "olmo2", COMPLETEP),
    ],
)
def test_a_mup_model_exports_as_the_stock_class_with_normlabs_logits(layout, arch, opts, tmp_path):
    """muP's readout 1/m, its 1/d_head attention scale and CompleteP's branch multiplier are folded into the stock
    class's weights (final-norm gain, q or q-norm gain, output-norm gain or o/down projections): the folder loads
    through AutoModelForCausalLM, with no code, and computes normlab's logits; the message says what was folded.
    (Before: LlamaForCausalLM as exact, its logits 2.0x normlab's.)"""
    from normlab.hf.export import export

    model = normlab.build_model(layout, "nano", seed=0, vocab_size=96, **opts).eval()
    with torch.no_grad():  # gains away from their init, so a fold into the wrong norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path, used, why = export(model, tmp_path / "out", arch)
    assert used == {"auto": {"pre": "llama"}.get(layout, layout)}.get(arch, arch)
    assert "multipliers folded into the weights" in why
    assert not (tmp_path / "out" / "modeling_normlab.py").exists()
    hf = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    want = ours(model)
    torch.testing.assert_close(hf_logits(hf), want, rtol=0, atol=folded_tolerance(want, model))
    assert not torch.allclose(want, ours(normlab.build_model(layout, "nano", seed=0, vocab_size=96, **opts)))


def test_a_multiplier_with_no_exact_place_refuses_the_stock_class():
    """The readout's 1/m rides on the final norm's gain; a model whose final norm has none (edited past its layout:
    every exportable preset has the gains) is refused by name for the stock class, and auto picks normlab's."""
    from normlab.hf.export import choose_arch
    from normlab.model.norms import RMSNorm

    model = normlab.build_model("pre", "nano", seed=0, vocab_size=96, **MUP)
    model.final_norm = RMSNorm(64, 1e-6, gain="none")
    for arch in ("llama", "mistral"):
        with pytest.raises(NativeExportError, match=r"readout's 1/m = 0.5 \(no final-norm gain.*--arch normlab"):
            to_native(model, arch)
    assert choose_arch(model)[0] == "normlab"
    sp = normlab.build_model("pre", "nano", seed=0, vocab_size=96, d_model=64, n_heads=4)  # nothing to fold: as before
    assert choose_arch(sp) == ("llama", "transformers' own llama class computes layout pre exactly: no custom code")


def test_cli_export_of_a_mup_run_computes_its_logits(corpus, tmp_path, capsys):
    """The issue's command: a muP run (width 64 on base 32) exported by auto, --arch llama and --arch qwen3 (a pre run
    is not qwen3: refused) computes the run's logits."""
    from normlab.cli import main
    from normlab.runs.model import load_run_model

    run = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--layout", "pre", "--size", "nano", "--model", "d_model=64"]
    args += ["--model", "n_heads=4", "--set", "model.parametrization=mup", "--set", "model.base_d_model=32"]
    assert main([*args, "--steps", "3", "--seq-len", "32", "--batch-size", "4", "--out", str(run)]) == 0
    model = load_run_model(run).model.eval()
    want = ours(model)
    for name, arch in (("auto", []), ("llama", ["--arch", "llama"])):
        capsys.readouterr()
        assert main(["export", str(run), str(tmp_path / name), *arch]) == 0
        assert "mup's multipliers folded into the weights" in capsys.readouterr().out
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / name, local_files_only=True).eval()
        assert type(hf).__name__ == "LlamaForCausalLM"
        torch.testing.assert_close(hf_logits(hf), want, rtol=0, atol=folded_tolerance(want, model))
    assert main(["export", str(run), str(tmp_path / "q"), "--arch", "qwen3"]) == 2
    assert "does not map exactly onto qwen3" in capsys.readouterr().err


def test_cli_export_of_a_trained_run(corpus, tmp_path, capsys):
    from normlab.cli import main
    from normlab.train import TrainConfig, train

    train(
        TrainConfig.of(
            data=str(corpus),
            size="nano",
            layout="pre",
            seq_len=32,
            batch_size=8,
            steps=3,
            eval_every=0,
            eval_batches=1,
            probe_every=0,
            progress=False,
            out=str(tmp_path / "run"),
        )
    )
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--arch", "llama"]) == 0
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    from normlab.runs.checkpoint import list_checkpoints, load_checkpoint

    trained = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])["model"]  # the trained weights, exported
    torch.testing.assert_close(hf.model.embed_tokens.weight, trained["embed.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        hf.model.layers[1].mlp.down_proj.weight, trained["blocks.1.mlp.down_proj.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(hf.model.norm.weight, trained["final_norm.weight"], rtol=0, atol=0)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "o"), "--arch", "olmo2"]) == 2
    assert "does not map exactly onto olmo2" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "nl")]) == 0  # the normlab class takes any layout
    nl = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "nl", local_files_only=True).eval()
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "nl", local_files_only=True)  # saved beside the weights
    text = "To be, or not — to bé.\n"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    torch.testing.assert_close(hf_logits(nl), hf_logits(hf), rtol=1e-5, atol=2e-5)


EXPORTED = [
    ("peri", False),
    ("hybrid*", False),
    ("peri,h=0.5", True),
    ("pre-dyt,norm.final=derf,gain.attn.A=scalar", True),
    ("admin", False),
    ("pre,softmax=sink", False),
    ("pre-mhc", True),
    ("ngpt", False),
    ("siamese", False),  # two streams: the normlab class only (its native refusal: tests/unit/test_siamese.py)
    ("normformer,attn=qkgsAB,qk-rope,norm.mlp.A=dyt,alpha0.mlp.A=0.3,gain.final=centered", True),
    ("sandwich-gatednorm", False),  # GatedNorm and TaperNorm (issue 67): no stock class computes them
    ("pre-taper", False),
]


def _exported_model(layout: str, tied: bool) -> torch.nn.Module:
    return normlab.build_model(layout, "nano", seed=0, vocab_size=96, tie_embeddings=tied).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every EXPORTED layout saved as the normlab class, then loaded in ONE fresh process that never imports
    normlab itself (the folders' remote code does): one interpreter start for all of them, once per session."""
    from normlab.hf import save_hf

    def build(root):
        folders = {
            layout: save_hf(_exported_model(layout, tied), root / str(i)) for i, (layout, tied) in enumerate(EXPORTED)
        }
        code = (
            "import sys, torch; from transformers import AutoModelForCausalLM\n"
            "for folder in sys.argv[1:]:\n"
            "    m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True)\n"
            "    m.eval()\n"
            "    x = torch.tensor([[1, 5, 9, 2, 7]])\n"
            "    print(type(m).__name__, m(input_ids=x).logits.sum().item())\n"
        )
        out = subprocess.run([sys.executable, "-c", code, *map(str, folders.values())], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.split("\n")
        return {layout: (str(folder), *lines[i].split()) for i, (layout, folder) in enumerate(folders.items())}

    return built_once(tmp_path_factory, "exported", build)


@pytest.mark.parametrize("layout, tied", EXPORTED)
def test_any_layout_exports_as_the_normlab_class(layout, tied, exported):
    from normlab.hf import from_hf

    model = _exported_model(layout, tied)
    folder, name, total = exported[layout]
    assert name == "NormLabForCausalLM"
    assert float(total) == pytest.approx(ours(model, torch.tensor([[1, 5, 9, 2, 7]])).sum().item(), rel=1e-5, abs=1e-3)
    back = from_hf(folder)
    assert back.layout.to_string() == model.layout.to_string()
    torch.testing.assert_close(ours(back), ours(model), rtol=0, atol=0)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    torch.testing.assert_close(hf_logits(hf), ours(model), rtol=0, atol=0)
    gen = hf.generate(TOKENS[:1, :4], max_new_tokens=4, do_sample=False)
    greedy = TOKENS[:1, :4]
    for _ in range(4):
        greedy = torch.cat([greedy, ours(model, greedy)[:, -1:].argmax(-1)], 1)
    assert torch.equal(gen, greedy)
    labels = TOKENS.clone()
    loss = hf(input_ids=TOKENS, labels=labels).loss  # transformers' label convention: shifted inside
    assert loss.item() == pytest.approx(model(TOKENS[:, :-1], targets=TOKENS[:, 1:]).loss.item(), rel=1e-5)
    # left padding: the real tokens' logits are those of the unpadded sequence (positions from the mask)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), TOKENS[:1, :10]], 1)
    left = hf(input_ids=padded, attention_mask=torch.tensor([[0] * 2 + [1] * 10])).logits[:, 2:]
    torch.testing.assert_close(left, ours(model, TOKENS[:1, :10]), rtol=1e-5, atol=1e-5)


def test_the_bundle_defines_every_name_its_modules_import(monkeypatch):
    """The export's modeling_normlab.py strips normlab imports, so each imported name must be bundled:
    leaving a module out (here the errors the layout raises) is refused at export time, not at load."""
    from normlab.hf import bundle

    text = bundle.bundle_source()
    assert "class LayoutError" in text and "class ConfigError" in text
    monkeypatch.setattr(bundle, "MODULES", tuple(m for m in bundle.MODULES if m != "errors.py"))
    with pytest.raises(bundle.BundleError, match="LayoutError"):
        bundle.bundle_source()


@pytest.mark.parametrize("arch, window", [("qwen3", None), ("qwen3", 4), ("mistral", 4), ("llama", None), ("qwen2", 4)])
def test_head_dim_and_sliding_window_round_trip_with_equal_logits(arch, window, tmp_path):
    """A head width apart from d_model / heads (Qwen 3: 128 in every size) and a sliding window shorter than
    the sequence (12 tokens, window 4): import from a random transformers model and export back, logits equal."""
    cls, config = {
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
        "mistral": ("MistralForCausalLM", "MistralConfig"),
        "llama": ("LlamaForCausalLM", "LlamaConfig"),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    }[arch]
    opts = dict(SMALL, head_dim=16)  # 4 heads x 16 = 64 != hidden 32
    if arch in ("qwen2", "qwen3"):
        opts.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
    elif arch == "mistral":
        opts.update(sliding_window=window)
    torch.manual_seed(0)
    hf = getattr(tf, cls)(getattr(tf, config)(**opts)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # Qwen 2's q/k/v biases, away from their zero init
                p.uniform_(-0.5, 0.5)
    model = from_native(hf)
    assert model.config.head_dim == 16 and model.config.d_head == 16 and model.config.sliding_window == window
    assert model.config.qkv_bias == (arch == "qwen2")
    torch.testing.assert_close(ours(model), hf_logits(hf), atol=2e-5, rtol=1e-5)
    if window is not None:  # the window matters here: without it the logits differ
        full = normlab.build_model(model.layout, model.config.with_(sliding_window=None)).eval()
        full.load_state_dict(model.state_dict())
        assert (ours(full) - hf_logits(hf)).abs().max() > 1e-3
    save_native(model, tmp_path / "out", arch)
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(back).__name__ == cls
    torch.testing.assert_close(hf_logits(back), ours(model), atol=2e-5, rtol=1e-5)


def test_window_patterns_map_or_are_refused():
    """transformers' layer_types as normlab's (sliding_window, full_attention_every), or refused by name."""
    from types import SimpleNamespace as NS

    from normlab.hf.archs.base import window_of

    s, f = "sliding_attention", "full_attention"
    assert window_of(NS(sliding_window=8, layer_types=[s, s, s, f, s, s, s, f])) == (8, 4)  # OLMo 3's 3:1
    assert window_of(NS(sliding_window=8, layer_types=[s] * 5 + [f])) == (8, 6)  # Gemma 3's 5:1
    assert window_of(NS(sliding_window=8, layer_types=[f, f])) == (None, 0)
    assert window_of(NS(sliding_window=8, layer_types=None)) == (8, 0)  # Mistral: every layer
    with pytest.raises(ValueError, match="not 'every k-th layer full'"):
        window_of(NS(sliding_window=8, layer_types=[f, s, s, s]))  # Qwen 3's max_window_layers pattern
    cfg = normlab.ModelConfig(sliding_window=8, full_attention_every=4, n_layers=8)
    assert [cfg.window_of(i) for i in range(8)] == [8, 8, 8, None, 8, 8, 8, None]


@pytest.mark.parametrize("arch", ["gemma3", "olmo3"])
def test_local_global_layers_round_trip_with_equal_logits(arch, tmp_path):
    """Gemma 3 (QK-norm, (1 + w) gains as normlab's centered gain, one local layer of two here with its own RoPE
    base) and OLMo 3 (OLMo 2's block, three local layers of four): import, logits equal on 12 tokens with a
    window of 4; a control without the windows differs; export back through the Auto classes, equal again."""
    s, f = "sliding_attention", "full_attention"
    opts = dict(SMALL, num_hidden_layers=4, sliding_window=4)
    if arch == "gemma3":
        opts.update(
            head_dim=16,
            query_pre_attn_scalar=16,
            layer_types=[s, f, s, f],
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                s: {"rope_type": "default", "rope_theta": 1000.0},
                f: {"rope_type": "default", "rope_theta": 5000.0},
            },
        )
        hf = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**opts)).eval()
    else:
        opts.update(
            layer_types=[s, s, s, f],
            rope_parameters={k: {"rope_type": "default", "rope_theta": 5000.0} for k in (s, f)},
        )
        hf = tf.Olmo3ForCausalLM(tf.Olmo3Config(**opts)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if arch == "gemma3" else p.uniform_(0.5, 1.5)  # gemma: w of (1 + w)
    model = from_native(hf)
    cfg = model.config
    assert model.layout.to_string() == normlab.PRESETS["gemma3" if arch == "gemma3" else "olmo2"].layout.to_string()
    assert (cfg.sliding_window, cfg.full_attention_every) == ((4, 2) if arch == "gemma3" else (4, 4))
    assert cfg.rope_local_theta == (1000.0 if arch == "gemma3" else None)
    torch.testing.assert_close(ours(model), hf_logits(hf), atol=2e-5, rtol=1e-5)
    full = normlab.build_model(
        model.layout, cfg.with_(sliding_window=None, full_attention_every=0, rope_local_theta=None)
    ).eval()
    full.load_state_dict(model.state_dict())
    assert (ours(full) - hf_logits(hf)).abs().max() > 1e-3
    save_native(model, tmp_path / "out", arch)
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    torch.testing.assert_close(hf_logits(back), ours(model), atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # quick: each class's export round trip (above), the scan test and test_doctor's CLI test
def test_scan_and_doctor_read_every_exportable_architecture(tmp_path):
    """Each class normlab exports to (folders written without a tokenizer: the texts are read as bytes) scans,
    and loads in `normlab doctor` as a normlab model computing the same logits."""
    from normlab.doctor import load_model, sample_tokens
    from normlab.hf.archs import EXPORTABLE
    from normlab.hf.scan import scan

    gemma = {"mlp": "geglu-tanh", "sliding_window": 8, "full_attention_every": 2}
    opts = {
        "gemma2": gemma,
        "gemma3": gemma,
        "qwen2": {"qkv_bias": True},
        "qwen3": {"d_head": 16},
        "mistral": {"sliding_window": 8},
        "olmo3": {"sliding_window": 8, "full_attention_every": 4, "n_layers": 4},
    }
    for arch, preset in EXPORTABLE.items():
        model = normlab.build_model(preset, "nano", seed=0, **opts.get(arch, {})).eval()
        save_native(model, tmp_path / arch, arch)
        r = scan(tmp_path / arch, tmp_path / arch / "scan", max_len=16)
        assert r["tokens"] == [4, 16] and len(r["layers"]) == model.config.n_layers + 1, arch
        back, _, kind, run = load_model(tmp_path / arch)
        assert run is None  # a transformers folder, not a run
        x = sample_tokens(back, None, max_len=16)
        torch.testing.assert_close(ours(back, x), ours(model, x), atol=2e-5, rtol=1e-5, msg=arch)


def test_trainer_callback_writes_a_run_the_report_reads(tmp_path):
    """HF Trainer on a tiny local Llama with NormlabCallback: metrics every step, probes every 4 (the stream by
    depth, gradient norm per block and matrix, norm gains under normlab's site names), and `normlab report`
    draws the run like a normlab run's."""
    from normlab.diagnostics.run_report import make_report
    from normlab.hf.callback import NormlabCallback

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    data = [
        {"input_ids": t, "labels": t}
        for t in torch.randint(0, 96, (32, 16), generator=torch.Generator().manual_seed(1))
    ]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=9,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=100,
        use_cpu=True,
        disable_tqdm=True,
    )
    tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[NormlabCallback(every=4)]).train()
    run = normlab.load_run(tmp_path / "hf" / "normlab")
    # the Trainer's step numbers (1..9); probes at the first step, every 4, and the final weights (step 10)
    assert run.metrics.step.tolist() == list(range(1, 10)) and run.metrics.loss.notna().all()
    assert run.metrics.loss.iloc[0] == pytest.approx(math.log(96), abs=0.3)  # a random model's loss at init
    assert sorted(run.probes.step.unique().tolist()) == [1, 4, 8, 10]
    assert len(run.probe("stream", "var").columns) == SMALL["num_hidden_layers"] + 1
    assert set(run.probe("self_attn.q_proj", "grad_norm").columns) == {0, 1}
    assert not run.probe("mlp_norms.input", "gamma_mean").empty  # Llama's post_attention_layernorm
    assert run.summary.status == "ok" and run.summary.extra["spikes"] == 0
    # attention logits per head, recomputed from the attention's inputs: equal to normlab's own probe on the
    # same weights (the model at the end, on the probe batch)
    from normlab.diagnostics.probes import Probes
    from normlab.diagnostics.training_monitor import TrainingMonitor

    probe_x = torch.stack([data[0]["input_ids"], data[1]["input_ids"], data[2]["input_ids"], data[3]["input_ids"]])
    mon = TrainingMonitor(model, tmp_path / "again", every=1, probe_batch={"input_ids": probe_x})
    rows = {(r["layer"], r["site"]): r["value"] for r in mon._probe_rows(0) if r["metric"] == "max_logit"}
    mon.close()
    ref = {
        (r["layer"], r["site"]): r["value"]
        for r in Probes(from_native(model), (probe_x, probe_x)).record(0)
        if r["metric"] == "max_logit"
    }
    assert set(rows) == set(ref) and len(rows) == 2 * (1 + SMALL["num_attention_heads"])
    for key, v in ref.items():
        assert rows[key] == pytest.approx(v, rel=1e-4), key
    make_report([tmp_path / "hf" / "normlab"], tmp_path / "report")
    assert {"loss.png", "variance_by_depth.png", "grad_by_layer.png", "top100_fp16.png"} <= {
        p.name for p in (tmp_path / "report").glob("*.png")
    }
    # `normlab report` on the Trainer's output_dir finds the normlab folder one level down
    from normlab.cli import main

    assert main(["report", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "report" / "index.html").is_file()


def test_a_monitor_folder_reads_fully_in_the_report(tmp_path):
    """A TrainingMonitor folder (what NormlabCallback writes): a final probe after the last step when the last
    step was not a probe step; the report's table has its layout and steps, and its angular distances are drawn
    (the monitor records layer l to l+1, not the layer x layer matrix)."""
    from normlab.diagnostics.figures import fig_angular
    from normlab.diagnostics.run_report import make_report, summary_rows
    from normlab.diagnostics.training_monitor import TrainingMonitor

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = TrainingMonitor(model, tmp_path / "m", every=4, name="llama")
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.randint(0, 96, (2, 12), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        monitor.step(step)
        opt.step()
        opt.zero_grad()
    monitor.close()
    run = normlab.load_run(tmp_path / "m")
    assert sorted(run.probes.step.unique().tolist()) == [0, 4, 6]  # 6: the weights after the last update
    final = run.probes[run.probes.step == 6]
    assert not final[final.metric == "angular_next"].empty and final[final.metric == "grad_norm"].empty
    row = summary_rows([run], ["llama"])[0]
    assert (row["layout"], row["steps"], row["status"]) == ("llama", 6, "ok")
    assert row["final loss"] == run.metrics.loss.iloc[-1]
    ax = fig_angular([run], ["llama"]).axes[0]
    assert ax.get_title() == "llama: angular distance, layer l to l+1"
    assert [ln.get_label() for ln in ax.get_lines()] == ["step 0", "step 4", "step 6"]
    page = make_report([tmp_path / "m"], tmp_path / "report").read_text()
    assert "no probes" not in page and "no angular probes" not in page


def test_a_loss_spike_saves_its_batch_and_probes_it(tmp_path):
    """OLMo's rule (6 sigma over the window): a planted spike at step 30 saves the batch that caused it, with
    its loss, and probes that batch; steady losses before it do not trigger."""
    from normlab.diagnostics.training_monitor import SpikeRule, TrainingMonitor

    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    monitor = TrainingMonitor(model, tmp_path / "m", every=1000, spike=SpikeRule(window=16, min_history=8))
    gen = torch.Generator().manual_seed(0)
    for step in range(32):
        x = torch.randint(0, 96, (2, 12), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        planted = 50.0 if step == 30 else 4.5 + 0.01 * (step % 3)
        monitor.step(step, loss=planted)
        model.zero_grad()
    summary = monitor.close()
    assert summary["spikes"] == 1 and [s["step"] for s in monitor.spikes] == [30]
    saved = torch.load(tmp_path / "m" / "spikes" / "step_30.pt")
    assert saved["loss"] == 50.0 and saved["threshold"] < 5 and saved["batch"]["input_ids"].shape == (2, 12)
    run = normlab.load_run(tmp_path / "m")
    assert not run.probe("spike:stream", "var").empty and run.probe("spike:stream", "var").index.tolist() == [30]
    with pytest.raises(ValueError, match="min_history"):
        SpikeRule(window=4, min_history=8)


def test_lightning_callback_writes_a_run_the_report_reads(tmp_path):
    """A LightningModule around a tiny local Llama: metrics every step, probes every 3 and at the end (step 6, the
    final weights), the report draws it."""
    L = pytest.importorskip("lightning.pytorch")
    from normlab.diagnostics.lightning import NormlabLightningCallback
    from normlab.diagnostics.run_report import make_report
    from normlab.hf.callback import site_names

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    torch.manual_seed(0)
    lit = Lit()
    loader = torch.utils.data.DataLoader(
        torch.randint(0, 96, (24, 16), generator=torch.Generator().manual_seed(1)), batch_size=4
    )
    callback = NormlabLightningCallback(tmp_path / "lit", every=3, site_names=site_names(lit.model))
    L.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    ).fit(lit, loader)
    run = normlab.load_run(tmp_path / "lit")
    assert run.metrics.step.tolist() == list(range(6)) and run.metrics.grad_norm.gt(0).all()
    # probes every 3 steps, and at the end on the final weights (the monitor's close: step 5 was not a probe step)
    assert (
        sorted(run.probes.step.unique().tolist()) == [0, 3, 6] and not run.probe("mlp_norms.input", "gamma_mean").empty
    )
    make_report([tmp_path / "lit"], tmp_path / "report")
    assert (tmp_path / "report" / "variance_by_depth.png").exists()


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "gemma3"])
def test_monitor_attention_logits_match_normlabs_own_probe(arch):
    """Per-head QK-norm before RoPE (Qwen 3, Gemma 3 with its (1 + w) gains and query_pre_attn_scalar), over
    the full projection (OLMo 2): the monitor's recomputed logits equal normlab's probe of the same weights."""
    from normlab.diagnostics.probes import Probes
    from normlab.diagnostics.training_monitor import TrainingMonitor

    opts = {"qwen3": {"d_head": 16}, "olmo2": {}, "gemma3": {"mlp": "geglu-tanh", "attn_scale": 12.0}}[arch]
    ours_model = normlab.build_model(arch, "nano", seed=0, **opts)
    with torch.no_grad():
        for name, p in ours_model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf = to_native(ours_model, arch).eval()
    x = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mon = TrainingMonitor(hf, d, every=1, probe_batch={"input_ids": x})
        rows = {(r["layer"], r["site"]): r["value"] for r in mon._probe_rows(0) if r["metric"] == "max_logit"}
        mon.close()
    ref = {
        (r["layer"], r["site"]): r["value"] for r in Probes(ours_model, (x, x)).record(0) if r["metric"] == "max_logit"
    }
    assert set(rows) == set(ref)
    for key, v in ref.items():
        assert rows[key] == pytest.approx(v, rel=1e-4, abs=1e-5), (arch, key)


TOKENIZER_CHECK = r"""
import builtins, json, sys
asked = []
def no_prompt(*args, **kwargs):  # transformers' trust question goes through input(): recorded, and refused
    asked.append(str(args[0]) if args else "")
    raise EOFError("stdin closed")
builtins.input = no_prompt
from transformers import AutoTokenizer, PreTrainedTokenizerFast
native, ours = sys.argv[1], sys.argv[2]
a = AutoTokenizer.from_pretrained(native, local_files_only=True)         # a native export: the Auto class
b = PreTrainedTokenizerFast.from_pretrained(ours, local_files_only=True)  # a normlab-class export: the stock class
c = AutoTokenizer.from_pretrained(ours, local_files_only=True, trust_remote_code=False)
quiet = len(asked)
d = AutoTokenizer.from_pretrained(ours, local_files_only=True)  # AutoConfig asks first (docs/huggingface.md)
print(json.dumps({"classes": [type(t).__name__ for t in (a, b, c, d)], "asked_before": quiet,
                  "asked_plain": len(asked) - quiet, "ids": [t("To bé")["input_ids"] for t in (a, b, c, d)]}))
"""


def test_hyper_connections_export_only_as_the_normlab_class(tmp_path):
    """No transformers class computes hyper-connections on a dense block (DeepSeek-V4's mHC sits in its MoE and
    compressed attention): auto and every native architecture refuse in one line, with the reason and the way out;
    nothing is written. (--arch normlab: test_any_layout_exports_as_the_normlab_class, pre-mhc.)"""
    from normlab.hf.export import export
    from normlab.hf.native import NativeExportError

    model = normlab.build_model("pre-hc", "nano", seed=0)
    for arch in ("auto", "llama", "qwen3"):
        with pytest.raises(NativeExportError, match=r"4 residual streams .* no transformers class .* --arch normlab"):
            export(model, tmp_path / arch, arch)
        assert not (tmp_path / arch).exists()


def test_ngpt_exports_as_the_normlab_class_with_its_scalings(tmp_path):
    """nGPT's s_qk, s_uv, s_z and eigen rates travel in the normlab class's weights: the same logits back."""
    from normlab.hf import from_hf, save_hf

    model = normlab.build_model("ngpt", "nano", seed=0, vocab_size=96).eval()
    with torch.no_grad():
        model.sz.mul_(1.5)
        model.blocks[0].attn.sqk.mul_(0.7)
    save_hf(model, tmp_path / "out")
    torch.testing.assert_close(ours(from_hf(tmp_path / "out")), ours(model), rtol=0, atol=0)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    torch.testing.assert_close(hf_logits(hf), ours(model), rtol=0, atol=0)


def test_cli_refuses_a_hyper_connection_run_in_one_line(corpus, tmp_path, capsys):
    from normlab.cli import main
    from normlab.train import train
    from tests.helpers import small

    train(small(corpus, tmp_path / "run", layout="pre-mhc", steps=2, eval_every=0, probe_every=0))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "4 residual streams" in err and "--arch normlab" in err
    assert not (tmp_path / "out").exists()


def test_export_writes_the_stock_class_where_exact_and_a_tokenizer_that_asks_no_trust(corpus, tmp_path, capsys):
    """`normlab export` (auto): a pre run as transformers' LlamaForCausalLM (no code in the folder), a peri run as the
    normlab class (no stock class computes it); --arch normlab on pre says llama is exact. Both tokenizers are stock
    files that load without a trust question, byte-exact with normlab's byte tokenizer on any bytes."""
    import json
    import random

    from normlab.cli import main
    from normlab.data import ByteTokenizer
    from normlab.hf.tokenizer import to_hf_tokenizer
    from normlab.train import train
    from tests.helpers import small

    for layout in ("pre", "peri"):
        train(small(corpus, tmp_path / layout, layout=layout, steps=2, eval_every=0, probe_every=0))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "pre"), str(tmp_path / "e-pre")]) == 0
    out = capsys.readouterr().out
    assert "(llama: transformers' own llama class computes layout pre exactly: no custom code)" in out
    assert f"load: AutoModelForCausalLM.from_pretrained({str(tmp_path / 'e-pre')!r})" in out
    assert json.loads((tmp_path / "e-pre" / "config.json").read_text())["model_type"] == "llama"
    assert not (tmp_path / "e-pre" / "modeling_normlab.py").exists()
    assert main(["export", str(tmp_path / "peri"), str(tmp_path / "e-peri")]) == 0
    out = capsys.readouterr().out
    assert "(normlab: no transformers class computes layout peri" in out and "trust_remote_code=True" in out
    assert "tokenizer: PreTrainedTokenizerFast.from_pretrained(" in out
    assert main(["export", str(tmp_path / "pre"), str(tmp_path / "e-forced"), "--arch", "normlab"]) == 0
    assert "--arch llama needs no custom code" in capsys.readouterr().out
    for folder in ("e-pre", "e-peri"):
        config = json.loads((tmp_path / folder / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in config
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRUST_REMOTE_CODE"} | {"HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "-c", TOKENIZER_CHECK, str(tmp_path / "e-pre"), str(tmp_path / "e-peri")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=PATIENCE_S,
    )
    assert res.returncode == 0 and "Do you wish to run the custom code" not in res.stdout + res.stderr, res.stderr[
        -2000:
    ]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["ids"] == [list("To bé".encode())] * 4
    assert got["asked_before"] == 0  # the stock class, and AutoTokenizer with trust_remote_code=False: no question
    # transformers 5.x: AutoTokenizer without the flag resolves config.json through AutoConfig first, which asks for the
    # model's code (its auto_map, needed by AutoModelForCausalLM); refused, it falls back and loads the stock class.
    # This fails the day transformers stops asking: then docs/huggingface.md's advice can be simplified.
    assert got["asked_plain"] == 1
    # byte-exact: any byte sequence (invalid UTF-8 included) decodes as normlab decodes it; any text encodes alike
    ours, hf = ByteTokenizer(), to_hf_tokenizer(ByteTokenizer(), 64)
    rng = random.Random(0)
    pool = [0x41, 0x80, 0xBF, 0xC0, 0xC2, 0xE0, 0xED, 0xF0, 0xF4, 0xFF, 0x00]
    samples = [[rng.choice(pool) for _ in range(rng.randint(0, 10))] for _ in range(500)]
    samples += [[rng.randint(0, 255) for _ in range(rng.randint(0, 10))] for _ in range(500)]
    samples += [list(b"\xed\xa0\x80"), list(b"\xf4\x90\x80\x80"), list(b"a\xe2\x82"), list(b"\xc0\xaf")]
    for ids in samples:
        assert hf.decode(ids) == ours.decode(ids), bytes(ids)
        text = bytes(i for i in ids if i).decode("utf-8", errors="replace") + " é€😀\t\n"
        assert hf(text)["input_ids"] == ours.encode(text), text


def _normlm_loop(monitor, model, steps, start=0, outside=False, losses=None):
    """A nanoGPT-style loop on a NormLM called positionally; ``outside``: the loss computed outside the model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(start, start + steps):
        x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(step))
        if outside:
            logits = model(x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        else:
            loss = model(x[:, :-1], targets=x[:, 1:]).loss
        loss.backward()
        monitor.step(step, loss=None if losses is None else losses[step])
        opt.step()
        opt.zero_grad()


def test_monitor_replays_positional_calls_and_probes_the_end(tmp_path):
    """NormLM called positionally (model(x, targets=y)): the probe replays the call as made; with every=3 over
    steps 0..4 the probes are at 0 and 3 and at 5, the final weights."""
    from normlab.diagnostics.training_monitor import TrainingMonitor

    model = normlab.build_model("pre", "nano", seed=0)
    monitor = TrainingMonitor(model, tmp_path / "m", every=3)
    _normlm_loop(monitor, model, 5)
    assert monitor.close()["status"] == "ok"
    run = normlab.load_run(tmp_path / "m")
    assert sorted(run.probes.step.unique().tolist()) == [0, 3, 5]
    assert len(run.probe("stream", "max_abs").columns) == model.config.n_layers + 1
    assert run.probe("stream", "max_abs").index.tolist() == [0, 3, 5]
    grads = run.probes[run.probes.metric == "grad_norm"]
    assert sorted(grads.step.unique().tolist()) == [0, 3]  # at the end the gradients were cleared: none recorded


def test_monitor_without_a_loss_is_ok_and_bad_top_k_is_refused(tmp_path):
    """A loss computed outside the model and step() without loss=: the run is ok, its losses null (not NaN);
    top_k=-1 is refused at construction with one clear error."""
    from normlab.diagnostics.training_monitor import TrainingMonitor

    model = normlab.build_model("pre", "nano", seed=0)
    monitor = TrainingMonitor(model, tmp_path / "m", every=2)
    _normlm_loop(monitor, model, 4, outside=True)
    summary = monitor.close()
    assert summary["status"] == "ok" and summary["final_loss"] is None
    rows = normlab.load_run(tmp_path / "m").metrics
    assert rows.loss.isna().all() and rows.grad_norm.gt(0).all()
    for bad in (-1, 0, 2.5, True):
        with pytest.raises(ValueError, match=r"top_k must be a positive number .* got"):
            TrainingMonitor(model, tmp_path / "bad", top_k=bad)


def test_a_second_monitor_on_the_folder_resumes_its_history(tmp_path):
    """Trainer's resume_from_checkpoint: a second monitor on the same folder keeps metrics, probes and spikes
    before its first step, replaces (and says so, in a warning and in config.json) the steps logged at or
    after it, and continues the spike rule from the kept losses."""
    from normlab.diagnostics.training_monitor import SpikeRule, TrainingMonitor

    rule = SpikeRule(window=8, min_history=3)
    losses = [2.0, 2.01, 2.0, 9.0, 2.01, 2.0, 2.0, 2.01, 2.0, 2.0]  # a spike at step 3
    model = normlab.build_model("pre", "nano", seed=0)
    first = TrainingMonitor(model, tmp_path / "m", every=2, spike=rule)
    _normlm_loop(first, model, 6, losses=losses)
    assert first.close()["spikes"] == 1
    second = TrainingMonitor(model, tmp_path / "m", every=2, spike=rule)
    with pytest.warns(UserWarning, match=r"resumes at step 4; the 2 steps logged at or after it \(4..5\)"):
        _normlm_loop(second, model, 6, start=4, losses=losses)
    summary = second.close()
    run = normlab.load_run(tmp_path / "m")
    assert run.metrics.step.tolist() == list(range(10)) and run.metrics.loss.tolist() == losses
    assert sorted(run.probes.step.unique().tolist()) == [0, 2, 3, 4, 6, 8, 10]  # 3: the spike's probe
    assert summary["spikes"] == 1 and [s["step"] for s in normlab.runs.files.RunDir(tmp_path / "m").spikes()] == [3]
    assert (tmp_path / "m" / "spikes" / "step_3.pt").exists()
    assert run.config["resumes"] == [{"step": 4, "kept": 4, "replaced": [4, 5]}]
    # the rule's window continued from the kept losses: 2.0 at step 4 is no spike, a 9.0 there would have been
    assert len(second.history) == 8


@pytest.mark.long
def test_monitor_under_fsdp2_equals_one_process_and_the_trainer_callback_reads_shards(tmp_path):
    """TrainingMonitor on a tiny Llama sharded by FSDP2 over 2 processes (gloo), each rank its share of the
    batch: every metrics and probe row equals one process's on the whole batch (gradients, gains and the
    stream from DTensor shards; only scalars cross ranks). NormlabCallback in a Trainer whose model is
    FSDP2-sharded (accelerate shards on GPUs only; here fully_shard in one process) writes a run that loads
    (its report: test_trainer_callback_writes_a_run_the_report_reads)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.integration.test_distributed import assert_same_curve, assert_same_probes

    script = Path(__file__).with_name("sharded_monitor.py")
    env = {**os.environ, "PYTHONPATH": str(Path(normlab.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    for cmd in (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            "monitor",
            str(tmp_path / "two"),
        ],
        [sys.executable, str(script), "reference", str(tmp_path)],
    ):  # "one" and "hf"
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PATIENCE_S)
        assert res.returncode == 0, res.stderr[-3000:]
    assert_same_curve(tmp_path / "one", tmp_path / "two")
    n, worst = assert_same_probes(tmp_path / "one", tmp_path / "two")
    assert n > 150 and worst < 1e-5, worst
    run = normlab.load_run(tmp_path / "hf" / "normlab")
    assert run.metrics.step.tolist() == [1, 2, 3, 4] and run.metrics.grad_norm.gt(0).all()  # the Trainer's
    assert sorted(run.probes.step.unique().tolist()) == [1, 2, 4]  # the first step's, every 2nd
    assert not run.probe("self_attn.q_proj", "grad_norm").empty and not run.probe("mlp_norms.input", "gamma_mean").empty
