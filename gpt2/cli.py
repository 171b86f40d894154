"""The command line: ``python -m gpt2 <command> [options]`` (also installed as ``gpt2``).

Commands: ``train`` (pretrain from scratch), ``finetune`` (LoRA), ``sample``, ``prepare``
(text -> token shards), ``eval`` (val loss / perplexity, HellaSwag), ``export`` (to a
``transformers`` directory / a PEFT adapter) and ``bench`` (the speed-up ladder).

There is one implementation of each job, the ``*_job`` functions of :mod:`gpt2.recipes`; this
module declares each command's options and turns them into the job's arguments. The scripts in
``examples/`` call :func:`run_command` with their own defaults, so ``python
examples/pretrain_shakespeare.py`` and ``gpt2 train`` run the same code.

Option values come from, lowest priority first: the command's built-in defaults (some differ
on CUDA and on CPU), a named ``--recipe``, an example script's defaults, a ``--config`` YAML/JSON
file whose keys are the long option names, and finally the flags on the command line.
A bad flag or value, or a missing file, ends with a one-line error and exit code 2;
``GPT2_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import recipes
from .recipes import ByDevice, UsageError

logger = logging.getLogger(__name__)

EXIT_USAGE = 2  # argparse's code for a bad command line; we use it for every input error
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


# --------------------------------------------------------------------------- option specs
@dataclass
class Opt:
    """One option of a command: argparse flags plus a default that may depend on the device."""

    flags: tuple[str, ...]
    default: Any
    help: str
    type: Callable[[str], Any] | None = None  # None = str; bool = --flag / --no-flag
    choices: Sequence[Any] | None = None
    nargs: str | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        long = next(f for f in self.flags if f.startswith("--"))
        return long[2:].replace("-", "_")


def opt(*flags: str, default: Any = None, help: str, **kwargs: Any) -> Opt:
    return Opt(tuple(flags), default, help, **kwargs)


@dataclass
class Command:
    name: str
    summary: str
    run: Callable[[argparse.Namespace], int | None]
    options: list[Opt]
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""


def optional_int(text: str) -> int | None:
    """An int, or ``none``."""
    return None if str(text).lower() in ("none", "null", "") else int(text)


def optional_float(text: str) -> float | None:
    return None if str(text).lower() in ("none", "null", "") else float(text)


def optional_str(text: str) -> str | None:
    return None if str(text).lower() in ("none", "null", "") else str(text)


def _type_name(t: Callable[..., Any] | None) -> str:
    return {int: "int", float: "float", optional_int: "int or none", optional_float: "number or none"}.get(
        t, "string"
    )


# --------------------------------------------------------------------------- parsing
def _format_default(value: Any) -> str:
    if isinstance(value, ByDevice):
        return f"{_format_default(value.cuda)} on CUDA, {_format_default(value.cpu)} on CPU"
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "none"
    return "none" if value is None else str(value)


def build_parser(cmd: Command, prog: str, defaults: dict[str, Any] | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    defaults = defaults or {}
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description or cmd.description or cmd.summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # Absent flags stay absent, so we can tell "given on the command line" from "default"
        # and let a --config file fill the gaps.
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", metavar="FILE",
        help="YAML or JSON file of option values, keys = long option names (e.g. max_steps: 100); "
             "flags on the command line win",
    )
    # The defaults --help shows are the effective ones: the recipe's, then the script's.
    shown = {o.dest: o.default for o in cmd.options}
    if cmd.recipes:
        shown.update(cmd.recipes.get(defaults.get("recipe", shown.get("recipe")), {}))
    shown.update(defaults)
    for o in cmd.options:
        default = shown.get(o.dest)
        help_text = o.help
        if o.dest == "recipe" and cmd.recipes:
            help_text += f"; the defaults shown here are those of {default!r}"
        help_text = (help_text + f" (default: {_format_default(default)})").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": o.dest, "help": help_text}
        if o.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if o.type is not None:
                kwargs["type"] = o.type
            if o.choices is not None:
                kwargs["choices"] = o.choices
            if o.nargs is not None:
                kwargs["nargs"] = o.nargs
            kwargs["metavar"] = o.metavar
        parser.add_argument(*o.flags, **kwargs)
    return parser


def read_config_file(path: str | os.PathLike[str], cmd: Command) -> dict[str, Any]:
    """Option values from a YAML or JSON mapping, checked and converted like the flags."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise UsageError(
                f"reading {path} needs PyYAML: pip install pyyaml (or write the config as JSON)"
            ) from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UsageError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from e
    elif path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"config file {path} is not valid JSON: {e}") from e
    else:
        raise UsageError(f"config file {path} must end in .yaml, .yml or .json, got {path.suffix!r}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of option names to values, got {type(data).__name__}")
    options = {o.dest: o for o in cmd.options}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in options:
            raise UsageError(
                f"config file {path}: unknown option {key!r} for `{cmd.name}`; known: {', '.join(sorted(options))}"
            )
        values[dest] = _convert(options[dest], value, f"config file {path}: {key}")
    return values


