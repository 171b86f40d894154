"""Reproduce the training speed-up ladder: fp32 -> tf32 -> bf16 -> +compile -> +flash attention ->
+vocab padded to 50304 -> +fused AdamW, each rung timed on its own with the Trainer's train_step.

    python examples/benchmark.py                    # GPU: GPT-2 124M, B=16, T=1024; CPU: a tiny smoke run
    python examples/benchmark.py --model gpt2 --batch-size 16 --seq-len 1024 --steps 20 --warmup 5
    python examples/benchmark.py --model tiny --device cpu --no-compile --steps 2 --json ladder.json
    python examples/benchmark.py --rungs bf16,compile,fused_adamw

Prints a table of ms/step, tokens/s, MFU (GPUs only) and the speed-up over the first rung.
This script is `gpt2 bench`: the same code (gpt2.train.bench.run_ladder), the same options.
"""

from __future__ import annotations

import sys

from gpt2.cli import run_command


def main(argv: list[str] | None = None) -> int:
    return run_command("bench", argv, prog="benchmark.py", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
