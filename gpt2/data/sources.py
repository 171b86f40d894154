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
from gpt2.data.prepare import encode_document, split_tokens
from gpt2.errors import MissingFileError
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


def text_tokens(path: str | os.PathLike[str]) -> np.ndarray:
    """A UTF-8 text file as one document: ``<|endoftext|>`` then its GPT-2 tokens, ``uint16``
    (the layout :func:`gpt2.data.tokenize_file` writes to disk, kept in memory).
    """
    # read_text names the file and byte offset of non-UTF-8 text; ids past uint16 are refused.
    return encode_document(read_text(path), get_tokenizer())


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
