"""What the command line makes of its inputs: flags (a nested group's prefix, near-flag suggestions),
YAML files that repeat a key or hold aliases, a memory limit past the machine's memory, and the hints
for an adapter's run folder and a missing FineWeb folder.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated

import pytest
import yaml

from gpt2.cli import main
from gpt2.cli.layers import Flat, Options, dump_yaml, parse

TINY = ["--model", "tiny", "--seq-len", "32", "--warmup-steps", "0", "--eval-interval", "0", "--max-steps", "1"]
TINY += ["--num-samples", "0", "--no-progress", "--no-plot", "--device", "cpu"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@dataclasses.dataclass
class Patience:
    patience: int = 3
    """bad steps in a row"""


@dataclasses.dataclass
class Schedule:
    max_steps: int = 10  # steps in the run
    recovery: Patience = dataclasses.field(default_factory=Patience)


@dataclasses.dataclass
class ScheduleOptions(Options):
    """a command of a test"""

    train: Annotated[Schedule, Flat] = dataclasses.field(default_factory=Schedule)


def test_a_group_inside_a_flat_group_keeps_its_prefix(tmp_path, capsys):
    """TrainConfig's own groups (``recovery``) read as ``--recovery.patience``, in flags, files and --help."""
    options = parse(ScheduleOptions, ["--recovery.patience", "5", "--max-steps", "4"], prog="t")
    assert (options.train.max_steps, options.train.recovery.patience) == (4, 5)
    config = tmp_path / "c.yaml"
    config.write_text(dump_yaml(options, ""))
    assert yaml.safe_load(config.read_text()) == {"max_steps": 4, "recovery": {"patience": 5}}
    assert parse(ScheduleOptions, ["--config", str(config)], prog="t").train == options.train
    with pytest.raises(SystemExit) as e:
        parse(ScheduleOptions, ["--help"], prog="t")
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--recovery.patience INT" in out and "bad steps in a row (default: 3)" in out
    assert "--max-steps INT" in out and "steps in the run (default: 10)" in out
    with pytest.raises(Exception, match="did you mean --recovery.patience"):
        parse(ScheduleOptions, ["--patience", "2"], prog="t")


@pytest.mark.parametrize(
    ("flag", "near"),
    [("--lr", "--max-lr"), ("--steps", "--max-steps"), ("--max-step", "--max-steps?")],
)
def test_a_near_flag_is_suggested(capsys, flag, near):
    """--lr said only "unknown option": a flag holding every word of it is named too."""
    code, _, err = run(capsys, "train", flag, "3")
    assert code == 2 and f"{flag}: unknown option; did you mean " in err and len(err.splitlines()) == 1, err
    assert near in err.split("did you mean ")[1].split("(")[0], err


def test_a_yaml_alias_bomb_under_a_real_option_is_refused_at_once(tmp_path, capsys):
    """Nine levels of nine aliases under log_to: it expanded for minutes; now one line, in well under a second."""
    lines = ["log_to:", "  - &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, 9):
        lines.append(f"  - &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    code, _, err = run(capsys, "train", "--config", bomb, "--device", "cpu")
    assert time.monotonic() - start < 10
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"config file {bomb}: line 3: YAML aliases (*name) are not read" in err


def test_a_key_given_twice_is_refused(tmp_path, capsys):
    """It took the last value silently."""
    config = tmp_path / "twice.yaml"
    config.write_text("max_steps: 5\nseq_len: 32\nmax_steps: 7\n")
    code, _, err = run(capsys, "train", "--config", config, "--device", "cpu")
    assert (
        code == 2 and err == f"gpt2 train: error: config file {config}: line 3: 'max_steps' is given twice; keep one\n"
    )
    config.write_text("lora:\n  rank: 4\n  rank: 8\n")
    code, _, err = run(capsys, "finetune", "--config", config, "--device", "cpu")
    assert code == 2 and "line 3: 'rank' is given twice" in err


def test_a_memory_limit_past_the_machines_memory_is_one_line(tmp_path, capsys, shakespeare_file):
    """9e9 GiB ended in an OverflowError from setrlimit."""
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", shakespeare_file, "--out-dir", out, "--micro-batch-size", "auto"]
    code, _, err = run(capsys, *argv, "--memory-limit-gb", "9e9")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "memory_limit_gb (--memory-limit-gb) must be in (0, " in err and "got 9e+09" in err
    assert "OverflowError" not in err and not out.exists()


def test_an_adapters_run_folder_gets_a_hint(tmp_path, capsys, hf_dir):
    """`--adapter runs/instruct-lora` (gpt2 finetune's run folder) said only that no adapter is there."""
    run_folder = tmp_path / "instruct-lora"
    (run_folder / "adapter").mkdir(parents=True)
    code, _, err = run(capsys, "sample", "--model", hf_dir, "--adapter", run_folder, "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.rstrip().endswith(f"did you mean --adapter {run_folder / 'adapter'}?")


def test_a_missing_fineweb_folder_points_to_the_script_that_writes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "train", "--recipe", "gpt2-124m-fineweb", "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "data/edu_fineweb10B" in err and "python examples/prepare_fineweb.py" in err
