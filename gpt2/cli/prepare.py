"""``gpt2 prepare``: text files, jsonl files or a Hugging Face dataset -> token shards
(build-nanogpt's layout: the first shard is the val split; one text file is split by
``--val-fraction`` instead)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpt2.cli.common import UsageError
from gpt2.cli.options import PrepareOptions
from gpt2.data import iter_jsonl, load_tokens, read_text, tokenize_file, write_shards


def prepare(options: PrepareOptions) -> int:
    if not options.input and not options.dataset:
        raise UsageError(
            "nothing to tokenise: give --input FILE... (text/jsonl files or directories) or --dataset NAME"
        )
    if options.max_docs is not None and options.max_docs < 1:
        raise UsageError(f"--max-docs must be >= 1, got {options.max_docs}")
    start = time.time()
    if options.input:  # local files win over a --dataset default (e.g. prepare_fineweb.py's)
        files = _expand_inputs(options.input)
        if len(files) == 1 and files[0].suffix.lower() != ".jsonl":
            # One text: split by token count (the end of the text is the validation set).
            paths = tokenize_file(
                files[0],
                options.out_dir,
                prefix=options.prefix,
                shard_size=options.shard_size,
                val_fraction=options.val_fraction,
                progress=options.progress,
                overwrite=options.overwrite,
                file_format=options.format,
            )
            return _report_shards(paths, start)
        docs: Iterable[str] = _documents(files, options.text_field)
    else:
        docs = _dataset_documents(options)
    if options.max_docs is not None:
        docs = itertools.islice(docs, options.max_docs)
    paths = write_shards(
        docs,
        options.out_dir,
        prefix=options.prefix or "shard",
        shard_size=options.shard_size,
        num_workers=options.num_workers,
        progress=options.progress,
        overwrite=options.overwrite,
        file_format=options.format,
    )
    if len(paths) == 1:
        print(
            f"warning: all tokens fit in one shard, which is the val split ({paths[0].name}): "
            f"use a smaller --shard-size to get train shards too"
        )
    return _report_shards(paths, start)


def _report_shards(paths: list[Path], start: float) -> int:
    total = 0
    for p in paths:
        n = len(load_tokens(p))
        total += n
        print(f"{p}  {n:,} tokens")
    print(f"wrote {len(paths)} shard(s), {total:,} tokens in {time.time() - start:.1f} s")
    return 0


def _expand_inputs(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (".txt", ".jsonl", ".md"))
            if not found:
                raise FileNotFoundError(f"directory {str(path)!r} has no .txt, .md or .jsonl files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {item!r} does not exist")
    return files


def _documents(inputs: list[Path], text_field: str) -> Iterator[str]:
    """Text files give one document each; ``.jsonl`` files one per line (its ``text_field``)."""
    for path in inputs:
        if path.suffix.lower() == ".jsonl":
            for line_no, row in iter_jsonl(path):
                if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                    raise ValueError(
                        f"{path}:{line_no}: expected a JSON object with a string field {text_field!r} "
                        f"(choose the field with --text-field)"
                    )
                yield row[text_field]
        else:
            yield read_text(path)


def _dataset_documents(options: PrepareOptions) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "tokenising a Hugging Face dataset needs the `datasets` package: pip install datasets "
            "(or pass local text/jsonl files with --input)"
        ) from e
    ds = datasets.load_dataset(options.dataset, name=options.dataset_config, split=options.split, streaming=True)
    for row in ds:
        text = row.get(options.text_field)
        if not isinstance(text, str):
            raise ValueError(
                f"dataset {options.dataset!r} rows have no string field {options.text_field!r} "
                f"(fields: {sorted(row)}); choose it with --text-field"
            )
        yield text
