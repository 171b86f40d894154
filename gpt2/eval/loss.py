"""Evaluation: validation loss / perplexity over token data (HellaSwag: :mod:`gpt2.eval.hellaswag`)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ContextManager, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from gpt2.data.loader import TokenLoader, one_pass
from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.eval import lockstep
from gpt2.files import progress_enabled
from gpt2.model.gpt import IGNORE_INDEX

logger = logging.getLogger(__name__)

# What an autocast argument may be: nothing, a dtype (bf16/fp16 autocast on the model's device),
# or a zero-argument callable returning a fresh context manager (e.g. a precision policy's).
AutocastArg = Union[None, torch.dtype, Callable[[], ContextManager[Any]]]


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


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
    # This process's rank and the world size under distributed=True in a process group.
    rank, world_size = 0, 1
    if distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    share = _share(data, rank, world_size)
    if device is not None:
        device = torch.device(device)
    else:
        device = _model_device(model)
    loader = _eval_loader(model, data, batch_size, seq_len, split)
    batches = one_pass(loader, max_batches)
    if progress_enabled(progress):
        batches = _progress_bar(batches, loader, max_batches)
    total, n_tokens, seen = _summed_loss(model, batches, device, autocast, share=share, world_size=world_size)
    if n_tokens == 0:
        raise InvalidValueError("no token was scored: the data is shorter than one batch (or every target is ignored)")
    if warn_short and max_batches is not None and seen < max_batches and rank == 0:
        logger.warning(
            f"the evaluation data holds only {seen} batch(es) of {batch_size} x {seq_len} tokens; scored them once "
            f"instead of max_batches={max_batches} (no batch is read twice)"
        )
    mean = total / n_tokens
    if not math.isfinite(mean):
        raise NonFiniteLossError(
            f"the validation loss of {source} is {mean} over {n_tokens:,} tokens: its weights or activations "
            "overflow (a diverged run or a damaged file?); evaluate an earlier checkpoint, or try fp32",
            mean,
        )
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": n_tokens}


def _share(data: Any, rank: int, world_size: int) -> tuple[int, int]:
    """``(rank, world_size)`` of the batches this rank scores: ``(0, 1)``, all of them, when ``data`` is a loader
    built for this rank and world size (this rank's share already); under ``distributed=True`` any other loader
    must be a one-process one.
    """
    data_world_size = getattr(data, "world_size", 1)
    if world_size > 1 and data_world_size not in (1, world_size):
        raise InvalidValueError(
            "distributed=True splits one sequence of batches across the ranks: pass the tokens, a "
            "token file, a one-process TokenLoader (world_size=1) or one built for this rank and world size"
        )
    if world_size > 1 and data_world_size == world_size:
        return 0, 1
    return rank, world_size


def _eval_loader(model: nn.Module, data: Any, batch_size: int, seq_len: int, split: str | None) -> Any:
    """``data`` itself if it is a loader (of ``batch_size`` x ``seq_len`` batches), else a
    :class:`TokenLoader` of it.
    """
    sizes = (getattr(data, "batch_size", batch_size), getattr(data, "seq_len", seq_len))
    if sizes != (batch_size, seq_len):
        raise InvalidValueError(
            f"the loader reads batches of {sizes[0]} x {sizes[1]}, not {batch_size} x {seq_len}: build it so"
        )
    if hasattr(data, "next_batch"):
        # one pass from the start, then put back where it was (gpt2.data.loader.one_pass)
        missing = [name for name in ("reset", "state_dict", "load_state_dict") if not hasattr(data, name)]
        if missing:
            raise TypeError(
                f"a loader to evaluate needs reset(), state_dict() and load_state_dict() to read one pass from its "
                f"start and put it back; {type(data).__name__} has no {', '.join(missing)}"
            )
        return data
    # Ids are checked against the vocabulary on the CPU (the forward never syncs to).
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return TokenLoader(data, batch_size, seq_len, split=split, vocab_size=vocab_size)


def _progress_bar(batches: Iterator[Any], loader: Any, max_batches: int | None) -> Iterator[Any]:
    """``batches`` through an "eval" bar. Its total: the fewer of max_batches and the loader's batches in one pass,
    where known; data that ends sooner sets it to the batches read, as the short-data warning says.
    """
    known = [n for n in (max_batches, getattr(loader, "batches_per_pass", None)) if n]
    with tqdm(total=min(known, default=None), desc="eval", unit="batch", dynamic_ncols=True, leave=False) as bar:
        for batch in batches:
            yield batch
            bar.update(1)
        bar.total = bar.n
        bar.refresh()


def _summed_loss(
    model: nn.Module,
    batches: Iterable[Any],
    device: torch.device,
    autocast: AutocastArg,
    *,
    share: tuple[int, int],
    world_size: int,
) -> tuple[float, int, int]:
    """``(summed loss, scored tokens, batches seen)`` over all ranks, the model in eval mode meanwhile.
    ``share``: ``(r, n)``, this rank scores batches ``r, r + n, ...`` (:func:`_share`).
    """
    # [summed loss, scored tokens]: float64 so a long pass loses no precision, one tensor so the
    # ranks combine both in one all-reduce.
    sums = torch.zeros(2, dtype=torch.float64, device=device)

    def score(batch: tuple[torch.Tensor, torch.Tensor], counted: bool) -> None:
        x, y = batch[0].to(device), batch[1].to(device)
        with _autocast_context(autocast, device):
            # GPT's forward returns (logits, loss)
            logits = model(x)[0].float()
        if counted:
            # Loss in fp32 whatever the autocast dtype; summed so batches weigh by their tokens.
            # Targets equal to IGNORE_INDEX (prompt and padding of instruction data) are not
            # scored and not counted, so the mean is over the scored tokens only.
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
            sums[0] += loss.double()
            sums[1] += (y != IGNORE_INDEX).sum()

    seen = lockstep.score_share(model, batches, *share, score)
    if world_size > 1:
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM)
    return sums[0].item(), int(sums[1]), seen
