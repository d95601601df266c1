"""Every snippet `normlab.recommend.frameworks.snippets` emits, executed as printed in the real library (litgpt
0.5.13, ai2-olmo-core 3.0.0, torchtitan 0.3.0: `make test-frameworks`), loaded with a normlab model's
weights (strict: the same parameters, no more, no fewer) and compared on logits in float32.

The models are tiny but every setting bites: GQA, a head width and an MLP width of their own, RoPE base
1000 (no library's default), norm eps 1e-3 (against weights of std ~0.02, where 1e-5 or 1e-6 would
differ) and every weight perturbed from its init, so that a gain of 1 + w, a swapped or missing norm, a
bias, a rotary fraction or an embedding scale would each change the logits far beyond the tolerance.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from normlab.model.build import build_model
from normlab.model.config import ModelConfig
from normlab.recommend.frameworks.patches import peri_parts, titan_new_parameters
from normlab.recommend.frameworks.snippets import settings_for
from tests.frameworks.cases import PATCHED, TESTED
from tests.frameworks.weights import WEIGHTS

MODULES = {"litgpt": "litgpt", "OLMo-core": "olmo_core", "torchtitan": "torchtitan"}
BASE = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=48,
    max_seq_len=32,
    rope_theta=1000.0,
    norm_eps=1e-3,
)
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
ATOL = RTOL = 1e-5  # float32; the largest difference measured is 9.5e-7 (docs/frameworks.md), logits of std ~0.28


def _need(framework: str) -> None:
    if importlib.util.find_spec(MODULES[framework]) is None:
        pytest.skip(f"{MODULES[framework]} is not installed (make test-frameworks installs it)")


def _normlab(layout: str, cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(layout, cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # tied weights are perturbed twice: still one tensor
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _logits(framework: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if framework == "torchtitan":  # its attention takes the positions' mask (flex: no backward on CPU)
            positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)
            return model(x, positions, model.get_attention_masks(positions))
        out = model(x)
        return getattr(out, "logits", out)


def load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every parameter from normlab's, none left over (buffers the library computes, OLMo-core's
    LayerNorm-Scaling factor, stay as built)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert not unexpected and not set(missing) & params, (unexpected, missing)


def built(layout: str, framework: str, cfg: ModelConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model the printed snippet builds in its library, loaded with normlab's weights; normlab's model)."""
    _need(framework)
    entry = settings_for(layout, cfg)[framework]
    assert entry["expressible"] and entry["code"] in entry["settings"]  # the code is what the user reads
    assert "NOT stated" not in entry["code"]
    space: dict = {}
    exec(compile(entry["code"], f"<{framework} snippet for {layout}>", "exec"), space)  # our own generated text
    theirs = space["model"].float().eval()
    ours = _normlab(layout, cfg)
    load(theirs, WEIGHTS[framework](ours.state_dict(), layout))
    return theirs, ours


def check(layout: str, framework: str, cfg: ModelConfig) -> float:
    """Build the printed snippet in its library, copy normlab's weights, compare logits; the max |diff|."""
    theirs, ours = built(layout, framework, cfg)
    want, got = ours(TOKENS).logits.detach(), _logits(framework, theirs, TOKENS)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    return (got - want).abs().max().item()


def patched_code(layout: str, framework: str, cfg: ModelConfig, base: str | None) -> str:
    """The patch `settings_for` prints for `layout` in `framework` to a user whose placement is `base`."""
    _need(framework)
    entry = settings_for(layout, cfg, base_layout=base)[framework]
    assert not entry["expressible"] and entry["patch"] and entry["code"] in entry["settings"]  # what the user reads
    assert "NOT stated" not in entry["code"]
    return entry["code"]


def run_patch(code: str, layout: str, framework: str, cfg: ModelConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model `code` builds, loaded with normlab's weights, strictly; normlab's model)."""
    space: dict = {}
    exec(compile(code, f"<{framework} patch for {layout}>", "exec"), space)  # our own generated text
    theirs = space["model"].float().eval()
    ours = _normlab(layout, cfg)
    load(theirs, WEIGHTS[framework](ours.state_dict(), layout))
    return theirs, ours


def check_patch(layout: str, framework: str, cfg: ModelConfig, base: str | None) -> float:
    """Build the printed patch in its library, copy normlab's weights, compare logits; the max |diff|."""
    theirs, ours = run_patch(patched_code(layout, framework, cfg, base), layout, framework, cfg)
    want, got = ours(TOKENS).logits.detach(), _logits(framework, theirs, TOKENS)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    return (got - want).abs().max().item()


