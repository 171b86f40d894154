"""The command line: ``gpt2 <command> [options]`` (also ``python -m gpt2 <command>``).

Nothing here declares an option. Each command's options are a dataclass in
:mod:`gpt2.jobs.options`; tyro derives the flags and ``--help`` from its fields, and
:mod:`gpt2.cli.layers` layers the values: dataclass defaults < ``--recipe`` (a YAML file; device-
dependent defaults live in ``<name>-cpu.yaml`` / ``<name>-gpu.yaml``) < ``--config FILE`` < flags.
``--print-config`` prints the resolved options as YAML instead of running.

A bad flag, value or file ends with a one-line error naming the flag and exit code 2; another
failure exits 1 (``GPT2_DEBUG=1`` shows the traceback). Ctrl-C, SIGTERM and SIGHUP stop training
at a step boundary with a checkpoint and one line saying how to resume; the exit code is 128 +
the signal (130, 143, 129).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2.cli import options as o
from gpt2.cli.common import UsageError
from gpt2.cli.layers import ConfigError, build, dump_yaml, read_yaml, recipe_names, recipe_path, to_flat, validation_off
from gpt2.train.distributed import uses_cuda

EXIT_USAGE = 2  # argparse's code for a bad command line; we use it for every input error
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    options: type
    job: str  # the function in gpt2.jobs that runs it
    recipe: str | None = None  # the recipe applied when --recipe is not given


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command(
            "train",
            "pretrain a GPT-2 from scratch (Tiny Shakespeare by default), report val loss and samples",
            o.TrainOptions,
            "train",
            recipe="shakespeare",
        ),
        Command(
            "finetune",
            "LoRA (or full) fine-tuning of GPT-2 weights on text or instruction data",
            o.FinetuneOptions,
            "finetune",
            recipe="finetune",
        ),
        Command(
            "sample",
            "stream text from a model (hub id, transformers dir, checkpoint, + LoRA adapter)",
            o.SampleOptions,
            "sample",
        ),
        Command(
            "prepare",
            "tokenise text files, jsonl files or a Hugging Face dataset into token shards",
            o.PrepareOptions,
            "prepare",
        ),
        Command(
            "eval",
            "validation loss / perplexity on token data, and HellaSwag accuracy",
            o.EvalOptions,
            "evaluate",
            recipe="eval",
        ),
        Command(
            "export", "write a transformers directory (LoRA merged in) and/or a PEFT adapter", o.ExportOptions, "export"
        ),
        Command(
            "bench",
            "the training speed-up ladder: fp32, tf32, bf16, compile, flash, vocab pad, fused AdamW",
            o.BenchOptions,
            "bench",
            recipe="bench",
        ),
    )
}

# Spellings kept from earlier versions (CHANGELOG.md lists them); rewritten before parsing.
ALIASES: dict[str, str] = {
    "--batch-size": "--micro-batch-size",
    "--steps": "--max-steps",
    "--lr": "--max-lr",
    "-n": "--num-samples",
    "--rank": "--lora.rank",
    "--lora-rank": "--lora.rank",
    "--alpha": "--lora.alpha",
    "--lora-alpha": "--lora.alpha",
    "--lora-dropout": "--lora.dropout",
    "--lora-targets": "--lora.target-modules",
    "--lora-head": "--lora.include-lm-head",
    "--no-lora-head": "--lora.no-include-lm-head",
    "--lora-embeddings": "--lora.include-embeddings",
    "--no-lora-embeddings": "--lora.no-include-embeddings",
}


def _flags(cls: type) -> set[str]:
    """Every flag of ``cls``'s options, the ``--no-`` form of its true/false ones included."""
    from gpt2.cli.layers import option_fields

    flags = set()
    for _, key, hint in option_fields(cls):
        *group, name = key.replace("_", "-").split(".")
        flags.add("--" + ".".join([*group, name]))
        if hint is bool:
            flags.add("--" + ".".join([*group, "no-" + name]))
    return flags


def rewrite_aliases(argv: list[str], cls: type) -> list[str]:
    """Old flag spellings -> the current ones, where the command has no option of that name."""
    own = _flags(cls)
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in ALIASES and flag not in own and ALIASES[flag] in own:
            arg = ALIASES[flag] + eq + value
        out.append(arg)
    return out


