"""Seed the library's cache folder (``~/.cache/gpt2``) from a folder of offline copies.

The library downloads Tiny Shakespeare and GPT-2's BPE files on first use and caches them in
:func:`gpt2.files.default_cache_dir`. On a machine with no internet but a folder of copies (this
project's ``../shared/data``), copying them there once makes every later command work in any
shell with no variables to set (``run.sh`` does this):

    python scripts/seed_cache.py ../shared/data

The folder may hold ``tinyshakespeare.txt`` and ``gpt2-tokenizer/{vocab.bpe,encoder.json}``. Each
file is checked against its known sha256 before it is copied (atomically); a good copy already in
the cache is left alone.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from gpt2.data.downloads import TINY_SHAKESPEARE_SHA256
from gpt2.files import default_cache_dir, replace_atomically
from gpt2.model.tokenizer import BPE_SHA256, bpe_cache_dir


def seed_caches(source: Path) -> list[Path]:
    """Copy the offline files found in ``source`` into the cache; returns the files written."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a directory; pass the folder holding tinyshakespeare.txt")
    jobs = [(source / "tinyshakespeare.txt", default_cache_dir() / "tinyshakespeare.txt", TINY_SHAKESPEARE_SHA256)]
    jobs += [(source / "gpt2-tokenizer" / name, bpe_cache_dir() / name, sha) for name, sha in BPE_SHA256.items()]
    written = []
    for src, dst, sha256 in jobs:
        if not src.is_file() or (dst.is_file() and hashlib.sha256(dst.read_bytes()).hexdigest() == sha256):
            continue
        data = src.read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError(f"{src}: sha256 is not the expected {sha256}; replace the file with a good copy")
        dst.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(dst, lambda f, data=data: f.write(data))
        written.append(dst)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/seed_cache.py DIR  (a folder with tinyshakespeare.txt and gpt2-tokenizer/)")
    try:
        for path in seed_caches(Path(sys.argv[1]).expanduser()):
            print(f"cached {path}")
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
