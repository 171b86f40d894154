"""One run per ``out_dir``. Two processes training into one ``out_dir`` destroy each other's work, and a fresh run among
another run's checkpoints mixes with them. So :func:`start_run` (rank 0 works, every rank learns the outcome):

1. takes ``<out_dir>/run.lock`` (:class:`gpt2.files.Lock`) for the run's life;
2. removes what an interrupted save left in ``checkpoints/``;
3. refuses files gpt2 did not write where the run would write them (always: ``overwrite`` never replaces a
   ``metrics.jsonl`` or ``results.json`` the user edited), other files of the user (unless ``overwrite``,
   which keeps them), and another run (unless ``resume`` or ``overwrite``); ``out_dir/.gpt2-outputs.json``
   records what gpt2 wrote there (:mod:`gpt2.outputs`);
4. resumes, and only then deletes what ``overwrite`` replaces, only what the record proves is gpt2's (a
   file of the user's inside a run folder is kept and named): a failed resume changes nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from gpt2.errors import Gpt2Error
from gpt2.files import Lock
from gpt2.model.checkpoint_files import CHECKPOINT_DIR, checkpoint_candidates, checkpoint_step
from gpt2.outputs import RECORD_FILE, OutputFolder
from gpt2.train import checkpoint as ckpt
from gpt2.train.metrics import METRICS_FILE, PLOT_FILE

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
# What a run writes into out_dir (the Trainer: checkpoints, metrics, plot, metric sinks; the train and
# finetune commands: results.json and the LoRA adapter). Each is recorded after it is written.
TRAINER_FILES = (CHECKPOINT_DIR, METRICS_FILE, PLOT_FILE, "tensorboard", "wandb")
RUN_FILES = (*TRAINER_FILES, "results.json", "adapter")


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


class RunLock(Lock):
    """The lock on one ``out_dir``; :meth:`acquire` it, :meth:`release` it when the run ends."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        path = self.out_dir / LOCK_FILE
        busy = (
            f"out_dir {self.out_dir} is in use by another run: {{who}} holds {path}. Wait for it to finish or stop it, "
            "or train into another out_dir"
        )
        super().__init__(path, busy, RunDirLockedError)

    def acquire(self) -> RunLock:
        try:
            key = (os.getpid(), os.path.realpath(self.path))
            previous = _HELD.get(key)
            if previous is not None and previous.fd is not None:
                # The same process holds the lock: the older Trainer is abandoned (it can no longer save).
                self.fd, previous.fd = previous.fd, None
                logger.warning(
                    "another Trainer in this process was using %s; this one takes it over "
                    "(the older one can no longer save checkpoints)",
                    self.out_dir,
                )
            else:
                super().acquire()
            _HELD[key] = self
            return self
        except RunDirError:
            raise
        # Unwritable or full disk: say which file, keep the errno (and class).
        except OSError as e:
            raise OSError(e.errno, f"cannot lock out_dir {self.out_dir}: {e.strerror or e}", str(self.path)) from None

    def ensure_held(self) -> None:
        """Raise if this lock was released (its Trainer closed) or a newer Trainer took it over."""
        if self.fd is None:
            raise RunDirLockedError(
                f"this Trainer no longer owns out_dir {self.out_dir}: this Trainer was closed, or a newer Trainer in "
                "this process took its lock over, so it may not write there (another run may own it now); make a "
                "new Trainer (resume='auto' continues the run)"
            )

    def release(self) -> None:
        """Remove the lock file and unlock; a no-op when not held."""
        key = (os.getpid(), os.path.realpath(self.path))
        if _HELD.get(key) is self:
            del _HELD[key]
        super().release()


