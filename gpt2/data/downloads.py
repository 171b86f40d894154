"""Downloading and caching data files: the default cache directory and Tiny Shakespeare."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpt2.data.formats import read_text
from gpt2.errors import MissingFileError
from gpt2.files import default_cache_dir, download

logger = logging.getLogger(__name__)

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# sha256 of the 1,115,394-byte file, so that a truncated download or an HTML error page is never cached as the corpus.
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def tiny_shakespeare_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the Tiny Shakespeare text: ``$GPT2_TINY_SHAKESPEARE``, else ``tinyshakespeare.txt``
    under ``cache_dir`` (default :func:`default_cache_dir`), downloaded and sha256-checked once.
    """
    override = os.environ.get("GPT2_TINY_SHAKESPEARE")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise MissingFileError(
                f"GPT2_TINY_SHAKESPEARE={override!r} is not a file; point it at the Tiny Shakespeare text (e.g. "
                "../shared/data/tinyshakespeare.txt) or unset it to download and cache the file"
            )
        return path
    if cache_dir is None:
        cache_dir = default_cache_dir()
    path = Path(cache_dir).expanduser() / "tinyshakespeare.txt"
    if path.is_file():
        return path
    download(
        TINY_SHAKESPEARE_URL,
        path,
        sha256=TINY_SHAKESPEARE_SHA256,
        what="Tiny Shakespeare",
        offline_hint="set GPT2_TINY_SHAKESPEARE=/path/to/tinyshakespeare.txt, pass the "
        "file's path (load_tiny_shakespeare(path=...), tokenize_file(path, ...)), or copy it to",
    )
    return path


def load_tiny_shakespeare(path: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None) -> str:
    """The Tiny Shakespeare text: from ``path`` if given, else :func:`tiny_shakespeare_path`."""
    if path is None:
        path = tiny_shakespeare_path(cache_dir)
    return read_text(path)
