"""One run per ``out_dir``. Two processes training into one ``out_dir`` destroy each other's work, and a fresh run among
another run's checkpoints mixes with them. So :func:`start_run` (rank 0 works, every rank learns the outcome):

1. takes ``<out_dir>/run.lock`` (pid, host, start time), ``fcntl.flock``-ed for the run's life: a
   crash leaves no stuck lock on this host; another host's record is refused with how to remove it;
2. removes what an interrupted save left in ``checkpoints/``;
3. refuses files gpt2 did not write where the run would write (always), other files of the user
   (unless ``overwrite``, which keeps them), and another run (unless ``resume`` or ``overwrite``);
   ``out_dir/.gpt2-outputs.json`` records what gpt2 wrote there (:mod:`gpt2.outputs`: each name
   recorded after it is written, with its size and sha256, a checkpoint by its ``SHA256SUMS``);
4. resumes, and only then deletes what ``overwrite`` replaces, only what the record proves is
   gpt2's (a file of the user's inside a run folder is kept and named): a failed resume changes
   nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpt2 import outputs
from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.files import pid_alive, replace_atomically
from gpt2.train import checkpoint as ckpt
from gpt2.train.distributed import _active

try:
    import fcntl
# Windows: the pid/host record alone (created exclusively) is the lock.
except ImportError:
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
CHECKPOINT_DIR = "checkpoints"
# What a run writes into out_dir (the Trainer: checkpoints, metrics, plot, metric sinks; the
# train and finetune commands: results.json and the LoRA adapter). Each is recorded in the record
# MANIFEST_FILE after it is written (record_outputs); overwrite=True deletes what the record proves
# is gpt2's, nothing else.
TRAINER_FILES = (CHECKPOINT_DIR, "metrics.jsonl", "loss.png", "tensorboard", "wandb")
RUN_FILES = (*TRAINER_FILES, "results.json", "adapter")
MANIFEST_FILE = outputs.RECORD_FILE
# A log the Trainer only appends to (a resume or a recovery cuts it back, then appends again).
_APPENDED = {"metrics.jsonl"}


class RunDirError(Gpt2Error, FileExistsError):
    """``out_dir`` cannot be used by this run (see the message for the ways out)."""


class RunDirLockedError(RunDirError):
    """Another process (or another Trainer) is running in this ``out_dir``."""


class RunDirNotEmptyError(RunDirError):
    """A fresh run was pointed at an ``out_dir`` that holds another run, or files gpt2 did not write."""


# Locks held by this process, by (pid, the lock file's real path): a second Trainer on the same
# out_dir in one process (a notebook cell run again after an error) takes the lock over. The pid
# keeps a forked child from taking over its parent's lock.
_HELD: dict[tuple[int, str], RunLock] = {}


@atexit.register
def _release_at_exit() -> None:
    """A script that never called ``Trainer.close()`` leaves no lock record behind either."""
    for (pid, _), lock in list(_HELD.items()):
        if pid == os.getpid():
            lock.release()


class RunLock:
    """The lock on one ``out_dir``; :meth:`acquire` it, :meth:`release` it when the run ends."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self._fd: int | None = None
        # A newer Trainer in this process took the lock from this one.
        self.taken_over = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            key = (os.getpid(), os.path.realpath(self.path))
            previous = _HELD.get(key)
            if previous is not None and previous.held:
                self._take_over(previous)
            else:
                self._fd = self._lock_file()
            _HELD[key] = self
            return self
        except RunDirError:
            raise
        # Unwritable or full disk: say which file, keep the errno (and class).
        except OSError as e:
            raise OSError(e.errno, f"cannot lock out_dir {self.out_dir}: {e.strerror or e}", str(self.path)) from None

    def _take_over(self, previous: RunLock) -> None:
        """The same process holds the lock: the older Trainer is abandoned (it can no longer save)."""
        self._fd, previous._fd = previous._fd, None
        previous.taken_over = True
        logger.warning(
            "another Trainer in this process was using %s; this one takes it over "
            "(the older one can no longer save checkpoints)",
            self.out_dir,
        )

    def _lock_file(self) -> int:
        """An fd of the lock file, locked by this process and holding its record."""
        # The file may be removed / replaced under us by its releasing owner: try again.
        for _ in range(20):
            fd = self._open_locked()
            if fd is None:
                continue
            try:
                record = _read_record(fd)
                if record:
                    self._judge_left_behind(record)
                _write_record(fd)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise RunDirLockedError(
            f"could not lock out_dir {self.out_dir}: {self.path} keeps changing; is another run starting in it?"
        )

    def _open_locked(self) -> int | None:
        """An fd of the lock file that this process holds, None to try again; raises if busy."""
        if fcntl is not None:
            opened = self._open_or_create()
            if opened is None:
                return None
            fd, created = opened
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(fd)
                os.close(fd)
                raise RunDirLockedError(_busy_message(self.out_dir, self.path, record)) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                # This filesystem has no flock: the file's creator owns the lock, as without fcntl.
                if created:
                    return fd
                os.close(fd)
                return self._open_exclusive()
            # The file we locked must still be the one at the path (not unlinked by its owner).
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                return None
            return fd
        return self._open_exclusive()

    def _open_or_create(self) -> tuple[int, bool] | None:
        """An fd of the lock file and whether this call created it (None: try again). Knowing who
        created it matters where flock is missing: an O_CREAT open would leave an empty file that
        the exclusive-create fallback then takes for another run's lock.
        """
        cloexec = getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(self.path, os.O_RDWR | cloexec), False
        except FileNotFoundError:
            pass
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | cloexec, 0o644), True
        except FileExistsError:
            # Created between the two opens by another starting run: look again.
            return None

    def _open_exclusive(self) -> int | None:
        """Without flock: whoever creates the file owns the lock."""
        with contextlib.suppress(FileExistsError):
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            record = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            record = {}
        if record.get("host") == socket.gethostname() and not pid_alive(int(record.get("pid", 0) or 0)):
            logger.warning("taking over %s: pid %s that held it is no longer running", self.path, record.get("pid"))
            self.path.unlink(missing_ok=True)
            return None
        raise RunDirLockedError(_busy_message(self.out_dir, self.path, record))

    def _judge_left_behind(self, record: dict[str, Any]) -> None:
        """We hold the lock, but a previous owner's record is still there: it did not release it."""
        if record.get("host") not in (None, socket.gethostname()):
            # flock may not reach across machines (network filesystems): that run may be alive.
            raise RunDirLockedError(
                f"out_dir {self.out_dir} is locked by pid {record.get('pid')} on host {record.get('host')} "
                f"(started {record.get('started', '?')}), which cannot be checked from here; if that run is "
                f"really gone, delete {self.path} and start again, or use another out_dir"
            )
        # Garbage in the file: nobody holds the flock, so nobody owns it.
        if record.get("pid") is None:
            logger.warning("taking over %s (its record was unreadable and nobody holds it)", self.path)
        elif record.get("pid") != os.getpid():
            logger.warning(
                "taking over %s left by pid %s (started %s), which is no longer running",
                self.path,
                record.get("pid"),
                record.get("started", "?"),
            )

    def ensure_held(self) -> None:
        """Raise if this lock was released (its Trainer closed) or a newer Trainer took it over."""
        if self.held:
            return
        if self.taken_over:
            why = "a newer Trainer in this process took it over"
        else:
            why = "this Trainer was closed"
        raise RunDirLockedError(
            f"this Trainer no longer owns out_dir {self.out_dir}: {why}, so it may not write there "
            "(another run may own it now); make a new Trainer (resume='auto' continues the run)"
        )

    def release(self) -> None:
        """Remove the lock file and unlock; a no-op when not held."""
        if self._fd is None:
            return
        key = (os.getpid(), os.path.realpath(self.path))
        # Unlinked while still locked, so nobody locks the old file.
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
        if _HELD.get(key) is self:
            del _HELD[key]


