"""What a new user meets on the command line (issues 27 and 30): commands printed for a new shell,
a finished run reported again in seconds, one-line argument errors, resume lines that work, and
one line for a failed write (disk full, read-only folder) that says what is intact.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpt2.cli.train import TrainOptions, print_next_steps


# --------------------------------------------------------------------------- commands for a new shell
def next_programs(capsys, out_dir: Path) -> set[str]:
    """The program each printed "next, try:" command starts."""
    print_next_steps(out_dir, TrainOptions())
    lines = capsys.readouterr().out.split("next, try:")[1].strip().splitlines()
    assert len(lines) == 3, lines
    return {line.split()[0] for line in lines}


def test_next_commands_name_the_programs_of_a_virtual_environment_that_is_not_activated(tmp_path, monkeypatch, capsys):
    """run.sh trains with .venv/bin/python without activating .venv: `gpt2 ...` was not found in a
    new shell. The commands name .venv/bin/gpt2 then (relative to the working directory inside it).
    """
    bindir = tmp_path / ".venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "gpt2").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    run = Path("runs") / "x"
    run.mkdir(parents=True)
    assert next_programs(capsys, run) == {".venv/bin/gpt2"}
    # From another folder: the absolute path.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert next_programs(capsys, tmp_path / run) == {str(bindir / "gpt2")}
    # Activated (its programs on PATH), or no virtual environment: `gpt2` as before.
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin")
    assert next_programs(capsys, tmp_path / run) == {"gpt2"}
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    assert next_programs(capsys, tmp_path / run) == {"gpt2"}
