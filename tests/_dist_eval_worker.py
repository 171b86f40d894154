"""Worker for tests/test_final_eval.py: the final validation report of a run, on 1 or 2 ranks.

Launched as ``python -m torch.distributed.run --nproc_per_node 2 --standalone
tests/_dist_eval_worker.py OUT`` (two gloo processes on CPU) or called in-process through
:func:`main` (one process). No training: the same weights on every rank, so the final report
must give the one-process loss whatever the number of ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gpt2 import GPT, GPTConfig
from gpt2.config import TrainConfig
from gpt2.jobs.common import final_report
from gpt2.jobs.options import SamplingOptions
from gpt2.trainer import Trainer

B, T = 2, 16
VAL_BATCHES = 5  # odd: under 2 ranks one scores 3 batches and the other 2


def main(out_dir: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    tokens = torch.randint(0, 128, (2048 + VAL_BATCHES * B * T + 1,), generator=torch.Generator().manual_seed(1))
    train, val = tokens[:2048], tokens[2048:]
    config = TrainConfig(micro_batch_size=B, seq_len=T, total_batch_size=B * T * int(os.environ.get("WORLD_SIZE", "1")),
                         max_steps=1, eval_interval=0, progress=False, device="cpu", precision="fp32", plot=False,
                         out_dir=None)
    no_samples = SamplingOptions(num_samples=0)
    with Trainer(model, config, train, val, sinks=[]) as trainer:
        forwards = []
        hook = trainer.model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
        full = final_report(trainer, val, no_samples, final_eval_batches=None)
        hook.remove()
        report = {
            "rank": trainer.dist_env.rank,
            "full": full,
            "full_forwards": len(forwards),  # the batches this rank scored
            "capped": final_report(trainer, val, no_samples, final_eval_batches=3),
            # Trainer.evaluate on a val set shorter than steps: every rank stops at the same batch
            "evaluate": trainer.evaluate(steps=50),
        }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, f"report_rank{report['rank']}.json").write_text(json.dumps(report))
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