def _read_record(fd: int) -> dict[str, Any]:
    """The lock file's record: ``{}`` when empty or not a JSON object, ``{"unreadable": True}`` on an error."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        # A one-line record.
        data = os.read(fd, 1 << 16)
        if not data.strip():
            return {}
        record = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return {"unreadable": True}
    if not isinstance(record, dict):
        return {}
    return record


def _write_record(fd: int) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))
    os.fsync(fd)


def _busy_message(out_dir: Path, path: Path, record: dict[str, Any]) -> str:
    if record.get("pid") is not None:
        who = f"pid {record['pid']} on host {record.get('host', '?')} (started {record.get('started', '?')})"
    else:
        who = "another process"
    return (
        f"out_dir {out_dir} is in use by another run: {who} holds {path}. Wait for it to finish or "
        "stop it, or train into another out_dir"
    )


# --- the run's files


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """Raise :class:`RunDirError` if ``out_dir`` is a file, lies under one, or cannot be written."""
    path = existing = Path(out_dir).absolute()
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():
            raise RunDirError(
                f"out_dir {out_dir}: {existing} is a dangling symlink (to {os.readlink(existing)}): create its "
                "target, or give another out_dir"
            )
        existing = existing.parent
    if not existing.is_dir():
        if existing == path:
            where = "is a file"
        else:
            where = f"lies under the file {existing}"
        raise RunDirError(f"out_dir {out_dir} {where}: give a directory (new or one of an earlier run)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"out_dir {out_dir} cannot be written ({existing} is not writable): choose another out_dir")


def own_outputs(out_dir: str | os.PathLike) -> set[str]:
    """The names in ``out_dir`` that gpt2 wrote (its record, :data:`MANIFEST_FILE`).

    A run directory with a run in it (checkpoints, metrics) but no readable record, one from before
    the record or one whose record is damaged (named in a warning by :mod:`gpt2.outputs`), counts as
    holding :data:`RUN_FILES` under the older rule: ``resume`` continues it, ``overwrite`` replaces
    those names (see :func:`_legacy_record`).
    """
    out_dir = Path(out_dir)
    names = outputs.recorded_names(out_dir)
    if not names and existing_run(out_dir):
        names = set(RUN_FILES)
    return names | {LOCK_FILE, MANIFEST_FILE}


def record_outputs(out_dir: str | os.PathLike, names: Iterable[str]) -> None:
    """Record in ``out_dir``'s record, after writing them, those of the run files ``names`` that exist:
    a checkpoint folder by its checkpoints' ``SHA256SUMS``, another folder by its files' sizes and
    sha256, ``metrics.jsonl`` as a log that is appended to, another file by its size and sha256.
    Links are never recorded (gpt2 writes none).
    """
    out_dir = Path(out_dir)
    for name in names:
        path = out_dir / name
        if path.is_symlink() or not path.exists():
            continue
        if name == CHECKPOINT_DIR:
            outputs.record_written(path, digests=ckpt.DIGEST_FILE)
        elif path.is_dir():
            outputs.record_written(path, files=_files_in(path))
        else:
            outputs.record_written(path, appends=name in _APPENDED)


def _files_in(folder: Path) -> list[str]:
    """The regular files under ``folder`` (not through links), as ``/``-separated relative paths."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for file in files:
            path = Path(root, file)
            if path.is_file() and not path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return found


