"""Token data: Tiny Shakespeare, uint16 token shards on disk, and a rank-aware batch loader.

The on-disk layout is build-nanogpt's FineWeb-edu one: a directory of 1-D ``uint16`` ``.npy``
shards named ``{prefix}_{split}_{index:06d}.npy``, the first shard (index 0) being ``val``.
GPT-2's vocabulary (50257 ids) fits in ``uint16`` (max 65535), which halves the disk and page
cache footprint compared with ``int32``.

:class:`TokenLoader` reads those shards (or an in-memory array) the way build-nanogpt's
``DataLoaderLite`` does, with a position that can be saved and restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import operator
import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

__all__ = [
    "TINY_SHAKESPEARE_URL",
    "DownloadError",
    "TokenLoader",
    "default_cache_dir",
    "load_tiny_shakespeare",
    "load_tokens",
    "shard_name",
    "tiny_shakespeare_path",
    "tokenize_file",
    "write_shards",
]

TokenSource = Union[torch.Tensor, np.ndarray, str, os.PathLike]

# File suffixes the loader understands: build-nanogpt's .npy shards and nanoGPT's raw .bin.
_TOKEN_SUFFIXES = (".npy", ".bin")


# ------------------------------------------------------------------------------------------
# Tiny Shakespeare
# ------------------------------------------------------------------------------------------

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
# sha256 of the 1,115,394-byte file, so that a truncated download or an HTML error page is
# never cached as the corpus.
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
_DOWNLOAD_TIMEOUT_S = 60


class DownloadError(ConnectionError):
    """A data file could not be downloaded (no network, bad response, checksum mismatch)."""


def default_cache_dir() -> Path:
    """``$GPT2_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpt2``, else ``~/.cache/gpt2``."""
    if os.environ.get("GPT2_CACHE_DIR"):
        return Path(os.environ["GPT2_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gpt2"


def tiny_shakespeare_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the Tiny Shakespeare text (1.1 MB), downloading and caching it on first use.

    In order: the file named by ``$GPT2_TINY_SHAKESPEARE``; a cached copy
    ``tinyshakespeare.txt`` under ``cache_dir`` (default :func:`default_cache_dir`); else a
    download from :data:`TINY_SHAKESPEARE_URL`, checked against its sha256 and written
    atomically, so an interrupted download never leaves a partial file in the cache.
    """
    override = os.environ.get("GPT2_TINY_SHAKESPEARE")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"GPT2_TINY_SHAKESPEARE={override!r} is not a file; point it at the Tiny "
                "Shakespeare text (e.g. ../shared/data/tinyshakespeare.txt) or unset it to "
                "download and cache the file"
            )
        return path
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cache / "tinyshakespeare.txt"
    if path.is_file():
        return path
    download(
        TINY_SHAKESPEARE_URL,
        path,
        sha256=TINY_SHAKESPEARE_SHA256,
        what="Tiny Shakespeare",
        offline_hint="set GPT2_TINY_SHAKESPEARE=/path/to/tinyshakespeare.txt, pass the "
        "file's path (load_tiny_shakespeare(path=...), tokenize_file(path, ...)), or copy it to",
    )
    return path


def load_tiny_shakespeare(
    path: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None
) -> str:
    """The Tiny Shakespeare text: from ``path`` if given, else :func:`tiny_shakespeare_path`."""
    path = Path(path) if path is not None else tiny_shakespeare_path(cache_dir)
    return path.read_text(encoding="utf-8")


def download(
    url: str,
    dest: Path,
    *,
    what: str,
    offline_hint: str,
    sha256: str | None = None,
    validate: Callable[[bytes], None] | None = None,
) -> None:
    """Fetch ``url`` into ``dest`` atomically, or raise :class:`DownloadError` saying how to
    work offline (``offline_hint`` is followed by ``dest``). The bytes are checked against
    ``sha256`` and/or by ``validate`` (which raises ``ValueError``) before anything is cached,
    so a truncated download or an HTML error page never lands in the cache."""

    def fail(reason: str) -> DownloadError:
        return DownloadError(
            f"could not download {what} from {url}: {reason}. "
            f"To work offline, {offline_hint} {str(dest)!r}."
        )

    logger.info("downloading %s from %s to %s", what, url, dest)
    try:
        with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    # URLError, HTTPError and timeouts are OSErrors; ValueError covers a malformed URL.
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise fail(f"{type(e).__name__}: {e}") from e
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise fail(f"the {len(data)} bytes received do not have the expected sha256 {sha256}")
    if validate is not None:
        try:
            validate(data)
        except ValueError as e:
            raise fail(f"the response is not {what} ({e})") from e
    dest.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomically(dest, lambda f: f.write(data))


