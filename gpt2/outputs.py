"""What gpt2 may delete or replace: only what it can prove it wrote (issue 27).

The rule, in one place: gpt2 replaces or deletes a file only where it can prove that it wrote that
file, and refuses anything else with one line naming the path and the flag that would allow it.

The proof is a record, ``.gpt2-outputs.json``, in the folder that holds what gpt2 wrote: a JSON object
from each name gpt2 wrote there to what identifies it, added *after* the write (so a name that a
caller may write but has not written yet is never recorded)::

    {
     "checkpoints": {"digests": "SHA256SUMS", "files": {}},
     "hf": {"files": {"config.json": {"sha256": "…", "size": 912}, "model.safetensors": {…}}},
     "loss.png": {"legacy": true},
     "metrics.jsonl": {"appends": true, "sha256": "…", "size": 1200},
     "model.gguf": {"sha256": "…", "size": 250718816}
    }

- A file: its size and sha256. With ``appends`` (a log gpt2 only appends to) its first ``size``
  bytes identify it, so lines appended after the record still match.
- A folder: ``files``, the relative paths of the files gpt2 wrote in it, each with its size and
  sha256; and/or ``digests``, the name of the ``sha256sum``-format files that vouch for the files
  beside them anywhere in the folder (each checkpoint's ``SHA256SUMS``). A digest file is gpt2's
  while every file it lists that is still there matches it.
- ``legacy``: a name from the plain list of names older versions wrote (the run directory's
  manifest). It carries no identity, so it counts as gpt2's only where the caller passes
  ``legacy=True`` because its older rule allowed it (the run's own files under ``--overwrite``).

The record describes the names *in* its folder, so an export folder is recorded in its parent
(the folder holds the export and nothing else) and a single file (a GGUF file, ``gpt2 eval
--output``) is recorded the same way. Keyed by name, the record still reads as the list of names to
code written for the older format (``set(json.load(f))``). It is written atomically
(:func:`gpt2.files.replace_atomically`), and entries whose path is gone are dropped at each write
(legacy names excepted: the older code lists its names before it writes them).

A damaged record (not JSON, neither an object nor a list, an entry of the wrong shape) is named in
a warning. What cannot be read claims nothing, so nothing of it is replaced or deleted; the valid
entries still stand (each is checked against the disk when used), and the next write rebuilds the
record from them. A record that cannot be written is a warning too: the file then counts as not
gpt2's, which can only keep it.

Links are never followed: gpt2 writes none, so a symbolic link is never gpt2's (it is kept), and a
folder is never entered through one. What the user names (``--out``, the run directory) may be one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.files import replace_atomically

logger = logging.getLogger(__name__)

RECORD_FILE = ".gpt2-outputs.json"
LEGACY: dict[str, Any] = {"legacy": True}

_SHA256 = re.compile(r"[0-9a-f]{64}")
# One line of a sha256sum file: the digest, then " " (text mode) or " *" (binary mode), then the name.
_DIGEST_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")
_CHUNK_BYTES = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

Entry = dict[str, Any]


class NotOursError(Gpt2Error, FileExistsError):
    """gpt2 would replace or delete a path it cannot prove it wrote; the message names the way out."""


# --- the public rule


def record_written(
    path: str | os.PathLike,
    *,
    files: Iterable[str] | None = None,
    digests: str | None = None,
    appends: bool = False,
) -> None:
    """Record, after writing it, that gpt2 wrote ``path`` (in the record of its folder).

    A file: its size and sha256 (``appends``: a log gpt2 only appends to; record it again after
    writing more). A folder: ``files``, the relative paths (``/``-separated) of the files gpt2
    wrote in it, added to those recorded before; and/or ``digests``, the name of the digest
    files that vouch for their neighbours (``"SHA256SUMS"`` for checkpoints).
    """
    path = _absolute(path)
    entries = _read(path.parent)
    previous = entries.get(path.name, {})
    if files is None and digests is None:
        entry = _identity(path)
        if appends:
            entry["appends"] = True
    else:
        entry = _folder_entry(path, files or (), digests or previous.get("digests"))
        # What was recorded in the folder before stays recorded (dropped once it is gone).
        entry["files"] = {**previous.get("files", {}), **entry["files"]}
    entries[path.name] = entry
    try:
        _write(path.parent, entries)
    except OSError as e:
        logger.warning(
            "could not record that gpt2 wrote %s (%s): gpt2 will treat it as a file it did not write", path, e
        )


def check_replaceable(
    path: str | os.PathLike,
    *,
    overwrite: bool,
    flag: str,
    within: str | os.PathLike | None = None,
    legacy: bool = False,
) -> None:
    """Return if gpt2 may replace ``path``: it is absent, or gpt2 can prove it wrote it
    (:func:`is_owned`), or ``overwrite`` (the user named this very path and asked to replace
    it; never a folder). Otherwise raise :class:`NotOursError`, one line naming ``path`` and ``flag``.
    ``within``: ``path`` is a file in that recorded folder (an export folder), not a name of its own.
    """
    path = _absolute(path)
    if not os.path.lexists(path) or is_owned(path, within=within, legacy=legacy):
        return
    folder = path.is_dir() and not path.is_symlink()
    if overwrite and not folder:
        return
    if folder:
        raise NotOursError(
            f"{path} is a folder holding files gpt2 did not write (or that changed since): choose another "
            f"path, or move them away ({flag} replaces files, never a folder)"
        )
    claim = _claim(path, within)
    why = "exists and gpt2 has no record of writing it"
    if claim == LEGACY:
        why = "was recorded by an older gpt2 without its size and sha256, so gpt2 cannot prove it wrote it"
    elif claim is not None:
        why = "has changed since gpt2 wrote it"
    raise NotOursError(f"{path} {why}: choose another path, or pass {flag} to replace it")


def is_owned(path: str | os.PathLike, *, within: str | os.PathLike | None = None, legacy: bool = False) -> bool:
    """Whether gpt2 can prove it wrote ``path``: a file recorded with its identity (still matching),
    or a folder whose every file is. ``legacy``: a name an older gpt2 recorded counts too.
    ``within``: ``path`` is a file in that recorded folder.
    """
    path = _absolute(path)
    claim = _claim(path, within)
    if claim is None:
        return False
    if within is not None and _through_link(_absolute(within), path):
        return False
    return not _sort(path, claim, legacy)[1]


def remove_owned(
    folder: str | os.PathLike, names: Iterable[str], *, legacy: bool = False
) -> tuple[list[Path], list[Path]]:
    """Delete what of ``folder/name`` (each of ``names``) gpt2 can prove it wrote, then the folders
    that leaves empty; returns ``(removed, kept)``. ``removed``: what was deleted (a folder deleted
    whole stands for its files). ``kept``: what gpt2 cannot prove it wrote (a file it did not
    record, one that changed since, a link), for the caller to name in a warning. ``legacy``: a
    name an older gpt2 recorded counts as gpt2's, whole (the caller's older rule allowed that).
    """
    folder = _absolute(folder)
    entries = _read(folder)
    removed: list[Path] = []
    kept: list[Path] = []
    for name in names:
        if not _is_name(name):
            raise InvalidValueError(f"remove_owned takes names in {folder}, got {name!r}")
        path = folder / name
        if not os.path.lexists(path):
            continue
        if name not in entries:
            kept.append(path)
            continue
        mine, others = _sort(path, entries[name], legacy)
        for file in mine:
            file.unlink()
        _remove_emptied(path, mine)
        kept += others
        if os.path.lexists(path):
            removed += mine
        else:
            removed.append(path)
            del entries[name]
    if removed:
        # What is gone is dropped from the record; a record that cannot be rewritten only keeps
        # entries for absent paths, which claim nothing (the next write drops them).
        with contextlib.suppress(OSError):
            _write(folder, entries)
    return removed, kept


def recorded_names(folder: str | os.PathLike) -> set[str]:
    """The names ``folder``'s record lists (legacy ones too); empty without a record."""
    return set(_read(_absolute(folder)))


