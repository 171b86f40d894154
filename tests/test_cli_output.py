"""What the command line prints: help within 80 columns that names only what exists, no
BrokenPipeError when the reader stops, a line at a time into a file, and no other package's
log lines (matplotlib's font cache).
"""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2.cli import COMMANDS, main
from gpt2.cli.layers import option_fields

REPO = Path(__file__).resolve().parents[1]


def help_text(name: str, monkeypatch, capsys, columns: int = 80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    argv = [name, "--help"]
    if "device" in option_fields(COMMANDS[name].options):
        argv += ["--device", "cpu"]
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_line_of_help_fits_80_columns(name, monkeypatch, capsys):
    """The descriptions ran to 83-110 characters (tyro wraps only the option boxes)."""
    long = [line for line in help_text(name, monkeypatch, capsys).splitlines() if len(line) > 80]
    assert long == []
    assert main(["--help"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if len(line) > 80] == []


def test_help_names_only_what_exists(monkeypatch, capsys):
    """--max-lr began with a source comment's rule, --recover said "(above)", --instruction named
    gpt2.instruct.TEMPLATE, which does not import.
    """
    texts = {name: help_text(name, monkeypatch, capsys, columns=200) for name in COMMANDS}
    train = " ".join(texts["train"].replace("│", " ").split())
    assert "--max-lr FLOAT peak learning rate" in train
    every = " ".join(texts.values())
    assert "optimizer and schedule" not in every and "(above)" not in every
    names = set(re.findall(r"\b(?:gpt2|minlora)(?:\.\w+)+", every))
    assert "gpt2.data.instruct.TEMPLATE" in names
    for name in names:
        module, _, attribute = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ImportError:
            assert hasattr(importlib.import_module(module), attribute), name


def test_help_into_a_pipe_that_closes_says_nothing():
    """`gpt2 train --help | head` printed a BrokenPipeError traceback."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpt2", "train", "--help", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    # the reader goes before the first line is written (the interpreter takes a second to start)
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1 and err == ""


class Writes(io.BytesIO):
    """A file that remembers each write that reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return super().write(data)


def test_step_lines_reach_a_file_one_at_a_time(tmp_path, monkeypatch, shakespeare_file):
    """With stdout a file, Python wrote the step lines in blocks of 8 KB: a log read nothing for minutes."""
    file = Writes()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(file, encoding="utf-8"))
    argv = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "3"]
    argv += ["--warmup-steps", "0", "--log-interval", "1", "--eval-interval", "0", "--num-samples", "0"]
    argv += ["--no-progress", "--no-plot", "--device", "cpu", "--data", str(shakespeare_file)]
    assert main([*argv, "--out-dir", str(tmp_path / "run")]) == 0
    steps = [write for write in file.writes if write.startswith(b"step ")]
    assert len(steps) == 3 and all(write.count(b"\n") == 1 for write in steps), file.writes


def test_matplotlibs_font_cache_line_is_not_shown(tmp_path):
    """run.sh printed "generated new fontManager" (matplotlib's INFO log) on a fresh machine."""
    code = "from gpt2.cli import _setup_logging; _setup_logging(); import matplotlib.pyplot; print('done')"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLCONFIGDIR": str(tmp_path / "mpl"), "MPLBACKEND": "Agg"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and (tmp_path / "mpl").is_dir(), result.stderr
    assert result.stdout == "done\n" and "fontManager" not in result.stderr
