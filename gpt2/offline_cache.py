"""Seed the library's download caches from a folder of offline copies.

The library downloads two things on first use and caches them: Tiny Shakespeare (in
:func:`gpt2.data.default_cache_dir`) and GPT-2's BPE files (in tiktoken's cache). On a machine
with no internet but a folder of copies (this project's ``../shared/data``), copying the files
into those caches once makes every later command work in any shell, with no variables to set:

    python -m gpt2.offline_cache ../shared/data

The folder may hold ``tinyshakespeare.txt`` and ``gpt2-tokenizer/{vocab.bpe,encoder.json}``;
each file is checked against its known sha256 before it is copied, and a file already in the
cache is left alone. Copies are written to a temporary name and renamed, so an interrupted run
never leaves a partial file where the library would read it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from gpt2.data import TINY_SHAKESPEARE_SHA256, default_cache_dir
from gpt2.data._util import replace_atomically

__all__ = ["seed_caches", "tiktoken_cache_dir"]

# Where tiktoken downloads GPT-2's BPE files from; its cache names each file by the sha1 of its URL.
_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# The sha256 tiktoken checks the two files against (tiktoken_ext/openai_public.py).
_BPE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def tiktoken_cache_dir() -> Path:
    """The directory tiktoken reads its downloads from, chosen as tiktoken itself does:
    ``$TIKTOKEN_CACHE_DIR``, else ``$DATA_GYM_CACHE_DIR``, else ``<tempdir>/data-gym-cache``."""
    for name in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _copy_checked(src: Path, dst: Path, sha256: str) -> bool:
    """Copy ``src`` to ``dst`` (atomically) unless ``dst`` already holds the right bytes.
    Returns whether a copy was made; raises ValueError when ``src`` has the wrong bytes."""
    if dst.is_file() and _sha256(dst.read_bytes()) == sha256:  # files of about 1 MB
        return False
    data = src.read_bytes()
    got = _sha256(data)
    if got != sha256:
        raise ValueError(f"{src}: sha256 {got} is not the expected {sha256}; replace the file with a good copy")
    dst.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(dst, lambda f: f.write(data))
    return True


def seed_caches(source: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Copy the offline files found in ``source`` into the caches the library reads.

    ``tinyshakespeare.txt`` goes to ``cache_dir`` (default :func:`gpt2.data.default_cache_dir`),
    ``gpt2-tokenizer/vocab.bpe`` and ``encoder.json`` to :func:`tiktoken_cache_dir` under the
    names tiktoken gives them. Files missing from ``source`` are skipped. Returns the cache files
    written (already-present good copies are not rewritten).
    """
    source = Path(source).expanduser()
    if not source.is_dir():
        raise FileNotFoundError(
            f"{source} is not a directory; pass the folder holding tinyshakespeare.txt and gpt2-tokenizer/"
        )
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    jobs = [(source / "tinyshakespeare.txt", cache / "tinyshakespeare.txt", TINY_SHAKESPEARE_SHA256)]
    tiktoken_dir = tiktoken_cache_dir()
    for name, sha256 in _BPE_SHA256.items():
        key = hashlib.sha1((_BPE_URL + name).encode()).hexdigest()
        jobs.append((source / "gpt2-tokenizer" / name, tiktoken_dir / key, sha256))
    return [dst for src, dst, sha256 in jobs if src.is_file() and _copy_checked(src, dst, sha256)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m gpt2.offline_cache DIR  (a folder with tinyshakespeare.txt and gpt2-tokenizer/)",
            file=sys.stderr,
        )
        return 2
    try:
        written = seed_caches(argv[0])
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"cached {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
