"""Private PyTorch names are used only in the compat modules (gpt2/torch_compat.py, minlora/_torch_compat.py),
so a torch upgrade has one place per package to check; and the helpers of gpt2/torch_compat.py work.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2 import torch_compat

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("gpt2", "minlora")
# a private torch name: torch._x (not a dunder such as torch.__version__) or torch.ops, at any depth
PRIVATE = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\.(?:_(?!_)\w*|ops\b)")
# private attributes of torch's objects, which no module path reveals
PRIVATE_ATTRIBUTES = {"_orig_mod", "_compiled_call_impl"}
# Uses that wait for their owner's change (remove each entry once its file goes through gpt2.torch_compat).
PENDING: set[tuple[str, str]] = set()


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to torch modules or objects: ``F`` -> ``torch.nn.functional``."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` of an attribute chain rooted at a name bound to torch, the alias spelled out."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _documentation(tree: ast.AST) -> set[int]:
    """The string statements (docstrings): prose, not uses."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every private torch name in code: attribute chains, imports, and strings
    (a module looked up by name) other than docstrings. Comments are not code.
    """
    tree = ast.parse(source)
    aliases, prose = _aliases(tree), _documentation(tree)
    uses = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [_dotted(node, aliases) or ""]
            if node.attr in PRIVATE_ATTRIBUTES:
                names.append(f".{node.attr}")
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            names = PRIVATE.findall(node.value)
            if node.value in PRIVATE_ATTRIBUTES:
                # getattr(module, "_orig_mod")
                names.append(f".{node.value}")
        for name in names:
            match = PRIVATE.match(name)
            if name.startswith("."):
                uses.append((node.lineno, name))
            elif match:
                # the private part: torch._dynamo of torch._dynamo.reset, and of torch._dynamo itself
                uses.append((node.lineno, match.group(0)))
    return sorted(set(uses))


def test_private_torch_names_only_in_compat_modules():
    """Any new private use goes through gpt2/torch_compat.py or minlora/_torch_compat.py, with a comment
    saying why the public API does not do and the torch versions it was checked on.
    """
    offenders = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "compat" in path.name:
                continue
            relative = path.relative_to(ROOT).as_posix()
            for line, name in private_uses(path.read_text(encoding="utf-8")):
                if (relative, name) not in PENDING:
                    offenders.append(f"{relative}:{line}: {name}")
    assert not offenders, "private torch names outside the compat modules:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\ntorch._int_mm(a, b)", [(2, "torch._int_mm")]),
        ("import torch\nx = torch.ops.aten.mm", [(2, "torch.ops")]),
        ("import torch.nn.functional as F\nF._canonical_mask(m)", [(2, "torch.nn.functional._canonical_mask")]),
        (
            "from torch.nn.utils import parametrize\nparametrize._cache_enabled",
            [(2, "torch.nn.utils.parametrize._cache_enabled")],
        ),
        ("import torch._dynamo", [(1, "torch._dynamo")]),
        ("from torch import _int_mm", [(1, "torch._int_mm")]),
        ("import sys\nsys.modules.get('torch._dynamo.eval_frame')", [(2, "torch._dynamo")]),
        ("m = model._orig_mod", [(1, "._orig_mod")]),
        ("m = model._compiled_call_impl", [(1, "._compiled_call_impl")]),
        ("m = getattr(model, '_compiled_call_impl', None)", [(1, "._compiled_call_impl")]),
        # not uses: a dunder, public names, prose, a module's own private names, other libraries'
        ("import torch\nv = torch.__version__\ny = torch.nn.functional.softmax(x, -1)", []),
        ('"""Uses torch._int_mm (see gpt2.torch_compat)."""\n# torch._softmax was here', []),
        ("import numpy as np\nnp._x\nself._kept\n_orig = 'a torch user'\nk.startswith('_orig_mod.')", []),
    ],
)
def test_the_scan_finds_private_names(source, expected):
    assert private_uses(source) == expected


def test_int8_matmul_sums_int8_products_exactly_through_onednn():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (64, 48), dtype=torch.int8, generator=g)
    # (q.T, scale): pack_int8's form where torch has no fbgemm, summed by torch._int_mm in int32
    product = torch_compat.int8_matmul(a.float(), (b, torch.ones(48)))
    assert torch.equal(product.long(), a.long() @ b.long())


def test_uncompiled_and_unwrap_compiled():
    module = torch.nn.Linear(4, 4)
    assert torch_compat.unwrap_compiled(module) is module and torch_compat.uncompiled(module) is module
    # a module of one's own with an attribute of that name is not a wrapper
    module._orig_mod = torch.nn.Identity()
    assert torch_compat.unwrap_compiled(module) is module
    del module._orig_mod
    wrapped = torch.compile(module, backend="eager")
    assert wrapped is not module
    assert torch_compat.unwrap_compiled(wrapped) is module and torch_compat.uncompiled(wrapped) is module
    in_place = torch.nn.Linear(4, 4)
    in_place.compile(backend="eager")
    assert torch_compat.unwrap_compiled(in_place) is in_place
    assert torch_compat.uncompiled(in_place) == in_place.forward
    x = torch.randn(2, 4)
    torch.testing.assert_close(torch_compat.uncompiled(in_place)(x), in_place(x))


def test_starting_the_package_imports_neither_fsdp_nor_dtensor_nor_dcp():
    # They cost ~1.3 s of every start (gpt2 --help, every command); the package imports them where it uses them.
    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
    code = (
        "import sys, gpt2, gpt2.cli.train, gpt2.cli.sample, gpt2.cli.evaluate, minlora; "
        f"print([name for name in {heavy!r} if name in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert not torch_compat.is_fsdp_module(torch.nn.Linear(2, 2))
    assert not torch_compat.is_dtensor(torch.zeros(2))
