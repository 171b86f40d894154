"""Time to a target validation loss on Tiny Shakespeare: AdamW against Muon.

A byte-level GPT (vocabulary 256, so the blocks hold most of the parameters: 4 layers, 128 wide,
T=128) trained on CPU, one thread. Both optimizers see the same tokens: for a given seed the
initial weights and the sequence of training batches are the same. Each run evaluates the
validation loss (the same ``--eval-batches`` batches every time) every ``--eval-every`` steps and
stops at the first evaluation at or below ``--target``; it reports that step and the process CPU
seconds spent in training steps up to it (evaluations not counted).

Schedule: linear warmup over ``--warmup`` steps, then constant (the schedule of
:func:`gpt2.train.optim.lr_at` with ``min_lr = max_lr``), so where a run stops does not change
its learning rates. AdamW: :func:`gpt2.train.optim.build_optimizer` with the library's defaults
(betas 0.9/0.95, weight decay 0.1 on matrices). Muon: the same call with ``optimizer="muon"``:
Muon at ``muon_lr`` for the blocks' matrices, AdamW at the tuned AdamW LR for the rest.

Procedure: sweep the AdamW LR on the first seed, then Muon's LR (its AdamW part at the best AdamW
LR) on the first seed, then run both winners on the remaining seeds.

    PYTHONPATH=. python benchmarks/muon_shakespeare.py   # about 7 CPU minutes on one core
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gpt2 import GPT, GPTConfig, TrainConfig
from gpt2.train.optim import build_optimizer, lr_at, set_lr
from gpt2.train.precision import describe_machine

DATA = Path("/work/shared/data/tinyshakespeare.txt")


def load_bytes(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    return data[:split], data[split:]


def batch(data: torch.Tensor, generator: torch.Generator, batch_size: int, seq_len: int):
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def val_loss(model: GPT, val_batches) -> float:
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches)
    model.train()
    return loss


def run(optimizer: str, lr: float, muon_lr: float, seed: int, args, train, val_batches) -> dict:
    """Train until the validation loss reaches ``args.target`` (or ``args.max_steps``)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=args.seq_len, vocab_size=256, n_layer=4, n_head=4, n_embd=128))
    opt = build_optimizer(model, TrainConfig(max_lr=lr, optimizer=optimizer, muon_lr=muon_lr))
    generator = torch.Generator().manual_seed(1000 + seed)  # the same batches for both optimizers
    cpu = 0.0
    for step in range(args.max_steps):
        x, y = batch(train, generator, args.batch_size, args.seq_len)
        t0 = time.process_time()
        set_lr(opt, lr_at(step, max_lr=lr, min_lr=lr, warmup_steps=args.warmup, max_steps=args.max_steps))
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        cpu += time.process_time() - t0
        if (step + 1) % args.eval_every == 0:
            loss = val_loss(model, val_batches)
            if loss <= args.target:
                return {"steps": step + 1, "cpu_s": cpu, "val_loss": loss, "reached": True}
    return {"steps": args.max_steps, "cpu_s": cpu, "val_loss": val_loss(model, val_batches), "reached": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=2.3, help="validation loss (nats per byte) to reach")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--adamw-lrs", default="2e-3,4e-3,8e-3")
    parser.add_argument("--muon-lrs", default="0.01,0.02,0.04")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(describe_machine(), flush=True)
    train, val = load_bytes(DATA)
    val_gen = torch.Generator().manual_seed(0)
    val_batches = [batch(val, val_gen, args.batch_size, args.seq_len) for _ in range(args.eval_batches)]

    def show(name, lr, seed, r):
        mark = "" if r["reached"] else f" (not reached: val {r['val_loss']:.3f})"
        print(f"{name:6} lr {lr:<7g} seed {seed}: {r['steps']:4d} steps, {r['cpu_s']:6.1f} CPU s{mark}", flush=True)

    def sweep(name, lrs, make):
        results = {}
        for lr in lrs:
            results[lr] = make(lr, 0)
            show(name, lr, 0, results[lr])
        best = min(lrs, key=lambda lr: (results[lr]["steps"], results[lr]["cpu_s"]))
        return best, results[best]

    adamw_lrs = [float(v) for v in args.adamw_lrs.split(",")]
    muon_lrs = [float(v) for v in args.muon_lrs.split(",")]
    best_adamw, adamw0 = sweep("adamw", adamw_lrs, lambda lr, s: run("adamw", lr, 0.02, s, args, train, val_batches))
    best_muon, muon0 = sweep("muon", muon_lrs, lambda lr, s: run("muon", best_adamw, lr, s, args, train, val_batches))
    rows = {"adamw": [adamw0], "muon": [muon0]}
    for seed in range(1, args.seeds):
        # interleaved, so a busy machine slows both alike
        rows["adamw"].append(run("adamw", best_adamw, 0.02, seed, args, train, val_batches))
        show("adamw", best_adamw, seed, rows["adamw"][-1])
        rows["muon"].append(run("muon", best_adamw, best_muon, seed, args, train, val_batches))
        show("muon", best_muon, seed, rows["muon"][-1])

    print(f"\ntarget val loss {args.target}, {args.seeds} seeds, B={args.batch_size}, T={args.seq_len}")
    print("| optimizer | LR | steps per seed | mean steps | mean CPU s |")
    print("|---|---|---|---|---|")
    for name, lr in (("AdamW", best_adamw), ("Muon", best_muon)):
        rs = rows[name.lower()]
        steps = ", ".join(str(r["steps"]) + ("" if r["reached"] else "+") for r in rs)
        print(
            f"| {name} | {lr:g} | {steps} | {statistics.mean(r['steps'] for r in rs):.0f} "
            f"| {statistics.mean(r['cpu_s'] for r in rs):.1f} |"
        )
    a, m = (statistics.mean(r["steps"] for r in rows[k]) for k in ("adamw", "muon"))
    ca, cm = (statistics.mean(r["cpu_s"] for r in rows[k]) for k in ("adamw", "muon"))
    print(f"Muon: {a / m:.2f}x fewer steps, {ca / cm:.2f}x less CPU time to the target")


if __name__ == "__main__":
    main()
