"""Stop signals: Ctrl-C (SIGINT), SIGTERM and SIGHUP end a run at a step boundary on every rank,
with a checkpoint, the run lock released, one line saying how to resume, and exit code 128 + the
signal; `--resume auto` then continues to the same losses as an uninterrupted run. Also: the
steps a 2-process run took equal a 1-process run of the same global batch.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the launcher and every
worker. The tests start the run in a new session and signal that group the same way; a
scheduler's SIGTERM goes to the launcher only (Kubernetes signals PID 1), which forwards it. Each
launch of 2 workers costs several seconds of interpreter start-up, so each `--nproc-per-node`
run serves several checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import signal_after_step

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
    # each process draws its own dropout masks: the shakespeare recipe's dropout would make the losses differ
    "--dropout",
    "0",
]


def train_args(data: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
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
        str(data),
        "--out-dir",
        str(out),
        *extra,
    ]


def interrupt_after_step_2(
    launcher: list[str], data: Path, out: Path, *extra: str, sig: int = signal.SIGINT, group: bool = True
) -> tuple[int, str, str]:
    """Start a long run, send ``sig`` once step 2 is logged (to the process group, as a
    terminal's Ctrl-C does, or with ``group=False`` to the launcher only, as a scheduler does).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_out, log_err = out.parent / "stdout.txt", out.parent / "stderr.txt"
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(
            [*launcher, *train_args(data, out, 100000, *extra)],
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
            (os.killpg if group else os.kill)(proc.pid, sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log_out.read_text(), log_err.read_text()


@pytest.fixture(scope="module")
def shakespeare_tokens(tmp_path_factory, shakespeare_file) -> Path:
    """The 64 KB slice's GPT-2 tokens in a .npy file (what `--data` reads of the text itself): every
    process these tests start would otherwise load the tokenizer and encode the text (a second or
    so each).
    """
    from gpt2.data.sources import text_tokens

    path = tmp_path_factory.mktemp("tokens") / "shakespeare.npy"
    np.save(path, text_tokens(shakespeare_file))
    return path


@pytest.fixture(scope="module")
def nproc_run(tmp_path_factory, shakespeare_tokens) -> tuple[int, str, str, Path]:
    """`gpt2 train --nproc-per-node 2`, stopped by Ctrl-C after step 2."""
    out = tmp_path_factory.mktemp("nproc") / "run"
    code, stdout, stderr = interrupt_after_step_2(
        [sys.executable, "-m", "gpt2"], shakespeare_tokens, out, "--nproc-per-node", "2", *SAME_RUN
    )
    return code, stdout, stderr, out


def stop_line(stderr: str, prog: str = "gpt2 train") -> str:
    """The one line a stopped run writes (nothing else on stderr)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: interrupted by "), stderr
    return lines[0]


def check_stopped(stderr: str, out: Path, signame: str) -> tuple[int, list[str]]:
    """The line names the signal, the step, its checkpoint (which exists) and a resume command;
    the lock is released. Returns the step and the resume command's arguments after `gpt2`.
    """
    line = stop_line(stderr)
    match = re.search(rf"interrupted by {signame} after step (\d+); checkpoint (\S+); resume with: (.+)$", line)
    assert match, line
    step, checkpoint, command = int(match[1]), Path(match[2]), shlex.split(match[3])
    assert step >= 2 and checkpoint == out / "checkpoints" / f"step_{step:06d}" and checkpoint.is_dir()
    assert command[:2] == ["gpt2", "train"] and command[-2:] == ["--resume", "auto"]
    assert not (out / "run.lock").exists()
    return step, command[1:]


def resume(command: list[str], max_steps: int) -> list[str]:
    """The printed resume command, with a finite --max-steps (the LR is constant: see SAME_RUN)."""
    i = command.index("--max-steps")
    return [*command[: i + 1], str(max_steps), *command[i + 2 :]]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_with_nproc_per_node_is_one_line_and_exit_130(nproc_run):
    """Both ranks stop after the same step, rank 0 saves it, both leave the process group
    together: no gloo abort ("terminate called without an active exception"), no traceback.
    """
    code, stdout, stderr, out = nproc_run
    assert "2 process(es)" in stdout
    assert code == 130, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr and "terminate called" not in stderr
    step, command = check_stopped(stderr, out, "SIGINT")
    assert "--nproc-per-node" in command  # the launcher's own command line, not the workers'
    assert len(losses(out)) == step  # every rank stopped after that step, none ran ahead


@pytest.mark.slow
@pytest.mark.dist
def test_two_process_cli_run_equals_one_process(nproc_run, shakespeare_tokens, tmp_path):
    """2 gloo processes x 1 micro-step and 1 process x 2 micro-steps: the same 128-token global
    batch, the same seed, the same losses. The workers get the launcher's resolved options as a
    config file (gpt2.launch), so this covers more than plain torchrun, whose ranks parse the
    same flags (started below and in test_examples).
    """
    code, stdout, _, out = nproc_run
    assert "2 process(es), 1 micro-step(s)" in stdout
    assert main(train_args(shakespeare_tokens, tmp_path / "single", 2, *SAME_RUN)) == 0
    two, one = losses(out)[:2], losses(tmp_path / "single")
    assert len(two) == len(one) == 2
    # Only the summation order differs (all-reduce vs local accumulation).
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_under_torchrun_workers_exit_quietly(tmp_path, shakespeare_tokens):
    """Under plain torchrun the workers stop with one line; the only traceback left is the one
    torchrun's own agent prints for its SignalException (not ours to change; see gpt2.launch).
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gpt2"]
    code, stdout, stderr = interrupt_after_step_2(launcher, shakespeare_tokens, tmp_path / "run")
    assert "2 process(es)" in stdout
    assert stderr.count("gpt2 train: interrupted") == 1  # rank 0 says it, once
    assert stderr.count("Traceback") <= 1 and ("Traceback" not in stderr or "SignalException" in stderr)
    assert code != 0


def test_sigterm_checkpoints_and_resume_equals_an_uninterrupted_run(tmp_path, shakespeare_tokens):
    """One process, SIGTERM (what SLURM and Kubernetes send): exit 143, a checkpoint at the step
    boundary; the printed resume command continues to the losses of a run never stopped.
    """
    out = tmp_path / "run"
    code, _, stderr = interrupt_after_step_2(
        [sys.executable, "-m", "gpt2"], shakespeare_tokens, out, *SAME_RUN, sig=signal.SIGTERM
    )
    assert code == 143, stderr
    step, command = check_stopped(stderr, out, "SIGTERM")
    assert main(resume(command, step + 2)) == 0
    assert main(train_args(shakespeare_tokens, tmp_path / "whole", step + 2, *SAME_RUN)) == 0
    assert losses(out) == losses(tmp_path / "whole")  # bit for bit on CPU


def test_sighup_stops_like_ctrl_c_with_exit_129(tmp_path, shakespeare_tokens, capsys, monkeypatch, keep_sigint):
    """SIGHUP after step 2 of a run in this process (signals from other processes: the tests
    around): exit 129, one line, the checkpoint, the lock released.
    """
    out = tmp_path / "run"
    signal_after_step(monkeypatch, 2, signal.SIGHUP)
    code = main(train_args(shakespeare_tokens, out, 100000))
    stderr = capsys.readouterr().err
    assert code == 129, stderr
    check_stopped(stderr, out, "SIGHUP")


@pytest.mark.slow
@pytest.mark.dist
def test_sigterm_to_the_launcher_stops_every_rank_and_resumes(tmp_path, shakespeare_tokens):
    """SIGTERM to `gpt2 train --nproc-per-node 2` alone (as Kubernetes sends it): the launcher
    forwards it, both ranks agree on the stop step, exit 143; the resumed 2-process run ends
    where a 1-process run of the same global batch does (the same steps; see the test above).
    """
    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "gpt2"]
    code, _, stderr = interrupt_after_step_2(
        launcher, shakespeare_tokens, out, "--nproc-per-node", "2", *SAME_RUN, sig=signal.SIGTERM, group=False
    )
    assert code == 143, stderr
    step, command = check_stopped(stderr, out, "SIGTERM")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run([*launcher, *resume(command, step + 2)], cwd=REPO, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert main(train_args(shakespeare_tokens, tmp_path / "one", step + 2, *SAME_RUN)) == 0
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(tmp_path / "one")), rtol=1e-5, atol=1e-6)


def test_a_signal_during_a_save_lets_it_complete_then_stops(tmp_path, monkeypatch):
    """In-process: SIGTERM arrives while the step-2 checkpoint is being written. The save
    completes (intact, loadable), fit() raises TrainingInterrupted at that step, the handlers
    are restored afterwards, and resume='auto' continues from the checkpoint.
    """
    from gpt2 import GPT, GPTConfig, TrainConfig
    from gpt2.train import checkpoint as ckpt
    from gpt2.train.recovery import TrainingInterrupted
    from gpt2.train.trainer import Trainer

    real_save = ckpt.save_checkpoint

    def save_while_signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # delivered now, in the middle of the save
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", save_while_signalled)
    TINY = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    before = signal.getsignal(signal.SIGTERM)
    config = TrainConfig(
        micro_batch_size=2, seq_len=16, max_steps=6, checkpoint_interval=2, out_dir=str(tmp_path), progress=False
    )
    tokens = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with pytest.raises(TrainingInterrupted) as info, Trainer(GPT(TINY), config, tokens) as t:
        t.fit()
    assert info.value.signum == signal.SIGTERM and info.value.step == 2
    assert info.value.checkpoint == tmp_path / "checkpoints" / "step_000002"
    assert signal.getsignal(signal.SIGTERM) is before and not (tmp_path / "run.lock").exists()
    monkeypatch.undo()
    resumed = Trainer(GPT(TINY), dataclasses.replace(config, resume="auto"), tokens, sinks=[])
    with resumed:
        assert resumed.step == 2 and len(resumed.fit()) == 4
