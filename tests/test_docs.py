"""The Python names and package paths the docs point at exist.

Every dotted `gpt2.` / `minlora.` name in README.md and docs/*.md (in backticks or code blocks)
resolves, every `gpt2/...` / `minlora/...` path there exists, and every gpt2 / minlora import
line of their ```python blocks runs: a moved or renamed module or function fails here, not in a
reader's hands.
CHANGELOG.md is left out: its entries name what the code was called then.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
PACKAGES = ("gpt2", "minlora")

# A dotted name not glued to a path or a longer word (`train_gpt2.py`, `runs/gpt2.x`); a trailing
# sentence dot is allowed, a dot followed by more of a word is not.
NAME = re.compile(r"(?<![\w./-])(?:gpt2|minlora)(?:\.[A-Za-z_]\w*)+(?![\w/-]|\.[\w/-])")
# An inline code span: no backtick inside, never across a blank line.
SPAN = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")
# A path inside the packages (`gpt2/model/gpt.py`, `gpt2/recipes/*.yaml`), not one that merely
# contains gpt2 (`~/.cache/gpt2/...`, `runs/gpt2/...`).
PATH = re.compile(r"(?<![\w./~-])(?:gpt2|minlora)/[\w/.*-]*[\w*]")
FENCE = re.compile(r"^\s*(```|~~~)\s*(\w*)")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "toml", "txt", "sh", "bin", "npy", "safetensors", "gguf"}
# Dotted words that are not Python: GGUF metadata keys (docs/deploy.md).
NOT_PYTHON = {"gpt2.context_length"}


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def scan(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[tuple[int, str]]]:
    """(line, x) for the dotted names and the repo paths in code spans and blocks, and for the
    import statements of python blocks.
    """
    chunks: list[tuple[int, str]] = []  # (first line, code): each code block line, each span
    imports: list[tuple[int, str]] = []
    prose = []  # the text with fenced lines blanked, so spans keep their line numbers
    fence, pending, pending_line = None, "", 0
    for number, line in enumerate(text.split("\n"), 1):
        opening = FENCE.match(line)
        prose.append("" if fence is not None or opening else line)
        if fence is None:
            fence = (opening.group(2) or "text") if opening else None
            continue
        if opening and not opening.group(2):
            fence = None
            continue
        chunks.append((number, line))
        code = line.strip()
        if fence == "python" and (pending or code.startswith(("import ", "from "))):
            pending, pending_line = pending + code + "\n", pending_line or number
            if pending.count("(") == pending.count(")") and not code.endswith("\\"):
                imports.append((pending_line, pending))
                pending, pending_line = "", 0
    joined = "\n".join(prose)
    chunks += [(_line(joined, span.start(1)), span.group(1)) for span in SPAN.finditer(joined)]

    def found(pattern: re.Pattern) -> list[tuple[int, str]]:
        return sorted(
            (n + chunk.count("\n", 0, m.start()), m.group()) for n, chunk in chunks for m in pattern.finditer(chunk)
        )

    names = [
        (n, name) for n, name in found(NAME) if name.rsplit(".", 1)[1] not in FILE_SUFFIXES and name not in NOT_PYTHON
    ]
    return names, found(PATH), imports


def resolve(name: str) -> str | None:
    """None if `name` exists: the longest importable module prefix, then attributes; else why not."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # no such module: try a shorter prefix
            return f"importing {module_name} failed: {e!r}"
        for j, attr in enumerate(parts[i:], i):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:j])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def run_import(statement: str) -> str | None:
    """None if the import runs (or is not of gpt2 / minlora); else the error."""
    tree = ast.parse(statement)
    node = tree.body[0]
    modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    if not any(m.split(".")[0] in PACKAGES for m in modules):
        return None  # other projects' names (torch, transformers, peft, llama_cpp) are theirs to keep
    try:
        exec(compile(tree, "<docs>", "exec"), {})
    except ImportError as e:
        return repr(e)
    return None


def path_missing(path: str) -> str | None:
    """None if the repo path (or glob) exists; else why not."""
    exists = any(REPO_ROOT.glob(path)) if "*" in path else (REPO_ROOT / path).exists()
    return None if exists else "no such file or folder"


def _problems() -> tuple[list[str], list[int]]:
    problems, counts = [], [0, 0, 0]
    for doc in DOCS:
        where = doc.relative_to(REPO_ROOT)
        found = scan(doc.read_text(encoding="utf-8"))
        counts = [c + len(f) for c, f in zip(counts, found)]
        for items, check in zip(found, (resolve, path_missing, run_import)):
            problems += [f"{where}:{line}: {item.strip()!r}: {why}" for line, item in items if (why := check(item))]
    return problems, counts


def test_names_paths_and_imports_in_docs_exist():
    problems, counts = _problems()
    assert not problems, f"{len(problems)} stale names in the docs:\n" + "\n".join(problems)
    # the scan found the docs' names, paths and imports (an empty scan would pass vacuously)
    assert counts[0] > 50 and counts[1] > 10 and counts[2] > 5, counts


def test_scan_finds_names_and_skips_paths_and_commands():
    text = "\n".join(
        [
            "See `gpt2.GPT` and `gpt2 train`, `gpt2/model/gpt.py`, `train_gpt2.py`, `gpt2.py`, `gpt2.context_length`.",
            "A span over two lines: `resolve(x) ->",
            "gpt2.nope.thing` ends here; gpt2.Unquoted is prose, `~/.cache/gpt2/x` is not ours.",
            "```python",
            "from gpt2 import (",
            "    GPT,",
            "    Missing,",
            ")",
            "import torch",
            "x = minlora.add_lora(model)  # then gpt2.Trainer.",
            "```",
            "```bash",
            "python -m gpt2 train --model gpt2 --out runs/gpt2.x --config gpt2/recipes/*.yaml minlora/nope.py",
            "```",
        ]
    )
    names, paths, imports = scan(text)
    assert names == [(1, "gpt2.GPT"), (3, "gpt2.nope.thing"), (10, "gpt2.Trainer"), (10, "minlora.add_lora")]
    assert [resolve(name) for _, name in names] == [None, "gpt2 has no attribute 'nope'", None, None]
    assert paths == [(1, "gpt2/model/gpt.py"), (13, "gpt2/recipes/*.yaml"), (13, "minlora/nope.py")]
    assert [path_missing(path) for _, path in paths] == [None, None, "no such file or folder"]
    assert imports == [(5, "from gpt2 import (\nGPT,\nMissing,\n)\n"), (9, "import torch\n")]
    assert "Missing" in run_import(imports[0][1]) and run_import(imports[1][1]) is None
