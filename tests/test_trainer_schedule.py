"""The checkpoint schedule of one fit() call (gpt2.train.schedule) and the recovery policy's rules on
their own, without a Trainer: when a save is due, how a due save waits for a good step, and that a save
in a run of bad steps prunes nothing.
"""

from __future__ import annotations

import pytest

from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.recovery import RecoveryPolicy
from gpt2.train.schedule import CheckpointSchedule, is_due


def test_due_every_interval_and_at_the_last_step():
    assert [s for s in range(1, 11) if is_due(s, 4, max_steps=10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if is_due(s, 0, max_steps=10)] == [10]


def test_a_due_save_waits_for_a_good_step():
    schedule = CheckpointSchedule(interval=2, max_steps=10, stop=10)
    assert not schedule.save_now(1, good=True, to_disk=True)
    # due at step 2, but step 2 was bad: pending until step 4, the next good one
    assert not schedule.save_now(2, good=False, to_disk=True) and schedule.pending
    assert not schedule.save_now(3, good=False, to_disk=True)
    assert schedule.save_now(4, good=True, to_disk=True) and not schedule.pending
    assert not schedule.save_now(5, good=True, to_disk=True)


@pytest.mark.parametrize("to_disk", [True, False])
def test_the_stop_point_is_saved_to_disk_even_in_a_bad_step(to_disk):
    schedule = CheckpointSchedule(interval=0, max_steps=10, stop=5)
    assert schedule.save_now(5, good=False, to_disk=to_disk) is to_disk
    # an in-memory copy never takes a bad state
    assert schedule.pending is not to_disk


def test_recovery_policy_counts_bad_steps_and_keeps_checkpoints_in_trouble():
    policy = RecoveryPolicy(
        TrainConfig(out_dir=None, recovery=RecoveryConfig(max_bad_steps=2), keep_last_checkpoints=3)
    )
    record = {"loss": 4.0, "scored_tokens": 8}
    assert policy.good and policy.checkpoints_to_keep() == 3
    policy.count_step(bad=True)
    assert not policy.judge(record) and not policy.good and policy.checkpoints_to_keep() == 0
    policy.count_step(bad=True)
    assert policy.judge(record)
    policy.count_step(bad=False)
    assert policy.consecutive_bad_steps == 0 and policy.good
    state = {"recoveries": 2, "lr_scale": 0.25, "monitor": {"best": 3.5, "streak": 0}, "confirmed": []}
    policy.count_step(bad=True)
    policy.load_state_dict(state)
    policy.saved_checkpoint(0)
    assert policy.state_dict() == state and policy.consecutive_bad_steps == 0