def existing_run(out_dir: str | os.PathLike) -> list[str]:
    """What of another run ``out_dir`` holds: its checkpoints and metrics (empty: nothing)."""
    out_dir = Path(out_dir)
    found = []
    names = sorted(p.name for p in ckpt.checkpoint_candidates(out_dir / CHECKPOINT_DIR))
    if len(names) == 1:
        found.append(f"checkpoints {names[0]}")
    elif names:
        found.append(f"checkpoints {names[0]}..{names[-1]}")
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def _check_run_dir(out_dir: Path, resume: str | None, overwrite: bool) -> list[Path]:
    """Refuse what this run would mix with or replace; return what ``overwrite`` will delete once
    the run has started (nothing is deleted here, so a failed resume changes nothing).
    """
    checkpoint_dir = out_dir / CHECKPOINT_DIR
    own = own_outputs(out_dir)
    foreign = _foreign_names(out_dir, own)
    _refuse_replacing_foreign(out_dir, foreign)
    realpath = os.path.realpath
    if resume == "auto" or (resume is not None and realpath(resume) in map(realpath, (out_dir, checkpoint_dir))):
        # Continues whatever run is there (or starts one): its newest usable checkpoint.
        return []
    if resume is not None and Path(realpath(resume)).is_relative_to(realpath(checkpoint_dir)):
        return _check_older_checkpoint(checkpoint_dir, resume, overwrite)
    return _check_fresh_run(out_dir, resume, overwrite, own, foreign)


