"""The jobs behind the command line and the example scripts: one implementation of each.

``gpt2 train`` and ``python examples/pretrain_shakespeare.py`` both end in :func:`train_job`;
``finetune_job``, ``sample_job``, ``prepare_job``, ``eval_job``, ``export_job`` and
``bench_job`` likewise. Each takes the resolved options (the ``argparse.Namespace`` that
:mod:`gpt2.cli` builds from defaults, recipe, config file and flags) and writes the command's
output to stdout: this module is the command line's body, the one place besides ``examples/``
where the project prints.

The reusable pieces the jobs share (:func:`load_model`, :func:`apply_adapter`,
:func:`text_tokens`, :func:`training_data`, :func:`stream_text`) take plain arguments and are
usable from Python too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from .config import SHAPES
# Suffixes of token files (.npy shards, llm.c / nanoGPT .bin); anything else given as --data is
# read as UTF-8 text and tokenised.
from .data.formats import TOKEN_SUFFIXES

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """Bad options, values or files: the command line reports it in one line, exit code 2."""


def uses_cuda(device: str | None) -> bool:
    """Whether ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...) means a CUDA GPU here."""
    device = (device or "auto").lower()
    if device == "auto":
        return torch.cuda.is_available()
    return device.startswith("cuda")


def resolve_device(device: str | None) -> torch.device:
    """``auto`` = this process's GPU (``cuda:LOCAL_RANK``) when CUDA is available, else cpu."""
    from .distributed import env_from_environ, resolve_device as _resolve

    return _resolve(device or "auto", env_from_environ())


# --------------------------------------------------------------------------- data
def shakespeare_or_path(data: str) -> Path:
    """``shakespeare`` -> the Tiny Shakespeare text (downloaded once, or $GPT2_TINY_SHAKESPEARE);
    anything else must be an existing path."""
    if data == "shakespeare":
        from .data import tiny_shakespeare_path

        return tiny_shakespeare_path()
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data {data!r} does not exist; give a text file, a token file (.npy/.bin), a directory "
            f"of token shards (gpt2 prepare writes them) or 'shakespeare'"
        )
    return path


def text_tokens(path: str | os.PathLike[str], tokenizer: Any = None) -> np.ndarray:
    """A UTF-8 text file as one document: ``<|endoftext|>`` then its GPT-2 tokens, ``uint16``
    (the layout :func:`gpt2.data.tokenize_file` writes to disk, kept in memory)."""
    if tokenizer is None:
        from .tokenizer import get_tokenizer

        tokenizer = get_tokenizer()
    from .data import read_text

    text = read_text(path)  # not UTF-8: an error with the file and byte offset
    ids = [tokenizer.eot_token] + tokenizer.encode_ordinary(text)
    return np.asarray(ids, dtype=np.uint16)


def is_text(data: str) -> bool:
    """Whether ``--data`` names text to tokenise (not a token file or shard directory)."""
    if data == "shakespeare":
        return True
    path = Path(data).expanduser()
    return path.is_file() and path.suffix.lower() not in TOKEN_SUFFIXES


def load_token_source(data: str) -> Any:
    """``data`` as something :class:`gpt2.data.TokenLoader` reads: a shard directory or token
    file as is, a text file (or ``shakespeare``) tokenised into an array."""
    from .data import load_tokens

    path = shakespeare_or_path(data)
    if path.is_dir():
        return path
    if path.suffix.lower() in TOKEN_SUFFIXES:
        return np.asarray(load_tokens(path))
    return text_tokens(path)


def split_tokens(tokens: np.ndarray, val_fraction: float, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The first ``1 - val_fraction`` of the tokens for training, the rest for validation (the
    end of the text, as nanoGPT's prepare.py does, so no passage is in both)."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0:
        return tokens, None
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 2 or n_val >= len(tokens) - 1:
        raise ValueError(f"{what} has {len(tokens)} tokens, too few to split with --val-fraction {val_fraction}")
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def training_data(data: str, val_data: str | None, val_fraction: float) -> tuple[Any, Any]:
    """``(train, val)`` sources for the Trainer from the ``--data`` / ``--val-data`` options.

    A shard directory gives its ``train`` shards and, unless ``val_data`` is given, its ``val``
    shards (when it has any). A text or token file is split by ``val_fraction`` unless
    ``val_data`` is given.
    """
    source = load_token_source(data)
    if isinstance(source, Path):  # a directory of shards
        val: Any = None
        if val_data is not None:
            val = load_token_source(val_data)
        elif any("val" in p.name for p in source.iterdir() if p.suffix in TOKEN_SUFFIXES):
            val = source
        return source, val
    if val_data is not None:
        return source, load_token_source(val_data)
    return split_tokens(source, val_fraction, data)


# --------------------------------------------------------------------------- models
def is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / name).is_file()
        for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json")
    )


