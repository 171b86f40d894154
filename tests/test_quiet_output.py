"""Issue 30, "quiet, honest output": progress bars only on a terminal, perplexity from few tokens flagged."""

from __future__ import annotations

import sys

import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.data import prepare
from gpt2.eval.loss import evaluate_loss
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer


def _model_and_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    tokens = torch.randint(0, 64, (2048,), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _fit_and_evaluate(model, tokens):
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=2,
        eval_interval=2,
        eval_steps=3,
        out_dir=None,
        device="cpu",
        progress=True,
    )
    Trainer(model, config, tokens, tokens, sinks=[]).fit()
    evaluate_loss(model, tokens, 2, 16, max_batches=4, progress=True)


def test_no_progress_bar_when_stderr_is_redirected(capfd):
    """A log file gets no carriage returns or escape codes from the train, val and eval bars."""
    model, tokens = _model_and_tokens()
    _fit_and_evaluate(model, tokens)
    err = capfd.readouterr().err
    assert "\r" not in err and "\x1b" not in err


def test_progress_bar_on_a_terminal(capsys, monkeypatch):
    model, tokens = _model_and_tokens()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _fit_and_evaluate(model, tokens)
    err = capsys.readouterr().err
    assert "train" in err and "val:" in err and "eval" in err and "\r" in err


@pytest.mark.parametrize("terminal", [False, True])
def test_prepare_bars_only_on_a_terminal(tmp_path, monkeypatch, capsys, terminal):
    monkeypatch.setattr(prepare, "_BAR_DELAY_S", 0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    docs = ["Speak, speak. You are all resolved rather to die than to famish?"] * 20
    prepare.write_shards(docs, tmp_path / "out", prefix="t", shard_size=100, progress=True)
    err = capsys.readouterr().err
    assert ("t shard" in err) == terminal


def test_progress_not_requested_is_never_shown(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert prepare.progress_enabled(True) and not prepare.progress_enabled(False)