def _convert(o: Opt, value: Any, where: str) -> Any:
    """A config-file value converted to what the flag would have produced."""
    if value is None:
        return None
    if o.type is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise UsageError(f"{where}: expected true or false, got {value!r}")
    if o.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        return [_convert_scalar(o, v, where) for v in items]
    return _convert_scalar(o, value, where)


def _convert_scalar(o: Opt, value: Any, where: str) -> Any:
    t = o.type or str
    if isinstance(value, (dict, list)) or (isinstance(value, bool) and t is not str):
        raise UsageError(f"{where}: expected a single {_type_name(o.type)}, got {value!r}")
    if t is int and isinstance(value, float):
        if not value.is_integer():
            raise UsageError(f"{where}: expected an integer, got {value!r}")
        value = int(value)
    try:
        # Strings go through the flag's own converter (YAML 1.1 reads 6e-4 as a string).
        converted = t(value)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: expected {_type_name(o.type)}, got {value!r}") from e
    if o.choices is not None and converted not in o.choices:
        raise UsageError(f"{where}: {converted!r} is not one of {list(o.choices)}")
    return converted


def resolve_options(cmd: Command, explicit: dict[str, Any], defaults: dict[str, Any] | None = None) -> argparse.Namespace:
    """Merge built-in defaults < recipe < script defaults < config file < command-line flags,
    then pick the CUDA or CPU value of device-dependent defaults."""
    defaults = dict(defaults or {})
    file_values = read_config_file(explicit.pop("config"), cmd) if "config" in explicit else {}
    values = {o.dest: o.default for o in cmd.options}
    if cmd.recipes:
        recipe = explicit.get("recipe", file_values.get("recipe", defaults.get("recipe", values.get("recipe"))))
        if recipe not in cmd.recipes:
            raise UsageError(f"unknown recipe {recipe!r}; choose one of {sorted(cmd.recipes)}")
        values.update(cmd.recipes[recipe])
    values.update(defaults)
    values.update(file_values)
    values.update(explicit)
    on_cuda = recipes.uses_cuda(values.get("device", "auto"))
    for key, value in values.items():
        if isinstance(value, ByDevice):
            values[key] = value.cuda if on_cuda else value.cpu
    values["on_cuda"] = on_cuda
    return argparse.Namespace(**values)


# --------------------------------------------------------------------------- entry points
def _is_usage_error(e: BaseException) -> bool:
    from .tokenizer import TokenizerNotAvailableError

    user_errors: tuple[type[BaseException], ...] = (
        UsageError, ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError,
        IsADirectoryError, PermissionError, ConnectionError, ImportError, TokenizerNotAvailableError,
    )
    try:
        from .data import DownloadError

        user_errors += (DownloadError,)
    except ImportError:  # pragma: no cover
        pass
    return isinstance(e, user_errors)


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, KeyError):
        text = f"missing key {text}"
    return " ".join(text.split())


def run_command(
    name: str,
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    defaults: dict[str, Any] | None = None,
    description: str | None = None,
) -> int:
    """Run one command with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    ``defaults`` override the command's built-in defaults (flags and ``--config`` still win):
    this is how each example script sets its own. ``prog`` and ``description`` set ``--help``.
    """
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r}; choose one of {sorted(COMMANDS)}")
    cmd = COMMANDS[name]
    prog = prog or f"gpt2 {name}"
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(cmd, prog, defaults, description)
    try:
        explicit = vars(parser.parse_args(argv))
    except SystemExit as e:  # --help (0) or a bad flag (2, message already printed)
        return int(e.code or 0)
    debug = os.environ.get("GPT2_DEBUG", "") not in ("", "0")
    _setup_logging()
    try:
        args = resolve_options(cmd, explicit, defaults)
        result = cmd.run(args)  # an exit code, or the job's results (success)
        return result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the command line reports, the library raises
        if debug:
            raise
        code = EXIT_USAGE if _is_usage_error(e) else EXIT_FAILURE
        kind = "error" if code == EXIT_USAGE else f"error ({type(e).__name__})"
        print(f"{prog}: {kind}: {_one_line(e)}", file=sys.stderr)
        if code == EXIT_FAILURE:
            print(f"{prog}: set GPT2_DEBUG=1 for the full traceback", file=sys.stderr)
        return code


