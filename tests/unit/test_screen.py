"""The stability screen: verdicts that agree with the papers, invariances, W2 against closed forms."""

import json
import math

import numpy as np
import pytest
import torch

import normlab
from normlab.cli import main
from normlab.errors import ConfigError
from normlab.layout import PRESETS, LayoutError, parse_layout
from normlab.screen import ScreenConfig, parse_stresses, screen_layout, wasserstein2, wellposedness
from normlab.screen.backward import block_sensitivity
from normlab.screen.forward import fit_growth, stressed

FAST = ScreenConfig(
    model={"n_layers": 4, "d_model": 64, "n_heads": 4}, batch=2, seq_len=16, iters=10, stresses=(1.0, 8.0)
)


@pytest.fixture(scope="module")
def screened():
    return {n: screen_layout(n, FAST) for n in ("pre", "peri", "b", "post")}


def test_pre_is_unbounded_and_sensitivity_grows_with_stress(screened):
    v = screened["pre"]["verdict"]
    assert v["wellposedness"] == "ill-posed (unbounded)"
    assert v["sensitivity_ratio"] > 1.5 and v["backward"].startswith("grows with s")
    assert v["forward_final_mean_abs_ratio"] > 3  # the stream's scale follows the module weights
    assert v["overall"] == "unstable"


@pytest.mark.parametrize("name", ["peri", "b"])
def test_output_normalized_layouts_are_bounded_and_invariant(screened, name):
    r = screened[name]
    assert r["verdict"]["wellposedness"] == "well-posed" and r["verdict"]["backward"] == "invariant to s"
    assert abs(r["verdict"]["sensitivity_ratio"] - 1) < 0.05
    for row in r["stresses"].values():  # Theorem 4: measured mean|X_l| under the linear bound at every depth
        assert row["thm4_holds"] and all(m <= b + 1e-9 for m, b in zip(row["mean_abs"], row["thm4_bound"]))
    assert r["verdict"]["overall"] == "stable"


def test_post_has_flat_variance_in_depth(screened):
    r = screened["post"]
    assert r["verdict"]["wellposedness"] == "degenerate (tangential)"
    assert all(row["shape_var"]["shape"] == "flat" for row in r["stresses"].values())


def test_smaller_h_reduces_growth(screened):
    h = screened["pre"]["h_effect"]
    assert h["h_small"] == 0.5 and h["final_mean_abs"][1] < 0.7 * h["final_mean_abs"][0]
    assert h["sensitivity_mean"][1] < h["sensitivity_mean"][0]


def test_wellposedness_from_data_alone():
    expect = {
        "peri": "well-posed",
        "b": "well-posed",
        "olmo2": "well-posed",
        "peri-frozen": "well-posed",
        "post": "degenerate (tangential)",
        "deepnorm": "degenerate (tangential)",
        "a+c": "degenerate (tangential)",
        "pre": "ill-posed (unbounded)",
        "hybrid": "ill-posed (unbounded)",
        "none": "ill-posed (unbounded)",
        "mix-ln": "ill-posed (unbounded)",
    }
    for name, verdict in expect.items():
        assert wellposedness(PRESETS[name].layout.resolve(8))["verdict"] == verdict, name
    mixed = wellposedness(parse_layout("attn=AB,mlp=A,[0:1]mlp=AB").resolve(4))
    assert mixed["verdict"] == "ill-posed (unbounded)"
    bad = [v for v in mixed["sublayers"] if v["kind"] == "unbounded"]
    assert [(v["layers"], v["sublayer"]) for v in bad] == [("1-3", "mlp")]


def test_stress_leaves_a_peri_block_unchanged_up_to_eps():
    """Module outputs x s: N_B(s f) = s f / sqrt(s^2 ms(f) + eps) = N_B(f) with eps -> eps / s^2.

    With eps negligible the block is exactly unchanged; with the default eps (comparable to ms(f) at
    init) the outputs converge as eps / s^2 -> 0."""
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = normlab.build_model("peri", "nano", seed=0, norm_eps=1e-30).double()
    for s in (2.0, 8.0, 100.0):
        for b0, b1 in zip(exact.blocks, stressed(exact, s, "output").blocks):
            torch.testing.assert_close(b1(x), b0(x), rtol=1e-12, atol=1e-12)
    model = normlab.build_model("peri", "nano", seed=0).double()  # eps = 1e-6
    outs = {s: stressed(model, s, "output").blocks[0](x) for s in (1.0, 100.0, 1000.0)}
    far, near = (outs[1.0] - outs[1000.0]).abs().max(), (outs[100.0] - outs[1000.0]).abs().max()
    assert near < 1e-3 and near < far / 100


