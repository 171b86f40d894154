"""Pretrain GPT-2 from scratch on Tiny Shakespeare, then print the validation loss and samples.

On a CUDA GPU this is the 124M reference run (B=16, T=1024, bf16, torch.compile, vocab padded
to 50304); on a CPU a 4-layer, 128-wide model reads the text once in about 3 minutes. Every option can be
changed (see below), e.g.:

    python examples/pretrain_shakespeare.py                          # the defaults for this machine
    python examples/pretrain_shakespeare.py --max-steps 500 --model gpt2 --seq-len 256
    python examples/pretrain_shakespeare.py --out-dir runs/shakespeare --resume auto   # continue a run
    torchrun --nproc_per_node 2 examples/pretrain_shakespeare.py     # data parallel

The run directory (--out-dir) gets metrics.jsonl, loss.png, checkpoints/ and results.json;
`python examples/sample.py --model runs/shakespeare` samples from it later. This script is
`gpt2 train --recipe shakespeare`: the same code, the same options.
"""

import sys

from gpt2.cli import run_command

if __name__ == "__main__":
    sys.exit(
        run_command("train", prog="pretrain_shakespeare.py", defaults={"recipe": "shakespeare"}, description=__doc__)
    )
