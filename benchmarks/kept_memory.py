"""The Trainer's step with freed memory kept in the process (``gpt2.train.host_memory``) against glibc's thresholds.

One process, one thread, the Trainer's ``train_step()`` at the 124M shape (B=4, T=256, random init), the two states
switched step by step: each timed step comes after one untimed step in the same state (which fills the heap, or maps
and trims it), in the order kept-default, default-kept, ... so that a slow stretch of a shared machine falls on both.
Per state: the medians of user and system CPU time (``getrusage``) and of page faults (``ru_minflt``) per step, and
the median of the pairs' ratios (kept / glibc's thresholds) of user + system time.

    PYTHONPATH=. python benchmarks/kept_memory.py [--pairs 12] [--precision bf16] [--batch 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics

import torch

from benchmarks.step_vs_peers import Shape, build_ours
from gpt2.train import host_memory
from gpt2.train.precision import describe_machine


def timed_step(step, kept: bool) -> tuple[float, float, int]:
    """(user s, system s, page faults) of one ``step`` in the state ``kept``, after an untimed one in it."""
    host_memory.set_kept(kept)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF)
    step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    Shape.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("gpt2").setLevel(logging.WARNING)
    print(describe_machine())
    if not host_memory.set_kept(True):
        print("this process's malloc is not glibc's, or its settings come from the environment: nothing to compare")
        return
    shape = Shape.from_args(args)
    trainer, step, _ = build_ours(shape, args.precision)
    print(f"{args.model}, {args.precision}, B={args.batch}, T={args.seq_len}: Trainer.train_step(), CPU s per step")
    print("pair | kept user s | kept system s | kept faults | glibc user s | glibc system s | glibc faults | ratio")
    runs: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
    ratios = []
    for pair in range(args.pairs):
        for kept in (True, False) if pair % 2 == 0 else (False, True):
            runs[kept].append(timed_step(step, kept))
        kept_run, glibc_run = runs[True][-1], runs[False][-1]
        ratios.append((kept_run[0] + kept_run[1]) / (glibc_run[0] + glibc_run[1]))
        cells = [f"{kept_run[0]:.3f}", f"{kept_run[1]:.3f}", f"{kept_run[2]:,}"]
        cells += [f"{glibc_run[0]:.3f}", f"{glibc_run[1]:.3f}", f"{glibc_run[2]:,}", f"{ratios[-1]:.3f}x"]
        print(" | ".join([str(pair + 1), *cells]))
    medians = []
    for kept in (True, False):
        user, system, faults = zip(*runs[kept])
        medians += [f"{statistics.median(user):.3f}", f"{statistics.median(system):.3f}"]
        medians.append(f"{statistics.median(faults):,.0f}")
    print(" | ".join(["median", *medians, f"{statistics.median(ratios):.3f}x"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"min-max ratio: {min(ratios):.3f}x-{max(ratios):.3f}x; peak RSS {peak} MiB")
    del trainer


if __name__ == "__main__":
    main()
