"""Honest evaluation: no batch is read twice, and the final report under DDP is split across ranks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import dist_job

from gpt2 import GPT, GPTConfig
from gpt2.data import TokenLoader
from gpt2.eval.loss import evaluate_loss
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer

B, T = 2, 16


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # far from uniform, so batches differ in loss and their weights matter
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _batch_losses(model: GPT, val: torch.Tensor) -> list[float]:
    """Mean loss per token of each batch of one pass over ``val``, each batch once."""
    loader = TokenLoader(val, B, T)
    losses = []
    with torch.no_grad():
        for _ in range((len(val) - 1) // (B * T)):
            x, y = loader.next_batch()
            losses.append(F.cross_entropy(model(x)[0].reshape(-1, 128), y.reshape(-1)).item())
    return losses


def _reference(model: GPT, val: torch.Tensor) -> tuple[float, int]:
    """Mean loss per token over one pass (equal-size batches: the mean of the batch means)."""
    losses = _batch_losses(model, val)
    return sum(losses) / len(losses), len(losses)


def test_trainer_evaluate_does_not_wrap_a_short_val_set(caplog):
    model = _model()
    val = _tokens(3 * B * T + 1, seed=2)  # exactly 3 batches
    losses = _batch_losses(model, val)
    expected = sum(losses) / 3
    wrapped = (4 * losses[0] + 3 * losses[1] + 3 * losses[2]) / 10  # 10 steps wrapping around
    assert len(losses) == 3 and wrapped != pytest.approx(expected, rel=1e-4)  # the test can tell
    config = TrainConfig(
        micro_batch_size=B,
        seq_len=T,
        max_steps=1,
        eval_steps=10,
        eval_interval=0,
        progress=False,
        device="cpu",
        precision="fp32",
        plot=False,
        out_dir=None,
    )
    with Trainer(model, config, _tokens(1024), val, sinks=[]) as trainer, caplog.at_level(logging.WARNING):
        first = trainer.evaluate()
        second = trainer.evaluate(steps=7)
        exact = trainer.evaluate(steps=3)  # as many batches as there are: no warning needed
        fewer = trainer.evaluate(steps=2)
        with pytest.raises(ValueError, match="max_batches must be a positive integer"):
            trainer.evaluate(steps=0)  # not taken for "the default" (it ran eval_steps batches)
    assert first == pytest.approx(expected, rel=1e-5) and second == first == exact
    assert fewer == pytest.approx((losses[0] + losses[1]) / 2, rel=1e-5)  # the cap still works
    warnings = [r.getMessage() for r in caplog.records if "data holds only" in r.getMessage()]
    assert len(warnings) == 1 and "only 3 batch(es) of 2 x 16 tokens" in warnings[0]  # once per run


def test_evaluate_loss_says_when_max_batches_exceeds_the_data(caplog):
    model = _model()
    val = _tokens(4 * B * T + 5, seed=3)  # 4 batches and a few tokens
    expected, n = _reference(model, val)
    with caplog.at_level(logging.WARNING):
        capped = evaluate_loss(model, val, B, T, max_batches=100)
    assert capped["tokens"] == n * B * T and capped["loss"] == pytest.approx(expected, rel=1e-6)
    assert any("holds only 4 batch(es)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        evaluate_loss(model, val, B, T, max_batches=4)
        evaluate_loss(model, val, B, T)
    assert not caplog.records  # nothing to say when the data covers what was asked


def test_distributed_flag_is_a_no_op_in_one_process():
    model = _model()
    val = _tokens(5 * B * T + 1, seed=4)
    assert evaluate_loss(model, val, B, T, distributed=True) == evaluate_loss(model, val, B, T)


@pytest.mark.slow
@pytest.mark.dist
def test_final_report_is_split_across_ranks_and_equals_one_process(tmp_path, dist_run):
    rank0, rank1 = dist_run.reports("final_eval")
    single = dist_job("final_eval", tmp_path / "single")

    # Rank 0 reports what one process reports: all 5 batches (3 scored here, 2 on rank 1), or 3.
    for key, batches in (("full", 5), ("capped", 3)):
        assert rank0[key]["val_tokens"] == single[key]["val_tokens"] == batches * B * T
        assert rank0[key]["val_loss"] == pytest.approx(single[key]["val_loss"], rel=1e-9)
    assert rank1["full"] == {} and rank1["capped"] == {}  # only rank 0 reports
    assert (rank0["full_forwards"], rank1["full_forwards"], single["full_forwards"]) == (3, 2, 5)  # split
    assert rank0["evaluate"] == rank1["evaluate"]  # both ranks stopped at the end of the data