# --- the run's files


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """Raise :class:`RunDirError` if ``out_dir`` is a file, lies under one, or cannot be written."""
    existing = Path(out_dir).absolute()
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():
            raise RunDirError(
                f"out_dir {out_dir}: {existing} is a dangling symlink (to {os.readlink(existing)}): create its "
                "target, or give another out_dir"
            )
        existing = existing.parent
    if not existing.is_dir():
        # out_dir itself, or a path above it
        raise RunDirError(f"out_dir {out_dir}: {existing} is a file: give a directory (new or one of an earlier run)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"out_dir {out_dir} cannot be written ({existing} is not writable): choose another out_dir")


def record_outputs(out_dir: str | os.PathLike, names: Collection[str]) -> None:
    """Record in ``out_dir``'s record, after writing them, those of the run files ``names`` that exist: the
    checkpoint folder by its checkpoints' own records, ``metrics.jsonl`` as a log that is appended to (a resume
    or a recovery cuts it back, then appends again), another file or folder by its files' sizes and sha256. Links
    are never recorded (gpt2 writes none).
    """
    OutputFolder(out_dir).record(
        [n for n in names if n not in (CHECKPOINT_DIR, METRICS_FILE)],
        appends=[n for n in names if n == METRICS_FILE],
        digests=[n for n in names if n == CHECKPOINT_DIR],
    )


def _refuse_another_run(out_dir: Path, resume: str | None) -> None:
    """Refuse an ``out_dir`` that holds another run: its checkpoints or its metrics."""
    found = []
    names = sorted(p.name for p in checkpoint_candidates(out_dir / CHECKPOINT_DIR))
    if len(names) == 1:
        found.append(f"checkpoints {names[0]}")
    elif names:
        found.append(f"checkpoints {names[0]}..{names[-1]}")
    metrics = out_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_FILE)
    if not found:
        return
    what = "a fresh run (resume=None)"
    if resume is not None:
        what = f"a run resuming from {resume}"
    raise RunDirNotEmptyError(
        f"out_dir {out_dir} already holds another run ({', '.join(found)}), and {what} would mix with it. "
        "Continue that run with resume='auto' (--resume auto), train into a new out_dir, or pass "
        f"overwrite=True (--overwrite) to delete its files ({', '.join(RUN_FILES)}) first"
    )


def _check_run_dir(out_dir: Path, resume: str | None, overwrite: bool) -> list[Path]:
    """Refuse what this run would mix with or replace; return what ``overwrite`` will delete once
    the run has started (nothing is deleted here, so a failed resume changes nothing).
    """
    checkpoint_dir = out_dir / CHECKPOINT_DIR
    folder = OutputFolder(out_dir)
    entries = folder.read()
    # A damaged record cannot say what is whose: the run's names count as recorded, and overwrite refuses them.
    recorded = set(RUN_FILES)
    if entries is not None:
        # Only the run's names: a folder's other recorded files (prepare's shards) are not a run's to mix with.
        recorded = {rel.split("/", 1)[0] for rel in entries} & set(RUN_FILES)
    present = [name for name in RUN_FILES if os.path.lexists(out_dir / name)]
    unlisted = [name for name in present if name not in recorded]
    realpath = os.path.realpath
    if resume == "auto" or (resume is not None and realpath(resume) in map(realpath, (out_dir, checkpoint_dir))):
        # Continues whatever run is there (or starts one): its newest usable checkpoint.
        _refuse_unproven(out_dir, unlisted)
        return []
    if resume is not None and Path(realpath(resume)).is_relative_to(realpath(checkpoint_dir)):
        _refuse_unproven(out_dir, unlisted)
        return _check_older_checkpoint(checkpoint_dir, resume, overwrite)
    _refuse_unproven(out_dir, _check_fresh_run(folder, resume, overwrite, recorded, present, entries is None))
    return [out_dir / name for name in present]


def _refuse_unproven(out_dir: Path, names: list[str]) -> None:
    """What this run would replace that the record does not prove is gpt2's: refused, even with overwrite."""
    if names:
        raise RunDirNotEmptyError(
            f"out_dir {out_dir}: {', '.join(names)} changed since gpt2 wrote them, or gpt2 did not write them (or "
            f"its record {RECORD_FILE} cannot tell), and this run would replace them: move them away, or train into "
            "another out_dir (overwrite never replaces files that are not gpt2's)"
        )


