"""Which steps evaluate and save: :func:`is_due` (every ``interval`` steps, and the last step) and the
:class:`CheckpointSchedule` of one ``fit()`` call, which holds a due checkpoint back until a good step.
"""

from __future__ import annotations


def is_due(step: int, interval: int, max_steps: int) -> bool:
    """Is ``step`` (just taken) due for a task run every ``interval`` steps (0 = never)? The last step always is."""
    return step == max_steps or (interval > 0 and step % interval == 0)


class CheckpointSchedule:
    """When one ``fit()`` call saves: every ``interval`` steps, at the run's last step (``max_steps``) and at the
    call's ``stop``. A save that falls due during a run of bad steps (skipped, or part of a diverging streak) is
    *pending* until the next good step, so the last good checkpoint stays the newest one. The stop point is saved
    anyway when it goes to disk (its weights are finite: skipped steps never touch them), so that the run can resume.
    """

    def __init__(self, interval: int, max_steps: int, stop: int) -> None:
        self.interval = interval
        self.max_steps = max_steps
        self.stop = stop
        # a save fell due but waits for a good step
        self.pending = False

    def save_now(self, step: int, *, good: bool, to_disk: bool) -> bool:
        """After ``step`` (one that was not rolled back): must it be saved now? ``good``: the step was neither
        skipped nor diverging; ``to_disk``: the save is a checkpoint (not an in-memory copy).
        """
        self.pending = self.pending or is_due(step, self.interval, self.max_steps) or step == self.stop
        if self.pending and (good or (step == self.stop and to_disk)):
            self.pending = False
            return True
        return False
