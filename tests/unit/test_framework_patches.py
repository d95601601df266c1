"""The patches `normlab recommend` prints where a code base's settings do not reach (torchtitan's output and
embedding norms, litgpt's embedding norm), and its advice worded from the user's model. No framework is imported
here: `make test-frameworks` (tests/frameworks) runs every patch in its library and compares logits."""

from __future__ import annotations

import pytest

from normlab.model.config import SIZES
from normlab.recommend.frameworks.patches import PERI_FAMILY, as_change, changes, peri_parts
from normlab.recommend.frameworks.snippets import PATCHES, PLACEMENTS, patch, settings_for
from tests.frameworks.cases import PATCHED

CFG = SIZES["micro"]
QWEN3_OUT = "attn=qkAB,mlp=AB,final"  # your model (qwen3) + output norms
QWEN3_PERI = "attn=qkAB,mlp=AB,emb,final"  # your model (qwen3) + output and embedding norms


@pytest.fixture(scope="module")
def qwen3_out() -> dict:
    return settings_for(QWEN3_OUT, CFG, base_layout="qwen3")


def test_qwen3_plus_output_norms_is_a_torchtitan_patch_on_qwen3s_block(qwen3_out):
    titan = qwen3_out["torchtitan"]
    assert not titan["expressible"] and titan["patch"]
    code = titan["code"]
    assert code in titan["settings"]  # printed as the user reads it
    assert titan["settings"].startswith("your model (qwen3) + output norms after attention and after the MLP: ")
    assert "class PeriLNBlock(Qwen3TransformerBlock):" in code and "class PeriLNModel(Qwen3Model):" in code
    assert "Llama3" not in code
    for name in ("layers.{i}.post_attention_norm.weight", "layers.{i}.post_ffn_norm.weight"):
        assert name in code  # the state-dict names, said
    assert "embedding_norm" not in code  # qwen3 has none, and this change adds none
    assert code.count("qk_norm=norm(") == 1 and f"eps={CFG.norm_eps!r}" in code  # QK-norm kept, eps stated
    assert "param_init={'weight': nn.init.ones_}" in code  # the gains' init
    assert "model = config.build()" in code
    compile(code, "<torchtitan patch>", "exec")


def test_settings_still_give_what_they_reach(qwen3_out):
    """OLMo-core (peri_norm, per-head QK-norm) and litgpt (post norms, norm_qk) state qwen3 + output norms by their
    settings; qwen3 itself stays a settings snippet in every code base."""
    olmo, lit = qwen3_out["OLMo-core"], qwen3_out["litgpt"]
    assert olmo["expressible"] and not olmo["patch"] and "TransformerBlockType.peri_norm" in olmo["code"]
    assert "use_head_qk_norm=True" in olmo["code"] and "embedding_norm=None" in olmo["code"]
    assert lit["expressible"] and not lit["patch"]
    for stated in ("post_attention_norm=True", "post_mlp_norm=True", "norm_qk=True", "norm_qk_type='default'"):
        assert stated in lit["code"]
    assert "class " not in lit["code"]
    same = settings_for("qwen3", CFG, base_layout="qwen3")
    for fw in ("OLMo-core", "torchtitan", "litgpt"):
        assert same[fw]["expressible"] and not same[fw]["patch"] and "class " not in same[fw]["code"], fw
    assert "Qwen3TransformerBlock.Config(" in same["torchtitan"]["code"]
    assert not same["torchtitan"]["settings"].startswith("your model")  # no change to word


def test_peri_from_a_llama_user():
    said = settings_for("peri", CFG, base_layout="pre")
    titan, lit = said["torchtitan"], said["litgpt"]
    assert titan["patch"] and "class PeriLNBlock(Llama3TransformerBlock):" in titan["code"]
    assert "layers.0.embedding_norm.weight" in titan["code"] and "qk_norm=None" in titan["code"]
    assert titan["settings"].startswith(
        "your model (pre) + output norms after attention and after the MLP + an embedding norm: "
    )
    assert lit["patch"] and "class EmbeddingNormBlock(Block):" in lit["code"]
    assert "model.transformer.h[0] = EmbeddingNormBlock(config, 0)" in lit["code"]
    assert "post_attention_norm=True" in lit["code"] and "transformer.h.0.embedding_norm.weight" in lit["code"]
    assert said["OLMo-core"]["expressible"] and not said["OLMo-core"]["patch"]  # peri_norm + embedding_norm