def is_recorded(path: str | os.PathLike) -> bool:
    """Whether the record of ``path``'s folder holds what identifies ``path`` (a legacy name does not)."""
    path = _absolute(path)
    entry = _read(path.parent).get(path.name)
    return entry is not None and entry != LEGACY


# --- what the record says about a path


def _claim(path: Path, within: str | os.PathLike | None) -> Entry | None:
    """What the records say ``path`` is: its own entry, or (``within``) the identity that folder's
    entry gives it, LEGACY for a legacy folder, None where nothing is recorded.
    """
    if within is None:
        return _read(path.parent).get(path.name)
    root = _absolute(within)
    if not path.is_relative_to(root) or path == root:
        raise InvalidValueError(f"{path} is not inside {root}")
    entry = _read(root.parent).get(root.name)
    if entry is None or entry == LEGACY:
        return entry
    claim = dict(entry.get("files", {}).get(path.relative_to(root).as_posix(), {}))
    if "digests" in entry:
        claim["digests"] = entry["digests"]
    return claim or None


def _sort(path: Path, entry: Entry, legacy: bool) -> tuple[list[Path], list[Path]]:
    """``(mine, others)``: the files at ``path`` that ``entry`` proves gpt2 wrote, and the rest."""
    if os.path.islink(path):
        return [], [path]
    if path.is_dir():
        if "sha256" in entry:
            # A file was recorded; a folder is there now.
            return [], [path]
        mine: list[Path] = []
        others: list[Path] = []
        _sort_folder(path, "", entry, legacy and entry == LEGACY, mine, others)
        return mine, others
    if entry == LEGACY:
        ours = legacy and path.is_file()
    else:
        ours = _matches(path, entry) or ("digests" in entry and _vouched(path, entry["digests"]))
    if ours:
        return [path], []
    return [], [path]


