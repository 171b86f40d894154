"""Divergence recovery loses nothing: it goes back only to a state it has seen succeed, and the
metrics (metrics.jsonl, TensorBoard) are rewound to that state as a resume rewinds them.

The model is tiny and learns a repeating token pattern; at max_lr=3.0 (fp32) its loss jumps from ~4 to
hundreds on the second step, so the state saved after the first step is already a bad one.
"""

from __future__ import annotations

import logging
import re
import sys
import types

import pytest
import torch
from _tiny_run import DIVERGING_PATTERN, DIVERGING_TOKENS, diverging_config

from gpt2 import GPT, GPTConfig, TrainConfig
from gpt2.train.metrics import WandbSink, read_jsonl
from gpt2.train.trainer import Trainer

PATTERN, TOKENS = DIVERGING_PATTERN, DIVERGING_TOKENS


def _config(**overrides) -> TrainConfig:
    return diverging_config(**{"max_steps": 12, **overrides})


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
    assert trainer.recovery.recoveries == len(targets) >= 1 and trainer.step == 12
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


def test_a_recovery_rewinds_the_metrics_as_a_resume_does(tmp_path):
    """After going back to step k, metrics.jsonl and TensorBoard hold each step once, in order, with the values
    of the steps that counted; the abandoned steps stayed (16 records for 12 steps, TensorBoard showing both).
    """
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _fit(_config(checkpoint_interval=2, out_dir=str(tmp_path), log_to=("tensorboard",)))
    assert trainer.recovery.recoveries >= 1
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    # the records of the last branch: the last one logged for each step
    final = {r["step"]: r["loss"] for r in trainer.history}
    assert [r["loss"] for r in records] == [final[s] for s in range(1, 13)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, 13))
    assert [e.value for e in losses] == pytest.approx([final[s] for s in range(1, 13)], rel=1e-6)


def test_wandb_logs_the_steps_redone_after_a_recovery(tmp_path, monkeypatch):
    """W&B ignores a step lower than the last one logged: its own step keeps growing, the training step is
    logged as "step" (the charts' x-axis), so the steps redone after a recovery are not lost.
    """
    logged: list[tuple[dict, int]] = []

    class Run:
        dir = str(tmp_path / "wandb" / "run-x" / "files")

        def define_metric(self, name, step_metric=None):
            pass

        def log(self, data, step):
            logged.append((data, step))

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run()))
    sink = WandbSink(tmp_path, mode="disabled")
    for step in (1, 2, 3):
        sink.log({"step": step, "loss": float(step)})
    sink.rewind(1)
    for step in (2, 3):
        sink.log({"step": step, "loss": 10.0 * step})
    assert [step for _, step in logged] == [1, 2, 3, 4, 5]
    assert [data["step"] for data, _ in logged] == [1, 2, 3, 2, 3]
