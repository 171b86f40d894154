"""The staging folder of ``prepare``, which is also its lock: one ``prepare`` at a time writes a prefix
into a folder.

A prepare of ``prefix`` into ``out_dir`` writes its data set into ``out_dir/.prepare-{prefix}.staging``
first (see :mod:`gpt2.data.prepare`). Holding that folder's lock file ``.lock`` makes it the only prepare
of that prefix there; a second one is refused with who holds it. The lock is an ``fcntl.flock``, which the
kernel releases when its process ends, however it ends; where there is no flock (Windows, some network
filesystems) whoever creates ``.lock`` owns it, and one whose process is gone (on this host) is taken
over. The file records pid, host and start time. A prepare killed with ``kill -9`` leaves the folder
behind; the next prepare of that prefix takes it over and empties it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpt2.errors import Gpt2Error
from gpt2.files import pid_alive

try:
    import fcntl
except ImportError:  # Windows: the lock file, created exclusively, is the lock
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# What flock fails with on a filesystem that does not support it.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# How often acquire tries again when the lock file is removed or replaced under it by its owner.
_TRIES = 20
# Earlier versions staged in .prepare-<pid>-<host>-<random>; one whose process is gone (on this
# host) is the leftover of a killed prepare.
_OLD_STAGE = re.compile(r"\.prepare-(\d+)-(.+)-\w+")


class PrepareLockedError(Gpt2Error, FileExistsError):
    """Another prepare is writing the same prefix into the same folder."""


class StagingFolder:
    """``out_dir/.prepare-{prefix}.staging`` and its lock: :meth:`acquire` it (the folder is made,
    locked and emptied), write the data set into :attr:`path`, and :meth:`release` it (the folder goes).
    """

    def __init__(self, out_dir: Path, prefix: str) -> None:
        self.out_dir, self.prefix = out_dir, prefix
        self.path = out_dir / f".prepare-{prefix}.staging"
        self.lock_file = self.path / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Lock the folder (made if need be) and empty it; :class:`PrepareLockedError` while another
        prepare holds it.
        """
        fd = self._lock()
        try:
            self._judge_left_behind(_read_record(fd))
            _write_record(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._remove_contents()

    def release(self) -> None:
        """Remove the folder (whatever is still staged in it) and unlock; a no-op when not held."""
        if self._fd is None:
            return
        self._remove_contents()
        # Unlinked while still locked, so that nobody locks the old file.
        with contextlib.suppress(OSError):
            self.lock_file.unlink()
        os.close(self._fd)
        self._fd = None
        if fcntl is None:
            # Windows removes no file that is open: now that it is closed, it can.
            with contextlib.suppress(OSError):
                self.lock_file.unlink()
        # Fails when the next prepare has already made its own lock file in the folder: it is theirs now.
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def _lock(self) -> int:
        """A descriptor of the lock file that this process holds."""
        for _ in range(_TRIES):
            self.path.mkdir(exist_ok=True)
            fd = self._open_locked()
            if fd is not None:
                return fd
        raise PrepareLockedError(
            f"could not lock {str(self.lock_file)!r}: it keeps changing; is another prepare of prefix "
            f"{self.prefix!r} starting in {str(self.out_dir)!r}?"
        )

    def _open_locked(self) -> int | None:
        """The lock file, opened and held; None when it changed under us (try again)."""
        created, fd = self._open_or_create()
        if fd is None:
            return None
        if _flock(fd, self._busy):
            if _same_file(fd, self.lock_file):
                return fd
            # Its owner removed it while we waited for it: lock the file now at the path instead.
            os.close(fd)
            return None
        if created:
            # Without flock, whoever created the file owns the lock.
            return fd
        record = _read_record(fd)
        os.close(fd)
        if _left_by_a_gone_process(record):
            logger.warning("taking over %s: pid %s that held it is no longer running", self.path, record.get("pid"))
            self.lock_file.unlink(missing_ok=True)
            return None
        raise PrepareLockedError(self._busy(record) + f"; if it is gone, delete {str(self.path)!r}")

    def _open_or_create(self) -> tuple[bool, int | None]:
        """``(created, fd)`` of the lock file; ``fd`` None when the folder or file changed meanwhile."""
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        with contextlib.suppress(FileNotFoundError):
            return False, os.open(self.lock_file, flags)
        try:
            return True, os.open(self.lock_file, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except (FileExistsError, FileNotFoundError):
            return False, None

    def _judge_left_behind(self, record: dict[str, Any]) -> None:
        """We hold the lock, but a previous owner's record is still there: it was killed."""
        if not record:
            return
        if record.get("host") not in (None, socket.gethostname()):
            # flock may not reach across machines (network filesystems): that prepare may be running.
            raise PrepareLockedError(
                f"{str(self.path)!r} was left by a prepare ({_holder(record)}) that cannot be checked from "
                f"here; if it is gone, delete {str(self.path)!r} and prepare again, or choose another directory"
            )
        logger.warning("taking over %s, left by a prepare (%s) that was killed", self.path, _holder(record))

    def _remove_contents(self) -> None:
        for child in self.path.iterdir():
            if child.name == LOCK_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)

    def _busy(self, record: dict[str, Any]) -> str:
        return (
            f"another prepare ({_holder(record)}) is writing prefix {self.prefix!r} into {str(self.out_dir)!r}; "
            "wait for it to finish, or choose another directory or prefix"
        )


def remove_old_stages(out_dir: Path) -> None:
    """Remove what a killed prepare of an earlier version left in ``out_dir`` (a live pid's, or another
    host's, is kept).
    """
    for path in out_dir.glob(".prepare-*"):
        match = _OLD_STAGE.fullmatch(path.name)
        if match and match[2] == socket.gethostname() and not pid_alive(int(match[1])):
            logger.warning("removing %s, left by a prepare that was killed", path)
            shutil.rmtree(path, ignore_errors=True)


def _flock(fd: int, busy: Callable[[dict[str, Any]], str]) -> bool:
    """Lock ``fd`` with flock: True once held, False where there is no flock; raises
    :class:`PrepareLockedError` (``busy(record)``) while another process holds it.
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record = _read_record(fd)
        os.close(fd)
        raise PrepareLockedError(busy(record)) from None
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return False
        os.close(fd)
        raise
    return True


def _left_by_a_gone_process(record: dict[str, Any]) -> bool:
    """Whether the record names a process of this host that no longer runs."""
    pid = record.get("pid")
    return record.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(record: dict[str, Any]) -> str:
    if record.get("pid") is None:
        return "a process that has not said who it is yet"
    return f"pid {record['pid']} on host {record.get('host', '?')}, started {record.get('started', '?')}"


def _read_record(fd: int) -> dict[str, Any]:
    """The lock file's record; empty when there is none (or it cannot be read)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if isinstance(record, dict):
        return record
    return {}


def _write_record(fd: int) -> None:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(record).encode("utf-8"))