def _sort_folder(
    folder: Path,
    prefix: str,
    entry: Entry,
    everything: bool,
    mine: list[Path],
    others: list[Path],
    vouched: dict[Path, str] | None = None,
) -> None:
    """Sort the files under ``folder`` (``prefix``: its path in the recorded folder) into ``mine``
    and ``others``, entering no link. ``everything``: every plain file is gpt2's (a trusted legacy folder).
    ``vouched``: the sha256 of files below, from the digest files of the folders above (a sharded checkpoint's
    ``SHA256SUMS`` lists ``shards/...``).
    """
    digests = entry.get("digests")
    sums, vouched = _folder_digests(folder, digests, vouched)
    with os.scandir(folder) as scan:
        items = sorted(scan, key=lambda item: item.name)
    for item in items:
        path = Path(item.path)
        if sums is not None and item.name == digests:
            # Judged below, once the files it lists are.
            continue
        if item.is_dir(follow_symlinks=False):
            _sort_folder(path, f"{prefix}{item.name}/", entry, everything, mine, others, vouched)
        elif item.is_file(follow_symlinks=False) and (everything or _listed(path, prefix + item.name, entry, vouched)):
            mine.append(path)
        else:
            # A link (never gpt2's), or a file gpt2 did not write or that changed since.
            others.append(path)
    if sums is None:
        return
    if {folder / name for name in sums if os.path.lexists(folder / name)} <= set(mine):
        mine.append(folder / digests)
    else:
        others.append(folder / digests)


def _folder_digests(
    folder: Path, digests: str | None, vouched: dict[Path, str] | None
) -> tuple[dict[str, str] | None, dict[Path, str]]:
    """The digest file ``digests`` of ``folder`` (None if there is none), and ``vouched`` with what it lists."""
    vouched = dict(vouched or {})
    sums = None
    if digests is not None:
        sums = _read_digests(folder / digests)
    if sums is not None:
        vouched.update({folder / name: sha256 for name, sha256 in sums.items()})
    return sums, vouched


def _listed(path: Path, rel: str, entry: Entry, vouched: dict[Path, str]) -> bool:
    """Whether the folder's ``files`` or a digest file beside or above ``path`` give its bytes."""
    identity = entry.get("files", {}).get(rel)
    if identity is not None and _matches(path, identity):
        return True
    return path in vouched and vouched[path] == _file_sha256(path)


