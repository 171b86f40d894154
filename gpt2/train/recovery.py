"""What stops a run early and what brings it back: a stop signal (:class:`gpt2.files.StopSignals`) ends it at a step
boundary with :class:`TrainingInterrupted`; :class:`RecoveryPolicy` judges every step (with a
:class:`DivergenceMonitor`) and, when the run has diverged, takes it back to its newest good state or stops it with
:class:`TrainingDivergedError`.
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
        name = signal.Signals(signum).name
        saved = "nothing saved (no out_dir)"
        if checkpoint is not None:
            saved = f"checkpoint {checkpoint}"
        super().__init__(f"interrupted by {name} after step {step}; {saved}")
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
    """Where an error message sends the user back to."""
    if checkpoint is None:
        return "no checkpoint was written in this run"
    return f"the last good checkpoint is {checkpoint}"


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
        # non-finite steps are skipped and counted by the Trainer (RecoveryPolicy.count_step)
        if not math.isfinite(loss):
            return False
        if loss > self.factor * self.best and loss > self.best + 1.0:
            if not self.streak:
                self.streak_start = step
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


class RecoveryPolicy:
    """Divergence recovery for one :class:`~gpt2.train.trainer.Trainer` (``TrainConfig.recover`` and the fields after
    it; docs/training.md, "When a run goes wrong"). It owns everything that decides and performs a recovery:

    - the judgement of each step: the :class:`DivergenceMonitor` of the loss and the count of non-finite (skipped)
      steps in a row (``consecutive_bad_steps``);
    - what a recovery changed: ``recoveries`` so far and ``lr_scale`` (``recovery_lr_factor ** recoveries``, which
      multiplies the scheduled learning rate); checkpoints record these with the monitor (:meth:`state_dict`);
    - the states to go back to: checkpoints written before the trouble began and, before the first one exists,
      an in-memory ``snapshot``; so that one is always there, a save in a run of bad steps prunes no checkpoint
      (:meth:`checkpoints_to_keep`).

    Every rank decides alike: the loss and gradient norm it judges are all-reduced.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.monitor = DivergenceMonitor(config.divergence_factor, config.divergence_patience)
        self.recoveries = 0
        self.lr_scale = 1.0
        self.consecutive_bad_steps = 0
        # The trainable weights, optimizer, data position, counters and RNG before a checkpoint exists.
        self.snapshot: dict[str, Any] | None = None

    # ------------------------------------------------------------------ judging steps
    def count_step(self, bad: bool) -> None:
        """Count an optimizer step: a bad one (a non-finite loss or gradient norm: a real numerical problem, not fp16's
        scale search) extends the run of bad steps, any other ends it.
        """
        if bad:
            self.consecutive_bad_steps += 1
        else:
            self.consecutive_bad_steps = 0

    def judge(self, step: int, record: dict[str, Any]) -> bool:
        """Show the monitor step ``step``'s ``record``; True when the run must go back (or, with ``recover=False``,
        stop): the loss has diverged, or ``max_bad_steps`` steps in a row were non-finite.
        """
        # A step with no scored target reports loss 0: no evidence either way.
        judged = self.config.recover and record.get("scored_tokens", 1) > 0
        diverged = judged and self.monitor.observe(step, record["loss"])
        return diverged or self.consecutive_bad_steps >= self.config.max_bad_steps

    @property
    def good(self) -> bool:
        """The last step was neither skipped nor part of a diverging streak: a state worth saving."""
        return self.consecutive_bad_steps == 0 and self.monitor.streak == 0

    def checkpoints_to_keep(self) -> int:
        """``keep_last_checkpoints`` for a save now: a save in a run of bad steps (a stop point, a signal) prunes
        nothing, as the recovery that may follow needs a good checkpoint to go back to.
        """
        if self.good:
            return self.config.keep_last_checkpoints
        return 0

    # ------------------------------------------------------------------ the in-memory good state
    def begin(self, trainer: Trainer) -> None:
        """At the start of a ``fit()``: without a checkpoint yet, copy the state so there is somewhere to go back to."""
        if self.config.recover and trainer.last_checkpoint is None:
            self.snapshot = _capture(trainer)

    def refresh_snapshot(self, trainer: Trainer) -> None:
        """A fresh in-memory copy of the (good) state ``trainer`` is in."""
        self.snapshot = _capture(trainer)

    def drop_snapshot(self) -> None:
        """A checkpoint was written: no in-memory copy is needed any more."""
        self.snapshot = None

    # ------------------------------------------------------------------ going back
    def recover(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Take ``trainer`` back to the newest good state (an intact checkpoint written before the trouble began, else
        the in-memory copy), multiply the learning rate by ``recovery_lr_factor`` and go on reading the data *after*
        the batches that blew up. Raises :class:`TrainingDivergedError` with ``recover=False``, after
        ``max_recoveries``, or when there is nothing to go back to.
        """
        cfg = self.config
        if not cfg.recover or self.recoveries >= cfg.max_recoveries:
            raise self.diverged(trainer, record)
        reason = self._reason(record)
        position = trainer.train_loader.state_dict()
        # Loading a checkpoint restores its recovery state too: what this recovery changes is taken first.
        recoveries = self.recoveries + 1
        lr_scale = self.lr_scale * cfg.recovery_lr_factor
        monitor = self.monitor.state_dict()
        source = self._go_back(trainer, before_step=self._trouble_start(trainer.step))
        if source is None:
            raise self.diverged(trainer, record)
        self.recoveries = recoveries
        self.lr_scale = lr_scale
        self.monitor.load_state_dict({**monitor, "streak": 0})
        self.consecutive_bad_steps = 0
        trainer.train_loader.load_state_dict(position)
        logger.warning(
            "step %d: %s; recovery %d of %d: back to step %d (%s), learning rate x%g, skipping the batches of "
            "steps %d-%d",
            record["step"],
            reason,
            self.recoveries,
            cfg.max_recoveries,
            trainer.step,
            source,
            self.lr_scale,
            trainer.step + 1,
            record["step"],
        )

    def _trouble_start(self, step: int) -> int:
        """The first step of the trouble that ended at ``step``: of the diverging streak, or of the non-finite run."""
        if self.monitor.streak:
            return self.monitor.streak_start
        return step - self.consecutive_bad_steps + 1

    def _go_back(self, trainer: Trainer, before_step: int) -> str | None:
        """Load the newest intact checkpoint older than ``before_step`` (else the in-memory copy); returns what was
        loaded, or None when there is nothing to go back to.
        """
        if trainer.checkpoint_dir is not None:
            for path in ckpt.checkpoint_candidates(trainer.checkpoint_dir):
                if (ckpt.checkpoint_step(path) or 0) >= before_step:
                    continue
                try:
                    trainer.load_checkpoint(path)
                    return f"checkpoint {path}"
                except Exception as e:  # noqa: BLE001 - a damaged checkpoint: try the one before
                    logger.warning("recovery: cannot load %s (%s); trying an older one", path, e)
        if self.snapshot is None or self.snapshot["step"] >= before_step:
            return None
        _restore(trainer, self.snapshot)
        return "in-memory copy"

    def diverged(self, trainer: Trainer, record: dict[str, Any]) -> TrainingDivergedError:
        """The error that stops a run which diverged at ``record``'s step and could not (or may not) go back."""
        cfg = self.config
        n = self.consecutive_bad_steps
        message = f"training diverged at step {trainer.step}"
        if cfg.recover:
            message += f" after {self.recoveries} recoveries (max_recoveries={cfg.max_recoveries})"
        message += f": {self._reason(record)}."
        if n >= cfg.max_bad_steps:
            message += f" Those steps were skipped, so the weights are still those of step {trainer.step - n}."
        message += (
            f" {last_good(trainer.last_checkpoint)}. Lower max_lr, set grad_clip, or use precision='bf16'/'fp32', then "
            "resume from the checkpoint."
        )
        return TrainingDivergedError(
            message,
            step=trainer.step,
            loss=record["loss"],
            grad_norm=record["grad_norm"],
            last_checkpoint=trainer.last_checkpoint,
        )

    def _reason(self, record: dict[str, Any]) -> str:
        """Why the run counts as diverged, in words."""
        scale = ""
        if "loss_scale" in record:
            scale = f", loss scale {record['loss_scale']:g}"
        if self.consecutive_bad_steps >= self.config.max_bad_steps:
            return (
                f"{self.consecutive_bad_steps} consecutive steps had a non-finite loss or gradient norm "
                f"(last: loss {record['loss']}, grad norm {record['grad_norm']}{scale})"
            )
        return (
            f"the loss stayed above {self.monitor.factor:g} x the best loss so far ({self.monitor.best:.4g}) for "
            f"{self.monitor.streak} steps (last: {record['loss']:.4g})"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records (``meta["recovery"]``), so that resume stays exact across a recovery."""
        return {"recoveries": self.recoveries, "lr_scale": self.lr_scale, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The counters and monitor :meth:`state_dict` recorded (none: a fresh run's)."""
        state = state or {}
        self.recoveries = int(state.get("recoveries", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.monitor.load_state_dict(state.get("monitor"))

    def resume(self, state: dict[str, Any] | None) -> None:
        """After loading a checkpoint: its recovery state, and no bad steps in a row."""
        self.consecutive_bad_steps = 0
        self.load_state_dict(state)


def _capture(trainer: Trainer) -> dict[str, Any]:
    """The trainable weights, optimizer and scaler state, data position, counters and RNG of ``trainer``, copied to the
    CPU: about 3x the trainable parameters' size with AdamW (documented in docs/training.md). Frozen weights (a LoRA
    base) never change, so they are not copied.
    """
    model, scaler = trainer.model, trainer.scaler
    return _to_cpu(
        {
            "weights": {n: p for n, p in model.named_parameters() if p.requires_grad},
            "optimizer": trainer.optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "loader": trainer.train_loader.state_dict(),
            "step": trainer.step,
            "skipped_steps": trainer.skipped_steps,
            "best_val_loss": trainer.best_val_loss,
            "rng": ckpt.capture_rng_state(),
        }
    )


def _to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor in it (in dicts, lists and tuples) detached and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


def _restore(trainer: Trainer, snapshot: dict[str, Any]) -> None:
    """Put ``trainer`` back into the state :func:`_capture` copied."""
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if name in snapshot["weights"]:
                p.copy_(snapshot["weights"][name])
    trainer.optimizer.load_state_dict(snapshot["optimizer"])
    if trainer.scaler is not None:
        trainer.scaler.load_state_dict(snapshot["scaler"])
    trainer.train_loader.load_state_dict(snapshot["loader"])
    trainer.step = snapshot["step"]
    trainer.skipped_steps = snapshot["skipped_steps"]
    trainer.best_val_loss = snapshot["best_val_loss"]
    ckpt.restore_rng_state(snapshot["rng"])
