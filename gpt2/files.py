"""Filesystem rules every layer shares: the cache folder, checksummed downloads, atomic writes, one
output file the user names, the one lock, what to advise when a write fails, and stop signals.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import io
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gpt2.errors import Gpt2Error

try:
    import fcntl
# Windows: the lock file, created exclusively, is the lock.
except ImportError:
    fcntl = None  # type: ignore[assignment]

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
        else:
            with open(tmp, "wb") as f:
                write(f)
        # fsync flushes the file's data whichever descriptor wrote it: one way for both kinds of writer
        with open(tmp, "r+b") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | os.PathLike, size: int | None = None) -> str:
    """The sha256 of a file, read a MiB at a time; ``size``: of its first ``size`` bytes only (a log that
    gpt2 appends to). An unreadable file raises ``OSError``.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size is None:
            size = os.fstat(f.fileno()).st_size
        # what is left to read
        while size > 0:
            chunk = f.read(min(1 << 20, size))
            if not chunk:
                break
            digest.update(chunk)
            size -= len(chunk)
    return digest.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (0 or below: a group, which counts as running)."""
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
        # The bar starts once the server has answered: never an empty bar before that. Its total is the
        # length the server announces, if any (a stand-in for a response may have no headers at all).
        length = getattr(response, "headers", {}).get("Content-Length") or ""
        total = int(length) if length.isdigit() else None
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


# Ctrl-C; what SLURM and Kubernetes send before they kill a job; a closed terminal or SSH session.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class StopSignals:
    """While installed (main thread only: Python runs handlers there), a stop signal sets
    ``received`` instead of raising. The ``force_after``-th one stops at once (:class:`Stopped`, saying
    ``outcome``): under ``torchrun`` each worker gets two for one Ctrl-C (the terminal's and the agent's).

    A signal that is ignored when it is installed stays ignored, as Unix users expect:
    ``nohup gpt2 train ... &`` keeps training when the terminal closes (nohup ignores SIGHUP), and
    so does a process started under ``trap '' HUP``, or a shell script's background job (SIGINT).
    """

    def __init__(self, force_after: float = 3, outcome: str = "at once, without saving") -> None:
        self.force_after = force_after
        self.outcome = outcome
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
            raise Stopped(signum, self.outcome)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            # None: the handler was not installed from Python; the default one is the closest.
            if previous is None:
                previous = signal.SIG_DFL
            signal.signal(sig, previous)
        self._previous.clear()


class Stopped(KeyboardInterrupt):
    """A stop signal (``signum``) ended a command at once, where it had no step boundary to stop at."""

    def __init__(self, signum: int, outcome: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; {outcome}")
        self.signum = signum


def progress_enabled(requested: bool) -> bool:
    """Whether to show a progress bar that was ``requested``: in a notebook (a widget) or where stderr is a
    terminal. A console bar redirected to a log file leaves carriage returns and escape codes in it; the
    metric lines on stdout report progress there instead.
    """
    if not requested:
        return False
    # the class tqdm.auto chose (already imported, so no second notebook-mode warning)
    from tqdm.autonotebook import tqdm as chosen_tqdm
    from tqdm.std import tqdm as console_tqdm

    if chosen_tqdm is not console_tqdm:
        return True
    return sys.stderr is not None and sys.stderr.isatty()


# What to do about a read or write the system refused, by its errno: the one place gpt2 words it.
_WRITABLE = "choose a folder you can write to (or change its permissions)"
ERROR_ADVICE = {
    errno.ENOSPC: "free some space on that disk, or write to another one",
    errno.EDQUOT: "free some space (the disk quota is used up), or write to another disk",
    errno.EROFS: "choose a folder you can write to (that file system is read-only)",
    errno.EACCES: _WRITABLE,
    errno.EPERM: _WRITABLE,
    errno.ENOENT: "check the path: a folder that does not exist, or a symlink to nothing?",
    errno.ELOOP: "check the path: a symlink that leads back to itself?",
}


def write_advice(e: BaseException) -> str:
    """What to do about a write that failed with ``e``: :data:`ERROR_ADVICE` for its errno (a full disk
    also where torch or safetensors say so in words of their own), else check the disk.
    """
    code = getattr(e, "errno", None)
    if code is None and "No space" in str(e):
        code = errno.ENOSPC
    return ERROR_ADVICE.get(code, "check the disk")


# --- one output file the user names


class OutputExistsError(Gpt2Error, FileExistsError):
    """A file the user named to write already exists (without ``overwrite``), or is not a regular file."""


def check_new_file(path: str | os.PathLike, *, overwrite: bool, flag: str) -> None:
    """Raise :class:`OutputExistsError` (one line naming ``path`` and ``flag``) unless ``path``, one file the
    user named, may be written: it does not exist, or ``overwrite`` and it is a regular file (never a folder, a
    device such as ``/dev/null``, or a link, which would send the bytes elsewhere). The caller then writes that
    file alone, with :func:`replace_atomically`, and nothing beside it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        # a folder, a link or a device
        raise OutputExistsError(f"{path} is not a regular file: gpt2 writes a new file there only; give a file name")
    if not overwrite:
        raise OutputExistsError(f"{path} exists: choose another path, or pass {flag} to replace it")