@pytest.mark.parametrize(("layout", "framework"), TESTED, ids=[f"{f}-{p}" for p, f in TESTED])
def test_snippet_builds_normlabs_function(layout, framework):
    check(layout, framework, BASE)


@pytest.mark.parametrize("framework", ["litgpt", "OLMo-core", "torchtitan"])
def test_tied_embeddings(framework):
    check("pre", framework, BASE.with_(tie_embeddings=True))


# the model options each code base states besides the placement
OPTIONS = [
    (
        "gemma2",
        "litgpt",
        dict(
            mlp="geglu-tanh",
            attn_scale=24.0,
            attn_softcap=5.0,
            logit_softcap=3.0,
            sliding_window=4,
            full_attention_every=2,
            rope_local_theta=100.0,
        ),
    ),
    ("qwen3", "litgpt", dict(qkv_bias=True, mlp="gelu-tanh")),
    ("pre", "litgpt", dict(linear_bias=True, mlp="gelu")),
    ("qwen3", "OLMo-core", dict(linear_bias=True, mlp="geglu-tanh")),
    ("peri+qk", "OLMo-core", dict(norm_bias=False)),
    # Gemma 3's options: GeGLU-tanh, a window of 4 keys on alternate layers (12 tokens: it hides keys), local base 100
    ("gemma3", "OLMo-core", dict(mlp="geglu-tanh", sliding_window=4, full_attention_every=2, rope_local_theta=100.0)),
    # query_pre_attn_scalar = head_dim (16; every Gemma 3): the libraries' own 1/sqrt(head_dim), so not "NOT stated"
    ("gemma3", "OLMo-core", dict(mlp="geglu-tanh", attn_scale=16.0)),
    ("pre", "torchtitan", dict(attn_scale=16.0)),
    # heads wider than d_model / n_heads (Qwen 3: 16 x 128 on a width of 1024)
    ("qwen3", "litgpt", dict(d_head=24)),
    ("qwen3", "OLMo-core", dict(d_head=24)),
    ("qwen3", "torchtitan", dict(d_head=24)),
]


@pytest.mark.parametrize(
    ("layout", "framework", "options"), OPTIONS, ids=[f"{f}-{p}-{'-'.join(o)}" for p, f, o in OPTIONS]
)
def test_model_options(layout, framework, options):
    check(layout, framework, BASE.with_(**options))


