"""The one-entry registries: a norm kind is its facts row (normlab.layout.norm_kinds) and its module
(normlab.model.norms.NORM_MODULES); an optimizer is its facts row (normlab.config.optimizers) and its builder
(normlab.train.optim.OPTIMIZER_BUILDERS). Every reader follows them, and each check here is a function returning
what disagrees, run on the real registries (nothing) and on a registry with an entry missing or wrong (something),
so a check that could not fail would show."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import normlab
from normlab.config.optimizers import OPTIMIZER_FACTS, OPTIMIZER_NAMES, OPTIMIZERS, OptimizerFacts
from normlab.layout import parse_layout
from normlab.layout.norm_kinds import NORM_FACTS, NORM_KIND_FACTS, NormKindFacts
from normlab.layout.sites import ALPHA_KINDS, GAINS, NORM_KINDS
from normlab.layout.spec import TOKEN_HELP
from normlab.model import analytic_params, count_params
from normlab.model.norms import NORM_MODULES, NORM_TYPES, NormModule, is_norm, make_norm, norm_kind_of

WIDTHS = (4, 12)  # two widths: a count that is right at one width by chance is wrong at the other


def _gains(facts: NormKindFacts) -> tuple[str, ...]:
    return GAINS if facts.gained else ("gamma",)


def module_problems(facts: tuple[NormKindFacts, ...], modules: dict[str, NormModule]) -> list[str]:
    """Where the facts and the modules disagree: a kind without a module (or a module without facts), a parameter
    the facts name that the module lacks or sizes otherwise, a point-wise kind without its alpha at alpha0."""
    names = [f.name for f in facts]
    out = [f"{k}: no module" for k in names if k not in modules]
    out += [f"{k}: a module without facts" for k in modules if k not in names]
    for f in facts:
        if f.name not in modules:
            continue
        for width in WIDTHS:
            for gain in _gains(f):
                for bias in (True, False):
                    norm = modules[f.name].build(width, 1e-5, bias, "input", 0.7, gain)
                    if not isinstance(norm, modules[f.name].cls):
                        out.append(f"{f.name}: builds a {type(norm).__name__}, registered as {modules[f.name].cls}")
                    have = {n: p.numel() for n, p in norm.named_parameters()}
                    want = {n: s for n, s in f.param_sizes(width, gain, bias).items() if s}
                    if have != want:
                        out.append(f"{f.name} width {width} gain {gain} bias {bias}: module {have}, facts {want}")
                    alpha = getattr(norm, "alpha", None)
                    if f.pointwise != (
                        isinstance(alpha, torch.nn.Parameter) and math.isclose(alpha.item(), 0.7, rel_tol=1e-6)
                    ):
                        out.append(f"{f.name}: pointwise={f.pointwise}, but its alpha is {alpha!r}")
    return out


def test_every_norm_kind_has_a_module_that_agrees_with_its_facts():
    assert module_problems(NORM_KIND_FACTS, NORM_MODULES) == []
    assert list(NORM_MODULES) == list(NORM_KINDS)  # one order: error messages list the kinds in it


def test_a_missing_or_wrong_norm_entry_is_caught():
    extra = dataclasses.replace(NORM_FACTS["rms"], name="newnorm")
    assert module_problems((*NORM_KIND_FACTS, extra), NORM_MODULES) == ["newnorm: no module"]
    without = {k: m for k, m in NORM_MODULES.items() if k != "derf"}
    assert module_problems(NORM_KIND_FACTS, without) == ["derf: no module"]
    # Derf's facts without its shift s: the count is one short at every width
    short = dataclasses.replace(NORM_FACTS["derf"], params=NORM_FACTS["dyt"].params)
    found = module_problems(tuple(short if f.name == "derf" else f for f in NORM_KIND_FACTS), NORM_MODULES)
    assert found and all(p.startswith("derf width") for p in found)
    # a module registered under a kind whose facts it does not match (ScaleNorm holds one g, not a gain per channel)
    swapped = {**NORM_MODULES, "rms": NORM_MODULES["scale"]}
    assert any(p.startswith("rms width 12 gain gamma") for p in module_problems(NORM_KIND_FACTS, swapped))


@pytest.mark.parametrize("kind", NORM_KINDS)
def test_every_kind_is_a_norm_parses_and_counts(kind):
    facts = NORM_FACTS[kind]
    norm = make_norm(kind, 8, 1e-5)
    assert is_norm(norm) and norm_kind_of(norm) == kind and isinstance(norm, NORM_TYPES)
    lay = parse_layout(f"peri,norm={kind}")
    assert lay.norm == kind and parse_layout(lay.to_string()) == lay
    assert parse_layout(f"peri,norm.final={kind}").norm_at("final").kind == kind
    assert f"|{kind}|" in TOKEN_HELP or f"={kind}|" in TOKEN_HELP or f"|{kind}," in TOKEN_HELP
    assert (kind in ALPHA_KINDS) == facts.pointwise
    # the analytic count (normlab.model.params, read from the facts) is the built model's
    model = normlab.build_model(f"peri,norm={kind}", "nano", n_layers=2)
    assert count_params(model) == analytic_params(model.config, model.resolved)


def screen_problems(facts: tuple[NormKindFacts, ...]) -> list[str]:
    """A kind the screen's well-posedness step has no words for as an output norm (B) or an after-add norm (C)."""
    from normlab.screen import wellposedness

    out = []
    for f in facts:
        try:
            b = wellposedness(parse_layout(f"attn=B,mlp=B,norm={f.name}").resolve(2))["sublayers"][0]
            c = wellposedness(parse_layout(f"attn=C,mlp=C,norm={f.name}").resolve(2))["sublayers"][0]
        except Exception as e:  # noqa: BLE001 - a kind the layout grammar or the screen refuses is the finding
            out.append(f"{f.name}: {type(e).__name__}: {e}")
            continue
        if b["kind"] != "bounded" or f.output_bound not in b["why"]:
            out.append(f"{f.name}: B verdict {b}")
        if c["kind"] != "tangential" or f.after_add not in c["why"]:
            out.append(f"{f.name}: C verdict {c}")
    return out


