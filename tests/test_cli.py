"""The command line (gpt2.cli / gpt2.jobs): every subcommand end to end in a tiny config,
option precedence, --resume auto, and clear errors (exit code 2, no traceback) for bad input.

Most tests call ``gpt2.cli.main`` in-process (no interpreter start-up per call); one runs the
installed ``gpt2`` entry point. The example scripts themselves run in tests/test_examples.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2.cli import COMMANDS, main
from gpt2.model.generate import stream_text
from gpt2.model.gpt import GPT

REPO = Path(__file__).resolve().parents[1]

HELLASWAG = [
    {
        "ctx": "ROMEO: I will",
        "endings": ["go to the house.", "fly to the moon of cheese.", "xyz qqq", "the the the"],
        "label": 0,
    },
    {
        "ctx_a": "JULIET:",
        "ctx_b": "O Romeo,",
        "endings": ["Romeo, wherefore art thou Romeo?", "banana", "1 2 3", "!!!"],
        "label": 0,
    },
    {
        "ctx": "First Citizen:",
        "endings": ["Before we proceed any further, hear me speak.", "ok", "no", "yes"],
        "label": "0",
    },
]

# A 2-layer, 32-wide model on 32-token sequences: a few hundred ms per step on a CPU.
TINY_TRAIN = [
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "4",
    "--warmup-steps",
    "1",
    "--eval-interval",
    "2",
    "--eval-steps",
    "2",
    "--final-eval-batches",
    "3",
    "--num-samples",
    "1",
    "--max-new-tokens",
    "8",
    "--no-progress",
    "--log-interval",
    "1",
]


def write_hellaswag(path: Path) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in HELLASWAG))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def recipe(name: str, on_cuda: bool) -> dict:
    """The values a recipe file sets (what the tests compare with, instead of copying them)."""
    import yaml

    from gpt2.cli.layers import recipe_path

    return yaml.safe_load(recipe_path(name, on_cuda).read_text())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", autouse=True)
def _small_shakespeare(small_shakespeare):
    """`--data shakespeare` reads a 64 KB slice here: the runs are a few steps long."""


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, str]:
    """A 4-step tiny run of `gpt2 train` on Tiny Shakespeare with HellaSwag every 2 steps, and
    its console output; shared by the tests below.
    """
    if not os.environ.get("GPT2_TINY_SHAKESPEARE"):
        pytest.skip("Tiny Shakespeare not available offline (../shared/data)")
    out = tmp_path_factory.mktemp("run") / "shakespeare"
    hellaswag = write_hellaswag(out.parent / "hellaswag_val.jsonl")
    stdout = io.StringIO()
    # The library's INFO lines on stdout, as the command line shows them (under pytest the root
    # logger has pytest's handlers, so main() leaves logging alone).
    handler, root = logging.StreamHandler(stdout), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    with contextlib.redirect_stdout(stdout), contextlib.ExitStack() as restore:
        restore.callback(root.setLevel, level)
        restore.callback(root.removeHandler, handler)
        code = main(
            [
                "train",
                *TINY_TRAIN,
                "--max-steps",
                "4",
                "--checkpoint-interval",
                "2",
                "--out-dir",
                str(out),
                "--hellaswag",
                str(hellaswag),
                "--hellaswag-interval",
                "2",
            ]
        )
    assert code == 0
    return out, stdout.getvalue()


@pytest.fixture(scope="module")
def trained(trained_run) -> Path:
    return trained_run[0]


# --------------------------------------------------------------------------- help and errors
def test_top_level_help_and_unknown_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in COMMANDS:
        assert f"  {name} " in out
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "unknown command 'frobnicate'" in err
    assert run(capsys)[0] == 2  # no command: help on stdout, usage error


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(capsys, name):
    code, out, _ = run(capsys, name, "--help")
    assert code == 0
    assert out.startswith(f"usage: gpt2 {name}") and "--config FILE" in out and "--print-config" in out


def test_help_comes_from_the_dataclasses(capsys):
    """Every TrainConfig field is a flag, with its comment as help and the recipe's value as default."""
    import dataclasses

    from gpt2 import TrainConfig

    _, out, _ = run(capsys, "train", "--help", "--device", "cpu")
    text = " ".join(out.replace("│", " ").split())
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    # the default shown is the CPU recipe's, not TrainConfig's
    recipe_lr = float(recipe("shakespeare", on_cuda=False)["max_lr"])
    assert recipe_lr != TrainConfig().max_lr and f"(default: {recipe_lr:g})" in text
    assert "--recipe NAME|FILE" in text and "(default: shakespeare)" in text  # the recipe in use
    _, out, _ = run(capsys, "finetune", "--help", "--device", "cpu")
    assert "--lora.rank" in out and "--lora.alpha" in out
    assert "target-types" not in out  # LoRAConfig.target_types holds classes: no flag, not shown
    _, out, _ = run(capsys, "export", "--help")
    text = " ".join(out.replace("│", " ").split())
    assert (
        "None = $GPT2_TOKENIZER_DIR, else the tokenizer's cache (default: None)" in text
        and "(default: $GPT2" not in text
    )  # one default


