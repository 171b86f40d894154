"""The batch loader: ``(x, y)`` batches from token arrays, files or shard directories, read the
way build-nanogpt's ``DataLoaderLite`` does, with a position that can be saved and restored.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.data.formats import check_token_ids, load_tokens, manifest_mismatch, recorded_shards, token_files
from gpt2.errors import InvalidValueError, MissingFileError
from gpt2.files import sha256_file
from gpt2.model.config import POSITIVE_INT, Range, check_value

logger = logging.getLogger(__name__)
# Any integer: the bounds are checked where the message can say more (rank, state).
_INT = Range(integer=True)
_VOCAB_SIZE = Range(low=1, integer=True, optional=True)


def _as_token_array(source: torch.Tensor | np.ndarray) -> np.ndarray:
    """A 1-D integer numpy view of an in-memory token sequence (no copy for CPU tensors)."""
    array = source.detach().cpu().numpy() if isinstance(source, torch.Tensor) else np.asarray(source)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token array has dtype {array.dtype}; expected integer token ids (e.g. uint16 or torch.long)")
    if array.ndim != 1:
        raise InvalidValueError(
            f"token array has shape {tuple(array.shape)}; expected a 1-D sequence of token ids "
            "(flatten it first, e.g. tokens.reshape(-1))"
        )
    if array.size and np.issubdtype(array.dtype, np.signedinteger) and int(array.min()) < 0:
        raise InvalidValueError(f"token array holds a negative id ({int(array.min())}); ids must be >= 0")
    return array


@functools.cache
def _warn_unverified(directory: str) -> None:
    logger.warning(
        "%s has no record of its shards (written by another tool or an older version): nothing verifies "
        "that they are complete and unchanged",
        directory,
    )


class _Shard:
    """One token sequence: an in-memory array, or a file opened lazily (memory-mapped), checked
    against its folder's record of it when there is one.
    """

    __slots__ = ("name", "path", "array", "length", "checked_vocab", "sha256")

    def __init__(self, name: str, *, path: Path | None = None, array: np.ndarray | None = None, sha256=None):
        self.name, self.path, self.array = name, path, array
        if array is not None:
            self.length = len(array)
        else:
            # Opening an .npy memory map only reads its header, so measuring every shard up front is
            # cheap and lets the constructor reject a too-short shard before training starts.
            self.length = len(load_tokens(path))
        # The vocab_size its ids were last checked against.
        self.checked_vocab: int | None = None
        # The digest still to verify; None: nothing (more) to verify.
        self.sha256: str | None = sha256

    def open(self, vocab_size: int | None) -> np.ndarray:
        # The digest reads the whole shard, so it is checked once, when the shard is first opened
        # (as the ids are), not for every shard when the loader is built.
        if self.sha256 is not None and sha256_file(self.path) != self.sha256:
            raise manifest_mismatch(self.path.parent, f"{self.path.name} has changed (its sha256 differs)")
        self.sha256 = None
        tokens = self.array
        if tokens is None:
            tokens = load_tokens(self.path)
        # One pass over the shard (numpy on the memory map, no GPU involved), only the first
        # time it is opened for a given vocabulary.
        if vocab_size is not None and self.checked_vocab != vocab_size:
            check_token_ids(tokens, vocab_size, self.name)
            self.checked_vocab = vocab_size
        return tokens


def _directory_shards(path: Path, split: str | None) -> list[_Shard]:
    """The shards of a directory (of ``split``), each checked against the folder's record if it has one."""
    digests = recorded_shards(path)
    if digests is None:
        _warn_unverified(str(path))
        digests = {}
    files = token_files(path, split)
    if not files:
        what = "token files (.npy/.bin)" if split is None else f"{split!r} token files (x_{split}_000000.npy)"
        raise MissingFileError(
            f"no {what} in directory {str(path)!r}; write shards with "
            "gpt2.data.write_shards or tokenize_file, or check the path and split"
        )
    return [_Shard(f"shard {str(p)!r}", path=p, sha256=digests.get(p.name)) for p in files]


