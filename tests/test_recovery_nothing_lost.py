"""Divergence recovery loses nothing (issue 27): it goes back only to a state it has seen succeed, and the
metrics (metrics.jsonl, TensorBoard) are rewound to that state as a resume rewinds them.

The model is tiny and learns a repeating token pattern; at max_lr=3.0 (fp32) its loss jumps from ~4 to
hundreds on the second step, so the state saved after the first step is already a bad one.
"""

from __future__ import annotations

import logging
import re

import torch

from gpt2 import GPT, GPTConfig, TrainConfig
from gpt2.train.trainer import Trainer

PATTERN = torch.randint(0, 64, (97,), generator=torch.Generator().manual_seed(1))
TOKENS = PATTERN.repeat(60)


def _config(**overrides) -> TrainConfig:
    base = dict(
        micro_batch_size=4,
        seq_len=32,
        max_steps=12,
        max_lr=3.0,
        min_lr=0.3,
        precision="fp32",
        device="cpu",
        out_dir=None,
        progress=False,
        eval_interval=0,
        plot=False,
        recovery_lr_factor=0.1,
    )
    return TrainConfig(**{**base, **overrides})


def _fit(config: TrainConfig) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    with Trainer(model, config, TOKENS, sinks=[]) as trainer:
        trainer.fit()
    return trainer


def _judged_good(losses: list[float], factor: float = 2.0) -> bool:
    """Whether the last of ``losses`` (one branch of the run, in order) is below the divergence threshold."""
    *before, loss = losses
    best = min(before, default=float("inf"))
    return not (loss > factor * best and loss > best + 1.0)


def test_recovery_goes_back_only_to_a_state_whose_next_loss_was_good(tmp_path, caplog):
    """checkpoint_interval=1 at a diverging LR: step_000001 is written after a good step 1, but step 2's loss
    (measured on its weights) is already 40x the best. Every recovery went back to it and the run gave up after
    max_recoveries; now it goes back to a confirmed state (here the copy taken before step 1) and finishes.
    """
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        trainer = _fit(_config(checkpoint_interval=1, out_dir=str(tmp_path)))
    targets = [int(m) for r in caplog.records for m in re.findall(r"back to step (\d+)", r.getMessage())]
    assert trainer.recoveries == len(targets) >= 1 and trainer.step == 12
    # Replay the run's records branch by branch: the step after each restored state was judged good.
    branch: list[dict] = []
    restored = iter(targets)
    for record in trainer.history:
        if branch and record["step"] <= branch[-1]["step"]:
            target = next(restored)
            assert record["step"] == target + 1
            following = [r["loss"] for r in branch if r["step"] <= target + 1]
            assert _judged_good(following), (target, following)
            branch = [r for r in branch if r["step"] <= target]
        branch.append(record)


def _checkpoints(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_no_save_prunes_the_newest_confirmed_checkpoint(tmp_path):
    """keep_last_checkpoints=1 with a checkpoint every step: the newest one awaits the next step's loss, so the
    one before it (confirmed) stays too, and is recorded as confirmed for a resume; the run's last save prunes
    as it is told.
    """
    import json

    config = _config(max_lr=1e-3, min_lr=1e-4, checkpoint_interval=1, keep_last_checkpoints=1, out_dir=str(tmp_path))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    with Trainer(model, config, TOKENS, sinks=[]) as trainer:
        trainer.fit(5)
        assert _checkpoints(tmp_path) == ["step_000004", "step_000005"]
        meta = json.loads((tmp_path / "checkpoints" / "step_000005" / "trainer_state.json").read_text())
        # recorded before that save pruned step 3 (confirmed too)
        assert meta["recovery"]["confirmed"] == [3, 4]
        trainer.fit()
    assert _checkpoints(tmp_path) == ["step_000012"]
