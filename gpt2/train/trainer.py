"""The Trainer: build-nanogpt's training loop as a library piece.

It wires the pieces of the other modules together: a precision policy
(:mod:`gpt2.precision`), AdamW and the cosine schedule (:mod:`gpt2.optim`), DDP
(:mod:`gpt2.distributed`), atomic checkpoints (:mod:`gpt2.checkpoint`) and metric sinks
(:mod:`gpt2.metrics`)::

    trainer = Trainer(model, TrainConfig(...), train_data, val_data)
    history = trainer.fit()

Three views of one model are kept apart: ``trainer.model`` is the raw module (checkpoints, state
dicts and generation use it, so no ``_orig_mod.`` / ``module.`` prefixes ever appear);
``trainer.eval_model`` is the ``torch.compile``d module when compiling (evaluation), and
``trainer.train_model`` wraps that in DistributedDataParallel when running under torchrun
(training steps). All three share the same parameters.

Data: ``train_data`` / ``val_data`` may be a 1-D token tensor or array, a token file, a
directory of shards (the Trainer then reads the files whose names contain ``"train"`` /
``"val"``), or a :class:`gpt2.data.TokenLoader`. A loader must have been built with this run's
``micro_batch_size``, ``seq_len`` and the process's ``rank`` / ``world_size`` (the Trainer checks
and says what differs; it does not rebuild a loader, because it cannot know its source; see
:func:`gpt2.data.loader.make_loader`).

Resume: with ``resume="auto"`` (or a path) the Trainer restores weights, optimizer, loss scaler,
RNG states, the data loader's position, the step (which fixes the learning rate) and the best
validation loss, so the continued run is the uninterrupted one: on CPU bit for bit. Validation
always reads the same first ``eval_steps`` batches, so it consumes no state of its own.

Run directory: one run per ``out_dir`` (a lock, released by :meth:`Trainer.close`); a fresh run
refuses a directory holding another run unless ``overwrite=True``; ``resume="auto"`` skips
damaged checkpoints (see :mod:`gpt2.rundir`, which also assembles what a checkpoint records,
and :mod:`gpt2.checkpoint`).

Divergence guard: a step whose loss or gradient norm is inf/nan is skipped (gradients dropped,
weights and optimizer state untouched) and logged. ``max_bad_steps`` such steps in a row raise
:class:`TrainingDivergedError`. With fp16 the loss scaler skips steps whose scaled gradients
overflowed while it searches for a good scale; those are counted in ``skipped_steps`` but are
not "bad" unless the loss itself was non-finite or the scale was already at 1 or below (then
the true gradients overflow fp16: a real spike, not the scale).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from gpt2.data.loader import make_loader, one_pass
from gpt2.model.gpt import IGNORE_INDEX
from gpt2.train import checkpoint as ckpt
from gpt2.train import distributed, rundir, trainer_state
from gpt2.train.checkpoint import seed_everything  # noqa: F401 - re-exported: `from gpt2.trainer import seed_everything`
from gpt2.train.config import TrainConfig
from gpt2.train.metrics import (
    METRICS_FILE,
    PLOT_FILE,
    ConsoleSink,
    FitLog,
    Sink,
    detect_peak_flops,
    mfu,
    plot_loss_curve,
    progress_bar,
    read_jsonl,
)
from gpt2.train.optim import build_optimizer, lr_at, set_lr
from gpt2.train.precision import check_master_weights, resolve_precision

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = rundir.CHECKPOINT_DIR


def _returns_sum(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``reduction="sum"`` (as :class:`gpt2.GPT` does)."""
    return "reduction" in inspect.signature(model.forward).parameters


class TrainingDivergedError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""

    def __init__(self, message: str, *, step: int, loss: float, grad_norm: float, last_checkpoint: Path | None):
        super().__init__(message)
        self.step = step
        self.loss = loss
        self.grad_norm = grad_norm
        self.last_checkpoint = last_checkpoint


def grad_accum_steps(config: TrainConfig, world_size: int) -> int:
    """Micro-steps per optimizer step so that one step sees ``total_batch_size`` tokens."""
    per_micro_step = config.micro_batch_size * config.seq_len * world_size
    if config.total_batch_size is None:
        return 1
    if config.total_batch_size % per_micro_step != 0:
        raise ValueError(
            f"total_batch_size={config.total_batch_size:,} tokens is not divisible by micro_batch_size x "
            f"seq_len x world_size = {config.micro_batch_size} x {config.seq_len} x {world_size} = "
            f"{per_micro_step:,} tokens; pick a total_batch_size that is a multiple of {per_micro_step:,} "
            f"(e.g. {max(1, config.total_batch_size // per_micro_step) * per_micro_step:,}) or change the micro-batch"
        )
    return config.total_batch_size // per_micro_step