def _vouched(path: Path, digests: str) -> bool:
    """Whether the digest file ``digests`` beside ``path`` (or one folder up, as a sharded checkpoint's lists its
    ``shards/...``) lists it with its sha256 (or ``path`` is that file, with everything it lists intact).
    """
    if path.name == digests:
        sums = _read_digests(path)
        if sums is None:
            return False
        present = [name for name in sums if os.path.lexists(path.parent / name)]
        return all(sums[name] == _file_sha256(path.parent / name) for name in present)
    for folder in (path.parent, path.parent.parent):
        sums = _read_digests(folder / digests)
        rel = path.relative_to(folder).as_posix()
        if sums is not None and rel in sums:
            return sums[rel] == _file_sha256(path)
    return False


def _read_digests(path: Path) -> dict[str, str] | None:
    """A plain file in ``sha256sum`` format as ``{name: sha256}``; None if it is not one."""
    if not path.is_file() or path.is_symlink():
        return None
    sums = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return None
    for line in filter(None, lines):
        match = _DIGEST_LINE.fullmatch(line)
        # a name, or a path below (a sharded checkpoint's shards/...)
        if match is None or not _is_relative_path(match[2]):
            return None
        sums[match[2]] = match[1]
    return sums


def _through_link(root: Path, path: Path) -> bool:
    """Whether ``path`` lies below ``root`` through a link (or something that is not a folder)."""
    for parent in path.relative_to(root).parents:
        here = root / parent
        if here != root and (here.is_symlink() or not here.is_dir()):
            return True
    return False


def _remove_emptied(path: Path, removed: list[Path]) -> None:
    """Remove the folders the files ``removed`` leave empty, deepest first, up to ``path`` itself."""
    if path.is_symlink() or not path.is_dir():
        return
    folders = {path} | {parent for file in removed for parent in file.parents if parent.is_relative_to(path)}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        # Still holding something (what is kept): it stays.
        with contextlib.suppress(OSError):
            folder.rmdir()


# --- identities


def _absolute(path: str | os.PathLike) -> Path:
    """``path`` made absolute without resolving links ("." has a parent then)."""
    return Path(os.path.abspath(path))


def _identity(path: Path) -> Entry:
    """What identifies a file gpt2 just wrote: its size and sha256."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidValueError(f"{path} is not a plain file: gpt2 records only the files it writes")
    return {"size": st.st_size, "sha256": _sha256(path, st.st_size)}


def _folder_entry(folder: Path, files: Iterable[str], digests: str | None) -> Entry:
    """A folder's entry: each of ``files`` (relative paths) with its identity, and ``digests``."""
    if folder.is_symlink() or not folder.is_dir():
        raise InvalidValueError(f"{folder} is not a folder gpt2 wrote into")
    entry: Entry = {"files": {}}
    for rel in files:
        if not _is_relative_path(rel) or _through_link(folder, folder / rel):
            raise InvalidValueError(f"{rel!r} is not a path inside {folder}")
        entry["files"][rel] = _identity(folder / rel)
    if digests is not None:
        if not _is_name(digests):
            raise InvalidValueError(f"digests must be a file name, got {digests!r}")
        entry["digests"] = digests
    return entry


def _matches(path: Path, identity: Entry) -> bool:
    """Whether ``path`` is a plain file holding the recorded bytes (``appends``: starting with them)."""
    if "sha256" not in identity:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    size = identity["size"]
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        return False
    if st.st_size > size and not identity.get("appends"):
        return False
    try:
        return _sha256(path, size) == identity["sha256"]
    except OSError:
        return False


