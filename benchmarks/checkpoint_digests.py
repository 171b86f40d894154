"""What checkpoint digests (SHA256SUMS) cost: save and load+verify time of one checkpoint, and the
share of it spent hashing. CPU time on one thread (time.process_time).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import torch

from gpt2 import GPT, GPTConfig
from gpt2.model.checkpoint_files import CHECKPOINT_FILES, sha256_file
from gpt2.train import checkpoint as ckpt
from gpt2.train.precision import describe_machine


def main() -> None:
    torch.set_num_threads(1)
    print(describe_machine())
    model = GPT(GPTConfig(block_size=256, vocab_size=50304, n_layer=4, n_head=8, n_embd=512))
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.zeros(1, 8, dtype=torch.long)
    model(idx, idx)[1].backward()
    optimizer.step()  # the optimizer state (exp_avg, exp_avg_sq) is part of the checkpoint
    root = tempfile.mkdtemp()
    try:
        for step in range(2):
            t = time.process_time()
            path = ckpt.save_checkpoint(root, step, model, optimizer)
            save = time.process_time() - t
            t = time.process_time()
            for name in CHECKPOINT_FILES:
                sha256_file(path / name)
            hashing = time.process_time() - t
            t = time.process_time()
            ckpt.load_checkpoint(path, model, optimizer)
            load = time.process_time() - t
            mib = sum((path / name).stat().st_size for name in CHECKPOINT_FILES) / 2**20
            print(
                f"{model.num_params() / 1e6:.1f}M parameters, {mib:.0f} MiB: save {save:.2f} s, "
                f"load+verify {load:.2f} s, hashing the files {hashing:.2f} s"
            )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
