"""The package's structure as tests: the import order reads bottom-up, no folder imports a folder above
it or forms a cycle with another, and a run's file names are spelled in one module."""

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "normlab"
# Bottom to top: a module may import its own level and the levels below it. Foundation modules
# (errors, io, pages, _lazy) depend on nothing above them; the layers follow docs/architecture.md.
LEVELS = [
    {"errors", "_lazy", "_version"},
    {"io", "pages", "settings"},
    {"layout"},
    {"model"},
    {"data", "config"},
    {"runs"},
    {"diagnostics", "hf", "screen"},
    {"train"},
    {"experiments", "doctor"},
    {"evaluation", "recommend"},
    {"cli", "subcommands", "demo", "__main__", "__init__"},
]
RANK = {name: i for i, level in enumerate(LEVELS) for name in level}
# A run directory's and a sweep folder's files: spelled only in normlab/runs/files.py.
RUN_FILES = (
    "metrics.jsonl",
    "probes.jsonl",
    "summary.json",
    "eval.json",
    "eval_log.txt",
    "sweep.db",
    "sweep.toml",
    "checkpoints",
    "summary.md",
    "report.html",
)
# config.json is also a transformers folder's file: the Hugging Face side may name that one.
HF_SIDE = ("hf/", "evaluation/harness.py", "recommend/planning/shape.py")


def _unit(path: Path) -> str:
    """The folder (or top-level module) a source file belongs to."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@functools.cache  # every check below walks the same modules: each is parsed once
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[str, int]]:
    """(unit imported, line) for every normlab import in a file, lazy ones inside functions included."""
    tree = _parse(path)
    package = ["normlab", *path.relative_to(root).parts[:-1]]
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join(package[: len(package) - node.level + 1] + ([module] if module else []))
            if module == "normlab":  # `from normlab import X`: the subpackage X, else the package's top
                names = [f"normlab.{a.name}" if _is_unit(a.name) else "normlab.__init__" for a in node.names]
            elif module.startswith("normlab."):
                names = [module]
        elif isinstance(node, ast.Import):  # a bare `import normlab` runs the package's top, the highest level
            names = [
                a.name if a.name != "normlab" else "normlab.__init__"
                for a in node.names
                if a.name == "normlab" or a.name.startswith("normlab.")
            ]
        found += [(name.split(".")[1], node.lineno) for name in names]
    return found


def _is_unit(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def _edges() -> dict[tuple[str, str], list[str]]:
    edges = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _unit(path)
        for dst, line in _imports(path):
            if dst != src:
                edges[(src, dst)].append(f"{path.relative_to(PACKAGE)}:{line}")
    return edges


def test_every_unit_has_a_level():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")}
    assert units <= set(RANK), f"place these in LEVELS (and docs/architecture.md): {sorted(units - set(RANK))}"


def test_no_import_runs_against_the_layering():
    against = [
        f"{where}: {src} imports {dst}"
        for (src, dst), places in _edges().items()
        for where in places
        if RANK[dst] > RANK[src]
    ]
    assert not against, "\n".join(against)


def test_no_cycle_across_folders():
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in _edges():
        graph[src].add(dst)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    cycles = sorted({tuple(sorted((a, b))) for a in list(graph) for b in graph[a] if a in reachable(b)})
    assert not cycles, f"folders importing each other: {cycles}"


def _module_edges() -> dict[str, set[str]]:
    """Module -> the modules of its own folder it imports (lazy imports inside functions included; a package's
    __init__ re-exports and is left out)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) < 2 or path.name == "__init__.py":
            continue
        folder, me = rel.parts[0], ".".join(rel.with_suffix("").parts)
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if (
                    parts[:2] == ["normlab", folder]
                    and len(parts) > 2
                    and (PACKAGE.joinpath(*parts[1:]).with_suffix(".py")).is_file()
                    and ".".join(parts[1:]) != me
                ):
                    graph[me].add(".".join(parts[1:]))
    return graph


def test_no_cycle_inside_a_folder():
    """One idea per module, in an order: within a folder no two modules reach each other (a function-level
    import hides a cycle from Python, not from this test)."""
    graph = _module_edges()

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    cycles = sorted({tuple(sorted((a, b))) for a in list(graph) for b in graph[a] if a in reachable(b)})
    assert not cycles, f"modules of one folder importing each other (directly or around a loop): {cycles}"


@functools.cache
def _literals(path: Path) -> list[tuple[str, int]]:
    """String constants of a module that are not docstrings."""
    tree = _parse(path)
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        (n.value, n.lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


@pytest.mark.parametrize("name", [*RUN_FILES, "config.json"])
def test_a_run_files_name_is_spelled_in_one_module(name):
    owner = PACKAGE / "runs" / "files.py"
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if path == owner or (name == "config.json" and rel.startswith(HF_SIDE)):
            continue
        spelled += [f"{rel}:{line}" for text, line in _literals(path) if text == name or text.endswith("/" + name)]
    assert not spelled, f"{name!r} spelled outside normlab/runs/files.py: {spelled}"
    assert name in {text for text, _ in _literals(owner)}


def test_the_checks_above_can_fail(tmp_path, monkeypatch):
    """A planted import against the layering and a planted file name are caught (the tests are not vacuous)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.py").write_text('from normlab.train import trainer\nNAME = "metrics.jsonl"\n')
    assert _imports(tmp_path / "model" / "bad.py", tmp_path) == [("train", 1)]
    assert ("metrics.jsonl", 2) in _literals(tmp_path / "model" / "bad.py")
    assert RANK["train"] > RANK["model"]
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "bare.py").write_text("import normlab\nfrom normlab import build_model\n")
    assert _imports(tmp_path / "train" / "bare.py", tmp_path) == [("__init__", 1), ("__init__", 2)]
    assert RANK["__init__"] > RANK["train"]
