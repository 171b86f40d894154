"""``gpt2 train``: pretrain a GPT-2 from scratch, then report validation loss and samples."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

from gpt2.cli.common import UsageError, check_sampling, final_report, model_config
from gpt2.cli.options import TrainOptions
from gpt2.data.sources import shakespeare_or_path, training_data
from gpt2.eval.hellaswag import HellaSwagCallback, resolve_hellaswag
from gpt2.model.gpt import GPT
from gpt2.train.rundir import LOCK_FILE, check_out_dir
from gpt2.train.trainer import Trainer, seed_everything


def check(options: TrainOptions) -> None:
    """What can be checked before any data is read or any process started."""
    if options.train.out_dir is not None:
        check_out_dir(options.train.out_dir)  # a file, or not writable: one error before any work
    check_sampling(options.sampling, allow_none=True)
    if options.hellaswag_interval < 0:
        raise UsageError(f"--hellaswag-interval must be >= 0, got {options.hellaswag_interval}")
    model_config(options.shape, options.train.seq_len)
    for data in (options.data.data, options.data.val_data):
        if data is not None:
            shakespeare_or_path(data)  # it exists (Tiny Shakespeare: downloaded once, here)


def train(options: TrainOptions) -> dict[str, Any]:
    check(options)
    config = options.train
    gpt_config = model_config(options.shape, config.seq_len)
    hellaswag = resolve_hellaswag(options.hellaswag)
    train_data, val = training_data(options.data.data, options.data.val_data, options.data.val_fraction)
    seed_everything(config.seed)  # --seed fixes the initial weights too, not only the data order
    model = GPT(gpt_config)
    callback = HellaSwagCallback(hellaswag, options.hellaswag_interval, options.hellaswag_limit) if hellaswag else None
    start = time.time()
    with Trainer(model, config, train_data, val, callbacks=[callback] if callback else ()) as trainer:
        if trainer.is_main:
            print(
                f"GPT {options.shape.model}: {model.num_params():,} parameters ({gpt_config.n_layer} layers, "
                f"{gpt_config.n_head} heads, {gpt_config.n_embd} wide, context {gpt_config.block_size}); "
                f"{trainer.tokens_per_step:,} tokens per step, {config.max_steps} steps, {trainer.precision.name}"
                f"{', compiled' if config.compile else ''} on {trainer.device}",
                flush=True,
            )
        trainer.fit()
        extra: dict[str, Any] = {"train_seconds": round(time.time() - start, 1)}
        if callback is not None:  # the last HellaSwag score (scored now if the run was already complete)
            extra["hellaswag"] = callback.last if callback.last is not None else callback.score(trainer)
        results = final_report(
            trainer, val, options.sampling, final_eval_batches=options.final_eval_batches, extra=extra
        )  # every rank: the evaluation is split
        if trainer.is_main and trainer.out_dir is not None:
            print_next_steps(trainer.out_dir, options)
        return results


def print_next_steps(out_dir: Path, options: TrainOptions) -> None:
    """Where the outputs are and three commands to try next. They name only files and the run
    directory (no environment variables), so they work from the same directory in a new shell."""
    run = shlex.quote(str(out_dir))
    print(f"\noutputs in {out_dir}/:")
    for entry in sorted(out_dir.iterdir()):
        if entry.name.startswith(".") or entry.name == LOCK_FILE:  # the lock is released on exit
            continue
        if entry.is_dir():
            names = sorted(p.name for p in entry.iterdir())
            what = ", ".join(names) if len(names) <= 3 else f"{len(names)}: ..., {names[-2]}, {names[-1]}"
        else:
            what = f"{entry.stat().st_size:,} bytes"
        print(f"  {entry.name}{'/' if entry.is_dir() else ''}  ({what})")
    prompt = shlex.quote(options.sampling.prompt or "ROMEO:")
    # The training text (and its held-out fraction, when not the default) for fine-tuning and eval.
    data = shlex.quote(str(options.data.data))
    if options.data.val_fraction != 0.1:
        data += f" --val-fraction {options.data.val_fraction:g}"
    print("next, try:")
    print(f"  gpt2 sample --model {run} --prompt {prompt} --max-new-tokens 100   # sample from the model")
    instructions = Path("examples/data/instructions.jsonl")  # in the checkout (docs/lora.md)
    if instructions.is_file():
        print(
            f"  gpt2 finetune --init {run} --data {instructions} --full --max-lr 2e-3 --micro-batch-size 8 "
            f"--max-steps 150 --out-dir {shlex.quote(str(out_dir) + '-instruct')}   # instruction tuning "
            f"(docs/lora.md)"
        )
    else:
        print(
            f"  gpt2 finetune --init {run} --data {data} --out-dir {shlex.quote(str(out_dir) + '-lora')}"
            "   # LoRA fine-tune it"
        )
    print(f"  gpt2 eval --model {run} --data {data}   # validation loss of the saved model")
