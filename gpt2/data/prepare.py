"""Tokenising text into build-nanogpt's FineWeb-edu layout: 1-D ``uint16`` shards named
``{prefix}_{split}_{index:06d}.npy`` (or llm.c's ``.bin``), the first one ``val``. GPT-2's 50257
ids fit ``uint16``, half the disk and page cache of ``int32``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from gpt2.data.formats import read_text, token_files, write_tokens
from gpt2.errors import Gpt2Error, InvalidValueError
from gpt2.files import Lock, Stopped, StopSignals, progress_enabled, replace_atomically, write_advice
from gpt2.model.config import NON_NEGATIVE_INT, POSITIVE_INT, PROBABILITY, check_value
from gpt2.model.tokenizer import get_tokenizer
from gpt2.outputs import RECORD_FILE, OutputFolder

logger = logging.getLogger(__name__)

# uint16 holds ids 0..65535; GPT-2's 50257 ids fit, a bigger vocabulary does not.
_UINT16_LIMIT = 2**16
_FORMATS = ("npy", "bin")
# A long text is encoded in pieces of about this many characters (one piece's list of ids at a time,
# and steps for tokenize_file's progress bar); bars appear only once a job has run this many seconds,
# so quick jobs print nothing.
_TEXT_CHUNK_CHARS = 1 << 20
_BAR_DELAY_S = 1.0


def _bar(progress: bool, iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A progress bar that appears once its job has run :data:`_BAR_DELAY_S` (only where ``progress_enabled``)."""
    return tqdm(iterable, delay=_BAR_DELAY_S, disable=not progress_enabled(progress), **kwargs)