class TokenLoader:
    """Batches ``(x, y)`` of shape ``(B, T)`` from a token stream, split across DDP ranks.

    ``source``: a 1-D tensor or array of token ids, a token file (``.npy``/``.bin``), or a
    directory of shards (those whose names contain ``split`` when given, sorted by name).

    One step of all ranks reads the ``B*T*world_size + 1`` tokens from ``position`` of the current shard, rank ``r`` the
    ``B*T + 1`` from ``position + r*B*T``; when the next step would run past the shard's end the loader moves to the
    next shard (wrapping around) at position 0. So one rank with batch ``2B`` reads the rows two ranks with batch ``B``
    read, and :meth:`state_dict` is rank-independent. With ``vocab_size`` each shard's ids are checked on the CPU when
    it is opened, so a bad id is named with its file before it reaches the GPU.
    """

    def __init__(
        self,
        source: torch.Tensor | np.ndarray | str | os.PathLike,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        split: str | None = None,
        vocab_size: int | None = None,
    ):
        self.batch_size = check_value("TokenLoader", "batch_size", batch_size, POSITIVE_INT)
        self.seq_len = check_value("TokenLoader", "seq_len", seq_len, POSITIVE_INT)
        self.world_size = check_value("TokenLoader", "world_size", world_size, POSITIVE_INT)
        self.rank = check_value("TokenLoader", "rank", rank, _INT)
        if not 0 <= self.rank < self.world_size:
            raise InvalidValueError(
                f"rank={self.rank} is outside [0, world_size={self.world_size}); pass the "
                "process's rank from torch.distributed (or the RANK environment variable)"
            )
        if split is not None and (not isinstance(split, str) or not split):
            raise InvalidValueError(f"split must be a non-empty string such as 'train' or 'val', got {split!r}")
        self._source_desc, self._shards = self._resolve(source, split)

        needed = self.tokens_per_step + 1
        for shard in self._shards:
            if shard.length < needed:
                raise InvalidValueError(
                    f"{shard.name} has {shard.length} tokens, but one step needs {needed} (batch_size "
                    f"{self.batch_size} x seq_len {self.seq_len} x world_size {self.world_size} + 1 for the shifted "
                    "targets); use a smaller --micro-batch-size or --seq-len, or more data (the validation part of a "
                    "file is its --val-fraction; short shards can be merged)"
                )
        # The shard the next batch is read from (shard), and the offset in it of the next step's first token
        # (position, the same on every rank): the first shard's start.
        self.reset()
        # Ids must be below this (the model's vocabulary); None: not checked. Each shard's ids are checked
        # once per vocabulary, when the shard is first opened.
        self.vocab_size = check_value("TokenLoader", "vocab_size", vocab_size, _VOCAB_SIZE)
        # ((index, vocab_size), tokens) of the shard last opened: the current one opens on its first read.
        self._opened: tuple[tuple[int, int | None], np.ndarray] | None = None
        if vocab_size is not None:
            # The first shard's ids are checked now.
            self._current()

    @staticmethod
    def _resolve(source: Any, split: str | None) -> tuple[str, list[_Shard]]:
        if isinstance(source, (torch.Tensor, np.ndarray)):
            if split is not None:
                raise InvalidValueError(
                    f"split={split!r} only selects files from a directory of shards; an in-memory "
                    "token array has no splits, so pass split=None (or the split's own array)"
                )
            array = _as_token_array(source)
            return f"<array of {len(array)} tokens>", [_Shard("the token array", array=array)]
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(
                "source must be a 1-D tensor/array of token ids, a token file (.npy/.bin) or a "
                f"directory of shards; got {type(source).__name__}"
            )
        path = Path(source)
        if path.is_dir():
            return str(path), _directory_shards(path, split)
        if path.is_file():
            if split is not None and split not in path.name:
                raise InvalidValueError(
                    f"split={split!r} does not match token file {str(path)!r} (its name does not contain {split!r}); "
                    "pass the directory of shards, the right file, or split=None"
                )
            return str(path), [_Shard(f"token file {str(path)!r}", path=path)]
        raise MissingFileError(f"token source {str(path)!r} does not exist")

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step of all ranks consumes: ``batch_size * seq_len * world_size``."""
        return self.batch_size * self.seq_len * self.world_size

    @property
    def num_tokens(self) -> int:
        """Total tokens in the source, over all shards."""
        return sum(shard.length for shard in self._shards)

    @property
    def batches_per_pass(self) -> int:
        """Steps in one pass over every shard (a shard's tail shorter than a step is skipped)."""
        return sum(max(1, (shard.length - 1) // self.tokens_per_step) for shard in self._shards)

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def _current(self) -> np.ndarray:
        key = (self.shard, self.vocab_size)
        if self._opened is None or self._opened[0] != key:
            self._opened = (key, self._shards[self.shard].open(self.vocab_size))
        return self._opened[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``: int64 CPU tensors of shape (B, T); ``y`` is ``x`` shifted by one."""
        B, T = self.batch_size, self.seq_len
        start = self.position + self.rank * B * T
        # Only this slice is copied out of the memory map and widened to int64.
        buf = torch.from_numpy(np.array(self._current()[start : start + B * T + 1], dtype=np.int64))
        x = buf[:-1].view(B, T)  # (B, T)
        # y gets its own storage so that editing x in place (e.g. masking) never changes y.
        y = buf[1:].clone().view(B, T)  # (B, T)

        self.position += self.tokens_per_step
        if self.position + self.tokens_per_step + 1 > self._shards[self.shard].length:
            self.shard = (self.shard + 1) % len(self._shards)
            self.position = 0
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches forever (the stream wraps around); stop with ``itertools.islice`` or a break."""
        while True:
            yield self.next_batch()

    def reset(self) -> None:
        """Back to the first shard, position 0."""
        self.shard, self.position = 0, 0

    def state_dict(self) -> dict[str, Any]:
        """The position as JSON-serialisable ints: ``{"shard", "position", "num_shards"}``."""
        return {"shard": self.shard, "position": self.position, "num_shards": len(self._shards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where :meth:`state_dict` was taken (``num_shards`` optional)."""
        if not isinstance(state, dict) or "shard" not in state or "position" not in state:
            raise InvalidValueError(
                f"loader state must be a dict with 'shard' and 'position' (from state_dict()), got {state!r}"
            )
        shard = check_value("loader state", "shard", state["shard"], _INT)
        position = check_value("loader state", "position", state["position"], _INT)
        saved_over = state.get("num_shards", len(self._shards))
        if saved_over != len(self._shards) or not 0 <= shard < len(self._shards):
            raise InvalidValueError(
                f"loader state shard={shard}, saved over {saved_over} shard(s), does not fit the source "
                f"{self._source_desc}: it has {len(self._shards)} shard(s) (valid: 0..{len(self._shards) - 1}); "
                "resume with the same data (and split)"
            )
        length = self._shards[shard].length
        if position < 0 or position >= length:
            raise InvalidValueError(
                f"loader state position={position} does not fit {self._shards[shard].name}: it has {length} "
                "tokens; was the state saved with other data?"
            )
        # A bigger step than the saved run's no longer fits: move on as next_batch does.
        if position + self.tokens_per_step + 1 > length:
            logger.warning(f"a step of {self.tokens_per_step} tokens no longer fits after {position}: next shard")
            shard, position = (shard + 1) % len(self._shards), 0
        self.shard, self.position = shard, position


def make_loader(
    data: Any,
    split: str,
    batch_size: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    vocab_size: int | None = None,
) -> Any:
    """The loader the Trainer reads ``split`` (``"train"`` / ``"val"``) from: ``data`` as a
    :class:`TokenLoader` (a directory gives its ``split`` shards), or a ready loader, which must
    have been built with this run's ``batch_size``, ``seq_len``, ``rank`` and ``world_size``.
    """
    # A TokenLoader, or a loader with its interface.
    if hasattr(data, "next_batch"):
        expected = {"batch_size": batch_size, "seq_len": seq_len, "rank": rank, "world_size": world_size}
        wrong = [
            f"{name}={getattr(data, name)!r} (this run needs {want!r})"
            for name, want in expected.items()
            if getattr(data, name, want) != want
        ]
        if wrong:
            raise InvalidValueError(
                f"the {split} loader does not fit this run: {', '.join(wrong)}. Build it as "
                f"TokenLoader(source, {batch_size}, {seq_len}, rank={rank}, "
                f"world_size={world_size}), or pass the tokens / path and let the Trainer build it"
            )
        if vocab_size is not None and isinstance(data, TokenLoader) and data.vocab_size is None:
            data.vocab_size = vocab_size
            # The current shard's ids are checked now, before training starts.
            data._current()
        return data
    if isinstance(data, (str, os.PathLike, torch.Tensor, np.ndarray)):
        # Only a directory has splits to choose from.
        if not (isinstance(data, (str, os.PathLike)) and Path(data).is_dir()):
            split = None
        return TokenLoader(
            data, batch_size, seq_len, rank=rank, world_size=world_size, split=split, vocab_size=vocab_size
        )
    raise TypeError(
        f"{split}_data must be a 1-D token tensor/array, a token file or shard directory, or a "
        f"gpt2.data.TokenLoader; got {type(data).__name__}"
    )


def one_pass(loader: Any, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches from the start of ``loader``: at most ``max_batches``, and at most one pass (until its
    ``state_dict()`` comes back: a batch read twice would weigh double). Every rank's loader wraps
    at the same batch, so under DDP all ranks stop together. The loader is put back where it was
    (a training loader scored mid-run would otherwise replay its batches).
    """
    before = loader.state_dict()
    loader.reset()
    start = loader.state_dict()
    n = 0
    try:
        while max_batches is None or n < max_batches:
            yield loader.next_batch()
            n += 1
            if loader.state_dict() == start:
                return
    finally:
        loader.load_state_dict(before)
