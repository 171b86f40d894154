"""What a new user meets on the command line (issues 27 and 30): commands printed for a new shell,
a finished run reported again in seconds, one-line argument errors, resume lines that work, and
one line for a failed write (disk full, read-only folder) that says what is intact.
"""

from __future__ import annotations

import errno
import json
import shlex
import signal
import sys
from pathlib import Path

import pytest

from gpt2.cli import main
from gpt2.cli.train import TrainOptions, print_next_steps

# A 2-layer, 32-wide model on 32-token sequences, 2 steps, no samples: seconds on a CPU.
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "4", "--warmup-steps", "1", "--eval-interval", "0"]
TINY += ["--max-steps", "2", "--checkpoint-interval", "1", "--num-samples", "0", "--no-progress", "--no-plot"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def tiny_run(tmp_path, shakespeare_file, capsys) -> list[str]:
    """The arguments of a finished 2-step `gpt2 train` run in tmp_path/run."""
    argv = ["train", *TINY, "--data", str(shakespeare_file), "--out-dir", str(tmp_path / "run")]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    return argv


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


# --------------------------------------------------------------------------- a finished run again
def test_a_finished_run_started_again_reports_its_results_json(tiny_run, tmp_path, capsys, monkeypatch):
    """run.sh with no arguments resumes runs/shakespeare: a finished run scored its whole validation
    set again (52 s on the CPU recipe) to say what results.json already says.
    """
    import gpt2.cli.common

    results = json.loads((tmp_path / "run" / "results.json").read_text())
    scored = []
    monkeypatch.setattr(gpt2.cli.common, "val_loss", lambda *a, **k: scored.append(1) or {})
    code, out, err = run(capsys, *tiny_run, "--resume", "auto")
    assert code == 0, err
    line = f"already done: {tmp_path / 'run'} reached step 2; val loss {results['val_loss']:.4f} (from results.json)"
    assert line in out and "next, try:" in out and not scored
    # A results.json of another step (or none) is no report of this checkpoint: it is scored as before.
    (tmp_path / "run" / "results.json").write_text(json.dumps({**results, "step": 1}))
    monkeypatch.undo()
    code, out, err = run(capsys, *tiny_run, "--resume", "auto")
    assert code == 0 and "already done" not in out and "val loss" in out, err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["step"] == 2


# --------------------------------------------------------------------------- one-line argument errors
def test_a_mistyped_flag_is_one_line_naming_the_closest(capsys):
    """It was tyro's box of 10-13 lines; now one line on stderr, exit code 2."""
    code, out, err = run(capsys, "train", "--max-step", "10")
    assert (code, out) == (2, "")
    assert (
        err == "gpt2 train: error: --max-step: unknown option; did you mean --max-steps? "
        "(gpt2 train --help lists every option)\n"
    )
    code, _, err = run(capsys, "finetune", "--lora.rnak", "4")
    assert code == 2 and err.startswith(
        "gpt2 finetune: error: --lora.rnak: unknown option; did you mean --lora.rank?"
    ), err
    code, _, err = run(capsys, "eval", "--bogus-flag")
    assert code == 2 and err == "gpt2 eval: error: --bogus-flag: unknown option (gpt2 eval --help lists every option)\n"


@pytest.mark.parametrize(
    "argv,line",
    [
        (["train", "--max-steps", "ten"], "gpt2 train: error: --max-steps: expected an integer, got 'ten'"),
        (["train", "--max_steps", "ten"], "gpt2 train: error: --max-steps: expected an integer, got 'ten'"),
        (["train", "--max-steps"], "gpt2 train: error: --max-steps: expected an integer, got nothing"),
        (["train", "--max-lr", "fast"], "gpt2 train: error: --max-lr: expected a number, got 'fast'"),
        (["train", "--top-k", "all"], "gpt2 train: error: --top-k: expected an integer or None, got 'all'"),
        (
            ["train", "--precision", "fp8"],
            "gpt2 train: error: --precision: expected one of auto, fp32, tf32, bf16, fp16, got 'fp8'",
        ),
        (["train", "--betas", "0.9"], "gpt2 train: error: --betas: expected 2 values, each a number, got '0.9'"),
        (["finetune", "--lora.rank", "x"], "gpt2 finetune: error: --lora.rank: expected an integer, got 'x'"),
        (["sample", "-n", "x"], "gpt2 sample: error: --num-samples: expected an integer, got 'x'"),
        (["train", "--compile", "yes"], "gpt2 train: error: --compile: takes no value, got 'yes'"),
        (
            ["train", "stray"],
            "gpt2 train: error: 'stray': options are given as --name VALUE (gpt2 train --help lists them)",
        ),
    ],
)
def test_a_bad_value_is_one_line(capsys, argv, line):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", line + "\n")


def test_values_that_look_like_flags_are_still_values():
    """The check of the flags reads them as tyro does: a prompt "--- x", a -inf, a -1 are values."""
    from gpt2.cli import COMMANDS

    argv = ["--prompt", "--- x", "--temperature", "-inf", "--top-k", "-1", "--device", "cpu"]
    options = COMMANDS["train"].parse(argv, prog="gpt2 train")
    sampling = options.sampling
    assert (sampling.prompt, sampling.temperature, sampling.top_k) == ("--- x", float("-inf"), -1)


# --------------------------------------------------------------------------- resume lines that work
def test_the_resume_line_works_after_a_config_file_set_overwrite(tmp_path, shakespeare_file, capsys, monkeypatch):
    """The line repeated --config (overwrite: true) with --resume auto, which TrainConfig refuses
    together ("choose one"): it adds --no-overwrite now.
    """
    from gpt2.train import checkpoint as ckpt

    config = tmp_path / "run.yaml"
    config.write_text(f"overwrite: true\nout_dir: {tmp_path / 'run'}\n")
    save = ckpt.save_checkpoint

    def save_then_stop(*args, **kwargs):
        # SIGTERM while step 1's checkpoint is written: the run stops after it
        signal.raise_signal(signal.SIGTERM)
        return save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", save_then_stop)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        code, _, err = run(capsys, "train", *TINY, "--data", shakespeare_file, "--config", config)
    finally:
        # the report ignores further Ctrl-Cs, for a process that is about to exit
        signal.signal(signal.SIGINT, sigint)
    assert code == 128 + signal.SIGTERM, err
    command = shlex.split(err.split("resume with: ")[1])
    assert command[:2] == ["gpt2", "train"] and command[-3:] == ["--no-overwrite", "--resume", "auto"]
    monkeypatch.undo()
    code, out, err = run(capsys, *command[1:])
    assert code == 0 and "val loss" in out, err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["step"] == 2


def test_prepare_refuses_a_negative_number_of_workers(tmp_path, capsys):
    """One text file never started workers: --num-workers -1 went unnoticed."""
    text = tmp_path / "a.txt"
    text.write_text("Once upon a time there was a model. " * 40)
    code, _, err = run(capsys, "prepare", "--input", text, "--out-dir", tmp_path / "s", "--num-workers", "-1")
    assert (code, err) == (2, "gpt2 prepare: error: --num-workers must be >= 0 (0: tokenise in this process), got -1\n")
    assert not (tmp_path / "s").exists()


def test_a_dangling_symlink_out_dir_is_named_as_such(tmp_path, shakespeare_file, capsys):
    """It failed with "cannot lock out_dir ...: File exists: '.../run.lock'"."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    code, _, err = run(capsys, "train", *TINY, "--data", shakespeare_file, "--out-dir", link)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "is a dangling symlink" in err and "nowhere" in err


# --------------------------------------------------------------------------- a failed write
def test_a_full_disk_is_one_line_with_the_intact_checkpoint_and_the_resume_command(
    tmp_path, shakespeare_file, capsys, monkeypatch
):
    """ENOSPC writing results.json after the last step: it was two lines (the error, GPT2_DEBUG) with
    nothing on what survived.
    """
    import gpt2.cli.common

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(gpt2.cli.common, "write_json", full_disk)
    out = tmp_path / "run"
    code, _, err = run(capsys, "train", *TINY, "--data", shakespeare_file, "--out-dir", out)
    assert code == 1 and len(err.splitlines()) == 1, err
    what = "No space left on device; free some space on that disk, or write to another one"
    intact = f"checkpoint {out / 'checkpoints' / 'step_000002'} is intact"
    assert err.startswith(f"gpt2 train: error: {out / 'results.json'}: {what}; {intact}; resume with: gpt2 train "), err
    # The resume command works: the run is complete, results.json written this time.
    monkeypatch.undo()
    code, _, err = run(capsys, *shlex.split(err.split("resume with: ")[1])[1:])
    assert code == 0 and json.loads((out / "results.json").read_text())["step"] == 2, err


def test_a_failed_checkpoint_save_names_the_intact_checkpoint_once(tmp_path, shakespeare_file, capsys, monkeypatch):
    """A failed write of the run (a CheckpointSaveError, a RunOutputError) names the newest intact checkpoint
    itself: the line adds only the resume command (it named the checkpoint a second time).
    """
    from gpt2.train import checkpoint as ckpt

    real_save_weights = ckpt.save_weights

    def save_weights(weights, path):
        # step 2's checkpoint fails writing its weights
        if path.parent.name.startswith(".tmp-step_000002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save_weights(weights, path)

    monkeypatch.setattr(ckpt, "save_weights", save_weights)
    out = tmp_path / "run"
    code, _, err = run(capsys, "train", *TINY, "--data", shakespeare_file, "--out-dir", out)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.count("is intact") == 1 and f"{out / 'checkpoints' / 'step_000001'} is intact" in err, err
    assert "could not save checkpoint step_000002" in err and "; resume with: gpt2 train " in err, err


def test_the_intact_checkpoint_is_the_newest_that_verifies(tiny_run, tmp_path):
    from gpt2.cli.common import intact_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    assert intact_checkpoint(tmp_path / "run") == checkpoints / "step_000002"
    weights = checkpoints / "step_000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert intact_checkpoint(tmp_path / "run") == checkpoints / "step_000001"
    assert intact_checkpoint(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    "error,code,line",
    [
        (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x"), 1, "/mnt/ro/x: Read-only file system; choose a"),
        (PermissionError(errno.EACCES, "Permission denied", "/x"), 2, "/x: Permission denied; choose a folder you"),
        (
            FileNotFoundError(errno.ENOENT, "No such file or directory", "a", None, "b"),
            2,
            "a -> b: No such file or directory; check the path",
        ),
        (
            OSError(errno.ELOOP, "Too many levels of symbolic links", "/l"),
            1,
            "/l: Too many levels of symbolic links; check the path",
        ),
    ],
)
def test_a_failed_read_or_write_names_the_file_and_what_to_do(error, code, line, tmp_path, capsys, monkeypatch):
    """Any command; the exit code is as before (2 for the OSErrors that mean input: a missing file...)."""
    import gpt2.cli.prepare

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(gpt2.cli.prepare, "tokenize_file", fail)
    (tmp_path / "a.txt").write_text("some text")
    result, _, err = run(capsys, "prepare", "--input", tmp_path / "a.txt", "--out-dir", tmp_path / "s")
    assert result == code and err.startswith(f"gpt2 prepare: error: {line}") and len(err.splitlines()) == 1, err


def test_under_torchrun_only_rank_0_reports_a_usage_error(tmp_path, capsys, monkeypatch):
    """torchrun with a missing data folder printed the same one-line error once per rank."""
    missing = str(tmp_path / "no-such-data")
    monkeypatch.setenv("RANK", "1")
    code, _, err = run(capsys, "train", *TINY, "--data", missing, "--out-dir", tmp_path / "run")
    assert (code, err) == (2, "")
    monkeypatch.setenv("RANK", "0")
    code, _, err = run(capsys, "train", *TINY, "--data", missing, "--out-dir", tmp_path / "run")
    assert code == 2 and len(err.splitlines()) == 1 and "no-such-data" in err


@pytest.mark.parametrize(("rank", "shown"), [("0", "an info line\na warning\n"), ("1", "a warning\n")])
def test_under_torchrun_ranks_other_than_0_show_the_librarys_warnings_only(capsys, monkeypatch, rank, shown):
    """The command line's log lines: rank 0 shows the library's INFO lines, the other ranks only its
    warnings (a recovery decision, which each rank logs for itself: tests/test_recovery.py).
    """
    import logging

    from gpt2 import cli

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    library = [logging.getLogger(name) for name in ("gpt2", "minlora")]
    # pytest's own handlers out of the way: the command line leaves a root logger with handlers alone
    root.handlers.clear()
    monkeypatch.setenv("RANK", rank)
    try:
        cli._setup_logging()
        logging.getLogger("gpt2.train.trainer").info("an info line")
        logging.getLogger("gpt2.train.trainer").warning("a warning")
        # another package's INFO line (matplotlib's "generated new fontManager") is not the command's output
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for logger in library:
            logger.setLevel(logging.NOTSET)
    assert capsys.readouterr().out == shown