def _check_fresh_run(
    folder: OutputFolder, resume: str | None, overwrite: bool, recorded: set[str], present: list[str], damaged: bool
) -> list[str]:
    """A fresh run, or one continuing a checkpoint from elsewhere: out_dir must hold no run and no
    files of the user's, unless ``overwrite`` (which deletes gpt2's own files and keeps the user's).
    Returns the run's names ``present`` it would replace that the record does not prove are gpt2's: it writes
    them anew, so a file changed since (or any, when the record cannot be read) counts too.
    """
    out_dir = folder.path
    if not overwrite:
        _refuse_another_run(out_dir, resume)
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in {*recorded, LOCK_FILE, RECORD_FILE})
    if foreign and not overwrite:
        more = ""
        if len(foreign) > 5:
            more = " ..."
        raise RunDirNotEmptyError(
            f"out_dir {out_dir} holds files gpt2 did not write ({', '.join(foreign[:5])}{more}): train into a new "
            "or empty out_dir, or pass overwrite=True (--overwrite): your files are kept, only gpt2's own files "
            "there are replaced"
        )
    return [
        name
        for name in present
        if name not in recorded or damaged or (not (out_dir / name).is_dir() and not folder.owns(name))
    ]


def _check_older_checkpoint(checkpoint_dir: Path, resume: str, overwrite: bool) -> list[Path]:
    """Resuming from an older checkpoint of this very run: the newer ones are another future,
    refused unless ``overwrite`` (which deletes them).
    """
    step = checkpoint_step(Path(resume))
    newer = []
    if step is not None:
        newer = [p for p in checkpoint_candidates(checkpoint_dir) if checkpoint_step(p) > step]
    if newer and not overwrite:
        raise RunDirNotEmptyError(
            f"resume={resume!r} is older than checkpoints {', '.join(sorted(p.name for p in newer))} in "
            f"{checkpoint_dir}: continuing from it would mix two histories. Use resume='auto' to continue from the "
            "newest, train into a new out_dir, or pass overwrite=True to delete the newer checkpoints"
        )
    return newer


# --- everything the Trainer does before its first step


def start_run(
    out: Path | None, *, resume: str | None, overwrite: bool, load: Callable[[Path], Any], is_main: bool = True
) -> RunLock | None:
    """The steps of the module docstring; ``load(path)`` resumes on every rank. Rank 0 returns the
    held :class:`RunLock` (others None); call it on all ranks: all raise when any fails, and a
    failure leaves ``out_dir`` as it was (no lock, not even a new empty directory).
    """
    lock = None
    if out is not None and is_main:
        lock = RunLock(out)
    created = out is not None and not out.exists()
    try:
        doomed = ckpt.run_on_all_ranks(lambda: _claim(lock, resume, overwrite))
        _resume(out, resume, load)
        ckpt.run_on_all_ranks(lambda: _finish(lock, doomed))
    except BaseException:
        # Release the lock and remove the out_dir this run created, if still empty.
        if lock is not None:
            lock.release()
            if created and lock.out_dir.is_dir() and not any(lock.out_dir.iterdir()):
                lock.out_dir.rmdir()
        raise
    return lock


def _claim(lock: RunLock | None, resume: str | None, overwrite: bool) -> list[Path]:
    """Rank 0: steps 1 to 3 of the module docstring; returns what ``overwrite`` will delete."""
    if lock is None:
        return []
    check_out_dir(lock.out_dir)
    lock.acquire()
    ckpt.clean_interrupted_saves(lock.out_dir / CHECKPOINT_DIR)
    return _check_run_dir(lock.out_dir, resume, overwrite)


def _resume(out: Path | None, resume: str | None, load: Callable[[Path], Any]) -> None:
    """``load`` the checkpoint ``resume`` names on every rank (resume='auto' with none yet: a fresh start)."""
    if resume is None:
        return
    if resume != "auto":
        target = Path(resume)
    else:
        target = out / CHECKPOINT_DIR  # type: ignore[operator]
        if not checkpoint_candidates(target):
            logger.info("resume='auto': no checkpoint in %s, starting from scratch", target)
            return
    ckpt.run_on_all_ranks(lambda: load(target))


def _finish(lock: RunLock | None, doomed: list[Path]) -> None:
    """Rank 0, once the run has started: delete what ``overwrite`` replaces, only what the records prove is
    gpt2's (the run folder's for its names, a checkpoint's own for a newer checkpoint of this run); what is
    kept is named.
    """
    if lock is None:
        return
    out_dir = lock.out_dir
    removed, kept = OutputFolder(out_dir).remove([path.name for path in doomed if path.parent == out_dir])
    for path in doomed:
        if path.parent != out_dir:
            removed.append(path)
            kept += ckpt.remove_checkpoint(path)
    if removed:
        logger.warning("overwrite=True: deleted %s", ", ".join(str(p) for p in removed))
    ckpt.warn_kept(kept, "overwrite=True")