class Trainer:
    """Trains a GPT (any module with ``forward(idx, targets) -> (logits, loss)``).

    Args:
        model: the raw model, in fp32 (the precision policy handles the low-precision compute).
            Only parameters with ``requires_grad=True`` are trained.
        config: a :class:`gpt2.TrainConfig`.
        train_data / val_data: tokens, a token file or shard directory, or a fitting
            :class:`gpt2.data.TokenLoader` (see the module docstring). ``val_data=None``: no
            validation.
        sinks: where the per-step records go besides ``out_dir/metrics.jsonl``: objects with
            ``log(record)`` or callables. Default: a :class:`gpt2.metrics.ConsoleSink` printing
            every ``log_interval`` steps; ``[]`` for silence. Only rank 0 calls them.
        callbacks: ``fn(trainer, record)`` called on *every* process after each step (and after
            validation), before the record is logged; a callback may add entries to ``record``
            (e.g. a HellaSwag score every N steps), which then reach the sinks and metrics.jsonl.

    Under ``torchrun`` the Trainer joins the process group itself (NCCL on CUDA, gloo on CPU);
    :meth:`close` (or ``with Trainer(...) as trainer:``) leaves it again.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        train_data: Any,
        val_data: Any = None,
        *,
        sinks: Iterable[Sink] | None = None,
        callbacks: Iterable[Callable[[Trainer, dict], None]] = (),
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a gpt2.TrainConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (e.g. gpt2.GPT), got {type(model).__name__}")
        self.config = config
        self.dist_env = distributed.env_from_environ()
        self.device = distributed.resolve_device(config.device, self.dist_env)
        self._owns_process_group = distributed.init_process_group(self.dist_env, self.device)
        self.precision = resolve_precision(config.precision, self.device)
        self.precision.apply()
        self.grad_accum_steps = grad_accum_steps(config, self.dist_env.world_size)
        self.tokens_per_step = (
            config.micro_batch_size * config.seq_len * self.grad_accum_steps * self.dist_env.world_size
        )
        seed_everything(config.seed)

        self.model = ckpt.unwrap_model(model).to(self.device)  # the raw model
        self._check_model()
        self.optimizer = build_optimizer(
            self.model,
            lr=config.max_lr,
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.eps,
            fused=config.fused_adamw,
            decay_embeddings=config.decay_embeddings,
        )
        self._trainable = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.scaler = self.precision.make_scaler()
        self.eval_model: nn.Module = torch.compile(self.model) if config.compile else self.model
        self.train_model: nn.Module = (
            distributed.wrap_ddp(self.eval_model, self.device) if self.dist_env.is_distributed else self.eval_model
        )
        vocab_size = getattr(getattr(self.model, "config", None), "vocab_size", None)
        loader_args = dict(rank=self.dist_env.rank, world_size=self.dist_env.world_size, vocab_size=vocab_size)
        self.train_loader = make_loader(train_data, "train", config.micro_batch_size, config.seq_len, **loader_args)
        self.val_loader = (
            make_loader(val_data, "val", config.micro_batch_size, config.seq_len, **loader_args)
            if val_data is not None
            else None
        )

        flops = getattr(self.model, "flops_per_token", None)
        self.flops_per_token: float | None = flops(config.seq_len) if callable(flops) else None
        self.peak_flops = detect_peak_flops(self.device, config.peak_flops)
        self.sinks: list[Sink] = (
            ([ConsoleSink(interval=config.log_interval)] if sinks is None else list(sinks)) if self.is_main else []
        )

        self.callbacks = list(callbacks)
        self.step = 0  # completed optimizer steps
        self.skipped_steps = 0
        self.consecutive_bad_steps = 0
        self.best_val_loss: float | None = None
        self.last_checkpoint: Path | None = None
        self.history: list[dict[str, Any]] = []  # records of this process's fit() calls
        logger.info(
            "training on %s with %s, %d process(es), %d micro-step(s) of %d x %d tokens = %s tokens per step",
            self.device,
            self.precision.name,
            self.dist_env.world_size,
            self.grad_accum_steps,
            config.micro_batch_size,
            config.seq_len,
            f"{self.tokens_per_step:,}",
        )
        # One run per out_dir: lock it, clean up interrupted saves, refuse to mix with another run;
        # then resume (config.resume).
        self._run_lock: rundir.RunLock | None = trainer_state.start_run(self)

    # ------------------------------------------------------------------ set-up helpers
    @property
    def is_main(self) -> bool:
        return self.dist_env.is_main

    @property
    def out_dir(self) -> Path | None:
        return Path(self.config.out_dir) if self.config.out_dir is not None else None

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.out_dir / CHECKPOINT_DIR if self.out_dir is not None else None

    def _check_model(self) -> None:
        block_size = getattr(getattr(self.model, "config", None), "block_size", None)
        if block_size is not None and self.config.seq_len > block_size:
            raise ValueError(
                f"TrainConfig.seq_len={self.config.seq_len} exceeds the model's block_size={block_size}; "
                "train on shorter sequences or build the model with a larger block_size"
            )
        check_master_weights(self.model)

    # ------------------------------------------------------------------ training
    def fit(self, until_step: int | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps``; return this call's per-step records (also in metrics.jsonl).

        ``until_step`` stops earlier, after that step, with a checkpoint (when ``out_dir`` is
        set) so a later Trainer with ``resume="auto"`` continues the same run: the learning-rate
        schedule still runs to ``max_steps``.
        """
        cfg = self.config
        stop = cfg.max_steps if until_step is None else min(int(until_step), cfg.max_steps)
        if self.step >= stop:
            logger.info("already at step %d (stopping at %d): nothing to train", self.step, stop)
            return []
        # metrics.jsonl, the sinks, TensorBoard / W&B (config.log_to) and the progress bar
        log = FitLog.open(
            self.sinks,
            cfg,
            out_dir=self.out_dir,
            step=self.step,
            is_main=self.is_main,
            before_write=self._run_lock.ensure_held if self._run_lock is not None else None,
        )
        history: list[dict[str, Any]] = []
        pending = False  # a checkpoint is due but was postponed
        try:
            while self.step < stop:
                record = self.train_step()
                if self._due(cfg.eval_interval) and self.val_loader is not None:
                    log.status("evaluating ...")  # evaluation takes a while on a CPU: say so on the bar
                    record["val_loss"] = self.evaluate()
                for callback in self.callbacks:
                    callback(self, record)
                self.history.append(record)
                log.emit(record)
                history.append(record)
                if self.consecutive_bad_steps >= cfg.max_bad_steps:
                    raise self._diverged(record)
                if self.out_dir is not None:
                    pending = pending or self._due(cfg.checkpoint_interval) or self.step == stop
                    # A checkpoint waits for a good step: during a run of skipped steps the last
                    # good checkpoint stays the newest one. The stop point is always saved (the
                    # weights are finite: skipped steps never touch them).
                    if pending and (self.consecutive_bad_steps == 0 or self.step == stop):
                        self.save_checkpoint()
                        pending = False
        finally:
            log.close()
        if self.is_main and self.out_dir is not None and cfg.plot:
            plot_loss_curve(read_jsonl(self.out_dir / METRICS_FILE), self.out_dir / PLOT_FILE)
        return history

    def _due(self, interval: int) -> bool:
        """Every ``interval`` steps (0 = never) and always after the last step."""
        return self.step == self.config.max_steps or (interval > 0 and self.step % interval == 0)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its metrics record."""
        cfg = self.config
        lr = lr_at(
            self.step, max_lr=cfg.max_lr, min_lr=cfg.final_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps
        )
        set_lr(self.optimizer, lr)
        self.train_model.train()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        # The whole step's micro-batches first (token ids are small): each one's share of the
        # loss needs the number of scored targets of the whole global batch.
        batches = [self.train_loader.next_batch() for _ in range(self.grad_accum_steps)]
        counts = [int((batch[1] != IGNORE_INDEX).sum()) for batch in batches]  # on the CPU: no device sync
        scored = self._global_count(sum(counts))
        if scored == 0:
            # A mean over no targets is 0/0: no forward, and no optimizer step either (AdamW would
            # still decay and move the weights on zero gradients).
            loss_value, grad_norm, skipped, bad = 0.0, 0.0, True, False
            self.skipped_steps += 1
        else:
            loss_value = self._accumulate(batches, counts, scored)
            grad_norm, skipped, bad = self._optimizer_step(loss_value)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are queued asynchronously: time them all
        dt = time.perf_counter() - t0
        self.step += 1
        tokens_per_second = self.tokens_per_step / dt
        record: dict[str, Any] = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "dt_ms": dt * 1000.0,
            "tokens_per_second": tokens_per_second,
            "mfu": mfu(self.flops_per_token, tokens_per_second, self.peak_flops, self.dist_env.world_size),
            "scored_tokens": scored,
            "skipped": skipped,
            "skipped_steps": self.skipped_steps,
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        if skipped:
            if scored == 0:
                why = "the global batch has no scored targets (every target is IGNORE_INDEX)"
            elif bad:
                why = "non-finite loss or gradient norm"
            else:
                why = f"fp16 gradients overflowed, loss scale lowered to {record['loss_scale']:g}"
            logger.warning("step %d skipped (%s): loss %s, grad norm %s", self.step, why, loss_value, grad_norm)
        return record

    def _global_count(self, local: int) -> int:
        """``local`` summed over all processes (float64 holds any count exactly)."""
        world_size = self.dist_env.world_size
        if world_size == 1:
            return local
        total = torch.tensor(float(local), dtype=torch.float64, device=self.device)
        return round(distributed.all_reduce_mean(total).item() * world_size)

    def _accumulate(self, batches: list[tuple], counts: list[int], scored: int) -> float:
        """Forward and backward every micro-batch; returns the global batch's mean loss.

        Each micro-batch adds the SUM of its targets' losses divided by the global batch's count
        ``scored``, so the gradients add up to the gradient of the mean over every scored target of
        the global batch: a micro-batch (or rank) with 3 response tokens weighs as little as they
        do, not as much as one with 300. DDP averages gradients over the ranks: hence x world_size.
        """
        scale = self.dist_env.world_size / scored
        sums = _returns_sum(self.model)
        loss_sum = torch.zeros((), device=self.device)
        for micro_step, (batch, count) in enumerate(zip(batches, counts)):
            extras = batch[2] if len(batch) > 2 else {}  # e.g. a packed batch's attn_mask, position_ids
            x, y, *values = self._to_device(batch[0], batch[1], *extras.values())
            kwargs = dict(zip(extras, values))
            # Under DDP, only the last micro-step's backward averages gradients across processes.
            with distributed.no_sync(self.train_model, skip_sync=micro_step < len(batches) - 1):
                with self.precision.autocast():
                    if sums:
                        _, loss = self.train_model(x, y, reduction="sum", **kwargs)
                    else:  # forward(idx, targets) -> (logits, mean loss): the mean of no targets is NaN
                        _, loss = self.train_model(x, y, **kwargs)
                        loss = loss * count if count else loss.nan_to_num(0.0) * 0.0
                loss = loss * scale
                loss_sum += loss.detach()
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        # Every process logs (and judges) the loss of the whole global batch.
        return distributed.all_reduce_mean(loss_sum).item()

    def _to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.device.type == "cuda":
            # Pinned memory lets the copy run asynchronously with the previous step's kernels.
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in tensors)
        return tuple(t.to(self.device) for t in tensors)

    def _optimizer_step(self, loss_value: float) -> tuple[float, bool, bool]:
        """Unscale, clip, step (unless non-finite). Returns (grad_norm, skipped, bad)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        max_norm = self.config.grad_clip or math.inf  # inf: measure the norm, change nothing
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trainable, max_norm))
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if self.scaler is None:
            if finite:
                self.optimizer.step()
            bad = not finite
        else:
            scale = self.scaler.get_scale()
            if finite:
                self.scaler.step(self.optimizer)
            self.scaler.update()  # lowers the scale when unscale_ found inf/nan gradients
            overflow = self.scaler.get_scale() < scale
            # Overflow of *scaled* fp16 gradients is the scaler searching for its scale (normal);
            # a non-finite loss, or an overflow at scale <= 1, is a real numerical problem.
            explained = overflow and math.isfinite(loss_value) and scale > 1.0
            bad = not finite and not explained
        skipped = not finite
        if skipped:
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)  # the non-finite gradients go nowhere
        self.consecutive_bad_steps = self.consecutive_bad_steps + 1 if bad else 0
        return grad_norm, skipped, bad

    def _diverged(self, record: dict[str, Any]) -> TrainingDivergedError:
        n = self.consecutive_bad_steps
        where = (
            f"the last good checkpoint is {self.last_checkpoint}"
            if self.last_checkpoint is not None
            else "no checkpoint was written in this run"
        )
        scale = f", loss scale {record['loss_scale']:g}" if "loss_scale" in record else ""
        message = (
            f"training diverged at step {self.step}: {n} consecutive steps had a non-finite loss or gradient "
            f"norm (last: loss {record['loss']}, grad norm {record['grad_norm']}{scale}). Those steps were skipped, "
            f"so the weights are still those of step {self.step - n}; {where}. Lower max_lr, set grad_clip, "
            f"or use precision='bf16'/'fp32', then resume from the checkpoint."
        )
        return TrainingDivergedError(
            message,
            step=self.step,
            loss=record["loss"],
            grad_norm=record["grad_norm"],
            last_checkpoint=self.last_checkpoint,
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, steps: int | None = None) -> float:
        """Mean validation loss per token over the first ``steps`` (default ``eval_steps``)
        batches, or over one pass of the validation data when it holds fewer: a batch is never
        read twice (that would weigh it double), and the first short evaluation says so once."""
        if self.val_loader is None:
            raise ValueError("no validation data: pass val_data to the Trainer")
        steps = steps or self.config.eval_steps
        model = self.eval_model
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, device=self.device)  # [loss summed over scored tokens, scored tokens]
        batches = 0
        # a second, transient bar under the training bar while validation runs
        bar = progress_bar(self.is_main and self.config.progress, total=steps, desc="val", unit="batch", leave=False)
        try:
            # the same batches every time (evaluations are comparable), none of them twice
            for x, y in one_pass(self.val_loader, steps):
                x, y = self._to_device(x, y)
                with self.precision.autocast():
                    _, loss = model(x, y)
                # Weighted by the batch's scored targets (instruction data ignores prompt and
                # padding), so the result is the mean per scored token; a batch with none adds 0.
                n = (y != IGNORE_INDEX).sum().float()
                sums[0] += torch.where(n > 0, loss.detach().float() * n, torch.zeros_like(n))
                sums[1] += n
                batches += 1
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()
            model.train(was_training)
        if batches < steps and not getattr(self, "_warned_short_val", False):
            self._warned_short_val = True
            if self.is_main:
                logger.warning(
                    "the validation data holds only %d batch(es) of %d x %d tokens per process; evaluations "
                    "score those once instead of %d (no batch is read twice)",
                    batches,
                    self.config.micro_batch_size,
                    self.config.seq_len,
                    steps,
                )
        # Mean over the token sums of every rank (averaging [sum, count] keeps their ratio).
        loss_sum, tokens = distributed.all_reduce_mean(sums).tolist()
        val_loss = loss_sum / tokens
        if math.isfinite(val_loss) and (self.best_val_loss is None or val_loss < self.best_val_loss):
            self.best_val_loss = val_loss
        return val_loss

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """Checkpoint the current step under ``out_dir/checkpoints`` (rank 0 writes; all ranks
        return the path). Raises :class:`TrainingDivergedError` instead of saving non-finite weights."""
        if self.checkpoint_dir is None:
            return None
        bad = ckpt.non_finite_tensors(dict(self.model.state_dict()))
        if bad:  # checked on every rank, so all of them stop together
            where = (
                f"the last good checkpoint is {self.last_checkpoint}"
                if self.last_checkpoint
                else "no checkpoint was written"
            )
            raise TrainingDivergedError(
                f"not saving step {self.step}: the model holds non-finite weights ({', '.join(bad[:5])}); {where}",
                step=self.step,
                loss=math.nan,
                grad_norm=math.nan,
                last_checkpoint=self.last_checkpoint,
            )
        path = self.checkpoint_dir / f"step_{self.step:06d}"
        if self.is_main:  # once it checked it still owns out_dir; meta.json: trainer_state.trainer_metadata
            path = trainer_state.save_trainer_checkpoint(self, self._run_lock)
        self.last_checkpoint = path
        return path

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore everything from a checkpoint (see :func:`gpt2.checkpoint.load_checkpoint`)."""
        meta = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scaler, restore_rng=True)
        trainer_state.restore_trainer_state(self, meta)  # data position, step, best val loss, counters
        logger.info("resumed from %s at step %d", meta["path"], self.step)
        return meta

    # ------------------------------------------------------------------ lifetime
    def close(self, wait_for_all: bool = True) -> None:
        """Leave the process group if this Trainer created it (under torchrun); by default after
        every rank got here (see :func:`gpt2.distributed.destroy_process_group`). Then release
        the ``out_dir`` lock (see :mod:`gpt2.rundir`)."""
        if self._owns_process_group:
            distributed.destroy_process_group(wait_for_all)
            self._owns_process_group = False
        self._release_run_lock()

    def _release_run_lock(self) -> None:
        if getattr(self, "_run_lock", None) is not None:
            self._run_lock.release()
            self._run_lock = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(wait_for_all=exc_type is None)  # after an error other ranks may never arrive
