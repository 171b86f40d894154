"""The bf16 training step casts each weight to bf16 once per optimizer step, not once per micro-step:
the same losses and gradients, bit for bit, as the per-micro-step casts it replaced, with and without gradient
accumulation, ignored targets and activation checkpointing; fewer casts, counted by torch.profiler (counts are
deterministic: no timing here); the fused loss under autocast against F.cross_entropy under autocast; and the
benchmark that counts the casts runs end to end at a tiny shape.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _tiny_run import Batches
from torch.profiler import ProfilerActivity, profile

from gpt2 import GPT, GPTConfig
from gpt2.model.gpt import IGNORE_INDEX
from gpt2.train.config import TrainConfig
from gpt2.train.precision import PrecisionPolicy, resolve_precision
from gpt2.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
B, T, V = 2, 16, 96
N_LAYER = 2
# the Linear layers whose weight and bias autocast casts in every forward (the LM head's cast is the loss's own)
LINEARS_PER_BLOCK = 4


def _model(checkpointing: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=N_LAYER, n_head=2, n_embd=32))
    return model.set_activation_checkpointing(checkpointing)


def _batches(accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``accum`` micro-batches of random ids, some targets ignored (a whole row of one of them)."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for i in range(accum):
        x = torch.randint(0, V, (B, T), generator=generator)
        y = torch.roll(x, -1, 1)
        y[0, : 3 + i] = IGNORE_INDEX
        if i == 1:
            y[1] = IGNORE_INDEX
        batches.append((x, y))
    return batches


def _config(accum: int, **overrides) -> TrainConfig:
    return TrainConfig(
        micro_batch_size=B,
        seq_len=T,
        total_batch_size=B * T * accum,
        max_steps=4,
        warmup_steps=0,
        # no clipping: the accumulated gradient stays in .grad after the step
        grad_clip=0.0,
        eval_interval=0,
        out_dir=None,
        progress=False,
        device="cpu",
        precision="bf16",
        plot=False,
        seed=0,
        **overrides,
    )


def _per_micro_step(monkeypatch) -> None:
    """The Trainer as it was: autocast entered and left per micro-step, so every micro-step casts every weight."""
    monkeypatch.setattr(PrecisionPolicy, "step_casts", lambda self, micro_steps: contextlib.nullcontext())


def _train(accum: int, checkpointing: bool = False, **overrides) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of two bf16 steps and the second step's gradients."""
    config = _config(accum, **overrides)
    with Trainer(_model(checkpointing), config, Batches(_batches(accum)), sinks=[]) as trainer:
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    return losses, grads


@pytest.mark.parametrize("accum,checkpointing", [(1, False), (2, False), (2, True)])
def test_one_cast_per_step_gives_the_per_micro_step_losses_and_gradients_bit_for_bit(monkeypatch, accum, checkpointing):
    losses, grads = _train(accum, checkpointing)
    with monkeypatch.context() as patch:
        _per_micro_step(patch)
        before_losses, before_grads = _train(accum, checkpointing)
    assert losses == before_losses
    assert grads.keys() == before_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, before_grads[name]), name


