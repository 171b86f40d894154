"""``gpt2 train``: pretrain a GPT-2 from scratch, then report validation loss and samples."""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from gpt2.cli.common import (
    DataOptions,
    LaunchOptions,
    SamplingOptions,
    check_run,
    final_report,
    finished_results,
    program,
)
from gpt2.cli.layers import Flat, Options, UsageError
from gpt2.data.instruct import is_instruction_data
from gpt2.data.sources import training_data
from gpt2.eval.hellaswag import HellaSwagCallback, resolve_hellaswag
from gpt2.model.config import SHAPE_NAMES, GPTConfig
from gpt2.model.gpt import GPT
from gpt2.train.config import TrainConfig
from gpt2.train.rundir import LOCK_FILE
from gpt2.train.trainer import Trainer, seed_everything


@dataclass
class ModelShape:
    model: Literal[SHAPE_NAMES] = "mini"
    """model shape: a GPT-2 preset (gpt2 = 124M), mini (4 layers x 128) or tiny (2 x 32)"""
    n_layer: int | None = None
    """override the shape's number of layers"""
    n_head: int | None = None
    """override the shape's number of heads"""
    n_embd: int | None = None
    """override the shape's width"""
    block_size: int | None = None
    """context length of the model; None = --seq-len"""
    dropout: float = 0.0
    """dropout probability"""
    pad_vocab_multiple: int = 1
    """round the vocabulary up to a multiple of this (64: 50257 -> 50304, faster on GPUs)"""
    flash: bool = True
    """scaled_dot_product_attention (flash attention on GPUs); False = explicit softmax attention"""


@dataclass
class TrainOptions(Options):
    """gpt2 train: pretrain a GPT-2 from scratch; report validation loss and samples."""

    data: Annotated[DataOptions, Flat] = field(default_factory=DataOptions)
    shape: Annotated[ModelShape, Flat] = field(default_factory=ModelShape)
    train: Annotated[TrainConfig, Flat] = field(default_factory=TrainConfig)
    final_eval_batches: int | None = None
    """batches of the final validation loss; None = the whole validation data"""
    hellaswag: str | None = None
    """score HellaSwag (val jsonl path, or 'auto' to download and cache it) during and after training"""
    hellaswag_interval: int = 250
    """HellaSwag every N steps (and at the end); 0 = only at the end"""
    hellaswag_limit: int | None = None
    """score only the first N HellaSwag examples"""
    launch: Annotated[LaunchOptions, Flat] = field(default_factory=LaunchOptions)
    sampling: Annotated[SamplingOptions, Flat] = field(default_factory=SamplingOptions)


def model_config(shape: ModelShape, seq_len: int) -> GPTConfig:
    """The GPTConfig of ``--model`` with the ``--n-layer`` / ``--n-head`` / ``--n-embd`` / ...
    overrides; the context defaults to ``--seq-len``.
    """
    # Every field but the shape's name is a GPTConfig field; None keeps the shape's value (a block
    # size of 0 goes through: GPTConfig refuses it).
    overrides = {name: value for name, value in asdict(shape).items() if name != "model" and value is not None}
    return GPTConfig.from_name(shape.model, **{"block_size": seq_len, **overrides})


def check(options: TrainOptions) -> GPTConfig:
    """What can be checked before any data is read or any process started; returns the model's config."""
    check_run(options)
    if options.hellaswag_interval < 0:
        raise UsageError(f"--hellaswag-interval must be >= 0, got {options.hellaswag_interval}")
    for flag, data in (("--data", options.data.data), ("--val-data", options.data.val_data)):
        # A .jsonl or .json file would be read as raw JSON text.
        if is_instruction_data(data):
            raise UsageError(
                f"{flag}: a {Path(data).suffix} file is no text: gpt2 prepare tokenises a .jsonl's 'text' fields, "
                "gpt2 finetune trains on instruction rows"
            )
    return model_config(options.shape, options.train.seq_len)


