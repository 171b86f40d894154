"""Downloading and caching data files: the default cache directory and Tiny Shakespeare."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from gpt2.data._util import replace_atomically
from gpt2.data.formats import read_text

logger = logging.getLogger(__name__)

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# sha256 of the 1,115,394-byte file, so that a truncated download or an HTML error page is
# never cached as the corpus.
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
_DOWNLOAD_TIMEOUT_S = 60
_CHUNK_BYTES = 1 << 16
# The progress bar appears only when a download takes longer than this (seconds), so a small
# or cached file prints nothing.
_BAR_DELAY_S = 0.5


class DownloadError(ConnectionError):
    """A data file could not be downloaded (no network, bad response, checksum mismatch)."""


def default_cache_dir() -> Path:
    """``$GPT2_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpt2``, else ``~/.cache/gpt2``."""
    if os.environ.get("GPT2_CACHE_DIR"):
        return Path(os.environ["GPT2_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gpt2"


def tiny_shakespeare_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the Tiny Shakespeare text (1.1 MB), downloading and caching it on first use.

    In order: the file named by ``$GPT2_TINY_SHAKESPEARE``; a cached copy
    ``tinyshakespeare.txt`` under ``cache_dir`` (default :func:`default_cache_dir`); else a
    download from :data:`TINY_SHAKESPEARE_URL`, checked against its sha256 and written
    atomically, so an interrupted download never leaves a partial file in the cache.
    """
    override = os.environ.get("GPT2_TINY_SHAKESPEARE")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"GPT2_TINY_SHAKESPEARE={override!r} is not a file; point it at the Tiny "
                "Shakespeare text (e.g. ../shared/data/tinyshakespeare.txt) or unset it to "
                "download and cache the file"
            )
        return path
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cache / "tinyshakespeare.txt"
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
    path = Path(path) if path is not None else tiny_shakespeare_path(cache_dir)
    return read_text(path)


def download(
    url: str,
    dest: Path,
    *,
    what: str,
    offline_hint: str,
    sha256: str | None = None,
    validate: Callable[[bytes], None] | None = None,
    progress: bool = True,
) -> None:
    """Fetch ``url`` into ``dest`` atomically, or raise :class:`DownloadError` saying how to
    work offline (``offline_hint`` is followed by ``dest``). The bytes are checked against
    ``sha256`` and/or by ``validate`` (which raises ``ValueError``) before anything is cached,
    so a truncated download or an HTML error page never lands in the cache.

    With ``progress`` a byte counter (a bar when the server sends the size) shows on stderr
    once the download has taken more than half a second.
    """

    def fail(reason: str) -> DownloadError:
        return DownloadError(
            f"could not download {what} from {url}: {reason}. To work offline, {offline_hint} {str(dest)!r}."
        )

    logger.info("downloading %s from %s to %s", what, url, dest)
    buffer = io.BytesIO()
    try:
        with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
            # The bar starts once the server has answered: never an empty bar before that.
            headers = getattr(response, "headers", None)
            length = headers.get("Content-Length") if headers is not None else None
            total = int(length) if length and length.isdigit() else None
            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=what,
                delay=_BAR_DELAY_S,
                disable=not progress,
            ) as bar:
                while True:
                    chunk = response.read(_CHUNK_BYTES)
                    if not chunk:
                        break
                    buffer.write(chunk)
                    bar.update(len(chunk))
    # URLError, HTTPError and timeouts are OSErrors; ValueError covers a malformed URL.
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise fail(f"{type(e).__name__}: {e}") from e
    data = buffer.getvalue()
    if total is not None and len(data) != total:
        raise fail(f"the connection closed after {len(data)} of {total} bytes")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise fail(f"the {len(data)} bytes received do not have the expected sha256 {sha256}")
    if validate is not None:
        try:
            validate(data)
        except ValueError as e:
            raise fail(f"the response is not {what} ({e})") from e
    dest.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(dest, lambda f: f.write(data))
