"""Ctrl-C on a multi-process run: every rank stops quietly (exit 130, one line, no traceback).

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the launcher and every
worker. The tests start the run in a new session and signal that group the same way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def text(tmp_path) -> Path:
    if not os.environ.get("GPT2_TINY_SHAKESPEARE") or not os.environ.get("TIKTOKEN_CACHE_DIR"):
        pytest.skip("the offline data in ../shared/data is needed")
    path = tmp_path / "input.txt"
    path.write_text(Path(os.environ["GPT2_TINY_SHAKESPEARE"]).read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return path


def interrupt_after_step_2(launcher: list[str], text: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    args = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "100000",
            "--val-fraction", "0", "--eval-interval", "0", "--num-samples", "0", "--no-progress", "--no-plot",
            "--device", "cpu", "--log-interval", "1", "--data", str(text), "--out-dir", str(out), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    log_out, log_err = out.parent / "stdout.txt", out.parent / "stderr.txt"
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen([*launcher, *args], cwd=REPO, env=env, stdout=fo, stderr=fe, start_new_session=True)
        try:
            deadline = time.time() + 240
            while "step 2 " not in log_out.read_text():
                assert proc.poll() is None, log_err.read_text()
                assert time.time() < deadline, "no step 2 within 240 s"
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log_out.read_text(), log_err.read_text()


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_with_nproc_per_node_is_one_line_and_exit_130(tmp_path, text):
    code, stdout, stderr = interrupt_after_step_2([sys.executable, "-m", "gpt2"], text, tmp_path / "run",
                                                  "--nproc-per-node", "2")
    assert "2 process(es)" in stdout
    assert code == 130, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr
    assert [line for line in stderr.splitlines() if line.strip()] == ["gpt2 train: interrupted"]


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_under_torchrun_workers_exit_quietly(tmp_path, text):
    """Under plain torchrun the workers stop with one line; the only traceback left is the one
    torchrun's own agent prints for its SignalException (not ours to change; see gpt2.launch)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gpt2"]
    code, stdout, stderr = interrupt_after_step_2(launcher, text, tmp_path / "run")
    assert "2 process(es)" in stdout
    assert stderr.count("gpt2 train: interrupted") == 1  # rank 0 says it, once
    assert stderr.count("Traceback") <= 1 and ("Traceback" not in stderr or "SignalException" in stderr)
    assert code != 0