class _StdoutHandler(logging.Handler):
    """Log records as plain lines on the *current* ``sys.stdout`` (which tests and tqdm swap)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must never break the job
            self.handleError(record)


def _setup_logging() -> None:
    # The library logs through `logging`; on the command line its INFO messages (the Trainer's
    # set-up lines, downloads, files written) are part of the output. Ranks other than 0 only
    # show warnings. An application that configured logging itself is left alone.
    root = logging.getLogger()
    if root.handlers:
        return
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if int(os.environ.get("RANK", "0") or 0) == 0 else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """``gpt2 <command> [options]``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        from . import __version__

        print(f"gpt2 {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"gpt2: error: unknown command {name!r}; choose one of: {', '.join(COMMANDS)} "
              f"(gpt2 --help lists them)", file=sys.stderr)
        return EXIT_USAGE
    return run_command(name, argv[1:])


def _top_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: gpt2 <command> [options]     (also: python -m gpt2 <command>)",
        "",
        "GPT-2 from pretraining to LoRA fine-tuning, sampling and evaluation.",
        "",
        "commands:",
        *(f"  {n.ljust(width)}  {c.summary}" for n, c in COMMANDS.items()),
        "",
        "`gpt2 <command> --help` lists the command's options. Every command also takes",
        "--config FILE (YAML/JSON, keys = long option names); flags win over the file.",
    ]
    return "\n".join(lines)




# --------------------------------------------------------------------------- the commands
def _device_opt() -> Opt:
    return opt("--device", default="auto",
               help="auto (this process's CUDA GPU when there is one, else CPU), cpu, cuda or cuda:N")


def _inference_precision_opt() -> Opt:
    return opt("--precision", default="auto", choices=("auto", "fp32", "tf32", "bf16", "fp16"),
               help="autocast for the forward passes; auto = bf16 on GPUs that support it, fp16 on older "
                    "GPUs, fp32 on CPU")


def _sampling_opts(num_samples: Any = 1, max_new_tokens: Any = 100, prompt: str = "Hello, I'm a language model,",
                   top_p: bool = True) -> list[Opt]:
    opts = [
        opt("--prompt", default=prompt, help="text the samples continue; empty = an unconditional sample"),
        opt("-n", "--num-samples", default=num_samples, type=int, help="how many samples to draw"),
        opt("--max-new-tokens", default=max_new_tokens, type=int, help="tokens to sample after the prompt"),
        opt("--temperature", default=1.0, type=float, help="softmax temperature; 0 = greedy"),
        opt("--top-k", default=50, type=optional_int, help="sample from the k most likely tokens; none = all"),
    ]
    if top_p:
        opts.append(opt("--top-p", default=None, type=optional_float,
                        help="nucleus sampling: the smallest set of tokens with this much probability; none = off"))
    return opts


def _instruction_opts() -> list[Opt]:
    return [
        opt("--instruction", default=None, type=optional_str,
            help="sample the response to this instruction: the prompt is the instruction template of "
                 "docs/lora.md (gpt2.instruct.TEMPLATE) and only the response is printed"),
        opt("--input", default=None, type=optional_str,
            help="the optional input of --instruction (the template's '### Input:' part)"),
    ]


def _sample_command() -> Command:
    return Command(
        name="sample",
        summary="stream text from a model (hub id, transformers dir, checkpoint, + LoRA adapter)",
        run=recipes.sample_job,
        options=[
            opt("--model", default="gpt2", metavar="MODEL",
                help="a hub id (gpt2, gpt2-medium, ...), a transformers directory, or a checkpoint / run "
                     "directory of `gpt2 train`"),
            opt("--adapter", default=None, metavar="PATH",
                help="a LoRA adapter to add: the `adapter` directory `gpt2 finetune` writes, or a PEFT adapter directory"),
            *_sampling_opts(),
            *_instruction_opts(),
            opt("--seed", default=None, type=optional_int, help="seed of the sampler, for reproducible samples; none = random"),
            _device_opt(),
            _inference_precision_opt(),
            opt("--compile", default=False, type=bool, help="torch.compile the model first (pays off for long samples on a GPU)"),
        ],
    )