def iter_jsonl(path: str | os.PathLike, *, hint: str = "") -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for each non-blank line of a JSON-lines file; a malformed line
    raises ``ValueError`` naming the file and line (``hint`` is appended to that message)."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}){hint}") from e


def _replace_atomically(dest: Path, write) -> None:
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


# ------------------------------------------------------------------------------------------
# Writing token shards
# ------------------------------------------------------------------------------------------

# uint16 holds ids 0..65535; GPT-2's 50257 ids fit, a bigger vocabulary does not.
_UINT16_LIMIT = 2**16


def shard_name(prefix: str, split: str, index: int) -> str:
    """build-nanogpt's shard file name, e.g. ``edufineweb_train_000001.npy``."""
    return f"{prefix}_{split}_{index:06d}.npy"


def _to_uint16(ids: Any, where: str) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= _UINT16_LIMIT):
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise ValueError(
            f"token id {bad} in {where} does not fit uint16 (0..{_UINT16_LIMIT - 1}); uint16 "
            "shards only hold vocabularies of up to 65536 ids, such as GPT-2's 50257"
        )
    return array.astype(np.uint16)


def _encode_document(doc: Any, tokenizer: Any) -> np.ndarray:
    """``<|endoftext|>`` then the document's ids, as uint16 (build-nanogpt's ``tokenize``).

    The end-of-text token *before* each document lets the model learn where documents start,
    and separates them in the concatenated stream.
    """
    if not isinstance(doc, str):
        raise TypeError(
            f"documents must be str, got {type(doc).__name__}; for dataset rows pass the text "
            "field, e.g. (row['text'] for row in dataset)"
        )
    ids = [tokenizer.eot_token]
    ids.extend(tokenizer.encode_ordinary(doc))
    return _to_uint16(ids, f"a document starting {doc[:40]!r}")


_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_document_in_worker(doc: Any) -> np.ndarray:
    return _encode_document(doc, _worker_tokenizer)


class _ShardWriter:
    """Writes numbered shards atomically; the index runs across splits, as in build-nanogpt."""

    def __init__(self, out_dir: str | os.PathLike, prefix: Any, shard_size: Any, overwrite: bool):
        if (
            not isinstance(prefix, str)
            or not prefix
            or os.sep in prefix
            or (os.altsep and os.altsep in prefix)
        ):
            raise ValueError(
                f"prefix must be a non-empty file-name prefix such as 'edufineweb', got {prefix!r}"
            )
        self.prefix = prefix
        self.shard_size = _positive_int(shard_size, "shard_size")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.existing = sorted(
            p
            for split in ("val", "train")
            for p in self.out_dir.glob(f"{_glob_escape(prefix)}_{split}_*.npy")
        )
        if self.existing and not overwrite:
            raise FileExistsError(
                f"{str(self.out_dir)!r} already holds {len(self.existing)} shard(s) with prefix "
                f"{prefix!r} (e.g. {self.existing[0].name}); pass overwrite=True to replace them, "
                "or choose another directory or prefix (mixing old and new shards would corrupt "
                "the data set)"
            )
        self.index = 0
        self.written: list[Path] = []

    def write(self, tokens: np.ndarray, split: str) -> Path:
        path = self.out_dir / shard_name(self.prefix, split, self.index)
        _replace_atomically(path, lambda f: np.save(f, tokens, allow_pickle=False))
        logger.info("wrote %s (%d tokens)", path, len(tokens))
        self.written.append(path)
        self.index += 1
        return path

    def finish(self) -> list[Path]:
        # Shards of an earlier, longer run that this run did not overwrite would otherwise be
        # read as part of the new data set.
        for stale in set(self.existing) - set(self.written):
            stale.unlink()
        return self.written


