"""Benchmark a LoRA fine-tuning step: minlora (fast path and plain parametrization) vs PEFT.

    python examples/benchmark_lora.py --model mini --device cpu --steps 5
    python examples/benchmark_lora.py --model gpt2 --batch-size 8 --seq-len 1024 --precision bf16 --compile

All implementations adapt the same randomly initialised gpt2.GPT (124M shape with --model gpt2)
with the same rank and target layers; the table reports the median step time and, on CUDA, the
peak memory (torch.cuda.max_memory_allocated) over the timed steps. A status line per run goes to
stderr as it happens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The benchmark code lives in benchmarks/lora.py at the repository root (not an installed package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lora import IMPLEMENTATIONS, PRECISIONS, format_results, run_lora_benchmark  # noqa: E402
from gpt2.model.config import SHAPES  # noqa: E402
from gpt2.train.distributed import resolve_device  # noqa: E402
from gpt2.train.precision import describe_machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(SHAPES), default="mini", help="a named model shape (gpt2 = 124M)")
    parser.add_argument("--impl", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="autocast dtype of the step (fp16 adds a GradScaler); fp32 = no autocast",
    )
    parser.add_argument(
        "--base-dtype",
        choices=PRECISIONS,
        default="fp32",
        help="dtype of the frozen base weights (LoRA factors stay fp32)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--targets", nargs="+", default=["c_attn", "c_proj", "c_fc"])
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over the implementations (interleaved; helps on a shared, noisy machine)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines too")
    args = parser.parse_args()
    try:  # bad values (a rank of 0, no CUDA, a target that matches nothing): one line, exit 2
        resolve_device(args.device)
        results = _run(args)
    except ValueError as e:
        parser.error(str(e))
    print(describe_machine(resolve_device(args.device)))
    print(
        f"model={args.model} batch={args.batch_size} seq_len={args.seq_len} precision={args.precision} "
        f"base={args.base_dtype} compile={args.compile} steps={args.steps}x{args.repeats} rank={args.rank} "
        f"targets={','.join(args.targets)}"
    )
    print(format_results(results))
    if args.json:
        for r in results:
            print(json.dumps(r.to_dict()))


def _run(args: argparse.Namespace) -> list:
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        raise ValueError(
            f"--steps and --repeats must be >= 1 and --warmup >= 0, got {args.steps}, {args.repeats}, {args.warmup}"
        )
    return run_lora_benchmark(
        args.impl,
        model=args.model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
        base_dtype=args.base_dtype,
        steps=args.steps,
        warmup=args.warmup,
        compile=args.compile,
        device=args.device,
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        targets=args.targets,
        repeats=args.repeats,
    )


if __name__ == "__main__":
    main()
