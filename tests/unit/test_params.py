"""Parameter counts: measured = analytic, and the papers' presets near their nominal sizes."""

import pytest
import torch

import normlab
from normlab.layout import PRESETS, LayoutError
from normlab.model import NormLM, analytic_params, count_params
from normlab.model.config import NOMINAL_PARAMS, SIZES


@pytest.mark.parametrize("name", list(PRESETS), ids=list(PRESETS))
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"tie_embeddings": True, "n_kv_heads": 1, "mlp": "gelu", "linear_bias": True},
        {"qkv_bias": True, "d_head": 8, "n_kv_heads": 2},
    ],
)
def test_measured_equals_analytic(name, variant):
    if PRESETS[name].layout.ngpt and (variant.get("mlp", "swiglu") != "swiglu" or variant.get("n_kv_heads", 2) != 2):
        with pytest.raises(LayoutError, match="nGPT's model"):  # nGPT's s_u, s_v and s_qk need SwiGLU and MHA
            normlab.build_model(name, "nano", n_layers=4, **variant)
        return
    model = normlab.build_model(name, "nano", n_layers=4, **variant)
    assert count_params(model) == analytic_params(model.config, model.resolved)


@pytest.mark.parametrize("layout", ["pre-gatednorm", "sandwich-gatednorm", "siamese,norm=gatednorm"])
@pytest.mark.parametrize("rank", [3, 128])
def test_measured_equals_analytic_at_every_gate_rank(layout, rank):
    """GatedNorm's gates counted at the rank the config sets, wherever the kind stands (SiameseNorm's stream norms
    too), below and above the width."""
    from normlab.model.params import analytic_matrices
    from normlab.train.optim import muon_matrices

    model = normlab.build_model(layout, "nano", n_layers=2, gated_norm_rank=rank)
    assert count_params(model) == analytic_params(model.config, model.resolved)
    # Muon takes the blocks' gates with their other matrices (the memory plan and the cost count them there)
    assert analytic_matrices(model.config, model.resolved) == sum(p.numel() for p in muon_matrices(model))


def test_sinks_count_one_logit_per_query_head_and_are_not_decayed():
    from normlab.config.train import TrainConfig
    from normlab.train.optim import param_groups

    sink = normlab.build_model("peri,softmax=sink", "nano", n_layers=3, n_heads=4, n_kv_heads=2)
    assert count_params(sink) == analytic_params(sink.config, sink.resolved)
    assert (
        count_params(sink).total
        - count_params(normlab.build_model("peri", "nano", n_layers=3, n_heads=4, n_kv_heads=2)).total
        == 3 * 4
    )
    for kind in ("off-by-one", "softpick"):  # no parameter
        m = normlab.build_model(f"peri,softmax={kind}", "nano")
        assert count_params(m) == count_params(normlab.build_model("peri", "nano"))
    decayed = {id(p) for p in param_groups(sink, TrainConfig())[0]["params"]}
    assert all(id(b.attn.sinks) not in decayed for b in sink.blocks)


def test_layernorm_counts_beta():
    ln = normlab.build_model("peri,norm=layer", "nano")
    rms = normlab.build_model("peri", "nano")
    n_norms = 2 + 4 * 2  # embedding + final, four per block
    assert count_params(ln).non_embedding - count_params(rms).non_embedding == n_norms * 32


def test_non_embedding_formula_by_hand():
    """Pre-LN, MHA, SwiGLU: L (4 d^2 + 3 d f + 2 d) + d (final norm)."""
    model = normlab.build_model("pre", "tiny")
    d, f, L = 128, 512, 6
    assert count_params(model).non_embedding == L * (4 * d * d + 3 * d * f + 2 * d) + d


