"""The Trainer's state on disk: starting (or resuming) a run in its ``out_dir``, what its
checkpoints record about the run, and saving one while it still holds the run's lock.

These functions take the :class:`gpt2.Trainer` itself and read or set its attributes, so the
Trainer's own checkpoint methods stay two lines each and the loop in ``trainer.py`` stays short.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from gpt2.train import checkpoint as ckpt
from gpt2.train.rundir import RunLock, prepare, run_on_all_ranks

logger = logging.getLogger(__name__)


def start_run(trainer: Any) -> RunLock | None:
    """Everything the Trainer does before its first step: one run per ``out_dir`` (lock it, clean
    up interrupted saves, refuse to mix with another run; see :func:`prepare`), then resume as
    ``config.resume`` says, on every rank. Returns the held lock (rank 0), released again if
    resuming fails."""
    cfg = trainer.config
    lock = None
    if trainer.out_dir is not None:
        lock = prepare(trainer.out_dir, resume=cfg.resume, overwrite=cfg.overwrite, is_main=trainer.is_main)
    if cfg.resume is not None:
        try:
            run_on_all_ranks(lambda: _resume(trainer, cfg.resume))
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    return lock


def _resume(trainer: Any, resume: str) -> None:
    if resume == "auto":
        # The newest *intact* checkpoint: damaged ones are skipped with a warning; if every one
        # is damaged, the error names each file (never a silent start from scratch).
        if trainer.checkpoint_dir is None or not ckpt.checkpoint_candidates(trainer.checkpoint_dir):
            logger.info("resume='auto': no checkpoint in %s, starting from scratch", trainer.checkpoint_dir)
            return
        trainer.load_checkpoint(trainer.checkpoint_dir)
    else:
        trainer.load_checkpoint(resume)


def save_trainer_checkpoint(trainer: Any, lock: RunLock | None, rng_state: dict[str, Any] | None = None) -> Path:
    """Rank 0's save of the Trainer's current step under ``trainer.checkpoint_dir``, while it
    still owns ``out_dir`` (holds ``lock``); ``rng_state`` as ``capture_rng_state(all_ranks=True)``
    gathered it (None: rank 0's own)."""
    if lock is not None:
        lock.ensure_held()
    return ckpt.save_checkpoint(
        trainer.checkpoint_dir,
        trainer.step,
        trainer.model,
        trainer.optimizer,
        trainer.scaler,
        trainer_metadata(trainer),
        keep_last=trainer.config.keep_last_checkpoints,
        trainable_only=trainer.config.save_trainable_only,
        rng_state=rng_state,
    )


def trainer_metadata(trainer: Any) -> dict[str, Any]:
    """What a Trainer checkpoint records besides the tensors (its ``meta.json``)."""
    model_config = getattr(trainer.model, "config", None)
    return {
        "config": trainer.config.to_dict(),
        "model_config": model_config.to_dict() if hasattr(model_config, "to_dict") else None,
        "data": {"train": trainer.train_loader.state_dict()},
        "best_val_loss": trainer.best_val_loss,
        "skipped_steps": trainer.skipped_steps,
        "world_size": trainer.dist_env.world_size,
        "grad_accum_steps": trainer.grad_accum_steps,
        "tokens_per_step": trainer.tokens_per_step,
        "precision": trainer.precision.name,
        "torch_version": torch.__version__,
    }


def restore_trainer_state(trainer: Any, meta: dict[str, Any]) -> None:
    """Put the data position and counters of :func:`trainer_metadata` (``meta``, as
    :func:`gpt2.checkpoint.load_checkpoint` returns it) back into ``trainer``."""
    if meta.get("tokens_per_step") != trainer.tokens_per_step or meta.get("world_size") != trainer.dist_env.world_size:
        logger.warning(
            "checkpoint was written with %s tokens/step on %s process(es), this run uses %s on %s: "
            "the data order (and so the losses) will differ from an uninterrupted run",
            meta.get("tokens_per_step"),
            meta.get("world_size"),
            trainer.tokens_per_step,
            trainer.dist_env.world_size,
        )
    if not isinstance(meta.get("data"), dict) or "train" not in meta["data"]:
        raise ValueError(
            f"checkpoint {meta['path']} records no data-loader position ('data' in "
            f"{ckpt.META_FILE}): it was not written by the Trainer, so it cannot be resumed"
        )
    trainer.train_loader.load_state_dict(meta["data"]["train"])
    trainer.step = int(meta["step"])
    trainer.skipped_steps = int(meta.get("skipped_steps", 0))
    trainer.best_val_loss = meta.get("best_val_loss")
    trainer.consecutive_bad_steps = 0
    trainer.last_checkpoint = Path(meta["path"])
