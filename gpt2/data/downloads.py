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


def path_from_env(name: str, what: str, *, folder_ok: bool = False) -> Path | None:
    """The file (or, with ``folder_ok``, folder) that the environment variable ``name`` names, None when it is
    unset or empty; anything else there is refused, saying it should be ``what``.
    """
    value = os.environ.get(name)
    if not value:
        return None
    path = Path(value).expanduser()
    if not (path.is_file() or folder_ok and path.is_dir()):
        raise MissingFileError(
            f"${name}={value!r} is not {what}: point it at one, or unset it to download and cache the file"
        )
    return path


def tiny_shakespeare_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the Tiny Shakespeare text: ``$GPT2_TINY_SHAKESPEARE``, else ``tinyshakespeare.txt``
    under ``cache_dir`` (default :func:`default_cache_dir`), downloaded and sha256-checked once.
    """
    override = path_from_env(
        "GPT2_TINY_SHAKESPEARE", "the Tiny Shakespeare text file (e.g. ../shared/data/tinyshakespeare.txt)"
    )
    if override is not None:
        return override
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


def load_tiny_shakespeare(path: str | os.PathLike | None = None) -> str:
    """The Tiny Shakespeare text: from ``path`` if given, else :func:`tiny_shakespeare_path`."""
    return read_text(path or tiny_shakespeare_path())