def _prepare_command() -> Command:
    return Command(
        name="prepare",
        summary="tokenise text files, jsonl files or a Hugging Face dataset into uint16 token shards",
        run=recipes.prepare_job,
        description=(
            "Tokenise documents with GPT-2's BPE into uint16 .npy shards (build-nanogpt's layout: the\n"
            "first shard is the val split, the others train). One text file is split by --val-fraction\n"
            "instead. Every document starts with <|endoftext|>."
        ),
        options=[
            opt("--input", default=[], nargs="+", metavar="PATH",
                help="text files (one document each), .jsonl files (one document per line) or directories of them"),
            opt("--dataset", default=None, metavar="NAME",
                help="a Hugging Face dataset to stream instead (needs `pip install datasets`), "
                     "e.g. HuggingFaceFW/fineweb-edu"),
            opt("--dataset-config", default=None, metavar="NAME", help="the dataset's configuration, e.g. sample-10BT"),
            opt("--split", default="train", help="the dataset split to read"),
            opt("--text-field", default="text", help="the field holding the text in jsonl rows / dataset rows"),
            opt("--out-dir", default="data/shards", metavar="DIR", help="where the shards go"),
            opt("--prefix", default=None, help="shard file-name prefix; default: the text file's name, or 'shard'"),
            opt("--shard-size", default=10**8, type=int, help="tokens per shard (10^8 = 200 MB, build-nanogpt's size)"),
            opt("--val-fraction", default=0.1, type=float, help="for a single text file: the fraction at its end kept for validation"),
            opt("--num-workers", default=0, type=int, help="tokeniser processes; 0 = tokenise in this process"),
            opt("--max-docs", default=None, type=optional_int, help="stop after this many documents (for a quick try)"),
            opt("--overwrite", default=False, type=bool, help="replace shards with the same prefix already in --out-dir"),
            opt("--progress", default=True, type=bool, help="show a progress bar"),
        ],
    )


def _eval_command() -> Command:
    return Command(
        name="eval",
        summary="validation loss / perplexity on token data, and HellaSwag accuracy",
        run=recipes.eval_job,
        options=[
            opt("--model", default="gpt2", metavar="MODEL",
                help="a hub id, a transformers directory, or a checkpoint / run directory of `gpt2 train`"),
            opt("--adapter", default=None, metavar="PATH", help="a LoRA adapter to add first"),
            opt("--data", default=None, metavar="DATA",
                help="tokens to score: a shard directory (its --split shards), a .npy/.bin token file, a text file or "
                     "'shakespeare' (texts: their last --val-fraction)"),
            opt("--split", default="val", help="which shards of a shard directory to score"),
            opt("--val-fraction", default=0.1, type=float,
                help="for a text: score its last fraction, the part `gpt2 train` holds out; 0 = the whole text"),
            opt("--batch-size", default=ByDevice(16, 4), type=int, help="sequences per forward pass"),
            opt("--seq-len", default=None, type=optional_int, help="tokens per sequence; none = the model's context, at most 1024"),
            opt("--max-batches", default=None, type=optional_int, help="score at most this many batches; none = all"),
            opt("--hellaswag", default=None, metavar="PATH",
                help="HellaSwag val jsonl to score, or 'auto' to download and cache it ($GPT2_HELLASWAG overrides)"),
            opt("--hellaswag-limit", default=None, type=optional_int, help="score only the first N HellaSwag examples"),
            _device_opt(),
            _inference_precision_opt(),
            opt("--output", default=None, metavar="FILE", help="also write the results to this JSON file"),
        ],
    )