# --------------------------------------------------------------------------- parsing
def parse(
    cmd: Command,
    argv: Sequence[str],
    *,
    prog: str,
    defaults: dict[str, Any] | None = None,
    description: str | None = None,
) -> tuple[Any, bool]:
    """The options of ``cmd`` from recipe, script defaults, config file and ``argv``; and
    whether ``--print-config`` asked to print them instead of running."""
    import tyro

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    pre.add_argument("--config")
    pre.add_argument("--print-config", action="store_true")
    pre.add_argument("--device")
    known, rest = pre.parse_known_args(rewrite_aliases(list(argv), cmd.options))
    if known.device is not None:
        rest += ["--device", known.device]

    from_file: dict[str, Any] = {}
    if known.config:
        path = Path(known.config).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file {known.config!r} does not exist")
        from_file = read_yaml(path, cmd.options, "config file")
    defaults = dict(defaults or {})
    recipe = known.recipe or from_file.pop("recipe", None) or defaults.pop("recipe", None) or cmd.recipe
    recipe_values = (
        {} if recipe is None else read_yaml(recipe_path(recipe, uses_cuda(known.device)), cmd.options, "recipe")
    )
    values = {**recipe_values, **defaults}
    values.update(from_file)
    explicit = {"--" + k.replace("_", "-") for k in (*defaults, *from_file)}
    explicit |= {a.split("=")[0] for a in rest if a.startswith("--")}
    header = (description or cmd.options.__doc__ or cmd.summary).strip()
    if {"-h", "--help"} & set(rest):  # listing the recipes reads every recipe file: only for --help
        header += (
            "\n\nValues: the defaults below (those of recipe {!r}) < --config FILE.yaml < flags. "
            "--recipe NAME|FILE picks another recipe (packaged: {}; NAME-cpu / NAME-gpu pick a device's "
            "file); --print-config prints the resolved options as YAML."
        ).format(recipe, ", ".join(recipe_names(cmd.options)))
    with validation_off(cmd.options):
        parsed = tyro.cli(cmd.options, args=rest, default=build(cmd.options, values), prog=prog, description=header)
    flat = to_flat(parsed)
    _scale_warmup(flat, recipe_values, explicit)
    options = build(cmd.options, flat)  # the real dataclasses: their checks run here
    return options, known.print_config


