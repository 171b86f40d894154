"""What several commands share: option groups, checks, sampling to stdout, and the end-of-training report."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch

from gpt2.cli.layers import Short, UsageError
from gpt2.data.sources import shakespeare_or_path
from gpt2.errors import InvalidValueError
from gpt2.files import OutputExistsError, check_new_file, replace_atomically
from gpt2.model.checkpoint_files import CHECKPOINT_DIR, CheckpointError, open_checkpoint
from gpt2.model.generate import SamplingConfig, stream_text
from gpt2.model.gpt import GPT
from gpt2.model.loading import apply_adapter
from gpt2.train.distributed import resolve_device
from gpt2.train.precision import inference_autocast
from gpt2.train.rundir import check_out_dir, record_outputs


def check_output_file(flag: str, path: str, overwrite: bool) -> None:
    """``flag``'s ``path`` names a new file, or with ``overwrite`` a regular file to replace (never a device such
    as /dev/null, a folder or a link); nothing else is written beside it.
    """
    try:
        check_new_file(path, overwrite=overwrite, flag="--overwrite")
    except OutputExistsError as e:
        raise UsageError(f"{flag} {e}") from None


@dataclass
class DataOptions:
    data: str = "shakespeare"
    """training data: a text file, a .npy/.bin token file, a directory of shards (from `gpt2 prepare`), an
    instruction .jsonl (gpt2 finetune) or 'shakespeare' (Tiny Shakespeare, downloaded once and cached)"""
    val_data: str | None = None
    """validation data; None = a shard directory's val shards, or --val-fraction of a text / token file"""
    val_fraction: float = 0.1
    """fraction of a text / token file held out for validation (passages spread through it; of an
    instruction .jsonl, its last rows)"""


@dataclass
class SamplingOptions:
    prompt: str = "Hello, I'm a language model,"
    """text the samples continue; empty = an unconditional sample"""
    num_samples: Annotated[int, Short("-n")] = 1
    """how many samples to draw"""
    max_new_tokens: int = 100
    """tokens to sample after the prompt"""
    temperature: float = 1.0
    """softmax temperature; 0 = greedy"""
    top_k: int | None = 50
    """sample from the k most likely tokens; None = all"""
    top_p: float | None = None
    """nucleus sampling: the smallest set of tokens with this much probability; None = off"""


@dataclass
class InstructionOptions:
    instruction: str | None = None
    """sample the response to this instruction: the prompt is the instruction template of docs/lora.md
    (gpt2.data.instruct.TEMPLATE) and only the response is printed"""
    input: str | None = None
    """the optional input of --instruction (the template's '### Input:' part)"""


@dataclass
class ModelOptions:
    """The model a command reads (``gpt2 sample``, ``gpt2 eval``, ``gpt2 export``), with its adapter."""

    model: str = "gpt2"
    """the model: a hub id (gpt2, gpt2-medium, ...), a transformers directory, or a checkpoint / run directory of
    `gpt2 train`"""
    adapter: str | None = None
    """a LoRA adapter to add: the `adapter` directory `gpt2 finetune` writes, or a PEFT adapter directory (gpt2
    export merges it into the weights)"""
    allow_base_mismatch: bool = False
    """load an --adapter recorded on other base weights anyway (a warning instead of the error)"""

    def load(self, device: torch.device | str = "cpu") -> GPT:
        """The model on ``device``, with the adapter added."""
        model = GPT.from_pretrained(self.model, device=device)
        if self.adapter:
            try:
                apply_adapter(model, self.adapter, self.allow_base_mismatch)
            except FileNotFoundError as e:
                # gpt2 finetune's run folder holds the adapter in adapter/
                inside = Path(self.adapter).expanduser() / "adapter"
                if not inside.is_dir():
                    raise
                raise UsageError(f"{e}; did you mean --adapter {inside}?") from e
        return model


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    """start this many processes on this machine (one per GPU; gloo on CPU), like torchrun --standalone
    --nproc-per-node N; Ctrl-C stops them all with one line"""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise InvalidValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")


