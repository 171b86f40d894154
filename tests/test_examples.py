"""The example scripts, run as a user runs them (tiny configurations, offline data).

Each test checks what the script promises: files in the run directory, metrics, samples, an
adapter that loads, a merged model that `transformers` loads with the same logits, shards, a
run that stops cleanly on Ctrl-C, and the 124M recipe under `torchrun` with 2 CPU processes.
Most run in this process, as ``python examples/<name> ...`` would (``__main__``, ``sys.argv``,
its exit code): an interpreter start per run would cost more than the runs (Ctrl-C too: the
signal is raised in this process after step 2). torchrun needs real processes. `gpt2 train`
itself is tested in tests/test_cli.py (what pretrain_shakespeare.py runs; resume is tested there
and in tests/test_trainer.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import runpy
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import signal_after_step

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

HELLASWAG = [
    {"ctx": "ROMEO: I will", "endings": ["go to the house.", "fly to the moon.", "xyz qqq", "the the the"], "label": 0},
    {
        "ctx_a": "JULIET:",
        "ctx_b": "O Romeo,",
        "endings": ["wherefore art thou Romeo?", "banana", "1 2 3", "!!!"],
        "label": 0,
    },
    {
        "ctx": "First Citizen:",
        "endings": ["Before we proceed any further, hear me speak.", "ok", "no", "yes"],
        "label": 0,
    },
]

TINY = [
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "4",
    "--warmup-steps",
    "1",
    "--eval-steps",
    "2",
    "--final-eval-batches",
    "2",
    "--max-new-tokens",
    "8",
    "--no-progress",
    "--log-interval",
    "1",
]


def example(name: str, *args: object) -> subprocess.CompletedProcess:
    """Run examples/<name> in this process, as `python examples/<name> ARGS` would: as __main__,
    with sys.argv set, stdout and stderr captured, the library's INFO log lines on stdout (what
    the command line does), and its exit code.
    """
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(out)
    root, argv = logging.getLogger(), sys.argv
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    sys.argv = [str(EXAMPLES / name), *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        root.removeHandler(handler)
        root.setLevel(level)
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    return result.stdout


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", autouse=True)
def _needs_offline_data(small_shakespeare):
    """The offline data, and `shakespeare` read from a 64 KB slice: the runs are a few steps long."""
    if not os.environ.get("GPT2_TINY_SHAKESPEARE") or not os.environ.get("GPT2_TOKENIZER_DIR"):
        pytest.skip("the offline data in ../shared/data is needed to run the examples")


@pytest.fixture(scope="module")
def hellaswag(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in HELLASWAG))
    return path


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, hf_dir) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("lora") / "run"
    result = example(
        "finetune_lora.py",
        "--init",
        hf_dir,
        "--max-steps",
        "4",
        "--warmup-steps",
        "1",
        "--seq-len",
        "32",
        "--eval-steps",
        "2",
        "--final-eval-batches",
        "2",
        "--max-new-tokens",
        "6",
        "--seed",
        "5",
        "--lora.rank",
        "4",
        "--lora.alpha",
        "8",
        "--out-dir",
        out,
        "--merge-export",
        out / "merged",
        "--peft-export",
        out / "peft",
        "--no-progress",
        "--log-interval",
        "1",
    )
    return out, ok(result)


# --------------------------------------------------------------------------- --help
@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_help(name, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage:")


# --------------------------------------------------------------------------- pretraining
def test_pretrain_interrupted_with_ctrl_c(tmp_path, monkeypatch, keep_sigint):
    """Ctrl-C (SIGINT) stops the run with one line and exit code 130, its checkpoints intact. The
    signal comes after step 2 of the script run in this process (Ctrl-C from a terminal, to every
    process of a run: tests/test_interrupt.py).
    """
    out = tmp_path / "run"
    args = [
        *TINY,
        "--eval-interval",
        "0",
        "--num-samples",
        "0",
        "--checkpoint-interval",
        "2",
        "--keep-last-checkpoints",
        "0",
        "--out-dir",
        out,
        "--no-plot",
        "--max-steps",
        "1000",
    ]
    signal_after_step(monkeypatch, 2, signal.SIGINT)
    result = example("pretrain_shakespeare.py", *args)
    stderr = result.stderr
    assert result.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr
    # the printed way back runs the script by its path (it read "pretrain_shakespeare.py ...")
    resume = shlex.split(stderr.split("resume with: ")[1].strip())
    assert resume[:2] == ["python", str(EXAMPLES / "pretrain_shakespeare.py")] and resume[-2:] == ["--resume", "auto"]
    stopped_at = max(r["step"] for r in read_jsonl(out / "metrics.jsonl"))
    assert 2 <= stopped_at < 1000
    # every checkpoint left is complete: what `--resume auto` continues from (tested in test_cli)
    from gpt2.model.checkpoint_files import find_latest_checkpoint, list_checkpoints

    assert list_checkpoints(out / "checkpoints") == sorted((out / "checkpoints").glob("step_*"))
    assert find_latest_checkpoint(out / "checkpoints").name >= "step_000002"


# --------------------------------------------------------------------------- fine-tuning
def test_finetune_lora_example(finetuned, hf_dir):
    from transformers import GPT2LMHeadModel

    from gpt2.model.gpt import GPT
    from gpt2.model.loading import apply_adapter

    out, stdout = finetuned
    assert stdout.index("before fine-tuning: val loss") < stdout.index("--- before fine-tuning: sample 1/1 ---")
    assert (
        stdout.index("--- before fine-tuning: sample")
        < stdout.index("step 4 | loss")
        < stdout.index("--- after fine-tuning: sample 1/1 ---")
    )
    assert "trainable params:" in stdout
    results = json.loads((out / "results.json").read_text())
    assert math.isfinite(results["val_loss_before"]) and math.isfinite(results["val_loss"])
    assert results["samples_before"][0].startswith("ROMEO:") and results["samples"][0].startswith("ROMEO:")
    assert (out / "adapter").is_dir() and (out / "peft" / "adapter_config.json").is_file()
    # checkpoints hold the adapter only (the base weights are the --init model's)
    ckpt = out / "checkpoints" / "step_000004" / "model.safetensors"
    assert ckpt.stat().st_size < 200_000
    # the merged export loads in transformers and computes what base + adapter computes
    model = apply_adapter(GPT.from_pretrained(str(hf_dir)), out / "adapter").eval()
    merged = GPT2LMHeadModel.from_pretrained(out / "merged").eval()
    x = torch.randint(0, 50257, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, model(x)[0], rtol=1e-4, atol=1e-4)


def test_sample_example_with_adapter(finetuned, hf_dir, capsys):
    from gpt2.cli import main

    out, _ = finetuned
    argv = [
        "--model",
        hf_dir,
        "--prompt",
        "ROMEO:",
        "-n",
        "2",
        "--max-new-tokens",
        "6",
        "--seed",
        "11",
        "--top-p",
        "0.9",
        "--temperature",
        "0.7",
    ]
    ours = ok(example("sample.py", *argv, "--adapter", out / "adapter"))
    assert "--- sample 2/2 ---" in ours
    # the same through the PEFT copy of the adapter (in-process: `gpt2 sample` is the same code)
    assert main(["sample", *map(str, argv), "--adapter", str(out / "peft")]) == 0
    peft = capsys.readouterr().out
    samples = lambda text: text[text.index("--- sample 1/2 ---") :]  # noqa: E731
    assert samples(ours) == samples(peft)


def test_export_command_merges_the_finetuned_adapter(finetuned, hf_dir, tmp_path, capsys):
    """`gpt2 export --adapter`: the same merged model and PEFT adapter finetune_lora.py wrote."""
    from safetensors.torch import load_file

    from gpt2.cli import main

    out, _ = finetuned
    assert (
        main(
            [
                "export",
                "--model",
                str(hf_dir),
                "--adapter",
                str(out / "adapter"),
                "--out",
                str(tmp_path / "hf"),
                "--peft-out",
                str(tmp_path / "peft"),
            ]
        )
        == 0
    )
    assert "wrote merged model" in capsys.readouterr().out
    merged, exported = load_file(out / "merged" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert merged.keys() == exported.keys()
    for key in merged:
        torch.testing.assert_close(exported[key], merged[key])
    peft, ours = (
        load_file(out / "peft" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert peft.keys() == ours.keys() and all(torch.equal(peft[k], ours[k]) for k in peft)


# --------------------------------------------------------------------------- data
def test_prepare_fineweb_example_local_files(tmp_path):
    from gpt2.data import load_tokens

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("To be, or not to be, that is the question. " * 30)
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(10)))
    out = tmp_path / "shards"
    stdout = ok(
        example(
            "prepare_fineweb.py",
            "--input",
            corpus,
            "--out-dir",
            out,
            "--shard-size",
            "300",
            "--no-progress",
            "--num-workers",
            "0",
        )
    )
    shards = sorted(out.glob("edufineweb_*.npy"))
    assert (out / "edufineweb_val_000000.npy") in shards and (out / "edufineweb_train_000001.npy") in shards
    total = sum(len(load_tokens(p)) for p in shards)
    assert f"{total:,} tokens" in stdout and total > 300 * (len(shards) - 1)
    # the default source, FineWeb-edu through `datasets`: a clear one-line error when that is
    # not installed (or, offline, not reachable)
    result = example("prepare_fineweb.py", "--max-docs", "1", "--out-dir", tmp_path / "fw")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "datasets" in result.stderr or "fineweb" in result.stderr.lower()


@pytest.mark.dist
@pytest.mark.slow
def test_train_gpt2_124m_under_torchrun_on_cpu(tmp_path, hellaswag, shared_data):
    """The 124M recipe's loop (grad accumulation, DDP over gloo, val loss, HellaSwag split over
    ranks, checkpoints) with a tiny model and 2 CPU processes, in one torchrun launch. (That the
    recipe resumes by default is tested in test_cli; resuming itself in test_cli and test_trainer.)
    """
    from gpt2.data import write_shards

    shards = tmp_path / "shards"
    docs = (shared_data / "tinyshakespeare.txt").read_text().split("\n\n")[:400]
    write_shards(docs, shards, prefix="edufineweb", shard_size=4000, progress=False)
    out = tmp_path / "run"
    # 2 ranks x 2 sequences x 32 tokens x 2 accumulation micro-steps = 256 tokens per step
    args = [
        "--data",
        shards,
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--total-batch-size",
        "256",
        "--warmup-steps",
        "1",
        "--eval-interval",
        "2",
        "--eval-steps",
        "2",
        "--final-eval-batches",
        "2",
        "--checkpoint-interval",
        "2",
        "--hellaswag",
        hellaswag,
        "--hellaswag-interval",
        "2",
        "--no-compile",
        "--out-dir",
        out,
        "--no-progress",
        "--max-new-tokens",
        "4",
        "--num-samples",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(EXAMPLES / "train_gpt2_124m.py"),
        *map(str, args),
    ]
    result = subprocess.run([*cmd, "--max-steps", "3"], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    stdout = ok(result)
    assert "2 process(es), 2 micro-step(s)" in stdout
    assert stdout.count("val loss") == 1 and stdout.count("--- sample 1/1 ---") == 1  # rank 0 only
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    hs = [r for r in records if "hellaswag_acc_norm" in r]
    assert [r["step"] for r in hs] == [2, 3] and all(r["hellaswag_n"] == 3 for r in hs)  # every example, over 2 ranks
    # HellaSwag no longer pauses fit(): the only checkpoints are the interval's and the stop point's
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    assert json.loads((out / "results.json").read_text())["hellaswag"]["n"] == 3


def test_precision_curves_script(tmp_path):
    """The figure script of docs/precision.md, at a toy size: same curves, the loss scale, the histogram."""
    stdout = ok(
        example(
            "precision_curves.py",
            "--steps",
            "3",
            "--precisions",
            "fp32,fp16",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--n-embd",
            "32",
            "--n-layer",
            "1",
            "--out",
            tmp_path,
        )
    )
    summary = json.loads((tmp_path / "precision_curves.json").read_text())
    runs = {r["precision"]: r for r in summary["runs"]}
    assert len(runs["fp32"]["loss"]) == 3 and runs["fp16"]["loss_scale"][0] == 65536.0
    # fp16 with loss scaling follows fp32 closely on the same batches
    assert abs(runs["fp16"]["loss"][-1] - runs["fp32"]["loss"][-1]) < 0.05
    grads = summary["gradients"]
    assert grads["scaled_below_fp16_subnormal"] <= grads["below_fp16_subnormal"]
    for name in ("precision_loss_curves.png", "fp16_gradient_range.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "wrote" in stdout
    assert "fp16: step 3/3" in stdout  # per-run progress lines (the last step always gets one)
    # --replot redraws the loss curves from the JSON alone, without training
    replot = tmp_path / "replot"
    stdout = ok(example("precision_curves.py", "--replot", tmp_path / "precision_curves.json", "--out", replot))
    assert (replot / "precision_loss_curves.png").stat().st_size > 1000
    assert sorted(p.name for p in replot.iterdir()) == ["precision_loss_curves.png"] and "training" not in stdout


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("precision_curves.py", ["--precisions", "fp8"], "unknown ['fp8']"),
        ("precision_curves.py", ["--steps", "0"], "--steps must be >= 1"),
        ("benchmark_lora.py", ["--model", "tiny", "--device", "cpu", "--rank", "0"], "LoRAConfig.rank must be"),
        ("benchmark_lora.py", ["--model", "tiny", "--device", "cpu", "--steps", "0"], "--steps and --repeats"),
    ],
)
def test_example_scripts_answer_bad_values_in_one_line(tmp_path, script, args, message):
    """They ended in a traceback (exit 1) where the other examples give one line and exit 2."""
    result = example(script, *args, *(["--out", tmp_path] if script == "precision_curves.py" else []))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
