"""A LoRA fine-tuning step as a user of each library runs it: minlora on ``gpt2.GPT`` against PEFT
on ``transformers.GPT2LMHeadModel``, the same GPT-2 124M weights (random, seeded), the same LoRA
(rank 8, alpha 16, on ``c_attn``), the same batch, AdamW on the LoRA factors, eager, fp32.

Each measurement runs in a fresh process (peak RSS is per process: ``ru_maxrss``), one CPU thread,
CPU time (``time.process_time``) per step after a warm-up step; the two libraries alternate
(A B A B ...) so a change in the machine's load hits both.

    PYTHONPATH=. python benchmarks/lora_vs_peft.py [--rounds 2 --steps 3 --batch-size 2 --seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def one_run(lib: str, batch_size: int, seq_len: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from gpt2.model.config import GPTConfig
    from gpt2.model.gpt import GPT

    base = GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768))
    x = torch.randint(0, 50257, (batch_size, seq_len))
    y = torch.randint(0, 50257, (batch_size, seq_len))
    if lib == "minlora":
        import minlora

        model = base
        minlora.add_lora(model, minlora.LoRAConfig(rank=8, alpha=16, target_modules=("c_attn",)))
        minlora.mark_only_lora_as_trainable(model)

        def loss_fn():
            return model(x, y)[1]
    else:
        import peft
        import transformers

        hf_dir = f"/tmp/lora_vs_peft_hf_{os.getpid()}"
        base.save_pretrained(hf_dir)  # the same weights, as transformers loads them
        del base
        hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir)
        model = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"]))
        # transformers shifts the labels by one inside: position t is scored against labels[t + 1] =
        # y[t], the same targets (all but the last position's).
        labels = torch.cat([x[:, :1], y[:, :-1]], dim=1)

        def loss_fn():
            return model(input_ids=x, labels=labels).loss

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for step in range(steps + 1):
        t0 = time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        if step:  # the first step warms the allocator and the kernels up
            times.append(time.process_time() - t0)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # One more step under the profiler: how much of a step is matrix products (the frozen base's
    # and the LoRA factors'), which both libraries hand to the same BLAS at the same FLOPs.
    with torch.profiler.profile() as prof:
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
    matmul_s = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMULS) / 1e6
    return {
        "lib": lib,
        "step_s": statistics.median(times),
        "peak_mib": peak_mib,
        "loss": float(loss),
        "matmul_s": matmul_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one library in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.batch_size, args.seq_len, args.steps)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, list[dict]] = {"minlora": [], "peft": []}
    for _ in range(args.rounds):
        for lib in results:
            cmd = [sys.executable, __file__, "--one", lib, "--steps", str(args.steps)]
            cmd += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            results[lib].append(json.loads(out.strip().splitlines()[-1]))
            print(results[lib][-1], flush=True)
    ours, peer = results["minlora"], results["peft"]
    time_ratio = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(ours, peer))
    mem_ratio = statistics.median(a["peak_mib"] / b["peak_mib"] for a, b in zip(ours, peer))
    # Imported here: the parent process only starts the measured ones (its own size is not measured).
    from gpt2.train.precision import describe_machine

    print(f"\n{describe_machine(threads=1)}")
    print(f"GPT-2 124M, B={args.batch_size}, T={args.seq_len}, LoRA r=8 on c_attn, fp32, one thread")
    print("| library | CPU s per step (median) | peak RSS MiB (median) |")
    print("|---|---:|---:|")
    for lib, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        peak = statistics.median(r["peak_mib"] for r in runs)
        print(f"| {lib} | {step:.2f} | {peak:,.0f} |")
    print(f"minlora / PEFT: time {time_ratio:.3f}x, peak memory {mem_ratio:.3f}x (pair by pair, median)")
    mm_ours, mm_peer = (statistics.median(r["matmul_s"] for r in runs) for runs in (ours, peer))
    peer_step = statistics.median(r["step_s"] for r in peer)
    print(
        f"matrix products (profiled step): minlora {mm_ours:.2f} s, PEFT {mm_peer:.2f} s; a step made of "
        f"PEFT's matrix products alone would be {mm_peer / peer_step:.2f}x PEFT's step"
    )


if __name__ == "__main__":
    main()