def program(name: str) -> str:
    """How a new shell starts the program ``name`` (``gpt2``) installed beside this Python: by its name, or by its
    path when this Python is a virtual environment that is not activated (its folder of programs is not on PATH),
    relative to the working directory when inside it (``.venv/bin/gpt2``).
    """
    folder = Path(sys.executable).parent
    on_path = {Path(p).absolute() for p in os.environ.get("PATH", "").split(os.pathsep) if p}
    path = folder / name
    # Not a virtual environment, an activated one, or not installed there (a source checkout on PYTHONPATH).
    if sys.prefix == sys.base_prefix or folder.absolute() in on_path or not path.is_file():
        return name
    if path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    return str(path)


def check_sampling(s: SamplingOptions, *, fewest: int = 1) -> None:
    """The sampling options, checked before any model is loaded or trained (gpt2.model.generate
    checks them again when it samples: after training). ``fewest``: samples.
    """
    for flag, value, least in (("--num-samples", s.num_samples, fewest), ("--max-new-tokens", s.max_new_tokens, 0)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    SamplingConfig(s.temperature, s.top_k, s.top_p)


def check_run(options: Any) -> None:
    """What ``gpt2 train`` and ``gpt2 finetune`` check before any data is read or process started."""
    if options.train.out_dir is not None:
        # A file, or not writable: one error before any work.
        check_out_dir(options.train.out_dir)
    check_sampling(options.sampling, fewest=0)  # 0: no samples after training
    if options.final_eval_batches is not None and options.final_eval_batches < 1:
        raise UsageError(
            f"--final-eval-batches must be >= 1 (or None: the whole validation data), got {options.final_eval_batches}"
        )
    for data in (options.data.data, options.data.val_data):
        if data is None:
            continue
        # Check that it exists (Tiny Shakespeare: downloaded once, here).
        try:
            shakespeare_or_path(data)
        except FileNotFoundError as e:
            if "fineweb" not in Path(data).name.lower():
                raise
            raise UsageError(f"{e}; python examples/prepare_fineweb.py writes FineWeb-edu's shards there") from e


def load_for_inference(options: Any) -> tuple[Any, Any, torch.device]:
    """``options.source``'s model on ``options.device`` in eval mode, the autocast of ``options.precision`` and
    the device (``gpt2 sample`` and ``gpt2 eval``).
    """
    device = resolve_device(options.device)
    return options.source.load(device).eval(), inference_autocast(options.precision, device), device


def instruction_prompt(instruction: str | None, input: str | None) -> str | None:
    """The instruction template around ``--instruction`` (and ``--input``), or None without one."""
    if not instruction:
        if input:
            raise UsageError("--input goes with --instruction (it fills the template's '### Input:' part)")
        return None
    from gpt2.data.instruct import render_prompt

    return render_prompt(instruction, input or "")


def print_samples(
    model: Any,
    s: SamplingOptions,
    *,
    seed: int | None,
    header: str = "",
    autocast: Any = None,
    prompt: str | None = None,
) -> list[str]:
    """``s.num_samples`` samples, streamed to stdout; returns their texts. ``prompt`` (an
    instruction template) replaces ``s.prompt``; it is shown before each sample, and the returned
    texts hold only the responses.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(seed)
    sampling = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=generator, autocast=autocast)
    # A plain prompt is part of the text; an instruction's template is shown but not returned.
    echo = prompt is None
    if echo:
        prompt = s.prompt
    texts = []
    for i in range(s.num_samples):
        print(f"--- {f'{header} sample {i + 1}/{s.num_samples}'.strip()} ---")
        print(prompt, end="", flush=True)
        generated = ""
        for piece in stream_text(model, prompt, s.max_new_tokens, **sampling):
            generated += piece
            print(piece, end="", flush=True)
        if not generated:
            # An empty answer is the model's choice (<|endoftext|> first), not a lost output.
            print(EMPTY_SAMPLE, end="")
        print()
        texts.append(prompt + generated if echo else generated)
    return texts


# Printed where a sample's first new token is <|endoftext|>.
EMPTY_SAMPLE = "(the model ended the text at once)"


def val_loss(trainer: Any, val: Any, max_batches: int | None) -> dict[str, float]:
    """Validation loss of ``trainer.model`` over ``val`` (at most ``max_batches`` batches). Every
    rank calls this: each scores its share and the sums are all-reduced.
    """
    from gpt2.eval.loss import evaluate_loss

    return evaluate_loss(
        trainer.model,
        val,
        trainer.config.micro_batch_size,
        trainer.config.seq_len,
        max_batches=max_batches,
        autocast=trainer.precision.autocast,
        split="val" if isinstance(val, Path) else None,
        device=trainer.device,
        distributed=True,
        progress=trainer.config.progress and trainer.is_main,
        source=f"the model trained in {trainer.out_dir or 'memory'} (step {trainer.step})",
    )


# From fewer scored tokens than this a perplexity is a rough estimate, and its line says so.
FEW_TOKENS = 200


def loss_line(loss: dict[str, Any]) -> str:
    """``val loss ... | perplexity ... | N tokens`` for :func:`~gpt2.eval.loss.evaluate_loss`'s result; from fewer
    than :data:`FEW_TOKENS` tokens the perplexity is marked as a rough estimate.
    """
    head = f"val loss {loss['loss']:.4f} | perplexity {loss['perplexity']:.2f}"
    tokens = loss["tokens"]
    if tokens >= FEW_TOKENS:
        return f"{head} | {tokens:,} tokens"
    return f"{head} (from only {tokens} token{'s' * (tokens != 1)}: a rough estimate)"


def final_report(
    trainer: Any,
    val: Any,
    sampling: SamplingOptions,
    *,
    final_eval_batches: int | None,
    extra: dict[str, Any] | None = None,
    header: str = "",
    prompt: str | None = None,
    save: bool = True,
) -> dict[str, Any]:
    """Validation loss (every rank calls this), then on rank 0 samples and (``save``) ``results.json``
    in the run directory; ranks other than 0 return ``{}``.
    """
    results: dict[str, Any] = {"step": trainer.step, **(extra or {})}
    if val is not None:
        loss = val_loss(trainer, val, final_eval_batches)
        results.update(val_loss=loss["loss"], perplexity=loss["perplexity"], val_tokens=loss["tokens"])
        if trainer.is_main:
            print(f"{header} {loss_line(loss)}".strip())
    model = None
    if sampling.num_samples > 0:
        # Under FSDP every rank takes part in gathering the model whole (rank 0 gets it).
        model = trainer.full_model()
    if not trainer.is_main:
        return {}
    if model is not None:
        # On a CPU the samples decode in fp32, as gpt2 sample does: autocast would convert every weight to bf16
        # at every token (slower, and other numbers than the reference).
        autocast = trainer.precision.autocast
        if trainer.device.type == "cpu":
            autocast = None
        results["samples"] = print_samples(
            model, sampling, seed=trainer.config.seed, header=header, autocast=autocast, prompt=prompt
        )
    if save and trainer.out_dir is not None:
        write_json(trainer.out_dir / "results.json", results)
        # The run's from now on: --overwrite may replace it.
        record_outputs(trainer.out_dir, ["results.json"])
    return results


def finished_results(trainer: Any) -> dict[str, Any] | None:
    """The ``results.json`` of a run that had already reached ``max_steps`` when it was resumed, if it is
    that step's: a rerun reports it instead of scoring the validation data again. Else None.
    """
    if trainer.out_dir is None or trainer.last_checkpoint is None or trainer.step < trainer.config.max_steps:
        return None
    try:
        results = json.loads((trainer.out_dir / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict) or results.get("step") != trainer.step:
        return None
    return results


def intact_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest checkpoint under ``out_dir/checkpoints`` whose files all verify (a sharded one's shards stay on
    disk), or None.
    """
    try:
        return open_checkpoint(Path(out_dir) / CHECKPOINT_DIR, weights=False).path
    except (CheckpointError, OSError):
        return None


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` to ``path`` whole (never a half-written file; the caller checked that it may)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2) + "\n"
    replace_atomically(path, lambda f: f.write(text.encode("utf-8")))
    print(f"wrote {path}")
