"""The residual path as one typed value and one class: illegal combinations refused where they are written, the
grammar read into the variant in any order, and a new design added as one variant and one class."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import normlab
from normlab.layout import PRESETS, Layout, LayoutError, parse_layout
from normlab.layout import residual as variants
from normlab.layout.residual import AttnRes, Residual, ResidualOptions, Skip, Sphere, Streams
from normlab.model import residual as paths
from normlab.model.block import Block
from normlab.model.residual import RESIDUALS, ResidualPath
from normlab.model.sublayer import Flow, Sublayer
from tests.reference import N, mha, swiglu


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Streams(n=1), "from 1 to 16"),
        (lambda: Streams(n=4, mix="dense"), "unknown stream mix"),
        (lambda: Skip(h=0.0), "h=0 with a fixed h"),
        (lambda: Skip(alpha="deep"), "alpha must be a number > 0 or one of"),
        (lambda: Skip(h=1.0, h_learned="vector"), "h_learned must be one of"),
        (lambda: AttnRes(blocks=0), "whole number of blocks"),
        (lambda: Sphere(h=0.5), "nGPT's step is its eigen learning rate"),
        (lambda: Layout(residual="streams"), "one of normlab.layout.residual's variants"),  # type: ignore[arg-type]
        (lambda: ResidualOptions(streams=4, gpas=True).build(), "streams=4: .* so gpas has nothing to act on"),
        (lambda: ResidualOptions(streams=2, alpha="keel").build(), "skip scale alpha=keel"),
        (lambda: ResidualOptions(attn_res=8, streams=4).build(), "attnres=8: .*streams=4"),
        (lambda: ResidualOptions(attn_res=8, skip_learned=True).build(), "skip-scalar"),
        (lambda: ResidualOptions(scheme="ngpt", h=0.5).build(), "ngpt is nGPT's whole block.*this layout has h$"),
        (lambda: ResidualOptions(scheme="ngpt", streams=2).build(), "this layout has streams=2$"),
        (lambda: ResidualOptions(mix="mhc").build(), "give streams=N with N > 1"),
    ],
)
def test_an_illegal_residual_combination_is_refused_where_it_is_written_in_one_line(make, words):
    with pytest.raises(LayoutError, match=words) as err:
        make()
    assert "\n" not in str(err.value)


def test_a_variant_has_no_field_for_another_schemes_option():
    """Streams has no skip scale, lambda or GPAS; AttnRes none either; nGPT no step: they cannot be written."""
    assert {"alpha", "skip_learned", "gpas"} & set(Streams.__dataclass_fields__) == set()
    assert {"alpha", "skip_learned", "gpas", "n", "mix"} & set(AttnRes.__dataclass_fields__) == set()
    with pytest.raises(TypeError):
        Streams(n=4, gpas=True)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("pre,streams=4,mix=mhc", "pre,mix=mhc,streams=4"),
        ("attn=-,mlp=-,h=0,h-scalar", "attn=-,mlp=-,h-scalar,h=0"),
        ("pre,gpas,skip-scalar,h=0.5", "pre,h=0.5,skip-scalar,gpas"),
        ("pre-gpas,-gpas,attnres=4", "pre,attnres=4"),
        ("ngpt,-ngpt", "attn=qkBC,mlp=BC,norm=l2,qk-rope"),
    ],
)
def test_residual_tokens_are_read_in_any_order_into_one_variant(a, b):
    assert parse_layout(a) == parse_layout(b)
    assert parse_layout(parse_layout(a).to_string()) == parse_layout(a)


def test_every_preset_holds_a_variant_with_a_registered_class_and_its_options_round_trip():
    for name, preset in PRESETS.items():
        residual = preset.layout.residual
        assert type(residual) in RESIDUALS, name
        assert ResidualOptions.of(residual).build() == residual, name


def test_no_block_or_residual_method_takes_more_than_8_parameters():
    classes = [Block, Sublayer, *RESIDUALS.values()]
    for cls in classes:
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if fn.__qualname__.startswith(cls.__name__):
                assert len(inspect.signature(fn).parameters) <= 8, f"{cls.__name__}.{name}"


# --- a toy residual design: one variant (a one-token scheme) and one class, and nothing else ---


@dataclass(frozen=True)
class Leaky(Residual):
    """x' = k x + N_B(F(N_A(x))), k a learned scalar per sublayer from 0.5 (a toy)."""

    token: ClassVar[str | None] = "toy-leaky"
    words: ClassVar[str] = "toy leaky skip"


class LeakyPath(ResidualPath):
    variant = Leaky
    part_names = ("leak",)

    def parts(self, k: int) -> dict[str, Any]:
        return {"leak": nn.Parameter(torch.full((1,), 0.5))}

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        normed, update = self.update(x, sub, own, flow)
        return sub.close(own["leak"] * x, update, flow)


@pytest.fixture
def leaky(monkeypatch):
    monkeypatch.setattr(variants, "SCHEMES", dict(variants.SCHEMES))
    monkeypatch.setattr(paths, "RESIDUALS", dict(paths.RESIDUALS))
    monkeypatch.setattr(paths, "PART_NAMES", list(paths.PART_NAMES))
    import normlab.layout.spec as spec
    import normlab.model.block as block

    monkeypatch.setattr(spec, "SCHEMES", variants.SCHEMES)
    monkeypatch.setattr(block, "PART_NAMES", paths.PART_NAMES)
    variants.register_scheme(Leaky)
    paths.register(LeakyPath)


def test_a_new_residual_design_is_one_variant_and_one_class(leaky):
    lay = parse_layout("pre,toy-leaky")
    assert lay.residual == Leaky() and lay.to_string() == "attn=A,mlp=A,final,toy-leaky"
    assert parse_layout(lay.to_string()) == lay and parse_layout("pre,toy-leaky,-toy-leaky") == PRESETS["pre"].layout
    with pytest.raises(LayoutError, match="toy-leaky is a residual scheme of its own.*this layout has gpas"):
        parse_layout("pre,toy-leaky,gpas")
    model = normlab.build_model(lay, "nano", seed=0).double()
    assert "toy leaky skip" in model.resolved.table()
    b = model.blocks[0]
    assert isinstance(b.attn_leak, nn.Parameter) and b.attn_hc is None  # its part by name; other schemes' None
    with torch.no_grad():
        b.attn_leak.fill_(0.3)
        b.mlp_leak.fill_(0.7)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        y = 0.3 * x + mha(b.attn, N(b.attn_norms.input, x), "")
        want = 0.7 * y + swiglu(b.mlp, N(b.mlp_norms.input, y))
        # float64: the reference sums attention in another order than SDPA; eps times 2^16 bounds the growth of
        # sums of d = 32 and T = 5 terms through two sublayers (the float64 equation tests of the presets use 1e-6)
        tol = torch.finfo(torch.float64).eps * 2**16
        torch.testing.assert_close(b(x), want, rtol=tol, atol=tol)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(tokens, targets=tokens).loss
    loss.backward()
    assert b.attn_leak.grad is not None and b.attn_leak.grad.abs().item() > 0
    opt.step()
    assert b.attn_leak.item() != 0.3 and torch.isfinite(model(tokens, targets=tokens).loss)
