"""What stops a run early and what brings it back: a stop signal (:class:`gpt2.files.StopSignals`) ends it at a step
boundary with :class:`TrainingInterrupted`; :class:`RecoveryPolicy` judges every step and, when
the run has diverged, takes it back to its newest good state or stops it with :class:`TrainingDivergedError`.
"""

from __future__ import annotations

import copy
import logging
import math
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpt2.errors import Gpt2Error
from gpt2.model.checkpoint_files import checkpoint_step
from gpt2.train import checkpoint as ckpt
from gpt2.train.config import TrainConfig

if TYPE_CHECKING:
    from gpt2.train.trainer import Trainer

logger = logging.getLogger(__name__)


class TrainingInterrupted(KeyboardInterrupt):
    """A stop signal ended :meth:`gpt2.Trainer.fit` at a step boundary, after a checkpoint (``checkpoint`` is None
    without ``out_dir``). A KeyboardInterrupt, so code that catches Ctrl-C catches it; the command line exits with
    ``128 + signum`` (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
    """

    def __init__(self, signum: int, *, step: int, checkpoint: Path | None):
        saved = "nothing saved (no out_dir)"
        if checkpoint is not None:
            saved = f"checkpoint {checkpoint}"
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}; {saved}")
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint


class TrainingDivergedError(Gpt2Error, RuntimeError):
    """Training diverged (non-finite steps, or a loss run-away) and could not recover, or the weights
    to be saved are non-finite.
    """

    def __init__(self, message: str, *, step: int, loss: float, grad_norm: float, last_checkpoint: Path | None):
        super().__init__(message)
        self.step = step
        self.loss = loss
        self.grad_norm = grad_norm
        self.last_checkpoint = last_checkpoint


def last_good(checkpoint: Path | None) -> str:
    """Where an error message sends the user back to: a checkpoint confirmed good (the step after it had a good
    loss), or the news that there is none.
    """
    if checkpoint is None:
        return "No checkpoint of this run is known good (none was followed by a step with a good loss)"
    return f"The last good checkpoint is {checkpoint}"


