"""``micro_batch_size="auto"``: the largest micro-batch that fits, found when the Trainer starts.

Which sizes: those that divide the sequences each process reads per step (``total_batch_size / (seq_len x
world_size)``), so that accumulation keeps ``total_batch_size`` exactly; without a ``total_batch_size`` (one
micro-batch per step, so the step grows with it) the powers of two up to :data:`MAX_AUTO_SEQUENCES`.

How: doubling, then backing off. The smallest size first, then the smallest size at least twice the last one that
fitted, until one does not (or none is left); then halving the gap between the largest size that fitted and the
smallest that did not: at most log2(largest size) + log2(number of sizes) trials, and on the powers of two none more
than twice the size that fits. A failing trial stops where memory runs out; starting from the largest size instead
would ask for up to a thousand sequences to fail on, and a search downwards tries every size above the answer.

Each trial is one real forward and backward of the raw model on its device, at the run's ``seq_len`` and precision
(``autocast``), on random tokens, with the gradients and the optimizer state already allocated: before the trials,
zero gradients and one optimizer step at learning rate 0 (which moves no weight) allocate them, as a run's second step
has them. The raw model runs eagerly: a compiled one would compile again for every size (and its activations are no
larger); under DDP it talks to no other process, and the gradient buckets DDP made when it wrapped the model are in
GPU memory already (on a CPU they are only mapped until the first step fills them: the limit keeps their size free).
Afterwards the gradients and the optimizer state are dropped again and the RNG is as it was: training starts exactly
as with the size given as a number.

Out of memory: ``torch.cuda.OutOfMemoryError`` on a GPU. A CPU has no such error: Linux lets a process allocate
until its OOM killer ends it. So on a CPU "auto" needs ``memory_limit_gb``, and each trial runs with the
address-space limit (``RLIMIT_AS``) lowered to what the process has mapped now plus ``memory_limit_gb`` minus what it
holds in memory now: an allocation past it fails, and torch raises "DefaultCPUAllocator: can't allocate memory",
which backs off like a GPU's error. The old limit comes back after each trial. Checked with glibc 2.36, torch 2.13
and OpenMP (2 and 4 threads): every failure point of a forward/backward raises cleanly and the process goes on; a
first forward/backward on a few tokens before any limit starts the thread pools (a thread that cannot start would
abort the process).

Under torchrun all processes try the same sizes in lock step and a size counts as fitting only when it fits on every
one (:func:`gpt2.train.distributed.all_reduce_int`): they end on the same size. Resuming (``resume``), the size the
checkpoint's run used is taken again when its ``seq_len`` and number of processes are this run's: the same data order
and no search.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from gpt2.data.loader import make_loader
from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.model.checkpoint_files import find_latest_checkpoint, read_meta
from gpt2.train import distributed
from gpt2.train.config import AUTO, TrainConfig, grad_accum_steps, sequences_per_process
from gpt2.train.distributed import DistributedEnv

logger = logging.getLogger(__name__)

# Without a total_batch_size, the largest micro-batch tried (sequences): far past what a GPU holds at GPT-2's
# 1024 tokens, and a step of a million tokens at 1024 tokens each.
MAX_AUTO_SEQUENCES = 1024
# Tokens of the first forward/backward, before any limit: it starts the thread pools and one-time buffers.
WARMUP_TOKENS = 8
# What torch's errors say when an allocation failed (CPU allocator, CUDA, MPS, std::bad_alloc, ENOMEM, cuBLAS).
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "bad_alloc", "alloc_failed")
GIB = 2**30


class NoMicroBatchFitsError(Gpt2Error, MemoryError):
    """Not even one sequence of ``seq_len`` tokens fits (with the model, its gradients and optimizer state)."""


@dataclasses.dataclass(frozen=True)
class Trial:
    """One size tried, and whether it fitted (on every process)."""

    size: int
    fitted: bool


# --------------------------------------------------------------------------- which sizes, in which order
def candidate_sizes(per_process: int | None, cap: int = MAX_AUTO_SEQUENCES) -> list[int]:
    """The micro-batch sizes "auto" may choose, smallest first: the divisors of ``per_process`` (the sequences one
    process reads per step), or without one the powers of two up to ``cap``.
    """
    if per_process is None:
        return [2**k for k in range(cap.bit_length()) if 2**k <= cap]
    small = [d for d in range(1, math.isqrt(per_process) + 1) if per_process % d == 0]
    return sorted({*small, *(per_process // d for d in small)})


def search(
    sizes: list[int], fits: Callable[[int], bool], agree: Callable[[bool], bool] = bool
) -> tuple[int | None, list[Trial]]:
    """The largest of ``sizes`` (ascending) for which ``fits`` holds, by doubling then bisecting (module docstring),
    assuming that a size fits when a larger one does. ``agree(fitted)`` turns one process's answer into every
    process's (all must call it for the same sizes). Returns it (None: not even the smallest) and the trials.
    """
    trials: list[Trial] = []

    def attempt(index: int) -> bool:
        fitted = agree(fits(sizes[index]))
        trials.append(Trial(sizes[index], fitted))
        return fitted

    # sizes[fitting] fitted, sizes[failing] did not (-1 and len(sizes): none known yet)
    fitting, failing, index = -1, len(sizes), 0
    while fitting < len(sizes) - 1:
        if not attempt(index):
            failing = index
            break
        fitting = index
        # the smallest size at least twice this one, else the largest
        index = min(bisect.bisect_left(sizes, 2 * sizes[index]), len(sizes) - 1)
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if attempt(middle):
            fitting = middle
        else:
            failing = middle
    if fitting < 0:
        return None, trials
    return sizes[fitting], trials


def describe(trials: list[Trial]) -> str:
    """``1, 2, 4, 8 out of memory, 6``: the sizes in the order tried."""
    return ", ".join(f"{t.size}" if t.fitted else f"{t.size} out of memory" for t in trials)


# --------------------------------------------------------------------------- out of memory
def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says that an allocation failed (and nothing else went wrong)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in text for words in OUT_OF_MEMORY_WORDS)


def memory_now() -> tuple[int, int]:
    """(bytes mapped, bytes resident) of this process, from Linux's ``/proc/self/statm``."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm", encoding="ascii") as file:
        mapped, resident = file.read().split()[:2]
    return int(mapped) * page, int(resident) * page


