"""Data-parallel training under ``torchrun`` (one process per GPU, told who it is by ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``): process group (NCCL on GPUs, gloo on CPUs), reductions, no_sync.
No module-level state: the Trainer keeps a :class:`DistributedEnv`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ContextManager, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gpt2.errors import InvalidValueError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedEnv:
    """Who this process is in a (possibly one-process) data-parallel job."""

    rank: int = 0
    # Index on this machine: which GPU to use.
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and logs to the console."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def env_from_environ(environ: Mapping[str, str] = os.environ) -> DistributedEnv:
    """Read ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` as ``torchrun`` sets them (absent = 1 process), from this
    process's environment (``os.environ`` itself, read at each call) unless ``environ`` is given.
    """
    values = {}
    for key, default in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        # absent or empty: the default
        raw = environ.get(key) or default
        try:
            values[key] = int(raw)
        except ValueError:
            raise InvalidValueError(
                f"environment variable {key}={raw!r} is not an integer; launch with torchrun"
            ) from None
    env = DistributedEnv(rank=values["RANK"], local_rank=values["LOCAL_RANK"], world_size=values["WORLD_SIZE"])
    if env.world_size < 1 or not 0 <= env.rank < env.world_size or env.local_rank < 0:
        raise InvalidValueError(
            f"inconsistent torchrun environment: RANK={env.rank}, LOCAL_RANK={env.local_rank}, "
            f"WORLD_SIZE={env.world_size} (need 0 <= RANK < WORLD_SIZE)"
        )
    return env


def uses_cuda(device: str | torch.device | None) -> bool:
    """Whether ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...) means a CUDA GPU here."""
    device = str(device or "auto").lower()
    if device == "auto":
        return torch.cuda.is_available()
    return device.startswith("cuda")


def resolve_device(device: str | torch.device, env: DistributedEnv | None = None) -> torch.device:
    """``"auto"`` = ``cuda:LOCAL_RANK`` when CUDA is available, else cpu; ``"cuda"`` under DDP
    also means this process's GPU, ``cuda:LOCAL_RANK`` (``env`` defaults to this process's). ``""`` is refused,
    as ``TrainConfig`` refuses it.
    """
    env = env or env_from_environ()
    if device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except RuntimeError as err:
            raise InvalidValueError(
                f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N' ({err})"
            ) from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidValueError(
                f"device {str(device)!r} requested but CUDA is not available; use device='cpu' or 'auto'"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(resolved)
    return resolved


def init_process_group(env: DistributedEnv, device: torch.device) -> bool:
    """Join the job's process group when there is more than one process; True when this call
    created it (the caller destroys it), False for one process or a group the user made.
    """
    if not env.is_distributed:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed support")
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise RuntimeError(
                f"an existing process group has world size {dist.get_world_size()}, but WORLD_SIZE is {env.world_size}"
            )
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    # resolve_device has already called torch.cuda.set_device, so NCCL uses this process's GPU.
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)
    logger.info("joined process group: rank %d of %d (%s)", env.rank, env.world_size, backend)
    return True


def destroy_process_group(wait_for_all: bool = True) -> None:
    """Leave the process group. ``wait_for_all`` first waits at a barrier: rank 0 may still be writing checkpoints and
    plots, and a rank that tears its gloo connections down under it has been seen to abort ("terminate called without an
    active exception"). Skip the barrier when leaving because of an error, which the other ranks may never reach.
    """
    if dist.is_available() and dist.is_initialized():
        if wait_for_all:
            dist.barrier()
            # gloo's worker thread destroys the barrier's finished work after barrier() has returned, and needs the
            # GIL for it; the last reference to the group (held by DDP's Reducer) may be dropped meanwhile, and the
            # group's destructor then joins that thread while holding the GIL: a deadlock seen once at exit (torch
            # 2.13, CI). Sleeping releases the GIL and gives the thread the time to finish.
            time.sleep(0.1)
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over all processes, in place (a no-op with one process)."""
    if not _active():
        return tensor
    # a sum, then a division: gloo has no AVG
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= dist.get_world_size()
    return tensor


def all_reduce_int(value: int, op: Literal["max", "min", "sum"]) -> int:
    """``value`` reduced with ``op`` over all processes (``value`` itself with one process), exact as integers are:
    e.g. whether a micro-batch fitted on every one (``"min"``, :mod:`gpt2.train.batch_finder`).
    """
    if not _active():
        return value
    device = "cpu"
    # NCCL reduces GPU tensors only.
    if dist.get_backend() == "nccl":
        device = "cuda"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return int(tensor.item())


def wrap_ddp(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    """DistributedDataParallel around ``module`` (already compiled, if compiling)."""
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(module: nn.Module, skip_sync: bool) -> ContextManager:
    """Skip DDP's gradient all-reduce inside this context (forward and backward) when ``skip_sync``:
    during accumulation only the last micro-step needs it, earlier syncs only cost communication.
    """
    if skip_sync and isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()