def train(options: TrainOptions) -> dict[str, Any]:
    gpt_config = check(options)
    config = options.train
    hellaswag = resolve_hellaswag(options.hellaswag)
    train_data, val = training_data(options.data.data, options.data.val_data, options.data.val_fraction)
    # --seed fixes the initial weights too, not only the data order.
    seed_everything(config.seed)
    model = GPT(gpt_config)
    callbacks = []
    if hellaswag:
        callbacks.append(HellaSwagCallback(hellaswag, options.hellaswag_interval, options.hellaswag_limit))
    start = time.time()
    with Trainer(model, config, train_data, val, callbacks=callbacks) as trainer:
        done = finished_results(trainer)
        if done is not None:
            return _report_done(trainer, done, options)
        if trainer.is_main:
            print(_run_line(options, model, trainer), flush=True)
        trainer.fit()
        extra: dict[str, Any] = {"train_seconds": round(time.time() - start, 1)}
        # A run that was already complete scored nothing during it: it is scored now.
        if callbacks:
            extra["hellaswag"] = callbacks[0].last or callbacks[0].score(trainer)
        # every rank: the evaluation is split
        results = final_report(
            trainer, val, options.sampling, final_eval_batches=options.final_eval_batches, extra=extra
        )
        if trainer.is_main and trainer.out_dir is not None:
            print_next_steps(trainer.out_dir, options)
        return results


def _run_line(options: TrainOptions, model: GPT, trainer: Trainer) -> str:
    """The model's shape and size, and how it trains."""
    shape, config = model.config, options.train
    how = trainer.precision.name
    if config.compile:
        how += ", compiled"
    return (
        f"GPT {options.shape.model}: {model.num_params():,} parameters ({shape.n_layer} layers, "
        f"{shape.n_head} heads, {shape.n_embd} wide, context {shape.block_size}); "
        f"{trainer.tokens_per_step:,} tokens per step, {config.max_steps} steps, {how} on {trainer.device}"
    )


def _report_done(trainer: Trainer, results: dict[str, Any], options: TrainOptions) -> dict[str, Any]:
    """A finished run started again: its ``results.json`` (see :func:`gpt2.cli.common.finished_results`)."""
    if not trainer.is_main:
        return {}
    line = f"already done: {trainer.out_dir} reached step {trainer.step}"
    if isinstance(results.get("val_loss"), (int, float)):
        line += f"; val loss {results['val_loss']:.4f}"
    print(f"{line} (from results.json)")
    print_next_steps(trainer.out_dir, options)
    return results


def print_next_steps(out_dir: Path, options: TrainOptions) -> None:
    """Where the outputs are and three commands to try next. They name only files, the run directory
    and the ``gpt2`` program (by its path when its virtual environment is not activated: see
    :func:`gpt2.cli.common.program`), so they work from the same directory in a new shell.
    """
    print(f"\noutputs in {out_dir}/:")
    for entry in sorted(out_dir.iterdir()):
        # the lock is released on exit
        if not entry.name.startswith(".") and entry.name != LOCK_FILE:
            print(f"  {_describe(entry)}")
    run = shlex.quote(str(out_dir))
    prompt = shlex.quote(options.sampling.prompt or "ROMEO:")
    # The training text (and its held-out fraction, when not the default) for fine-tuning and eval.
    data = shlex.quote(str(options.data.data))
    if options.data.val_fraction != 0.1:
        data += f" --val-fraction {options.data.val_fraction:g}"
    gpt2 = shlex.quote(program("gpt2"))
    finetune = f"{gpt2} finetune --init {run}"
    # the finetune recipe's 64 tokens would not fit a shorter context
    context = model_config(options.shape, options.train.seq_len).block_size
    if context < 64:
        finetune += f" --seq-len {context}"
    # In the checkout, docs/lora.md's instruction rows; elsewhere, LoRA on the training text.
    instructions = Path("examples/data/instructions.jsonl")
    if instructions.is_file():
        finetune += f" --data {instructions} --full --max-lr 2e-3 --micro-batch-size 8 --max-steps 150 --out-dir "
        finetune += f"{shlex.quote(str(out_dir) + '-instruct')}   # instruction tuning (docs/lora.md)"
    else:
        finetune += f" --data {data} --out-dir {shlex.quote(str(out_dir) + '-lora')}   # LoRA fine-tune it"
    print("next, try:")
    print(f"  {gpt2} sample --model {run} --prompt {prompt} --max-new-tokens 100   # sample from the model")
    print(f"  {finetune}")
    print(f"  {gpt2} eval --model {run} --data {data}   # validation loss of the saved model")


def _describe(entry: Path) -> str:
    """A file with its size, a folder with its first (or last two) entries."""
    if not entry.is_dir():
        return f"{entry.name}  ({entry.stat().st_size:,} bytes)"
    names = sorted(p.name for p in entry.iterdir())
    listing = ", ".join(names)
    if len(names) > 3:
        listing = f"{len(names)}: ..., {names[-2]}, {names[-1]}"
    return f"{entry.name}/  ({listing})"