class RecoveryPolicy:
    """Divergence recovery for one :class:`~gpt2.train.trainer.Trainer` (``TrainConfig.recovery``;
    docs/training.md, "When a run goes wrong"). It owns everything that decides and performs a recovery:

    - the judgement of each step: the divergence monitor of the loss (:meth:`observe`: the lowest loss so far
      ``best``, the ``streak`` of steps in a row above it) and the count of non-finite
      (skipped) steps in a row (``consecutive_bad_steps``);
    - what a recovery changed: ``recoveries`` so far and ``lr_scale`` (``lr_factor ** recoveries``, which
      multiplies the scheduled learning rate); checkpoints record these with the monitor (:meth:`state_dict`);
    - the states to go back to: only states it has seen succeed. The loss of step s is measured on the weights of
      step s - 1, so a state saved after step s (a checkpoint, or an in-memory copy) is *confirmed* good only once
      step s + 1's loss was judged good; until then it waits in ``unconfirmed``, and a bad step s + 1 refutes it.
      Confirmed are the steps of checkpoints in ``confirmed`` (recorded in each checkpoint, so a resume knows the
      older ones) and the in-memory ``snapshot``, kept until a checkpoint is confirmed. So that one is always
      there, no save prunes the newest confirmed checkpoint (:meth:`checkpoints_to_keep`).

    Every rank decides alike: the loss and gradient norm it judges are all-reduced.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        # A confirmed in-memory copy of the Trainer's state_dict() (on the CPU: about 3x the trainable parameters'
        # size with AdamW, as docs/training.md says), kept until a checkpoint is confirmed.
        self.snapshot: dict[str, Any] | None = None
        # a fresh run's counters, monitor and confirmed checkpoints, and no saved state yet
        self.load_state_dict(None)

    # ------------------------------------------------------------------ judging steps
    def observe(self, loss: float) -> bool:
        """Record a step's loss; True once the run has diverged: the loss exceeded ``divergence_factor`` x the
        lowest loss so far, and it by over 1 nat (near a loss of 0, twice the best is one noisy batch), ``patience``
        steps in a row. The lowest loss is at most the untrained model's first, so a run climbing above that counts
        too.
        """
        # non-finite steps are skipped and counted by the Trainer (count_step)
        if not math.isfinite(loss):
            return False
        if loss > self.config.recovery.divergence_factor * self.best and loss > self.best + 1.0:
            self.streak += 1
        else:
            self.streak = 0
            self.best = min(self.best, loss)
        return self.streak >= self.config.recovery.patience

    def count_step(self, bad: bool) -> None:
        """Count an optimizer step: a bad one (a non-finite loss or gradient norm: a real numerical problem, not fp16's
        scale search) extends the run of bad steps, any other ends it.
        """
        if bad:
            self.consecutive_bad_steps += 1
        else:
            self.consecutive_bad_steps = 0

    def judge(self, record: dict[str, Any]) -> bool:
        """Judge a step's ``record`` (:meth:`observe`); True when the run must go back (or, with recovery off,
        stop): the loss has diverged (only with recovery on), or ``max_bad_steps`` steps in a row were non-finite.
        With recovery off the steps are judged too, so that an error names only a checkpoint confirmed good.
        """
        # A step with no scored target reports loss 0 (and changes no weight): no evidence either way.
        judged = record.get("scored_tokens", 1) > 0
        diverged = judged and self.observe(record["loss"]) and self.config.recovery.enabled
        # The step after the newest saved state was judged: a good step confirms that state, a bad one refutes it.
        saved = self.unconfirmed
        if judged:
            self.unconfirmed = None
        if judged and saved is not None and self.good:
            step, snapshot = saved
            # The confirmed in-memory copy, or none: a confirmed checkpoint is newer than any copy.
            self.snapshot = snapshot
            if snapshot is None:
                self.confirmed.add(step)
        return diverged or self.consecutive_bad_steps >= self.config.recovery.max_bad_steps

    @property
    def good(self) -> bool:
        """The last step was neither skipped nor part of a diverging streak: a state worth saving."""
        return self.consecutive_bad_steps == 0 and self.streak == 0

    def checkpoints_to_keep(self, checkpoint_dir: Path | None = None, step: int = 0) -> int:
        """``keep_last_checkpoints`` for a save of ``step`` now, into ``checkpoint_dir``: a save in a run of bad steps
        (a stop point, a signal) prunes nothing, and no save prunes the newest confirmed checkpoint, as the recovery
        that may follow needs it to go back to (so up to the newest ``keep_last_checkpoints`` and every checkpoint
        from the newest confirmed one on are kept). The run's last step prunes as it is told: no recovery follows.
        """
        keep = self.config.keep_last_checkpoints
        if not self.good:
            return 0
        if not keep or not self.config.recovery.enabled or checkpoint_dir is None or step >= self.config.max_steps:
            return keep
        newest_confirmed = self.newest_confirmed(checkpoint_dir)
        if newest_confirmed is None:
            return keep
        first_kept = checkpoint_step(newest_confirmed) or 0
        # the steps on disk after the save (the same step saved again replaces its old copy)
        steps = {checkpoint_step(p) or 0 for p in ckpt.list_checkpoints(checkpoint_dir)} | {step}
        return max(keep, len([s for s in steps if s >= first_kept]))

    def _confirmed_checkpoints(self, checkpoint_dir: Path | None) -> list[Path]:
        """The complete checkpoints under ``checkpoint_dir`` confirmed good, newest first."""
        if checkpoint_dir is None:
            return []
        return [
            path for path in reversed(ckpt.list_checkpoints(checkpoint_dir)) if checkpoint_step(path) in self.confirmed
        ]

    def newest_confirmed(self, checkpoint_dir: Path | None) -> Path | None:
        """The newest complete checkpoint under ``checkpoint_dir`` confirmed good, or None."""
        return next(iter(self._confirmed_checkpoints(checkpoint_dir)), None)

    # ------------------------------------------------------------------ the in-memory good state
    def begin(self, trainer: Trainer) -> None:
        """At the start of a ``fit()``: without a checkpoint yet, copy the state so there is somewhere to go back to
        (once the first step confirms it). A fit() that ended at this step already left its copy of it (a whole model
        and optimizer state: not copied again).
        """
        if not self.config.recovery.enabled or trainer.last_checkpoint is not None:
            return
        if self.unconfirmed is None or self.unconfirmed[0] != trainer.step:
            self.refresh_snapshot(trainer)

    def refresh_snapshot(self, trainer: Trainer) -> None:
        """A fresh in-memory copy of the (good) state ``trainer`` is in; the confirmed one stays until the next step
        confirms this one (both are held for that one step).
        """
        self.unconfirmed = (trainer.step, _to_cpu(trainer.state_dict()))

    def saved_checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` was written (or loaded): the newest saved state, until the next step confirms
        it.
        """
        self.unconfirmed = (step, None)

    # ------------------------------------------------------------------ going back
    def recover(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Take ``trainer`` back to the newest good state (an intact checkpoint written before the trouble began, else
        the in-memory copy), multiply the learning rate by ``lr_factor`` and go on reading the data *after*
        the batches that blew up. Raises :class:`TrainingDivergedError` with recovery off, after
        ``max_recoveries``, or when there is nothing to go back to.
        """
        cfg = self.config
        if not cfg.recovery.enabled or self.recoveries >= cfg.recovery.max_recoveries:
            raise self.diverged(trainer, record)
        reason = self._reason(record)
        position = trainer.train_loader.state_dict()
        # Going back restores the recovery state saved with that state too: this run's is taken first.
        kept = self.state_dict(trainer.checkpoint_dir)
        source = self._go_back(trainer)
        if source is None:
            raise self.diverged(trainer, record)
        # The state gone back to was confirmed; checkpoints after it belong to the abandoned steps.
        self.load_state_dict({**kept, "confirmed": [step for step in kept["confirmed"] if step <= trainer.step]})
        self.recoveries += 1
        self.lr_scale *= cfg.recovery.lr_factor
        self.streak = 0
        trainer.train_loader.load_state_dict(position)
        logger.warning(
            f"step {record['step']}: {reason}; recovery {self.recoveries} of {cfg.recovery.max_recoveries}: back to "
            f"step {trainer.step} ({source}), learning rate x{self.lr_scale:g}, skipping the batches of steps "
            f"{trainer.step + 1}-{record['step']}"
        )

    def _go_back(self, trainer: Trainer) -> str | None:
        """Load the newest intact confirmed checkpoint (else the confirmed in-memory copy), all older than the trouble:
        a saved state is confirmed by a good step after it, and a good step ends any trouble (no bad steps in a row,
        no diverging streak), so the trouble began after every confirmed state;
        returns what was loaded, or None when there is nothing to go back to.
        """
        for path in self._confirmed_checkpoints(trainer.checkpoint_dir):
            try:
                trainer.load_checkpoint(path)
                return f"checkpoint {path}"
            except Exception as e:  # noqa: BLE001 - a damaged checkpoint: try the one before
                logger.warning("recovery: cannot load %s (%s); trying an older one", path, e)
        if self.snapshot is None:
            return None
        trainer.load_state_dict(self.snapshot)
        return "in-memory copy"

    def diverged(self, trainer: Trainer, record: dict[str, Any]) -> TrainingDivergedError:
        """The error that stops a run which diverged at ``record``'s step and could not (or may not) go back."""
        cfg = self.config
        n = self.consecutive_bad_steps
        message = f"training diverged at step {trainer.step}"
        if cfg.recovery.enabled:
            message += f" after {self.recoveries} recoveries (max_recoveries={cfg.recovery.max_recoveries})"
        message += f": {self._reason(record)}."
        if n >= cfg.recovery.max_bad_steps:
            message += f" Those steps were skipped, so the weights are still those of step {trainer.step - n}."
        # Only a checkpoint whose next step had a good loss: resuming an unconfirmed one may diverge at once.
        checkpoint = self.newest_confirmed(trainer.checkpoint_dir)
        message += (
            f" {last_good(checkpoint)}. To go on, lower max_lr (--max-lr; this run's was {cfg.max_lr:g}), keep "
            "grad_clip or use precision='bf16'/'fp32', then resume from the last good checkpoint (start again "
            "if there is none)."
        )
        return TrainingDivergedError(
            message, step=trainer.step, loss=record["loss"], grad_norm=record["grad_norm"], last_checkpoint=checkpoint
        )

    def _reason(self, record: dict[str, Any]) -> str:
        """Why the run counts as diverged, in words."""
        if self.consecutive_bad_steps >= self.config.recovery.max_bad_steps:
            return (
                f"{self.consecutive_bad_steps} consecutive steps had a non-finite loss or gradient norm "
                f"(last: loss {record['loss']}, grad norm {record['grad_norm']})"
            )
        return (
            f"the loss stayed above {self.config.recovery.divergence_factor:g} x the best loss so far "
            f"({self.best:.4g}) for {self.streak} steps (last: {record['loss']:.4g})"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self, checkpoint_dir: Path | None = None) -> dict[str, Any]:
        """The counters and the monitor (so that resume stays exact across a recovery), and the steps of the
        checkpoints under ``checkpoint_dir`` confirmed good so far (the one being written is not yet).
        """
        return {
            "recoveries": self.recoveries,
            "lr_scale": self.lr_scale,
            "monitor": {"best": self.best if math.isfinite(self.best) else None, "streak": self.streak},
            "confirmed": sorted(checkpoint_step(p) for p in self._confirmed_checkpoints(checkpoint_dir)),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The counters, monitor and confirmed checkpoints recorded (none: a fresh run's). The state loaded starts
        afresh: no bad steps in a row, and no saved state waiting for its judgement (a loaded checkpoint is one:
        :meth:`saved_checkpoint`).
        """
        state = state or {}
        self.consecutive_bad_steps = 0
        # The newest saved state, waiting for the judgement of the step after it: (its step, the in-memory copy, or
        # None for a checkpoint).
        self.unconfirmed: tuple[int, dict[str, Any] | None] | None = None
        self.recoveries = int(state.get("recoveries", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        monitor = state.get("monitor") or {}
        self.best = math.inf if monitor.get("best") is None else float(monitor["best"])
        self.streak = int(monitor.get("streak", 0))
        self.confirmed = {int(step) for step in state.get("confirmed", [])}


def _to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor in it (in dicts, lists and tuples) detached and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)
