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
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then [ -z "$FAKE_NO_TORCH" ]; exit; fi
if [ "$1" = "-c" ] && [ "$2" = "import gpt2, minlora" ]; then exit 0; fi
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


def _setup(root: Path, extras: str = "dev", **more_env: str) -> tuple[str, list[str]]:
    tmp = root.parent
    env = {
        **os.environ,
        "FAKE_NO_TORCH": "",
        **more_env,
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


def test_alternating_extras_install_once(checkout):
    """test.sh (dev) and run.sh (no extras) in turn: the dev install serves both."""
    _, calls = _setup(checkout, "")
    assert len(calls) == 1
    _, calls = _setup(checkout, "dev")
    assert len(calls) == 2  # more extras than installed: installed
    for extras in ("", "dev", "", "dev"):
        out, calls = _setup(checkout, extras)
        assert "nothing to install" in out and len(calls) == 2


def _torch_install(checkout, **env: str) -> tuple[str, list[str]]:
    """setup.sh on a machine without torch and without pip settings of its own (no mirror, no wheel folder)."""
    plain = {"FAKE_NO_TORCH": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "", "PIP_EXTRA_INDEX_URL": ""}
    out, calls = _setup(checkout, "dev", PIP_FIND_LINKS="", **plain, **env)
    return out, [call for call in calls if " install torch" in call]


@pytest.fixture
def cpu_index(tmp_path):
    """A local stand-in for PyTorch's CPU wheel index (its torch/ page answers)."""
    import functools
    import http.server
    import threading

    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi"), reason="NVIDIA GPU")
def test_without_a_gpu_torch_comes_from_the_cpu_index_when_it_answers(checkout, cpu_index):
    out, calls = _torch_install(checkout, GPT2_TORCH_CPU_INDEX=cpu_index)
    assert len(calls) == 1 and f"--extra-index-url {cpu_index}" in calls[0]
    assert "the CPU build" in out


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi"), reason="NVIDIA GPU")
def test_without_a_gpu_and_no_cpu_index_it_says_what_it_downloads(checkout, cpu_index):
    # A port nothing listens on: the index does not answer.
    out, calls = _torch_install(checkout, GPT2_TORCH_CPU_INDEX="http://127.0.0.1:9")
    assert len(calls) == 1 and "--extra-index-url" not in calls[0]
    assert "CUDA build with its nvidia-* wheels" in out and "--index-url http://127.0.0.1:9" in out


def test_a_configured_wheel_source_is_used_as_it_is(checkout, cpu_index):
    out, calls = _setup(
        checkout, "dev", FAKE_NO_TORCH="1", PIP_FIND_LINKS="/opt/wheels", GPT2_TORCH_CPU_INDEX=cpu_index
    )
    torch_calls = [call for call in calls if " install torch" in call]
    assert len(torch_calls) == 1 and "--extra-index-url" not in torch_calls[0]
