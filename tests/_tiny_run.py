"""The tiny Trainer runs that the checkpoint and run-directory tests share: a 1-layer, 16-wide
GPT over a 64-token vocabulary, random tokens, and a TrainConfig that checkpoints often; and what the generation
tests share (a model whose tokens depend on the context, greedy decoding's reference loop).
"""

from __future__ import annotations

import torch

from gpt2 import GPT, GPTConfig
from gpt2.train.config import RecoveryConfig, TrainConfig


def tiny_config(out_dir, **overrides) -> TrainConfig:
    base = dict(
        micro_batch_size=2,
        seq_len=16,
        max_steps=4,
        max_lr=1e-3,
        out_dir=str(out_dir),
        progress=False,
        eval_interval=0,
        plot=False,
        checkpoint_interval=2,
        keep_last_checkpoints=0,
    )
    return TrainConfig(**{**base, **overrides})


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))


def tiny_tokens() -> torch.Tensor:
    return torch.randint(0, 64, (1024,), generator=torch.Generator().manual_seed(1))


# A learnable token stream (a 97-token pattern repeated): a safe LR brings the loss well below its start.
DIVERGING_PATTERN = torch.randint(0, 64, (97,), generator=torch.Generator().manual_seed(1))
DIVERGING_TOKENS = DIVERGING_PATTERN.repeat(60)


def diverging_config(**overrides) -> TrainConfig:
    """The recovery tests' run: LR 3.0 diverges on :data:`DIVERGING_TOKENS`; each recovery cuts it 10x."""
    base = dict(
        micro_batch_size=4,
        seq_len=32,
        max_steps=16,
        max_lr=3.0,
        min_lr=0.3,
        precision="fp32",
        device="cpu",
        out_dir=None,
        progress=False,
        eval_interval=0,
        plot=False,
        recovery=RecoveryConfig(lr_factor=0.1),
    )
    return TrainConfig(**{**base, **overrides})


class Batches:
    """A loader that hands out the given ``(x, y)`` batches in turn; its batch size and sequence length are the
    first batch's.
    """

    def __init__(self, batches: list[tuple]) -> None:
        self.batches, self.i = batches, 0
        self.batch_size, self.seq_len = batches[0][0].shape
        self.rank, self.world_size = 0, 1

    def next_batch(self) -> tuple:
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]


def context_dependent_model(config: GPTConfig) -> GPT:
    """A model in eval mode whose tokens depend on the whole context. At GPT-2's init a random model mostly echoes
    its last token and barely reads positions; larger random weights make every token depend on the whole
    (positioned) context, so a wrong position or mask changes the output.
    """
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def argmax_loop(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding's reference, nanoGPT's loop: per token a full forward over the last block_size tokens, the
    argmax of its last logits.
    """
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -model.config.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


class _Payload:
    """Unpickling this creates the file ``marker``: the proof that something was unpickled."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_payload(checkpoint, name: str, marker) -> None:
    """Replace ``checkpoint/name`` with a pickle that would create ``marker``, and re-sign SHA256SUMS (as anyone who
    can write the folder can).
    """
    import pickle

    from gpt2.model.checkpoint_files import DIGEST_FILE, sha256_file

    (checkpoint / name).write_bytes(pickle.dumps(_Payload(marker)))
    names = [line.split(maxsplit=1)[1] for line in (checkpoint / DIGEST_FILE).read_text().splitlines()]
    names += [name] if name not in names else []
    (checkpoint / DIGEST_FILE).write_text("".join(f"{sha256_file(checkpoint / n)}  {n}\n" for n in names))
