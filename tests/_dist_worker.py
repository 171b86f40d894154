"""Worker for tests/test_distributed.py: trains a tiny GPT with the Trainer and reports rank 0's run.

Launched as ``python -m torch.distributed.run --nproc_per_node 2 --standalone tests/_dist_worker.py OUT``
(two gloo processes on CPU) or called in-process through :func:`main` (one process). Both use the
same global batch of 128 tokens per step: 2 sequences x 16 tokens x 4 micro-steps on one process,
or x 2 micro-steps x 2 processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gpt2 import GPT, GPTConfig
from gpt2.config import TrainConfig
from gpt2.trainer import Trainer

MICRO_BATCH, SEQ_LEN, TOTAL_BATCH, MAX_STEPS = 2, 16, 128, 4


def main(out_dir: str) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    tokens = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(1))
    # Validation reads eval_steps micro-batches on every process: 4 in all, either way.
    eval_steps = 4 // int(os.environ.get("WORLD_SIZE", "1"))
    config = TrainConfig(
        micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN, total_batch_size=TOTAL_BATCH, max_steps=MAX_STEPS,
        warmup_steps=1, max_lr=1e-3, eval_interval=2, eval_steps=eval_steps, checkpoint_interval=2, out_dir=out_dir,
        progress=False, device="cpu", precision="fp32", plot=False,
    )
    with Trainer(model, config, tokens[:3072], tokens[3072:], sinks=[]) as trainer:
        history = trainer.fit()
        report = {
            "rank": trainer.dist_env.rank,
            "world_size": trainer.dist_env.world_size,
            "grad_accum_steps": trainer.grad_accum_steps,
            "losses": [r["loss"] for r in history],
            "grad_norms": [r["grad_norm"] for r in history],
            "val_losses": [r.get("val_loss") for r in history],
        }
    # Every rank writes its own report (the Trainer itself writes only on rank 0).
    Path(out_dir, f"report_rank{report['rank']}.json").write_text(json.dumps(report))
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)  # two processes on a small CPU: do not oversubscribe it
    main(sys.argv[1])
