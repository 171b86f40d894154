"""scripts/setup.sh (sourced by run.sh and test.sh): a line per phase, and no second install while
pyproject.toml is unchanged (it reinstalled on every run, silently for minutes, then showed
setuptools' boxed warning). Run against a stand-in python that records pip's calls instead of
installing anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A stand-in for the interpreter: pip calls are recorded, not run; sys.prefix is a folder of the
# test's (the install stamp lives there); setup.sh's import checks (is torch there, is the project
# installed) succeed without importing torch (seconds each); everything else is the real python.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*" >> "$FAKE_LOG"; exit 0; fi
if [ "$1" = "-c" ] && [ "$2" = "import sys; print(sys.prefix)" ]; then echo "$FAKE_PREFIX"; exit 0; fi
if [ "$1" = "-c" ] && { [ "$2" = "import torch" ] || [ "$2" = "import gpt2, minlora" ]; }; then exit 0; fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "prefix").mkdir()
    return root


def _setup(root: Path, extras: str = "dev") -> tuple[str, list[str]]:
    tmp = root.parent
    env = {
        **os.environ,
        "PYTHON": str(tmp / "python"),
        "REAL_PYTHON": sys.executable,
        "FAKE_LOG": str(tmp / "pip.log"),
        "FAKE_PREFIX": str(tmp / "prefix"),
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        ["bash", "-c", f'source scripts/setup.sh "{extras}"'], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    log = tmp / "pip.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return result.stdout + result.stderr, calls


def test_each_phase_says_what_it_does_and_an_unchanged_project_is_not_reinstalled(checkout):
    out, calls = _setup(checkout)
    assert "setup: installing gpt2-minlora[dev]" in out
    assert len(calls) == 1 and ".[dev]" in calls[0]

    out, calls = _setup(checkout)
    assert "nothing to install" in out and len(calls) == 1

    # a changed pyproject.toml: installed again
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    _, calls = _setup(checkout)
    assert len(calls) == 2
