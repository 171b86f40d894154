"""Architecture: gpt2's modules import each other one way only (no import cycles)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "gpt2"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_modules(node: ast.AST) -> set[str]:
    """gpt2 modules named by one import statement (``from .x import``, ``from . import x``,
    ``from gpt2.x import``, ``import gpt2.x``)."""
    found = set()
    if isinstance(node, ast.ImportFrom):
        if node.level == 1 and node.module:  # from .x import y
            found.add(node.module.split(".")[0])
        elif node.level == 1:  # from . import x, y  (x may be a module or a name of __init__)
            found |= {a.name if a.name in MODULES else "__init__" for a in node.names}
        elif node.level == 0 and node.module and node.module.split(".")[0] == "gpt2":
            parts = node.module.split(".")
            found.add(parts[1] if len(parts) > 1 else "__init__")
    elif isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "gpt2":
                found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def _top_level_imports(module: str) -> set[str]:
    """What ``module`` imports when it is imported: module-level statements (also inside a
    top-level ``try`` / ``if``), not ``if TYPE_CHECKING:`` blocks, not imports inside functions."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            else:
                found.update(_imported_modules(node))

    visit(tree.body)
    return found - {module}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_module_level_imports_are_acyclic():
    graph = {m: _top_level_imports(m) for m in MODULES}
    assert graph["model"] >= {"generate", "hf", "config"}  # the parser sees real imports
    cycle = _find_cycle(graph)
    assert cycle is None, f"gpt2 modules import each other in a circle: {' -> '.join(cycle)}"


def test_model_generate_hf_depend_one_way():
    """model -> generate and model -> hf; neither imports model when it is imported."""
    assert "model" not in _top_level_imports("generate")
    assert "model" not in _top_level_imports("hf")
    # The pure conversion sits below hf: it imports neither hf nor model, even inside functions.
    assert "hf_convert" in _top_level_imports("hf")
    convert = ast.parse((PACKAGE / "hf_convert.py").read_text(encoding="utf-8"))
    assert not {"hf", "model"} & set().union(*(_imported_modules(n) for n in ast.walk(convert)))
    # generate needs no model at all, not even inside its functions: it works on any GPT-like
    # object (the type is imported for type checkers only).
    tree = ast.parse((PACKAGE / "generate.py").read_text(encoding="utf-8"))
    runtime = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            node.body = []
    for node in ast.walk(tree):
        runtime |= _imported_modules(node)
    assert "model" not in runtime


def test_model_generate_hf_each_import_alone():
    """Each imported first, in a fresh set of gpt2 modules with gpt2/__init__.py not run (it
    imports everything, which would hide a module that imports only when another came first)."""
    code = f"""
import importlib, sys, types
for name in ("generate", "hf_convert", "hf", "model"):
    for key in [k for k in sys.modules if k == "gpt2" or k.startswith("gpt2.")]:
        del sys.modules[key]
    package = types.ModuleType("gpt2")
    package.__path__ = [{str(PACKAGE)!r}]
    package.__version__ = "0"
    sys.modules["gpt2"] = package
    importlib.import_module("gpt2." + name)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
