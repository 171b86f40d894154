"""Activation checkpointing (``GPT.set_activation_checkpointing``, ``TrainConfig.activation_checkpointing``): the
same losses and gradients as without (dropout, LoRA and DoRA, the Trainer, torch.compile; DDP in
tests/test_distributed.py), only in a training forward with gradients, and less memory kept by the forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import gpt2.model.gpt as gpt_module
from gpt2.errors import InvalidValueError
from gpt2.model.config import GPTConfig
from gpt2.model.generate import KVCache
from gpt2.model.gpt import GPT
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer
from minlora.config import LoRAConfig
from minlora.model import add_lora
from minlora.utils import mark_only_lora_as_trainable

CONFIG = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32)


def _model(checkpointing: bool, **overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CONFIG, **overrides)).set_activation_checkpointing(checkpointing).train()


def _lora_model(checkpointing: bool, use_dora: bool = False, dropout: float = 0.1) -> GPT:
    model = _model(checkpointing, dropout=dropout)
    add_lora(model, LoRAConfig(rank=4, alpha=8, use_dora=use_dora, dropout=dropout))
    mark_only_lora_as_trainable(model)
    # B starts at zero, which would leave A without gradients: give both factors some.
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(2))
    return model


def _batch(T: int = 32) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: nn.Module, forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = _batch()
    # the same dropout masks with and without checkpointing
    torch.manual_seed(3)
    loss = (forward if forward is not None else model)(x, x)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_same_loss_and_gradients(dropout, flash):
    plain = _loss_and_grads(_model(False, dropout=dropout, flash=flash))
    _assert_same(_loss_and_grads(_model(True, dropout=dropout, flash=flash)), plain)


@pytest.mark.parametrize("use_dora", [False, True])
def test_same_gradients_with_lora_and_dora(use_dora):
    """The adapted weights (and LoRA's dropout) are recomputed inside the checkpointed blocks."""
    plain = _loss_and_grads(_lora_model(False, use_dora))
    _assert_same(_loss_and_grads(_lora_model(True, use_dora)), plain)


def test_only_a_training_forward_with_gradients_recomputes(monkeypatch):
    calls = []

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs)
        return torch.utils.checkpoint.checkpoint(*args, **kwargs)

    monkeypatch.setattr(gpt_module, "checkpoint", counting_checkpoint)
    model, x = _model(True), _batch()
    model(x, x)
    assert calls == [{"use_reentrant": False}] * CONFIG.n_layer
    calls.clear()
    with torch.no_grad():
        model(x, x)
    # decoding writes into the cache: a recomputation would write again
    model(x[:, :4], kv_cache=KVCache.for_model(model))
    model.generate(x[:, :4], 3)
    model.eval()(x, x)
    model.train().set_activation_checkpointing(False)(x, x)
    assert calls == []


def _kept_bytes(model: GPT, x: torch.Tensor, monkeypatch) -> int:
    """Bytes the forward keeps for the backward, parameters aside: the tensors autograd saves, and with
    checkpointing each block's input, which torch.utils.checkpoint holds (distinct storages, counted once).
    """
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def checkpoint_keeping_input(block, x, *args, **kwargs):
        keep(x)
        return torch.utils.checkpoint.checkpoint(block, x, *args, **kwargs)

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    monkeypatch.setattr(gpt_module, "checkpoint", checkpoint_keeping_input)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in kept.items() if ptr not in params)


def test_the_forward_keeps_less_memory(monkeypatch):
    x = _batch()
    plain, checkpointed = (_kept_bytes(_model(flag), x, monkeypatch) for flag in (False, True))
    # Here 300,288 bytes against 50,432: a block saves about 16 (B, T, C) tensors' worth for its backward
    # (LayerNorm inputs, q, k, v, attention output, the MLP's 4C-wide hidden twice...), checkpointed only its
    # input; the embeddings and the loss keep 34,048 bytes either way.
    assert checkpointed < 0.3 * plain, (checkpointed, plain)


def _fit(checkpointing: bool) -> tuple[list[dict], GPT]:
    model = _model(False, dropout=0.1)
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        total_batch_size=64,
        max_steps=3,
        warmup_steps=1,
        max_lr=1e-3,
        eval_interval=0,
        out_dir=None,
        progress=False,
        device="cpu",
        precision="fp32",
        activation_checkpointing=checkpointing,
    )
    tokens = torch.randint(0, CONFIG.vocab_size, (2048,), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(4)
    with Trainer(model, config, tokens, sinks=[]) as trainer:
        return trainer.fit(), trainer.model


def test_trainer_same_losses_with_dropout():
    """Two micro-steps a step, dropout on: the recomputation leaves the RNG where the forward left it."""
    plain, plain_model = _fit(False)
    checkpointed, model = _fit(True)
    assert model.activation_checkpointing and not plain_model.activation_checkpointing
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in checkpointed]), torch.tensor([r[key] for r in plain]), rtol=0, atol=1e-6
        )
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_trainer_refuses_a_model_without_the_switch():
    config = TrainConfig(micro_batch_size=2, seq_len=4, max_steps=1, out_dir=None, device="cpu", progress=False)
    with pytest.raises(InvalidValueError, match=r"set_activation_checkpointing\(\).*Linear has none") as error:
        Trainer(nn.Linear(4, 4), dataclasses.replace(config, activation_checkpointing=True), torch.zeros(64).long())
    assert "\n" not in str(error.value)


def test_compiled_lora_model_same_gradients():
    """torch.compile traces the checkpointed blocks, LoRA's fast path inside them, in one graph, and AOTAutograd's
    partitioner recomputes them in the backward with the same gradients. ``aot_eager`` runs that joint graph
    without Inductor's code generation (a cold C++ compile took ~50 s of the suite's time on a 2-core machine;
    tests/test_inductor.py compiles a LoRA training step with Inductor itself). No dropout, whose compiled random
    numbers differ from eager's.
    """
    from torch._dynamo.utils import counters

    plain = _loss_and_grads(_lora_model(False, dropout=0.0))
    torch._dynamo.reset()
    counters.clear()
    model = _lora_model(True, dropout=0.0)
    compiled = _loss_and_grads(model, torch.compile(model, backend="aot_eager"))
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    _assert_same(compiled, plain)
