"""``gpt2 bench``: the speed-up ladder of :mod:`gpt2.bench`, printed as a table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpt2.cli.common import write_json
from gpt2.cli.layers import Options
from gpt2.model.config import SHAPE_NAMES
from gpt2.train.bench import RungResult, format_table, run_ladder
from gpt2.train.distributed import resolve_device
from gpt2.train.precision import describe_machine


@dataclass
class BenchOptions(Options):
    """gpt2 bench: the training speed-up ladder (fp32, bf16, compile, flash...)."""

    model: Literal[SHAPE_NAMES] = "tiny"
    """model shape"""
    batch_size: int = 4
    """sequences per step"""
    seq_len: int = 64
    """tokens per sequence"""
    steps: int = 5
    """timed steps per repeat"""
    repeats: int = 3
    """timed blocks of --steps per rung: the table shows their median and spread"""
    warmup: int = 2
    """untimed steps per rung (compilation happens here)"""
    rungs: str = "fp32,tf32,bf16,compile,flash,vocab_pad,fused_adamw"
    """comma-separated subset of the rungs"""
    device: str = "auto"
    """auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N"""
    compile: bool = False
    """time the compile rung (torch.compile); the GPU recipe turns it on, compiling on a CPU is slow"""
    vocab_size: int | None = 1024
    """override GPT-2's 50257 tokens (smaller keeps CPU runs quick); None = 50257"""
    peak_flops: float | None = None
    """peak FLOP/s for MFU; None = from the GPU name"""
    json: str | None = None
    """also write the results as JSON"""


def bench(options: BenchOptions) -> list[Any]:
    # none named: every rung
    rungs = [r.strip() for r in options.rungs.split(",") if r.strip()] or None
    # "cuda" without CUDA: the Trainer's error, before any work
    where = describe_machine(resolve_device(options.device))
    title = (
        f"`gpt2 bench` on {where}: {options.model}, B={options.batch_size}, "
        f"T={options.seq_len}, {options.repeats} x {options.steps} timed steps after {options.warmup} warm-up steps"
    )
    print(title, flush=True)
    results = run_ladder(
        options.model,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        steps=options.steps,
        warmup=options.warmup,
        repeats=options.repeats,
        rungs=rungs,
        device=options.device,
        compile=options.compile,
        peak_flops=options.peak_flops,
        vocab_size=options.vocab_size,
        # one line per rung as it finishes (a compiled rung takes a minute), then the table
        on_result=_print_rung,
    )
    print()
    # markdown: paste it into an issue as it is
    print(format_table(results, title))
    if options.json:
        write_json(
            options.json,
            {"device": where, "torch": torch.__version__, "results": [dataclasses.asdict(r) for r in results]},
        )
    return results


def _print_rung(result: RungResult) -> None:
    """``  bf16: 41.2 ms/step``, or the note of a skipped rung."""
    shown = result.note if result.skipped else f"{result.ms_per_step:.1f} ms/step"
    print(f"  {result.rung}: {shown}", flush=True)
