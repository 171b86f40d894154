"""``gpt2 finetune``: LoRA or full fine-tuning, samples before and after, the adapter and exports."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Annotated, Any

import minlora
from gpt2.cli.common import (
    DataOptions,
    InstructionOptions,
    LaunchOptions,
    ModelOptions,
    SamplingOptions,
    check_run,
    final_report,
    instruction_prompt,
    program,
    write_json,
)
from gpt2.cli.export import ExportOptions, check_export_dirs, write_exports
from gpt2.cli.layers import Flat, Options, UsageError
from gpt2.data.instruct import instruction_loaders, is_instruction_data
from gpt2.data.sources import training_data
from gpt2.model.gpt import GPT
from gpt2.train import rundir
from gpt2.train.config import TrainConfig
from gpt2.train.distributed import env_from_environ
from gpt2.train.trainer import Trainer, seed_everything
from minlora import LoRAConfig


@dataclass
class FinetuneOptions(Options):
    """gpt2 finetune: LoRA (or --full) fine-tuning of GPT-2 on a text or instructions.

    Instructions: --data x.jsonl of Alpaca or prompt/response rows (docs/lora.md).
    """

    init: str = "gpt2"
    """the weights to start from: a hub id (gpt2, gpt2-medium, ...), a transformers directory, or a
    checkpoint / run directory of `gpt2 train`"""
    data: Annotated[DataOptions, Flat] = field(default_factory=DataOptions)
    # No --lora.target-types: LoRAConfig.target_types holds layer classes, which no flag can give.
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """which layers get LoRA, and its rank and scaling (minlora.LoRAConfig); --full trains every weight instead"""
    train: Annotated[TrainConfig, Flat] = field(default_factory=lambda: TrainConfig(save_trainable_only=True))
    final_eval_batches: int | None = None
    """batches of the final validation loss; None = the whole validation data"""
    peft_export: str | None = None
    """also write the adapter in PEFT format here"""
    merge_export: str | None = None
    """merge the adapter into the weights and write a transformers directory here"""
    full: bool = False
    """full fine-tuning: train every weight, no LoRA; the run directory then holds the whole model
    (gpt2 sample --model OUT_DIR)"""
    pack: bool = True
    """instruction data (.jsonl): pack rows into each sequence, each isolated (own positions, attention in the row);
    --no-pack: one row per sequence, padded"""
    instruct: Annotated[InstructionOptions, Flat] = field(default_factory=InstructionOptions)
    launch: Annotated[LaunchOptions, Flat] = field(default_factory=LaunchOptions)
    sampling: Annotated[SamplingOptions, Flat] = field(default_factory=SamplingOptions)


def check(options: FinetuneOptions) -> None:
    """What can be checked before the model is loaded or any process started."""
    check_run(options)
    instruction_prompt(options.instruct.instruction, options.instruct.input)
    val_data = options.data.val_data
    if val_data is not None and is_instruction_data(val_data) != is_instruction_data(options.data.data):
        raise UsageError("--val-data: a .jsonl goes with a .jsonl --data (instruction rows), text with text or tokens")
    # Instruction rows are packed into batches of the micro-batch size before the Trainer could search for one.
    if is_instruction_data(options.data.data) and options.train.micro_batch_size == "auto":
        raise UsageError("--micro-batch-size auto works on text data; with instruction rows (.jsonl) give a number")
    if (options.lora.include_embeddings or options.lora.include_lm_head) and options.merge_export and not options.full:
        raise UsageError(
            "--merge-export cannot hold a merged --lora.include-embeddings / --lora.include-lm-head adapter: GPT-2 "
            "ties the LM head to the token embedding and merging unties them: drop those options, or don't merge"
        )
    if options.full and options.peft_export:
        raise UsageError("--peft-export writes a LoRA adapter; --full trains all weights and has none (drop one)")
    if not options.full and not options.train.save_trainable_only:
        raise UsageError("--no-save-trainable-only: LoRA checkpoints hold the adapter only (--full: full fine-tuning)")
    merged, peft = ("--merge-export", options.merge_export), ("--peft-export", options.peft_export)
    check_export_dirs(options.init, merged, peft, options.train.overwrite)


def finetune(options: FinetuneOptions) -> dict[str, Any]:
    check(options)
    # LoRA checkpoints hold the adapter only; --full ones the whole model (gpt2 sample --model out_dir).
    config = dataclasses.replace(options.train, save_trainable_only=not options.full)
    model = GPT.from_pretrained(options.init, device="cpu")
    # The Trainer refuses a --seq-len beyond the model's block_size.
    model.train()
    prompt = instruction_prompt(options.instruct.instruction, options.instruct.input)
    if is_instruction_data(options.data.data):
        train_data, val, first_row = _instruction_data(options, config)
        # Samples answer the first held-out row.
        prompt = prompt or instruction_prompt(*first_row)
    else:
        train_data, val = training_data(options.data.data, options.data.val_data, options.data.val_fraction)
    # The before/after val loss reads the val data as one process would (every rank scores its share of
    # those batches, see val_loss), so that --final-eval-batches N means the same N batches whatever the
    # number of processes, as with text data: the unsharded instruction loader, not this rank's part.
    report_val = val
    if hasattr(val, "unsharded"):
        report_val = val.unsharded()
    # --seed fixes LoRA's random A matrices too, not only the data order.
    seed_everything(config.seed)
    if not options.full:
        minlora.add_lora(model, lora_config=options.lora)
        minlora.mark_only_lora_as_trainable(model)
    with Trainer(model, config, train_data, val) as trainer:
        main = trainer.is_main
        if main and options.full:
            print(f"full fine-tuning of {options.init}: {model.num_params():,} parameters", flush=True)
        elif main:
            lora = f"LoRA rank {options.lora.rank}, alpha {options.lora.alpha:g} on {options.init}"
            print(f"{lora}: {minlora.count_parameters(model)}", flush=True)
        before: dict[str, Any] = {}
        # Every rank scores, rank 0 samples.
        report = (trainer, report_val, options.sampling)
        kwargs = dict(final_eval_batches=options.final_eval_batches, prompt=prompt, save=False)  # _save writes
        # A resumed run has no "before" (LoRA's B starts at zero: the pretrained model).
        if trainer.step == 0:
            measured = final_report(*report, header="before fine-tuning:", **kwargs)
            before = {f"{k}_before": measured[k] for k in ("val_loss", "samples") if k in measured}
        trainer.fit()
        results = final_report(*report, extra=before, header="after fine-tuning:", **kwargs)
        # Under FSDP every rank takes part in gathering the model whole (rank 0 gets it).
        model = trainer.full_model()
        if not main:
            return {}
        _save(trainer, model, options, results)
        return results


def _instruction_data(options: FinetuneOptions, config: Any) -> tuple[Any, Any, tuple[str, str]]:
    """Loaders of instruction rows, and the (instruction, input) the samples answer by default:
    the first validation row's (the first training row's without validation).
    """
    env = env_from_environ()
    train, val, rows = instruction_loaders(
        options.data.data,
        options.data.val_data,
        options.data.val_fraction,
        batch_size=config.micro_batch_size,
        seq_len=config.seq_len,
        pack=options.pack,
        seed=config.seed,
        rank=env.rank,
        world_size=env.world_size,
    )
    if env.is_main:
        counts = f"{train.num_rows} training rows in {train.num_sequences} sequences"
        if val is not None:
            counts += f", {val.num_rows} validation rows"
        print(
            f"instruction data {options.data.data}: {counts}; loss on {train.num_targets:,} response tokens", flush=True
        )
    return train, val, (rows[0][0], rows[0][1])


def _save(trainer: Any, model: Any, options: FinetuneOptions, results: dict[str, Any]) -> None:
    """Rank 0, after training: the adapter (LoRA) of ``model`` (the trained model, whole) or a note on the run
    directory (--full), results.json, then the optional PEFT and transformers exports.
    """
    # No run directory (--out-dir None) writes nothing there (never ./adapter).
    out = trainer.out_dir
    sample = f"{shlex.quote(program('gpt2'))} sample --model"
    if out is not None:
        if options.full:
            print(f"saved the fine-tuned model in {out} ({sample} {out})")
        else:
            adapter = minlora.save_adapter(model, out / "adapter")
            # the run's from now on: --overwrite may replace it, and nothing of the user's beside it
            rundir.record_outputs(out, ["adapter"])
            results["adapter"] = str(adapter)
            print(f"saved adapter {adapter} ({sample} {options.init} --adapter {adapter})")
        write_json(out / "results.json", results)
        rundir.record_outputs(out, ["results.json"])
    # --peft-export never with --full: check() refuses it
    exports = ExportOptions(
        source=ModelOptions(options.init),
        out=options.merge_export,
        peft_out=options.peft_export,
        overwrite=options.train.overwrite,
    )
    write_exports(model, exports)
