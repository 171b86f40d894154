"""Token data: downloads, tokenising into shards, token file formats, and the batch loader.

* :mod:`gpt2.data.downloads`: Tiny Shakespeare, downloaded and cached (:mod:`gpt2.files`).
* :mod:`gpt2.data.prepare`: text -> ``uint16`` shards and their manifest, written whole
  (``write_shards``, ``tokenize_file``).
* :mod:`gpt2.data.formats`: ``.npy`` and llm.c ``.bin`` token files and shard manifests, read and
  checked.
* :mod:`gpt2.data.loader`: :class:`TokenLoader`, the rank-aware batch loader.
"""

from gpt2.data.downloads import (
    TINY_SHAKESPEARE_SHA256,
    TINY_SHAKESPEARE_URL,
    load_tiny_shakespeare,
    tiny_shakespeare_path,
)
from gpt2.data.formats import (
    TOKEN_SUFFIXES,
    ShardManifestError,
    check_token_ids,
    iter_jsonl,
    load_tokens,
    read_text,
    write_tokens,
)
from gpt2.data.loader import TokenLoader, TokenSource
from gpt2.data.prepare import ShardWriteError, shard_name, tokenize_file, write_shards

__all__ = [
    "TINY_SHAKESPEARE_SHA256",
    "TINY_SHAKESPEARE_URL",
    "TOKEN_SUFFIXES",
    "ShardManifestError",
    "ShardWriteError",
    "TokenLoader",
    "TokenSource",
    "check_token_ids",
    "iter_jsonl",
    "load_tiny_shakespeare",
    "load_tokens",
    "read_text",
    "shard_name",
    "tiny_shakespeare_path",
    "tokenize_file",
    "write_shards",
    "write_tokens",
]