def _text_pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut just before a newline
    that sits between two non-space characters. GPT-2's pre-tokeniser always splits there (no
    pattern joins a newline to the word before it, and a lone newline before a word is its
    own piece), so encoding the pieces gives exactly the ids of encoding the whole text.
    """
    start = 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and (cut + 1 >= len(text) or text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def encode_document(doc: Any, tokenizer: Any, bar: Any = None) -> np.ndarray:
    """``<|endoftext|>`` then the document's ids, as uint16 (build-nanogpt's ``tokenize``): the
    token *before* each document marks where documents start in the concatenated stream. A long
    text is encoded in pieces (:func:`_text_pieces`: the same ids, without one huge list of ints),
    each counted on ``bar`` (a tqdm of characters) when one is given.
    """
    if not isinstance(doc, str):
        raise TypeError(
            f"documents must be str, got {type(doc).__name__}; for dataset rows pass the text "
            "field, e.g. (row['text'] for row in dataset)"
        )
    parts = [np.asarray([tokenizer.eot_token], dtype=np.int64)]
    for piece in _text_pieces(doc, _TEXT_CHUNK_CHARS):
        parts.append(np.asarray(tokenizer.encode_ordinary(piece), dtype=np.int64))
        if bar is not None:
            bar.update(len(piece))
    ids = np.concatenate(parts)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= _UINT16_LIMIT:
        bad = low if low < 0 else high
        raise InvalidValueError(
            f"token id {bad} in a document starting {doc[:40]!r} does not fit uint16 (0..{_UINT16_LIMIT - 1}); "
            "uint16 shards only hold vocabularies of up to 65536 ids, such as GPT-2's 50257"
        )
    return ids.astype(np.uint16)


_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    # Ctrl-C reaches the whole process group: the parent handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_document_in_worker(doc: Any) -> np.ndarray:
    return encode_document(doc, _worker_tokenizer)


class ShardWriteError(Gpt2Error, OSError):
    """Writing a data set failed (disk full, no permission, ...); its folder was left as it was."""


class PrepareLockedError(Gpt2Error, FileExistsError):
    """Another prepare is writing the same prefix into the same folder."""


class _ShardWriter:
    """Writes a data set whole: the numbered shards (the index runs across splits, as in
    build-nanogpt) go into the hidden staging folder of this prefix inside ``out_dir``,
    ``.prepare-{prefix}.staging``, whose lock file ``.lock`` keeps a second prepare of the prefix out
    (one killed with ``kill -9`` leaves the folder behind; the next one takes it over). Only a complete set is
    moved into place, replacing the prefix's shards that the folder's record of what gpt2 wrote
    (:mod:`gpt2.outputs`) proves are gpt2's, unchanged. An error, Ctrl-C, SIGTERM or SIGHUP before that leaves
    ``out_dir`` as it was.
    """

    def __init__(self, out_dir, prefix: Any, shard_size: Any, overwrite: bool, file_format: str, tokenizer: Any):
        if not isinstance(prefix, str) or not prefix or Path(prefix).name != prefix:
            raise InvalidValueError(f"prefix must be a non-empty file-name prefix such as 'edufineweb', got {prefix!r}")
        if file_format not in _FORMATS:
            raise InvalidValueError(
                f"file_format must be 'npy' (numpy shards) or 'bin' (llm.c's headered shards), got {file_format!r}"
            )
        self.prefix, self.file_format, self.overwrite = prefix, file_format, overwrite
        self.shard_size = check_value("write_shards", "shard_size", shard_size, POSITIVE_INT)
        if tokenizer is None:
            tokenizer = get_tokenizer()
        self.tokenizer = tokenizer
        self.out_dir = Path(out_dir)
        self.folder = OutputFolder(self.out_dir)
        self.stage = self.out_dir / f".prepare-{prefix}.staging"
        busy = (
            f"another prepare ({{who}}) is writing prefix {prefix!r} into {str(self.out_dir)!r}; "
            "wait for it to finish, or choose another directory or prefix"
        )
        self.lock = Lock(self.stage / ".lock", busy, PrepareLockedError)
        self.written: list[Path] = []

    def __enter__(self) -> _ShardWriter:
        """Lock this prefix's staging folder, then find the shards this data set replaces (refusing
        them without ``overwrite``), all before the documents are read.
        """
        self.created = [p for p in (self.out_dir, *self.out_dir.parents) if not p.exists()]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # SIGTERM and SIGHUP stop it as Ctrl-C does: the staging folder is cleaned up on the way out.
        self.signals = StopSignals(force_after=1, outcome="nothing was written").install()
        try:
            # Emptying it through a link would delete files elsewhere.
            if self.stage.is_symlink():
                raise PrepareLockedError(f"{self.stage} is a symbolic link: remove it (gpt2 never writes through one)")
            self.lock.acquire()
            self._empty_stage()
            self.existing = self._own_shards()
        except BaseException:
            self._close(committed=False)
            self.signals.restore()
            raise
        # `train --data <folder>` reads every shard of the folder: say when other shards are there.
        others = sorted(p.name for p in token_files(self.out_dir) if p not in self.existing)
        if others:
            logger.warning(
                "%s also holds other shards (%s): training on the folder reads them all", self.out_dir, others[:3]
            )
        return self

    def _own_shards(self) -> list[Path]:
        """The files named as this prefix's shards: the only files it replaces, with ``overwrite`` only, and only
        while the folder's record proves gpt2 wrote each of them, unchanged since (the new shards would land on them).
        """
        own_name = re.compile(rf"{re.escape(self.prefix)}_(val|train)_\d{{6,}}\.({'|'.join(_FORMATS)})")
        named = [p for p in token_files(self.out_dir) if own_name.fullmatch(p.name)]
        unproven = [p.name for p in named if not self.folder.owns(p.name)]
        if unproven:
            raise FileExistsError(
                f"{str(self.out_dir)!r} holds {len(unproven)} file(s) named as shards of prefix {self.prefix!r} (e.g. "
                f"{unproven[0]}) that its record {RECORD_FILE} does not prove gpt2 wrote, unchanged since (another "
                "tool's, changed, or the record is damaged); prepare replaces only its own shards, even with "
                "--overwrite (overwrite=True): move them out, or choose another directory or prefix"
            )
        if named and not self.overwrite:
            raise FileExistsError(
                f"{str(self.out_dir)!r} already holds {len(named)} shard(s) with prefix {self.prefix!r} (e.g. "
                f"{named[0].name}); pass --overwrite (overwrite=True) to replace them, or choose another "
                "directory or prefix (mixing old and new shards would corrupt the data set)"
            )
        return named

    def write(self, tokens: np.ndarray, split: str) -> None:
        # build-nanogpt's shard file name, e.g. edufineweb_train_000001.npy.
        name = f"{self.prefix}_{split}_{len(self.written):06d}.{self.file_format}"
        with self._writing():
            write_tokens(self.stage / name, tokens)
        logger.info("wrote %s (%d tokens)", name, len(tokens))
        self.written.append(self.out_dir / name)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Our own writes failing (not the documents' source) is a ShardWriteError."""
        try:
            yield
        except OSError as e:
            raise ShardWriteError(
                f"could not write the {self.prefix!r} shards in {str(self.out_dir)!r} ({e}); the folder was "
                f"left as it was before. To go on: {write_advice(e)}, then prepare again"
            ) from e

    def __exit__(self, kind, error, traceback) -> None:
        committed = False
        try:
            # Stop signals wait until the moves are done (or undone) and the staging folder, the lock with
            # it, is gone: a data set is never moved in half, and no lock is left behind.
            self.signals.force_after = math.inf
            if kind is None:
                with self._writing():
                    self._commit()
                committed = True
        finally:
            self._close(committed)
            self.signals.restore()
        if kind is None and self.signals.received:
            raise Stopped(self.signals.received, "the data set was written whole")

    def _close(self, committed: bool) -> None:
        """Remove the staging folder (the replaced files, or an unfinished set) and unlock; a failed
        prepare also takes away the folders it made (the deepest first).
        """
        if self.lock.fd is not None:
            self._empty_stage()
            self.lock.release()
            # Fails when the next prepare has already made its own lock file in the folder: it is theirs now.
            with contextlib.suppress(OSError):
                self.stage.rmdir()
        if not committed:
            for path in self.created:
                with contextlib.suppress(OSError):
                    path.rmdir()

    def _empty_stage(self) -> None:
        for child in self.stage.iterdir():
            if child == self.lock.path:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)

    def _commit(self) -> None:
        """Move the replaced shards aside, record the new ones (read back from the page cache, so each digest is
        of the bytes on disk), then move them in: a prepare killed meanwhile leaves a folder the loader refuses
        (a recorded shard is missing) and whose recorded shards the next prepare replaces.
        """
        record = self.folder.record_file
        before = record.read_bytes() if record.exists() else None
        # The replaced files, kept until the new set is in place.
        old = self.stage / ".old"
        old.mkdir()
        done: list[tuple[Path, Path]] = []
        recorded = False
        try:
            for src, dst in [(p, old / p.name) for p in self.existing]:
                os.replace(src, dst)
                done.append((src, dst))
            self.folder.record([p.name for p in self.written], staged=self.stage)
            recorded = True
            for src, dst in [(self.stage / p.name, p) for p in self.written]:
                os.replace(src, dst)
                done.append((src, dst))
        except BaseException:
            for src, dst in reversed(done):
                os.replace(dst, src)
            if recorded and before is None:
                record.unlink()
            elif recorded:
                replace_atomically(record, lambda f: f.write(before))
            raise