def load_model(spec: str, *, device: torch.device | str | None = None, pad_vocab_multiple: int = 1) -> Any:
    """A :class:`gpt2.GPT` from a hub id (``gpt2``, ``gpt2-medium``, ...), a ``transformers``
    directory, or a checkpoint / run directory written by ``gpt2 train`` (the newest checkpoint).

    Which one follows :func:`gpt2.hf.resolve_source`: the bare official GPT-2 names are the hub
    (also in this repository's checkout, where ``gpt2/`` is the package); any other existing path
    is local, and a local path that holds no model is an error saying what is missing.
    """
    from .checkpoint import checkpoint_step
    from .hf import resolve_source
    from .model import GPT

    source = resolve_source(spec)
    if isinstance(source, str):  # a hub id
        return GPT.from_pretrained(source, device=device, pad_vocab_multiple=pad_vocab_multiple)
    if source.is_file():
        parent = source.parent
        hint = (f"; pass its directory {str(parent)!r}"
                if (parent / "config.json").is_file() or (parent / "trainer_state.json").is_file() else "")
        raise NotADirectoryError(
            f"{spec!r} is a file; a model is a directory: a transformers model (config.json + "
            f"model.safetensors) or a gpt2 checkpoint / run directory{hint}"
        )
    if (source / "config.json").is_file():  # a transformers directory (missing weights are named)
        return GPT.from_pretrained(source, device=device, pad_vocab_multiple=pad_vocab_multiple)
    is_checkpoint_like = ((source / "trainer_state.json").exists() or (source / "checkpoints").is_dir()
                          or checkpoint_step(source) is not None
                          or any(checkpoint_step(p) is not None for p in source.iterdir()))
    if not is_checkpoint_like:
        found = sorted(p.name for p in source.iterdir())[:10]
        hub = f"; for the hub model {source.name!r} write its bare name" if source.name in _official_names() else ""
        raise FileNotFoundError(
            f"{spec!r} holds no model: neither a transformers directory (no config.json) nor a gpt2 "
            f"checkpoint (no trainer_state.json) or run directory (no checkpoints/); found {found}{hub}"
        )
    return load_trained_model(source, device=device)


def _official_names() -> frozenset[str]:
    from .hf import OFFICIAL_HUB_IDS

    return OFFICIAL_HUB_IDS


def load_trained_model(path: str | os.PathLike[str], device: torch.device | str | None = None) -> Any:
    """The GPT in a checkpoint (or the newest *intact* checkpoint of a run directory: damaged ones
    are skipped with a warning) of ``gpt2 train``."""
    from .checkpoint import load_state_into, open_checkpoint
    from .config import GPTConfig
    from .model import GPT

    data = open_checkpoint(path, trainer_state=False)  # verified: files, header, size, finite weights
    checkpoint, meta = data.path, data.meta
    model_config = meta.get("model_config")
    if not isinstance(model_config, dict):
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} does not record its model configuration "
            f"('model_config' in trainer_state.json), so the model cannot be rebuilt from it"
        )
    if meta.get("trainable_only") or data.trainable_only:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds only the trainable (adapter) weights; load the base "
            f"model and pass this run's adapter with --adapter instead"
        )
    try:
        model = GPT(GPTConfig.from_dict(model_config))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {str(checkpoint)!r}: 'model_config' in trainer_state.json is not a valid "
                         f"GPTConfig ({e})") from None
    load_state_into(model, data)
    logger.info("loaded %s (%s parameters)", checkpoint, f"{model.num_params():,}")
    return model.to(device or "cpu").eval()


