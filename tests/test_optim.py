"""AdamW parameter groups (decay / no decay, tied once, frozen out) and the cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gpt2 import GPT, TrainConfig
from gpt2.train import optim
from gpt2.train.optim import build_optimizer, lr_at, param_groups, set_lr, use_fused_adamw


@pytest.fixture
def model(tiny_config):
    return GPT(tiny_config)


def _ids(group):
    return {id(p) for p in group["params"]}


def test_groups_decay_matrices_only_and_count_tied_weight_once(model):
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # Every unique parameter lands in exactly one group (the tied wte/lm_head once).
    all_ids = _ids(decay) | _ids(no_decay)
    assert not (_ids(decay) & _ids(no_decay))
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()
    assert all_ids == {id(p) for p in model.parameters()}
    # Decayed: the Linear weights of the blocks. Not decayed: biases, LayerNorms, embeddings.
    expected_decay = {id(m.weight) for m in model.transformer.h.modules() if isinstance(m, nn.Linear)}
    assert _ids(decay) == expected_decay
    assert id(model.transformer.wte.weight) in _ids(no_decay)  # tied with lm_head: an embedding
    assert id(model.transformer.wpe.weight) in _ids(no_decay)
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    assert {id(p) for p in no_decay["params"] if p.dim() >= 2} == embeddings


def test_decay_embeddings_option(model):
    decay, _ = param_groups(model, weight_decay=0.1, decay_embeddings=True)
    assert id(model.transformer.wte.weight) in _ids(decay) and id(model.transformer.wpe.weight) in _ids(decay)


def test_only_trainable_parameters_are_optimised(model):
    for p in model.parameters():
        p.requires_grad_(False)
    model.transformer.ln_f.weight.requires_grad_(True)
    groups = param_groups(model, 0.1)
    assert len(groups) == 1 and _ids(groups[0]) == {id(model.transformer.ln_f.weight)}
    model.transformer.ln_f.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(model, 0.1)


def test_build_optimizer_fused_and_foreach(model):
    opt = build_optimizer(model, max_lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused_adamw=False)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and not opt.param_groups[0]["fused"]
    assert opt.param_groups[0]["foreach"] is True
    fused = build_optimizer(model, max_lr=1e-3, fused_adamw=True)  # fused AdamW also runs on CPU in torch >= 2.4
    assert fused.param_groups[0]["fused"] is True
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    model(x, x)[1].backward()
    fused.step()
    set_lr(fused, 5e-4)
    assert all(g["lr"] == 5e-4 for g in fused.param_groups)


@pytest.fixture
def fresh_fused_check():
    """fused_adamw_supported's cached answers are dropped before and after the test."""
    optim.fused_adamw_supported.cache_clear()
    yield
    optim.fused_adamw_supported.cache_clear()


def test_auto_picks_fused_adamw_wherever_torch_has_it(model, monkeypatch, fresh_fused_check):
    """On this CPU (torch >= 2.4) "auto" takes the fused kernel for fp32 parameters; a torch without one (the
    check's step fails, as torch's own check at the first step does) gets the multi-tensor implementation.
    """
    assert use_fused_adamw(model, "auto") is True
    assert build_optimizer(model, max_lr=1e-3).param_groups[0]["fused"] is True

    class NoFusedAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            if self.param_groups[0]["fused"]:
                raise RuntimeError(
                    "`fused=True` requires all the params to be floating point Tensors of supported devices"
                )
            return super().step(closure)

    optim.fused_adamw_supported.cache_clear()
    monkeypatch.setattr(torch.optim, "AdamW", NoFusedAdamW)
    assert use_fused_adamw(model, "auto") is False
    group = build_optimizer(model, max_lr=1e-3).param_groups[0]
    assert not group["fused"] and group["foreach"] is True
    # asked once per device and dtype
    assert optim.fused_adamw_supported.cache_info().currsize == 1


def test_build_optimizer_takes_a_train_config_and_keywords(model):
    """build_optimizer(model, config) reads the TrainConfig's optimizer fields; keywords (TrainConfig's
    names) override them, and with no config they alone set the optimizer.
    """
    config = TrainConfig(max_lr=2e-3, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6, decay_embeddings=True)
    opt = build_optimizer(model, config)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (2e-3, 0.05, (0.8, 0.9), 1e-6)
    assert id(model.transformer.wte.weight) in _ids(group)
    again = build_optimizer(model, max_lr=2e-3, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6, decay_embeddings=True)
    assert [(g["lr"], g["weight_decay"], _ids(g)) for g in again.param_groups] == [
        (g["lr"], g["weight_decay"], _ids(g)) for g in opt.param_groups
    ]
    assert build_optimizer(model, config, max_lr=1e-4).param_groups[0]["lr"] == 1e-4
    with pytest.raises(ValueError, match="TrainConfig.optimizer must be one of"):
        build_optimizer(model, optimizer="sgd")


def test_lr_schedule_warmup_cosine_floor():
    kw = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=110)
    warm = [lr_at(s, **kw) for s in range(10)]
    assert warm[0] == pytest.approx(6e-4 / 10) and warm[-1] == pytest.approx(6e-4)
    assert all(b - a == pytest.approx(6e-5) for a, b in zip(warm, warm[1:]))  # linear
    assert lr_at(10, **kw) == pytest.approx(6e-4)  # the cosine starts at the peak
    assert lr_at(60, **kw) == pytest.approx((6e-4 + 6e-5) / 2)  # half-way: the mean of peak and floor
    decay = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # monotone
    assert lr_at(110, **kw) == 6e-5 and lr_at(500, **kw) == 6e-5  # the floor, also after the end
    # No warmup, and warmup == max_steps, are both well defined.
    assert lr_at(0, max_lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=4) == 1.0
    assert lr_at(2, max_lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=4) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 2))
    )
    assert lr_at(4, max_lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=4) == 0.1
