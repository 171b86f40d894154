"""Automatic recovery from divergence (TrainConfig.recover): back to the last good state, a lower
learning rate, the batches that blew up skipped; a run that never diverges is unchanged, resume
stays exact across a recovery, and after max_recoveries the run stops with TrainingDivergedError.

The model is tiny and learns a repeating token pattern; at max_lr=3.0 (fp32) its loss jumps from
~4 to hundreds within a few steps and stays there, which is what divergence looks like.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import pytest
import torch
from _tiny_run import DIVERGING_PATTERN, DIVERGING_TOKENS, diverging_config
from conftest import dist_job

from gpt2 import GPT, GPTConfig, RecoveryConfig, TrainConfig
from gpt2.model.checkpoint_files import checkpoint_step
from gpt2.train import checkpoint as ckpt
from gpt2.train.optim import lr_at
from gpt2.train.trainer import Trainer, TrainingDivergedError

PATTERN, TOKENS = DIVERGING_PATTERN, DIVERGING_TOKENS


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32))


def _config(**overrides) -> TrainConfig:
    return diverging_config(**overrides)


def _fit(config: TrainConfig, model: GPT | None = None, until: int | None = None) -> tuple[Trainer, list[dict]]:
    with Trainer(model or _model(), config, TOKENS, sinks=[]) as trainer:
        history = trainer.fit(until)
    return trainer, history


def _nan_loss_on_calls(model: GPT, calls: set[int]) -> None:
    """The loss of these forward calls (1-based) is NaN, as after an overflow."""
    count = {"n": 0}

    def hook(module, inputs, output):
        count["n"] += 1
        if count["n"] in calls:
            return output[0], output[1] * float("nan")

    model.register_forward_hook(hook)


def test_a_diverging_run_recovers_with_a_lower_lr_and_finishes(caplog):
    _, unguarded = _fit(_config(recovery=RecoveryConfig(enabled=False, lr_factor=0.1)))
    assert unguarded[-1]["loss"] > 50  # today: the loss stays in the hundreds, no error
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        trainer, history = _fit(_config())
    lines = [r.getMessage() for r in caplog.records if "recovery " in r.getMessage()]
    assert trainer.recovery.recoveries == len(lines) >= 1
    assert "the loss stayed above 2 x the best loss" in lines[0] and "in-memory copy" in lines[0]
    assert trainer.step == 16 and history[-1]["step"] == 16
    assert history[-1]["loss"] < history[0]["loss"] < 5  # it learns again, below the untrained loss
    # after the last recovery every step runs at the schedule's LR times 0.1 ** recoveries
    scale = 0.1**trainer.recovery.recoveries
    for record in history[-3:]:
        expected = lr_at(record["step"] - 1, max_lr=3.0, min_lr=0.3, warmup_steps=0, max_steps=16)
        assert record["lr"] == pytest.approx(scale * expected, rel=1e-12)


def test_a_run_that_never_diverges_is_bit_for_bit_unchanged():
    (guarded, a), (plain, b) = (
        _fit(_config(max_lr=0.01, min_lr=None)),
        _fit(_config(max_lr=0.01, min_lr=None, recovery=RecoveryConfig(enabled=False))),
    )
    assert guarded.recovery.recoveries == 0 and [r["loss"] for r in a] == [r["loss"] for r in b]
    for (name, x), y in zip(guarded.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(x, y), name


def test_non_finite_steps_go_back_to_the_last_good_state_and_skip_their_batches():
    """NaN losses on steps 4-6 (max_bad_steps=3): back to the copy taken at step 2 (the last
    due checkpoint), LR halved, the batches of steps 3-6 skipped. The reference is a plain run
    of 2 steps that then skips 4 batches and halves its LR.
    """
    config = _config(max_lr=0.01, min_lr=None, checkpoint_interval=2, recovery=RecoveryConfig(max_bad_steps=3))
    model = _model()
    _nan_loss_on_calls(model, {4, 5, 6})
    recovered, history = _fit(config, model)
    assert recovered.recovery.recoveries == 1 and recovered.recovery.lr_scale == 0.5
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6, *range(3, 17)]

    with Trainer(_model(), config, TOKENS, sinks=[]) as reference:
        reference.fit(2)
        for _ in range(4):  # steps 3-6 of the recovered run read these batches
            reference.train_loader.next_batch()
        reference.recovery.lr_scale = 0.5
        expected = reference.fit()
    assert [r["loss"] for r in history[6:]] == [r["loss"] for r in expected]
    for x, y in zip(recovered.model.parameters(), reference.model.parameters()):
        assert torch.equal(x, y)


def test_resume_is_exact_across_a_recovery(tmp_path):
    """Checkpoints record the LR factor, the recovery count and the divergence monitor: a run
    stopped after its recovery and resumed ends where the uninterrupted one does.
    """
    whole, _ = _fit(_config(checkpoint_interval=2, out_dir=str(tmp_path / "whole")))
    assert whole.recovery.recoveries >= 1
    stopped, _ = _fit(_config(checkpoint_interval=2, out_dir=str(tmp_path / "parts")), until=12)
    assert stopped.recovery.recoveries == whole.recovery.recoveries  # the recovery happened before the stop
    resumed, history = _fit(_config(checkpoint_interval=2, out_dir=str(tmp_path / "parts"), resume="auto"))
    assert (
        resumed.recovery.recoveries == whole.recovery.recoveries
        and resumed.recovery.lr_scale == whole.recovery.lr_scale
    )
    assert [r["loss"] for r in history] == [r["loss"] for r in whole.history[-len(history) :]]
    for x, y in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(x, y)


def test_recovery_goes_back_to_a_checkpoint_written_before_the_divergence(tmp_path, caplog):
    config = _config(max_lr=0.05, min_lr=None, checkpoint_interval=3, out_dir=str(tmp_path))
    model = _model()
    _nan_loss_on_calls(model, {8, 9, 10, 11, 12})  # max_bad_steps=5: steps 8-12
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        trainer, history = _fit(config, model)
    assert trainer.recovery.recoveries == 1
    assert any(
        "back to step 6 (checkpoint" in r.getMessage() and "step_000006" in r.getMessage() for r in caplog.records
    )
    assert [r["step"] for r in history][12:14] == [7, 8]


def test_after_max_recoveries_the_run_stops_with_training_diverged_error():
    model = _model()
    _nan_loss_on_calls(model, set(range(3, 100)))
    config = _config(
        max_lr=0.01, min_lr=None, recovery=RecoveryConfig(max_bad_steps=2, max_recoveries=2, lr_factor=0.1)
    )
    with pytest.raises(TrainingDivergedError, match="after 2 recoveries") as info:
        _fit(config, model)
    assert math.isnan(info.value.loss)


def test_lora_runs_recover_and_never_touch_the_frozen_weights():
    from minlora import add_lora

    model = _model()
    add_lora(model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer, history = _fit(
        _config(max_lr=30.0, min_lr=3.0, recovery=RecoveryConfig(max_recoveries=5, lr_factor=0.1)), model
    )
    assert trainer.recovery.recoveries >= 1 and math.isfinite(history[-1]["loss"])
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


def test_diverged_error_names_no_checkpoint_when_none_was_followed_by_a_good_step(tmp_path):
    """max_lr 1000: every step after the first blows up, so step_000001 is written but its next loss diverged;
    the error does not send the user back to it (resuming it diverges at once) but says what to change.
    """
    config = _config(
        max_lr=1000.0,
        min_lr=None,
        out_dir=str(tmp_path),
        checkpoint_interval=1,
        recovery=RecoveryConfig(max_recoveries=1),
    )
    with pytest.raises(TrainingDivergedError, match="No checkpoint of this run is known good.*lower max_lr") as info:
        _fit(config)
    assert info.value.last_checkpoint is None and "\n" not in str(info.value)
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()


def test_the_checkpoint_named_last_good_resumes_without_diverging_at_once(tmp_path):
    # the warmup gives the run one good step before it blows up
    config = _config(
        out_dir=str(tmp_path), warmup_steps=8, checkpoint_interval=1, recovery=RecoveryConfig(max_recoveries=0)
    )
    with pytest.raises(TrainingDivergedError) as info:
        _fit(config)
    named = info.value.last_checkpoint
    assert named is not None and f"The last good checkpoint is {named}" in str(info.value)
    # every checkpoint written after it belongs to the steps that diverged
    assert named != ckpt.list_checkpoints(tmp_path / "checkpoints")[-1]
    step = checkpoint_step(named)
    trainer, history = _fit(dataclasses.replace(config, resume=str(named), overwrite=True), until=step + 1)
    assert trainer.recovery.streak == 0 and math.isfinite(history[0]["loss"])


@pytest.mark.parametrize(
    "field, value",
    [("lr_factor", 1.5), ("lr_factor", 0.0), ("divergence_factor", 1.0), ("max_recoveries", -1)],
)
def test_recovery_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=f"RecoveryConfig.{field}"):
        _config(recovery={field: value})


@pytest.mark.slow
@pytest.mark.dist
def test_every_rank_takes_the_same_recovery_decision(tmp_path, dist_run):
    """2 gloo processes at max_lr=3 (tests/_dist_worker.py's ``recovery`` job, in the session's one
    torchrun launch): both ranks judge the all-reduced loss, so they recover at the same step to
    the same state, each logging its decision once; the losses equal a 1-process run of the same
    global batch (which also recovers), recovery included, and metrics.jsonl went back with it.
    """
    import json

    def losses(out: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]

    ranks = dist_run.reports("recovery")
    one = dist_job("recovery", tmp_path)
    assert one["recoveries"] >= 1 and "recovery 1 of 3" in one["recovery_lines"][0]
    for rank in ranks:
        assert rank["recoveries"] == one["recoveries"]
        assert len(rank["recovery_lines"]) == rank["recoveries"]  # each rank logs each decision once
    assert ranks[0]["recovery_lines"] == ranks[1]["recovery_lines"]
    # the recovery went back, and metrics.jsonl with it: each step once
    assert len(losses(tmp_path)) == 8
    two = losses(dist_run.out / "recovery")
    torch.testing.assert_close(torch.tensor(two), torch.tensor(losses(tmp_path)), rtol=1e-4, atol=1e-5)


def test_a_run_near_zero_loss_is_not_diverged_by_noisy_batches():
    """A model that fits its data down to 0.0165 sees batches of 0.03-0.19 (2-11x the best): noise,
    not divergence. It took three recoveries and TrainingDivergedError before the 1-nat margin.
    """
    from gpt2.train.recovery import RecoveryPolicy

    def monitor_with(patience: int) -> RecoveryPolicy:
        return RecoveryPolicy(
            TrainConfig(out_dir=None, recovery=RecoveryConfig(divergence_factor=2.0, patience=patience))
        )

    monitor = monitor_with(patience=3)
    losses = [10.9, 3.0, 0.5, 0.0165] + [0.03, 0.19, 0.11, 0.07, 0.15, 0.19] * 3
    assert not any(monitor.observe(loss) for loss in losses)
    # a real climb from there is still caught: above 2x the best and by more than 1 nat, 3 times
    assert [monitor.observe(loss) for loss in [1.5, 4.0, 9.0]] == [False, False, True]
    fresh = monitor_with(patience=2)  # early in a run the factor decides, as before
    assert [fresh.observe(loss) for loss in [10.9, 22.0, 25.0]] == [False, False, True]


def test_a_stop_in_the_middle_of_bad_steps_keeps_the_good_checkpoint_to_go_back_to(tmp_path):
    """fit(until_step) (or a stop signal) inside a run of NaN steps saves there, as every stop point
    is saved; with keep_last_checkpoints=1 that save pruned the last good checkpoint, and the
    recovery that followed had nothing to go back to (TrainingDivergedError after 0 recoveries).
    """
    model = _model()
    _nan_loss_on_calls(model, {4, 5, 6})  # steps 4, 5, 6
    config = _config(
        max_lr=1e-3,
        min_lr=1e-4,
        out_dir=str(tmp_path),
        checkpoint_interval=2,
        keep_last_checkpoints=1,
        recovery=RecoveryConfig(max_bad_steps=3),
    )
    with Trainer(model, config, TOKENS, sinks=[]) as trainer:
        trainer.fit(5)  # stops after two of the three bad steps
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000005"]
        trainer.fit()
        assert trainer.recovery.recoveries == 1 and trainer.step == 16
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000016"]  # pruned again once good


def test_a_second_fit_does_not_copy_the_state_its_first_fit_left(monkeypatch):
    from gpt2.train.recovery import RecoveryPolicy

    copied = []
    refresh = RecoveryPolicy.refresh_snapshot

    def counting(self, trainer):
        copied.append(trainer.step)
        refresh(self, trainer)

    monkeypatch.setattr(RecoveryPolicy, "refresh_snapshot", counting)
    with Trainer(_model(), _config(out_dir=None, max_steps=4, max_lr=1e-3, min_lr=1e-4), TOKENS, sinks=[]) as trainer:
        trainer.fit(until_step=2)
        after_first = list(copied)
        trainer.fit()
    # the second fit() starts from the copy of step 2 the first one left
    assert after_first[-1] == 2 and copied.count(2) == 1, copied