def apply_adapter(model: Any, path: str | os.PathLike[str]) -> Any:
    """Add the LoRA adapter at ``path`` to ``model``: one saved by :func:`minlora.save_adapter`
    (``gpt2 finetune`` writes ``<out_dir>/adapter``) or a PEFT adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    import minlora

    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"adapter {str(path)!r} does not exist")
    if path.is_dir() and (path / "adapter_config.json").is_file():
        minlora.import_peft_adapter(model, path)
    else:
        minlora.load_adapter(model, path)
    logger.info("applied LoRA adapter %s (%d LoRA layers, %s parameters)", path, len(minlora.lora_sites(model)),
                f"{sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n):,}")
    return model


# --------------------------------------------------------------------------- sampling
def stream_text(
    model: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    tokenizer: Any = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_at_eot: bool = True,
    autocast: Any = None,
) -> Iterator[str]:
    """Yield the text of one sample piece by piece, as tokens are sampled.

    An empty ``prompt`` starts from ``<|endoftext|>`` (an unconditional sample). A token that
    ends inside a multi-byte UTF-8 character is held back until the character is complete, so
    every yielded piece is valid text. ``autocast`` is a zero-argument callable returning the
    context to sample in (e.g. ``PrecisionPolicy.autocast``), or None.
    """
    import contextlib

    if tokenizer is None:
        from .tokenizer import get_tokenizer

        tokenizer = get_tokenizer()
    eot = tokenizer.eot_token
    ids = tokenizer.encode(prompt) if prompt else [eot]
    idx = torch.tensor([ids], dtype=torch.long)
    produced: list[int] = []
    shown = ""
    from .generate import stream

    with (autocast() if autocast is not None else contextlib.nullcontext()):
        # gpt2.generate.stream rather than model.stream: a torch.compile'd model then runs compiled.
        tokens = stream(
            model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            eos_token_id=eot if stop_at_eot else None, generator=generator,
        )
        for column in tokens:  # (1,)
            token = int(column[0])
            if stop_at_eot and token == eot:
                break
            produced.append(token)
            text = tokenizer.decode(produced)
            if text.endswith("\ufffd"):  # a character split across tokens: wait for its rest
                continue
            yield text[len(shown):]
            shown = text
    text = tokenizer.decode(produced)
    if len(text) > len(shown):
        yield text[len(shown):]


def print_samples(model: Any, args: argparse.Namespace, *, header: str = "", autocast: Any = None) -> list[str]:
    """``args.num_samples`` samples of ``args.prompt``, streamed to stdout; returns their texts.

    Reads ``prompt``, ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed`` from
    ``args`` (``top_p`` and ``seed`` may be absent). With ``args.instruction`` the prompt is the
    instruction template (:func:`gpt2.instruct.render_prompt`) and only the response is shown."""
    instruction = _apply_instruction(args)
    device = next(model.parameters()).device
    seed = getattr(args, "seed", None)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    texts = []
    for i in range(args.num_samples):
        title = f"{header} sample {i + 1}/{args.num_samples}".strip()
        print(f"--- {title} ---")
        if not instruction:
            print(args.prompt, end="", flush=True)
        pieces = []
        for piece in stream_text(
            model, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=getattr(args, "top_p", None), generator=generator, autocast=autocast,
        ):
            pieces.append(piece)
            print(piece, end="", flush=True)
        print()
        texts.append("".join(pieces) if instruction else args.prompt + "".join(pieces))
    return texts


def _apply_instruction(args: argparse.Namespace) -> bool:
    """With ``--instruction`` (and ``--input``), set ``args.prompt`` to the instruction template."""
    instruction = getattr(args, "instruction", None)
    if not instruction:
        if getattr(args, "input", None):
            raise UsageError("--input goes with --instruction (it fills the template's '### Input:' part)")
        return False
    from .instruct import render_prompt

    args.prompt = render_prompt(instruction, getattr(args, "input", None) or "")
    return True


def _check_sampling(args: argparse.Namespace) -> None:
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1 (or none), got {args.top_k}")
    top_p = getattr(args, "top_p", None)
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (or none), got {top_p}")


def _inference_autocast(precision: str, device: torch.device) -> Any:
    from .precision import resolve_precision

    policy = resolve_precision(precision, device)
    policy.apply()
    return policy.autocast


def sample_job(args: argparse.Namespace) -> int:
    """``gpt2 sample``: stream text from a hub id, a transformers directory, a checkpoint or run
    directory of ``gpt2 train``, optionally with a LoRA adapter."""
    _check_sampling(args)
    device = resolve_device(args.device)
    model = load_model(args.model, device=device)
    if args.adapter:
        apply_adapter(model, args.adapter)
    model.eval()
    if args.compile:
        model = torch.compile(model)
    autocast = _inference_autocast(args.precision, device)
    print_samples(model, args, autocast=autocast)
    return 0


# --------------------------------------------------------------------------- prepare
def _documents(inputs: list[Path], text_field: str) -> Iterator[str]:
    """Text files give one document each; ``.jsonl`` files one per line (its ``text_field``)."""
    for path in inputs:
        if path.suffix.lower() == ".jsonl":
            from .data import iter_jsonl

            for line_no, row in iter_jsonl(path):
                if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                    raise ValueError(
                        f"{path}:{line_no}: expected a JSON object with a string field {text_field!r} "
                        f"(choose the field with --text-field)"
                    )
                yield row[text_field]
        else:
            from .data import read_text

            yield read_text(path)


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


def _dataset_documents(args: argparse.Namespace) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "tokenising a Hugging Face dataset needs the `datasets` package: pip install datasets "
            "(or pass local text/jsonl files with --input)"
        ) from e
    ds = datasets.load_dataset(args.dataset, name=args.dataset_config, split=args.split, streaming=True)
    for row in ds:
        text = row.get(args.text_field)
        if not isinstance(text, str):
            raise ValueError(
                f"dataset {args.dataset!r} rows have no string field {args.text_field!r} "
                f"(fields: {sorted(row)}); choose it with --text-field"
            )
        yield text


def prepare_job(args: argparse.Namespace) -> int:
    """``gpt2 prepare``: text files, jsonl files or a Hugging Face dataset -> uint16 token shards."""
    from .data import load_tokens, tokenize_file, write_shards

    if not args.input and not args.dataset:
        raise UsageError("nothing to tokenise: give --input FILE... (text/jsonl files or directories) or --dataset NAME")
    if args.max_docs is not None and args.max_docs < 1:
        raise UsageError(f"--max-docs must be >= 1, got {args.max_docs}")
    start = time.time()
    if args.input:  # local files win over a --dataset default (e.g. prepare_fineweb.py's)
        files = _expand_inputs(args.input)
        if len(files) == 1 and files[0].suffix.lower() != ".jsonl":
            # One text: split by token count (the end of the text is the validation set).
            paths = tokenize_file(files[0], args.out_dir, prefix=args.prefix, shard_size=args.shard_size,
                                  val_fraction=args.val_fraction, progress=args.progress,
                                  overwrite=args.overwrite, file_format=args.format)
            return _report_shards(paths, load_tokens, start)
        docs: Iterable[str] = _documents(files, args.text_field)
    else:
        docs = _dataset_documents(args)
    if args.max_docs is not None:
        docs = itertools.islice(docs, args.max_docs)
    paths = write_shards(docs, args.out_dir, prefix=args.prefix or "shard", shard_size=args.shard_size,
                         num_workers=args.num_workers, progress=args.progress, overwrite=args.overwrite,
                         file_format=args.format)
    if len(paths) == 1:
        print(f"warning: all tokens fit in one shard, which is the val split ({paths[0].name}): "
              f"use a smaller --shard-size to get train shards too")
    return _report_shards(paths, load_tokens, start)


def _report_shards(paths: list[Path], load_tokens: Any, start: float) -> int:
    total = 0
    for p in paths:
        n = len(load_tokens(p))
        total += n
        print(f"{p}  {n:,} tokens")
    print(f"wrote {len(paths)} shard(s), {total:,} tokens in {time.time() - start:.1f} s")
    return 0


# --------------------------------------------------------------------------- eval
def _resolve_hellaswag(spec: str | None) -> Path | None:
    from .eval import hellaswag_path

    if spec is None:
        return None
    if spec == "auto":
        return hellaswag_path("val")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--hellaswag {spec!r} does not exist; give the val jsonl path or 'auto' to download it")
    return path


def eval_job(args: argparse.Namespace) -> dict[str, Any]:
    """``gpt2 eval``: validation loss / perplexity on token data and/or HellaSwag accuracy."""
    from .eval import evaluate_loss, score_hellaswag

    if args.data is None and args.hellaswag is None:
        raise UsageError("nothing to evaluate: give --data (tokens or text) and/or --hellaswag (a jsonl path or 'auto')")
    hellaswag = _resolve_hellaswag(args.hellaswag)  # before the model loads: fail fast
    source = load_token_source(args.data) if args.data is not None else None
    device = resolve_device(args.device)
    model = load_model(args.model, device=device)
    if args.adapter:
        apply_adapter(model, args.adapter)
    model.eval()
    autocast = _inference_autocast(args.precision, device)
    results: dict[str, Any] = {"model": args.model}
    if source is not None:
        seq_len = args.seq_len or min(model.config.block_size, 1024)
        if seq_len > model.config.block_size:
            raise UsageError(f"--seq-len {seq_len} exceeds the model's context (block_size {model.config.block_size})")
        split = args.split if isinstance(source, Path) else None
        if is_text(args.data) and args.val_fraction > 0:
            # A text: score its end, the same tokens `gpt2 train --val-fraction` holds out.
            source = split_tokens(source, args.val_fraction, args.data)[1]
        start = time.time()
        loss = evaluate_loss(model, source, args.batch_size, seq_len, args.max_batches, autocast, split=split,
                             device=device, progress=True)
        results.update(val_loss=loss["loss"], perplexity=loss["perplexity"], tokens=loss["tokens"])
        print(f"val loss {loss['loss']:.4f} | perplexity {loss['perplexity']:.2f} | "
              f"{loss['tokens']:,} tokens | {time.time() - start:.1f} s")
    if hellaswag is not None:
        start = time.time()
        hs = score_hellaswag(model, hellaswag, limit=args.hellaswag_limit, autocast=autocast)
        results.update(hellaswag_acc=hs["acc"], hellaswag_acc_norm=hs["acc_norm"], hellaswag_n=hs["n"])
        print(f"hellaswag acc_norm {hs['acc_norm']:.4f} | acc {hs['acc']:.4f} | {hs['n']} examples | "
              f"{time.time() - start:.1f} s")
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
    return results


# --------------------------------------------------------------------------- export
def export_job(args: argparse.Namespace) -> int:
    """``gpt2 export``: a checkpoint (optionally + adapter) -> a transformers directory, and/or
    the adapter in PEFT format."""
    import minlora

    if args.out is None and args.peft_out is None:
        raise UsageError("nothing to export: give --out DIR (transformers model) and/or --peft-out DIR (PEFT adapter)")
    if args.peft_out is not None and not args.adapter:
        raise UsageError("--peft-out needs --adapter: only a LoRA adapter can be exported in PEFT format")
    model = load_model(args.model, device="cpu")
    if args.adapter:
        apply_adapter(model, args.adapter)
        if args.peft_out is not None:
            minlora.export_peft_adapter(model, args.peft_out)
            print(f"wrote PEFT adapter {args.peft_out} (load with peft.PeftModel.from_pretrained)")
        minlora.merge_lora(model)
    if args.out is not None:
        tokenizer_dir = args.tokenizer_dir or os.environ.get("GPT2_TOKENIZER_DIR") or None
        model.save_pretrained(args.out, tokenizer_dir=tokenizer_dir)
        what = "merged model" if args.adapter else "model"
        print(f"wrote {what} {args.out} (load with transformers.GPT2LMHeadModel.from_pretrained)")
    return 0


# --------------------------------------------------------------------------- training
def model_config_from(args: argparse.Namespace) -> Any:
    """The :class:`gpt2.GPTConfig` of ``--model`` with the ``--n-layer`` / ``--n-head`` /
    ``--n-embd`` / ``--block-size`` / ``--dropout`` / ``--pad-vocab-multiple`` / ``--flash``
    overrides; the context defaults to ``--seq-len``."""
    from .config import GPTConfig

    if args.model not in SHAPES:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(SHAPES)}")
    dims = dict(SHAPES[args.model])
    for name in ("n_layer", "n_head", "n_embd"):
        if getattr(args, name) is not None:
            dims[name] = getattr(args, name)
    return GPTConfig(
        block_size=args.block_size or args.seq_len, dropout=args.dropout, flash=args.flash,
        pad_vocab_multiple=args.pad_vocab_multiple, **dims,
    )


def train_config_from(args: argparse.Namespace, **overrides: Any) -> Any:
    """A :class:`gpt2.TrainConfig` from the options that carry its field names."""
    import dataclasses

    from .config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if isinstance(values.get("fused_adamw"), str) and values["fused_adamw"] != "auto":
        values["fused_adamw"] = values["fused_adamw"].lower() in ("true", "yes", "1", "on")
    values.update(overrides)
    return TrainConfig(**values)


class HellaSwagCallback:
    """A Trainer callback: HellaSwag every ``interval`` steps and after the last one.

    It runs on every rank (each scores its share of the examples) inside ``Trainer.fit``, so
    training is never paused (no extra checkpoints) and the scores land in the step's record:
    ``hellaswag_acc`` / ``hellaswag_acc_norm`` / ``hellaswag_n`` in metrics.jsonl, which a resumed
    run truncates and continues like every other metric.
    """

    def __init__(self, path: Path, interval: int, limit: int | None) -> None:
        self.path, self.interval, self.limit = path, interval, limit
        self.last: dict[str, Any] | None = None

    def __call__(self, trainer: Any, record: dict[str, Any]) -> None:
        step = record["step"]
        if step == trainer.config.max_steps or (self.interval > 0 and step % self.interval == 0):
            result = self.score(trainer)
            record.update(hellaswag_acc=result["acc"], hellaswag_acc_norm=result["acc_norm"],
                          hellaswag_n=result["n"])

    def score(self, trainer: Any) -> dict[str, Any]:
        from .eval import score_hellaswag

        env = trainer.dist_env
        start = time.time()
        # The raw model, not the compiled one: every example has its own length, which would make
        # torch.compile recompile again and again.
        result = score_hellaswag(trainer.model, self.path, limit=self.limit, autocast=trainer.precision.autocast,
                                 rank=env.rank, world_size=env.world_size)
        self.last = {"step": trainer.step, **result}
        if trainer.is_main:
            print(f"step {trainer.step} | hellaswag acc_norm {result['acc_norm']:.4f} | acc {result['acc']:.4f} | "
                  f"{result['n']} examples | {time.time() - start:.1f} s", flush=True)
        return self.last


def _fit(trainer: Any, hellaswag: HellaSwagCallback | None) -> dict[str, Any] | None:
    """``trainer.fit()``; the last HellaSwag result (scored now if the run was already complete)."""
    trainer.fit()
    if hellaswag is None:
        return None
    return hellaswag.last if hellaswag.last is not None else hellaswag.score(trainer)


def _val_loss(trainer: Any, val: Any, max_batches: int | None) -> dict[str, float]:
    """Validation loss of ``trainer.model`` over ``val`` (at most ``max_batches`` batches). Under
    DDP every rank must call this: each scores its share of the batches and the sums are
    all-reduced, so no rank waits in a collective while rank 0 evaluates alone."""
    from .eval import evaluate_loss

    split = "val" if isinstance(val, Path) else None
    return evaluate_loss(trainer.model, val, trainer.config.micro_batch_size, trainer.config.seq_len,
                         max_batches=max_batches, autocast=trainer.precision.autocast, split=split,
                         device=trainer.device, distributed=True,
                         progress=trainer.config.progress and trainer.is_main)


def _final_report(trainer: Any, args: argparse.Namespace, val: Any, *, extra: dict[str, Any] | None = None,
                  header: str = "") -> dict[str, Any]:
    """Validation loss over the val data (or ``--final-eval-batches`` of it), then on rank 0
    samples and ``results.json`` in the run directory. Every rank calls this (under DDP the
    evaluation is split across the ranks); ranks other than 0 return ``{}``."""
    results: dict[str, Any] = {"step": trainer.step, **(extra or {})}
    if val is not None:
        loss = _val_loss(trainer, val, args.final_eval_batches)
        results.update(val_loss=loss["loss"], perplexity=loss["perplexity"], val_tokens=loss["tokens"])
        if trainer.is_main:
            print(f"val loss {loss['loss']:.4f} | perplexity {loss['perplexity']:.2f} | {loss['tokens']:,} tokens")
    if not trainer.is_main:
        return {}
    if args.num_samples > 0:
        results["samples"] = print_samples(trainer.model, args, header=header, autocast=trainer.precision.autocast)
    if trainer.out_dir is not None:
        trainer.out_dir.mkdir(parents=True, exist_ok=True)
        path = trainer.out_dir / "results.json"
        path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return results


def _check_train_args(args: argparse.Namespace) -> None:
    if args.num_samples < 0:
        raise UsageError(f"--num-samples must be >= 0, got {args.num_samples}")
    if args.num_samples:
        _check_sampling(args)
    if getattr(args, "hellaswag_interval", 0) < 0:
        raise UsageError(f"--hellaswag-interval must be >= 0, got {args.hellaswag_interval}")


def check_options(command: str, args: argparse.Namespace) -> None:
    """Build the configs of a ``train`` / ``finetune`` job (and nothing else) to check its options:
    what a launcher runs before starting the processes that would each report the same error."""
    if command in ("train", "finetune"):
        _check_train_args(args)
        train_config_from(args)
        for data in (args.data, args.val_data):
            if data is not None:
                shakespeare_or_path(data)  # exists (Tiny Shakespeare: downloaded once, here)
    if command == "train":
        model_config_from(args)
    elif command == "finetune":
        lora_config_from(args)


def train_job(args: argparse.Namespace) -> dict[str, Any]:
    """``gpt2 train``: pretrain a GPT-2 from scratch, then report validation loss and samples."""
    from .model import GPT
    from .trainer import Trainer, seed_everything

    _check_train_args(args)
    model_config = model_config_from(args)
    config = train_config_from(args)
    hellaswag = _resolve_hellaswag(args.hellaswag)
    train, val = training_data(args.data, args.val_data, args.val_fraction)
    seed_everything(args.seed)  # --seed fixes the initial weights too, not only the data order
    model = GPT(model_config)
    start = time.time()
    callback = HellaSwagCallback(hellaswag, args.hellaswag_interval, args.hellaswag_limit) if hellaswag else None
    with Trainer(model, config, train, val, callbacks=[callback] if callback else ()) as trainer:
        if trainer.is_main:
            print(f"GPT {args.model}: {model.num_params():,} parameters ({model_config.n_layer} layers, "
                  f"{model_config.n_head} heads, {model_config.n_embd} wide, context {model_config.block_size}); "
                  f"{trainer.tokens_per_step:,} tokens per step, {config.max_steps} steps, {trainer.precision.name}"
                  f"{', compiled' if config.compile else ''} on {trainer.device}", flush=True)
        hs = _fit(trainer, callback)
        extra: dict[str, Any] = {"train_seconds": round(time.time() - start, 1)}
        if hs is not None:
            extra["hellaswag"] = hs
        results = _final_report(trainer, args, val, extra=extra)  # every rank: the evaluation is split
        if trainer.is_main and trainer.out_dir is not None:
            _print_next_steps(trainer.out_dir, args)
        return results


def _print_next_steps(out_dir: Path, args: argparse.Namespace) -> None:
    """Rank 0, at the end of ``gpt2 train``: where the outputs are and three commands to try next.
    The commands name only files and the run directory (no environment variables), so they work
    from the same directory in a new shell."""
    import shlex

    run = shlex.quote(str(out_dir))
    print(f"\noutputs in {out_dir}/:")
    for entry in sorted(out_dir.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            names = sorted(p.name for p in entry.iterdir())
            what = ", ".join(names) if len(names) <= 3 else f"{len(names)}: ..., {names[-2]}, {names[-1]}"
        else:
            what = f"{entry.stat().st_size:,} bytes"
        print(f"  {entry.name}{'/' if entry.is_dir() else ''}  ({what})")
    prompt = shlex.quote(args.prompt or "ROMEO:")
    # The training text (and its held-out fraction, when not the default) for fine-tuning and eval.
    data = shlex.quote(str(args.data)) + (f" --val-fraction {args.val_fraction:g}" if args.val_fraction != 0.1 else "")
    print("next, try:")
    print(f"  gpt2 sample --model {run} --prompt {prompt} --max-new-tokens 100   # sample from the model")
    instructions = Path("examples/data/instructions.jsonl")  # in the checkout (docs/lora.md)
    if instructions.is_file():
        print(f"  gpt2 finetune --init {run} --data {instructions} --full --out-dir "
              f"{shlex.quote(str(out_dir) + '-instruct')}   # instruction fine-tuning (docs/lora.md)")
    else:
        print(f"  gpt2 finetune --init {run} --data {data} --out-dir {shlex.quote(str(out_dir) + '-lora')}"
              "   # LoRA fine-tune it")
    print(f"  gpt2 eval --model {run} --data {data}   # validation loss of the saved model")


# --------------------------------------------------------------------------- fine-tuning
def lora_config_from(args: argparse.Namespace) -> Any:
    import minlora

    return minlora.LoRAConfig(
        rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
        target_modules=tuple(args.lora_targets) or None, include_lm_head=args.lora_head,
        include_embeddings=args.lora_embeddings,
    )


def finetune_job(args: argparse.Namespace) -> dict[str, Any]:
    """``gpt2 finetune``: LoRA (or with ``--full`` full) fine-tuning of pretrained GPT-2 weights on
    a text, or on instruction rows (``--data x.jsonl``, see :mod:`gpt2.instruct`), with samples
    before and after, the adapter saved, and optionally a merged transformers export."""
    import minlora

    from .trainer import Trainer, seed_everything

    _check_train_args(args)
    if args.lora_head and args.merge_export:
        # Merging LoRA on the tied head unties it (head W + BA, embedding W), but GPT-2's
        # transformers format always ties the two: the export could not hold the merged model.
        raise UsageError(
            "--merge-export cannot hold a merged --lora-head adapter: transformers' GPT-2 ties the LM head to "
            "the token embedding, and merging LoRA into the head unties them. Drop --lora-head, or keep the "
            "adapter (and --peft-export) without merging"
        )
    full = bool(getattr(args, "full", False))
    if full and args.peft_export:
        raise UsageError("--peft-export writes a LoRA adapter; --full trains all weights and has none (drop one)")
    lora_config = lora_config_from(args)
    model = load_model(args.init, device="cpu")
    model.train()
    if args.seq_len > model.config.block_size:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's context (block_size {model.config.block_size})")
    # LoRA checkpoints hold the adapter only; --full ones the whole model (gpt2 sample --model out_dir)
    config = train_config_from(args, save_trainable_only=not full)
    from .instruct import is_instruction_data

    if is_instruction_data(args.data):
        train, val = _instruction_data(args, config)
    else:
        train, val = training_data(args.data, args.val_data, args.val_fraction)
    # The before/after val loss covers the whole val data: every rank scores its share of it
    # (see _val_loss), so it needs the unsharded instruction loader, not this rank's part.
    report_val = val.unsharded() if hasattr(val, "unsharded") else val
    seed_everything(args.seed)  # --seed fixes LoRA's random A matrices too, not only the data order
    if not full:
        minlora.add_lora(model, lora_config=lora_config)
        minlora.mark_only_lora_as_trainable(model)
    with Trainer(model, config, train, val) as trainer:
        main = trainer.is_main
        if main and full:
            print(f"full fine-tuning of {args.init}: {sum(p.numel() for p in model.parameters()):,} parameters",
                  flush=True)
        elif main:
            print(f"LoRA rank {lora_config.rank}, alpha {lora_config.alpha:g} on {args.init}: "
                  f"{minlora.count_parameters(model)}", flush=True)
        before: dict[str, Any] = {}
        if trainer.step == 0:  # a resumed run has no "before"
            if val is not None:
                # LoRA's B starts at zero, so this is the pretrained model's own loss. Every rank
                # evaluates its share (see _val_loss).
                loss = _val_loss(trainer, report_val, args.final_eval_batches)
                before["val_loss_before"] = loss["loss"]
                if main:
                    print(f"before fine-tuning: val loss {loss['loss']:.4f} | perplexity {loss['perplexity']:.2f}")
            if main and args.num_samples > 0:
                before["samples_before"] = print_samples(trainer.model, args, header="before fine-tuning:",
                                                         autocast=trainer.precision.autocast)
        trainer.fit()
        results = _final_report(trainer, args, report_val, extra=before, header="after fine-tuning:")  # every rank
        if not main:
            return {}
        out = Path(config.out_dir or ".")
        if full:
            _finish_full(trainer, args, results, out)
            return results
        adapter = minlora.save_adapter(trainer.model, out / "adapter")
        results["adapter"] = str(adapter)
        print(f"saved adapter {adapter} (gpt2 sample --model {args.init} --adapter {adapter})")
        if args.peft_export:
            minlora.export_peft_adapter(trainer.model, args.peft_export)
            print(f"wrote PEFT adapter {args.peft_export}")
        if args.merge_export:
            minlora.merge_lora(trainer.model)
            tokenizer_dir = os.environ.get("GPT2_TOKENIZER_DIR") or None
            trainer.model.save_pretrained(args.merge_export, tokenizer_dir=tokenizer_dir)
            print(f"wrote merged model {args.merge_export} (transformers.GPT2LMHeadModel.from_pretrained loads it)")
        if config.out_dir is not None:
            (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        return results


def _instruction_data(args: argparse.Namespace, config: Any) -> tuple[Any, Any]:
    """Loaders of instruction rows (``--data x.jsonl``); the samples default to the first
    validation row's instruction (the first training row's without validation)."""
    from .distributed import env_from_environ
    from .instruct import instruction_loaders

    env = env_from_environ()
    train, val, rows = instruction_loaders(
        args.data, args.val_data, args.val_fraction, batch_size=config.micro_batch_size, seq_len=config.seq_len,
        pack=bool(getattr(args, "pack", False)), seed=config.seed, rank=env.rank, world_size=env.world_size,
    )
    if env.is_main:
        print(f"instruction data {args.data}: {train.num_rows} training rows in {train.num_sequences} sequences"
              f"{f', {val.num_rows} validation rows' if val is not None else ''}; loss on "
              f"{train.num_targets:,} response tokens", flush=True)
    if not getattr(args, "instruction", None):
        args.instruction, args.input = rows[0][0], rows[0][1]
    return train, val


def _finish_full(trainer: Any, args: argparse.Namespace, results: dict[str, Any], out: Path) -> None:
    """After ``--full`` fine-tuning: the run directory's checkpoint is the model; optionally also
    a transformers directory (``--merge-export``: nothing to merge, the weights are written)."""
    if trainer.out_dir is not None:
        print(f"saved the fine-tuned model in {out} (gpt2 sample --model {out})")
    if args.merge_export:
        tokenizer_dir = os.environ.get("GPT2_TOKENIZER_DIR") or None
        trainer.model.save_pretrained(args.merge_export, tokenizer_dir=tokenizer_dir)
        print(f"wrote {args.merge_export} (transformers.GPT2LMHeadModel.from_pretrained loads it)")


# --------------------------------------------------------------------------- benchmark
def bench_job(args: argparse.Namespace) -> list[Any]:
    """``gpt2 bench``: the speed-up ladder of :mod:`gpt2.bench`, printed as a table."""
    from .bench import RUNGS, format_table, run_ladder

    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()] if args.rungs else list(RUNGS)
    where = torch.cuda.get_device_name() if uses_cuda(args.device) else "CPU"
    print(f"{args.model}, B={args.batch_size}, T={args.seq_len}, {args.repeats} x {args.steps} timed steps after "
          f"{args.warmup} warm-up steps per rung, on {where} (torch {torch.__version__})", flush=True)
    results = run_ladder(
        args.model, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
        repeats=args.repeats, rungs=rungs, device=args.device, compile=args.compile, peak_flops=args.peak_flops,
        vocab_size=args.vocab_size,
        # one line per rung as it finishes (a compiled rung takes a minute), then the table
        on_result=lambda r: print(f"  {r.rung}: " + (r.note if r.skipped else f"{r.ms_per_step:.1f} ms/step"),
                                  flush=True),
    )
    print()
    print(format_table(results))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": where, "torch": torch.__version__,
                                   "results": [r.to_dict() for r in results]}, indent=2) + "\n")
        print(f"wrote {out}")
    return results
