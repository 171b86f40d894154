"""Token data: Tiny Shakespeare (:mod:`.downloads`), text -> shards recorded in their folder (:mod:`.prepare`, each
prefix staged and locked there), ``.npy`` / llm.c ``.bin`` token files (:mod:`.formats`), the rank-aware
:class:`TokenLoader` (:mod:`.loader`), instruction data (:mod:`.instruct`) and what ``--data`` means (:mod:`.sources`).
"""

from gpt2.data.downloads import load_tiny_shakespeare, tiny_shakespeare_path
from gpt2.data.formats import TOKEN_SUFFIXES, ShardManifestError, iter_jsonl, load_tokens, read_text, write_tokens
from gpt2.data.loader import TokenLoader
from gpt2.data.prepare import PrepareLockedError, ShardWriteError, tokenize_file, write_shards

__all__ = [
    "TOKEN_SUFFIXES",
    "PrepareLockedError",
    "ShardManifestError",
    "ShardWriteError",
    "TokenLoader",
    "iter_jsonl",
    "load_tiny_shakespeare",
    "load_tokens",
    "read_text",
    "tiny_shakespeare_path",
    "tokenize_file",
    "write_shards",
    "write_tokens",
]
