"""``gpt2 eval``: validation loss / perplexity on token data and/or HellaSwag accuracy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from gpt2.cli.common import ModelOptions, check_output_file, load_for_inference, loss_line, write_json
from gpt2.cli.layers import Flat, Options, UsageError
from gpt2.data.instruct import is_instruction_data
from gpt2.data.sources import load_token_source, split_tokens
from gpt2.eval.hellaswag import resolve_hellaswag, score_hellaswag
from gpt2.eval.loss import evaluate_loss
from gpt2.train.config import Precision


@dataclass
class EvalOptions(Options):
    """gpt2 eval: validation loss / perplexity on token data; HellaSwag accuracy."""

    source: Annotated[ModelOptions, Flat] = field(default_factory=ModelOptions)
    data: str | None = None
    """tokens to score: a shard directory (its --split shards), a .npy/.bin token file, a text file or
    'shakespeare' (a text or token file: the --val-fraction training holds out)"""
    split: str = "val"
    """which shards of a shard directory to score"""
    val_fraction: float = 0.1
    """for a text or token file: score the fraction `gpt2 train` holds out; 0 = all of it"""
    batch_size: int = 4
    """sequences per forward pass"""
    seq_len: int | None = None
    """tokens per sequence; None = the model's context, at most 1024"""
    max_batches: int | None = None
    """score at most this many batches; None = all"""
    hellaswag: str | None = None
    """HellaSwag val jsonl to score, or 'auto' to download and cache it ($GPT2_HELLASWAG overrides)"""
    hellaswag_limit: int | None = None
    """score only the first N HellaSwag examples"""
    device: str = "auto"
    """auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N"""
    precision: Precision = "auto"
    """autocast for the forward passes; auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on any CPU
    (even one with native bf16: the reference numbers; bf16 differs in the last digits)"""
    output: str | None = None
    """also write the results to this JSON file (a file gpt2 wrote is replaced; any other only with --overwrite)"""
    overwrite: bool = False
    """let --output replace an existing file that gpt2 did not write (or that changed since)"""


def evaluate(options: EvalOptions) -> dict[str, Any]:
    if options.data is None and options.hellaswag is None:
        raise UsageError("nothing to evaluate: give --data (tokens or text) and/or --hellaswag (a jsonl or 'auto')")
    if is_instruction_data(options.data):
        raise UsageError(
            f"--data {options.data}: .jsonl instruction rows are not plain text; gpt2 finetune reports their val loss"
        )
    # The output and both input files before the model loads: fail fast.
    if options.output:
        check_output_file("--output", options.output, options.overwrite)
    hellaswag = resolve_hellaswag(options.hellaswag)
    source = None
    if options.data is not None:
        source = load_token_source(options.data)
    model, autocast, device = load_for_inference(options)
    results: dict[str, Any] = {"model": options.source.model}
    if source is not None:
        results.update(_score_tokens(options, source, model, autocast, device))
    if hellaswag is not None:
        start = time.time()
        hs = score_hellaswag(model, hellaswag, limit=options.hellaswag_limit, autocast=autocast)
        results.update(hellaswag_acc=hs["acc"], hellaswag_acc_norm=hs["acc_norm"], hellaswag_n=hs["n"])
        print(
            f"hellaswag acc_norm {hs['acc_norm']:.4f} | acc {hs['acc']:.4f} | {hs['n']} examples | "
            f"{time.time() - start:.1f} s"
        )
    if options.output:
        write_json(options.output, results)
    return results


def _score_tokens(options: EvalOptions, source: Any, model: Any, autocast: Any, device: Any) -> dict[str, Any]:
    """The validation loss of ``source``: a shard directory's ``--split``, or a text or token file's end."""
    seq_len = options.seq_len
    if seq_len is None:
        seq_len = min(model.config.block_size, 1024)
    if seq_len > model.config.block_size:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's context (block_size {model.config.block_size})")
    split = None
    if isinstance(source, Path):
        split = options.split
    elif options.val_fraction != 0:
        # A text or token file: score the tokens `gpt2 train --val-fraction` holds out
        # (split_tokens refuses NaN and a fraction < 0).
        source = split_tokens(source, options.val_fraction, options.data)[1]
    name = options.source.model
    if options.source.adapter:
        name += f" with adapter {options.source.adapter}"
    start = time.time()
    args = (model, source, options.batch_size, seq_len, options.max_batches, autocast)
    loss = evaluate_loss(*args, split=split, device=device, progress=True, source=name)
    print(f"{loss_line(loss)} | {time.time() - start:.1f} s")
    return {"val_loss": loss["loss"], "perplexity": loss["perplexity"], "tokens": loss["tokens"]}
