"""The shell commands a Markdown document shows, and a way to run one as a user would.

`doc_commands` reads the ```bash / ```sh / ```console blocks of a document: one command per
line, a trailing backslash continues it, a quote left open continues it too (a multi-line
prompt), and `# ...` comments are dropped. In a ```console block only the `$ ` lines are
commands; the others are their output.

`run_command` runs one command line from the current directory, as a shell would in the
project's activated environment. `gpt2 ...`, `python -m gpt2 ...` and `python SCRIPT.py ...`
run inside this process (the `gpt2` script is `gpt2.__main__:main`, and every example script
is a thin `__main__` over it): a Python start-up, with torch, costs seconds on a 2-core machine,
and a document has a dozen commands. Any other program runs from the environment's bin folder
in a process of its own. `> FILE` sends the standard output to FILE.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCKS = {"bash", "sh", "console"}
FENCE = re.compile(r"^\s*```\s*(\w*)")


@dataclass(frozen=True)
class DocCommand:
    """One command of a document: its first line number and its text on one line."""

    line: int
    text: str


def doc_commands(path: Path) -> list[DocCommand]:
    """The commands of the shell blocks of the Markdown file `path`, in order."""
    commands = []
    language = None
    pending, start = "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        # A fence opens a block, naming its language, and a bare one closes it.
        fence = FENCE.match(line)
        if fence and language is None:
            language = fence.group(1) or "text"
            continue
        if fence and not fence.group(1) and not pending:
            language = None
            continue
        if language not in SHELL_BLOCKS:
            continue
        if not pending:
            # In a console block the `$ ` lines are commands and the others their output.
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = number
        pending += line + "\n"
        if line.endswith("\\") or not _complete(pending):
            continue
        commands.append(DocCommand(start, _without_comment(re.sub(r"\s*\\\n\s*", " ", pending).strip())))
        pending = ""
    return commands


def _complete(text: str) -> bool:
    """False while a quote is still open: the command goes on on the next line."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def _without_comment(text: str) -> str:
    """`text` without its trailing `# comment` (a `#` inside quotes is kept)."""
    words = shlex.split(text, comments=True)
    for hash_sign in re.finditer(r"\s#", text):
        head = text[: hash_sign.start()]
        with contextlib.suppress(ValueError):
            if shlex.split(head) == words:
                return head.rstrip()
    return text


def run_command(text: str) -> tuple[int, str]:
    """Run the command line `text`; its exit code and its output (stdout, then stderr)."""
    argv = shlex.split(text)
    stdout_file = None
    if ">" in argv:
        at = argv.index(">")
        stdout_file = argv[at + 1]
        argv = argv[:at] + argv[at + 2 :]
    program, *args = argv
    if program not in ("gpt2", "python"):
        return _run_program(program, args, stdout_file)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _run_python(program, args)
    if stdout_file is not None:
        Path(stdout_file).write_text(out.getvalue(), encoding="utf-8")
        return code, err.getvalue()
    return code, out.getvalue() + err.getvalue()


def _run_python(program: str, args: list[str]) -> int:
    from gpt2.cli import main

    if program == "gpt2":
        return main(args)
    if args[:2] == ["-m", "gpt2"]:
        return main(args[2:])
    script = args[0]
    if not script.endswith(".py"):
        raise ValueError(f"python {shlex.join(args)}: only `python -m gpt2` and `python SCRIPT.py` are run")
    saved_argv = sys.argv
    sys.argv = list(args)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return _exit_code(e.code)
    finally:
        sys.argv = saved_argv
    return 0


def _exit_code(code: object) -> int:
    """The exit status `sys.exit(code)` gives: a message is printed and means 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_program(program: str, args: list[str], stdout_file: str | None) -> tuple[int, str]:
    """Another program of the environment (torchrun, ...), in a process of its own."""
    executable = Path(sys.executable).parent / program
    if not executable.is_file():
        raise FileNotFoundError(f"{program}: not in the environment's bin folder {executable.parent}")
    # The environment's bin folder first on PATH, as `source .venv/bin/activate` puts it; this checkout's gpt2.
    env = {
        **os.environ,
        "PATH": os.pathsep.join(filter(None, [str(executable.parent), os.environ.get("PATH")])),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run([str(executable), *args], capture_output=True, text=True, env=env, timeout=300)
    if stdout_file is not None:
        Path(stdout_file).write_text(result.stdout, encoding="utf-8")
        return result.returncode, result.stderr
    return result.returncode, result.stdout + result.stderr
