"""The GPT-2 byte-level BPE tokenizer, through tiktoken.

Its two files, GPT-2's ``vocab.bpe`` and ``encoder.json``, are looked up in this order:

1. ``GPT2_TOKENIZER_DIR`` (or an explicit ``tokenizer_dir``, ``--tokenizer-dir``): a folder with
   ``vocab.bpe`` + ``encoder.json``, or Hugging Face's ``merges.txt`` + ``vocab.json``. When set,
   it must hold them: nothing else is tried.
2. tiktoken's cache, where ``tiktoken.get_encoding("gpt2")`` keeps the same two files under the
   sha1 of their URL: ``TIKTOKEN_CACHE_DIR``, then ``DATA_GYM_CACHE_DIR`` (the variables tiktoken
   reads; each where set and not empty). A file is taken only if its sha256 is GPT-2's.
3. The project's cache, ``<cache>/gpt2-tokenizer`` (``~/.cache/gpt2`` unless ``GPT2_CACHE_DIR`` or
   ``XDG_CACHE_HOME`` says otherwise).
4. A download from OpenAI into the project's cache, sha256-checked.

Each file is looked up on its own from step 2 on, so an offline tiktoken cache never leads to a
download attempt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import tiktoken
import torch

from gpt2.errors import Gpt2Error, InvalidValueError, MissingFileError
from gpt2.files import DownloadError, default_cache_dir, download, sha256_file
from gpt2.model.config import GPT2_VOCAB_SIZE

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
# The id of <|endoftext|>: the last of GPT-2's 50257 ids (50000 merges + 256 bytes).
EOT_TOKEN = 50256

# GPT-2's pre-tokenisation pattern, as published in openai/gpt-2 src/encoder.py: contractions,
# letters, digits and other symbols (each optionally led by one space), then whitespace runs
# (a run before a non-space keeps its last space for the next word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Where OpenAI publishes GPT-2's BPE files, and their sha256 (the ones tiktoken checks too).
_GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
BPE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}

AllowedSpecial = Union[Literal["all"], Collection[str]]


class TokenizerNotAvailableError(Gpt2Error, RuntimeError):
    """The GPT-2 BPE files could not be read or downloaded."""


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Each character of GPT-2's printable byte alphabet -> its byte. Printable non-space bytes
    stand for themselves, the other 68 are chr(256), chr(257), ... in byte order; this order
    is also the ranks of the 256 single-byte tokens (ids 0..255).
    """
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


@dataclass(frozen=True)
class BpeVocabulary:
    """GPT-2's two BPE files, read and checked against each other by :func:`read_bpe_files`."""

    # Token bytes -> id, rebuilt from the merge list: tiktoken needs id order == merge priority.
    ranks: dict[bytes, int]
    # The merges in priority order, each "left right" as vocab.bpe writes it.
    merges: list[str]
    # encoder.json: each token (GPT-2's printable form of its bytes) -> its id.
    encoder: dict[str, int]


def read_bpe_files(vocab_bpe: str | os.PathLike, encoder_json: str | os.PathLike) -> BpeVocabulary:
    """Read GPT-2's ``vocab.bpe`` (or ``merges.txt``) and ``encoder.json`` (or ``vocab.json``) and check
    them: the merges rebuild the encoder's ids exactly, and they are GPT-2's 50257. The one reader of
    these files: :meth:`Tokenizer.from_files` and the GGUF export use it.
    """
    vocab_bpe, encoder_json = Path(vocab_bpe), Path(encoder_json)
    for path, what in ((vocab_bpe, "vocab.bpe (merges)"), (encoder_json, "encoder.json")):
        if not path.is_file():
            raise MissingFileError(f"GPT-2 BPE file {what} not found at {str(path)!r}")
    alphabet = _gpt2_byte_alphabet()

    def to_bytes(token: str, where: Path) -> bytes:
        try:
            return bytes(alphabet[ch] for ch in token)
        except KeyError as e:
            raise InvalidValueError(
                f"{str(where)!r}: token {token!r} has a character outside GPT-2's byte alphabet"
            ) from e

    ranks = {bytes([b]): i for i, b in enumerate(alphabet.values())}
    merges = []
    lines = vocab_bpe.read_text(encoding="utf-8").split("\n")
    # The first line is a version header ("#version: 0.2"); the file ends with a newline.
    for line_no, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InvalidValueError(f"{str(vocab_bpe)!r} line {line_no}: expected two tokens to merge, got {line!r}")
        ranks[to_bytes(parts[0], vocab_bpe) + to_bytes(parts[1], vocab_bpe)] = len(ranks)
        merges.append(f"{parts[0]} {parts[1]}")

    encoder = json.loads(encoder_json.read_text(encoding="utf-8"))
    expected = {to_bytes(token, encoder_json): i for token, i in encoder.items() if token != ENDOFTEXT}
    if ranks != expected:
        bad = next((t for t in expected if ranks.get(t) != expected[t]), None)
        raise InvalidValueError(
            f"{str(vocab_bpe)!r} and {str(encoder_json)!r} do not describe the same vocabulary "
            f"({len(ranks)} tokens from the merges, {len(expected)} in the encoder; first "
            f"disagreement: {bad!r}); use the vocab.bpe and encoder.json of the same GPT-2 release"
        )
    # The encoder's other tokens are the merges' (checked above); <|endoftext|> comes last, as GPT-2's.
    if len(ranks) != GPT2_VOCAB_SIZE - 1 or encoder.get(ENDOFTEXT) != EOT_TOKEN:
        raise InvalidValueError(
            f"{str(vocab_bpe)!r} and {str(encoder_json)!r} describe {len(ranks)} mergeable tokens and "
            f"<|endoftext|> as id {encoder.get(ENDOFTEXT)}; GPT-2's BPE has {GPT2_VOCAB_SIZE} ids (256 "
            f"bytes + 50000 merges + <|endoftext|> = {EOT_TOKEN}): are these GPT-2's files?"
        )
    return BpeVocabulary(ranks, merges, encoder)