def _fixed_size_pieces(encoded: Iterable[np.ndarray], size: int, bar: Any) -> Iterator[np.ndarray]:
    """The documents' tokens as one stream cut into pieces of exactly ``size`` tokens (the last one
    shorter), counted on ``bar``. Each piece is a view of one buffer, valid until the next is asked for.
    """
    # Grown as tokens come, not allocated at ``size``: --shard-size may be huge.
    buffer = np.empty(min(size, 1 << 22), dtype=np.uint16)
    filled = 0
    for tokens in encoded:
        bar.update(len(tokens))
        while len(tokens):
            take = min(size - filled, len(tokens))
            if filled + take > len(buffer):
                # np.resize keeps the first len(buffer) tokens.
                buffer = np.resize(buffer, min(size, max(filled + take, 2 * len(buffer))))
            buffer[filled : filled + take] = tokens[:take]
            filled += take
            tokens = tokens[take:]
            if filled == size:
                yield buffer
                filled = 0
    if filled:
        yield buffer[:filled]


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
    file_format: str = "npy",
) -> list[Path]:
    """Tokenise documents (each led by ``<|endoftext|>``) into shards of exactly ``shard_size``
    tokens (build-nanogpt's 100M by default; the last one shorter) and return their paths.

    The first shard is ``{prefix}_val_000000.npy``, the others ``{prefix}_train_{index:06d}.npy``, the index counting
    on; ``file_format="bin"`` writes llm.c's ``.bin`` shards. ``tokenizer``: any object with ``encode_ordinary`` and
    ``eot_token``; ``num_workers > 0`` tokenises in a process pool (same shards). The set and its record are written
    whole: a failure (:class:`ShardWriteError` for a full disk) or Ctrl-C leaves ``out_dir`` as it was. The prefix's
    shards that the folder's record ``.gpt2-outputs.json`` proves gpt2 wrote (an earlier data set) raise
    :class:`FileExistsError` unless ``overwrite=True``, which replaces those and no other file; a second prepare of
    ``prefix`` into ``out_dir`` while this one runs raises :class:`PrepareLockedError`.
    """
    writer = _ShardWriter(out_dir, prefix, shard_size, overwrite, file_format, tokenizer)
    num_workers = check_value("write_shards", "num_workers", num_workers, NON_NEGATIVE_INT)
    if isinstance(docs, str):
        raise TypeError("docs must be an iterable of documents, got a single str; wrap it: [text]")

    bar = _bar(progress, unit="tok", unit_scale=True, desc=f"{prefix} shard 0")
    pool = None
    if num_workers > 0:
        pool = multiprocessing.Pool(num_workers, _init_worker, (writer.tokenizer,))
    try:
        with writer:
            if pool is not None:
                # chunksize amortises inter-process traffic over many (usually short) documents.
                encoded = pool.imap(_encode_document_in_worker, docs, chunksize=16)
            else:
                encoded = (encode_document(doc, writer.tokenizer) for doc in docs)
            for piece in _fixed_size_pieces(encoded, writer.shard_size, bar):
                # build-nanogpt's layout: the first shard is the val split.
                writer.write(piece, "train" if writer.written else "val")
                bar.set_description(f"{prefix} shard {len(writer.written)}")
            if not writer.written:
                raise InvalidValueError("write_shards got no documents; docs was empty")
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return writer.written