def test_help_shows_an_example_scripts_defaults(capsys):
    """run_command(defaults=...) (how examples/*.py set theirs) sets the defaults --help shows."""
    from gpt2.cli import run_command

    assert run_command("prepare", ["--help"], prog="prep.py", defaults={"out_dir": "data/mine", "num_workers": 3}) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert text.startswith("usage: prep.py") and "(default: data/mine)" in text and "(default: 3)" in text


def test_bad_flags_exit_2_with_one_line(capsys):
    code, _, err = run(capsys, "train", "--bogus-flag")
    assert code == 2 and "--bogus-flag" in err
    code, _, err = run(capsys, "train", "--max-steps", "many")
    assert code == 2 and "many" in err
    code, _, err = run(capsys, "train", "--precision", "fp8")
    assert code == 2 and "fp8" in err
    # Values the library rejects (TrainConfig validation): its message in one line, no traceback.
    for argv, message in [
        (["--max-steps", "2", "--warmup-steps", "5"], "warmup_steps (5) exceeds"),
        (["--max-lr", "nan"], "max_lr must be"),
        (["--lora.rank", "0"], "LoRAConfig.rank must be"),
        # checked before training, not at the sample or the final evaluation after it
        (["--temperature", "nan"], "generate.temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "generate.temperature must be a finite number >= 0"),
        (["--final-eval-batches", "0"], "--final-eval-batches must be >= 1"),
    ]:
        command, common = ("finetune", []) if argv[0].startswith("--lora") else ("train", TINY_TRAIN)
        code, _, err = run(capsys, command, *common, *argv)
        assert code == 2 and message in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_short_run_scales_the_recipe_warmup(capsys):
    """The recipe's warmup (20 of 200 steps) shrinks with --max-steps; an explicit one is kept."""
    cmd = COMMANDS["train"]
    options = cmd.parse(["--max-steps", "10", "--device", "cpu"], prog="gpt2 train")
    assert options.train.max_steps == 10 and options.train.warmup_steps == 1
    options = cmd.parse(["--max-steps", "10", "--warmup-steps", "4", "--device", "cpu"], prog="gpt2 train")
    assert options.train.warmup_steps == 4


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--weight-decay", "nan", "TrainConfig.weight_decay must be a finite number >= 0, got nan"),
        ("--grad-clip", "inf", "TrainConfig.grad_clip must be a finite number"),
        ("--max-lr", "0", "TrainConfig.max_lr must be a finite number > 0"),
        ("--dropout", "1.5", "GPTConfig.dropout must be a finite number in [0, 1)"),
    ],
)
def test_library_errors_are_one_line(capsys, flag, value, words):
    """The library's own message (flags are its field names), after the command's name."""
    code, _, err = run(capsys, "train", *TINY_TRAIN, flag, value, "--device", "cpu")
    assert code == 2 and err.startswith(f"gpt2 train: error: {words}"), err
    assert len(err.strip().splitlines()) == 1


