"""Freed memory kept in the process while a CPU Trainer is open (Linux with glibc's malloc).

glibc gives a freed block of more than 32 MB, and the free top of its heap past a threshold, back to the operating
system at once, so each training step faults the pages of its tensors in again: 170,000 page faults and 0.3 s of
system time per step at 124M (bf16, B=4, T=256), 12-17% of the step (docs/benchmarks.md). While a CPU Trainer is
open, glibc keeps freed blocks for the next allocation (no mmap, no trimming); the peak memory stays about the same.
When the last one closes (or is garbage-collected), glibc's thresholds come back and the free memory goes back to
the system.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# glibc's thresholds again (its dynamic ones cannot come back): blocks over 32 MB mmapped, as its dynamic threshold
# ends in a process that frees large tensors, up to 65,536 of them; the heap trimmed past 128 KiB, its default. A
# transformers 124M step in benchmarks/step_vs_peers.py faults 348k pages a step so, 422k in a process of its own.
RESTORED = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 128 * 2**10, M_MMAP_MAX: 65536}
# Kept: nothing mmapped, and the heap's top trimmed only past 2 GB (mallopt takes an int).
KEPT = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}
# glibc's own settings of its malloc, from the environment: a user who set any keeps them
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")

# the open holders (hold() calls not yet released)
_holders = 0


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc and the user left its malloc settings alone, else None."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return None
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    libc = ctypes.CDLL(None)
    # musl and others have no gnu_get_libc_version
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def set_kept(kept: bool) -> bool:
    """Keep freed memory in the process (``kept``), or go back to glibc's thresholds and give the free memory back.
    False where this is not glibc or the user set its malloc (:data:`USER_SETTINGS`, ``GLIBC_TUNABLES``).
    """
    libc = _glibc()
    if libc is None:
        return False
    for parameter, value in (KEPT if kept else RESTORED).items():
        libc.mallopt(parameter, value)
    if not kept:
        libc.malloc_trim(0)
    return True


def hold() -> bool:
    """Keep freed memory until as many :func:`release` calls; whether glibc keeps it (:func:`set_kept`)."""
    global _holders
    if _holders == 0 and not set_kept(True):
        return False
    _holders += 1
    return True


def release() -> None:
    """End a :func:`hold` that returned True; the last one gives the memory back."""
    global _holders
    _holders -= 1
    if _holders == 0:
        set_kept(False)
