"""Signals as Unix users expect: a stop signal that is ignored when the run starts
stays ignored. ``nohup gpt2 train ... &`` sets SIGHUP to SIG_IGN, and so does ``trap '' HUP``; the
run used to replace that with its own handler and stop when the terminal closed.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import signal_after_step

from gpt2.cli import main
from gpt2.files import Stopped, StopSignals

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")


@pytest.fixture
def sighup_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGHUP, previous)


def test_an_ignored_sighup_stays_ignored_and_the_others_still_stop(sighup_ignored):
    stop = StopSignals().install()
    try:
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.raise_signal(signal.SIGHUP)
        assert stop.received == 0
        signal.raise_signal(signal.SIGTERM)
        assert stop.received == signal.SIGTERM
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_a_sighup_not_ignored_still_stops():
    before = signal.getsignal(signal.SIGHUP)
    stop = StopSignals().install()
    try:
        signal.raise_signal(signal.SIGHUP)
        assert stop.received == signal.SIGHUP
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGHUP) == before


def test_nohup_train_keeps_training_through_a_hangup(tmp_path, shakespeare_file, sighup_ignored, capsys, monkeypatch):
    """`nohup gpt2 train ...`: SIGHUP is ignored when the run starts (nohup sets SIG_IGN, which exec
    keeps; here this process does, and runs the command line's main()). The terminal closes
    (SIGHUP) after step 2: the run goes on to its last step, exit 0.
    """
    steps = 4
    signal_after_step(monkeypatch, 2, signal.SIGHUP)
    args = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", str(steps)]
    args += ["--val-fraction", "0", "--eval-interval", "0", "--num-samples", "0", "--no-progress", "--no-plot"]
    args += ["--device", "cpu", "--log-interval", "1", "--checkpoint-interval", "0"]
    code = main(["train", *args, "--data", str(shakespeare_file), "--out-dir", str(tmp_path / "run")])
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    assert "interrupted" not in stderr
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics if line.strip()][-1] == steps
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # still ignored after the run


def test_torchruns_agent_leaves_a_signal_ignored_at_start_ignored(monkeypatch):
    """``nohup gpt2 train --nproc-per-node 2``: the agent installed its own SIGHUP handler and stopped
    every worker on hangup. It is now told (LaunchConfig.signals_to_handle) to handle only the stop
    signals this process does not ignore.
    """
    import torch.distributed.launcher.api as launcher

    from gpt2.cli import launch

    seen = {}

    def fake_launch(config, entrypoint):
        def run(*args):
            seen["signals"] = config.signals_to_handle

        return run

    monkeypatch.setattr(launcher, "elastic_launch", fake_launch)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert launch.launch_workers("train", "max_steps: 1\n", 2, "gpt2 train") == 0
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert seen["signals"] == "SIGTERM,SIGINT,SIGQUIT"
    # Not ignored: the agent handles it as before.
    assert launch.launch_workers("train", "max_steps: 1\n", 2, "gpt2 train") == 0
    assert seen["signals"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    # A list the user set in torch's own variable is kept.
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    assert launch.launch_workers("train", "max_steps: 1\n", 2, "gpt2 train") == 0
    assert seen["signals"] == "SIGTERM"


def test_the_last_stop_signal_stops_at_once_naming_the_signal_and_the_outcome():
    stop = StopSignals(force_after=2, outcome="nothing was written").install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM  # the first one is only noted
        with pytest.raises(Stopped, match="stopped by SIGHUP; nothing was written") as info:
            os.kill(os.getpid(), signal.SIGHUP)
        assert info.value.signum == signal.SIGHUP and isinstance(info.value, KeyboardInterrupt)
        # the handlers it replaced are back
        assert signal.getsignal(signal.SIGTERM) != stop._handle
    finally:
        stop.restore()