def _scale_warmup(flat: dict[str, Any], recipe: dict[str, Any], explicit: set[str]) -> None:
    """A recipe's warmup belongs to its run length: with ``--max-steps`` changed and no
    ``--warmup-steps`` given, the warmup keeps its fraction of the run (an explicit value stays
    as given, and TrainConfig rejects it if it exceeds the run)."""
    if "--warmup-steps" in explicit or "warmup_steps" not in recipe or "max_steps" not in recipe:
        return
    planned, steps, warmup = recipe["max_steps"], flat["max_steps"], recipe["warmup_steps"]
    if steps != planned and isinstance(steps, int) and planned > 0:
        flat["warmup_steps"] = min(warmup, warmup * steps // planned)


# --------------------------------------------------------------------------- errors
def _is_usage_error(e: BaseException) -> bool:
    from gpt2.model.tokenizer import TokenizerNotAvailableError

    return isinstance(
        e,
        (
            UsageError,
            ConfigError,
            ValueError,
            TypeError,
            FileNotFoundError,
            FileExistsError,
            NotADirectoryError,
            IsADirectoryError,
            PermissionError,
            ConnectionError,
            ImportError,
            TokenizerNotAvailableError,
        ),
    )


def in_cli_terms(message: str, cls: type) -> str:
    """A library message in the command line's words: ``TrainConfig.max_lr`` / ``max_lr=`` ->
    ``--max-lr``, ``overwrite=True`` -> ``--overwrite``, ``resume='auto'`` -> ``--resume auto``."""
    from gpt2.cli.layers import option_fields

    flags = {}
    for path, key, _ in option_fields(cls):
        flags.setdefault(path[-1], "--" + key.replace("_", "-"))
        flags[key] = "--" + key.replace("_", "-")

    def value_form(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if name not in flags:
            return m.group(0)
        flag = flags[name]
        if value == "True":
            return flag
        if value == "False":
            return flag.replace("--", "--no-", 1) if "." not in flag else flag
        return f"{flag} {value.strip(chr(39) + chr(34))}"

    message = re.sub(
        r"(?<![\w./-])(?:(?:TrainConfig|LoRAConfig|GPTConfig)\.)?([a-z_]+)=('[^']*'|\"[^\"]*\"|[\w.+-]+)",
        value_form,
        message,
    )
    message = re.sub(
        r"\b(?:TrainConfig|LoRAConfig|GPTConfig)\.(\w+)\b(?!\[)", lambda m: flags.get(m.group(1), m.group(0)), message
    )
    # A bare name is only a name when it is unmistakably one: snake_case, not inside a path.
    return re.sub(
        r"(?<![\w./-])([a-z]+(?:_[a-z0-9]+)+)(?![\w/.-]*\w)", lambda m: flags.get(m.group(1), m.group(0)), message
    )


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, KeyError):
        text = f"missing key {text}"
    return " ".join(text.split())


# --------------------------------------------------------------------------- entry points
def run_command(
    name: str,
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    defaults: dict[str, Any] | None = None,
    description: str | None = None,
) -> int:
    """Run one command with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    ``defaults`` (option name -> value, or ``recipe``) sit between the recipe and ``--config``:
    this is how each example script sets its own. ``prog`` and ``description`` set ``--help``."""
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r}; choose one of {sorted(COMMANDS)}")
    cmd = COMMANDS[name]
    prog = prog or f"gpt2 {name}"
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("GPT2_DEBUG", "") not in ("", "0")
    _setup_logging()
    try:
        try:
            options, print_config = parse(cmd, argv, prog=prog, defaults=defaults, description=description)
        except SystemExit as e:  # --help (0) or a bad flag (2, tyro printed why)
            return int(e.code or 0)
        if print_config:
            sys.stdout.write(dump_yaml(options, f"# {prog}: resolved options (use with --config)\n"))
            return 0
        launch = getattr(options, "launch", None)  # train and finetune can start their own workers
        nproc = launch.nproc_per_node if launch is not None else 1
        if nproc < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
        if nproc > 1 and "RANK" not in os.environ:  # start the workers, unless we are one
            os.environ[LAUNCH_ARGV] = shlex.join(argv)  # for the workers' resume line
            return _launch(cmd, options, nproc, prog)
        from gpt2.cli import jobs

        result = getattr(jobs, cmd.job)(options)
        return result if isinstance(result, int) else 0
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal the Trainer turned into TrainingInterrupted
        # Under torchrun the signal reaches every rank and the agent forwards another: ignore
        # further ones (no second traceback while exiting) and let only rank 0 say it.
        signum = getattr(e, "signum", signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if int(os.environ.get("RANK", "0") or 0) == 0:
            checkpoint = getattr(e, "checkpoint", None)
            resume = f"; resume with: {_resume_command(prog, argv)}" if checkpoint is not None else ""
            print(f"\n{prog}: {e if str(e) else 'interrupted'}{resume}", file=sys.stderr)
        return 128 + int(signum)
    except Exception as e:  # noqa: BLE001 - the command line reports, the library raises
        if debug:
            raise
        code = EXIT_USAGE if _is_usage_error(e) else EXIT_FAILURE
        kind = "error" if code == EXIT_USAGE else f"error ({type(e).__name__})"
        # UsageErrors are written for the command line already; the library's name Python terms.
        message = _one_line(e) if isinstance(e, UsageError) else in_cli_terms(_one_line(e), cmd.options)
        print(f"{prog}: {kind}: {message}", file=sys.stderr)
        if code == EXIT_FAILURE:
            print(f"{prog}: set GPT2_DEBUG=1 for the full traceback", file=sys.stderr)
        return code


LAUNCH_ARGV = "GPT2_LAUNCH_ARGV"  # the launcher's own arguments, for its workers' resume line


def _resume_command(prog: str, argv: Sequence[str]) -> str:
    """The command that continues an interrupted run: this one with ``--resume auto``."""
    words = shlex.split(os.environ.get(LAUNCH_ARGV, "")) or list(argv)
    kept: list[str] = []
    skip = False
    for word in words:
        if skip or word == "--resume" or word.startswith("--resume="):
            skip = word == "--resume"
            continue
        kept.append(word)
    command = shlex.split(prog)
    if "TORCHELASTIC_RUN_ID" in os.environ and LAUNCH_ARGV not in os.environ:  # under plain torchrun
        torchrun = ["torchrun", "--standalone", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", "1")]
        command = [*torchrun, "-m", *command] if command[0] == "gpt2" else [*torchrun, *command]
    return shlex.join([*command, *kept, "--resume", "auto"])


def _launch(cmd: Command, options: Any, nproc: int, prog: str) -> int:
    """``--nproc-per-node N``: check the options once here (a bad value is one line, not one per
    rank), then start N workers that each read these resolved options."""
    import dataclasses

    from gpt2.cli.jobs import check_options
    from gpt2.cli.launch import launch_workers

    check_options(cmd.name, options)
    single = dataclasses.replace(options, launch=dataclasses.replace(options.launch, nproc_per_node=1))
    return launch_workers(cmd.name, dump_yaml(single, f"# {prog}: options of the launcher\n"), nproc, prog)


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
        from gpt2 import __version__

        print(f"gpt2 {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(
            f"gpt2: error: unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)} (gpt2 --help lists them)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run_command(argv[0], argv[1:])


def _top_help() -> str:
    width = max(len(n) for n in COMMANDS)
    return "\n".join(
        [
            "usage: gpt2 <command> [options]     (also: python -m gpt2 <command>)",
            "",
            "GPT-2 from pretraining to LoRA fine-tuning, sampling and evaluation.",
            "",
            "commands:",
            *(f"  {n.ljust(width)}  {c.summary}" for n, c in COMMANDS.items()),
            "",
            "`gpt2 <command> --help` lists the command's options. Every command also takes --recipe NAME|FILE,",
            "--config FILE.yaml (keys = option names) and --print-config; flags win over files.",
        ]
    )
