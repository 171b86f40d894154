"""Token files on disk: ``.npy`` arrays and llm.c's headered ``.bin`` shards, read and checked.

``.bin`` is llm.c's shard layout (``dev/data/data_common.py: write_datafile``): 256 little-endian int32 (magic, version,
token count, zeros), then the tokens; magic 20240520 / version 1 holds GPT-2's ``uint16`` ids, 20240801 / version 7
``uint32`` ones. A ``.bin`` without a header is nanoGPT's raw ``uint16`` layout: it says nothing about its dtype, so it
is only accepted when it fits (an even size, and not the every-other-value-zero pattern of int32 ids). A folder written
by ``prepare`` is checked against gpt2's record there of the shards it wrote (:func:`recorded_shards`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpt2.errors import Gpt2Error, InvalidValueError, MissingFileError
from gpt2.files import replace_atomically
from gpt2.outputs import RECORD_FILE, OutputFolder

# File suffixes the loader understands (the CLI reads anything else as text to tokenise).
TOKEN_SUFFIXES = (".npy", ".bin")

BIN_HEADER_INTS = 256
BIN_HEADER_BYTES = BIN_HEADER_INTS * 4
# magic -> (version, token dtype), as in llm.c's HEADERS_INFO.
BIN_MAGIC_UINT16 = 20240520
BIN_MAGIC_UINT32 = 20240801
BIN_LAYOUTS = {BIN_MAGIC_UINT16: (1, np.dtype("<u2")), BIN_MAGIC_UINT32: (7, np.dtype("<u4"))}
# Neither magic can start a valid headerless GPT-2 file: read as uint16 its first value is
# 54264 (or 54945), above GPT-2's 50257 ids.

# How many leading uint16 values the int32 sniff looks at (128 KiB: cheap even when a directory
# holds hundreds of shards, and far more than the pattern needs to show).
_SNIFF_VALUES = 2**16


def _convert_hint(path: Path) -> str:
    stem = str(path.with_suffix(""))
    return (
        'convert it once with numpy, e.g. python -c "import numpy as np; '
        f"np.save('{stem}.npy', np.fromfile('{path}', dtype=np.int32))\" (use the dtype it was "
        "written with), or re-tokenise the text with `gpt2 prepare`"
    )


class ShardManifestError(Gpt2Error, ValueError):
    """A shard folder that does not match gpt2's record of it: a shard missing, extra, truncated or changed."""


# prepare keeps a shard changed since it wrote it, so that one is moved out by hand.
_PREPARE_AGAIN = (
    "move out a changed shard (prepare keeps it), then re-run `gpt2 prepare` (or write_shards / tokenize_file) with "
    "overwrite to write the data set again"
)


def manifest_mismatch(directory: Path, problem: str, advice: str = _PREPARE_AGAIN) -> ShardManifestError:
    return ShardManifestError(
        f"shard folder {str(directory)!r} does not match gpt2's record of it ({RECORD_FILE}): {problem}; {advice}"
    )


def token_files(directory: Path, split: str | None = None) -> list[Path]:
    """The token files (``.npy``/``.bin``, not hidden) in ``directory`` by name; of ``split`` (:func:`split_of`)."""
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and p.suffix.lower() in TOKEN_SUFFIXES and not p.name.startswith(".")
        if split is None or split_of(p.name, split) == split
    )


def split_of(name: str, split: str | None = None) -> str | None:
    """A shard name's last split word (``x_val_0.npy``, ``train0.bin``, ``validation-00000-of-00001``; ``train_val_*``
    is val, ``interval_*`` no val), else the one split it contains (``trainset.npy``); ``split``: one more word.
    """
    names = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test", split: split}
    words = [names[w] for w in re.findall(r"(?:^|[_.-])([a-z]+)(?=[_.\-0-9]|$)", name.lower()) if w in names]
    if words:
        return words[-1]
    loose = [s for s in ("train", "val", "test") if s in name.lower()]
    if len(loose) == 1:
        return loose[0]
    return None


