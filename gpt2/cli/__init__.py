"""The command line: ``gpt2 <command> [options]`` (also ``python -m gpt2 <command>``).

Each command is a module of this package holding its options dataclass and the function that runs it (``gpt2 train``:
:class:`gpt2.cli.train.TrainOptions`, :func:`gpt2.cli.train.train`); :mod:`gpt2.cli.layers` turns the fields into
flags over the defaults of recipes and files, and tyro draws their ``--help``. A bad flag, value or file ends with a
one-line error and exit code 2; another failure exits 1 (``GPT2_DEBUG=1`` shows the traceback). A read or write the
system refused (a full disk, a read-only folder) is one line naming the file and what to do, and for a training run
its intact checkpoint and the resume command. Ctrl-C, SIGTERM and SIGHUP stop training at a step boundary with a
checkpoint and a resume line, exit code 128 + the signal.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pkgutil
import select
import shlex
import signal
import sys
import typing
from collections.abc import Sequence
from typing import Any, NamedTuple

from gpt2.cli.layers import UsageError, dump_yaml
from gpt2.cli.layers import parse as parse_options
from gpt2.errors import Gpt2Error, InvalidValueError

# argparse's code for a bad command line; we use it for every input error.
EXIT_USAGE = 2
EXIT_FAILURE = 1
# The errors that mean the input cannot be used (a bad flag, value or file): exit code 2 and the
# message alone. gpt2.cli's own errors are all UsageErrors; every other gpt2.Gpt2Error also has a
# builtin base, which decides: a run that failed (TrainingDivergedError, a RuntimeError; a full
# disk, an OSError) exits 1. TokenizerNotAvailableError (_report_error) is a RuntimeError about input.
USAGE_ERRORS = (
    UsageError,
    ValueError,
    TypeError,
    ConnectionError,
    ImportError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


class Command(NamedTuple):
    """A module of gpt2.cli holding the function named like it, its summary and default recipe."""

    module_name: str
    summary: str
    recipe: str | None = None

    def member(self, name: str) -> Any:
        """``name`` of the command's module: its function (named like the module) or its ``check``."""
        return pkgutil.resolve_name(f"gpt2.cli.{self.module_name}:{name}")

    @property
    def function(self) -> Any:
        return self.member(self.module_name)

    @property
    def options(self) -> type:
        return typing.get_type_hints(self.function)["options"]

    def parse(self, argv: Sequence[str], **kwargs: Any) -> Any:
        """The options from the recipe, ``defaults`` (an example script's), the config file and ``argv``."""
        return parse_options(self.options, list(argv), recipe=self.recipe, **kwargs)


