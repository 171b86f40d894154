"""Filesystem rules every layer shares: the cache folder, checksummed downloads, atomic writes,
whether a pid is alive, and stop signals held off at a safe point.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gpt2.errors import Gpt2Error

logger = logging.getLogger(__name__)

_DOWNLOAD_TIMEOUT_S = 60
_CHUNK_BYTES = 1 << 16
# The progress bar appears only when a download takes longer than this (seconds), so a small
# or cached file prints nothing.
_BAR_DELAY_S = 0.5


class DownloadError(Gpt2Error, ConnectionError):
    """A file could not be downloaded (no network, bad response, checksum mismatch)."""


def default_cache_dir() -> Path:
    """``$GPT2_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpt2``, else ``~/.cache/gpt2``."""
    if os.environ.get("GPT2_CACHE_DIR"):
        return Path(os.environ["GPT2_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gpt2"


def replace_atomically(dest: str | os.PathLike, write: Callable[[Any], object], *, to_path: bool = False) -> None:
    """``write(f)`` into a temporary file beside ``dest``, fsync it, then rename it over ``dest``:
    readers and a crash (a power loss too, thanks to the fsync) see the old file or the whole new
    one. ``open`` gives the file the user's umask (``mkstemp`` would make it 0600). ``to_path=True``:
    ``write(tmp_path)``, for writers that open the file themselves (gguf's).
    """
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        if to_path:
            write(tmp)
            with open(tmp, "r+b") as f:
                os.fsync(f.fileno())
        else:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        # It exists, but belongs to someone else.
        return True
    except (OSError, OverflowError):
        return False
    return True


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
    """Fetch ``url`` into ``dest`` atomically, or raise :class:`DownloadError` saying how to work
    offline (``offline_hint`` then ``dest``). The bytes are checked against ``sha256`` and/or by
    ``validate`` (raising ``ValueError``) first, so a truncated download or an HTML error page is
    never cached. ``progress``: a byte counter on stderr for downloads slower than half a second.
    """

    def fail(reason: str) -> DownloadError:
        return DownloadError(
            f"could not download {what} from {url}: {reason}. To work offline, {offline_hint} {str(dest)!r}."
        )

    logger.info("downloading %s from %s to %s", what, url, dest)
    try:
        data, total = _fetch(url, what, progress)
    # URLError, HTTPError and timeouts are OSErrors; ValueError covers a malformed URL.
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise fail(f"{type(e).__name__}: {e}") from e
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


def _fetch(url: str, what: str, progress: bool) -> tuple[bytes, int | None]:
    """``(the bytes received, the length the server announced or None)``, with a progress bar."""
    buffer = io.BytesIO()
    with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
        # The bar starts once the server has answered: never an empty bar before that.
        total = _content_length(response)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=what,
            delay=_BAR_DELAY_S,
            disable=not progress,
        ) as bar:
            for chunk in iter(lambda: response.read(_CHUNK_BYTES), b""):
                buffer.write(chunk)
                bar.update(len(chunk))
    return buffer.getvalue(), total


def _content_length(response: Any) -> int | None:
    """The ``Content-Length`` a response announces, or None (no headers, no or no numeric length)."""
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    length = headers.get("Content-Length")
    if not (length and length.isdigit()):
        return None
    return int(length)


# Ctrl-C; what SLURM and Kubernetes send before they kill a job; a closed terminal or SSH session.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class StopSignals:
    """While installed (main thread only: Python runs handlers there), a stop signal sets
    ``received`` instead of raising. The ``force_after``-th one stops at once (KeyboardInterrupt):
    under ``torchrun`` each worker gets two for one Ctrl-C (the terminal's and the agent's).

    A signal that is ignored when it is installed stays ignored, as Unix users expect:
    ``nohup gpt2 train ... &`` keeps training when the terminal closes (nohup ignores SIGHUP), and
    so does a process started under ``trap '' HUP``, or a shell script's background job (SIGINT).
    """

    def __init__(self, force_after: float = 3) -> None:
        self.force_after = force_after
        self.received = 0
        self._count = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        # A new fit() after an interruption starts afresh.
        self.received, self._count = 0, 0
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) == signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        self._count += 1
        if self._count >= self.force_after:
            self.restore()
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            # None: the handler was not installed from Python; the default one is the closest.
            if previous is None:
                previous = signal.SIG_DFL
            signal.signal(sig, previous)
        self._previous.clear()