def test_the_screen_has_a_bound_for_every_kind():
    assert screen_problems(NORM_KIND_FACTS) == []
    extra = dataclasses.replace(NORM_FACTS["rms"], name="newnorm")
    assert [p.split(":")[0] for p in screen_problems((extra,))] == ["newnorm"]


def test_the_screens_forward_bound_is_finite_for_every_kind():
    from normlab.screen.forward import output_norm_bound

    for kind in NORM_KINDS:
        model = normlab.build_model(f"peri,norm={kind}", "nano", n_layers=2)
        bound = output_norm_bound(model, 1.0)
        assert len(bound) == 3 and all(math.isfinite(b) and b > 1.0 for b in bound[1:]), (kind, bound)


def test_frameworks_say_something_for_every_kind():
    """A kind no code base computes is named, with its reason, wherever `normlab frameworks` says it cannot
    state the layout; the others are stated or judged by their sites."""
    from normlab.model.config import ModelConfig
    from normlab.recommend.frameworks.snippets import UNSAID, settings_for, unsaid

    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=64)
    for f in NORM_KIND_FACTS:
        said = [u for u in UNSAID if u.what == f.title]
        assert len(said) == (f.unsaid is not None), f.name
        if f.unsaid is not None:
            assert unsaid("OLMo-core", f"peri,norm={f.name}") == [f"{f.title}: {f.unsaid}"]
            entry = settings_for(f"peri,norm={f.name}", cfg)["torchtitan"]
            assert not entry["expressible"] and f.unsaid in entry["settings"]
    assert settings_for("peri", cfg)["OLMo-core"]["expressible"]  # RMSNorm is a code base's own


def test_doctors_rescale_follows_the_facts():
    from normlab.doctor.rescale import rescalable

    for f in NORM_KIND_FACTS:
        why = rescalable(normlab.build_model(f"pre,norm={f.name}", "nano", n_layers=2))
        assert (why is None) == f.rescalable, (f.name, why)


def test_param_sizes_by_hand():
    """The size rules against the modules' own docstrings, written out: LayerNorm's beta needs a per-channel gain."""
    assert NORM_FACTS["layer"].param_count(10, "gamma", True) == 20
    assert NORM_FACTS["layer"].param_count(10, "scalar", True) == 1
    assert NORM_FACTS["dyt"].param_count(10, "none", True) == 11  # beta and alpha
    assert NORM_FACTS["derf"].param_count(10, "gamma", False) == 12  # gamma, alpha, s
    assert NORM_FACTS["seednorm"].param_count(10, "centered", False) == 30
    assert NORM_FACTS["scale"].param_count(10) == 1 and NORM_FACTS["l2"].param_count(10) == 0
    with pytest.raises(ValueError, match="size"):
        NormKindFacts("bad", "Bad", "", (("weight", "per_head"),), False, True, "", "", False)  # type: ignore[arg-type]


# --- optimizers ---------------------------------------------------------------------------------


def _state_floats(opt) -> dict[int, int]:
    """Numbers of state per parameter id after a step (the step counters aside)."""
    return {
        id(p): sum(v.numel() for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor))
        for p, s in opt.state.items()
    }