def _glob_escape(text: str) -> str:
    """Make ``text`` match itself literally in a glob pattern."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def write_shards(
    docs: Iterable[str],
    out_dir: str | os.PathLike,
    *,
    prefix: str,
    shard_size: int = 10**8,
    tokenizer: Any = None,
    num_workers: int = 0,
    progress: bool = True,
    overwrite: bool = False,
) -> list[Path]:
    """Tokenise documents into uint16 ``.npy`` shards in build-nanogpt's FineWeb-edu layout.

    Each document is prefixed with ``<|endoftext|>``; the token stream is cut into shards of
    exactly ``shard_size`` tokens (the last one shorter). The first shard is the validation
    set, ``{prefix}_val_000000.npy``, the others ``{prefix}_train_{index:06d}.npy`` with the
    index counting on (``..._train_000001.npy``, ...). ``shard_size`` defaults to
    build-nanogpt's 100M tokens (200 MB per shard).

    ``tokenizer`` defaults to :func:`gpt2.tokenizer.get_tokenizer`; any object with
    ``encode_ordinary`` and ``eot_token`` works. ``num_workers > 0`` tokenises in a
    process pool; the shards are the same either way. Each shard is written atomically.
    Existing shards with the same prefix raise :class:`FileExistsError` unless
    ``overwrite=True``. Returns the shard paths in order.
    """
    writer = _ShardWriter(out_dir, prefix, shard_size, overwrite)
    num_workers = _int(num_workers, "num_workers")
    if num_workers < 0:
        raise ValueError(
            f"num_workers must be >= 0 (0 tokenises in this process), got {num_workers}"
        )
    if tokenizer is None:
        from .tokenizer import get_tokenizer

        tokenizer = get_tokenizer()
    if isinstance(docs, str):
        raise TypeError("docs must be an iterable of documents, got a single str; wrap it: [text]")

    size = writer.shard_size
    buffer = np.empty(size, dtype=np.uint16)
    filled = 0
    bar = tqdm(unit="tok", unit_scale=True, desc=f"{prefix} shard 0", disable=not progress)
    pool = (
        multiprocessing.Pool(num_workers, _init_worker, (tokenizer,)) if num_workers > 0 else None
    )
    try:
        if pool is not None:
            # chunksize amortises inter-process traffic over many (usually short) documents.
            encoded = pool.imap(_encode_document_in_worker, docs, chunksize=16)
        else:
            encoded = (_encode_document(doc, tokenizer) for doc in docs)
        for tokens in encoded:
            bar.update(len(tokens))
            start = 0
            while start < len(tokens):
                take = min(size - filled, len(tokens) - start)
                buffer[filled : filled + take] = tokens[start : start + take]
                filled += take
                start += take
                if filled == size:
                    writer.write(buffer, "val" if writer.index == 0 else "train")
                    filled = 0
                    bar.set_description(f"{prefix} shard {writer.index}")
        if filled:
            writer.write(buffer[:filled], "val" if writer.index == 0 else "train")
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    if not writer.written:
        raise ValueError("write_shards got no documents; docs was empty")
    return writer.finish()


def tokenize_file(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    prefix: str | None = None,
    shard_size: int = 10**8,
    val_fraction: float = 0.1,
    tokenizer: Any = None,
    progress: bool = True,
    overwrite: bool = False,
) -> list[Path]:
    """Tokenise one text file (e.g. Tiny Shakespeare) into uint16 shards, split by token count.

    The text is one document (``<|endoftext|>`` then its ids); its last ``val_fraction`` of
    tokens becomes ``{prefix}_val_000000.npy`` (more val shards if it exceeds
    ``shard_size``), the rest ``{prefix}_train_{index:06d}.npy`` shards, the index counting on
    across splits as in :func:`write_shards`. The validation part is the end of the text, as
    in nanoGPT's ``prepare.py``, so no passage is both trained on and validated on.
    ``prefix`` defaults to the file's stem. The file is read into memory: for a corpus of many
    documents stream them through :func:`write_shards` instead. Returns the shard paths.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist")
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, (int, float))
        or not 0 <= val_fraction < 1
    ):
        raise ValueError(
            "val_fraction must be a number in [0, 1), e.g. 0.1 for the last 10%, "
            f"got {val_fraction!r}"
        )
    writer = _ShardWriter(
        out_dir, prefix if prefix is not None else path.stem, shard_size, overwrite
    )
    if tokenizer is None:
        from .tokenizer import get_tokenizer

        tokenizer = get_tokenizer()

    text = path.read_text(encoding="utf-8")
    tokens = _encode_document(text, tokenizer)
    n_val = round(len(tokens) * val_fraction)
    if val_fraction > 0 and not 0 < n_val < len(tokens):
        raise ValueError(
            f"{str(path)!r} has only {len(tokens)} tokens, too few to split with "
            f"val_fraction={val_fraction}: use a longer text or val_fraction=0"
        )
    val, train = tokens[len(tokens) - n_val :], tokens[: len(tokens) - n_val]
    size = writer.shard_size
    chunks = [(val[i : i + size], "val") for i in range(0, len(val), size)]
    chunks += [(train[i : i + size], "train") for i in range(0, len(train), size)]
    for chunk, split in tqdm(
        chunks, desc=f"writing {writer.prefix} shards", unit="shard", disable=not progress
    ):
        writer.write(chunk, split)
    return writer.finish()