@pytest.mark.parametrize("size", list(NOMINAL_PARAMS))
def test_paper_sizes_near_nominal(size):
    cfg = SIZES[size]
    with torch.device("meta"):  # no memory: 3.2B parameters would need 13 GB
        model = NormLM(cfg, PRESETS["pre"].layout.resolve(cfg.n_layers))
    count = count_params(model)
    assert count == analytic_params(cfg, model.resolved)
    nominal, with_embedding = NOMINAL_PARAMS[size]
    measured = count.total if with_embedding else count.non_embedding
    # Within 8%. Kim's Table 4 gives no FFN width; 4 d gives 402.6M / 1.611B / 3.355B (no single
    # ratio hits all three nominal names). Zhuo's 1.2B row, as printed (FFN 9192), gives 1.28B.
    assert abs(measured - nominal) / nominal < 0.08, (size, measured)


def test_residual_lambdas_and_gpas_count_one_scalar_per_sublayer_are_not_decayed_and_are_probed():
    """pre-lambda: a skip lambda and a branch lambda per sublayer (4 per block); pre-gpas: one a per sublayer
    (2 per block). Scales, like the norms' gains: no weight decay; the probes record each at its value."""
    from normlab.config.train import TrainConfig
    from normlab.diagnostics.probes import Probes
    from normlab.train.optim import param_groups

    base = count_params(normlab.build_model("pre", "nano", n_layers=3)).total
    lam = normlab.build_model("pre-lambda", "nano", n_layers=3)
    gpas = normlab.build_model("pre-gpas", "nano", n_layers=3)
    assert count_params(lam).total - base == 3 * 4 and count_params(gpas).total - base == 3 * 2
    for model, names in ((lam, ("attn_skip", "mlp_skip", "attn_h", "mlp_h")), (gpas, ("attn_gpas", "mlp_gpas"))):
        decayed = {id(p) for p in param_groups(model, TrainConfig())[0]["params"]}
        assert all(id(getattr(b, n)) not in decayed for b in model.blocks for n in names)
    with torch.no_grad():
        lam.blocks[2].mlp_skip.fill_(0.75)
        gpas.blocks[1].attn_gpas.fill_(-0.5)
    x = torch.randint(0, 256, (2, 8))
    rows = {(r["layer"], r["site"], r["metric"]): r["value"] for m in (lam, gpas) for r in Probes(m, (x, x)).record(0)}
    assert rows[(2, "mlp_skip", "skip_mean")] == pytest.approx(0.75)
    assert rows[(0, "attn_skip", "skip_mean")] == pytest.approx(1.0)
    assert rows[(1, "attn_gpas", "gpas_mean")] == pytest.approx(-0.5)
    assert rows[(0, "mlp_gpas", "gpas_abs_max")] == pytest.approx(0.0)


@pytest.mark.parametrize("mix", ["hc", "mhc"])
def test_hyper_connections_are_counted_kept_from_muon_and_decay_only_their_projections(mix):
    """Per sublayer, n = 4, d = 32: HC (Zhu et al.) A_m0 (n) + A_r0 (n^2) + B0 (n) + W_m, W_b (d each) + W_r (d n)
    + s_a, s_b = 218; mHC (Xie et al.) phi (n d x (n^2 + 2n)) + b (n^2 + 2n) + 3 gates = 3099. Muon takes none of
    them; weight decay only the dynamic projections."""
    from normlab.config.train import TrainConfig
    from normlab.train.optim import muon_matrices, param_groups

    n, d = 4, 32
    model = normlab.build_model(f"pre,streams={n},mix={mix}", "nano", n_layers=3)
    per = n + n * n + n + 2 * d + d * n + 2 if mix == "hc" else n * d * (n * n + 2 * n) + (n * n + 2 * n) + 3
    assert count_params(model).total - count_params(normlab.build_model("pre", "nano", n_layers=3)).total == 3 * 2 * per
    assert count_params(model) == analytic_params(model.config, model.resolved)
    hc = {id(p) for b in model.blocks for c in (b.attn_hc, b.mlp_hc) for p in c.parameters()}
    assert not hc & {id(p) for p in muon_matrices(model)}
    decayed = {id(p) for p in param_groups(model, TrainConfig())[0]["params"]}
    conn = model.blocks[1].mlp_hc
    for name, p in conn.named_parameters():
        assert (id(p) in decayed) == (name in ("dynamic_pre", "dynamic_res", "dynamic_post", "phi")), name
