"""What gpt2 may delete or replace in a folder it writes: only what it can prove it wrote, unchanged since.

The proof lives inside the folder it describes. A run folder (or a transformers export folder) holds
``.gpt2-outputs.json``: a JSON object from the relative path of each file gpt2 wrote there to its size and
sha256, added *after* the write::

    {
     "checkpoints": {"digests": "SHA256SUMS"},
     "metrics.jsonl": {"appends": true, "sha256": "…", "size": 1200},
     "tensorboard/events.out.tfevents.1": {"sha256": "…", "size": 88}
    }

``appends``: a log gpt2 only appends to, whose first ``size`` bytes identify it. ``digests``: a folder of
checkpoints, each of which carries its own record, its ``SHA256SUMS`` (``sha256sum`` format): a file in a
checkpoint is gpt2's while that file lists it with its sha256, and ``SHA256SUMS`` itself while every file it
lists that is still there matches. Links are never followed and never gpt2's.

A record that cannot be read (truncated, not JSON, an entry of the wrong shape) proves nothing: nothing
it would vouch for is deleted or replaced, and a warning names it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpt2.files import replace_atomically, sha256_file

logger = logging.getLogger(__name__)

RECORD_FILE = ".gpt2-outputs.json"
DIGEST_FILE = "SHA256SUMS"
_SHA256 = re.compile(r"[0-9a-f]{64}")
# One line of a sha256sum file: the digest, then " " (text mode) or " *" (binary mode), then the name.
_DIGEST_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


class OutputFolder:
    """A folder gpt2 writes into, and the record inside it of what gpt2 wrote there."""

    def __init__(self, path: str | os.PathLike) -> None:
        # Absolute without resolving links: the folder the user named may be one.
        self.path = Path(os.path.abspath(path))
        self.record_file = self.path / RECORD_FILE

    def read(self) -> dict[str, Any] | None:
        """The record's entries: ``{}`` without a record, None (named in a warning) when it cannot be read."""
        try:
            data = json.loads(self.record_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            _warn_damaged(self.record_file, f"it is not readable JSON: {e}")
            return None
        if not isinstance(data, dict) or not all(_is_rel(k) and _is_entry(v) for k, v in data.items()):
            _warn_damaged(self.record_file, "it is not an object of paths and what identifies them")
            return None
        return data

    def record(
        self,
        rels: Iterable[str],
        *,
        appends: Iterable[str] = (),
        digests: Iterable[str] = (),
        staged: Path | None = None,
    ) -> None:
        """Record, after writing them, the files ``rels`` (relative paths; a folder stands for the files under
        it), ``appends`` (logs gpt2 appends to) and ``digests`` (folders of checkpoints). A record that cannot
        be written is a warning: the files then count as not gpt2's, which can only keep them. ``staged``: the
        folder that holds the files ``rels`` until the caller moves them in, next; then that error is raised,
        for the caller to undo its moves.
        """
        entries = self.read() or {}
        appends, rels = set(appends), list(rels)
        source = staged or self.path
        for rel in [*rels, *appends]:
            for file in _files_under(source / rel):
                name = file.relative_to(source).as_posix()
                digest = _sha256(file)
                # A link, or a file that cannot be read, is not vouched for (and a null would make the record
                # unreadable).
                if digest is None:
                    continue
                entries[name] = {"size": os.lstat(file).st_size, "sha256": digest}
                if rel in appends:
                    entries[name]["appends"] = True
        entries |= {rel: {"digests": DIGEST_FILE} for rel in digests}
        # What is gone is dropped; staged files are not in yet.
        incoming = set(rels) if staged else set()
        entries = {rel: entry for rel, entry in entries.items() if os.path.lexists(self.path / rel) or rel in incoming}
        text = json.dumps(entries, indent=1, sort_keys=True) + "\n"
        try:
            replace_atomically(self.record_file, lambda f: f.write(text.encode("utf-8")))
        except OSError as e:
            if staged is not None:
                raise
            logger.warning("could not record what gpt2 wrote in %s (%s): it counts as not gpt2's", self.path, e)

    def sort(self, rel: str) -> tuple[list[Path], list[Path]]:
        """``(mine, others)``: the files at or under ``self.path / rel`` (a name in the folder) that the record
        proves gpt2 wrote (unchanged since), and the rest (a file of the user's, one changed since, a link).
        """
        path = self.path / rel
        entries = self.read()
        if entries is None:
            return [], _files_under(path)
        mine: list[Path] = []
        others: list[Path] = []
        if "digests" in entries.get(rel, {}) and path.is_dir() and not path.is_symlink():
            # A folder of checkpoints: each checkpoint's own record vouches for its files.
            for child in sorted(path.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    mine_here, others_here = checkpoint_files(child)
                    mine += mine_here
                    others += others_here
                else:
                    others.append(child)
            return mine, others
        for file in _files_under(path):
            entry = entries.get(file.relative_to(self.path).as_posix())
            if entry is not None and _matches(file, entry):
                mine.append(file)
            else:
                others.append(file)
        return mine, others

    def owns(self, rel: str) -> bool:
        """Whether everything at ``rel`` is gpt2's (an absent path is, having nothing to lose)."""
        return not self.sort(rel)[1]

    def remove(self, rels: Iterable[str]) -> tuple[list[Path], list[Path]]:
        """Delete what of each of ``rels`` gpt2 can prove it wrote, then the folders that leaves empty;
        returns ``(removed, kept)``, ``kept`` for the caller to name.
        """
        removed: list[Path] = []
        kept: list[Path] = []
        for rel in rels:
            mine, others = self.sort(rel)
            remove_files(self.path / rel, mine)
            removed += mine
            kept += others
        if removed:
            self.record(())
        return removed, kept


def checkpoint_files(folder: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """``(mine, others)`` in a checkpoint folder: the files its ``SHA256SUMS`` vouches for, that file itself
    while everything it lists matches, and the rest (a user's notes, a damaged file, a link).
    """
    folder = Path(folder)
    sums = read_digests(folder / DIGEST_FILE)
    mine: list[Path] = []
    others: list[Path] = []
    for file in _files_under(folder):
        if file == folder / DIGEST_FILE:
            continue
        rel = file.relative_to(folder).as_posix()
        if sums is not None and rel in sums and _sha256(file) == sums[rel]:
            mine.append(file)
        else:
            others.append(file)
    if os.path.lexists(folder / DIGEST_FILE):
        listed = {folder / rel for rel in sums or {} if os.path.lexists(folder / rel)}
        if sums is not None and listed <= set(mine):
            mine.append(folder / DIGEST_FILE)
        else:
            others.append(folder / DIGEST_FILE)
    return mine, others


def read_digests(path: Path) -> dict[str, str] | None:
    """A plain file in ``sha256sum`` format as ``{relative path: sha256}``; None if it is not one."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return None
    sums = {}
    for line in filter(None, lines):
        match = _DIGEST_LINE.fullmatch(line)
        if match is None or not _is_rel(match[2]):
            return None
        sums[match[2]] = match[1]
    return sums


def remove_files(path: Path, files: list[Path]) -> None:
    """Delete ``files``, then the folders under (and at) ``path`` that this leaves empty, deepest first."""
    for file in files:
        file.unlink(missing_ok=True)
    if path.is_symlink() or not path.is_dir():
        return
    folders = {path} | {parent for file in files for parent in file.parents if parent.is_relative_to(path)}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        # Still holding something (what is kept): it stays.
        with contextlib.suppress(OSError):
            folder.rmdir()


def _files_under(path: Path) -> list[Path]:
    """The files at or under ``path``, entering no link: links (and other non-files) are listed as files are."""
    if path.is_symlink() or not path.is_dir():
        if os.path.lexists(path):
            return [path]
        return []
    found = []
    for root, dirs, files in os.walk(path):
        linked = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        dirs[:] = sorted(set(dirs) - set(linked))
        found += [Path(root, name) for name in sorted(files + linked)]
    return found


def _matches(path: Path, entry: dict[str, Any]) -> bool:
    """Whether ``path`` is a plain file holding the recorded bytes (``appends``: starting with them). The
    sha256 of its first ``size`` bytes is the proof, read only where the size fits (a large changed file is not).
    """
    if "sha256" not in entry:
        return False
    try:
        size = os.lstat(path).st_size
    except OSError:
        return False
    # a log gpt2 appends to only grows; any other file keeps its size
    if size < entry["size"] or (size > entry["size"] and not entry.get("appends")):
        return False
    return _sha256(path, entry["size"]) == entry["sha256"]


def _sha256(path: Path, size: int | None = None) -> str | None:
    """:func:`gpt2.files.sha256_file` of a plain file; None for a link (never gpt2's) or an unreadable file."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            return sha256_file(path, size)
    except OSError:
        pass
    return None


@functools.cache
def _warn_damaged(path: Path, why: str) -> None:
    """Name a damaged record once per process and problem."""
    logger.warning("%s is damaged (%s): gpt2 deletes and replaces nothing it would vouch for", path, why)


def _is_rel(rel: Any) -> bool:
    """A ``/``-separated relative path of plain names."""
    if not isinstance(rel, str) or rel == RECORD_FILE:
        return False
    return all(part not in ("", ".", "..") and "\0" not in part and os.sep not in part for part in rel.split("/"))


def _is_entry(entry: Any) -> bool:
    """``{"size": int >= 0, "sha256": hex[, "appends": bool]}`` or ``{"digests": "SHA256SUMS"}``."""
    if entry == {"digests": DIGEST_FILE}:
        return True
    if not isinstance(entry, dict) or not set(entry) <= {"size", "sha256", "appends"}:
        return False
    size, digest = entry.get("size"), entry.get("sha256")
    if type(size) is not int or size < 0 or not isinstance(entry.get("appends", False), bool):
        return False
    return isinstance(digest, str) and _SHA256.fullmatch(digest) is not None