# --- the lock

# What flock fails with on a filesystem that does not support it.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Lock:
    """An exclusive lock: the file ``path``, holding its owner's pid, host and start time.

    It is an ``fcntl.flock``, which the kernel releases when its process ends, however it ends. Where
    there is no flock (Windows, some network filesystems) whoever creates the file owns it, and one left
    by a process of this host that is gone is taken over. A record of another host is refused (flock may
    not reach across machines). The file is never opened through a symbolic link. ``busy`` words the refusal,
    with ``{who}`` where the holder goes; ``error`` is its class.
    """

    def __init__(self, path: str | os.PathLike, busy: str, error: type[Exception]):
        self.path = Path(path)
        self.busy = busy
        self.error = error
        self.fd: int | None = None

    def acquire(self) -> Lock:
        # The file may be removed or replaced under us by its releasing owner: try again.
        for _ in range(20):
            created, fd = self._open_or_create()
            try:
                if fd is not None and self._may_hold(fd, created):
                    _write_lock_record(fd)
                    self.fd, fd = fd, None
                    return self
            finally:
                if fd is not None:
                    os.close(fd)
        raise self.error(f"could not lock {self.path}: it keeps changing; is another process starting there?")

    def release(self) -> None:
        """Remove the lock file and unlock; a no-op when not held."""
        if self.fd is None:
            return
        # Unlinked while still locked, so that nobody locks the old file.
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None
        if fcntl is None:
            # Windows removes no file that is open: now that it is closed, it can.
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _open_or_create(self) -> tuple[bool, int | None]:
        """``(created, fd)`` of the lock file; ``fd`` None when it changed meanwhile. Knowing who created it
        matters where flock is missing: an empty file of our own is not another process's lock.
        """
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | _NOFOLLOW
        try:
            return False, os.open(self.path, flags)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno == errno.ELOOP or self.path.is_symlink():
                raise self.error(
                    f"{self.path} is a symbolic link: gpt2 never writes through one (it would overwrite the file "
                    "it points to); remove the link and start again"
                ) from None
            raise
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return True, os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        # Made or removed meanwhile (with its folder) by another process: look again.
        except (FileExistsError, FileNotFoundError):
            return False, None

    def _may_hold(self, fd: int, created: bool) -> bool:
        """Whether this process now holds the lock file ``fd`` (False: it changed meanwhile, try again); raises
        while another process may hold it. With flock the kernel says; without it, the creator of the file holds
        it, and a record of a process of this host that is gone is taken over.
        """
        flocked = self._flock(fd)
        if flocked and not _same_file(fd, self.path):
            # Its owner removed it while we waited for it: lock the file now at the path instead.
            return False
        record = _read_lock_record(fd)
        if not record and (flocked or created):
            return True
        pid = record.get("pid")
        if record.get("host") not in (None, socket.gethostname()):
            # flock may not reach across machines (network filesystems): that process may be alive.
            raise self._refused(
                record, f"; that host cannot be checked from here: if it is gone, delete {self.path} and start again"
            )
        if not flocked and not (isinstance(pid, int) and not pid_alive(pid)):
            raise self._refused(record, f"; if it is gone, delete {self.path}")
        if pid != os.getpid():
            logger.warning("taking over %s left by %s, which is no longer running", self.path, _holder(record))
        return True

    def _flock(self, fd: int) -> bool:
        """True once ``fd`` is locked, False where there is no flock; raises while another process holds it."""
        if fcntl is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._refused(_read_lock_record(fd)) from None
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return False
            raise
        return True

    def _refused(self, record: dict[str, Any], more: str = "") -> Exception:
        return self.error(self.busy.replace("{who}", _holder(record)) + more)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(record: dict[str, Any]) -> str:
    if record.get("pid") is None:
        return "a process with no readable record"
    return f"pid {record['pid']} on host {record.get('host', '?')}, started {record.get('started', '?')}"


def _read_lock_record(fd: int) -> dict[str, Any]:
    """The lock file's record; empty when there is none, ``{"unreadable": True}`` when it is not JSON."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 1 << 16)
        if not data.strip():
            return {}
        record = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return {"unreadable": True}
    if isinstance(record, dict):
        return record
    return {"unreadable": True}


def _write_lock_record(fd: int) -> None:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))
    os.fsync(fd)