def _foreign_names(out_dir: Path, own: set[str]) -> list[str]:
    """The names in ``out_dir`` that gpt2 did not write, sorted."""
    if not out_dir.is_dir():
        return []
    return sorted(p.name for p in out_dir.iterdir() if p.name not in own)


def _refuse_replacing_foreign(out_dir: Path, foreign: list[str]) -> None:
    """Files of the user's under a name this run writes (always refused, even with overwrite)."""
    clash = [name for name in foreign if name in RUN_FILES]
    if clash:
        raise RunDirNotEmptyError(
            f"out_dir {out_dir} holds {clash}, which gpt2 did not write there and this run would replace: move "
            "them away or train into another out_dir (overwrite never replaces files that are not gpt2's)"
        )


def _check_fresh_run(
    out_dir: Path, resume: str | None, overwrite: bool, own: set[str], foreign: list[str]
) -> list[Path]:
    """A fresh run, or one continuing a checkpoint from elsewhere: out_dir must hold no run and no
    files of the user's, unless ``overwrite`` (which deletes gpt2's own files and keeps the user's).
    """
    found = existing_run(out_dir)
    if found and not overwrite:
        if resume is None:
            what = "a fresh run (resume=None)"
        else:
            what = f"a run resuming from {resume}"
        raise RunDirNotEmptyError(
            f"out_dir {out_dir} already holds another run ({', '.join(found)}), and {what} would mix with it. "
            "Continue that run with resume='auto' (--resume auto), train into a new out_dir, or pass "
            f"overwrite=True (--overwrite) to delete its files ({', '.join(RUN_FILES)}) first"
        )
    if foreign and not overwrite:
        more = ""
        if len(foreign) > 5:
            more = " ..."
        raise RunDirNotEmptyError(
            f"out_dir {out_dir} holds files gpt2 did not write ({', '.join(foreign[:5])}{more}): train into a new "
            "or empty out_dir, or pass overwrite=True (--overwrite): your files are kept, only gpt2's own files "
            "there are replaced"
        )
    return [out_dir / name for name in RUN_FILES if name in own and (out_dir / name).exists()]


def _check_older_checkpoint(checkpoint_dir: Path, resume: str, overwrite: bool) -> list[Path]:
    """Resuming from an older checkpoint of this very run: the newer ones are another future,
    refused unless ``overwrite`` (which deletes them).
    """
    step = ckpt.checkpoint_step(Path(resume))
    newer = []
    if step is not None:
        newer = [p for p in ckpt.checkpoint_candidates(checkpoint_dir) if ckpt.checkpoint_step(p) > step]
    if newer and not overwrite:
        raise RunDirNotEmptyError(
            f"resume={resume!r} is older than checkpoints {', '.join(sorted(p.name for p in newer))} in "
            f"{checkpoint_dir}: continuing from it would mix two histories. Use resume='auto' to continue from the "
            "newest, train into a new out_dir, or pass overwrite=True to delete the newer checkpoints"
        )
    return newer


# --- everything the Trainer does before its first step


def start_run(
    out_dir: str | os.PathLike | None,
    *,
    resume: str | None,
    overwrite: bool,
    load: Callable[[Path], Any],
    is_main: bool = True,
) -> RunLock | None:
    """The steps of the module docstring; ``load(path)`` resumes on every rank. Rank 0 returns the
    held :class:`RunLock` (others None); call it on all ranks: all raise when any fails, and a
    failure leaves ``out_dir`` as it was (no lock, not even a new empty directory).
    """
    if overwrite and resume == "auto":
        raise InvalidValueError("overwrite=True deletes the run in out_dir and resume='auto' continues it: choose one")
    out = None
    if out_dir is not None:
        out = Path(out_dir)
    lock = None
    if out is not None and is_main:
        lock = RunLock(out)
    created = out is not None and not out.exists()
    try:
        doomed = run_on_all_ranks(lambda: _claim(lock, resume, overwrite))
        _resume(out, resume, load)
        run_on_all_ranks(lambda: _finish(lock, doomed))
    except BaseException:
        _give_up(lock, created)
        raise
    return lock


