"""The structure docs/architecture.md promises: layers without import circles, minlora
standing alone, and modules small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 460  # "no module over ~450 lines"


def _modules(package: str) -> dict[str, Path]:
    root = REPO / package
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the same project that ``module`` imports when it is imported: module-level
    statements only (function-level imports and ``if TYPE_CHECKING:`` blocks do not run then)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_package, node)
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` imports module x

    visit(tree.body)
    return {m for m in found if m in known and m != module}


def test_gpt2_modules_import_each_other_without_a_circle():
    modules = _modules("gpt2")
    graph = {m: _top_level_imports(m, p, set(modules)) for m, p in modules.items()}
    # A package's __init__ re-exporting its submodules is not a circle: drop package -> child edges.
    for m, deps in graph.items():
        graph[m] = {d for d in deps if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_graph_builder_sees_a_circle(tmp_path, monkeypatch):
    """The check above can fail: two modules importing each other are found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                              "from . import a\nif TYPE_CHECKING:\n    from .c import h\n")
    (pkg / "c.py").write_text("def h(): pass\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    modules = _modules("pkg")
    assert _top_level_imports("pkg.a", modules["pkg.a"], set(modules)) == {"pkg.b"}
    assert _top_level_imports("pkg.b", modules["pkg.b"], set(modules)) == {"pkg", "pkg.a"}


@pytest.mark.parametrize("package", ["gpt2", "minlora"])
def test_no_module_is_too_long_to_read(package):
    long = {str(p.relative_to(REPO)): n for p in _modules(package).values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job, see docs/architecture.md): {long}"
