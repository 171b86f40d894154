"""``gpt2 bench``: the speed-up ladder of :mod:`gpt2.bench`, printed as a table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpt2.cli.options import BenchOptions
from gpt2.train.bench import RUNGS, format_table, run_ladder
from gpt2.train.distributed import uses_cuda


def bench(options: BenchOptions) -> list[Any]:
    rungs = [r.strip() for r in options.rungs.split(",") if r.strip()] if options.rungs else list(RUNGS)
    where = torch.cuda.get_device_name() if uses_cuda(options.device) else "CPU"
    title = (
        f"`gpt2 bench` on {where}, torch {torch.__version__}: {options.model}, B={options.batch_size}, "
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
        on_result=lambda r: print(
            f"  {r.rung}: " + (r.note if r.skipped else f"{r.ms_per_step:.1f} ms/step"), flush=True
        ),
    )
    print()
    print(format_table(results, title))  # markdown: paste it into an issue as it is
    if options.json:
        out = Path(options.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"device": where, "torch": torch.__version__, "results": [r.to_dict() for r in results]}, indent=2
            )
            + "\n"
        )
        print(f"wrote {out}")
    return results
