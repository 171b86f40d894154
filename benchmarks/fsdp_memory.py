"""Peak memory per process of training under DDP and FSDP on 2 CPU processes (gloo), with and without
activation checkpointing: the Trainer's own path, a few steps, each configuration in its own torchrun launch.

Peak memory is each process's ``ru_maxrss`` (resident set size) at the end. With a model whose parameters and
optimizer state dominate (the default: 4 layers x 512 wide, GPT-2's vocabulary padded to 50304: 39M parameters,
16 bytes each under DDP), FSDP keeps half of the weights, gradients and AdamW moments on each of the 2 processes.
A long sequence (``--seq-len 1024``) makes activations dominate instead, which activation checkpointing cuts.

    PYTHONPATH=. python benchmarks/fsdp_memory.py                      # ~3 min on 2 cores
    PYTHONPATH=. python benchmarks/fsdp_memory.py --seq-len 1024 --micro-batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One process of a launch: train ``args.steps`` steps, write this rank's peak RSS to ``args.report``."""
    import torch

    from gpt2 import GPT, GPTConfig, TrainConfig, Trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.seq_len, vocab_size=50257, n_layer=args.layers, n_head=8, n_embd=args.width))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = TrainConfig(
        micro_batch_size=args.micro_batch,
        seq_len=args.seq_len,
        max_steps=args.steps,
        strategy=args.strategy,
        activation_checkpointing=args.activation_checkpointing,
        eval_interval=0,
        out_dir=None,
        progress=False,
        plot=False,
        device="cpu",
        precision="fp32",
    )
    tokens = torch.randint(0, 50257, (args.micro_batch * args.seq_len * world_size * (args.steps + 1) + 1,))
    with Trainer(model, config, tokens, sinks=[]) as trainer:
        trainer.fit()
        rank = trainer.dist_env.rank
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.report, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_mib": peak_mib}))


def launch(args: argparse.Namespace, strategy: str, checkpointing: bool, processes: int) -> list[float]:
    """Peak RSS (MiB) of each process of one launch."""
    with tempfile.TemporaryDirectory() as report:
        cmd = [sys.executable]
        if processes > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        cmd += [__file__, "--worker", "--report", report, "--strategy", strategy]
        cmd += ["--layers", str(args.layers), "--width", str(args.width), "--seq-len", str(args.seq_len)]
        cmd += ["--micro-batch", str(args.micro_batch), "--steps", str(args.steps)]
        if checkpointing:
            cmd.append("--activation-checkpointing")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        reports = [json.loads(p.read_text()) for p in sorted(Path(report).glob("rank*.json"))]
    return [r["peak_mib"] for r in reports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--activation-checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from gpt2.train.precision import describe_machine

    print(describe_machine())
    print(
        f"model: {args.layers} layers x {args.width} wide, vocab 50304; micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens per process, {args.steps} steps, fp32; peak RSS per process (max of the ranks)"
    )
    rows = [("one process", "ddp", False, 1), ("one process", "ddp", True, 1)]
    rows += [("2 x DDP", "ddp", False, 2), ("2 x DDP", "ddp", True, 2)]
    rows += [("2 x FSDP", "fsdp", False, 2), ("2 x FSDP", "fsdp", True, 2)]
    peaks = {}
    for label, strategy, checkpointing, processes in rows:
        peak = max(launch(args, strategy, checkpointing, processes))
        peaks[(label, checkpointing)] = peak
        ac = "with" if checkpointing else "without"
        print(f"{label:12s} {ac:7s} activation checkpointing: {peak:8.0f} MiB", flush=True)
    for checkpointing in (False, True):
        ratio = peaks[("2 x FSDP", checkpointing)] / peaks[("2 x DDP", checkpointing)]
        print(f"FSDP / DDP, {'with' if checkpointing else 'without'} activation checkpointing: {ratio:.2f}x")


if __name__ == "__main__":
    main()
