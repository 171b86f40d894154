"""What ``--data`` means: ``shakespeare``, a text file, a token file or a shard directory, turned
into the ``(train, val)`` sources a :class:`~gpt2.data.TokenLoader` reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpt2.data.downloads import tiny_shakespeare_path
from gpt2.data.formats import TOKEN_SUFFIXES, load_tokens, read_text, token_files
from gpt2.data.prepare import _encode_text
from gpt2.errors import InvalidValueError, MissingFileError
from gpt2.model.tokenizer import get_tokenizer


def shakespeare_or_path(data: str) -> Path:
    """``shakespeare`` -> the Tiny Shakespeare text (downloaded once, or $GPT2_TINY_SHAKESPEARE);
    anything else must be an existing path.
    """
    if data == "shakespeare":
        return tiny_shakespeare_path()
    path = Path(data).expanduser()
    if not path.exists():
        raise MissingFileError(
            f"data {data!r} does not exist; give a text file, a token file (.npy/.bin), a directory "
            f"of token shards (gpt2 prepare writes them) or 'shakespeare'"
        )
    return path


def text_tokens(path: str | os.PathLike[str], tokenizer: Any = None) -> np.ndarray:
    """A UTF-8 text file as one document: ``<|endoftext|>`` then its GPT-2 tokens, ``uint16``
    (the layout :func:`gpt2.data.tokenize_file` writes to disk, kept in memory).
    """
    if tokenizer is None:
        tokenizer = get_tokenizer()
    # read_text names the file and byte offset of non-UTF-8 text; ids past uint16 are refused.
    return _encode_text(read_text(path), tokenizer, str(path), progress=False)


def load_token_source(data: str) -> Any:
    """``data`` as something :class:`gpt2.data.TokenLoader` reads: a shard directory or token
    file as is, a text file (or ``shakespeare``) tokenised into an array.
    """
    path = shakespeare_or_path(data)
    if path.is_dir():
        return path
    if path.suffix.lower() in TOKEN_SUFFIXES:
        return np.asarray(load_tokens(path))
    return text_tokens(path)


# A file's validation tokens come from up to this many passages spread through it: the end of the text
# alone would be other plays (other names, other words) than the ones the model read most recently, so
# its loss would rise and fall with where in the text training is, not with how well the model learns.
VAL_PASSAGES = 100
# ... each at least this many tokens (a small file gets fewer, longer passages).
MIN_PASSAGE_TOKENS = 32
# Validation lists its passages in the order of (index x golden ratio) mod 1: any first part of them, such
# as the --eval-steps batches a run scores while it trains, is spread evenly over the text too.
_GOLDEN = (5**0.5 - 1) / 2


def split_tokens(tokens: np.ndarray, val_fraction: float, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(train, val)``: the tokens cut into up to :data:`VAL_PASSAGES` equal parts, the last
    ``val_fraction`` of each held out for validation, the rest (in order) for training. No token is in
    both, and validation (and any first part of it) samples the whole text. Both are copies in
    memory; data larger than memory belongs in shards (``gpt2 prepare``).
    """
    if not 0 <= val_fraction < 1:
        raise InvalidValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0:
        return tokens, None
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 2 or n_val >= len(tokens) - 1:
        raise InvalidValueError(f"{what} has {len(tokens)} tokens, too few to split with --val-fraction {val_fraction}")
    passages = max(1, min(VAL_PASSAGES, n_val // MIN_PASSAGE_TOKENS))
    # Part i is tokens[edges[i]:edges[i + 1]]; from val_starts[i] on it is held out.
    edges = np.linspace(0, len(tokens), passages + 1).round().astype(np.int64)
    val_starts = edges[1:] - np.diff(np.linspace(0, n_val, passages + 1).round().astype(np.int64))
    train = np.concatenate([tokens[start:end] for start, end in zip(edges[:-1], val_starts)])
    order = np.argsort((np.arange(passages) * _GOLDEN) % 1, kind="stable")
    val = np.concatenate([tokens[val_starts[i] : edges[i + 1]] for i in order])
    return train, val


def training_data(data: str, val_data: str | None, val_fraction: float) -> tuple[Any, Any]:
    """``(train, val)`` sources for the Trainer from ``--data`` / ``--val-data``: a shard directory
    gives its ``val`` shards (if any) for validation, a file is split by ``val_fraction``.
    """
    source = load_token_source(data)
    if val_data is not None:
        return source, load_token_source(val_data)
    if not isinstance(source, Path):
        return split_tokens(source, val_fraction, data)
    # A directory of shards: its val shards validate, when it has any.
    if token_files(source, "val"):
        return source, source
    return source, None
