"""What stops a run early and what brings it back: a stop signal (:class:`gpt2.files.StopSignals`) ends it at a step
boundary with :class:`TrainingInterrupted`; :class:`DivergenceMonitor` says when the loss has diverged.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any


class TrainingInterrupted(KeyboardInterrupt):
    """A stop signal ended :meth:`gpt2.Trainer.fit` at a step boundary, after a checkpoint (``checkpoint`` is None
    without ``out_dir``). A KeyboardInterrupt, so code that catches Ctrl-C catches it; the command line exits with
    ``128 + signum`` (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
    """

    def __init__(self, signum: int, *, step: int, checkpoint: Path | None):
        name = signal.Signals(signum).name
        saved = f"checkpoint {checkpoint}" if checkpoint is not None else "nothing saved (no out_dir)"
        super().__init__(f"interrupted by {name} after step {step}; {saved}")
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint


class DivergenceMonitor:
    """Counts the steps in a row whose loss exceeds ``factor`` x the lowest loss so far, and it by
    over 1 nat (near a loss of 0, twice the best is one noisy batch). The lowest loss is at most the
    untrained model's first, so a run climbing above that counts too. Its state is checkpointed.
    """

    def __init__(self, factor: float, patience: int) -> None:
        self.factor = factor
        self.patience = patience
        self.best = math.inf
        self.streak = 0
        self.streak_start = 0  # first step of the current streak

    def observe(self, step: int, loss: float) -> bool:
        """Record ``step``'s loss; True once the run has diverged."""
        if not math.isfinite(loss):  # non-finite steps are skipped and counted by the Trainer
            return False
        if loss > self.factor * self.best and loss > self.best + 1.0:
            self.streak_start = self.streak_start if self.streak else step
            self.streak += 1
        else:
            self.streak = 0
            self.best = min(self.best, loss)
        return self.streak >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best if math.isfinite(self.best) else None,
            "streak": self.streak,
            "start": self.streak_start,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.best = math.inf if state.get("best") is None else float(state["best"])
        self.streak = int(state.get("streak", 0))
        self.streak_start = int(state.get("start", 0))