def _export_command() -> Command:
    return Command(
        name="export",
        summary="write a transformers directory (LoRA merged in) and/or a PEFT adapter",
        run=recipes.export_job,
        options=[
            opt("--model", default=None, metavar="MODEL",
                help="the model: a checkpoint / run directory of `gpt2 train`, a transformers directory or a hub id"),
            opt("--adapter", default=None, metavar="PATH", help="a LoRA adapter to merge in (from `gpt2 finetune`)"),
            opt("--out", default=None, metavar="DIR",
                help="write a transformers.GPT2LMHeadModel directory here (the adapter merged into the weights)"),
            opt("--peft-out", default=None, metavar="DIR",
                help="write the adapter in PEFT format here (peft.PeftModel loads it on transformers' GPT-2)"),
            opt("--tokenizer-dir", default=None, metavar="DIR",
                help="GPT-2's encoder.json + vocab.bpe, copied into --out so AutoTokenizer loads it too "
                     "(default: $GPT2_TOKENIZER_DIR)"),
        ],
    )


def _trainer_opts(*, out_dir: str, steps: Any, batch: Any, seq_len: Any, lr: Any, warmup: Any, weight_decay: Any,
                  compile: Any, eval_interval: Any, eval_steps: Any, checkpoint_interval: Any) -> list[Opt]:
    """Options named after :class:`gpt2.TrainConfig` fields (so a config file can hold either)."""
    return [
        opt("--micro-batch-size", "--batch-size", default=batch, type=int, help="sequences per forward/backward on one process"),
        opt("--seq-len", default=seq_len, type=int, help="tokens per sequence"),
        opt("--total-batch-size", default=None, type=optional_int,
            help="tokens per optimizer step over all processes (gradient accumulation makes up the difference); "
                 "none = one micro-batch per process"),
        opt("--max-steps", "--steps", default=steps, type=int, help="optimizer steps in the whole run"),
        opt("--max-lr", "--lr", default=lr, type=float, help="peak learning rate"),
        opt("--min-lr", default=None, type=optional_float, help="floor of the cosine decay; none = max-lr / 10"),
        opt("--warmup-steps", default=warmup, type=int, help="linear warmup steps"),
        opt("--weight-decay", default=weight_decay, type=float, help="AdamW weight decay (2-D weights only)"),
        opt("--decay-embeddings", default=False, type=bool, help="also decay the embeddings (build-nanogpt does)"),
        opt("--grad-clip", default=1.0, type=optional_float, help="max global gradient norm; 0 or none = no clipping"),
        opt("--precision", default="auto", choices=("auto", "fp32", "tf32", "bf16", "fp16"),
            help="auto = bf16 on GPUs that support it, fp16 with loss scaling on older GPUs, fp32 on CPU"),
        opt("--compile", default=compile, type=bool, help="torch.compile the model"),
        opt("--fused-adamw", default="auto", choices=("auto", "true", "false"), help="the fused AdamW kernel (CUDA)"),
        _device_opt(),
        opt("--eval-interval", default=eval_interval, type=int, help="validation loss every N steps (and at the end); 0 = only at the end"),
        opt("--eval-steps", default=eval_steps, type=int, help="validation batches per evaluation"),
        opt("--final-eval-batches", default=None, type=optional_int,
            help="batches of the final validation loss; none = the whole validation data"),
        opt("--out-dir", default=out_dir, metavar="DIR", help="run directory: metrics.jsonl, loss.png, checkpoints/, results.json"),
        opt("--checkpoint-interval", default=checkpoint_interval, type=int, help="checkpoint every N steps (and at the end); 0 = only at the end"),
        opt("--keep-last-checkpoints", default=3, type=int, help="older checkpoints are deleted; 0 = keep all"),
        opt("--resume", default=None, type=optional_str, metavar="auto|PATH",
            help="'auto' = continue from the newest checkpoint in --out-dir if there is one; or a checkpoint path"),
        opt("--log-interval", default=10, type=int, help="console line every N steps"),
        opt("--progress", default=True, type=bool, help="progress bar"),
        opt("--plot", default=True, type=bool, help="loss-curve PNG in the run directory at the end"),
        opt("--peak-flops", default=None, type=optional_float, help="peak FLOP/s of one GPU for MFU; none = from its name"),
        opt("--max-bad-steps", default=5, type=int, help="stop after this many non-finite steps in a row"),
        opt("--seed", default=1337, type=int, help="seed of weights, data order and samples"),
    ]


def _data_opts(data: Any) -> list[Opt]:
    return [
        opt("--data", default=data, metavar="DATA",
            help="training data: a text file, a .npy/.bin token file, a directory of shards (from `gpt2 prepare`) "
                 "or 'shakespeare' (Tiny Shakespeare, downloaded once; $GPT2_TINY_SHAKESPEARE overrides); "
                 "for finetune also a .jsonl file of instruction rows (docs/lora.md)"),
        opt("--val-data", default=None, type=optional_str, metavar="DATA",
            help="validation data; none = a shard directory's val shards, or the end of a text / token file"),
        opt("--val-fraction", default=0.1, type=float, help="fraction at the end of a text / token file held out for validation"),
    ]


