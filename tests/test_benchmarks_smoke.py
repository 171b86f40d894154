"""benchmarks/step_vs_peers.py runs end to end at a tiny shape (one round): the numbers are the benchmark's to
report, not the test's; the test checks that every part of the output is there.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--batch", "2", "--seq-len", "16", "--vocab", "256", "--rounds", "1"]
TINY += ["--mm-size", "64", "--mm-reps", "1", "--optimizer-rounds", "1"]


@pytest.fixture
def step_vs_peers(monkeypatch):
    # benchmarks/ is not installed
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.step_vs_peers

    # main() sets one thread and quiets the library's logger: the rest of the session gets its own back
    threads, level = torch.get_num_threads(), logging.getLogger("gpt2").level
    yield benchmarks.step_vs_peers
    torch.set_num_threads(threads)
    logging.getLogger("gpt2").setLevel(level)


def run(module, monkeypatch, capsys, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["step_vs_peers.py", *TINY, *args])
    module.main()
    return capsys.readouterr().out


def test_step_vs_transformers_prints_every_part(step_vs_peers, monkeypatch, capsys):
    out = run(step_vs_peers, monkeypatch, capsys, "--peers", "transformers", "--profile", "3")
    assert out.startswith(step_vs_peers.describe_machine())
    name, why = step_vs_peers.auto_precision("cpu")
    assert f"\nprecision auto -> {name}: {why}\n" in out
    header = next(line for line in out.splitlines() if line.startswith("round |"))
    for column in ("mm GFLOP/s", "ours s", "bare s", "transformers s", "ours/transformers", "MFU ours"):
        assert column in header
    assert "\nmedian | " in out and "\nmin-max | " in out
    assert "page faults per step (medians): ours " in out and ", transformers " in out
    assert "goal fp32: MFU >= 80.0%" in out and "step <= 0.85x transformers" in out
    assert "AdamW: ours fused, transformers fused" in out or "AdamW: ours foreach" in out
    assert "by aten op and input shapes" in out and "matrix products" in out
    assert "the optimizer step alone" in out and "fused/foreach" in out
    assert "gradients within the clipping limit" in out and "the norm alone (the Trainer)" in out
    if step_vs_peers.cpu_native_bf16() is None:
        assert "bf16 skipped: this CPU has no native bf16 matmul" in out
    else:
        assert "goal bf16" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("litgpt") is None, reason="litgpt is not installed")
def test_step_vs_litgpt(step_vs_peers, monkeypatch, capsys):
    out = run(step_vs_peers, monkeypatch, capsys, "--peers", "litgpt", "--precisions", "fp32")
    assert "ours/litgpt" in out and "MFU litgpt" in out


def test_bad_option_is_one_line(step_vs_peers, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(step_vs_peers, monkeypatch, capsys, "--precisions", "fp16")
    assert "--precisions takes fp32,bf16" in capsys.readouterr().err


def test_every_benchmark_script_names_its_machine():
    """Every script in benchmarks/ that runs as a program prints the machine line (CPU model, AMX / AVX512-BF16,
    torch, threads, read from the machine) beside its numbers: the rule for docs/benchmarks.md.
    """
    scripts = [path for path in sorted((REPO / "benchmarks").glob("*.py")) if "__main__" in path.read_text()]
    # benchmarks/lora.py is a library: examples/benchmark_lora.py is its program
    scripts.append(REPO / "examples" / "benchmark_lora.py")
    assert len(scripts) >= 15
    silent = [path.name for path in scripts if "describe_machine(" not in path.read_text()]
    assert silent == []


def test_the_memory_table_names_the_machine_it_was_computed_on(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.memory_table
    from gpt2.train.precision import describe_machine

    monkeypatch.setattr(sys, "argv", ["memory_table.py", "--processes", "2"])
    benchmarks.memory_table.main()
    first, *_ = capsys.readouterr().out.splitlines()
    assert first == f"{describe_machine()} (computed, not measured on it)"


def test_attention_backward_compares_the_paths_on_the_same_outputs(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.attention_backward as attention

    threads = torch.get_num_threads()
    argv = ["attention_backward.py", "--rounds", "1", "--batch", "1", "--seq-len", "16", "--heads", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--head-size", "8", "--chunk", "4"])
    try:
        attention.main()
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    for dtype, names in (("bfloat16", ("flash", "math", "chunked", "ours")), ("float32", ("flash", "math", "chunked"))):
        for name in names:
            timed = [line for line in lines if line.split()[:2] == [dtype, name] and "x flash" in line]
            assert len(timed) == 1, (dtype, name)
    # gpt2's bf16 backward: its gradients' error against float64 stays at bf16 rounding
    ours = next(line for line in lines if line.split()[:2] == ["bfloat16", "ours"] and "error" in line)
    assert max(float(error) for error in ours.split()[-3:]) < 2e-2
    # the chunked causal blocks compute the same attention as the flash kernel (fp32: to rounding)
    chunked = next(line for line in lines if line.startswith("float32") and "chunked" in line and "max" in line)
    assert float(chunked.split()[-1]) < 1e-5
