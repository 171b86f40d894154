"""Quiet, honest output: progress bars only on a terminal, perplexity from few tokens flagged."""

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


# ------------------------------------------------------------------ few tokens, short data


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (6, "val loss 2.3100 | perplexity 10.07 (from only 6 tokens: a rough estimate)"),
        (1, "val loss 2.3100 | perplexity 10.07 (from only 1 token: a rough estimate)"),
        (4096, "val loss 2.3100 | perplexity 10.07 | 4,096 tokens"),
    ],
)
def test_final_report_flags_a_perplexity_from_few_tokens(monkeypatch, capsys, tokens, expected):
    from types import SimpleNamespace

    from gpt2.cli import common

    loss = {"loss": 2.31, "perplexity": 10.07, "tokens": tokens}
    monkeypatch.setattr(common, "val_loss", lambda *args: loss)
    trainer = SimpleNamespace(step=2, is_main=True, out_dir=None)
    sampling = SimpleNamespace(num_samples=0)
    common.final_report(trainer, "val", sampling, final_eval_batches=None, header="after fine-tuning:")
    assert capsys.readouterr().out == f"after fine-tuning: {expected}\n"


class _UncountedLoader:
    """A loader that cannot tell its batches per pass (as the instruction loaders)."""

    def __init__(self, inner):
        self.inner = inner
        self.batch_size, self.seq_len = inner.batch_size, inner.seq_len

    def __getattr__(self, name):
        if name == "batches_per_pass":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_short_data_warning_and_bar_agree_on_one_batch(monkeypatch, capsys, caplog):
    from gpt2.data.loader import TokenLoader

    model, tokens = _model_and_tokens()
    loader = _UncountedLoader(TokenLoader(tokens[: 2 * 16 + 1], 2, 16))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    evaluate_loss(model, loader, 2, 16, max_batches=4, progress=True)
    warning = "holds only 1 batch(es) of 2 x 16 tokens; scored them once instead of max_batches=4"
    assert warning in caplog.text
    # the bar's last frame counts the batches read, not max_batches
    frames = [frame for frame in capsys.readouterr().err.split("\r") if frame.startswith("eval")]
    assert "1/1" in frames[-1]
