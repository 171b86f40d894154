"""The jobs behind the command line and the example scripts: one function per command, each
taking its options dataclass (:mod:`gpt2.jobs.options`) and reading top to bottom.

``gpt2 train`` runs :func:`train`, ``gpt2 finetune`` :func:`finetune`, and so on; the scripts in
``examples/`` run the same functions through :func:`gpt2.cli.run_command`. Jobs print what the
user asked for; the library below them only logs.
"""

from __future__ import annotations

from typing import Any

from gpt2.cli.bench import bench
from gpt2.cli.common import UsageError
from gpt2.cli.evaluate import evaluate
from gpt2.cli.export import export
from gpt2.cli.finetune import finetune
from gpt2.cli.prepare import prepare
from gpt2.cli.sample import sample
from gpt2.cli.train import train

__all__ = ["UsageError", "bench", "check_options", "evaluate", "export", "finetune", "prepare", "sample", "train"]


def check_options(command: str, options: Any) -> None:
    """What ``train`` / ``finetune`` can check before any process starts (``--nproc-per-node``
    runs this once in the launcher, so a bad value is one line, not one per rank)."""
    # (imported by module path: the package attributes `train` and `finetune` are the functions)
    from gpt2.cli.finetune import check as check_finetune
    from gpt2.cli.train import check as check_train

    if command == "train":
        check_train(options)
    elif command == "finetune":
        check_finetune(options)
