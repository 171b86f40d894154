"""Every command's --help, rendered at 80 and 120 columns, reads well: each flag
has a description, defaults show as typed (no shell quoting, no empty ``(default: )``), no sentence
is broken mid-line, and no source comment or stale claim shows.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from gpt2.cli import COMMANDS, main
from gpt2.cli.layers import option_fields

WIDTHS = (80, 120)
# Flags whose text comes from a file gpt2.cli does not own, until that file gives it.
# The values the help of these flags attributes to GPT-3: as --help shows a default, as the help writes it.
GPT3 = {"--max-lr": ("0.0006", "6e-4"), "--weight-decay": ("0.1", "0.1")}


class Entry:
    """One flag of a help box: its name, and its help as the lines of the help column."""

    def __init__(self, flags: str, width: int) -> None:
        self.name = re.findall(r"--[\w.-]+", flags)[0]
        # the help column's width, once the column is known
        self.width = width
        self.lines: list[str] = []

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.lines).split())

    @property
    def default(self) -> str | None:
        match = re.search(r"\(default: (.*)\)$", self.text)
        return match and match[1]

    @property
    def description(self) -> str:
        return re.sub(r"\(default: .*\)$", "", self.text).strip()


def entries(text: str) -> list[Entry]:
    """The flags of every box of a --help text: lines ``│ --flag META   help │``, the help going on
    in the lines below, indented to its column.
    """
    found: list[Entry] = []
    for line in text.splitlines():
        if not line.startswith("│ "):
            continue
        inner = line[2:-2]
        if inner.startswith("-"):
            flags, _, help_text = inner.partition("  ")
            found.append(Entry(flags, len(inner)))
            if help_text.strip():
                found[-1].width = len(help_text.lstrip())
                found[-1].lines.append(help_text.strip())
        elif found and inner.startswith("  ") and inner.strip():
            found[-1].width = len(inner) - (len(inner) - len(inner.lstrip()))
            found[-1].lines.append(inner.strip())
    return found


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, int], str]:
    """Every command's --help at each width (with --device cpu where a command has it: the CPU
    recipe's defaults on any machine).
    """
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for columns in WIDTHS:
            # tyro (rich) takes the terminal's width from $COLUMNS
            patch.setenv("COLUMNS", str(columns))
            for name, cmd in COMMANDS.items():
                argv = [name, "--help"]
                if "device" in option_fields(cmd.options):
                    argv += ["--device", "cpu"]
                out[name, columns] = terminal_output(argv)
    return out


def terminal_output(argv: list[str]) -> str:
    """What ``gpt2 ARGV`` prints on a UTF-8 terminal (tyro draws its boxes for UTF-8 output only)."""
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    stdout.flush()
    return stdout.buffer.getvalue().decode("utf-8")


def all_entries(helps) -> list[tuple[str, int, Entry]]:
    return [(name, columns, entry) for (name, columns), text in helps.items() for entry in entries(text)]


def test_the_help_parser_finds_every_flag(helps):
    names = {entry.name for name, _, entry in all_entries(helps) if name == "train"}
    assert {"--help", "--recipe", "--max-steps", "--log-to", "--num-samples", "--nproc-per-node"} <= names
    assert all(entry.lines for _, _, entry in all_entries(helps) if entry.name == "--max-steps")


def test_every_flag_has_a_description(helps):
    missing = sorted({f"gpt2 {name} {entry.name}" for name, _, entry in all_entries(helps) if not entry.description})
    assert missing == []


def test_defaults_show_as_typed(helps):
    """No empty ``(default: )`` (an empty list), no shell quoting (``'Hello, I'"'"'m ...'``)."""
    for (name, columns), text in helps.items():
        assert "'\"'\"'" not in text, (name, columns)
        for entry in entries(text):
            assert "(default: )" not in entry.text and not entry.text.endswith("(default:"), (name, entry.name)
    sample = {e.name: e for e in entries(helps["sample", 120])}
    assert sample["--prompt"].default == '"Hello, I\'m a language model,"'
    train = {e.name: e for e in entries(helps["train", 120])}
    assert train["--betas"].default == "0.9 0.95" and train["--prompt"].default == "ROMEO:"
    assert train["--log-to"].text.endswith("always written.")


def test_no_sentence_is_broken_mid_line(helps):
    """A help line is full: its next line's first word would not have fit on it (a docstring's own
    line breaks showed as early breaks, mid-sentence), and the description is not indented.
    """
    for (name, columns), text in helps.items():
        description = text.split("\n\n", 1)[1].split("╭")[0]
        assert not re.search(r"^[ \t]+\S", description, re.M), (name, columns, description)
        for entry in entries(text):
            for line, after in zip(entry.lines, entry.lines[1:]):
                fits = len(line) + 1 + len(after.split()[0]) <= entry.width
                assert not fits, (name, columns, entry.name, line, after)


def test_no_source_comments_or_stale_claims(helps):
    for (name, columns), text in helps.items():
        assert "target_types" not in text and "no flag" not in text, (name, columns)
    assert "GGUF" in terminal_output(["--help"])
    stale = set()
    for _, _, entry in all_entries(helps):
        # "GPT-3's value" next to a recipe's other default, without saying which value GPT-3's is
        shown, written = GPT3.get(entry.name, (None, None))
        if shown and "GPT-3" in entry.text and entry.default != shown and written not in entry.text:
            stale.add(entry.name)
        if "[plot] extra" in entry.text:
            stale.add(entry.name)
    assert stale == set()


def test_bench_says_why_the_compile_rung_is_skipped(capsys):
    """It said "compile disabled (CPU default: --compile)": the reason and the flag read as one."""
    code = main(["bench", "--device", "cpu", "--rungs", "compile", "--steps", "1", "--warmup", "0", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "compile" in out
    assert "CPU default: --compile" not in out and "compiling on a CPU is slow (--compile times it)" in out


def test_a_fields_end_of_line_comment_after_non_ascii_text_is_its_whole_help():
    from gpt2.cli.layers import _own_field_help

    source = 'class Options:\n    arrow: str = "→→→→"  # the help text\n'
    assert _own_field_help(source) == {"arrow": "the help text"}
