"""Muon (TrainConfig.optimizer="muon"): which parameters it trains, the composite optimizer against
torch's two optimizers run side by side, the schedule, exact resume, gradient accumulation, the
fp16 GradScaler, LoRA and DDP.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from conftest import dist_job

from gpt2 import GPT
from gpt2.train.config import TrainConfig
from gpt2.train.optim import MUON_MOMENTUM, MuonAdamW, build_optimizer, lr_at, muon_params, set_lr
from gpt2.train.trainer import Trainer


def _block_matrices(model: GPT) -> list[nn.Parameter]:
    return [m.weight for m in model.transformer.h.modules() if isinstance(m, nn.Linear)]


def _backward(model: nn.Module, seed: int, vocab_size: int, scaler: torch.amp.GradScaler | None = None) -> None:
    x = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    loss = model(x, x)[1]
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _config(**overrides) -> TrainConfig:
    base = dict(
        micro_batch_size=2,
        seq_len=16,
        max_steps=6,
        warmup_steps=2,
        max_lr=1e-3,
        optimizer="muon",
        muon_lr=0.02,
        out_dir=None,
        progress=False,
        plot=False,
        device="cpu",
        precision="fp32",
        eval_interval=0,
    )
    return TrainConfig(**{**base, **overrides})


def test_muon_takes_the_block_matrices_only(tiny_config):
    model = GPT(tiny_config)
    assert {id(p) for p in muon_params(model)} == {id(p) for p in _block_matrices(model)}  # not wte = lm_head

    class UntiedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16))
            self.head = nn.Linear(16, 10)  # a direct child of the model: the output layer

    net = UntiedHead()
    assert [id(p) for p in muon_params(net)] == [id(net.blocks[0].weight), id(net.blocks[2].weight)]
    opt = build_optimizer(net, max_lr=1e-3, optimizer="muon")
    kinds = [(g["optimizer"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    # AdamW: the head decayed; the embedding, biases and LayerNorm not; then Muon's two matrices
    assert kinds == [("adamw", 0.1, 1), ("adamw", 0.0, 6), ("muon", 0.0, 2)]
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(net.parameters()))


def test_step_equals_torch_muon_and_adamw_side_by_side(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config)
    reference = copy.deepcopy(model)
    # fused=False: the reference below is torch's foreach AdamW, which the fused kernel (now picked
    # on CPUs too) matches only to ~2e-7.
    opt = build_optimizer(model, max_lr=1e-3, optimizer="muon", muon_lr=0.02, muon_weight_decay=0.01, fused_adamw=False)
    assert isinstance(opt, MuonAdamW) and isinstance(opt, torch.optim.Optimizer)
    hidden = _block_matrices(reference)
    rest = [p for p in reference.parameters() if all(p is not h for h in hidden)]
    ref_muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, momentum=MUON_MOMENTUM)
    ref_adamw = torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    for step in range(3):
        lr = lr_at(step, max_lr=1e-3, min_lr=1e-4, warmup_steps=1, max_steps=3)
        set_lr(opt, lr)
        assert [g["lr"] for g in opt.param_groups] == [lr, lr * 20]  # each group from its own peak
        for group in ref_adamw.param_groups:
            group["lr"] = lr
        for group in ref_muon.param_groups:
            group["lr"] = lr * 0.02 / 1e-3
        _backward(model, step, tiny_config.vocab_size)
        _backward(reference, step, tiny_config.vocab_size)
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_trainer_schedule_scales_each_group_from_its_peak(tiny_config):
    tokens = torch.randint(0, tiny_config.vocab_size, (2000,))
    trainer = Trainer(GPT(tiny_config), _config(min_lr=2e-4), tokens, sinks=[])
    for _ in range(7):  # the 7th update (index 6 = max_steps) is at the floor
        record = trainer.train_step()
        adamw_lr, muon_lr = (g["lr"] for g in trainer.optimizer.param_groups)
        assert adamw_lr == record["lr"] and muon_lr == pytest.approx(record["lr"] * 20)
    assert record["lr"] == pytest.approx(2e-4) and muon_lr == pytest.approx(2e-4 * 20)  # the floor, scaled


def test_resume_continues_exactly(tiny_config, tmp_path):
    tokens = torch.randint(0, tiny_config.vocab_size, (4000,))
    config = _config(out_dir=str(tmp_path), checkpoint_interval=0)
    torch.manual_seed(0)
    first = Trainer(GPT(tiny_config), config, tokens, sinks=[])
    first.fit(until_step=3)
    resumed = Trainer(GPT(tiny_config), TrainConfig(**{**config.to_dict(), "resume": "auto"}), tokens, sinks=[])
    assert resumed.step == 3 and isinstance(resumed.optimizer, MuonAdamW)
    # the momentum buffers came back, and they are the state the Muon child reads
    first_muon, resumed_muon = first.optimizer.optimizers[1], resumed.optimizer.optimizers[1]
    for p, q in zip(first_muon.param_groups[0]["params"], resumed_muon.param_groups[0]["params"]):
        assert torch.equal(first_muon.state[p]["momentum_buffer"], resumed_muon.state[q]["momentum_buffer"])
    for _ in range(3):
        a, b = first.train_step(), resumed.train_step()
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"])
    for (name, p), q in zip(first.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    first.close()
    resumed.close()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_takes_this_runs_optimizer_settings_with_the_saved_state(tiny_config, tmp_path, optimizer):
    """A resumed run with another weight decay, betas, eps (or Muon LR) used the checkpoint's values
    while its config (and its next checkpoint) claimed the new ones.
    """
    tokens = torch.randint(0, tiny_config.vocab_size, (4000,))
    config = _config(out_dir=str(tmp_path), checkpoint_interval=0, optimizer=optimizer)
    with Trainer(GPT(tiny_config), config, tokens, sinks=[]) as first:
        first.fit(until_step=2)
        saved = first.optimizer.state_dict()["state"]
    changed = {**config.to_dict(), **dict(weight_decay=0.5, betas=(0.8, 0.99), eps=1e-6, muon_lr=0.04)}
    with Trainer(GPT(tiny_config), TrainConfig(**{**changed, "out_dir": None}), tokens, sinks=[]) as fresh:
        expected = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in fresh.optimizer.param_groups]
    assert any(g.get("weight_decay") == 0.5 or g.get("lr_ratio") == 40 for g in expected)  # the settings changed
    with Trainer(GPT(tiny_config), TrainConfig(**{**changed, "resume": "auto"}), tokens, sinks=[]) as resumed:
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in resumed.optimizer.param_groups]
        assert groups == expected
        for key, value in saved.items():  # the state itself is the checkpoint's
            for name, tensor in value.items():
                torch.testing.assert_close(resumed.optimizer.state_dict()["state"][key][name], tensor, rtol=0, atol=0)
        resumed.train_step()


def test_an_adamw_state_does_not_load_into_muon(tiny_config):
    adamw = build_optimizer(GPT(tiny_config), max_lr=1e-3)
    muon = build_optimizer(GPT(tiny_config), max_lr=1e-3, optimizer="muon")
    with pytest.raises(ValueError, match=r"groups \['adamw', 'adamw'\].*\['adamw', 'muon'\]"):
        muon.load_state_dict(adamw.state_dict())
    # the other way round torch itself refuses: the groups hold different numbers of tensors
    with pytest.raises(ValueError, match="doesn't match the size"):
        adamw.load_state_dict(muon.state_dict())


def test_gradient_accumulation_equals_one_big_batch(tiny_config):
    tokens = torch.randint(0, tiny_config.vocab_size, (4000,))
    runs = []
    for micro, total in ((8, None), (2, 8 * 16)):  # 1 micro-step of 8 rows, or 4 of 2 rows
        torch.manual_seed(0)
        trainer = Trainer(GPT(tiny_config), _config(micro_batch_size=micro, total_batch_size=total), tokens, sinks=[])
        first = trainer.train_step()["loss"]
        # after a step the gradients are still there: the accumulated ones, and Muon's momentum
        grads = [p.grad.clone() for p in trainer.model.parameters()]
        buffers = [s["momentum_buffer"].clone() for s in trainer.optimizer.state.values() if "momentum_buffer" in s]
        losses = [first] + [trainer.train_step()["loss"] for _ in range(2)]
        runs.append((trainer.grad_accum_steps, grads, buffers, losses))
    (steps_big, *big), (steps_acc, *acc) = runs
    assert (steps_big, steps_acc) == (1, 4) and len(acc[1]) == 4 * tiny_config.n_layer
    for a, b in zip(acc[0] + acc[1], big[0] + big[1]):  # summation order differs: fp32 rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # Later steps: Newton-Schulz runs in bf16, so equal gradients give equal updates only up to
    # bf16 rounding; the losses still agree closely.
    torch.testing.assert_close(torch.tensor(acc[2]), torch.tensor(big[2]), rtol=1e-5, atol=1e-5)


def test_grad_scaler_unscales_and_skips_both_optimizers(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config)
    reference = copy.deepcopy(model)
    opt = build_optimizer(model, max_lr=1e-3, optimizer="muon")
    ref_opt = build_optimizer(reference, max_lr=1e-3, optimizer="muon")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    v = tiny_config.vocab_size

    # A good step: the scaled gradients are unscaled in both children (a power of 2: exactly).
    _backward(model, 0, v, scaler)
    _backward(reference, 0, v)
    scaler.unscale_(opt)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)

    # An inf in one Muon matrix's gradient: the whole step is skipped, AdamW's half included.
    _backward(model, 1, v, scaler)
    model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s}
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert buffers and all(torch.equal(opt.state[p]["momentum_buffer"], buffers[id(p)]) for p in muon_params(model))


def test_fp16_training_with_muon_runs_finite(tiny_config):
    tokens = torch.arange(2000) % 24
    history = Trainer(GPT(tiny_config), _config(precision="fp16", max_steps=8), tokens, sinks=[]).fit()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert history[-1]["loss"] < history[0]["loss"] - 0.5


def test_lora_factors_stay_with_adamw(tiny_config, caplog):
    from minlora.config import LoRAConfig
    from minlora.model import add_lora
    from minlora.utils import mark_only_lora_as_trainable

    model = GPT(tiny_config)
    add_lora(model, LoRAConfig(rank=4, alpha=8))
    mark_only_lora_as_trainable(model)
    assert muon_params(model) == []
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        opt = build_optimizer(model, max_lr=1e-3, optimizer="muon")
    assert type(opt) is torch.optim.AdamW and "AdamW trains everything" in caplog.text
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == trainable and trainable


def test_config_rejects_unknown_optimizer():
    with pytest.raises(ValueError, match="optimizer.*'sgd'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="muon_lr"):
        TrainConfig(muon_lr=0.0)


@pytest.mark.slow
@pytest.mark.dist
def test_two_gloo_processes_match_one_process(tmp_path, dist_run):
    """tests/_dist_worker.py's ``train`` job with Muon: 2 ranks x 2 micro-steps == 1 rank x 4."""
    ranks = dist_run.reports("muon")
    single = dist_job("muon", tmp_path / "single")
    assert [r["world_size"] for r in ranks] == [2, 2] and single["world_size"] == 1
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # The first step's gradients agree to fp32 rounding (summed in another order); Muon's update
    # is orthogonalised in bf16, so later steps agree to about bf16's precision (1e-3 relative).
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(ranks[0][key][:1]), torch.tensor(single[key][:1]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(ranks[0][key]), torch.tensor(single[key]), rtol=2e-3, atol=1e-4)


def test_a_model_of_hidden_matrices_only_gets_muon_alone():
    net = nn.Sequential(nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False)))
    opt = build_optimizer(net, max_lr=1e-3, optimizer="muon", muon_lr=0.02)
    assert type(opt) is torch.optim.Muon and len(opt.param_groups[0]["params"]) == 2
    set_lr(opt, 5e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