def test_the_user_picks_torchtitans_base_block():
    """QK-norm lives in torchtitan's attention config, so either block carries it: the user's is the base."""
    from_qwen3 = patch("torchtitan", QWEN3_PERI, CFG, "qwen3")
    from_llama = patch("torchtitan", QWEN3_PERI, CFG, "pre")
    unknown = patch("torchtitan", QWEN3_PERI, CFG)
    assert from_qwen3 is not None and from_llama is not None and unknown is not None
    assert "(Qwen3TransformerBlock)" in from_qwen3 and "(Llama3TransformerBlock)" in from_llama
    assert "(Qwen3TransformerBlock)" in unknown  # no user placement: by the layout's QK-norm
    assert "qk_norm=norm(" in from_llama  # the QK-norm kept on Llama3's block
    assert patch("torchtitan", "qwen3", CFG, "qwen3") is None  # its settings give it: no patch


def test_every_patch_is_run_in_its_library_by_make_test_frameworks():
    """Each (placement, code base) with a patch is in tests/frameworks/cases.PATCHED, which builds it there, and
    every patch compiles as printed; none is offered where the settings reach."""
    emitted = {(layout, fw) for layout, fws in PATCHES.items() for fw in fws}
    assert emitted == {(layout, fw) for layout, fw, _ in PATCHED}
    assert not emitted & {(layout, fw) for layout, fws in PLACEMENTS.items() for fw in fws}
    assert "OLMo-core" not in {fw for _, fw in emitted}  # its settings give all of PERI_FAMILY
    assert {p.name for p in PERI_FAMILY} <= {layout for layout, fws in PLACEMENTS.items() if "OLMo-core" in fws}
    for layout, fw, base in PATCHED:
        code = patch(fw, layout, CFG, base)
        assert code is not None, (layout, fw)
        compile(code, f"<{fw} {layout}>", "exec")
        assert "model = " in code and f"{CFG.norm_eps!r}" in code


def test_advice_without_a_patch_starts_from_the_users_model():
    """Where no setting and no patch gives the placement, the advice is the change from the user's model when the
    code base states the user's model, else the nearest placement it states."""
    hybrid = settings_for("hybrid", CFG, base_layout="qwen3")["torchtitan"]
    assert not hybrid["expressible"] and not hybrid["patch"] and hybrid["code"] is None
    assert "from your model (qwen3), which its settings give, the change is: your model (qwen3) " in hybrid["settings"]
    assert "nearest: " not in hybrid["settings"]
    assert "nearest: " in settings_for("hybrid", CFG)["torchtitan"]["settings"]
    layer_norm = settings_for("attn=AB,mlp=AB,emb,final,norm=layer", CFG, base_layout="pre")["torchtitan"]
    assert not layer_norm["patch"] and layer_norm["code"] is None  # patches are RMSNorm's only
    assert "(other settings: norm)" in layer_norm["settings"]


def test_changes_in_words():
    assert changes("qwen3", "pre") == ["without QK-norm"]
    assert changes("qwen3", QWEN3_PERI) == ["+ output norms after attention and after the MLP", "+ an embedding norm"]
    assert changes("pre", "peri+qk") == [
        "+ output norms after attention and after the MLP",
        "+ QK-norm",
        "+ an embedding norm",
        "(other settings: norm)",
    ]
    assert as_change("qwen3", "qwen3") == "your model (qwen3) as it is"
    assert peri_parts("pre-qk-pre") == peri_parts("qwen3")  # init aside: the same function
    assert peri_parts("gemma3") is None and peri_parts("attn=qkAB,mlp=AB,final,gain=centered") is None
