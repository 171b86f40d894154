"""GPT-2's tanh GELU on bf16 CPU activations: gpt2's table lookups (``gpt2.model.gpt.TanhGelu``) against torch's
kernels (``nn.GELU(approximate="tanh")``), one thread, CPU time (``time.process_time``).

1. Alone, on one MLP's activations at the 124M shape (B=4, T=256: 3.1M values): forward and backward of each,
   interleaved, the medians of ``--rounds`` rounds; then whether the two agree bit for bit.
2. In the Trainer's step (``train_step()``, bf16, random init; the 124M shape, B=4, T=256 unless told): each
   block's GELU module swapped between the two, step by step in the order tables-torch, torch-tables, ...; the
   median of the pairs' ratios.

    PYTHONPATH=. python benchmarks/bf16_gelu.py [--rounds 20] [--pairs 12] [--model gpt2] [--batch 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.nn as nn

from benchmarks.step_vs_peers import Shape, build_ours
from gpt2.model.gpt import MLP, TanhGelu
from gpt2.train.precision import describe_machine

MODULES = {"tables": TanhGelu(), "torch": nn.GELU(approximate="tanh")}


def forward_backward(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float, tuple]:
    """(forward CPU ms, backward CPU ms, (output, input gradient)) of ``module`` on ``x``."""
    x = x.clone().requires_grad_()
    start = time.process_time()
    y = module(x)
    middle = time.process_time()
    (dx,) = torch.autograd.grad(y, x, grad)
    end = time.process_time()
    return (middle - start) * 1e3, (end - middle) * 1e3, (y, dx)


def alone(rounds: int) -> None:
    x = (torch.randn(4, 256, 3072) * 2).to(torch.bfloat16)
    grad = torch.randn(4, 256, 3072).to(torch.bfloat16)
    times: dict[str, list[float]] = {f"{name} {part}": [] for name in MODULES for part in ("forward", "backward")}
    for _ in range(rounds):
        for name, module in MODULES.items():
            forward, backward, _ = forward_backward(module, x, grad)
            times[f"{name} forward"].append(forward)
            times[f"{name} backward"].append(backward)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"alone, (4, 256, 3072) bf16, medians of {rounds} rounds, CPU ms:")
    for part in ("forward", "backward"):
        tables, plain = medians[f"tables {part}"], medians[f"torch {part}"]
        print(f"  {part}: tables {tables:.2f}, torch {plain:.2f}, tables / torch {tables / plain:.2f}x")
    results = [forward_backward(module, x, grad)[2] for module in MODULES.values()]
    same = [torch.equal(a, b) for a, b in zip(*results)]
    print(f"  bit for bit the same: output {same[0]}, input gradient {same[1]}")


def in_step(shape: Shape, pairs: int) -> None:
    trainer, step, _ = build_ours(shape, "bf16")
    mlps = [m for m in trainer.model.modules() if isinstance(m, MLP)]

    def timed(kind: str) -> float:
        """CPU s of one step with the ``kind`` GELU, after an untimed one."""
        for mlp in mlps:
            mlp.gelu = MODULES[kind]
        step()
        start = time.process_time()
        step()
        return time.process_time() - start

    seconds: dict[str, list[float]] = {kind: [] for kind in MODULES}
    for pair in range(pairs):
        order = ("tables", "torch") if pair % 2 == 0 else ("torch", "tables")
        for kind in order:
            seconds[kind].append(timed(kind))
    ratios = [a / b for a, b in zip(seconds["tables"], seconds["torch"])]
    tables, plain = (statistics.median(seconds[kind]) for kind in MODULES)
    print(
        f"the Trainer's {shape.model} bf16 step (B={shape.batch}, T={shape.seq_len}), {pairs} pairs: "
        f"tables {tables:.3f} s, torch {plain:.3f} s, "
        f"tables / torch {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=12, help="0 skips the Trainer's step")
    Shape.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("gpt2").setLevel(logging.WARNING)
    print(describe_machine())
    alone(args.rounds)
    if args.pairs:
        in_step(Shape.from_args(args), args.pairs)


if __name__ == "__main__":
    main()
