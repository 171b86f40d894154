"""``gpt2 prepare``: text files, jsonl files or a Hugging Face dataset -> token shards."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpt2.cli.layers import Options, UsageError
from gpt2.data import iter_jsonl, load_tokens, read_text, tokenize_file, write_shards
from gpt2.errors import InvalidValueError, MissingFileError


@dataclass
class PrepareOptions(Options):
    """gpt2 prepare: tokenise documents with GPT-2's BPE into uint16 token shards.

    build-nanogpt's layout: the first shard is the val split, the others train.

    One text file is split by --val-fraction instead.
    """

    input: tuple[str, ...] = ()
    """text files (one document each), .jsonl files (one document per line) or directories of them"""
    dataset: str | None = None
    """a Hugging Face dataset to stream instead (needs `pip install datasets`), e.g. HuggingFaceFW/fineweb-edu"""
    dataset_config: str | None = None
    """the dataset's configuration, e.g. sample-10BT"""
    split: str = "train"
    """the dataset split to read"""
    text_field: str = "text"
    """the field holding the text in jsonl rows / dataset rows"""
    out_dir: str = "data/shards"
    """where the shards go"""
    prefix: str | None = None
    """shard file-name prefix; None = the text file's name, or 'shard'"""
    shard_size: int = 10**8
    """tokens per shard (10^8 = 200 MB, build-nanogpt's size)"""
    val_fraction: float = 0.1
    """for a single text file: the fraction kept for validation (passages spread through it, as
    `gpt2 train --data file.txt` holds out)"""
    num_workers: int = 0
    """tokeniser processes; 0 = tokenise in this process"""
    max_docs: int | None = None
    """stop after this many documents (for a quick try)"""
    overwrite: bool = False
    """replace shards with the same prefix already in --out-dir"""
    format: Literal["npy", "bin"] = "npy"
    """shard files: npy (numpy), or bin (llm.c's headered layout, which llm.c trains on as is)"""
    progress: bool = True
    """show a progress bar"""


def prepare(options: PrepareOptions) -> int:
    if not options.input and not options.dataset:
        raise UsageError(
            "nothing to tokenise: give --input FILE... (text/jsonl files or directories) or --dataset NAME"
        )
    if options.max_docs is not None and options.max_docs < 1:
        raise UsageError(f"--max-docs must be >= 1, got {options.max_docs}")
    if options.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0 (0: tokenise in this process), got {options.num_workers}")
    start = time.time()
    shards = dict(
        shard_size=options.shard_size,
        progress=options.progress,
        overwrite=options.overwrite,
        file_format=options.format,
    )
    # Local files win over a --dataset default (e.g. prepare_fineweb.py's).
    if options.input:
        files = _expand_inputs(options.input)
        if len(files) == 1 and files[0].suffix.lower() != ".jsonl":
            # One text: split as `gpt2 train --data file.txt` splits it.
            paths = tokenize_file(
                files[0], options.out_dir, prefix=options.prefix, val_fraction=options.val_fraction, **shards
            )
            return _report_shards(paths, start)
        docs: Iterable[str] = _documents(files, options.text_field)
    else:
        docs = _dataset_documents(options)
    if options.max_docs is not None:
        docs = itertools.islice(docs, options.max_docs)
    paths = write_shards(
        docs, options.out_dir, prefix=options.prefix or "shard", num_workers=options.num_workers, **shards
    )
    if len(paths) == 1:
        print(
            f"warning: all tokens fit in one shard, which is the val split ({paths[0].name}): "
            f"use a smaller --shard-size to get train shards too"
        )
    return _report_shards(paths, start)


def _report_shards(paths: list[Path], start: float) -> int:
    # Each shard's name and size is logged as it is written (gpt2.data's "wrote NAME (N tokens)"): the total here.
    total = sum(len(load_tokens(p)) for p in paths)
    print(f"wrote {len(paths)} shard(s), {total:,} tokens in {time.time() - start:.1f} s")
    return 0


def _expand_inputs(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (".txt", ".jsonl", ".md"))
            if not found:
                raise MissingFileError(f"directory {str(path)!r} has no .txt, .md or .jsonl files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise MissingFileError(f"input {item!r} does not exist")
    return files


def _documents(inputs: list[Path], text_field: str) -> Iterator[str]:
    """Text files give one document each; ``.jsonl`` files one per line (its ``text_field``)."""
    for path in inputs:
        if path.suffix.lower() == ".jsonl":
            yield from _texts(((f"{path}:{line_no}", row) for line_no, row in iter_jsonl(path)), text_field)
        else:
            text = read_text(path)
            if text:
                yield text


def _dataset_documents(options: PrepareOptions) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "tokenising a Hugging Face dataset needs the `datasets` package: pip install datasets "
            "(or pass local text/jsonl files with --input)"
        ) from e
    ds = datasets.load_dataset(options.dataset, name=options.dataset_config, split=options.split, streaming=True)
    yield from _texts(((f"dataset {options.dataset!r}", row) for row in ds), options.text_field)


def _texts(rows: Iterable[tuple[str, Any]], text_field: str) -> Iterator[str]:
    """The documents of ``(where, row)`` pairs, jsonl lines or dataset rows: each row's ``text_field``."""
    for where, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
            # the row's own fields: the names --text-field can choose from
            fields = f" (fields: {sorted(row)})" if isinstance(row, dict) else ""
            raise InvalidValueError(
                f"{where}: expected rows with a string field {text_field!r}{fields}; choose the field with --text-field"
            )
        # An empty document would be a lone <|endoftext|>.
        if row[text_field]:
            yield row[text_field]
