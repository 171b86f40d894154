"""Reproduce the training speed-up ladder (fp32 -> tf32 -> bf16 -> compile -> flash -> vocab pad -> fused AdamW).

    python examples/benchmark.py                          # GPT-2 124M, B=16, T=1024 (a GPU)
    python examples/benchmark.py --model tiny --batch-size 4 --seq-len 64 --steps 5 --vocab-size 1000  # CPU
    python examples/benchmark.py --rungs bf16,compile,fused_adamw --json ladder.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from gpt2.bench import MODEL_SHAPES, RUNGS, format_table, run_ladder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(MODEL_SHAPES), help="model shape (default: gpt2, 124M)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: 1024)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per rung (default: 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per rung, incl. compilation (default: 5)")
    p.add_argument("--rungs", default=",".join(RUNGS), help=f"comma-separated subset of {','.join(RUNGS)}")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--compile", dest="compile", action="store_true", default=None,
                       help="compile even on CPU (default: compile on CUDA only)")
    group.add_argument("--no-compile", dest="compile", action="store_false", help="never compile")
    p.add_argument("--vocab-size", type=int, default=None, help="override GPT-2's 50257 (smaller = faster CPU smoke)")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU (default: from the GPU name)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list:
    args = parse_args(argv)
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else platform.processor() or "CPU"
    print(f"{args.model}, B={args.batch_size}, T={args.seq_len}, {args.steps} timed steps after {args.warmup} "
          f"warm-up steps, on {device_name} (torch {torch.__version__})", flush=True)
    results = run_ladder(
        args.model, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
        rungs=rungs, device=args.device, compile=args.compile, peak_flops=args.peak_flops,
        vocab_size=args.vocab_size,
        on_result=lambda r: print(f"  {r.rung}: " + (r.note if r.skipped else f"{r.ms_per_step:.1f} ms/step"), flush=True),
    )
    print(format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "device": device_name, "torch": torch.__version__,
                       "results": [r.to_dict() for r in results]}, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
