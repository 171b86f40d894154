"""The Trainer: build-nanogpt's training loop as a library piece::

    trainer = Trainer(model, TrainConfig(...), train_data, val_data)
    history = trainer.fit()

``trainer.model`` is the raw module (checkpoints and generation use it: no ``_orig_mod.`` / ``module.`` prefixes),
``trainer.eval_model`` the ``torch.compile``d one when compiling, and ``trainer.train_model`` that wrapped in DDP under
torchrun; all three share the parameters. Resuming, skipped steps, divergence recovery and stop signals:
docs/training.md ("Checkpoints and resuming", "When a run goes wrong") and the safety fields of :class:`TrainConfig`.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import minlora
from gpt2.data.loader import make_loader
from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.eval.loss import NonFiniteLossError, evaluate_loss
from gpt2.files import StopSignals
from gpt2.model.gpt import IGNORE_INDEX, check_targets
from gpt2.train import batch_finder, distributed, fsdp, host_memory, metrics, rundir
from gpt2.train import checkpoint as ckpt
from gpt2.train.checkpoint import seed_everything  # noqa: F401 - re-exported for gpt2.cli
from gpt2.train.config import TrainConfig, grad_accum_steps
from gpt2.train.metrics import ConsoleSink, FitLog, Sink
from gpt2.train.optim import build_optimizer, lr_at, set_lr
from gpt2.train.precision import check_master_weights, resolve_precision
from gpt2.train.recovery import RecoveryPolicy, TrainingDivergedError, TrainingInterrupted, last_good
from gpt2.train.schedule import CheckpointSchedule, is_due

logger = logging.getLogger(__name__)

# The parts of Trainer.state_dict() a checkpoint writes into files of their own (the weights into model.safetensors
# or shards/, the rest into trainer_state.safetensors); the rest goes into trainer_state.json.
IN_FILES = ("model", "optimizer", "scaler", "rng")


class Trainer:
    """Trains a GPT (any module with ``forward(idx, targets) -> (logits, loss)``).

    Args:
        model: the raw model, in fp32 (the precision policy handles the low-precision compute).
            Only parameters with ``requires_grad=True`` are trained.
        config: a :class:`gpt2.TrainConfig`.
        train_data / val_data: tokens, a token file, a shard directory (files named "train" / "val") or a
            :class:`gpt2.data.TokenLoader` built for this run's micro_batch_size, seq_len, rank and world_size (see
            :func:`gpt2.data.loader.make_loader`). ``val_data=None``: no validation.
        sinks: where the per-step records go besides ``out_dir/metrics.jsonl``: objects with
            ``log(record)`` or callables. Default: a :class:`gpt2.train.metrics.ConsoleSink` printing
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
        self._owns_process_group, self._run_lock, self._signals = False, None, StopSignals()
        # ends the hold of freed memory (gpt2.train.host_memory) when closed or garbage-collected
        self._memory_hold: weakref.finalize | None = None
        try:
            self._setup(model, config, train_data, val_data, sinks=sinks, callbacks=callbacks)
        except BaseException:
            # A set-up that fails after joining the process group must leave it (NCCL holds the
            # GPU and its communicator otherwise); no barrier: the other ranks may never get here.
            self.close(wait_for_all=False)
            raise

    def _setup(self, model, config, train_data, val_data, *, sinks, callbacks) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a gpt2.TrainConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (e.g. gpt2.GPT), got {type(model).__name__}")
        self.config = config
        # this process's place in the run: device, process group, precision
        self.dist_env = distributed.env_from_environ()
        self.device = distributed.resolve_device(config.device, self.dist_env)
        # On a CPU the steps' freed memory stays in the process for the next step: no page faults to fill it again.
        if self.device.type == "cpu" and host_memory.hold():
            self._memory_hold = weakref.finalize(self, host_memory.release)
            self._memory_hold.atexit = False
        self._owns_process_group = distributed.init_process_group(self.dist_env, self.device)
        self.precision = resolve_precision(config.precision, self.device)
        self.precision.apply()
        seed_everything(config.seed)
        self._setup_model(model)
        # The micro-batch (micro_batch_size="auto": the largest that fits this model on this device, see
        # gpt2.train.batch_finder) and the accumulation that makes up total_batch_size.
        self.config = config = batch_finder.resolve_micro_batch_size(
            config,
            self.model,
            self.optimizer,
            self.precision.autocast,
            device=self.device,
            env=self.dist_env,
            data=(("train", train_data), ("val", val_data)),
        )
        world_size = self.dist_env.world_size
        self.grad_accum_steps = grad_accum_steps(config, world_size)
        self.tokens_per_step = config.micro_batch_size * config.seq_len * self.grad_accum_steps * world_size
        # This rank's training and validation loaders (val_data=None: no validation).
        self.vocab_size = getattr(getattr(self.model, "config", None), "vocab_size", None)
        loader_args = dict(rank=self.dist_env.rank, world_size=world_size, vocab_size=self.vocab_size)
        shape = (config.micro_batch_size, config.seq_len)
        self.train_loader = make_loader(train_data, "train", *shape, **loader_args)
        self.val_loader = None
        if val_data is not None:
            self.val_loader = make_loader(val_data, "val", *shape, **loader_args)
        # What MFU is measured against, and where rank 0's records go (a console line by default).
        flops = getattr(self.model, "flops_per_token", None)
        self.flops_per_token: float | None = None
        if callable(flops):
            self.flops_per_token = flops(config.seq_len)
        self.peak_flops = metrics.detect_peak_flops(self.device, config.peak_flops, self.precision.name)
        self.sinks: list[Sink] = []
        if self.is_main:
            self.sinks = [ConsoleSink(interval=config.log_interval)] if sinks is None else list(sinks)
        self.callbacks = list(callbacks)
        # completed optimizer steps
        self.step = 0
        self.skipped_steps = 0
        self.best_val_loss: float | None = None
        self.last_checkpoint: Path | None = None
        # the records of this process's fit() calls
        self.history: list[dict[str, Any]] = []
        # Divergence recovery: its counters are part of the run's state (state_dict).
        self.recovery = RecoveryPolicy(config)
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
        self._run_lock: rundir.RunLock | None = rundir.start_run(
            self.out_dir,
            resume=config.resume,
            overwrite=config.overwrite,
            load=self.load_checkpoint,
            is_main=self.is_main,
        )

    # ------------------------------------------------------------------ set-up helpers
    def _setup_model(self, model: nn.Module) -> None:
        """The raw model on the device, its optimizer and loss scaler, and the compiled / DDP-wrapped views of it."""
        config = self.config
        self.model = ckpt.unwrap_model(model).to(self.device)
        # torch.compile(model) would train uncompiled
        if self.model is not model and not config.compile:
            logger.warning("training the module inside %s, uncompiled (compile=True compiles it)", type(model).__name__)
        block_size = getattr(getattr(self.model, "config", None), "block_size", None)
        if block_size is not None and config.seq_len > block_size:
            raise InvalidValueError(
                f"TrainConfig.seq_len={config.seq_len} exceeds the model's block_size={block_size}; "
                "train on shorter sequences or build the model with a larger block_size"
            )
        # switched on in the raw model, before compiling and wrapping
        if config.activation_checkpointing and not callable(getattr(self.model, "set_activation_checkpointing", None)):
            raise InvalidValueError(
                "activation_checkpointing=True needs a model with a set_activation_checkpointing() method (gpt2's GPT "
                f"and its subclasses); {type(model).__name__} has none: train it with activation_checkpointing=False"
            )
        if config.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        check_master_weights(self.model)
        self._shard_if_fsdp()
        self.optimizer = build_optimizer(self.model, config)
        self._trainable = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.scaler = self.precision.make_scaler()
        self.eval_model: nn.Module = self.model
        if config.compile:
            self.eval_model = torch.compile(self.model)
        self.train_model: nn.Module = self.eval_model
        if self.dist_env.is_distributed and not self.sharded:
            self.train_model = distributed.wrap_ddp(self.eval_model, self.device)

    def _shard_if_fsdp(self) -> None:
        """``strategy="fsdp"`` with more than one process: shard the raw model in place (before the optimizer is
        built on its shards). What needs the whole model is taken first: the LoRA base's fingerprint (checkpoints
        record it) and an empty twin of the model (:meth:`full_model` fills it).
        """
        self.sharded = self.config.strategy == "fsdp" and self.dist_env.is_distributed
        self._base_fingerprint: str | None = None
        self._twin: nn.Module | None = None
        if self.config.strategy == "fsdp" and not self.sharded:
            logger.info("strategy='fsdp' with one process: nothing to shard, it trains as one process does")
        if not self.sharded:
            return
        fsdp.refuse_unsupported(self.config)
        if minlora.lora_sites(self.model):
            self._base_fingerprint = minlora.base_fingerprint(self.model)
        self._twin = fsdp.empty_twin(self.model)
        fsdp.shard_model(self.model, self.device, self.precision)

    @property
    def is_main(self) -> bool:
        return self.dist_env.is_main

    @property
    def out_dir(self) -> Path | None:
        return Path(self.config.out_dir) if self.config.out_dir is not None else None

    @property
    def checkpoint_dir(self) -> Path | None:
        if self.out_dir is None:
            return None
        return self.out_dir / rundir.CHECKPOINT_DIR

    # ------------------------------------------------------------------ the run's state
    def state_dict(self) -> dict[str, Any]:
        """The run's state, the one description of it that checkpoints and divergence recovery save and restore: the
        step and counters, the data position, divergence recovery's counters, monitor and confirmed checkpoints, the
        RNG states (every rank's: a collective), and the trainable weights, optimizer and loss scaler (the live
        tensors: copy them to keep them). A checkpoint writes the last four into files of their own
        (:data:`IN_FILES`), the rest into ``trainer_state.json``.
        """
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "best_val_loss": self.best_val_loss,
            "data": {"train": self.train_loader.state_dict()},
            "recovery": self.recovery.state_dict(self.checkpoint_dir),
            "rng": ckpt.capture_rng_state(all_ranks=True),
            "model": {name: p for name, p in self.model.named_parameters() if p.requires_grad},
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the run back into ``state`` (:meth:`state_dict`'s). What it lacks of :data:`IN_FILES` is left as it is
        (a checkpoint loads those itself; a weights-only resume starts the optimizer fresh).
        """
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.best_val_loss = state.get("best_val_loss")
        self.train_loader.load_state_dict(state["data"]["train"])
        self.recovery.load_state_dict(state.get("recovery"))
        # the trainable weights only (strict=False): the frozen ones are not part of the state
        self.model.load_state_dict(state.get("model", {}), strict=False)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if "rng" in state:
            ckpt.restore_rng_state(state["rng"])

    # ------------------------------------------------------------------ training
    def fit(self, until_step: int | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (or ``until_step``, then with a checkpoint that ``resume="auto"``
        continues; the LR schedule still runs to ``max_steps``); return this call's step records.
        """
        cfg = self.config
        stop = cfg.max_steps if until_step is None else min(int(until_step), cfg.max_steps)
        if self.step >= stop:
            logger.info("already at step %d (stopping at %d): nothing to train", self.step, stop)
            return []
        # Where this call's records go: metrics.jsonl, the sinks, TensorBoard / W&B (config.log_to) and the progress
        # bar; before any of them writes into out_dir, the Trainer checks that it still owns it.
        self._check_owner()
        log = FitLog(self.sinks, cfg, out_dir=self.out_dir, step=self.step, is_main=self.is_main)
        # What the log just created (metrics.jsonl, TensorBoard's and W&B's folders) is the run's from
        # now on: recorded at once, so that a run killed before its first checkpoint still resumes.
        self._record_outputs()
        schedule = CheckpointSchedule(cfg.checkpoint_interval, cfg.max_steps, stop)
        first = len(self.history)
        signals = self._signals.install()
        self.recovery.begin(self)
        interrupted = False
        try:
            while self.step < stop:
                record = self.train_step()
                in_trouble = self.recovery.judge(record)
                self._validate_if_due(record, log)
                # the callbacks (which may add entries), then the history, metrics.jsonl and the sinks
                for callback in self.callbacks:
                    callback(self, record)
                self.history.append(record)
                log.emit(record)
                saved = False
                if in_trouble:
                    # back to the newest good state, or TrainingDivergedError; the metrics go back with it
                    self.recovery.recover(self, record)
                    self._check_owner()
                    log.rewind(self.step)
                else:
                    saved = self._save_if_due(schedule)
                self._stop_if_signalled(saved)
        except TrainingInterrupted:
            interrupted = True
            raise
        finally:
            log.close()
            self._record_outputs()
            # Under DDP the stop signal reaches a rank again (torchrun's agent forwards it) while
            # it leaves the process group: close() restores the handlers after that.
            if not (interrupted and self.dist_env.is_distributed):
                signals.restore()
        if self.is_main and self.out_dir is not None and self.config.plot:
            metrics.plot_loss_curve(
                metrics.read_jsonl(self.out_dir / metrics.METRICS_FILE), self.out_dir / metrics.PLOT_FILE
            )
        self._record_outputs()
        return self.history[first:]

    def _check_owner(self) -> None:
        """Before a write into out_dir: rank 0 checks that this run still owns it (the lock is rank 0's)."""
        if self._run_lock is not None:
            self._run_lock.ensure_held()

    def _record_outputs(self) -> None:
        """Record in out_dir's record what the Trainer has written there (rank 0), so that a later
        ``overwrite`` may replace it and nothing else (:func:`gpt2.train.rundir.record_outputs`).
        """
        if self.is_main and self.out_dir is not None:
            rundir.record_outputs(self.out_dir, rundir.TRAINER_FILES)

    def _validate_if_due(self, record: dict[str, Any], log: FitLog) -> None:
        """Add the validation loss to the record of a step due for one (``eval_interval``)."""
        if self.val_loader is None or not self.due(self.config.eval_interval):
            return
        # evaluation takes a while on a CPU: say so on the bar
        log.status("evaluating ...")
        try:
            record["val_loss"] = self.evaluate()
        except NonFiniteLossError as e:
            # the training loss decides about divergence
            record["val_loss"] = e.loss

    def _save_if_due(self, schedule: CheckpointSchedule) -> bool:
        """Save what ``schedule`` says is due: a checkpoint or, without an out_dir, a fresh in-memory copy for
        divergence recovery. True when a checkpoint was written.
        """
        to_disk = self.out_dir is not None
        # without recovery there is no in-memory copy to refresh
        if not to_disk and not self.config.recovery.enabled:
            return False
        if not schedule.save_now(self.step, good=self.recovery.good, to_disk=to_disk):
            return False
        if not to_disk:
            self.recovery.refresh_snapshot(self)
            return False
        self.save_checkpoint()
        return True

    def _stop_if_signalled(self, saved: bool) -> None:
        """At a step boundary: if any rank got a stop signal, all save and raise TrainingInterrupted."""
        # every rank stops after the same step
        signum = distributed.all_reduce_int(self._signals.received, "max")
        if not signum:
            return
        if self.out_dir is not None and not saved:
            self.save_checkpoint()
        raise TrainingInterrupted(signum, step=self.step, checkpoint=self.last_checkpoint)

    def due(self, interval: int) -> bool:
        """Is the step just taken due for a task run every ``interval`` steps (0 = never)? The last step is."""
        return is_due(self.step, interval, self.config.max_steps)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its metrics record."""
        cfg = self.config
        lr = self.recovery.lr_scale * lr_at(
            self.step, max_lr=cfg.max_lr, min_lr=cfg.final_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps
        )
        set_lr(self.optimizer, lr)
        self.train_model.train()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        # All micro-batches are read first (token ids are small): each one's loss share needs the global count of
        # scored targets.
        batches = [self.train_loader.next_batch() for _ in range(self.grad_accum_steps)]
        # A custom loader's targets are checked too: -100 is not ignored here.
        if self.vocab_size:
            for batch in batches:
                check_targets(batch[1], self.vocab_size)
        # counted on the CPU (no device sync), then summed over the processes
        counts = [int((batch[1] != IGNORE_INDEX).sum()) for batch in batches]
        scored = distributed.all_reduce_int(sum(counts), "sum")
        if scored == 0:
            # A mean over no targets is 0/0: no forward, and no optimizer step either (AdamW would
            # still decay and move the weights on zero gradients).
            loss_value, grad_norm, skipped, bad = 0.0, 0.0, True, False
        else:
            # each weight cast to bf16 / fp16 once per step, not once per micro-step
            with self.precision.step_casts(len(batches)):
                loss_value = self._accumulate(batches, counts, scored)
            grad_norm, skipped, bad = self._optimizer_step(loss_value)
        if skipped:
            self.skipped_steps += 1
        if self.device.type == "cuda":
            # the step's kernels are queued asynchronously: time them all
            torch.cuda.synchronize()
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
            "mfu": metrics.mfu(self.flops_per_token, tokens_per_second, self.peak_flops, self.dist_env.world_size),
            "scored_tokens": scored,
            "skipped": skipped,
            "skipped_steps": self.skipped_steps,
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        if skipped:
            _warn_skipped(record, bad)
        return record

    def _accumulate(self, batches: list[tuple], counts: list[int], scored: int) -> float:
        """Forward and backward every micro-batch; returns the global batch's mean loss.

        Each micro-batch adds the SUM of its targets' losses divided by the global batch's count
        ``scored``, so the gradients add up to the gradient of the mean over every scored target of
        the global batch: a micro-batch (or rank) with 3 response tokens weighs as little as they
        do, not as much as one with 300. DDP averages gradients over the ranks: hence x world_size.
        """
        scale = self.dist_env.world_size / scored
        # a model that can sum its targets' losses itself, as gpt2.GPT
        sums = "reduction" in inspect.signature(self.model.forward).parameters
        loss_sum = torch.zeros((), device=self.device)
        for micro_step, (batch, count) in enumerate(zip(batches, counts)):
            x, y, kwargs = self._to_device(batch)
            # Under DDP and FSDP, only the last micro-step's backward averages gradients across processes.
            last = micro_step == len(batches) - 1
            if self.sharded:
                # FSDP reduce-scatters the gradients then; the earlier micro-steps accumulate them unsharded
                self.model.set_requires_gradient_sync(last)
            with distributed.no_sync(self.train_model, skip_sync=not last):
                with self.precision.autocast():
                    loss = self._summed_loss(x, y, kwargs, count, sums)
                loss = loss * scale
                loss_sum += loss.detach()
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
        # Every process logs (and judges) the loss of the whole global batch.
        return distributed.all_reduce_mean(loss_sum).item()

    def _to_device(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-batch's inputs, targets and extra model arguments (e.g. a packed batch's attn_mask and
        position_ids) on the device. On CUDA through pinned memory: the copy runs alongside the previous
        step's kernels.
        """
        extras = batch[2] if len(batch) > 2 else {}
        cuda = self.device.type == "cuda"
        tensors = [*batch[:2], *extras.values()]
        if cuda:
            tensors = [t.pin_memory() for t in tensors]
        x, y, *values = [t.to(self.device, non_blocking=cuda) for t in tensors]
        return x, y, dict(zip(extras, values))

    def _summed_loss(
        self, x: torch.Tensor, y: torch.Tensor, kwargs: dict[str, Any], count: int, sums: bool
    ) -> torch.Tensor:
        """The sum of the micro-batch's ``count`` targets' losses: from the model itself when it ``sums``
        (``reduction="sum"``), else its mean loss times ``count``.
        """
        if sums:
            _, loss = self.train_model(x, y, reduction="sum", **kwargs)
            return loss
        # forward(idx, targets) -> (logits, mean loss): the mean of no targets is NaN
        _, loss = self.train_model(x, y, **kwargs)
        if count:
            return loss * count
        return loss.nan_to_num(0.0) * 0.0

    def _optimizer_step(self, loss_value: float) -> tuple[float, bool, bool]:
        """Unscale, clip, step (unless non-finite). Returns (grad_norm, skipped, bad)."""
        if self.scaler is not None:
            # clip the true gradients, not the scaled ones
            self.scaler.unscale_(self.optimizer)
        # inf: measure the norm, change nothing
        max_norm = self.config.grad_clip or math.inf
        norm = torch.nn.utils.get_total_norm([p.grad for p in self._trainable if p.grad is not None])
        # a DTensor over every process's shards: its full value is a collective
        grad_norm = float(norm.full_tensor() if self.sharded else norm)
        # Gradients within the limit are left as they are: clip_grad_norm_ would multiply them all by 1.0, a pass
        # over every gradient (1.5% of the 124M bf16 step on a CPU).
        if grad_norm > max_norm:
            torch.nn.utils.clip_grads_with_norm_(self._trainable, max_norm, norm)
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        skipped = bad = not finite
        if self.scaler is None:
            if finite:
                self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            if finite:
                self.scaler.step(self.optimizer)
            # lowers the scale when unscale_ found inf/nan gradients
            self.scaler.update()
            # Overflow of *scaled* fp16 gradients is the scaler searching for its scale (normal);
            # a non-finite loss, or an overflow at scale <= 1, is a real numerical problem.
            overflow = self.scaler.get_scale() < scale
            bad = bad and not (overflow and math.isfinite(loss_value) and scale > 1.0)
        # a skipped step's non-finite gradients go nowhere: the next step sets them to None first
        self.recovery.count_step(bad)
        return grad_norm, skipped, bad

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, steps: int | None = None) -> float:
        """Mean validation loss per scored token over the same first ``steps`` (default ``eval_steps``)
        batches of each process every time (:func:`gpt2.eval.loss.evaluate_loss`, which raises
        :class:`~gpt2.eval.loss.NonFiniteLossError` for an inf/nan loss).
        """
        if self.val_loader is None:
            raise InvalidValueError("no validation data: pass val_data to the Trainer")
        cfg = self.config
        where = f"out_dir {self.out_dir}" if self.out_dir is not None else "no out_dir"
        result = evaluate_loss(
            self.eval_model,
            self.val_loader,
            cfg.micro_batch_size,
            cfg.seq_len,
            # steps=0 is refused there, not taken for the default
            cfg.eval_steps if steps is None else steps,
            self.precision.autocast,
            device=self.device,
            progress=self.is_main and cfg.progress,
            distributed=True,
            source=f"the model being trained ({where}, step {self.step})",
            # once per run: before its first validation loss
            warn_short=self.best_val_loss is None,
        )
        val_loss = result["loss"]
        if self.best_val_loss is None or val_loss < self.best_val_loss:
            self.best_val_loss = val_loss
        return val_loss

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """Checkpoint the current step under ``out_dir/checkpoints`` (rank 0 writes; all ranks
        return the path). Raises :class:`TrainingDivergedError` instead of saving non-finite weights.
        """
        if self.checkpoint_dir is None:
            return None
        # checked on every rank, so all of them stop together
        bad = fsdp.non_finite_parameters(self.model)
        if bad:
            good = self.recovery.newest_confirmed(self.checkpoint_dir)
            raise TrainingDivergedError(
                f"not saving step {self.step}: the model holds non-finite weights ({', '.join(bad[:5])}). "
                f"{last_good(good)}",
                step=self.step,
                loss=math.nan,
                grad_norm=math.nan,
                last_checkpoint=good,
            )
        path = self.checkpoint_dir / f"step_{self.step:06d}"
        # a collective (every rank's CUDA RNG state)
        state = self.state_dict()
        # rank 0 writes; under FSDP every rank writes its shards
        if self.sharded or self.is_main:
            path = self._write_checkpoint(self.checkpoint_dir, state)
        self._record_outputs()
        self.last_checkpoint = path
        self.recovery.saved_checkpoint(self.step)
        return path

    def _write_checkpoint(self, checkpoint_dir: Path, state: dict[str, Any]) -> Path:
        """Write this step's checkpoint of ``state`` (:meth:`state_dict`'s) under ``checkpoint_dir`` (rank 0; every
        rank under FSDP, each its shards): the weights, optimizer and scaler from the model and its optimizer (FSDP
        shards them), the RNG states, and the rest of ``state`` with the run's settings in ``trainer_state.json``.
        A failed write is one line naming the file and the newest intact checkpoint:
        :class:`~gpt2.train.checkpoint.CheckpointSaveError` from the checkpoint module, or a
        :class:`~gpt2.train.metrics.RunOutputError` for any other OSError.
        """
        model_config = getattr(self.model, "config", None)
        # how the run was set up, besides its state
        settings = {
            "config": self.config.to_dict(),
            "model_config": model_config.to_dict() if hasattr(model_config, "to_dict") else None,
            "world_size": self.dist_env.world_size,
            # how the processes share the model: "single", "ddp" or "fsdp"
            "strategy": self.config.strategy if self.dist_env.is_distributed else "single",
            "tokens_per_step": self.tokens_per_step,
            "precision": self.precision.name,
            "torch_version": torch.__version__,
        }
        meta = {**settings, **{k: v for k, v in state.items() if k not in IN_FILES}}
        args = (checkpoint_dir, self.step, self.model, self.optimizer, self.scaler, meta)
        keep_last = self.recovery.checkpoints_to_keep(checkpoint_dir, self.step)
        common = dict(keep_last=keep_last, trainable_only=self.config.save_trainable_only, rng_state=state["rng"])
        try:
            # rank 0 checks first that it still owns out_dir
            return ckpt.save_checkpoint(
                *args, base_fingerprint=self._base_fingerprint, before_write=self._check_owner, **common
            )
        except Gpt2Error:
            raise
        except OSError as e:
            where = e.filename or checkpoint_dir / f"step_{self.step:06d}"
            raise metrics.output_error(where, "saving the checkpoint into", e, checkpoint_dir) from e

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore everything from a checkpoint (see :func:`gpt2.train.checkpoint.load_checkpoint`): weights,
        optimizer, loss scaler, RNG, data position, step and counters; with ``resume_weights_only`` the
        weights, data position and step only (the optimizer and loss scaler start fresh).
        """
        cfg = self.config
        meta = ckpt.load_checkpoint(
            path,
            self.model,
            self.optimizer,
            self.scaler,
            restore_rng=True,
            weights_only=cfg.resume_weights_only,
            allow_base_mismatch=cfg.allow_base_mismatch,
            base_fingerprint=self._base_fingerprint,
        )
        was = (meta.get("tokens_per_step"), meta.get("world_size"))
        now = (self.tokens_per_step, self.dist_env.world_size)
        # once, not once per rank
        if was != now and self.is_main:
            logger.warning(
                "checkpoint was written with %s tokens/step on %s process(es), this run uses %s on %s: "
                "the data order (and so the losses) will differ from an uninterrupted run",
                *was,
                *now,
            )
        if not isinstance(meta.get("data"), dict) or "train" not in meta["data"]:
            raise InvalidValueError(
                f"checkpoint {meta['path']} records no data-loader position ('data' in "
                f"{ckpt.META_FILE}): it was not written by the Trainer, so it cannot be resumed"
            )
        self._keep_recorded_precision(meta.get("precision"))
        # the weights, optimizer, scaler and RNG are loaded: the rest of the run's state
        self.load_state_dict({k: v for k, v in meta.items() if k not in IN_FILES})
        self.recovery.saved_checkpoint(self.step)
        self.last_checkpoint = Path(meta["path"])
        fresh = " (weights only: the optimizer starts fresh)" if cfg.resume_weights_only else ""
        logger.info("resumed from %s at step %d%s", meta["path"], self.step, fresh)
        return meta

    def _keep_recorded_precision(self, recorded: str | None) -> None:
        """precision="auto" resumes in the precision the checkpoint recorded (auto may pick another on this
        machine), unless that needs what is already set up otherwise: FSDP's shards or a loss scaler.
        """
        if self.config.precision != "auto" or recorded in (None, self.precision.name):
            return
        policy = resolve_precision(recorded, self.device)
        # only fp16 has a loss scaler
        if self.sharded or "fp16" in (recorded, self.precision.name):
            raise InvalidValueError(
                f"the checkpoint trained in {recorded} and precision='auto' picks {self.precision.name} here: "
                f"resume with precision={recorded!r} (or {self.precision.name!r} to change it)"
            )
        logger.info("precision %s, as the checkpoint recorded (auto picks %s here)", recorded, self.precision.name)
        self.precision = policy
        self.precision.apply()
        self.peak_flops = metrics.detect_peak_flops(self.device, self.config.peak_flops, policy.name)

    def full_model(self) -> nn.Module | None:
        """The trained model whole, as one plain module (for sampling, saving adapters, exporting): the raw model
        itself, except under FSDP, where EVERY process must call this (the shards are gathered to rank 0, into a
        twin of the model on the CPU) and ranks other than 0 get None.
        """
        if not self.sharded:
            return self.model
        return fsdp.gather_into_twin(self.model, self._twin, self.is_main)

    # ------------------------------------------------------------------ lifetime
    def close(self, wait_for_all: bool = True) -> None:
        """Leave the process group if this Trainer created it (by default at a barrier, see
        :func:`gpt2.train.distributed.destroy_process_group`), then release the ``out_dir`` lock.
        """
        if self._owns_process_group:
            distributed.destroy_process_group(wait_for_all)
            self._owns_process_group = False
        # kept by an interrupted fit() under DDP until the group is gone
        self._signals.restore()
        # the lock object is kept: a fit() or save after this is refused (ensure_held)
        if self._run_lock is not None:
            self._run_lock.release()
        # the last open CPU Trainer gives the kept memory back (a finalizer runs once)
        if self._memory_hold is not None:
            self._memory_hold()
        # the user's sinks with a close(), once (set-up may have failed before there were sinks)
        while getattr(self, "sinks", None):
            getattr(self.sinks.pop(), "close", lambda: None)()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # After an error other ranks may never arrive; a stop signal stops them all at one step.
        self.close(wait_for_all=exc_type is None or issubclass(exc_type, TrainingInterrupted))


def _warn_skipped(record: dict[str, Any], bad: bool) -> None:
    """Say why the step of ``record`` changed no weight."""
    if record["scored_tokens"] == 0:
        why = "the global batch has no scored targets (every target is IGNORE_INDEX)"
    elif bad:
        why = "non-finite loss or gradient norm"
    else:
        why = f"fp16 gradients overflowed, loss scale lowered to {record['loss_scale']:g}"
    logger.warning(
        "step %d skipped (%s): loss %s, grad norm %s", record["step"], why, record["loss"], record["grad_norm"]
    )
