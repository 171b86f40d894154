"""Small helpers shared by the data modules: atomic file writes, whether a pid is alive."""

from __future__ import annotations

import os
from pathlib import Path


def replace_atomically(dest: Path, write) -> None:
    """Write ``dest`` through a temporary file in the same directory, then rename it.

    ``os.replace`` is atomic on POSIX and Windows, so readers (and a crash) see either the
    old file or the complete new one, never a partial file. The data are fsynced before the
    rename so that a power loss cannot leave a renamed but empty file either.
    """
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # it exists, but belongs to someone else
        return True
    except (OSError, OverflowError):
        return False
    return True
