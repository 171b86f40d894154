"""``gpt2 train --nproc-per-node N``: start N worker processes on this machine ourselves.

It does what ``torchrun --standalone --nproc-per-node N -m gpt2 train ...`` does, through
torch.distributed's own launcher API (the elastic agent torchrun is built on), with one
difference users notice: Ctrl-C ends the run with one line and exit code 130. Under plain
torchrun the workers exit just as cleanly, but torchrun's agent turns the signal into a
``SignalException`` and prints its traceback; that part is torchrun's own and cannot be changed
from the workers.

The workers get the launcher's *resolved* options (defaults, recipe, an example script's
defaults, config file and flags already merged) as a ``--config`` file, the YAML that
``--print-config`` writes, so every rank runs exactly the options the launcher saw.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid

EXIT_INTERRUPTED = 130


def launch_workers(command: str, config_yaml: str, nproc_per_node: int, prog: str) -> int:
    """Run ``python -m gpt2 <command> --config <config_yaml>`` in ``nproc_per_node`` processes (one
    per GPU, or gloo on CPU); returns the exit code (the first failed rank's, 130 on Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every step of its life ("Sending process N closing signal SIGINT", "failed
    # (exitcode: 2)"...); the workers' own one-line messages are what the user wants to read.
    # Its loggers set their own levels, so each one is quietened (they exist once imported).
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    fd, path = tempfile.mkstemp(prefix=f"gpt2-{command}-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_yaml)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc_per_node,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",  # what torchrun --standalone uses
            max_restarts=0,  # a failed rank fails the run; restarting would repeat the failure
        )
        try:
            elastic_launch(config, sys.executable)("-m", "gpt2", command, "--config", path)
        except SignalException as e:
            # Ctrl-C reaches the workers too (same process group): rank 0 has already said
            # "interrupted". Another signal (SIGTERM from a scheduler) gets its own line.
            if e.sigval != 2:  # SIGINT
                print(f"{prog}: stopped by signal {int(e.sigval)}", file=sys.stderr)
                return 128 + int(e.sigval)
            return EXIT_INTERRUPTED
        except ChildFailedError as e:
            # The failing rank printed its own one-line error; report its exit code.
            codes = [f.exitcode for f in e.failures.values() if f.exitcode]
            if codes and all(c in (EXIT_INTERRUPTED, -2) for c in codes):
                return EXIT_INTERRUPTED
            return next((c for c in codes if c > 0), 1)
        return 0
    finally:
        os.unlink(path)