def _train_command() -> Command:
    recipes_ = {
        # Tiny Shakespeare: the 124M reference settings on a GPU; a few minutes' run on a CPU.
        "shakespeare": dict(
            data="shakespeare", model=ByDevice("gpt2", "mini"), micro_batch_size=ByDevice(16, 8),
            # CPU: 200 steps of 8 x 128 tokens take about 3 minutes on 2 cores (~0.7 s per step, most
            # of it the 50257-way output layer); the model sees ~200k tokens, two thirds of the text.
            seq_len=ByDevice(1024, 128), max_steps=ByDevice(200, 200), max_lr=ByDevice(6e-4, 2e-3),
            warmup_steps=ByDevice(20, 20), compile=ByDevice(True, False), pad_vocab_multiple=ByDevice(64, 1),
            eval_interval=ByDevice(25, 50), eval_steps=ByDevice(5, 10), checkpoint_interval=ByDevice(100, 100),
            out_dir="runs/shakespeare", prompt="ROMEO:", num_samples=ByDevice(3, 2),
            max_new_tokens=ByDevice(200, 80), temperature=0.8,
        ),
        # build-nanogpt's 10B-token GPT-2 124M run (FineWeb-edu shards from examples/prepare_fineweb.py).
        "gpt2-124m": dict(
            data="data/edu_fineweb10B", model="gpt2", micro_batch_size=ByDevice(64, 4), seq_len=1024,
            total_batch_size=524288, max_steps=19073, warmup_steps=715, max_lr=6e-4, min_lr=6e-5,
            weight_decay=0.1, decay_embeddings=True, compile=ByDevice(True, False), pad_vocab_multiple=64,
            eval_interval=250, eval_steps=20, final_eval_batches=20, checkpoint_interval=5000,
            out_dir="runs/gpt2-124m", resume="auto", hellaswag="auto", hellaswag_interval=250,
            prompt="Hello, I'm a language model,", num_samples=4, max_new_tokens=32,
        ),
    }
    return Command(
        name="train",
        summary="pretrain a GPT-2 from scratch (Tiny Shakespeare by default), report val loss and samples",
        run=recipes.train_job,
        recipes=recipes_,
        options=[
            opt("--recipe", default="shakespeare", choices=tuple(recipes_),
                help="a named set of defaults: shakespeare (Tiny Shakespeare; GPT-2 124M at B=16, T=1024 on a GPU, "
                     "a 4-layer model on a CPU) or gpt2-124m (build-nanogpt's 10B-token FineWeb-edu run)"),
            *_data_opts("shakespeare"),
            opt("--model", default="mini", choices=tuple(recipes.MODEL_SIZES),
                help="model shape: a GPT-2 preset (gpt2 = 124M), mini (4 layers x 128) or tiny (2 x 32)"),
            opt("--n-layer", default=None, type=optional_int, help="override the shape's number of layers"),
            opt("--n-head", default=None, type=optional_int, help="override the shape's number of heads"),
            opt("--n-embd", default=None, type=optional_int, help="override the shape's width"),
            opt("--block-size", default=None, type=optional_int, help="context length of the model; none = --seq-len"),
            opt("--dropout", default=0.0, type=float, help="dropout probability"),
            opt("--pad-vocab-multiple", default=1, type=int,
                help="round the vocabulary up to a multiple of this (64: 50257 -> 50304, faster on GPUs)"),
            opt("--flash", default=True, type=bool, help="scaled_dot_product_attention (flash attention on GPUs)"),
            *_trainer_opts(out_dir="runs/train", steps=200, batch=8, seq_len=64, lr=6e-4, warmup=20,
                           weight_decay=0.1, compile=False, eval_interval=50, eval_steps=20, checkpoint_interval=100),
            opt("--hellaswag", default=None, type=optional_str, metavar="PATH",
                help="score HellaSwag (val jsonl path, or 'auto' to download and cache it) during and after training"),
            opt("--hellaswag-interval", default=250, type=int, help="HellaSwag every N steps (and at the end); 0 = only at the end"),
            opt("--hellaswag-limit", default=None, type=optional_int, help="score only the first N HellaSwag examples"),
            *_sampling_opts(num_samples=2, max_new_tokens=80, prompt="ROMEO:"),
        ],
    )