def _claim(lock: RunLock | None, resume: str | None, overwrite: bool) -> list[Path]:
    """Rank 0: steps 1 to 3 of the module docstring; returns what ``overwrite`` will delete."""
    if lock is None:
        return []
    check_out_dir(lock.out_dir)
    lock.acquire()
    checkpoint_dir = lock.out_dir / CHECKPOINT_DIR
    for line in ckpt.clean_interrupted_saves(checkpoint_dir):
        logger.warning("cleaning up an interrupted save in %s: %s", checkpoint_dir, line)
    return _check_run_dir(lock.out_dir, resume, overwrite)


def _resume(out: Path | None, resume: str | None, load: Callable[[Path], Any]) -> None:
    """``load`` the checkpoint ``resume`` names on every rank (resume='auto' with none yet: a fresh start)."""
    if resume is None:
        return
    if resume != "auto":
        target = Path(resume)
    else:
        target = out / CHECKPOINT_DIR  # type: ignore[operator]
        if not ckpt.checkpoint_candidates(target):
            logger.info("resume='auto': no checkpoint in %s, starting from scratch", target)
            return
    run_on_all_ranks(lambda: load(target))


def _finish(lock: RunLock | None, doomed: list[Path]) -> None:
    """Rank 0, once the run has started: delete what ``overwrite`` replaces. The run's names in out_dir
    go through :func:`gpt2.outputs.remove_owned` (only what the record proves is gpt2's; what it keeps
    is named); newer checkpoints of this run (resuming an older one) are checkpoint folders of its own
    checkpoint directory.
    """
    if lock is None:
        return
    out_dir = lock.out_dir
    names = [path.name for path in doomed if path.parent == out_dir]
    newer_checkpoints = [path for path in doomed if path.parent != out_dir]
    for path in newer_checkpoints:
        shutil.rmtree(path)
    removed: list[Path] = []
    kept: list[Path] = []
    if names:
        _legacy_record(out_dir)
        removed, kept = outputs.remove_owned(out_dir, names, legacy=True)
    removed += newer_checkpoints
    if removed:
        logger.warning("overwrite=True: deleted %s", ", ".join(str(p) for p in removed))
    if kept:
        logger.warning(
            "overwrite=True kept %s: gpt2 did not write them (or they changed since); move them away if they should go",
            ", ".join(str(p) for p in kept),
        )


def _legacy_record(out_dir: Path) -> None:
    """A run directory without a readable record (an older gpt2's, or a damaged record): write the
    older format, the list of :data:`RUN_FILES` (read as names without identity, see
    :mod:`gpt2.outputs`), so that ``overwrite`` replaces those names as the older rule did.
    """
    if outputs.recorded_names(out_dir):
        return
    found = existing_run(out_dir)
    if not found:
        return
    logger.warning(
        "%s has no readable record of what gpt2 wrote there: it is rebuilt from the run on disk (%s)",
        out_dir,
        ", ".join(found),
    )
    text = json.dumps(sorted(RUN_FILES)) + "\n"
    replace_atomically(out_dir / MANIFEST_FILE, lambda f: f.write(text.encode("utf-8")))


def _give_up(lock: RunLock | None, created: bool) -> None:
    """After a failure: release the lock and remove the ``out_dir`` this run created, if still empty."""
    if lock is None:
        return
    lock.release()
    if created and lock.out_dir.is_dir() and not any(lock.out_dir.iterdir()):
        lock.out_dir.rmdir()


def run_on_all_ranks(fn: Callable[[], Any]) -> Any:
    """``fn()`` on every process; if it raises on any of them, every process raises (so none is
    left waiting at a collective for one that died). One process: just ``fn()``.
    """
    if not _active():
        return fn()
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - handed to the other ranks, then raised here
        error = e
    outcomes: list[Any] = [None] * dist.get_world_size()
    mine = None
    if error is not None:
        mine = (type(error).__name__, str(error))
    dist.all_gather_object(outcomes, mine)
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            name, message = outcome
            cls = _ERRORS.get(name, RuntimeError)
            raise cls(f"{message} (raised on rank {rank})")
    return result


# What another rank's error is re-raised as, by name.
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (RunDirError, RunDirLockedError, RunDirNotEmptyError, ValueError, FileNotFoundError, KeyError)
    + (PermissionError, ckpt.CheckpointError, ckpt.CheckpointMismatchError, ckpt.NonFiniteWeightsError)
}
