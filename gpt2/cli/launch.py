"""``gpt2 train --nproc-per-node N``: start N worker processes on this machine ourselves.

It does what ``torchrun --standalone --nproc-per-node N -m gpt2 train ...`` does, through the elastic agent torchrun is
built on, except that a stop signal (Ctrl-C, SIGTERM, SIGHUP) ends the run with rank 0's one line (where the checkpoint
is, how to resume) and exit code 128 + the signal: torchrun's own agent prints a ``SignalException`` traceback the
workers cannot change. The workers get the launcher's resolved options as a ``--config`` file (what ``--print-config``
writes), so every rank runs exactly the options the launcher saw.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import uuid

# How long the workers have after a stop signal to finish their step and save, before SIGKILL
# (torchrun's default, 30 s, can be shorter than one step plus a save of a large model).
SHUTDOWN_SECONDS = 300


# The signals torchrun's agent turns into a stop of every worker (its own default list).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def launch_workers(command: str, config_yaml: str, nproc_per_node: int, prog: str) -> int:
    """Run ``python -m gpt2 <command> --config <config_yaml>`` in ``nproc_per_node`` processes;
    returns the exit code (the first failed rank's, or 128 + the stop signal).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every step of its life ("Sending process N closing signal SIGINT", "failed
    # (exitcode: 2)"...); the workers' own one-line messages are what the user wants to read.
    # Its loggers set their own levels, so each one is quietened (they exist once imported).
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # Deleted when the launch ends; the workers read it by name while it exists.
    with tempfile.NamedTemporaryFile("w", prefix=f"gpt2-{command}-", suffix=".yaml", encoding="utf-8") as file:
        file.write(config_yaml)
        file.flush()
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc_per_node,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",  # what torchrun --standalone uses
            # A failed rank fails the run; restarting would repeat the failure.
            max_restarts=0,
            shutdown_timeout=SHUTDOWN_SECONDS,
            # A stop signal ignored when the run starts (``nohup``: SIGHUP, ``trap '' HUP``) stays ignored, by the
            # agent as by the workers, which inherit the ignored disposition and keep it (gpt2.files.StopSignals).
            # A list the user set (torch's own variable) is theirs to keep.
            signals_to_handle=os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
            or ",".join(
                name for name in _AGENT_SIGNALS if signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN
            ),
        )
        try:
            elastic_launch(config, sys.executable)("-m", "gpt2", command, "--config", file.name)
        except SignalException as e:
            # The agent forwarded the signal and waited for the workers: each stopped at the same
            # step boundary with exit code 128 + signal, and rank 0 said where to resume.
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            # The failing rank printed its own one-line error; report its exit code.
            codes = [f.exitcode for f in e.failures.values() if f.exitcode]
            if codes and all(c < 0 for c in codes):  # killed by a signal (-N)
                return 128 - codes[0]
            return next((c for c in codes if c > 0), 1)
        return 0