def recorded_shards(directory: Path) -> dict[str, str] | None:
    """The sha256 of each token file gpt2's record in ``directory`` lists (:mod:`gpt2.outputs`), by name
    (``None``: it lists none). The cheap checks run on every call (the record is readable, each listed
    shard exists with its size, none is unlisted), raising :class:`ShardManifestError`.
    """
    entries = OutputFolder(directory).read()
    if entries is None:
        # prepare replaces only the shards the record proves are gpt2's: with it damaged, they go by hand first.
        advice = "move the shards out and delete the record, then re-run `gpt2 prepare` to write the data set again"
        raise manifest_mismatch(directory, f"{RECORD_FILE} is damaged", advice)
    shards = {
        name: entry
        for name, entry in entries.items()
        if "sha256" in entry and "/" not in name and Path(name).suffix.lower() in TOKEN_SUFFIXES
    }
    if not shards:
        return None
    for name, entry in shards.items():
        path = directory / name
        if not path.is_file():
            raise manifest_mismatch(directory, f"{name} is missing")
        if path.stat().st_size != entry["size"]:
            raise manifest_mismatch(
                directory,
                f"{name} has {path.stat().st_size} bytes, the record lists {entry['size']} (truncated or changed)",
            )
    unlisted = [p.name for p in token_files(directory) if p.name not in shards]
    if unlisted:
        raise manifest_mismatch(
            directory, f"{unlisted[0]} is not listed in it ({len(unlisted)} unlisted token file(s): move them out)"
        )
    return {name: entry["sha256"] for name, entry in shards.items()}


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file's contents; anything else raises ``ValueError`` naming the file and the
    byte offset of the first invalid byte (a binary file given as text, a Latin-1 file, ...).
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InvalidValueError(
            f"{str(path)!r} is not UTF-8 text: byte offset {e.start} (line {line}) holds "
            f"{data[e.start : e.start + 4]!r} ({e.reason}). Convert the text to UTF-8 (e.g. "
            "iconv -f latin1 -t utf-8), or if it holds token ids give it a .npy/.bin suffix"
        ) from None


def iter_jsonl(path: str | os.PathLike, *, hint: str = "") -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for each non-blank line of a JSON-lines file; a malformed line (or one that is not
    UTF-8) raises ``ValueError`` naming the file and line (``hint`` is appended to that message).
    """
    # The byte offset of the line, for the UTF-8 error.
    offset = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidValueError(
                    f"{path}:{line_no}: not UTF-8 text (byte offset {offset + e.start} in the file "
                    f"holds {raw[e.start : e.start + 4]!r}){hint}"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidValueError(f"{path}:{line_no}: not valid JSON ({e.msg}){hint}") from e


def write_tokens(path: str | os.PathLike, tokens: Any) -> Path:
    """Write 1-D token ids atomically: ``.npy`` a ``uint16`` array, ``.bin`` llm.c's layout
    (``uint16``, which llm.c's GPT-2 trainer reads, when every id fits, else ``uint32``).
    """
    path = Path(path)
    array = np.asarray(tokens)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidValueError(f"tokens must be a 1-D integer array, got {array.dtype} {array.shape}")
    if array.size == 0:
        raise InvalidValueError(f"no tokens to write to {str(path)!r} (a token file must not be empty)")
    if int(array.min()) < 0:
        raise InvalidValueError(f"token ids must be >= 0, got {int(array.min())} (writing {str(path)!r})")
    writers = {".npy": _write_npy, ".bin": _write_bin}
    if path.suffix.lower() not in writers:
        raise InvalidValueError(f"token files end in .npy or .bin, got {str(path)!r}")
    writers[path.suffix.lower()](path, array)
    return path


def _write_npy(path: Path, array: np.ndarray) -> None:
    if int(array.max()) >= 2**16:
        raise InvalidValueError(
            f"token id {int(array.max())} does not fit a uint16 .npy shard ({str(path)!r}); "
            "write a .bin shard, which holds uint32 ids"
        )
    data = array.astype(np.uint16, copy=False)
    replace_atomically(path, lambda f: np.save(f, data, allow_pickle=False))


def _write_bin(path: Path, array: np.ndarray) -> None:
    if len(array) >= 2**31:
        raise InvalidValueError(f"{len(array)} tokens do not fit one .bin shard (at most 2**31 - 1)")
    magic = BIN_MAGIC_UINT16 if int(array.max()) < 2**16 else BIN_MAGIC_UINT32
    version, dtype = BIN_LAYOUTS[magic]
    header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, len(array)
    data = array.astype(dtype, copy=False)

    def write(f) -> None:
        f.write(header.tobytes())
        f.write(data.tobytes())

    replace_atomically(path, write)


def load_tokens(path: str | os.PathLike, *, mmap: bool = True, vocab_size: int | None = None) -> np.ndarray:
    """Read a 1-D token file (``.npy``, llm.c's ``.bin``, or nanoGPT's headerless ``uint16`` ``.bin``).

    ``mmap=True`` memory-maps it, so opening a 100M-token shard costs nothing until its pages are
    read. With ``vocab_size`` every id is checked to be below it. Files that are empty, damaged
    or ambiguous raise ``ValueError`` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"token file {str(path)!r} does not exist (or is not a file)")
    readers = {".npy": _load_npy, ".bin": _load_bin}
    if path.suffix.lower() not in readers:
        raise InvalidValueError(f"unsupported token file {str(path)!r}: expected a .npy array or a .bin token file")
    tokens = readers[path.suffix.lower()](path, mmap)
    if len(tokens) == 0:
        raise InvalidValueError(
            f"token file {str(path)!r} holds no tokens; re-create it (e.g. with `gpt2 prepare`) or remove it"
        )
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, f"token file {str(path)!r}")
    return tokens


