"""The house limits, checked on the source: no function over 80 lines or 8 parameters, no module over 700
lines, cli.py at most 400 lines, no method of `Block` over 8 parameters.

Walks src/normlab with `ast`. A preset table (a function or module that is one long literal of named
presets) is excepted only by name in `ALLOWED`; nothing else is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "normlab"
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
MAX_MODULE_LINES = 700
MAX_CLI_LINES = 400

# (module path relative to src/normlab, qualified name or "" for the module) -> why it is excepted
ALLOWED: dict[tuple[str, str], str] = {
    ("layout/presets.py", ""): "the preset table: one named layout per entry",
}


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller can pass: positional, keyword-only, *args and **kwargs; self and cls not counted."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, str | None]]:
    """Every function and method: (qualified name, node, enclosing class name or None)."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, str | None]] = []

    def visit(node: ast.AST, prefix: str, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child, cls))
                visit(child, name + ".", None)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", child.name)
            else:
                visit(child, prefix, cls)

    visit(tree, "", None)
    return out


def _violations() -> list[str]:
    found: list[str] = []
    for path in _modules():
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        limit = MAX_CLI_LINES if rel == "cli.py" else MAX_MODULE_LINES
        if lines > limit and (rel, "") not in ALLOWED:
            found.append(f"{rel}: {lines} lines (limit {limit})")
        for name, node, cls in _functions(ast.parse(text)):
            if (rel, name) in ALLOWED or (rel, "") in ALLOWED:
                continue
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {name}: {length} lines (limit {MAX_FUNCTION_LINES})")
            n = _params(node)
            if n > MAX_PARAMETERS:
                what = "Block method" if cls == "Block" else "function"
                found.append(f"{rel}:{node.lineno} {name}: {what} with {n} parameters (limit {MAX_PARAMETERS})")
    return found


def test_the_source_keeps_the_house_limits() -> None:
    found = _violations()
    assert not found, "over the house limits:\n" + "\n".join(found)


def test_the_walk_counts_what_it_should() -> None:
    """The checker itself: a long function, a wide one and a wide Block method are each found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(
        f"def long():\n{body}\n\n"
        "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n\n"
        "class Block:\n    def forward(self, a, b, c, d, e, f, g, h, *, i):\n        pass\n"
        "    def fine(self, a, b, c, d, e, f, g, h):\n        pass\n"
    )
    got = {name: (node.end_lineno - node.lineno + 1, _params(node), cls) for name, node, cls in _functions(tree)}  # type: ignore[operator]
    assert got["long"][0] == MAX_FUNCTION_LINES + 1
    assert got["wide"][1] == MAX_PARAMETERS + 1
    assert got["Block.forward"] == (2, MAX_PARAMETERS + 1, "Block")
    assert got["Block.fine"][1] == MAX_PARAMETERS


@pytest.mark.parametrize("rel", [("layout/presets.py", "")])
def test_the_allow_list_names_files_that_exist(rel: tuple[str, str]) -> None:
    assert (SRC / rel[0]).exists()
