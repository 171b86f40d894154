"""The first run as a new user lives it: seed the caches from offline copies, train, then run the
three commands the run prints at its end, each in a fresh process with a clean environment (no
GPT2_TOKENIZER_DIR / GPT2_TINY_SHAKESPEARE, HOME and the temp dir in a tmp folder; the seeding
itself runs in this process, pointed at that HOME).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("seed_cache", REPO / "scripts" / "seed_cache.py")
seed_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seed_cache)
seed_caches = seed_cache.seed_caches

# Variables that would point the library at the offline copies directly: a new shell has none.
_POINTERS = (
    "TIKTOKEN_CACHE_DIR",
    "DATA_GYM_CACHE_DIR",
    "GPT2_TINY_SHAKESPEARE",
    "GPT2_TOKENIZER_DIR",
    "GPT2_CACHE_DIR",
    "XDG_CACHE_HOME",
    "TMPDIR",
)


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _POINTERS}
    # One intra-op thread: tiny models, and the cores may be shared (not a pointer to any data).
    env.update(HOME=str(home), TMPDIR=str(home / "tmp"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert result.returncode == 0, (
        f"{shlex.join(args)}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    )
    return result.stdout


def test_seed_caches_checks_and_copies(tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))
    written = seed_caches(shared_data)
    for name in ("tinyshakespeare.txt", "gpt2-tokenizer/vocab.bpe", "gpt2-tokenizer/encoder.json"):
        assert (tmp_path / "cache" / name).read_bytes() == (shared_data / name).read_bytes()
    assert len(written) == 3 and seed_caches(shared_data) == []  # good copies are kept

    # A corrupt source file is refused and nothing lands in the cache.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tinyshakespeare.txt").write_text("not shakespeare")
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache2"))
    with pytest.raises(ValueError, match="sha256"):
        seed_caches(bad)
    assert not (tmp_path / "cache2").exists() or not any((tmp_path / "cache2").iterdir())
    with pytest.raises(FileNotFoundError, match="not a directory"):
        seed_caches(tmp_path / "missing")


@pytest.mark.slow
def test_printed_next_commands_work_in_a_new_shell(tmp_path, shared_data, monkeypatch):
    env = clean_env(tmp_path / "home")
    work = tmp_path / "repo"
    work.mkdir()
    py = [sys.executable]
    # The new shell's cache (~/.cache/gpt2 of its HOME), seeded in this process (the script's own
    # command line runs in tests/test_docs_commands.py).
    for name in _POINTERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", env["HOME"])
    assert "tinyshakespeare.txt" in [path.name for path in seed_caches(shared_data)]
    monkeypatch.undo()
    # A tiny training run, with the data and tokenizer found only through the seeded caches.
    out = run(
        [
            *py,
            "-m",
            "gpt2",
            "train",
            "--recipe",
            "shakespeare",
            "--model",
            "tiny",
            "--seq-len",
            "32",
            "--micro-batch-size",
            "4",
            "--max-steps",
            "3",
            "--warmup-steps",
            "1",
            "--eval-interval",
            "0",
            "--final-eval-batches",
            "2",
            "--num-samples",
            "0",
            "--no-progress",
        ],
        env,
        work,
    )
    run_dir = work / "runs" / "shakespeare"
    for name in ("checkpoints", "metrics.jsonl", "loss.png", "results.json"):
        assert name in out and (run_dir / name).exists(), name
    commands = [line.split("#")[0].strip() for line in out.split("next, try:")[1].splitlines() if line.strip()]
    # `gpt2`, or the path of this virtual environment's gpt2 when it is not activated (not on PATH).
    programs = {shlex.split(c)[0] for c in commands}
    assert programs in ({"gpt2"}, {str(Path(sys.executable).with_name("gpt2"))}), programs
    assert [shlex.split(c)[1] for c in commands] == ["sample", "finetune", "eval"]
    # Run each as printed, shrunk to a few steps / tokens by options appended after it (argparse:
    # the last value wins). The first runs in a new shell exactly as printed; one fresh process with
    # the same clean environment runs the other two in turn through the `gpt2` script's main(): an
    # interpreter start fewer.
    shrink = {
        "sample": ["--max-new-tokens", "5", "--seed", "0"],
        "finetune": [
            "--max-steps",
            "2",
            "--warmup-steps",
            "1",
            "--eval-interval",
            "0",
            "--final-eval-batches",
            "1",
            "--max-new-tokens",
            "4",
            "--no-progress",  # no --seq-len: the printed line must fit the 32-token model itself
        ],
        "eval": ["--max-batches", "2"],
    }
    lines = [shlex.join([*shlex.split(c), *shrink[shlex.split(c)[1]]]) for c in commands]
    assert "ROMEO:" in run(["bash", "-c", lines[0]], env, work)
    out = run([*py, "-c", _RUN_EACH, *lines[1:]], env, work)
    results = dict(part.split("\n", 1) for part in out.split("=== ")[1:])
    assert sorted(results) == ["eval", "finetune"]
    assert "saved adapter" in results["finetune"]
    assert "val loss" in results["eval"]
    assert json.loads((run_dir / "results.json").read_text())["step"] == 3


# Runs each printed `gpt2 ...` line given as an argument through gpt2's command-line main(), in order,
# each one's output after a "=== <command>" line; stops at the first that fails.
_RUN_EACH = """
import shlex, sys
from gpt2.__main__ import main
for line in sys.argv[1:]:
    argv = shlex.split(line)
    print("=== " + argv[1], flush=True)
    code = main(argv[1:])
    sys.stdout.flush()
    if code:
        sys.exit(f"{line}: exit {code}")
"""