def _finetune_command() -> Command:
    return Command(
        name="finetune",
        summary="LoRA (or --full) fine-tuning on a text or instruction rows (.jsonl); samples, adapter, export",
        run=recipes.finetune_job,
        options=[
            opt("--init", default="gpt2", metavar="MODEL",
                help="the weights to start from: a hub id (gpt2, gpt2-medium, ...), a transformers directory, or a "
                     "checkpoint / run directory of `gpt2 train`"),
            *_data_opts("shakespeare"),
            opt("--pack", default=False, type=bool,
                help="instruction data (.jsonl): pack several rows into each sequence (a row attends to the rows "
                     "before it); default: one row per sequence, padded"),
            opt("--full", default=False, type=bool,
                help="full fine-tuning: train every weight, no LoRA; the run directory then holds the whole model "
                     "(gpt2 sample --model OUT_DIR)"),
            opt("--lora-rank", "--rank", default=8, type=int, help="rank of the LoRA update"),
            opt("--lora-alpha", "--alpha", default=16.0, type=float, help="LoRA alpha; the update is scaled by alpha / rank"),
            opt("--lora-dropout", default=0.0, type=float, help="dropout on the LoRA branch's input"),
            opt("--lora-targets", default=[], nargs="*", metavar="PATTERN",
                help="module-name patterns to adapt (e.g. attn.c_attn mlp.c_fc); default: every Linear but the head"),
            opt("--lora-head", default=False, type=bool, help="also adapt the LM head (tied to the embedding; see docs/lora.md)"),
            opt("--lora-embeddings", default=False, type=bool, help="also adapt the embeddings"),
            *_trainer_opts(out_dir="runs/lora", steps=ByDevice(200, 30), batch=ByDevice(8, 4),
                           seq_len=ByDevice(512, 64), lr=ByDevice(3e-4, 1e-3), warmup=ByDevice(20, 3),
                           weight_decay=0.0, compile=False, eval_interval=ByDevice(50, 10),
                           eval_steps=ByDevice(20, 4), checkpoint_interval=ByDevice(100, 0)),
            opt("--peft-export", default=None, metavar="DIR", help="also write the adapter in PEFT format here"),
            opt("--merge-export", default=None, metavar="DIR",
                help="merge the adapter into the weights and write a transformers directory here"),
            *_sampling_opts(num_samples=1, max_new_tokens=ByDevice(100, 40), prompt="ROMEO:"),
            *_instruction_opts(),
        ],
    )


def _bench_command() -> Command:
    from .bench import MODEL_SHAPES, RUNGS

    return Command(
        name="bench",
        summary="the training speed-up ladder: fp32, tf32, bf16, compile, flash, vocab pad, fused AdamW",
        run=recipes.bench_job,
        options=[
            opt("--model", default=ByDevice("gpt2", "tiny"), choices=tuple(MODEL_SHAPES), help="model shape"),
            opt("--batch-size", default=ByDevice(16, 4), type=int, help="sequences per step"),
            opt("--seq-len", default=ByDevice(1024, 64), type=int, help="tokens per sequence"),
            opt("--steps", default=ByDevice(20, 3), type=int, help="timed steps per rung"),
            opt("--warmup", default=ByDevice(5, 1), type=int, help="untimed steps per rung (compilation happens here)"),
            opt("--rungs", default=",".join(RUNGS), help="comma-separated subset of the rungs"),
            _device_opt(),
            opt("--compile", default=None, type=bool, help="compile even on CPU / never compile; default: on CUDA only"),
            opt("--vocab-size", default=ByDevice(None, 1024), type=optional_int,
                help="override GPT-2's 50257 tokens (smaller keeps CPU runs quick)"),
            opt("--peak-flops", default=None, type=optional_float, help="peak FLOP/s for MFU; none = from the GPU name"),
            opt("--json", default=None, metavar="FILE", help="also write the results as JSON"),
        ],
    )


COMMANDS: dict[str, Command] = {}
for _make in (_train_command, _finetune_command, _sample_command, _prepare_command, _eval_command,
              _export_command, _bench_command):
    _cmd = _make()
    COMMANDS[_cmd.name] = _cmd
