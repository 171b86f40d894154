"""Peak memory of one GPT-2 124M training step (B=4, T=1024, fp32, CPU): our chunked loss
against the same model with a plain full-logits loss.

Each variant runs in a fresh subprocess (the two at once) and reports its peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), so neither sees the other's allocations. The
step is zero_grad, forward, loss, backward, AdamW step. "plain" takes the logits from
``model(x)`` (``(B, T, 50257)`` sliced from the padded 50304) and calls ``F.cross_entropy`` on
them in fp32, the usual full-logits loss.

    PYTHONPATH=. python benchmarks/memory.py            # ~2-4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("ours", "plain")


def one_step(variant: str, batch: int, seq: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from gpt2.model.config import GPTConfig
    from gpt2.model.gpt import GPT
    from gpt2.train.config import TrainConfig
    from gpt2.train.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt2", pad_vocab_multiple=64)).train()
    optimizer = build_optimizer(model, TrainConfig(max_lr=6e-4))
    x = torch.randint(0, 50257, (batch, seq))
    y = torch.randint(0, 50257, (batch, seq))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    optimizer.zero_grad(set_to_none=True)
    if variant == "ours":
        loss = model(x, y)[1]
    else:
        logits = model(x)[0]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    optimizer.step()
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "rss_before_step_mib": before / 1024,
        "step_cpu_s": time.process_time() - start,
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_step(args.child, args.batch, args.seq)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = {
        v: subprocess.Popen(
            [sys.executable, __file__, "--child", v, "--batch", str(args.batch), "--seq", str(args.seq)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for v in VARIANTS
    }
    results = {}
    for v, child in children.items():
        out, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"the {v} step failed (exit code {child.returncode})")
        results[v] = json.loads(out.strip().splitlines()[-1])
    # Imported here: the parent process only starts the measured ones (its own size is not measured).
    from gpt2.train.precision import describe_machine

    print(describe_machine())
    print(f"GPT-2 124M, one fp32 training step on CPU, B={args.batch} T={args.seq}; peak RSS per process")
    for v, r in results.items():
        print(
            f"{v:<6} peak {r['peak_rss_mib']:8.0f} MiB (before the step {r['rss_before_step_mib']:6.0f} MiB), "
            f"step {r['step_cpu_s']:6.1f} s CPU, loss {r['loss']:.4f}"
        )
    ratio = results["ours"]["peak_rss_mib"] / results["plain"]["peak_rss_mib"]
    print(f"ours / plain peak RSS: {ratio:.3f}x (goal <= 0.75x: {'met' if ratio <= 0.75 else 'not met'})")


if __name__ == "__main__":
    main()