@contextlib.contextmanager
def address_space_limit(limit_bytes: int) -> Iterator[None]:
    """Within this block, this process may map at most ``limit_bytes`` minus what it holds in memory now: Linux's
    ``RLIMIT_AS`` (soft limit; a lower one already set stays) is lowered to the bytes mapped now plus that. Memory
    mapped but not yet used (reserved heap, thread stacks) may still fill without a new mapping, but what is in use
    stays about within ``limit_bytes``. The old limit comes back on the way out, whatever happens.
    """
    import resource

    mapped, resident = memory_now()
    if resident >= limit_bytes:
        raise NoMicroBatchFitsError(
            f"this process already holds {resident / GIB:.2f} GiB, as much as the limit of {limit_bytes / GIB:.2f} GiB"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    lowered = mapped + (limit_bytes - resident)
    # The soft limit is at most the hard one.
    if soft != resource.RLIM_INFINITY:
        lowered = min(lowered, soft)
    resource.setrlimit(resource.RLIMIT_AS, (lowered, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# --------------------------------------------------------------------------- trials on the real model
@contextlib.contextmanager
def trials_on(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    autocast: Callable[[], Any],
    device: torch.device,
    seq_len: int,
    limit_bytes: int | None = None,
) -> Iterator[Callable[[int], bool] | None]:
    """Yields ``fits(size)``: whether one forward and backward of ``size`` random sequences of ``seq_len`` tokens
    (of its ``config.vocab_size``) fits in ``module`` (``module(x, y) -> (logits, loss)``, on ``device``), with the
    gradients and the optimizer state (of ``optimizer``, which holds its trainable parameters) allocated as a run's
    second step has them; None when even those do not fit. ``limit_bytes``: each trial under
    :func:`address_space_limit` (a CPU); None: the device's own memory is the limit (a GPU). On the way out the
    gradients and the optimizer state are dropped again.
    """
    generator = torch.Generator().manual_seed(0)
    vocab_size = getattr(getattr(module, "config", None), "vocab_size", None) or 1
    was_training = module.training

    def run(size: int, tokens: int, limit: contextlib.AbstractContextManager) -> bool:
        x = torch.randint(0, vocab_size, (size, tokens), generator=generator).to(device)

        def forward_backward() -> None:
            with limit:
                with autocast():
                    _, loss = module(x, x)
                loss.backward()

        return _guarded(forward_backward, device)

    def fits(size: int) -> bool:
        limit = contextlib.nullcontext()
        if limit_bytes is not None:
            # a process already at the limit fails here, as a MemoryError: the same answer on every process
            limit = address_space_limit(limit_bytes)
        fitted = run(size, seq_len, limit)
        _free(device)
        return fitted

    module.train()
    try:
        # Warm up on a few tokens (no limit yet), then allocate the gradients and the optimizer state.
        ready = run(1, min(WARMUP_TOKENS, seq_len), contextlib.nullcontext()) and _allocate(optimizer, device)
        yield fits if ready else None
    finally:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
        module.train(was_training)
        _free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)


def _allocate(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Zero gradients and one optimizer step at learning rate 0; False when they do not fit."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
            # Learning rate 0 and zero gradients: AdamW's decay (1 - lr * wd) and update are exactly nothing.
            group["lr"] = 0.0
        return _guarded(optimizer.step, device)
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr


def _guarded(work: Callable[[], Any], device: torch.device) -> bool:
    """``work()``; False when it ran out of memory (its tensors are gone once this returns)."""
    try:
        work()
        if device.type == "cuda":
            # a kernel's failure would otherwise surface later
            torch.cuda.synchronize(device)
        return True
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        return False


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the Trainer's entry point
def resolve_micro_batch_size(
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    autocast: Callable[[], Any],
    *,
    device: torch.device,
    env: DistributedEnv | None = None,
    data: Sequence[tuple[str, Any]] = (),
) -> TrainConfig:
    """``config`` itself when its ``micro_batch_size`` is a number; with "auto" a copy with the size the checkpoint
    it resumes recorded, or else the largest that fits (module docstring). ``model``: the raw model on ``device``
    (not compiled, not DDP-wrapped); ``optimizer``: its optimizer; ``autocast()``: the run's precision; ``env``: this
    process's place in the job (default: one process); ``data``: ``(split, source)`` pairs as the Trainer gets them
    (a size must leave one step in each). Logs one line on the main process.
    """
    if config.micro_batch_size != AUTO:
        return config
    env = env or DistributedEnv()
    per_process = sequences_per_process(config, env.world_size)
    sizes = sizes_the_data_holds(candidate_sizes(per_process), data, config.seq_len, env)
    recorded = recorded_micro_batch_size(config, env.world_size, sizes)
    if recorded is not None:
        size, how = recorded
    else:
        size, how = _find(config, (model, optimizer, autocast), device, env.world_size, sizes)
    resolved = dataclasses.replace(config, micro_batch_size=size)
    steps = grad_accum_steps(resolved, env.world_size)
    if env.is_main:
        logger.info(
            f"micro-batch size auto: {size} sequences of {config.seq_len} tokens {how}; accumulation {steps} "
            f"micro-step{'s' * (steps != 1)} per step"
        )
    return resolved


def sizes_the_data_holds(
    sizes: list[int], data: Sequence[tuple[str, Any]], seq_len: int, env: DistributedEnv
) -> list[int]:
    """The sizes of ``sizes`` (ascending) for which every ``(split, source)`` of ``data`` holds one step (each of its
    shards ``size x seq_len x world_size + 1`` tokens), checked by building its loader. A ready loader is refused:
    its batch size is fixed. The data's own problems (a missing file, too few tokens for one sequence) raise here,
    as the Trainer would raise them.
    """
    sources = [(split, source) for split, source in data if source is not None]
    for split, source in sources:
        if hasattr(source, "next_batch"):
            raise InvalidValueError(
                f"micro_batch_size='auto' chooses the batch size, so the Trainer builds the loaders: pass the "
                f"{split} tokens, token file or shard directory, not a {type(source).__name__} built for one size"
            )

    def holds(size: int) -> bool:
        try:
            for split, source in sources:
                make_loader(source, split, size, seq_len, rank=env.rank, world_size=env.world_size)
        except InvalidValueError:
            if size == sizes[0]:
                raise
            return False
        return True

    largest, _ = search(sizes, holds)
    return [size for size in sizes if size <= largest]


def _find(
    config: TrainConfig, training: tuple, device: torch.device, world_size: int, sizes: list[int]
) -> tuple[int, str]:
    """The search on the model of ``training`` (model, optimizer, autocast): (size, how it was found, for the log
    line).
    """
    model, optimizer, autocast = training
    limit = _limit_bytes(config, device)
    trials_limit = limit
    if limit is not None and world_size > 1 and config.strategy == "ddp":
        # DDP's gradient buckets (a copy of the gradients) are mapped on a CPU but not yet in memory: keep room for them
        trials_limit -= sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    cuda_rng = [device] if device.type == "cuda" else []
    # dropout draws from the RNG: the run's random numbers stay those of a run with a number given
    with torch.random.fork_rng(devices=cuda_rng):
        with trials_on(model, optimizer, autocast, device, config.seq_len, trials_limit) as fits:
            size, trials = None, []
            if _agree(fits is not None):
                size, trials = search(sizes, fits, _agree)
    if size is None:
        where = f"the memory of {device}"
        if limit is not None:
            held = memory_now()[1] / GIB
            where = f"TrainConfig.memory_limit_gb={config.memory_limit_gb:g} GiB (this process holds {held:.2f} GiB)"
        if not trials:
            # No trial: the model with its gradients and optimizer state, on a few tokens, did not fit.
            raise NoMicroBatchFitsError(
                f"the model with its gradients and optimizer state does not fit in {where}: no "
                "micro_batch_size='auto' can; train a smaller model, or give it more memory"
            )
        raise NoMicroBatchFitsError(
            f"not even one sequence of {config.seq_len} tokens fits in {where} (tried {describe(trials)}); lower "
            "seq_len, use activation_checkpointing or a lower precision, or give it more memory"
        )
    where = f"on {device}"
    if limit is not None:
        where = f"in {config.memory_limit_gb:g} GiB (memory_limit_gb)"
    return size, f"fit {where} (tried {describe(trials)})"


def _limit_bytes(config: TrainConfig, device: torch.device) -> int | None:
    """The CPU's limit in bytes (None on a GPU), refused in one line where a CPU run cannot be held to one."""
    if device.type != "cpu":
        if config.memory_limit_gb is not None:
            logger.warning("memory_limit_gb applies on a CPU; on %s its own memory is the limit", device)
        return None
    if config.memory_limit_gb is None:
        raise InvalidValueError(
            "micro_batch_size='auto' on a CPU needs memory_limit_gb (--memory-limit-gb GiB, e.g. 8): the memory one "
            "process may use; a CPU has no out-of-memory error to back off from (Linux's OOM killer ends the process)"
        )
    if not sys.platform.startswith("linux"):
        raise InvalidValueError(
            f"micro_batch_size='auto' on a CPU holds the search to memory_limit_gb with Linux's RLIMIT_AS, which "
            f"{sys.platform} does not enforce; give micro_batch_size a number"
        )
    # A limit beyond this machine's memory holds nothing back (and past 2**63 bytes Linux cannot take it).
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    if config.memory_limit_gb > total:
        raise InvalidValueError(
            f"memory_limit_gb (--memory-limit-gb) must be in (0, {total:.1f}] GiB, this machine's memory; "
            f"got {config.memory_limit_gb:g}"
        )
    return int(config.memory_limit_gb * GIB)


def _agree(fitted: bool) -> bool:
    """One process's answer as every process's: fitted only where it fitted on all of them."""
    return bool(distributed.all_reduce_int(int(fitted), "min"))


# --------------------------------------------------------------------------- resuming
def recorded_micro_batch_size(config: TrainConfig, world_size: int, sizes: list[int]) -> tuple[int, str] | None:
    """The micro-batch size recorded by the checkpoint ``config.resume`` names, with the log line's words, where this
    run can take it again (same ``seq_len`` and number of processes, one of ``sizes``); else None.
    """
    checkpoint = None
    if config.resume is not None:
        # the checkpoint the resume most likely loads (resume='auto': the newest in out_dir)
        checkpoint = find_latest_checkpoint(config.out_dir if config.resume == "auto" else config.resume)
    if checkpoint is None:
        return None
    meta = read_meta(checkpoint, problems=[])
    try:
        recorded = meta["config"]
        size, seq_len, processes = recorded["micro_batch_size"], recorded["seq_len"], meta["world_size"]
    except (KeyError, TypeError):
        # the resume itself says what is wrong with it
        return None
    if size not in sizes or (seq_len, processes) != (config.seq_len, world_size):
        return None
    return size, f"as recorded in {checkpoint} (same data order; no search)"
