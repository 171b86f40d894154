"""Divergence recovery on Tiny Shakespeare: a run at a learning rate far too high for it.

Runs of the same small GPT (2 layers, 64 wide, GPT-2 tokens; same seed, data and steps), fp32 on
one CPU thread, one line each (recoveries, final training loss = mean of the last 10 steps,
validation loss, CPU seconds):

* ``lr=--safe-lr``: the reference;
* ``lr=--lr`` (3.0) with ``recovery.enabled=False``: what the Trainer did before recovery existed (the
  loss climbs to hundreds and stays there; the run ends normally, with no warning);
* ``lr=--lr`` with the default recovery settings (``TrainConfig.recovery``);
* ``--factors F ...``: the same with ``recovery.lr_factor=F``.

The recovery lines the Trainer logs are shown indented::

    PYTHONPATH=. python benchmarks/divergence_recovery.py
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from gpt2 import GPT, GPTConfig, RecoveryConfig, TrainConfig
from gpt2.data.sources import training_data
from gpt2.train.precision import describe_machine
from gpt2.train.trainer import Trainer, TrainingDivergedError


def run(lr: float, args: argparse.Namespace, train, val, **recovery) -> str:
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(block_size=args.seq_len, n_layer=2, n_head=2, n_embd=args.width))
    config = TrainConfig(
        micro_batch_size=args.batch_size,
        seq_len=args.seq_len,
        max_steps=args.steps,
        max_lr=lr,
        warmup_steps=args.steps // 10,
        precision="fp32",
        device="cpu",
        out_dir=None,
        eval_interval=0,
        eval_steps=args.eval_batches,
        progress=False,
        plot=False,
        seed=args.seed,
        recovery=RecoveryConfig(**recovery),
    )
    start = time.process_time()
    settings = ", ".join(f"{k}={v}" for k, v in recovery.items()) or "defaults"
    with Trainer(model, config, train, val, sinks=[]) as trainer:
        try:
            history = trainer.fit()
        except TrainingDivergedError as e:
            cpu = time.process_time() - start
            return f"lr={lr:g} ({settings}): TrainingDivergedError at step {e.step} ({cpu:.0f} s CPU)"
        val_loss = trainer.evaluate()
    final = sum(r["loss"] for r in history[-10:]) / 10
    line = (
        f"lr={lr:g} ({settings}): {trainer.recovery.recoveries} recoveries, LR x{trainer.recovery.lr_scale:g}, "
        "final train loss "
        f"{final:.3f} (mean of the last 10 steps), val loss {val_loss:.3f} ({time.process_time() - start:.0f} s CPU)"
    )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3.0)
    parser.add_argument("--safe-lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--factors", type=float, nargs="*", default=[], help="recovery.lr_factor values to try too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(describe_machine(), flush=True)
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")  # the recovery lines
    train, val = training_data("shakespeare", None, 0.1)
    print(run(args.safe_lr, args, train, val), flush=True)
    print(run(args.lr, args, train, val, enabled=False), flush=True)
    print(run(args.lr, args, train, val), flush=True)
    for factor in args.factors:
        print(run(args.lr, args, train, val, lr_factor=factor), flush=True)


if __name__ == "__main__":
    main()
