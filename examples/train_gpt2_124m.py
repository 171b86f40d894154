"""Reproduce GPT-2 124M: build-nanogpt's 10B-token FineWeb-edu run, under torchrun.

The recipe: 524,288-token batches (2**19, ~0.5M as in GPT-3 small) made of micro-batches by
gradient accumulation, AdamW with max lr 6e-4, 715 linear warmup steps, cosine decay to 6e-5
over 19,073 steps (= 10B tokens / 524,288), weight decay 0.1, gradient clipping at 1.0, bf16,
torch.compile, vocab padded to 50304. Every 250 steps: validation loss and HellaSwag; every
5,000 steps and at the end: a checkpoint. Run it again after an interruption and it resumes
(--resume auto is the default here).

    python examples/prepare_fineweb.py                                  # 10B tokens -> data/edu_fineweb10B
    torchrun --standalone --nproc_per_node 8 examples/train_gpt2_124m.py
    torchrun --standalone --nproc_per_node 1 examples/train_gpt2_124m.py --micro-batch-size 32

On 8 A100/H100 GPUs the run takes a few hours; see docs/distributed.md. This script is
`gpt2 train --recipe gpt2-124m-fineweb`.
"""

import sys

from gpt2.cli import run_command

if __name__ == "__main__":
    sys.exit(
        run_command("train", prog="train_gpt2_124m.py", defaults={"recipe": "gpt2-124m-fineweb"}, description=__doc__)
    )