def test_compiled_bf16_steps_are_unchanged(monkeypatch):
    """Under torch.compile the graph makes its own casts (autocast's cache is not used): the same results."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, **{"backend": "aot_eager", **kw}))
    losses, grads = _train(2, compile=True)
    with monkeypatch.context() as patch:
        _per_micro_step(patch)
        before_losses, before_grads = _train(2, compile=True)
    assert losses == before_losses
    for name, grad in grads.items():
        assert torch.equal(grad, before_grads[name]), name


def _weight_casts(accum: int) -> int:
    """fp32 -> bf16 casts of a parameter-shaped tensor in the forwards of one (second) bf16 step."""
    model = _model()
    shapes = {tuple(p.shape) for p in model.parameters()}
    with Trainer(model, _config(accum), Batches(_batches(accum)), sinks=[]) as trainer:
        trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            trainer.train_step()
    casts = 0
    for event in prof.events():
        parent = event.cpu_parent
        if event.name != "aten::copy_" or parent is None or parent.name != "aten::_to_copy":
            continue
        if event.input_dtypes[:2] == ["c10::BFloat16", "float"] and tuple(event.input_shapes[0]) in shapes:
            casts += 1
    return casts


def test_each_weight_is_cast_once_per_step_not_once_per_micro_step(monkeypatch):
    accum = 3
    after = _weight_casts(accum)
    with monkeypatch.context() as patch:
        _per_micro_step(patch)
        before = _weight_casts(accum)
    per_forward = N_LAYER * LINEARS_PER_BLOCK * 2
    # the Linear weights and biases: once per micro-step before, once per step now; the other casts of
    # parameter-shaped tensors (the loss's LM-head casts: its own, per micro-step) stay as they were
    assert before - after == (accum - 1) * per_forward
    assert after < before


def test_step_casts_without_autocast_changes_nothing():
    policy = resolve_precision("fp32", "cpu")
    with policy.step_casts(2):
        assert not torch.is_autocast_enabled("cpu")
    bf16 = resolve_precision("bf16", "cpu")
    with bf16.step_casts(2):
        # the backward between the forwards runs outside autocast, as before
        assert not torch.is_autocast_enabled("cpu")
        with bf16.autocast():
            assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_enabled("cpu")


def _casts(output: torch.Tensor) -> set[torch.autograd.graph.Node]:
    """The cast nodes (``ToCopyBackward0``) in ``output``'s graph."""
    found, todo, seen = set(), [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "ToCopyBackward0":
            found.add(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_step_casts_keeps_one_cast_for_the_micro_steps_and_drops_it_after():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    policy = resolve_precision("bf16", "cpu")
    with policy.step_casts(2):
        with policy.autocast():
            first = F.linear(x, weight)
        first.float().sum().backward()
        with policy.autocast():
            second = F.linear(x, weight)
        second.float().sum().backward()
        # one bf16 cast of the weight, reached by both micro-steps' graphs, and a backward through it each time
        assert len(_casts(first)) == 1 and _casts(first) == _casts(second)
    with policy.autocast():
        third = F.linear(x, weight)
    assert _casts(third).isdisjoint(_casts(first))
    expected = 2 * x.bfloat16().float().sum(0).expand(8, 8)
    torch.testing.assert_close(weight.grad, expected, rtol=1e-2, atol=1e-2)
    # One micro-step has no cast to share: none is kept past its forward, so the backward can free each one as it
    # passes its layer.
    with policy.step_casts(1):
        with policy.autocast():
            alone = F.linear(x, weight)
        with policy.autocast():
            again = F.linear(x, weight)
        assert _casts(alone).isdisjoint(_casts(again))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_loss_and_gradients_match_cross_entropy_under_autocast(reduction):
    """The fused LM head + loss under bf16 autocast against the logits built whole and F.cross_entropy (fp32
    softmax), both with ignored rows: within bf16's rounding (8 bits of mantissa: relative 2^-8 per product).
    """
    x, y = _batches(2)[1]
    model = _model()
    reference = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y, reduction=reduction)
        logits, _ = reference(x)
        expected = F.cross_entropy(
            logits.float().reshape(-1, V), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction
        )
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=1e-3)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        error = (p.grad - q.grad).norm() / q.grad.norm()
        assert error < 2e-2, (name, float(error))


def _run_main(module) -> None:
    """A benchmark's ``main()``, which sets one thread and quiets the gpt2 logger for the whole process: both are
    put back after it (a later test in the same worker reads the step lines).
    """
    threads, level = torch.get_num_threads(), logging.getLogger("gpt2").level
    try:
        module.main()
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("gpt2").setLevel(level)


def test_bf16_casts_benchmark_prints_its_table(monkeypatch, capsys):
    # benchmarks/ is not installed
    monkeypatch.syspath_prepend(str(REPO))
    module = importlib.import_module("benchmarks.bf16_casts")
    monkeypatch.setattr(sys, "argv", ["bf16_casts.py", "--shape", "tiny", "--accum", "1,2", "--top", "3"])
    _run_main(module)
    out = capsys.readouterr().out
    assert out.startswith(module.describe_machine("cpu", 1))
    for accum in (1, 2):
        assert f"grad accumulation {accum}: one step" in out
    lines = (
        "aten::_to_copy |",
        "aten::copy_ |",
        "casts by kind and phase:",
        "profiler self time",
        "CPU time of one more",
    )
    for line in (*lines, "top 3 cast / copy sites"):
        assert line in out


def test_the_loss_levers_benchmark_prints_both_paths(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))
    module = importlib.import_module("benchmarks.bf16_loss_levers")
    argv = ["bf16_loss_levers.py", "--batch", "2", "--seq-len", "8", "--rounds", "1", "--layers", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--width", "32", "--vocab", "101"])
    module.main()
    out = capsys.readouterr().out
    assert out.startswith(module.describe_machine("cpu", 1))
    assert "\nold: median " in out and "\nnew: median " in out and "new / old (medians): " in out
    # the levers change the order of the sums only
    apart = float(out.split("gradients apart: ")[1].split()[0])
    assert apart < 1e-5
    # one lever at a time, by name; an unknown one is refused
    monkeypatch.setattr(sys, "argv", [*argv, "--width", "32", "--vocab", "101", "--old", "rows"])
    module.main()
    assert "old: rows undone" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv, "--old", "rows,fast"])
    with pytest.raises(SystemExit):
        module.main()
    assert "--old takes levers of tied, kept, aligned, rows, transposed, got 'rows,fast'" in capsys.readouterr().err


def test_the_gelu_benchmark_times_both_and_finds_them_equal(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))
    module = importlib.import_module("benchmarks.bf16_gelu")
    argv = ["bf16_gelu.py", "--rounds", "1", "--pairs", "1", "--model", "tiny", "--batch", "2", "--seq-len", "16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--vocab", "101"])
    _run_main(module)
    out = capsys.readouterr().out
    assert out.startswith(module.describe_machine())
    assert "  forward: tables " in out and "  backward: tables " in out
    assert "bit for bit the same: output True, input gradient True" in out
    assert "the Trainer's tiny bf16 step (B=2, T=16), 1 pairs: tables " in out