def _load_npy(path: Path, mmap: bool) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        # Not a .npy file, a truncated one, or an object array (which needs pickle).
        raise InvalidValueError(
            f"could not read token file {str(path)!r} as a .npy array (damaged, truncated or "
            f"not a .npy file: {e}); re-create it, e.g. with `gpt2 prepare`"
        ) from e
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidValueError(
            f"token file {str(path)!r} holds an array of shape {tokens.shape} and dtype {tokens.dtype}; expected a "
            "1-D array of integer token ids (e.g. np.save(path, ids.astype(np.uint16).reshape(-1)))"
        )
    return tokens


def _load_bin(path: Path, mmap: bool) -> np.ndarray:
    size = path.stat().st_size
    if size == 0:
        raise InvalidValueError(f"token file {str(path)!r} is empty (0 bytes); re-create it or remove it")
    head = np.fromfile(path, dtype="<i4", count=min(size // 4, BIN_HEADER_INTS))
    if len(head) and int(head[0]) in BIN_LAYOUTS:
        dtype, count, offset = _check_bin_header(path, size, head)
    else:
        _check_headerless_bin(path, size, head)
        dtype, count, offset = np.dtype("<u2"), size // 2, 0
    if mmap:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    return np.fromfile(path, dtype=dtype, count=count, offset=offset)


def _check_bin_header(path: Path, size: int, head: np.ndarray) -> tuple[np.dtype, int, int]:
    """``(dtype, count, offset)`` of the tokens after a header with a known magic, checked."""
    magic = int(head[0])
    version, dtype = BIN_LAYOUTS[magic]
    if len(head) < BIN_HEADER_INTS:
        raise InvalidValueError(
            f"token file {str(path)!r} starts with llm.c's magic {magic} but has {size} bytes, "
            f"less than the {BIN_HEADER_BYTES}-byte header: it is truncated; re-create it"
        )
    if int(head[1]) != version:
        raise InvalidValueError(
            f"token file {str(path)!r} has llm.c magic {magic} with version {int(head[1])}; only "
            f"version {version} is known for that magic ({dtype.name} tokens). Re-create it with "
            "`gpt2 prepare` or a matching llm.c dev/data script"
        )
    count = int(head[2])
    expected = BIN_HEADER_BYTES + count * dtype.itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise InvalidValueError(
            f"token file {str(path)!r} is {what}: its header says {count} {dtype.name} tokens "
            f"({expected} bytes with the header) but the file has {size} bytes; re-create it"
        )
    return dtype, count, BIN_HEADER_BYTES


def _check_headerless_bin(path: Path, size: int, head: np.ndarray) -> None:
    """Refuse a headerless .bin that is not plausibly raw uint16 ids."""
    if size % 2:
        raise InvalidValueError(
            f"token file {str(path)!r} has {size} bytes, an odd number, and no llm.c header: a "
            "headerless .bin must hold uint16 ids (2 bytes each, nanoGPT's prepare.py layout); " + _convert_hint(path)
        )
    # An llm.c-style header with a magic we do not know: zeros after [2], a count that fits.
    header_like = len(head) == BIN_HEADER_INTS and not head[3:].any() and head[2] > 0
    if header_like and size - BIN_HEADER_BYTES in (int(head[2]) * 2, int(head[2]) * 4):
        raise InvalidValueError(
            f"token file {str(path)!r} starts with an llm.c-style header whose magic "
            f"{int(head[0])} is neither {BIN_MAGIC_UINT16} (uint16 tokens) nor "
            f"{BIN_MAGIC_UINT32} (uint32 tokens); re-create it with `gpt2 prepare`"
        )
    sample = np.fromfile(path, dtype="<u2", count=min(size // 2, _SNIFF_VALUES))
    # int32 (or int64) ids below 65536 read as uint16 leave every second value zero; real text
    # never tokenises to that pattern.
    if len(sample) >= 8 and not sample[1::2].any() and sample[0::2].any():
        raise InvalidValueError(
            f"token file {str(path)!r} has no llm.c header and looks like int32 token ids (every "
            "other uint16 value is 0), which would be read as uint16 with zeros between the ids; " + _convert_hint(path)
        )


def check_token_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` and the id when an id is < 0 or >= ``vocab_size``."""
    if np.issubdtype(tokens.dtype, np.signedinteger):
        low = int(tokens.min())
        if low < 0:
            raise InvalidValueError(f"{where} holds token id {low}; token ids must be >= 0")
    high = int(tokens.max())
    if high >= vocab_size:
        # Searched for only on the error path.
        position = int(np.argmax(np.asarray(tokens) >= vocab_size))
        raise InvalidValueError(
            f"{where} holds token id {high} (the first id out of range is at position {position}), "
            f"but the model's vocabulary has {vocab_size} ids (0..{vocab_size - 1}): tokenise the "
            "data with the model's tokenizer, or use a model with a larger vocab_size"
        )
