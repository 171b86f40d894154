"""Activation checkpointing (``GPT.set_activation_checkpointing``): peak memory and step time of GPT-2 124M
training steps (B=4, T=1024, fp32, CPU, one thread) with and without it.

Each variant runs in a fresh subprocess (the two at once) and reports its peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), so neither sees the other's allocations, and the
bytes of the tensors its forward saves for the backward (``saved_tensors_hooks``, each storage once:
exact, where the peak RSS also depends on when the allocator hands memory back to the system; they
include the loss's head gradient, 147 MiB, which the chunked loss computes in the forward). A step
is zero_grad, forward with the chunked loss, backward, AdamW step; the peak covers every step
(AdamW's moments exist from the first step on), the time is the CPU time of the steps after the
first (which also pays for first-touch page faults), so the ratio is the recomputation's cost.

    PYTHONPATH=. python benchmarks/activation_memory.py          # ~3 min of CPU time on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("plain", "checkpointed")


def run_steps(variant: str, batch: int, seq: int, steps: int) -> dict[str, float]:
    import torch

    from gpt2.model.config import GPTConfig
    from gpt2.model.gpt import GPT
    from gpt2.train.config import TrainConfig
    from gpt2.train.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt2", pad_vocab_multiple=64)).train()
    model.set_activation_checkpointing(variant == "checkpointed")
    optimizer = build_optimizer(model, TrainConfig(max_lr=6e-4))
    x = torch.randint(0, 50257, (batch, seq))
    y = torch.randint(0, 50257, (batch, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    losses, times = [], []
    for _ in range(steps):
        start = time.process_time()
        optimizer.zero_grad(set_to_none=True)
        # the forward's tensors saved for the backward, each storage once (checkpointing saves the blocks'
        # inputs through autograd too)
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(x, y)[1]
        saved = sum(kept.values())
        loss.backward()
        optimizer.step()
        times.append(time.process_time() - start)
        losses.append(loss.item())
    timed = times[1:] or times
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "rss_before_steps_mib": before / 1024,
        "step_cpu_s": sum(timed) / len(timed),
        "first_step_cpu_s": times[0],
        "saved_mib": saved / 2**20,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="training steps per variant; the first is not timed")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    if args.child:
        print(json.dumps(run_steps(args.child, args.batch, args.seq, args.steps)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = {
        v: subprocess.Popen(
            [sys.executable, __file__, "--child", v, *shape], stdout=subprocess.PIPE, env=env, text=True
        )
        for v in VARIANTS
    }
    results = {}
    for v, child in children.items():
        out, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"the {v} run failed (exit code {child.returncode})")
        results[v] = json.loads(out.strip().splitlines()[-1])
    # Imported here: the parent process only starts the measured ones (its own size is not measured).
    from gpt2.train.precision import describe_machine

    print(describe_machine())
    print(
        f"GPT-2 124M, {args.steps} fp32 training steps on CPU (1 thread), B={args.batch} T={args.seq}; "
        "peak RSS per process, CPU time per step after the first"
    )
    for v, r in results.items():
        print(
            f"{v:<12} peak {r['peak_rss_mib']:7.0f} MiB ({r['peak_rss_mib'] - r['rss_before_steps_mib']:6.0f} MiB "
            f"over the built model), saved for backward {r['saved_mib']:6.0f} MiB, "
            f"step {r['step_cpu_s']:6.1f} s CPU (first {r['first_step_cpu_s']:5.1f} s), "
            f"losses {', '.join(f'{loss:.6f}' for loss in r['losses'])}"
        )
    plain, checkpointed = results["plain"], results["checkpointed"]
    growth = [r["peak_rss_mib"] - r["rss_before_steps_mib"] for r in (checkpointed, plain)]
    print(
        f"checkpointed / plain: peak RSS {checkpointed['peak_rss_mib'] / plain['peak_rss_mib']:.3f}x, "
        f"growth over the built model {growth[0] / growth[1]:.3f}x, "
        f"saved for backward {checkpointed['saved_mib'] / plain['saved_mib']:.3f}x, "
        f"step time {checkpointed['step_cpu_s'] / plain['step_cpu_s']:.3f}x; "
        f"same losses: {checkpointed['losses'] == plain['losses']}"
    )


if __name__ == "__main__":
    main()