# ------------------------------------------------------------------------------------------
# Reading token files
# ------------------------------------------------------------------------------------------


def load_tokens(path: str | os.PathLike, *, mmap: bool = True) -> np.ndarray:
    """Read a 1-D token file: an ``.npy`` array of integers or a raw ``uint16`` ``.bin`` file.

    With ``mmap=True`` (the default) the file is memory-mapped, so opening a 100M-token shard
    costs nothing until its pages are read; pass ``mmap=False`` to read it into memory.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist (or is not a file)")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"could not read token file {str(path)!r} as a .npy array: {e}") from e
    elif suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise ValueError(
                f"token file {str(path)!r} has {size} bytes, an odd number: a raw .bin token "
                "file must hold uint16 ids (2 bytes each), as nanoGPT's prepare.py writes them"
            )
        if size == 0:
            # np.memmap refuses empty files; an empty array gives the caller a clearer error.
            return np.zeros(0, dtype=np.uint16)
        tokens = (
            np.memmap(path, dtype=np.uint16, mode="r") if mmap else np.fromfile(path, np.uint16)
        )
    else:
        raise ValueError(
            f"unsupported token file {str(path)!r}: expected a .npy array or a raw uint16 .bin file"
        )
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"token file {str(path)!r} holds an array of shape {tokens.shape} and dtype "
            f"{tokens.dtype}; expected a 1-D array of integer token ids"
        )
    return tokens


def _as_token_array(source: torch.Tensor | np.ndarray) -> np.ndarray:
    """A 1-D integer numpy view of an in-memory token sequence (no copy for CPU tensors)."""
    if isinstance(source, torch.Tensor):
        if source.is_floating_point() or source.is_complex() or source.dtype == torch.bool:
            raise TypeError(
                f"token tensor has dtype {source.dtype}; expected integer token ids "
                "(e.g. torch.long or torch.uint16)"
            )
        array = source.detach().cpu()
        if array.dtype in (torch.uint16, torch.uint32, torch.uint64):
            # numpy() does not support these on every torch version; widen to int64.
            array = array.to(torch.int64)
        array = array.numpy()
    else:
        array = np.asarray(source)
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(
                f"token array has dtype {array.dtype}; expected integer token ids (e.g. uint16)"
            )
    if array.ndim != 1:
        raise ValueError(
            f"token array has shape {tuple(array.shape)}; expected a 1-D sequence of token ids "
            "(flatten it first, e.g. tokens.reshape(-1))"
        )
    if array.size and np.issubdtype(array.dtype, np.signedinteger) and int(array.min()) < 0:
        raise ValueError(f"token array holds a negative id ({int(array.min())}); ids must be >= 0")
    return array


# ------------------------------------------------------------------------------------------
# The batch loader
# ------------------------------------------------------------------------------------------


class _Shard:
    """One token sequence: an in-memory array, or a file opened lazily (memory-mapped)."""

    __slots__ = ("name", "path", "array", "length")

    def __init__(self, name: str, *, path: Path | None = None, array: np.ndarray | None = None):
        self.name = name
        self.path = path
        self.array = array
        # Opening an .npy memory map only reads its header, so measuring every shard up front is
        # cheap and lets the constructor reject a too-short shard before training starts.
        self.length = len(array) if array is not None else len(load_tokens(path))

    def open(self) -> np.ndarray:
        return self.array if self.array is not None else load_tokens(self.path)


class TokenLoader:
    """Batches ``(x, y)`` of shape ``(B, T)`` from a token stream, split across DDP ranks.

    ``source`` is a 1-D tensor or array of token ids, a token file (``.npy`` as written by
    :func:`write_shards`, or a raw ``uint16`` ``.bin``), or a directory of shards (only the file
    names containing ``split`` when it is given, sorted by name).

    The reading order is build-nanogpt's ``DataLoaderLite``: one step of all ranks reads the
    ``B*T*world_size + 1`` tokens starting at ``position`` of the current shard, rank ``r`` the
    ``B*T + 1`` of them starting at ``position + r*B*T``; ``position`` then advances by
    ``B*T*world_size``, and when the next step would run past the shard's end the loader moves
    to the next shard (wrapping around to the first) at position 0. So one rank with batch
    ``2B`` reads exactly the rows two ranks with batch ``B`` read, and ``position`` is the same
    on every rank: :meth:`state_dict` is rank-independent.

    Shards are memory-mapped and only the slice a batch needs is converted to ``int64``.
    """

    def __init__(
        self,
        source: TokenSource,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        split: str | None = None,
    ):
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.seq_len = _positive_int(seq_len, "seq_len")
        self.world_size = _positive_int(world_size, "world_size")
        self.rank = _int(rank, "rank")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} is outside [0, world_size={self.world_size}); pass the "
                "process's rank from torch.distributed (or the RANK environment variable)"
            )
        if split is not None and (not isinstance(split, str) or not split):
            raise ValueError(
                f"split must be a non-empty string such as 'train' or 'val', got {split!r}"
            )
        self.split = split
        self._source_desc, self._shards = self._resolve(source, split)

        needed = self.tokens_per_step + 1
        for shard in self._shards:
            if shard.length < needed:
                raise ValueError(
                    f"{shard.name} has {shard.length} tokens, but one step needs {needed} "
                    f"(batch_size {self.batch_size} x seq_len {self.seq_len} x world_size "
                    f"{self.world_size} + 1 for the shifted targets); use a smaller batch_size or "
                    "seq_len, or more data per shard"
                )
        self._shard_index = 0
        self._position = 0
        self._tokens: np.ndarray | None = None  # the current shard, opened lazily

    # -- source resolution -------------------------------------------------------------------

    @staticmethod
    def _resolve(source: TokenSource, split: str | None) -> tuple[str, list[_Shard]]:
        if isinstance(source, (torch.Tensor, np.ndarray)):
            if split is not None:
                raise ValueError(
                    f"split={split!r} only selects files from a directory of shards; an in-memory "
                    "token array has no splits, so pass split=None (or the split's own array)"
                )
            array = _as_token_array(source)
            return f"<array of {len(array)} tokens>", [_Shard("the token array", array=array)]
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(
                "source must be a 1-D tensor/array of token ids, a token file (.npy/.bin) or a "
                f"directory of shards; got {type(source).__name__}"
            )
        path = Path(source)
        if path.is_dir():
            files = sorted(
                p
                for p in path.iterdir()
                if p.is_file()
                and p.suffix.lower() in _TOKEN_SUFFIXES
                and not p.name.startswith(".")
            )
            if split is not None:
                files = [p for p in files if split in p.name]
            if not files:
                what = (
                    "token files (.npy/.bin)"
                    if split is None
                    else f"token files with {split!r} in their name"
                )
                raise FileNotFoundError(
                    f"no {what} in directory {str(path)!r}; write shards with "
                    "gpt2.data.write_shards or tokenize_file, or check the path and split"
                )
            return str(path), [_Shard(f"shard {str(p)!r}", path=p) for p in files]
        if path.is_file():
            if split is not None and split not in path.name:
                raise ValueError(
                    f"split={split!r} does not match token file {str(path)!r} (its name does not "
                    f"contain {split!r}); pass the directory of shards, the right file, or "
                    "split=None"
                )
            return str(path), [_Shard(f"token file {str(path)!r}", path=path)]
        raise FileNotFoundError(f"token source {str(path)!r} does not exist")

    # -- properties --------------------------------------------------------------------------

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step of all ranks consumes: ``batch_size * seq_len * world_size``."""
        return self.batch_size * self.seq_len * self.world_size

    @property
    def num_tokens(self) -> int:
        """Total tokens in the source, over all shards."""
        return sum(shard.length for shard in self._shards)

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def shard(self) -> int:
        """Index of the shard the next batch is read from."""
        return self._shard_index

    @property
    def position(self) -> int:
        """Offset in the current shard of the next step's first token (the same on every rank)."""
        return self._position

    # -- reading -----------------------------------------------------------------------------

    def _current(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = self._shards[self._shard_index].open()
        return self._tokens

    def _set_shard(self, index: int) -> None:
        if index != self._shard_index:
            self._tokens = None  # drop the old memory map; the new shard opens on first read
        self._shard_index = index

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``: int64 CPU tensors of shape (B, T); ``y`` is ``x`` shifted by one."""
        B, T = self.batch_size, self.seq_len
        start = self._position + self.rank * B * T
        # Only this slice is copied out of the memory map and widened to int64.
        buf = torch.from_numpy(np.array(self._current()[start : start + B * T + 1], dtype=np.int64))
        x = buf[:-1].view(B, T)  # (B, T)
        # y gets its own storage so that editing x in place (e.g. masking) never changes y.
        y = buf[1:].clone().view(B, T)  # (B, T)

        self._position += self.tokens_per_step
        if self._position + self.tokens_per_step + 1 > self._shards[self._shard_index].length:
            self._set_shard((self._shard_index + 1) % len(self._shards))
            self._position = 0
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches forever (the stream wraps around); stop with ``itertools.islice`` or a break."""
        while True:
            yield self.next_batch()

    def reset(self) -> None:
        """Back to the first shard, position 0."""
        self._set_shard(0)
        self._position = 0

    # -- saving and restoring the position ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position as JSON-serialisable ints: ``{"shard", "position", "num_shards"}``."""
        return {
            "shard": self._shard_index,
            "position": self._position,
            "num_shards": len(self._shards),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where :meth:`state_dict` was taken (also after a JSON round trip).

        ``num_shards`` is optional; when present it must match this loader's source.
        """
        if not isinstance(state, dict) or "shard" not in state or "position" not in state:
            raise ValueError(
                "loader state must be a dict with 'shard' and 'position' (from state_dict()), "
                f"got {state!r}"
            )
        shard = _int(state["shard"], "state['shard']")
        position = _int(state["position"], "state['position']")
        if "num_shards" in state and state["num_shards"] != len(self._shards):
            raise ValueError(
                f"loader state was saved over {state['num_shards']} shard(s) but this loader's "
                f"source {self._source_desc} has {len(self._shards)}; resume with the same data "
                "(and split)"
            )
        if not 0 <= shard < len(self._shards):
            raise ValueError(
                f"loader state shard={shard} is out of range: the source {self._source_desc} has "
                f"{len(self._shards)} shard(s) (valid: 0..{len(self._shards) - 1})"
            )
        length = self._shards[shard].length
        if position < 0 or position + self.tokens_per_step + 1 > length:
            raise ValueError(
                f"loader state position={position} does not fit {self._shards[shard].name}: it has "
                f"{length} tokens and one step needs {self.tokens_per_step + 1} from the position "
                "on; was the state saved with other data, batch_size, seq_len or world_size?"
            )
        self._set_shard(shard)
        self._position = position

    def __repr__(self) -> str:
        split = f", split={self.split!r}" if self.split is not None else ""
        return (
            f"{type(self).__name__}(source={self._source_desc!r}{split}, "
            f"shards={len(self._shards)}, "
            f"num_tokens={self.num_tokens}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"rank={self.rank}, world_size={self.world_size}, shard={self._shard_index}, "
            f"position={self._position})"
        )


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})") from None


def _positive_int(value: Any, name: str) -> int:
    value = _int(value, name)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