def _file_sha256(path: Path) -> str | None:
    """The sha256 of a plain file (never through a link); None for anything else."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        return _sha256(path, st.st_size)
    except OSError:
        return None


def _sha256(path: Path, size: int) -> str:
    """The sha256 of the first ``size`` bytes of ``path``, opened without following a link."""
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
        while size > 0:
            chunk = f.read(min(_CHUNK_BYTES, size))
            if not chunk:
                break
            digest.update(chunk)
            size -= len(chunk)
    return digest.hexdigest()


# --- the record file


def _read(folder: Path) -> dict[str, Entry]:
    """The valid entries of ``folder``'s record ({} without one). A list of names (the older
    format) gives legacy entries; whatever is damaged is named in a warning and claims nothing.
    """
    path = folder / RECORD_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_damaged(path, f"it is not readable JSON: {e}")
        return {}
    if isinstance(data, list):
        pairs = [(name, LEGACY) for name in data]
    elif isinstance(data, dict):
        pairs = list(data.items())
    else:
        _warn_damaged(path, f"it holds a JSON {type(data).__name__}, not an object of names")
        return {}
    entries: dict[str, Entry] = {}
    bad = []
    for name, entry in pairs:
        if _is_name(name) and _is_entry(entry):
            entries[name] = entry
        else:
            bad.append(repr(name))
    if bad:
        _warn_damaged(path, f"its entries {', '.join(bad[:5])} are not valid")
    return entries


def _write(folder: Path, entries: dict[str, Entry]) -> None:
    """Replace ``folder``'s record atomically with ``entries``, less what is gone; none left: no record."""
    kept = {}
    for name, entry in entries.items():
        # A legacy name stays while absent: the run directory's older code lists names before writing them.
        if entry == LEGACY or os.path.lexists(folder / name):
            kept[name] = _without_missing(folder / name, entry)
    path = folder / RECORD_FILE
    if not kept:
        path.unlink(missing_ok=True)
        return
    text = json.dumps(kept, indent=1, sort_keys=True) + "\n"
    replace_atomically(path, lambda f: f.write(text.encode("utf-8")))


def _without_missing(path: Path, entry: Entry) -> Entry:
    """A folder's ``entry`` without the files that are gone."""
    if "files" not in entry:
        return entry
    files = {rel: identity for rel, identity in entry["files"].items() if os.path.lexists(path / rel)}
    return {**entry, "files": files}


_warned: set[tuple[str, str]] = set()


def _warn_damaged(path: Path, why: str) -> None:
    """Name a damaged record once per process and problem."""
    if (str(path), why) in _warned:
        return
    _warned.add((str(path), why))
    logger.warning(
        "%s is damaged (%s): gpt2 claims nothing there that it cannot read, so it replaces and deletes none of "
        "it; the record is rebuilt from its valid entries the next time gpt2 writes there",
        path,
        why,
    )


def _is_name(name: Any) -> bool:
    """A plain name inside one folder (no separator, not ``.``, ``..`` or the record itself)."""
    if not isinstance(name, str) or name in ("", ".", "..", RECORD_FILE):
        return False
    return "/" not in name and os.sep not in name and "\0" not in name


def _is_relative_path(rel: Any) -> bool:
    """A ``/``-separated path of plain names."""
    return isinstance(rel, str) and all(_is_name(part) for part in rel.split("/"))


def _is_identity(value: Any, extra: tuple[str, ...] = ()) -> bool:
    """``{"size": int >= 0, "sha256": 64 hex digits}`` (and the keys of ``extra``)."""
    if not isinstance(value, dict) or not set(value) <= {"size", "sha256", *extra}:
        return False
    size, digest = value.get("size"), value.get("sha256")
    return type(size) is int and size >= 0 and isinstance(digest, str) and _SHA256.fullmatch(digest) is not None


def _is_entry(entry: Any) -> bool:
    """One of the entry shapes of the module docstring."""
    if not isinstance(entry, dict) or not entry:
        return False
    if "legacy" in entry:
        return entry == LEGACY
    if "sha256" in entry:
        return _is_identity(entry, extra=("appends",)) and isinstance(entry.get("appends", False), bool)
    if not set(entry) <= {"files", "digests"}:
        return False
    files = entry.get("files", {})
    if not isinstance(files, dict) or not all(_is_relative_path(r) and _is_identity(i) for r, i in files.items()):
        return False
    return "digests" not in entry or _is_name(entry["digests"])