# A file's validation tokens come from up to this many passages spread through it: the end of the text
# alone would be other plays (other names, other words) than the ones the model read most recently, so
# its loss would rise and fall with where in the text training is, not with how well the model learns.
VAL_PASSAGES = 100
# ... each at least this many tokens (a small file gets fewer, longer passages).
MIN_PASSAGE_TOKENS = 32
# Validation lists its passages in the order of (index x golden ratio) mod 1: any first part of them, such
# as the --eval-steps batches a run scores while it trains, is spread evenly over the text too.
_GOLDEN = (5**0.5 - 1) / 2


def split_tokens(tokens: np.ndarray, val_fraction: float, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(train, val)``: the tokens cut into up to :data:`VAL_PASSAGES` equal parts, the last
    ``val_fraction`` of each held out for validation, the rest (in order) for training. No token is in
    both, and validation (and any first part of it) samples the whole text. Both are copies in
    memory; data larger than memory belongs in shards (``gpt2 prepare``).
    """
    if not 0 <= val_fraction < 1:
        raise InvalidValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0:
        return tokens, None
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 2 or n_val >= len(tokens) - 1:
        raise InvalidValueError(f"{what} has {len(tokens)} tokens, too few to split with --val-fraction {val_fraction}")
    passages = max(1, min(VAL_PASSAGES, n_val // MIN_PASSAGE_TOKENS))
    # Part i is tokens[edges[i]:edges[i + 1]]; from val_starts[i] on it is held out.
    edges = np.linspace(0, len(tokens), passages + 1).round().astype(np.int64)
    val_starts = edges[1:] - np.diff(np.linspace(0, n_val, passages + 1).round().astype(np.int64))
    train = np.concatenate([tokens[start:end] for start, end in zip(edges[:-1], val_starts)])
    order = np.argsort((np.arange(passages) * _GOLDEN) % 1, kind="stable")
    return train, np.concatenate([tokens[val_starts[i] : edges[i + 1]] for i in order])


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
    file_format: str = "npy",
) -> list[Path]:
    """Tokenise one UTF-8 text file, read into memory as one document, into shards as :func:`write_shards` does.
    ``val_fraction`` of its tokens, held out as :func:`split_tokens` does for ``gpt2 train --data file.txt``, are the
    ``val`` shards. ``prefix`` defaults to the file's stem. Returns the shard paths.
    """
    path = Path(path)
    val_fraction = check_value("tokenize_file", "val_fraction", val_fraction, PROBABILITY)
    if prefix is None:
        prefix = path.stem
    writer = _ShardWriter(out_dir, prefix, shard_size, overwrite, file_format, tokenizer)
    # The folder is locked, and an earlier data set refused, before the text is read (a missing file is the
    # FileNotFoundError of reading it; the folder is left as it was).
    with writer:
        text = read_text(path)
        if not text.strip():
            raise InvalidValueError(f"text file {str(path)!r} is empty (or only whitespace): nothing to tokenise")
        with _bar(
            progress, total=len(text), unit="char", unit_scale=True, desc=f"tokenising {path.name}", leave=False
        ) as bar:
            tokens = encode_document(text, writer.tokenizer, bar)
        train, val = split_tokens(tokens, val_fraction, repr(str(path)))
        if val is None:
            # val_fraction 0: no val shards
            val = tokens[:0]
        # Shards of at most shard_size tokens: the val split split_tokens holds out, then the train split.
        size = writer.shard_size
        chunks = [(val[i : i + size], "val") for i in range(0, len(val), size)]
        chunks += [(train[i : i + size], "train") for i in range(0, len(train), size)]
        for chunk, split in _bar(progress, chunks, desc=f"writing {writer.prefix} shards", unit="shard"):
            writer.write(chunk, split)
    return writer.written
