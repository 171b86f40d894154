"""Ctrl-C on a multi-process run: every rank stops quietly (exit 130, one line, no traceback);
and the steps a 2-process run took equal a 1-process run of the same global batch.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the launcher and every
worker. The tests start the run in a new session and signal that group the same way. Each
launch of 2 workers costs several seconds of interpreter start-up, so the `--nproc-per-node`
run is started once and serves both the Ctrl-C test and the 1-process comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpt2.cli import main

REPO = Path(__file__).resolve().parents[1]
# A constant learning rate (no warmup, min_lr = max_lr): the first steps do not depend on
# --max-steps, so a run stopped by Ctrl-C compares with a short run step for step.
SAME_RUN = [
    "--total-batch-size",
    "128",
    "--seed",
    "11",
    "--warmup-steps",
    "0",
    "--max-lr",
    "1e-3",
    "--min-lr",
    "1e-3",
    "--precision",
    "fp32",
]


def train_args(shakespeare_file: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--max-steps",
        str(max_steps),
        "--val-fraction",
        "0",
        "--eval-interval",
        "0",
        "--num-samples",
        "0",
        "--no-progress",
        "--no-plot",
        "--device",
        "cpu",
        "--log-interval",
        "1",
        "--data",
        str(shakespeare_file),
        "--out-dir",
        str(out),
        *extra,
    ]


def interrupt_after_step_2(launcher: list[str], shakespeare_file: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_out, log_err = out.parent / "stdout.txt", out.parent / "stderr.txt"
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(
            [*launcher, *train_args(shakespeare_file, out, 100000, *extra)],
            cwd=REPO,
            env=env,
            stdout=fo,
            stderr=fe,
            start_new_session=True,
        )
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


@pytest.fixture(scope="module")
def nproc_run(tmp_path_factory, shakespeare_file) -> tuple[int, str, str, Path]:
    """`gpt2 train --nproc-per-node 2`, stopped by Ctrl-C after step 2."""
    out = tmp_path_factory.mktemp("nproc") / "run"
    code, stdout, stderr = interrupt_after_step_2(
        [sys.executable, "-m", "gpt2"], shakespeare_file, out, "--nproc-per-node", "2", *SAME_RUN
    )
    return code, stdout, stderr, out


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_with_nproc_per_node_is_one_line_and_exit_130(nproc_run):
    code, stdout, stderr, _ = nproc_run
    assert "2 process(es)" in stdout
    assert code == 130, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr
    assert [line for line in stderr.splitlines() if line.strip()] == ["gpt2 train: interrupted"]


@pytest.mark.slow
@pytest.mark.dist
def test_two_process_cli_run_equals_one_process(nproc_run, shakespeare_file, tmp_path):
    """2 gloo processes x 1 micro-step and 1 process x 2 micro-steps: the same 128-token global
    batch, the same seed, the same losses. The workers get the launcher's resolved options as a
    config file (gpt2.launch), so this covers more than plain torchrun, whose ranks parse the
    same flags (started below and in test_examples)."""
    code, stdout, _, out = nproc_run
    assert "2 process(es), 1 micro-step(s)" in stdout
    assert main(train_args(shakespeare_file, tmp_path / "single", 2, *SAME_RUN)) == 0
    two, one = losses(out)[:2], losses(tmp_path / "single")
    assert len(two) == len(one) == 2
    # Only the summation order differs (all-reduce vs local accumulation).
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_under_torchrun_workers_exit_quietly(tmp_path, shakespeare_file):
    """Under plain torchrun the workers stop with one line; the only traceback left is the one
    torchrun's own agent prints for its SignalException (not ours to change; see gpt2.launch)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gpt2"]
    code, stdout, stderr = interrupt_after_step_2(launcher, shakespeare_file, tmp_path / "run")
    assert "2 process(es)" in stdout
    assert stderr.count("gpt2 train: interrupted") == 1  # rank 0 says it, once
    assert stderr.count("Traceback") <= 1 and ("Traceback" not in stderr or "SignalException" in stderr)
    assert code != 0