def test_every_weight_scaled_leaves_a_homogeneous_peri_mlp_unchanged():
    """Scaling every weight of a ReLU MLP by s scales its output by s^2; Peri-LN's output norm removes it."""
    model = normlab.build_model("peri", "nano", seed=0, norm_eps=1e-30, mlp="relu").double()
    big = stressed(model, 5.0, "all")
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    for b0, b1 in zip(model.blocks, big.blocks):
        f0 = b0.mlp_norms.output(b0.mlp(b0.mlp_norms.input(x)))
        f1 = b1.mlp_norms.output(b1.mlp(b1.mlp_norms.input(x)))
        torch.testing.assert_close(f1, f0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b1.mlp(x), 25.0 * b0.mlp(x))


def test_sensitivity_invariance_numerically():
    model = normlab.build_model("peri", "nano", seed=0, norm_eps=1e-30).double()
    pre = normlab.build_model("pre", "nano", seed=0).double()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    peri_s = [block_sensitivity(stressed(model, s, "output").blocks[0], x) for s in (1.0, 100.0)]
    pre_s = [block_sensitivity(stressed(pre, s, "output").blocks[0], x) for s in (1.0, 100.0)]
    assert peri_s[1] == pytest.approx(peri_s[0], rel=1e-9)
    assert pre_s[1] > 2 * pre_s[0]


def test_power_iteration_finds_the_spectral_norm():
    w = torch.diag(torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64))
    lin = lambda x: x @ w.T
    assert block_sensitivity(lin, torch.ones(1, 3, dtype=torch.float64), iters=50) == pytest.approx(3.0, rel=1e-6)


def test_wasserstein_closed_forms():
    # hand-solved 1-D case: sorted matching (0->2, 1->5): sqrt((4 + 16) / 2)
    assert wasserstein2(np.array([0.0, 1.0]), np.array([5.0, 2.0])) == pytest.approx(math.sqrt(10))
    # a translated cloud: W2 = |shift| exactly
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 5))
    shift = np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    assert wasserstein2(a, a + shift) == pytest.approx(np.linalg.norm(shift), rel=1e-9)
    # Gaussians N(0, 1) vs N(mu, sigma^2) on quantile grids: W2^2 = mu^2 + (sigma - 1)^2 E[z^2]
    from scipy.stats import norm

    z = norm.ppf((np.arange(200) + 0.5) / 200)
    mu, sigma = 0.7, 1.8
    expected = math.sqrt(mu**2 + (sigma - 1) ** 2 * np.mean(z**2))
    assert wasserstein2(z, mu + sigma * z[::-1]) == pytest.approx(expected, rel=1e-9)
    assert np.mean(z**2) == pytest.approx(1.0, abs=0.02)


def test_fit_growth_shapes():
    layer = np.arange(12.0)
    assert fit_growth(list(1 + 0.001 * layer))["shape"] == "flat"
    assert fit_growth(list(1 + 2 * layer))["shape"] == "linear"
    assert fit_growth(list(1 + 0.5 * layer**2))["shape"] == "quadratic"
    # Peri-LN's variance over depth at init: linear, a little under its line; not "quadratic"
    assert fit_growth([0.997, 2.958, 5.144, 7.069, 9.078, 10.723, 12.506])["shape"] == "linear"
    assert fit_growth(list(2.0**layer))["shape"] == "exponential"
    # one to three layers fit every curve exactly: no shape beyond linear is claimed (2^l over 3 layers)
    assert fit_growth([1.0, 2.0, 4.0])["shape"] == "linear" and fit_growth([1.0, 3.0])["shape"] == "linear"


@pytest.mark.parametrize("text", ["1,0", "-2", "abc", "nan", "1,inf"])
def test_invalid_stress_values(text):
    with pytest.raises(ConfigError, match="stress"):
        ScreenConfig(stresses=parse_stresses(text))