def optimizer_problems(facts: tuple[OptimizerFacts, ...], builders: dict) -> list[str]:
    """Where the optimizers' facts and builders disagree: a row without a builder (or one without a row), a setting
    named that `OptimSettings` lacks, and after one step on a small model, the state a parameter holds against the
    facts (per parameter taken: state_floats; the rest: the `rest` row's) and against `normlab plan`'s bytes."""
    from normlab.config.sections import OptimSettings
    from normlab.config.train import TrainConfig
    from normlab.train.memory import plan_memory
    from normlab.train.optim import muon_matrices

    names = [f.name for f in facts]
    out = [f"{k}: no builder" for k in names if k not in builders]
    out += [f"{k}: a builder without facts" for k in builders if k not in names]
    fields = {f.name for f in dataclasses.fields(OptimSettings)}
    by_name = {f.name: f for f in facts}
    for f in facts:
        out += [f"{f.name}: reads {s!r}, no OptimSettings field" for s in f.settings if s not in fields]
        if f.name not in builders:
            continue
        torch.manual_seed(0)
        model = normlab.build_model("peri", "nano", n_layers=2)
        cfg = TrainConfig.of(layout="peri", size="nano", model={"n_layers": 2}, optimizer=f.name, vocab_size=256)
        opt = builders[f.name](model, cfg, False)
        sum(p.float().pow(2).sum() for p in model.parameters()).backward()
        opt.step()
        state = _state_floats(opt)
        taken = {id(p) for p in (muon_matrices(model) if f.takes == "matrices" else model.parameters())}
        want_total = 0
        for p in model.parameters():
            row = f if id(p) in taken else by_name.get(str(f.rest))
            want = row.state_floats * p.numel() if row is not None else 0
            want_total += want
            if state.get(id(p), 0) != want:
                out.append(f"{f.name}: a parameter of shape {tuple(p.shape)} holds {state.get(id(p), 0)}, facts {want}")
                break
        planned = plan_memory(cfg).optimizer
        if planned != 4 * want_total:
            out.append(f"{f.name}: normlab plan counts {planned} bytes, facts {4 * want_total}")
    return out


def test_every_optimizer_has_a_builder_that_agrees_with_its_facts():
    from normlab.config.commands import RECOMMEND_OPTIMIZERS
    from normlab.config.sections import OptimSettings
    from normlab.train.optim import OPTIMIZER_BUILDERS

    assert optimizer_problems(OPTIMIZER_FACTS, OPTIMIZER_BUILDERS) == []
    assert list(OPTIMIZER_BUILDERS) == list(OPTIMIZER_NAMES) and sorted(RECOMMEND_OPTIMIZERS) == sorted(OPTIMIZER_NAMES)
    assert OptimSettings.__dataclass_fields__["optimizer"].metadata  # the choices come from the facts:
    from normlab.config.train import TrainConfig
    from normlab.errors import ConfigError

    with pytest.raises(ConfigError, match="adamw"):
        TrainConfig.of(optimizer="lamb")
    # every optimizer-specific setting is some row's: Muon's and AdamW's and SGD's own
    claimed = {s for f in OPTIMIZER_FACTS for s in f.settings}
    own = {f.name for f in dataclasses.fields(OptimSettings) if f.name.startswith("muon_")}
    assert own | {"beta1", "beta2", "eps", "momentum"} <= claimed


def test_a_missing_or_wrong_optimizer_entry_is_caught():
    from normlab.train.optim import OPTIMIZER_BUILDERS

    sgd = OPTIMIZERS["sgd"]
    lion = dataclasses.replace(sgd, name="lion")
    assert optimizer_problems((lion,), {}) == ["lion: no builder"]
    assert optimizer_problems((), {"sgd": OPTIMIZER_BUILDERS["sgd"]}) == ["sgd: a builder without facts"]
    wrong = dataclasses.replace(sgd, state_floats=2, settings=("momentum", "nesterov"))
    found = optimizer_problems((wrong,), {"sgd": OPTIMIZER_BUILDERS["sgd"]})
    assert found[0] == "sgd: reads 'nesterov', no OptimSettings field"
    assert any("holds" in p for p in found)


def test_only_newton_schulz_optimizers_add_step_flops():
    from normlab.train.mfu import optimizer_flops

    model = normlab.build_model("peri", "nano", n_layers=2)
    for f in OPTIMIZER_FACTS:
        assert (optimizer_flops(model, f.name, 5) > 0) == (f.step_flops == "newton_schulz"), f.name


def test_the_optimizer_factory_runs_the_models_post_step_hooks_and_reads_no_layout_flag():
    """The factory registers whatever the model asks to run after a step (nGPT: `project`), for every optimizer;
    test_equations.py checks that an nGPT model's weights end each step on the sphere."""
    from normlab.config.train import TrainConfig
    from normlab.train.optim import make_optimizer

    assert normlab.build_model("peri", "nano", n_layers=2).post_step_hooks() == []
    assert len(normlab.build_model("ngpt", "nano", n_layers=2).post_step_hooks()) == 1
    for name in OPTIMIZER_NAMES:
        model = normlab.build_model("peri", "nano", n_layers=2)
        calls: list[int] = []
        model.post_step_hooks = lambda calls=calls: [lambda: calls.append(1)]  # type: ignore[method-assign]
        opt = make_optimizer(model, TrainConfig.of(optimizer=name))
        sum(p.sum() for p in model.parameters()).backward()
        opt.step()
        opt.step()
        assert calls == [1, 1], name