def test_olmo_core_computes_gemma3s_sliding_window():
    """OLMo-core's sliding window, run (its torch backend, on the CPU), not assumed: with a window of 4 keys on
    layer 0 of 2 (layer 1 full) over 12 tokens, OLMo-core's model equals normlab's windowed one and is far from
    normlab's without the window, and the same snippet without the window equals that one. The first 4
    positions see no more than 4 keys either way, so there the two agree."""
    _need("OLMo-core")
    window = 4
    assert TOKENS.shape[1] > window
    windowed = BASE.with_(sliding_window=window, full_attention_every=2)
    olmo_w, ours_w = built("gemma3", "OLMo-core", windowed)
    olmo_f, ours_f = built("gemma3", "OLMo-core", BASE)
    for a, b in zip(ours_w.state_dict().values(), ours_f.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the same weights: the window is the only difference
    # what OLMo-core built: layer 0 masks all but keys i - 3 .. i, layer 1 none
    first, second = (olmo_w.blocks[str(i)].attention for i in range(2))
    assert first.window_size == window and first.backend.window_size == (window - 1, 0)
    assert type(first.backend).__name__ == "TorchAttentionBackend"
    assert second.window_size is None and second.backend.window_size == (-1, -1)
    got_w, got_f = _logits("OLMo-core", olmo_w, TOKENS), _logits("OLMo-core", olmo_f, TOKENS)
    with torch.no_grad():
        want_w, want_f = ours_w(TOKENS).logits, ours_f(TOKENS).logits
    torch.testing.assert_close(got_w, want_w, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_f, want_f, atol=ATOL, rtol=RTOL)
    assert (got_w - want_f).abs().max().item() > 100 * ATOL  # without its window the model is another function
    assert (got_f - want_w).abs().max().item() > 100 * ATOL
    torch.testing.assert_close(got_w[:, :window], got_f[:, :window], atol=ATOL, rtol=RTOL)
    assert (got_w[:, window:] - got_f[:, window:]).abs().amax(dim=-1).min().item() > 10 * ATOL  # every later one


# one default each code base would put back if the snippet left it out: the comparison must see it
WRONG = [
    ("pre", "litgpt", "rotary_percentage=1.0", "rotary_percentage=0.25", {}),
    ("gemma3", "litgpt", "name='Gemma-normlab-gemma3'", "name='normlab-gemma3'", {}),  # gains w, not 1 + w
    ("olmo2", "OLMo-core", "eps=0.001, ", "", {}),  # eps 1e-5
    ("qwen3", "OLMo-core", "use_head_qk_norm=True", "use_head_qk_norm=False", {}),  # over all heads
    ("qwen3", "torchtitan", "eps=0.001, ", "", {}),
    # OLMo-core's windows leave its first and last layers full by default
    (
        "gemma3",
        "OLMo-core",
        "force_full_attention_on_first_layer=False",
        "force_full_attention_on_first_layer=True",
        dict(sliding_window=4, full_attention_every=2),
    ),
    (
        "gemma3",
        "OLMo-core",
        "force_full_attention_on_last_layer=False",
        "force_full_attention_on_last_layer=True",
        dict(sliding_window=4),
    ),
]


@pytest.mark.parametrize(
    ("layout", "framework", "stated", "default", "options"),
    WRONG,
    ids=[f"{w[1]}-{w[0]}{'-' + w[2].split('=')[0] if w[4] else ''}" for w in WRONG],
)
def test_a_wrong_default_is_caught(layout, framework, stated, default, options):
    _need(framework)
    cfg = BASE.with_(**options)
    code = settings_for(layout, cfg)[framework]["code"]
    assert stated in code
    space: dict = {}
    exec(code.replace(stated, default), space)
    ours = _normlab(layout, cfg)
    try:
        load(space["model"], WEIGHTS[framework](ours.state_dict(), layout))
    except (AssertionError, RuntimeError):
        return  # another set of parameters: caught already (OLMo-core's full-width QK-norm has wider gains)
    diff = (_logits(framework, space["model"], TOKENS) - ours(TOKENS).logits).abs().max().item()
    assert diff > 100 * ATOL


# --- patches where a code base's settings do not reach (normlab.recommend.frameworks.patches) ---------------


@pytest.mark.parametrize(("layout", "framework", "base"), PATCHED, ids=[f"{f}-{p}-from-{b}" for p, f, b in PATCHED])
def test_patch_builds_normlabs_function(layout, framework, base):
    check_patch(layout, framework, BASE, base)


def test_litgpts_own_entry_points_refuse_a_patched_checkpoint_as_the_patch_says(tmp_path):
    """What the printed litgpt patch says: litgpt's generate/chat/finetune build GPT(config) and load with
    litgpt.utils.load_checkpoint (strict), which refuses the patched model's checkpoint by its new key; the patched
    model (GPT(config), then the patch's line replacing block 0) loads it."""
    _need("litgpt")
    import lightning as L
    from litgpt.utils import load_checkpoint

    code = patched_code("peri", "litgpt", BASE, "pre")
    assert "litgpt generate, chat and finetune" in " ".join(code.splitlines())
    space: dict = {}
    exec(compile(code, "<litgpt patch for peri>", "exec"), space)  # our own generated text
    path = tmp_path / "lit_model.pth"
    torch.save(space["model"].state_dict(), path)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*transformer\.h\.0\.embedding_norm\.weight"):
        load_checkpoint(fabric, space["GPT"](space["config"]), path)
    patched = space["GPT"](space["config"])
    patched.transformer.h[0] = space["EmbeddingNormBlock"](space["config"], 0)
    load_checkpoint(fabric, patched, path)


@pytest.mark.parametrize(
    ("layout", "base", "block"),
    [
        ("peri", "pre", "Llama3TransformerBlock"),
        ("attn=qkAB,mlp=AB,final", "qwen3", "Qwen3TransformerBlock"),  # your model (qwen3) + output norms
        ("attn=qkAB,mlp=AB,final", "pre", "Llama3TransformerBlock"),
    ],
)
def test_torchtitan_patch_subclasses_the_users_block(layout, base, block):
    """The patch's block is a subclass of the user's model's block (Qwen3's for a Qwen3 user), and its new norms
    are the parameters it says, with the init it says (gains of 1 from init_states)."""
    code = patched_code(layout, "torchtitan", BASE, base)
    space: dict = {}
    exec(code, space)
    model = space["model"]
    assert all(block in [c.__name__ for c in type(layer).__mro__] for layer in model.layers.values())
    parts = peri_parts(layout)
    extra = {
        name: p
        for name, p in model.named_parameters()
        if any(n in name for n in ("post_attention_norm", "post_ffn_norm", "embedding_norm"))
    }
    outs = ("post_attention_norm", "post_ffn_norm") if parts.out else ()
    want = {f"layers.{i}.{n}.weight" for i in range(BASE.n_layers) for n in outs}
    assert set(extra) == want | ({"layers.0.embedding_norm.weight"} if parts.emb else set())
    for p in extra.values():
        assert torch.equal(p, torch.ones(BASE.d_model))  # init_states: the gains start at 1
    assert all(name in code for name in titan_new_parameters(parts))  # the header names them


def test_torchtitan_patch_gives_new_norms_the_input_norms_sharding():
    """torchtitan's update_from_config shards the norms it knows; the patch's model gives the new ones the same."""
    _need("torchtitan")
    from types import SimpleNamespace

    from torchtitan.config import ParallelismConfig

    code = patched_code("attn=qkAB,mlp=AB,emb,final", "torchtitan", BASE, "qwen3")
    space: dict = {}
    exec(code, space)
    config = space["config"]
    config.update_from_config(config=SimpleNamespace(parallelism=ParallelismConfig(enable_sequence_parallel=True)))
    for i, layer in enumerate(config.layers):
        assert layer.attention_norm.sharding_config is not None
        for extra in (layer.post_attention_norm, layer.post_ffn_norm):
            assert extra.sharding_config == layer.attention_norm.sharding_config
        assert (layer.embedding_norm is None) == (i > 0)
    assert config.layers[0].embedding_norm.sharding_config == config.layers[0].attention_norm.sharding_config


PATCH_OPTIONS = [
    # Qwen 3's heads wider than d_model / n_heads, tied embeddings
    ("attn=qkAB,mlp=AB,emb,final", "torchtitan", "qwen3", dict(d_head=24, tie_embeddings=True)),
    ("attn=qkAB,mlp=AB,emb,final", "litgpt", "qwen3", dict(d_head=24, tie_embeddings=True)),
]


@pytest.mark.parametrize(
    ("layout", "framework", "base", "options"), PATCH_OPTIONS, ids=[f"{f}-{p}" for p, f, _, _ in PATCH_OPTIONS]
)
def test_patch_with_model_options(layout, framework, base, options):
    check_patch(layout, framework, BASE.with_(**options), base)


# a patch without one of its norms in the forward: the same parameters, another function, which the comparison sees
WRONG_PATCH = [
    ("attn=qkAB,mlp=AB,final", "torchtitan", "qwen3", "x = x + self.post_attention_norm(h)", "x = x + h"),
    ("peri", "torchtitan", "pre", "x = self.embedding_norm(x)", "pass"),
    ("peri", "litgpt", "pre", "super().forward(self.embedding_norm(x),", "super().forward(x,"),
]


@pytest.mark.parametrize(
    ("layout", "framework", "base", "stated", "wrong"), WRONG_PATCH, ids=[f"{w[1]}-{w[0]}" for w in WRONG_PATCH]
)
def test_a_patch_missing_a_norm_is_caught(layout, framework, base, stated, wrong):
    code = patched_code(layout, framework, BASE, base)
    assert stated in code
    theirs, ours = run_patch(code.replace(stated, wrong), layout, framework, BASE)
    diff = (_logits(framework, theirs, TOKENS) - ours(TOKENS).logits).abs().max().item()
    assert diff > 100 * ATOL