def test_cli_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "screen.json"
    toml = tmp_path / "mine.toml"
    toml.write_text('layout = "attn=AB,mlp=AB,final,h=0.5"\n')
    args = [
        "screen",
        "peri",
        str(toml),
        "--layers",
        "3",
        "--width",
        "32",
        "--heads",
        "2",
        "--seq-len",
        "8",
        "--stress",
        "1,4",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "well-posed" in table and "attn=AB,mlp=AB,final,h=0.5" in table
    data = json.loads(out.read_text())
    assert [r["n_layers"] for r in data["results"]] == [3, 3]
    assert set(data["results"][0]["stresses"]) == {"1.0", "4.0"}
    assert main(["screen", "perri"]) == 2
    assert "Did you mean peri" in capsys.readouterr().err
    with pytest.raises(LayoutError, match="has no 'layout' key"):
        (tmp_path / "empty.toml").write_text("size = 'tiny'\n")
        from normlab.screen import load_layout_arg

        load_layout_arg(str(tmp_path / "empty.toml"))


def test_wellposedness_names_each_kinds_bound():
    """B of every kind bounds the update (RMS: ellipsoid; DyT: a box; ScaleNorm/L2: a sphere); C of DyT keeps
    the stream in a box and stays tangential; a learned step is named as moving the bound."""

    def why(text, sublayer="attn"):
        v = wellposedness(parse_layout(text).resolve(2))
        return v["verdict"], next(s["why"] for s in v["sublayers"] if s["sublayer"] == sublayer)

    assert why("peri,norm=dyt")[0] == "well-posed" and "|u_i| <= h*(|gamma_i| + |beta_i|)" in why("peri,norm=dyt")[1]
    assert "||u|| = h*|g| exactly" in why("peri,norm=scale")[1] and "||u|| = h exactly" in why("peri,norm=l2")[1]
    assert "(B, dyt)" in why("peri,norm.mlp.B=dyt", "mlp")[1] and "(B, rms)" in why("peri,norm.mlp.B=dyt")[1]
    assert why("post,norm=dyt") == ("degenerate (tangential)", why("post,norm=dyt")[1])
    assert "box |x_i| <= |gamma_i| + |beta_i|" in why("post,norm=dyt")[1]
    assert "h learned (scalar, from 1)" in why("peri,h-scalar")[1]
    assert why("peri-derf")[0] == "well-posed" and "Derf squashes u" in why("peri-derf")[1]
    assert (
        "box |x_i| <= |gamma_i| + |beta_i|" in why("post,norm=derf")[1]
        and "(one scalar gain)" in why("peri,gain=scalar")[1]
    )
    assert why("rezero")[0] == "ill-posed (unbounded)" and "hidden norm (H)" in why("normformer", "mlp")[1]


@pytest.mark.parametrize(
    "text",
    [
        "peri,norm=l2",
        "peri,norm=scale",
        "peri,gain=none",
        "peri,norm=dyt",
        "peri,h-channel",
        "peri-derf",
        "peri,gain=scalar",
    ],
)
def test_theorem4_bound_holds_for_every_kind_of_output_norm(text):
    """The linear bound uses each kind's own per-entry bound (and a learned h's value) and holds under stress."""
    small = ScreenConfig(
        model={"n_layers": 2, "d_model": 32, "n_heads": 2}, batch=1, seq_len=8, iters=3, stresses=(1.0, 8.0)
    )
    r = screen_layout(text, small)
    assert len(r["stresses"]) == 2  # both stresses screened
    for row in r["stresses"].values():
        assert row["thm4_holds"], (text, row["mean_abs"], row["thm4_bound"])


def test_learned_skip_and_gpas_are_screened_without_theorem4():
    """A learned skip lambda or GPAS scales the carried stream, so Theorem 4's identity path is gone: the screen
    runs, says what carries the stream, and claims no bound even on Peri-LN's output norms."""
    for text, words in (("peri,skip-scalar", "learned skip scale"), ("peri,gpas", "GPAS")):
        r = screen_layout(
            text,
            ScreenConfig(
                model={"n_layers": 2, "d_model": 32, "n_heads": 2}, batch=1, seq_len=8, iters=3, stresses=(1.0, 4.0)
            ),
        )
        assert words in r["wellposedness"]["stream"] and r["wellposedness"]["verdict"] == "well-posed"
        assert all("thm4_bound" not in row for row in r["stresses"].values())
    assert wellposedness(PRESETS["peri"].layout.resolve(2))["stream"] == "identity (unit-weight sum)"


def test_screen_reports_the_hyper_connections_composite_gain(capsys):
    """mHC's res is doubly stochastic: the composite mixing's gain (max abs row / column sum of res_l..res_1) is 1
    at every stress; HC's unconstrained A_r, moved off its identity start, amplifies (gain > 1). The table says so."""
    from normlab.screen import format_table
    from normlab.screen.screen import hc_gain

    cfg = ScreenConfig(
        model={"n_layers": 2, "d_model": 32, "n_heads": 2}, batch=1, seq_len=8, iters=3, stresses=(1.0, 4.0)
    )
    r = screen_layout("pre-mhc", cfg)
    assert (
        r["verdict"]["hc_gain"] == pytest.approx(1.0, abs=1e-6) and "doubly stochastic" in r["wellposedness"]["stream"]
    )
    for row in r["stresses"].values():
        assert len(row["hc_gain"]["forward"]) == 4 and "thm4_bound" not in row
    assert "composite mixing gain" in format_table([r]) and "composite" not in format_table([screen_layout("pre", cfg)])
    model = normlab.build_model("pre-hc", "nano", n_layers=2).double()
    with torch.no_grad():
        for b in model.blocks:
            b.attn_hc.static_res.mul_(1.5)  # attention A_r = 1.5 I, the MLP keeps I: 1.5 per block
        model(torch.randint(0, 256, (1, 8)))
    assert hc_gain(model)["forward"] == pytest.approx([1.5, 1.5, 2.25, 2.25])


def test_seednorms_mean_entry_is_bounded_by_its_gains_whatever_its_input():
    """Theorem 4's per-sublayer term for SeeDNorm: mean|y| <= max|gamma| + max|alpha| (an RMS-1 vector times a gain
    |gamma_i + alpha_i tanh(.)| <= |gamma_i| + |alpha_i|), at any input scale and any beta."""
    from normlab.model.norms import make_norm
    from normlab.screen.forward import _mean_abs_bound

    g = torch.Generator().manual_seed(0)
    m = make_norm("seednorm", 64, 1e-6).double()
    with torch.no_grad():
        m.self_scale.copy_(torch.randn(64, generator=g, dtype=torch.float64))
        m.dyn_gain.copy_(2 * torch.randn(64, generator=g, dtype=torch.float64))
        m.weight.copy_(torch.randn(64, generator=g, dtype=torch.float64))
        bound = _mean_abs_bound(m, 64)
        for scale in (1e-3, 1.0, 1e4):
            y = m(scale * torch.randn(50, 64, generator=g, dtype=torch.float64))
            assert y.abs().mean(-1).max() <= bound


def test_ngpt_is_screened_as_output_normalized_on_the_sphere():
    """nGPT's update is Norm(F(h)) (an L2 norm at B) and its stream is renormalized (C): well-posed, the last
    stream's mean |entry| is that of a unit vector at every stress, and its sensitivity does not grow with s."""
    r = screen_layout(
        "ngpt",
        ScreenConfig(
            model={"n_layers": 2, "d_model": 32, "n_heads": 2}, batch=1, seq_len=8, iters=5, stresses=(1.0, 8.0)
        ),
    )
    assert r["wellposedness"]["verdict"] == "well-posed"
    assert abs(r["verdict"]["sensitivity_ratio"] - 1) < 0.05
    for row in r["stresses"].values():
        assert row["rms"][-1] == pytest.approx(32**-0.5, rel=1e-5)


@pytest.mark.parametrize("kind", ["moda", "depth_value"])
def test_cross_layer_attention_is_refused_in_one_line(kind):
    """MoDA's and Depth-Attention's blocks read the earlier layers' keys and values of the same forward: a block
    called alone (the Jacobians, the W2 probe) would read another forward's store, so the screen refuses them and
    names the attention kinds it can screen."""
    from normlab.errors import ConfigError

    with pytest.raises(ConfigError, match=f"model.attention={kind} .* model.attention=mha"):
        screen_layout("pre", ScreenConfig(size="nano", stresses=(1.0,)), {"model": {"attention": kind}})