COMMANDS: dict[str, Command] = {
    "train": Command("train", "pretrain a GPT-2 (Tiny Shakespeare by default), val loss and samples", "shakespeare"),
    "finetune": Command("finetune", "LoRA (or full) fine-tuning of GPT-2 weights on text or instructions", "finetune"),
    "sample": Command("sample", "stream text from a model (hub id, transformers dir or checkpoint)"),
    "prepare": Command("prepare", "tokenise text or jsonl files, or a Hugging Face dataset, into shards"),
    "eval": Command("evaluate", "validation loss / perplexity on token data, and HellaSwag accuracy", "eval"),
    "export": Command("export", "write a transformers folder, a GGUF file and/or a PEFT adapter"),
    "bench": Command("bench", "the training speed-up ladder: fp32, tf32, bf16, compile, flash...", "bench"),
}


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
    this is how each example script sets its own. ``prog`` and ``description`` set ``--help``.
    """
    if name not in COMMANDS:
        raise InvalidValueError(f"unknown command {name!r}; choose one of {sorted(COMMANDS)}")
    if argv is None:
        argv = sys.argv[1:]
    argv = list(argv)
    prog = prog or f"gpt2 {name}"
    # The reports of a failure or a stop need the options once they are parsed (a run's resume line).
    options = None
    _setup_logging()
    # Each line as it is printed, also into a file or a pipe (Python holds them back in blocks there).
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    try:
        options = COMMANDS[name].parse(argv, prog=prog, defaults=defaults, description=description)
        return _run(name, options, argv, prog)
    except SystemExit as e:  # --help (0)
        return int(e.code or 0)
    except BrokenPipeError as e:
        if _reader_gone():
            return EXIT_FAILURE
        return _report_error(e, prog, argv, options)
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal the Trainer turned into TrainingInterrupted
        return _report_interrupt(e, prog, argv, options)
    except Exception as e:  # noqa: BLE001 - the command line reports, the library raises
        if os.environ.get("GPT2_DEBUG", "") not in ("", "0"):
            raise
        return _report_error(e, prog, argv, options)


def _run(name: str, options: Any, argv: list[str], prog: str) -> int:
    """Print the options, start the workers or run the command."""
    if options.print_config:
        sys.stdout.write(dump_yaml(options, f"# {prog}: resolved options (use with --config)\n"))
        return 0
    # train and finetune can start their own workers (unless this process is one)
    launch = getattr(options, "launch", None)
    if launch is not None and launch.nproc_per_node > 1 and "RANK" not in os.environ:
        return _launch(name, options, argv, prog)
    result = COMMANDS[name].function(options)
    # Prepare and export return an exit code, the others their results.
    if isinstance(result, int):
        return result
    return 0


def _launch(name: str, options: Any, argv: list[str], prog: str) -> int:
    """Start ``--nproc-per-node`` workers, each reading these resolved options."""
    from gpt2.cli.launch import launch_workers

    # Check the options once here: a bad value is one line, not one per rank.
    COMMANDS[name].member("check")(options)
    single = dataclasses.replace(options, launch=dataclasses.replace(options.launch, nproc_per_node=1))
    config = dump_yaml(single, f"# {prog}: options of the launcher\n")
    # The workers' resume line repeats the launcher's arguments. Only the workers read them: a
    # later command in this process must not.
    os.environ[LAUNCH_ARGV] = shlex.join(argv)
    try:
        return launch_workers(name, config, options.launch.nproc_per_node, prog)
    finally:
        del os.environ[LAUNCH_ARGV]


def _reader_gone() -> bool:
    """Whether the program reading stdout ended (``gpt2 train --help | head``): its pipe reports an error. Then
    stdout points at nothing, as Python flushes it once more on exit, which would fail again with a traceback.
    """
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poll.poll(0)):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


def _report_interrupt(e: KeyboardInterrupt, prog: str, argv: list[str], options: Any) -> int:
    """Rank 0's line for a stopped run (and how to resume it); returns 128 + the signal."""
    # Under torchrun the signal reaches every rank and the agent forwards another: ignore
    # further ones (no second traceback while exiting) and let only rank 0 say it.
    signum = getattr(e, "signum", signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _rank() == 0:
        message = str(e) or "interrupted"
        if getattr(e, "checkpoint", None) is not None:
            message += f"; resume with: {_resume_command(prog, argv, options)}"
        print(f"\n{prog}: {message}", file=sys.stderr)
    return 128 + int(signum)


def _report_error(e: Exception, prog: str, argv: list[str], options: Any) -> int:
    """One line for ``e``; returns the exit code: 2 for input that cannot be used, else 1."""
    from gpt2.model.tokenizer import TokenizerNotAvailableError

    code = EXIT_FAILURE
    if isinstance(e, (*USAGE_ERRORS, TokenizerNotAvailableError)):
        code = EXIT_USAGE
    text = " ".join((str(e) or type(e).__name__).split())
    # Under torchrun every rank meets the same bad input: rank 0 says it once. Other failures (out
    # of memory on one rank) are said by the rank that met them.
    if code == EXIT_USAGE and _rank() != 0:
        return code
    # A read or write that failed (a full disk, a read-only folder...), not a file or folder of the user's that
    # gpt2 refused (a MissingFileError, a RunDirError: their messages say it all).
    if isinstance(e, OSError) and not (isinstance(e, Gpt2Error) and isinstance(e, USAGE_ERRORS)):
        print(f"{prog}: error: {_system_error(e, text, prog, argv, options)}", file=sys.stderr)
    elif code == EXIT_USAGE:
        print(f"{prog}: error: {text}", file=sys.stderr)
    else:
        print(f"{prog}: error ({type(e).__name__}): {text}", file=sys.stderr)
        print(f"{prog}: set GPT2_DEBUG=1 for the full traceback", file=sys.stderr)
    return code


def _system_error(e: OSError, text: str, prog: str, argv: list[str], options: Any) -> str:
    """One line for a read or write that failed (``text``: ``e`` on one line): the file, what happened and what to
    do (the library's own errors, a checkpoint that could not be saved..., say all of it themselves); for a training
    run (on rank 0), also its newest intact checkpoint and the command that resumes from it.
    """
    from gpt2.cli.common import intact_checkpoint
    from gpt2.files import ERROR_ADVICE, write_advice
    from gpt2.train.metrics import RunOutputError
    from minlora.errors import MinloraError

    if not isinstance(e, (Gpt2Error, MinloraError)):
        files = [str(name) for name in (e.filename, e.filename2) if name is not None]
        text = " ".join((e.strerror or str(e)).split())
        if files:
            text = f"{' -> '.join(files)}: {text}"
        if e.errno in ERROR_ADVICE:
            text += f"; {write_advice(e)}"
    out_dir = getattr(getattr(options, "train", None), "out_dir", None)
    if out_dir is None or _rank() != 0:
        return text
    checkpoint = intact_checkpoint(out_dir)
    if checkpoint is None:
        return text
    # A failed write of the run (RunOutputError) names the newest intact checkpoint itself.
    if not isinstance(e, RunOutputError):
        text += f"; checkpoint {checkpoint} is intact"
    return f"{text}; resume with: {_resume_command(prog, argv, options)}"


# The launcher's own arguments, for its workers' resume line.
LAUNCH_ARGV = "GPT2_LAUNCH_ARGV"
# The flags of a first start: `--overwrite` would now refuse, `--resume-weights-only` drop the optimizer state.
FIRST_START_FLAGS = ("--resume=", "--overwrite", "--no-overwrite", "--resume-weights-only", "--no-resume-weights-only")


# Options a --config file or recipe may set that would stop the resume line: the flags that undo them.
UNDO_FIRST_START = {"overwrite": "--no-overwrite", "resume_weights_only": "--no-resume-weights-only"}


def _resume_command(prog: str, argv: Sequence[str], options: Any = None) -> str:
    """The command that continues an interrupted run: this one with ``--resume auto``, without a first
    start's flags, and with the flags that undo the ones ``options`` got from a file.
    """
    words = iter(shlex.split(os.environ.get(LAUNCH_ARGV, "")) or argv)
    kept = []
    for word in words:
        if word == "--resume":
            next(words, None)  # and its value
        elif not word.startswith(FIRST_START_FLAGS):
            kept.append(word)
    train = getattr(options, "train", None)
    kept += [flag for name, flag in UNDO_FIRST_START.items() if getattr(train, name, False)]
    return shlex.join([*_started_as(prog), *kept, "--resume", "auto"])


def _started_as(prog: str) -> list[str]:
    """The words that started this command: ``gpt2 train``, ``python examples/x.py``, either under torchrun."""
    command = shlex.split(prog)
    start: list[str] = []
    # An example script (prog "pretrain_shakespeare.py") by the path it was started with.
    if prog.endswith(".py"):
        command, start = [sys.argv[0]], ["python"]
    if "TORCHELASTIC_RUN_ID" in os.environ and LAUNCH_ARGV not in os.environ:  # torchrun's, not our own launcher
        start = ["torchrun", "--standalone", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", "1")]
        if command[0] == "gpt2":
            start.append("-m")
    return [*start, *command]


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


class _StdoutHandler(logging.StreamHandler):
    """Log records as plain lines on the *current* ``sys.stdout`` (which tests and tqdm swap)."""

    # read at every record; StreamHandler's own assignment of a stream is ignored
    stream = property(lambda self: sys.stdout, lambda self, stream: None)


def _setup_logging() -> None:
    # The library logs through `logging`; on the command line its INFO messages (the Trainer's
    # set-up lines, downloads, files written) are part of the output, other packages' (matplotlib's
    # "generated new fontManager") are not. Ranks other than 0 only show warnings. An application
    # that configured logging itself is left alone.
    root = logging.getLogger()
    if root.handlers:
        return
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in ("gpt2", "minlora"):
        logging.getLogger(name).setLevel(logging.INFO if _rank() == 0 else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """``gpt2 <command> [options]``; returns the exit code."""
    if argv is None:
        argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        # no command: the help, as a usage error
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
    commands = "\n".join(f"  {n.ljust(width)}  {c.summary}" for n, c in COMMANDS.items())
    return TOP_HELP.format(commands=commands)


TOP_HELP = """usage: gpt2 <command> [options]     (also: python -m gpt2 <command>)

GPT-2 from pretraining to LoRA fine-tuning, sampling and evaluation.

commands:
{commands}

`gpt2 <command> --help` lists the command's options. Every command also takes
--recipe NAME|FILE, --config FILE.yaml (keys = option names) and --print-config;
flags win over files."""