def test_nproc_per_node_checks_options_before_starting_processes(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    # a bad value or a missing file: one line from the launcher, not one per rank
    for extra, words in (
        (["--weight-decay", "nan"], "weight_decay must be"),
        (["--data", str(tmp_path / "nope.txt")], "does not exist"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
    ):
        code, _, err = run(capsys, "train", *TINY_TRAIN, "--nproc-per-node", "2", "--device", "cpu", *extra)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_default_warmup_scales_with_a_short_run(capsys, tmp_path):
    if not os.environ.get("GPT2_TINY_SHAKESPEARE"):
        pytest.skip("Tiny Shakespeare not available offline (../shared/data)")
    cmd = COMMANDS["train"]

    def warmup(*argv: str) -> int:
        return cmd.parse([*argv, "--device", "cpu"], prog="gpt2 train").train.warmup_steps

    # the recipe's warmup keeps its share of a shorter run (never more than the recipe's) unless given
    import yaml

    from gpt2.cli.layers import RECIPE_DIR

    recipe = yaml.safe_load((RECIPE_DIR / "shakespeare-cpu.yaml").read_text())
    planned, recipe_warmup = recipe["max_steps"], recipe["warmup_steps"]
    assert recipe_warmup > 5  # the case below needs a warmup longer than a 5-step run
    for steps in (5, planned // 2, planned * 2):
        assert warmup("--max-steps", str(steps)) == min(recipe_warmup, recipe_warmup * steps // planned)
    assert warmup("--max-steps", "5") < 5 and warmup("--max-steps", str(planned * 2)) == recipe_warmup
    assert warmup("--max-steps", "5", "--warmup-steps", "4") == 4
    with pytest.raises(ValueError, match="exceeds max_steps"):  # an explicit value stays strict
        warmup("--max-steps", "5", "--warmup-steps", "7")
    cfg = tmp_path / "run.json"
    cfg.write_text('{"warmup_steps": 7}')  # a config file's value is the user's too
    with pytest.raises(ValueError, match="exceeds max_steps"):
        warmup("--config", str(cfg), "--max-steps", "5")
    # a short run with the default warmup trains; an explicit impossible warmup is still an error
    tiny = [a for a in TINY_TRAIN if a != "--warmup-steps"]
    tiny.remove("1")  # the value of --warmup-steps
    text = tmp_path / "input.txt"
    text.write_text(Path(os.environ["GPT2_TINY_SHAKESPEARE"]).read_text(encoding="utf-8")[:20000], encoding="utf-8")
    code, _, err = run(
        capsys,
        "train",
        *tiny,
        "--data",
        text,
        "--max-steps",
        "2",
        "--num-samples",
        "0",
        "--eval-interval",
        "0",
        "--out-dir",
        tmp_path / "short",
        "--no-plot",
    )
    assert code == 0, err
    assert [r["step"] for r in read_jsonl(tmp_path / "short" / "metrics.jsonl")] == [1, 2]


def test_missing_files_are_clear_errors(capsys, tmp_path, trained):
    missing = tmp_path / "missing"
    cases = [
        (["train", *TINY_TRAIN, "--data", missing / "text.txt"], "does not exist"),
        (["finetune", "--init", missing], "neither an existing directory"),
        (["sample", "--model", missing], "neither an existing directory"),
        (["sample", "--model", trained, "--adapter", missing], "adapter"),
        (["eval", "--model", trained, "--data", missing / "val.bin"], "does not exist"),
        (["eval", "--model", trained, "--hellaswag", missing / "hs.jsonl"], "does not exist"),
        (["export", "--model", trained], "nothing to export"),
        (["finetune", "--init", trained, "--lora.include-lm-head", "--merge-export", tmp_path], "ties the LM head"),
        (["train", "--config", missing / "cfg.yaml"], "config file"),
        (["prepare", "--input", missing / "a.txt", "--out-dir", tmp_path / "shards"], "does not exist"),
    ]
    # a HellaSwag row that cannot be scored: refused before training (it stopped the run at the first score)
    bad_hs = tmp_path / "hs.jsonl"
    bad_hs.write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 7}) + "\n")
    cases.append(
        (["train", *TINY_TRAIN, "--hellaswag", bad_hs, "--out-dir", tmp_path / "hs"], "hs.jsonl:1: 'label' must be")
    )
    if not torch.cuda.is_available():  # was a bare AssertionError from torch.cuda
        cases.append((["bench", "--device", "cuda", "--rungs", "fp32"], "CUDA is not available; use device='cpu'"))
    for argv, message in cases:
        code, _, err = run(capsys, *argv)
        assert code == 2, (argv, err)
        assert message in err and "Traceback" not in err, (argv, err)


def test_installed_entry_point(tmp_path):
    """The real entry point, started once: the console script declared in pyproject.toml, the one
    installed beside this interpreter (not whatever `gpt2` comes first on PATH: the venv may not
    be activated); `python -m gpt2` where it is not installed (the dist tests start that one too).
    Exit code 2 and no traceback on a bad value.
    """
    bindir = Path(sys.executable).parent
    script = next((p for p in (bindir / "gpt2", bindir / "gpt2.exe") if p.is_file()), None)
    launcher = [str(script)] if script is not None else [sys.executable, "-m", "gpt2"]
    result = subprocess.run(
        [*launcher, "eval", "--model", str(tmp_path / "nope"), "--data", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("gpt2 eval: error:") and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- configuration
def test_option_precedence_recipe_script_file_flags(tmp_path):
    cmd = COMMANDS["train"]
    cfg = tmp_path / "run.yaml"
    # YAML 1.1 reads 6e-4 as a string: it must still become a float.
    cfg.write_text("max_steps: 7\nmax-lr: 6e-4\ncompile: false\n")
    options = cmd.parse(
        ["--config", str(cfg), "--max-steps", "9", "--device", "cpu"],
        prog="gpt2 train",
        defaults={"warmup_steps": 3},
    )
    train = options.train
    assert train.max_steps == 9  # the flag beats the file
    assert train.max_lr == pytest.approx(6e-4) and isinstance(train.max_lr, float)  # file beats recipe
    assert train.compile is False
    assert train.warmup_steps == 3  # the script's default beats the recipe's 20
    cpu, gpu = recipe("shakespeare", on_cuda=False), recipe("shakespeare", on_cuda=True)
    assert (options.shape.model, train.seq_len) == (cpu["model"], cpu["seq_len"])  # the recipe's CPU values
    assert cpu["model"] != gpu["model"]
    assert cmd.parse(["--device", "cuda"], prog="gpt2 train").shape.model == gpu["model"]  # ... and its CUDA ones
    # A recipe named in a config file (JSON is YAML too).
    cfg_json = tmp_path / "run.json"
    cfg_json.write_text(json.dumps({"recipe": "gpt2-124m-fineweb", "micro_batch_size": 2}))
    options = cmd.parse(["--config", str(cfg_json), "--device", "cpu"], prog="gpt2 train")
    train = options.train
    fineweb = recipe("gpt2-124m-fineweb", on_cuda=False)
    assert (train.total_batch_size, train.warmup_steps, train.max_steps) == tuple(
        fineweb[k] for k in ("total_batch_size", "warmup_steps", "max_steps")
    )
    assert train.micro_batch_size == 2 != fineweb["micro_batch_size"]  # the file beats the recipe
    assert options.hellaswag == "auto" and train.resume == "auto"


def test_recipe_files_and_print_config_round_trip(tmp_path, capsys):
    """--print-config writes a file that --config reads back to the same options; a recipe can be a path."""
    code, out, _ = run(
        capsys,
        "finetune",
        "--device",
        "cpu",
        "--print-config",
        "--lora.rank",
        "4",
        "--lora.target-modules",
        "attn.c_attn",
        "mlp.c_fc",
        "-n",
        "3",
        "--max-steps",
        "7",
    )
    assert code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    cmd = COMMANDS["finetune"]
    again = cmd.parse(["--config", str(printed)], prog="gpt2 finetune")
    assert again.lora.rank == 4 and again.lora.target_modules == ("attn.c_attn", "mlp.c_fc")
    assert again.sampling.num_samples == 3 and again.train.max_steps == 7
    code, out2, _ = run(capsys, "finetune", "--config", printed, "--print-config")
    assert out2.splitlines()[1:] == out.splitlines()[1:]
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: tiny\nmax_steps: 5\nwarmup_steps: 0\n")
    options = COMMANDS["train"].parse(["--recipe", str(recipe)], prog="gpt2 train")
    assert options.shape.model == "tiny" and options.train.max_steps == 5 and options.train.seq_len == 1024


def test_config_file_errors(tmp_path, capsys):
    cases = {
        "a.yaml": ("max_stepz: 3\n", "unknown option 'max_stepz'"),
        "b.yaml": ("max_steps: many\n", "max_steps: expected an integer, got 'many'"),
        "c.yaml": ("max_steps: 2.5\n", "max_steps: expected an integer, got 2.5"),
        "d.yaml": ("- 1\n- 2\n", "must hold a mapping"),
        "e.json": ("{not json", "not valid YAML"),
        "f.yaml": ("precision: fp8\n", "expected one of auto, fp32, tf32, bf16, fp16, got 'fp8'"),
        "g.yaml": ("compile: perhaps\n", "expected True or False, got 'perhaps'"),
        "h.yaml": ("max_lr: .nan\n", "max_lr must be"),
        "i.yaml": ("max_steps: [1, 2]\n", "expected an integer, got [1, 2]"),
        "j.yaml": ("print_config: true\n", "unknown option 'print_config'"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        code, _, err = run(capsys, "train", "--config", path, "--device", "cpu")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)


# --------------------------------------------------------------------------- the commands
def test_train_writes_what_it_promises(trained_run):
    trained, stdout = trained_run
    # the console: step lines, HellaSwag, the final validation loss, then the sample
    assert "step 4 | loss" in stdout and "hellaswag acc_norm" in stdout
    assert stdout.index("step 4 | loss") < stdout.index("val loss") < stdout.index("--- sample 1/1 ---")
    records = read_jsonl(trained / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert [r["step"] for r in records if r.get("val_loss") is not None] == [2, 4]
    # HellaSwag runs inside fit() and its scores join the step records
    assert [r["step"] for r in records if "hellaswag_acc_norm" in r] == [2, 4]
    results = json.loads((trained / "results.json").read_text())
    assert results["step"] == 4 and math.isfinite(results["val_loss"]) and results["val_tokens"] == 3 * 4 * 32
    assert results["val_loss"] < 11.0  # below uniform, ln(50257) = 10.8
    assert results["perplexity"] == pytest.approx(math.exp(results["val_loss"]))
    assert results["hellaswag"]["n"] == 3 and results["hellaswag"]["step"] == 4
    assert len(results["samples"]) == 1 and results["samples"][0].startswith("ROMEO:")
    assert (trained / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (trained / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]


def test_eval_matches_the_training_run(trained, tmp_path, capsys):
    """`gpt2 eval` on the same held-out tokens gives the loss the training run reported."""
    hs = write_hellaswag(tmp_path / "hs.jsonl")
    out = tmp_path / "eval.json"
    code, stdout, err = run(
        capsys,
        "eval",
        "--model",
        trained,
        "--data",
        "shakespeare",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--max-batches",
        "3",
        "--hellaswag",
        hs,
        "--output",
        out,
    )
    assert code == 0, err
    result = json.loads(out.read_text())
    reported = json.loads((trained / "results.json").read_text())
    assert result["val_loss"] == pytest.approx(reported["val_loss"], rel=1e-5)
    assert result["tokens"] == reported["val_tokens"]
    assert result["hellaswag_n"] == 3 and 0 <= result["hellaswag_acc_norm"] <= 1
    assert "val loss" in stdout and "hellaswag acc_norm" in stdout


def test_eval_of_a_token_file_scores_the_part_training_held_out(trained, tmp_path, capsys, shared_data):
    """`gpt2 train --data x.npy` holds out its end, and its printed `gpt2 eval --data x.npy` scored the
    whole file (mostly trained on); a NaN or negative --val-fraction silently scored it all too.
    """
    from gpt2.data.sources import split_tokens, text_tokens

    tokens = text_tokens(shared_data / "tinyshakespeare.txt")[:20_000]
    np.save(tmp_path / "x.npy", tokens)
    held_out = len(split_tokens(tokens, 0.1, "x")[1])
    argv = ["eval", "--model", trained, "--data", tmp_path / "x.npy", "--seq-len", "32", "--batch-size", "4"]
    code, stdout, err = run(capsys, *argv, "--output", tmp_path / "r.json")
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["tokens"] == (held_out - 1) // (4 * 32) * 4 * 32
    for bad in ("nan", "-0.5"):
        code, _, err = run(capsys, *argv, "--val-fraction", bad)
        assert code == 2 and "--val-fraction must be in [0, 1)" in err, err
    # and `gpt2 train --data docs.jsonl` read its JSON as text
    rows = REPO / "examples" / "data" / "instructions.jsonl"
    code, _, err = run(capsys, "train", *TINY_TRAIN, "--data", rows)
    assert code == 2 and "--data: a .jsonl file is no text" in err, err
    code, _, err = run(capsys, "train", *TINY_TRAIN, "--val-data", rows)
    assert code == 2 and "--val-data: a .jsonl file is no text" in err, err
    code, _, err = run(capsys, "finetune", "--init", trained, "--data", "shakespeare", "--val-data", rows)
    assert code == 2 and "--val-data: a .jsonl goes with a .jsonl --data" in err, err
    code, _, err = run(capsys, "finetune", "--init", trained, "--data", rows, "--val-data", "shakespeare")
    assert code == 2 and "--val-data: a .jsonl goes with a .jsonl --data" in err, err


def test_eval_on_a_shard_directory(trained, tmp_path, capsys, shared_data, monkeypatch):
    # the progress bar shows on a terminal only: be one
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    from gpt2.data import write_shards

    shards = tmp_path / "shards"
    docs = (shared_data / "tinyshakespeare.txt").read_text().split("\n\n")[:300]
    write_shards(docs, shards, prefix="tiny", shard_size=2000, progress=False)
    code, stdout, err = run(
        capsys, "eval", "--model", trained, "--data", shards, "--seq-len", "32", "--batch-size", "4"
    )
    assert code == 0, err
    # one full pass over the val shard (2000 tokens): 15 batches of 4 x 32 (+1 token for the targets)
    assert f"{15 * 4 * 32:,} tokens" in stdout
    assert "/15 [" in err  # the progress bar knows its total
    # the loader's count of one pass is what one pass reads, over shards of several lengths
    from gpt2.data.loader import TokenLoader, one_pass

    for split, batch_size, seq_len in ((None, 4, 32), ("train", 3, 50), ("train", 1, 7)):
        loader = TokenLoader(shards, batch_size, seq_len, split=split)
        assert loader.num_shards > 1 and loader.batches_per_pass == len(list(one_pass(loader)))


def test_sample_is_reproducible_and_streams(trained, capsys):
    argv = ["sample", "--model", trained, "--prompt", "ROMEO:", "-n", "2", "--max-new-tokens", "6", "--seed", "7"]
    code, first, err = run(capsys, *argv)
    assert code == 0, err
    assert "--- sample 2/2 ---" in first and first.count("ROMEO:") == 2
    assert run(capsys, *argv)[1] == first  # same seed, same text
    assert run(capsys, *argv[:-1], "8")[1] != first


def test_sample_compile_on_the_cpu_uses_inductors_cpp_wrapper(trained, capsys, monkeypatch):
    """`gpt2 sample --compile` on the CPU compiles with Inductor's C++ wrapper (the faster decoding there); the
    compile itself is replaced by a recorder: a real one takes 20-40 s, tests/test_inductor.py compiles generation.
    """
    from gpt2.cli import sample as sample_cli

    calls = []

    def recording_compile(model, **kwargs):
        calls.append(kwargs)
        return model

    monkeypatch.setattr(sample_cli.torch, "compile", recording_compile)
    argv = ["sample", "--model", trained, "--prompt", "ROMEO:", "-n", "1", "--max-new-tokens", "4", "--seed", "7"]
    code, _, err = run(capsys, *argv, "--compile")
    assert code == 0, err
    assert calls == [{"options": {"cpp_wrapper": True}}]
    assert sample_cli.inductor_options(torch.nn.Linear(2, 2, device="meta")) is None


def test_stream_text_pieces_add_up_to_the_generated_text(trained):
    from gpt2.model.tokenizer import get_tokenizer

    model = GPT.from_pretrained(str(trained))
    tok = get_tokenizer()
    pieces = list(stream_text(model, "ROMEO:", 12, generator=torch.Generator().manual_seed(3), stop_at_eot=False))
    ids = model.generate(torch.tensor([tok.encode("ROMEO:")]), 12, generator=torch.Generator().manual_seed(3))
    assert len(pieces) > 1  # text arrives piece by piece, not at the end
    assert "ROMEO:" + "".join(pieces) == tok.decode(ids[0])
    assert all("\ufffd" not in p for p in pieces[:-1])


def test_export_writes_a_transformers_directory(trained, tmp_path, capsys):

    out = tmp_path / "hf"
    code, stdout, err = run(capsys, "export", "--model", trained, "--out", out)
    assert code == 0, err
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    x = torch.randint(0, 50257, (2, 16))
    ours = GPT.from_pretrained(str(trained))(x)[0]
    exported = GPT.from_pretrained(out)(x)[0]
    torch.testing.assert_close(exported, ours)


def test_finetune_from_a_training_run_in_fp16(trained, tmp_path, capsys, caplog):
    """`gpt2 finetune --init <run dir>`: LoRA on our own checkpoint, fp16 with loss scaling; the
    adapter then samples through `gpt2 sample --adapter`.
    """
    out = tmp_path / "lora"
    code, stdout, err = run(
        capsys,
        "finetune",
        "--init",
        trained,
        "--precision",
        "fp16",
        "--max-steps",
        "2",
        "--warmup-steps",
        "1",
        "--seq-len",
        "32",
        "--eval-steps",
        "1",
        "--final-eval-batches",
        "1",
        "--max-new-tokens",
        "4",
        "--out-dir",
        out,
        "--no-progress",
        "--lora.target-modules",
        "attn.c_attn",
    )
    assert code == 0, err
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["loss_scale"] > 0 for r in records)
    from safetensors import safe_open  # the adapter's config is in its file's metadata

    with safe_open(str(out / "adapter" / "adapter.safetensors"), framework="pt") as f:
        config = json.loads(f.metadata()["minlora"])
    assert sorted(config["targets"]) == ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"]
    with caplog.at_level(logging.INFO):
        code, stdout, err = run(
            capsys, "sample", "--model", trained, "--adapter", out / "adapter", "--max-new-tokens", "3", "--seed", "0"
        )
    assert code == 0 and "--- sample 1/1 ---" in stdout, err
    # it says which adapter it applied, and to how many layers (c_attn of 2 blocks)
    applied = [r.getMessage() for r in caplog.records if "applied LoRA adapter" in r.getMessage()]
    assert len(applied) == 1 and str(out / "adapter") in applied[0] and "2 LoRA layers" in applied[0]
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert len(loaded) == 1 and re.search(r"\(\d{1,3}(,\d{3})+ parameters\)", loaded[0])  # 1,634,720
    # an adapter on a checkpoint that holds only adapter weights is refused with a clear message
    code, _, err = run(capsys, "sample", "--model", out, "--max-new-tokens", "3")
    assert code == 2 and "only the trainable (adapter) weights" in err


@pytest.fixture(scope="module")
def trained_hf(trained, tmp_path_factory) -> Path:
    """The tiny run exported as a transformers folder (what `gpt2 finetune --init` usually gets)."""
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", "--model", str(trained), "--out", str(out)]) == 0
    return out


def test_finetune_and_eval_refuse_before_any_work(trained_hf, tmp_path, capsys):
    """Each was accepted, then failed after training or wrote a wrong result."""
    weights = (trained_hf / "model.safetensors").read_bytes()
    finetune = ["finetune", "--init", trained_hf, "--max-steps", "1", "--seq-len", "32", "--out-dir", tmp_path / "run"]
    same = [tmp_path / "same", tmp_path / "x" / ".." / "same"]  # one folder, spelled two ways
    cases = [  # (arguments, a key fact of the one-line error)
        ([*finetune, "--lora.include-embeddings", "--merge-export", tmp_path / "m"], "--lora.include-embeddings"),
        ([*finetune, "--no-save-trainable-only"], "LoRA checkpoints hold the adapter only"),
        ([*finetune, "--merge-export", same[0], "--peft-export", same[1]], "are one folder"),
        ([*finetune, "--merge-export", trained_hf], "the model's own folder"),
        (
            ["eval", "--model", trained_hf, "--data", REPO / "examples" / "data" / "instructions.jsonl"],
            "not plain text",
        ),
    ]
    for argv, message in cases:
        code, _, err = run(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "m").exists() and not (tmp_path / "same").exists()
    assert (trained_hf / "model.safetensors").read_bytes() == weights


def test_finetune_peft_export_names_its_base_as_export_does(trained_hf, tmp_path, capsys):
    run_dir, peft = tmp_path / "run", tmp_path / "peft"
    args = ["--max-steps", "1", "--seq-len", "32", "--final-eval-batches", "1", "--num-samples", "0"]
    code, _, err = run(capsys, "finetune", "--init", trained_hf, *args, "--out-dir", run_dir, "--peft-export", peft)
    assert code == 0, err
    code, _, err = run(
        capsys, "export", "--model", trained_hf, "--adapter", run_dir / "adapter", "--peft-out", tmp_path / "p2"
    )
    assert code == 0, err
    base = json.loads((peft / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(trained_hf.resolve())  # PEFT's AutoPeftModel loads the base from it
    assert base == json.loads((tmp_path / "p2" / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_resume_auto_continues_an_interrupted_run(tmp_path, capsys, shared_data):
    """A run that stopped after step 5 (its last checkpoint: step 4) continues with
    `--resume auto` and ends exactly where the uninterrupted run ends.
    """
    argv = [
        "train",
        *TINY_TRAIN,
        "--max-steps",
        "6",
        "--checkpoint-interval",
        "2",
        "--keep-last-checkpoints",
        "0",
        "--no-plot",
        "--num-samples",
        "0",
    ]
    full = tmp_path / "full"
    assert main([*argv, "--out-dir", str(full)]) == 0
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_000006")  # the crash came before step 6 was saved
    (crashed / "results.json").unlink()
    # metrics.jsonl still holds steps 5 and 6 of the lost future: the resumed run replaces them
    capsys.readouterr()
    assert main([*argv, "--out-dir", str(crashed), "--resume", "auto"]) == 0
    expected = [(r["step"], r["loss"]) for r in read_jsonl(full / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in read_jsonl(crashed / "metrics.jsonl")] == expected
    assert (
        json.loads((crashed / "results.json").read_text())["val_loss"]
        == json.loads((full / "results.json").read_text())["val_loss"]
    )


def test_prepare_text_and_jsonl(tmp_path, capsys):
    from gpt2.data import load_tokens
    from gpt2.model.tokenizer import get_tokenizer

    tok = get_tokenizer()
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time there was a model. " * 40)
    code, out, err = run(
        capsys, "prepare", "--input", text, "--out-dir", tmp_path / "a", "--val-fraction", "0.25", "--no-progress"
    )
    assert code == 0, err
    shards = sorted((tmp_path / "a").glob("*.npy"))
    assert [p.name for p in shards] == ["story_train_000001.npy", "story_val_000000.npy"]
    n = 1 + len(tok.encode_ordinary(text.read_text()))
    assert sum(len(load_tokens(p)) for p in shards) == n
    assert len(load_tokens(shards[1])) == round(n * 0.25)
    folder = tmp_path / "texts"  # an empty file in a folder adds nothing (it added a lone <|endoftext|>)
    folder.mkdir()
    (folder / "empty.txt").write_text("")
    (folder / "story.txt").write_text(text.read_text())
    assert run(capsys, "prepare", "--input", folder, "--out-dir", tmp_path / "e", "--no-progress")[0] == 0
    assert sum(len(load_tokens(p)) for p in (tmp_path / "e").glob("*.npy")) == n

    rows = [{"body": f"document number {i} " * (i + 1)} for i in range(6)] + [{"body": ""}]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run(
        capsys,
        "prepare",
        "--input",
        jsonl,
        "--text-field",
        "body",
        "--out-dir",
        tmp_path / "b",
        "--shard-size",
        "20",
        "--prefix",
        "docs",
        "--no-progress",
    )
    assert code == 0, err
    total = sum(len(load_tokens(p)) for p in (tmp_path / "b").glob("docs_*.npy"))
    assert total == sum(1 + len(tok.encode_ordinary(r["body"])) for r in rows[:-1])  # no lone EOT for the empty row
    assert (tmp_path / "b" / "docs_val_000000.npy").is_file() and (tmp_path / "b" / "docs_train_000001.npy").is_file()
    # the same again without --overwrite: a clear error instead of mixing old and new shards
    code, _, err = run(
        capsys,
        "prepare",
        "--input",
        jsonl,
        "--text-field",
        "body",
        "--out-dir",
        tmp_path / "b",
        "--shard-size",
        "20",
        "--prefix",
        "docs",
    )
    assert code == 2 and "overwrite" in err
    code, _, err = run(capsys, "prepare", "--input", jsonl, "--text-field", "text", "--out-dir", tmp_path / "c")
    # the row's own fields are listed: the names --text-field can choose from
    assert code == 2 and "string field 'text'" in err and "(fields: ['body'" in err
    code, _, err = run(capsys, "prepare", "--out-dir", tmp_path / "d")
    assert code == 2 and "nothing to tokenise" in err


def test_bench_runs_the_ladder(tmp_path, capsys):
    out = tmp_path / "ladder.json"
    code, stdout, err = run(
        capsys,
        "bench",
        "--device",
        "cpu",
        "--rungs",
        "fp32,bf16",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--json",
        out,
    )
    assert code == 0, err
    assert "rung" in stdout and "fp32" in stdout and "bf16" in stdout
    # one table, not the Trainer's set-up lines once per rung
    assert "training on" not in stdout + err and "AdamW groups" not in stdout + err
    results = json.loads(out.read_text())["results"]
    assert [r["rung"] for r in results] == ["fp32", "bf16"]
    assert all(r["ms_per_step"] > 0 and len(r["repeat_ms"]) == 2 for r in results)


def test_the_resume_line_drops_the_flags_of_a_first_start(monkeypatch):
    """--overwrite in the printed line made it refuse ("choose one"), --resume-weights-only made it
    drop the optimizer state: the way back is the run's own flags with --resume auto.
    """
    from gpt2.cli import _resume_command

    monkeypatch.delenv("GPT2_LAUNCH_ARGV", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = ["--model", "tiny", "--overwrite", "--resume-weights-only", "--resume", "runs/x/checkpoints/step_000002"]
    assert (
        _resume_command("gpt2 train", [*argv, "--max-lr", "1e-3"])
        == "gpt2 train --model tiny --max-lr 1e-3 --resume auto"
    )


def test_a_peft_export_on_a_run_folder_says_how_to_make_a_base_transformers_reads(trained, tmp_path, capsys):
    """PEFT's AutoPeftModel loads base_model_name_or_path with transformers, which cannot read a
    gpt2 run folder: the export says so and how to make one (it failed later, in PEFT).
    """
    import minlora

    model = GPT.from_pretrained(trained)
    minlora.add_lora(model, minlora.LoRAConfig(rank=2))
    minlora.save_adapter(model, tmp_path / "adapter")
    code, out, err = run(
        capsys, "export", "--model", trained, "--adapter", tmp_path / "adapter", "--peft-out", tmp_path / "p"
    )
    assert code == 0, err
    assert f"PEFT's base {trained}" in out and "which transformers cannot load" in out
    # the command that makes a base transformers reads, for this very model
    assert f"gpt2 export --model {shlex.quote(str(trained))} --out DIR" in out


def test_an_adapter_of_another_base_is_refused_unless_allowed(trained, tmp_path, capsys):
    """sample / eval / export take --allow-base-mismatch, the flag the refusal names (before, it named
    only load_adapter's keyword, which these commands had no way to pass).
    """
    import minlora

    model = GPT.from_pretrained(trained)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.add_(0.01)  # another base
    minlora.add_lora(model, minlora.LoRAConfig(rank=2))
    minlora.save_adapter(model, tmp_path / "adapter")
    sample = ["sample", "--model", trained, "--adapter", tmp_path / "adapter", "--max-new-tokens", "2"]
    code, _, err = run(capsys, *sample)
    assert code == 2 and "another base model" in err and "--allow-base-mismatch" in err
    assert run(capsys, *sample, "--allow-base-mismatch")[0] == 0
    export = ["export", "--model", trained, "--adapter", tmp_path / "adapter", "--out", tmp_path / "hf"]
    assert run(capsys, *export)[0] == 2 and not (tmp_path / "hf").exists()
    assert run(capsys, *export, "--allow-base-mismatch")[0] == 0 and (tmp_path / "hf" / "config.json").is_file()
    np.save(tmp_path / "x.npy", np.arange(300, dtype=np.uint16))
    code, _, err = run(
        capsys, "eval", "--model", trained, "--adapter", tmp_path / "adapter", "--data", tmp_path / "x.npy"
    )
    assert code == 2 and "--allow-base-mismatch" in err
