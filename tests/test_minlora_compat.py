"""The private torch.nn.utils.parametrize names minlora needs exist on this torch, all in one module."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parametrize

from minlora import _torch_compat

MINLORA = Path(__file__).resolve().parents[1] / "minlora"


def test_this_torch_has_every_private_name_minlora_uses():
    missing = _torch_compat.missing_names()
    assert not missing, (
        f"torch {torch.__version__} lacks torch.nn.utils.parametrize.{missing}: minlora's fast forward / class "
        f"swap (minlora/_torch_compat.py) must be adapted to this torch"
    )


def test_private_names_are_used_only_in_the_compat_module():
    """Any new private use must go through minlora/_torch_compat.py, so a torch upgrade has one place to check."""
    offenders = []
    for path in MINLORA.glob("*.py"):
        if path.name == "_torch_compat.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"parametrize\._\w", line):
                offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not offenders, "private parametrize names outside minlora/_torch_compat.py:\n" + "\n".join(offenders)


def test_a_torch_without_the_names_fails_at_import_with_a_clear_message(monkeypatch):
    monkeypatch.delattr(parametrize, "_cache_enabled")
    monkeypatch.delitem(sys.modules, "minlora._torch_compat")
    with pytest.raises(ImportError, match=r"parametrize\._cache_enabled, which torch .* does not have"):
        importlib.import_module("minlora._torch_compat")
    monkeypatch.undo()
    assert importlib.import_module("minlora._torch_compat").missing_names() == []


def test_cache_flag_follows_parametrize_cached():
    assert _torch_compat.parametrize_cache_enabled() is False
    with parametrize.cached():
        assert _torch_compat.parametrize_cache_enabled() is True
    assert _torch_compat.parametrize_cache_enabled() is False


def test_minlora_never_imports_gpt2():
    """minlora stands alone: what is GPT-2-specific reaches it through GPT.peft_adapter_layout()."""
    import ast

    offenders = []
    for path in MINLORA.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            )
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "gpt2"]
    assert not offenders, offenders
