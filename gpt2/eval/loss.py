"""Evaluation: validation loss / perplexity over token data (HellaSwag: :mod:`gpt2.eval.hellaswag`)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, ContextManager, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from gpt2.data.loader import TokenLoader, one_pass
from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.model.gpt import IGNORE_INDEX

logger = logging.getLogger(__name__)

# What an autocast argument may be: nothing, a dtype (bf16/fp16 autocast on the model's device),
# or a zero-argument callable returning a fresh context manager (e.g. a precision policy's).
AutocastArg = Union[None, torch.dtype, Callable[[], ContextManager[Any]]]


def _model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _autocast_context(autocast: AutocastArg, device: torch.device) -> ContextManager[Any]:
    if autocast is None or autocast == torch.float32:
        return contextlib.nullcontext()
    if isinstance(autocast, torch.dtype):
        return torch.autocast(device_type=device.type, dtype=autocast)
    if callable(autocast):
        return autocast()
    raise TypeError(
        f"autocast must be None, a torch.dtype or a callable returning a context manager, got {type(autocast).__name__}"
    )


def _logits(output: Any) -> torch.Tensor:
    """Logits from a forward output: GPT's ``(logits, loss)`` tuple, a bare tensor, or an
    object with ``.logits`` (a ``transformers`` model).
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model's forward returned {type(output).__name__}; expected logits, a (logits, loss) "
        f"tuple, or an object with .logits"
    )


class NonFiniteLossError(Gpt2Error, ValueError):
    """The evaluated loss is inf or NaN: the model (its weights or activations) is broken."""

    def __init__(self, message: str, loss: float):
        super().__init__(message)
        self.loss = loss


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    data: Any,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    autocast: AutocastArg = None,
    *,
    split: str | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    distributed: bool = False,
    source: str = "the model",
    warn_short: bool = True,
) -> dict[str, float]:
    """Mean next-token cross-entropy of ``model`` over ``data``: ``{"loss", "perplexity", "tokens"}``.

    ``data``: a 1-D token tensor / array, a token file, a directory of shards (``split`` picks e.g. the "val" ones), or
    a loader. Batches are read in order from the start, every full batch once or at most ``max_batches``; a batch is
    never read twice (short data logs a warning unless ``warn_short=False``). A non-finite loss raises
    :class:`NonFiniteLossError` naming ``source``.

    ``distributed=True`` under ``torchrun``: every rank calls this with the same arguments, rank ``r`` scores batches
    ``r, r + world_size, ...`` and the sums are all-reduced, so every rank returns the one-process result. A loader
    built for this rank and world size is read whole by its rank (``max_batches`` then counts per rank).
    """
    if max_batches is not None and (isinstance(max_batches, bool) or int(max_batches) < 1):
        raise InvalidValueError(f"max_batches must be a positive integer or None, got {max_batches!r}")
    rank, world_size = 0, 1
    if distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    per_rank = world_size > 1 and getattr(data, "world_size", 1) == world_size  # this rank's share already
    if world_size > 1 and not per_rank and getattr(data, "world_size", 1) != 1:
        raise InvalidValueError(
            "distributed=True splits one sequence of batches across the ranks: pass the tokens, a "
            "token file, a one-process TokenLoader (world_size=1) or one built for this rank and world size"
        )
    device = torch.device(device) if device is not None else _model_device(model)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    loader = data
    if (sizes := (getattr(data, "batch_size", batch_size), getattr(data, "seq_len", seq_len))) != (batch_size, seq_len):
        raise InvalidValueError(
            f"the loader reads batches of {sizes[0]} x {sizes[1]}, not {batch_size} x {seq_len}: build it so"
        )
    if not hasattr(data, "next_batch"):  # ids checked against the vocabulary on the CPU (forward never syncs to)
        loader = TokenLoader(data, batch_size, seq_len, split=split, vocab_size=vocab_size)
    batches = one_pass(loader, max_batches)
    if progress:
        known = [n for n in (max_batches, getattr(loader, "batches_per_pass", None)) if n]  # the bar's total
        batches = tqdm(
            batches, total=min(known, default=None), desc="eval", unit="batch", dynamic_ncols=True, leave=False
        )
    was_training = model.training
    model.eval()
    # [summed loss, scored tokens]: float64 so a long pass loses no precision, one tensor so the
    # ranks combine both in one all-reduce.
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    seen = 0  # batches in the sequence (all ranks' shares)
    try:
        for i, (x, y) in enumerate(batches):
            seen += 1
            if not per_rank and i % world_size != rank:
                continue  # another rank's share
            x, y = x.to(device), y.to(device)
            with _autocast_context(autocast, device):
                logits = _logits(model(x)).float()
            # Loss in fp32 whatever the autocast dtype; summed so batches weigh by their tokens.
            # Targets equal to IGNORE_INDEX (prompt and padding of instruction data) are not
            # scored and not counted, so the mean is over the scored tokens only.
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
            sums[0] += loss.double()
            sums[1] += (y != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if world_size > 1:
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM)
    total, n_tokens = sums[0].item(), int(sums[1])
    if n_tokens == 0:
        raise InvalidValueError("no token was scored: the data is shorter than one batch (or every target is ignored)")
    if warn_short and max_batches is not None and seen < max_batches and rank == 0:
        logger.warning(
            f"the evaluation data holds only {seen} batches of {batch_size} x {seq_len} tokens; scored those "
            f"{seen} once instead of max_batches={max_batches} (no batch is read twice)"
        )
    mean = total / n_tokens
    if not math.isfinite(mean):
        raise NonFiniteLossError(
            f"the validation loss of {source} is {mean} over {n_tokens:,} tokens: its weights or activations "
            "overflow (a diverged run or a damaged file?); evaluate an earlier checkpoint, or try fp32",
            mean,
        )
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": n_tokens}