class Tokenizer:
    """GPT-2's BPE (50257 ids, ``<|endoftext|>`` = 50256) over a :class:`tiktoken.Encoding`; decodes
    tensors and arrays and checks ids. :func:`get_tokenizer` gives the shared instance.
    """

    def __init__(self, encoding: tiktoken.Encoding):
        # A public constructor: another encoding (cl100k_base) would decode and check ids against its own vocabulary.
        if encoding.eot_token != EOT_TOKEN or encoding.n_vocab != GPT2_VOCAB_SIZE:
            raise InvalidValueError(
                f"encoding {encoding.name!r} has eot_token={encoding.eot_token} and n_vocab={encoding.n_vocab}; "
                f"GPT-2's BPE has {EOT_TOKEN} and {GPT2_VOCAB_SIZE}"
            )
        self.encoding = encoding

    @classmethod
    def from_files(cls, vocab_bpe: str | os.PathLike, encoder_json: str | os.PathLike) -> Tokenizer:
        """From local GPT-2 BPE files (``vocab.bpe``/``merges.txt``, ``encoder.json``/``vocab.json``)."""
        encoding = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=read_bpe_files(vocab_bpe, encoder_json).ranks,
            special_tokens={ENDOFTEXT: EOT_TOKEN},
            explicit_n_vocab=GPT2_VOCAB_SIZE,
        )
        return cls(encoding)

    @property
    def eot_token(self) -> int:
        """Id of ``<|endoftext|>`` (50256), which build-nanogpt puts before every document."""
        return self.encoding.eot_token

    @property
    def n_vocab(self) -> int:
        """Number of ids (50257); the model may pad its embedding beyond this (e.g. 50304)."""
        return self.encoding.n_vocab

    def __len__(self) -> int:
        return self.n_vocab

    def encode(self, text: str, *, allowed_special: AllowedSpecial = "all") -> list[int]:
        """Text -> ids; ``<|endoftext|>`` becomes 50256 (as in nanoGPT's ``sample.py``), an error with
        ``allowed_special=set()``; untrusted text should use :meth:`encode_ordinary`.
        """
        return self.encoding.encode(text, allowed_special=allowed_special)

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, with ``<|endoftext|>`` read as ordinary text (never id 50256)."""
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` over many texts, in parallel threads (tiktoken releases the GIL)."""
        _refuse_one_text(texts)
        return self.encoding.encode_batch(texts, allowed_special="all")

    def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode_ordinary` over many texts, in parallel threads."""
        _refuse_one_text(texts)
        return self.encoding.encode_ordinary_batch(texts)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor | int, *, errors: str = "replace") -> str:
        """Ids (a list, a 1-D integer array or tensor on any device, or one id) -> text; a token
        boundary inside a multi-byte character becomes U+FFFD with ``errors="replace"``.
        """
        if isinstance(ids, str):
            raise TypeError("decode expects token ids, got a str; did you mean encode?")
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu()
        array = np.asarray(ids)
        # an empty list reads as float64
        if array.size == 0:
            return ""
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"cannot decode ids of dtype {array.dtype}; token ids must be integers, got {ids!r:.100}")
        if array.ndim > 1:
            raise InvalidValueError(
                f"decode expects a 1-D sequence of ids, got shape {array.shape}; use decode_batch for a (B, T) batch"
            )
        outside = array[(array < 0) | (array >= self.n_vocab)]
        if outside.size:
            raise InvalidValueError(
                f"token id {outside.flat[0]} is outside GPT-2's vocabulary [0, {self.n_vocab}); ids from a padded "
                "vocabulary (e.g. 50304 rows) must never be sampled, so this points to a model bug"
            )
        return self.encoding.decode(array.reshape(-1).tolist(), errors=errors)

    def decode_batch(self, batch: Iterable[Any] | np.ndarray | torch.Tensor, *, errors: str = "replace") -> list[str]:
        """Decode each row of a (B, T) tensor/array or each sequence of a list."""
        if isinstance(batch, (torch.Tensor, np.ndarray)) and batch.ndim != 2:
            raise InvalidValueError(f"decode_batch expects a 2-D (B, T) batch of ids, got shape {tuple(batch.shape)}")
        return [self.decode(row, errors=errors) for row in batch]


def _refuse_one_text(texts: Any) -> None:
    """A str is a sequence of one-character texts: refused. (tiktoken refuses a text that is not a str.)"""
    if isinstance(texts, str):
        raise TypeError("expected a sequence of texts, got a single str; use encode for one text")


def bpe_cache_dir() -> Path:
    """Where GPT-2's ``vocab.bpe`` and ``encoder.json`` are cached: ``<cache>/gpt2-tokenizer``."""
    return default_cache_dir() / "gpt2-tokenizer"


def tiktoken_cache_dirs() -> list[Path]:
    """The folders of tiktoken's cache that the environment names: ``TIKTOKEN_CACHE_DIR``, then
    ``DATA_GYM_CACHE_DIR`` (an empty value, which turns tiktoken's cache off, names none).
    """
    # tiktoken's own cache folders, in the order tiktoken reads them (tiktoken/load.py)
    return [Path(os.environ[name]) for name in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR") if os.environ.get(name)]


def tiktoken_cache_name(url: str) -> str:
    """The name tiktoken gives the file downloaded from ``url`` in its cache: the sha1 of the URL
    (``tiktoken.load.read_file_cached``). tiktoken has no public function that only finds a cached
    file (``read_file_cached`` downloads a missing one), so this follows its rule.
    """
    return hashlib.sha1(url.encode(), usedforsecurity=False).hexdigest()


def _bpe_file(name: str, sha256: str) -> Path:
    """GPT-2's ``name`` (``vocab.bpe`` or ``encoder.json``) from tiktoken's cache, else from the
    project's cache, downloaded there first if it is missing.
    """
    url = _GPT2_BPE_URL + name
    for directory in tiktoken_cache_dirs():
        path = directory / tiktoken_cache_name(url)
        # a file that differs, or that cannot be read (a shared cache of another user's), is passed over with a warning
        if not path.is_file():
            continue
        try:
            digest = sha256_file(path)
        except OSError as e:
            logger.warning("passing over %s in tiktoken's cache: it cannot be read (%s)", path, e)
            continue
        if digest == sha256:
            return path
        logger.warning("passing over %s in tiktoken's cache: its sha256 is not the expected %s", path, sha256)
    path = bpe_cache_dir() / name
    if path.is_file():
        return path
    try:
        download(
            url,
            path,
            sha256=sha256,
            what=f"GPT-2's {name}",
            offline_hint="set GPT2_TOKENIZER_DIR to a folder with vocab.bpe and encoder.json (or a Hugging Face "
            "gpt2 folder with merges.txt and vocab.json), or TIKTOKEN_CACHE_DIR to a tiktoken cache that holds "
            "GPT-2's files, or copy the file to",
            progress=False,
        )
    except DownloadError as e:
        raise TokenizerNotAvailableError(str(e)) from e
    return path


def bpe_files(tokenizer_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """The ``(vocab.bpe, encoder.json)`` :func:`get_tokenizer` reads (and exports copy): from
    ``tokenizer_dir`` or ``GPT2_TOKENIZER_DIR`` if set, else from the caches in the order the
    module's docstring gives (downloaded on first use).
    """
    tokenizer_dir = tokenizer_dir or os.environ.get("GPT2_TOKENIZER_DIR")
    if not tokenizer_dir:
        return _bpe_file("vocab.bpe", BPE_SHA256["vocab.bpe"]), _bpe_file("encoder.json", BPE_SHA256["encoder.json"])
    directory = Path(tokenizer_dir)

    # GPT-2's names in the folder, or their Hugging Face names
    def first(*names: str) -> Path | None:
        return next((directory / n for n in names if (directory / n).is_file()), None)

    vocab_bpe, encoder_json = first("vocab.bpe", "merges.txt"), first("encoder.json", "vocab.json")
    if vocab_bpe is None or encoder_json is None:
        found: Any = "no such directory"
        if directory.is_dir():
            found = sorted(p.name for p in directory.iterdir())
        raise TokenizerNotAvailableError(
            f"the tokenizer folder {str(directory)!r} (GPT2_TOKENIZER_DIR or --tokenizer-dir) must contain GPT-2's "
            f"vocab.bpe and encoder.json (or the Hugging Face names merges.txt and vocab.json); found {found}"
        )
    return vocab_bpe, encoder_json


@functools.cache
def _load_tokenizer(tokenizer_dir: str | None, tiktoken_dirs: tuple[Path, ...], cache_dir: Path) -> Tokenizer:
    # The arguments are the cache key only: bpe_files() reads the same settings.
    del tokenizer_dir, tiktoken_dirs, cache_dir
    return Tokenizer.from_files(*bpe_files())


def get_tokenizer() -> Tokenizer:
    """The shared GPT-2 tokenizer from :func:`bpe_files`, cached per source (a failure is not, so
    a fixed environment works on the next call); :class:`TokenizerNotAvailableError` otherwise.
    """
    return _load_tokenizer(os.environ.get("GPT2_TOKENIZER_DIR") or None, tuple(tiktoken_cache_dirs()), bpe_cache_dir())
