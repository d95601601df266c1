"""scripts/trace_walk.py: the walk of a function through normlab's modules, and its rooms, stays and returns counted
as its docstring defines them, on two made-up modules whose walk is written out by hand."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

from tests.helpers import REPO

A = """
def root():
    os.path.join("x", "y")  # the standard library: not a room
    b_f()
    a_g()
    b_f2()
    for _ in range(2):
        b_f()

def a_g():
    pass
"""
B = """
def b_f():
    b_h()

def b_h():
    pass

def b_f2():
    pass
"""


def _script():
    spec = importlib.util.spec_from_file_location("trace_walk", REPO / "scripts" / "trace_walk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _modules():
    """normlab.walk_a.root calls into normlab.walk_b and back (the two modules exist only in these namespaces)."""
    b: dict = {"__name__": "normlab.walk_b"}
    exec(compile(textwrap.dedent(B), "walk_b.py", "exec"), b)
    a: dict = {"__name__": "normlab.walk_a", "os": os, **{k: b[k] for k in ("b_f", "b_f2")}}
    exec(compile(textwrap.dedent(A), "walk_a.py", "exec"), a)
    return a["root"]


def _walk(scope: str, distinct: bool) -> dict:
    tw = _script()
    tracer = tw.Tracer("normlab.walk_a:root", scope, distinct)
    root = _modules()
    before = sys.getprofile()
    sys.setprofile(tracer)
    try:
        root()
    finally:
        sys.setprofile(before)
    return {**tracer.walk.counts(), "walk": [m.removeprefix("normlab.walk_") for m in tracer.walk.rooms]}


def test_every_call_of_the_tree():
    # root (a), b_f (b), b_h (b: stay), a_g (a: return), b_f2 (b: return), b_f, b_h, b_f, b_h (stays)
    got = _walk("tree", distinct=False)
    assert got["walk"] == ["a", "b", "b", "a", "b", "b", "b", "b", "b"]
    assert (got["rooms"], got["stays"], got["returns"], got["calls"]) == (2, 5, 2, 8)
    assert got["returning_moves"] == {"normlab.walk_b -> normlab.walk_a": 1, "normlab.walk_a -> normlab.walk_b": 1}


def test_each_call_site_once():
    # the loop's b_f is a call site of its own (counted once); b_f's call of b_h was seen already
    got = _walk("tree", distinct=True)
    assert got["walk"] == ["a", "b", "b", "a", "b", "b"]
    assert (got["rooms"], got["stays"], got["returns"], got["calls"]) == (2, 2, 2, 5)


def test_the_roots_own_calls_only():
    got = _walk("direct", distinct=False)
    assert got["walk"] == ["a", "b", "a", "b", "b", "b"]
    assert (got["stays"], got["returns"]) == (2, 2)
