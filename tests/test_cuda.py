"""On a CUDA GPU: every rung of the `gpt2 bench` ladder, fp16 loss scaling, fused AdamW, compile
with LoRA, Muon, peak memory. Skipped without a GPU (``pytest -m gpu`` runs just these).
"""

from __future__ import annotations

import math

import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.train.config import TrainConfig
from gpt2.train.optim import MuonAdamW, build_optimizer
from gpt2.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _config(**overrides) -> TrainConfig:
    base = dict(
        micro_batch_size=4,
        seq_len=64,
        max_steps=20,
        max_lr=1e-3,
        device="cuda",
        out_dir=None,
        progress=False,
        plot=False,
        eval_interval=0,
    )
    return TrainConfig(**{**base, **overrides})


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64))


def _tokens() -> torch.Tensor:
    return torch.arange(20_000) % 48  # a cycle every model here learns within a few steps


@pytest.mark.slow
def test_every_ladder_rung_runs_and_reports():
    from gpt2.train.bench import RUNGS, format_table, run_ladder

    results = run_ladder("tiny", batch_size=4, seq_len=64, steps=2, warmup=2, repeats=1, device="cuda", compile=True)
    assert [r.rung for r in results] == list(RUNGS) and not any(r.skipped for r in results)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    for r in results:
        assert r.ms_per_step > 0 and math.isfinite(r.loss), r.rung
        assert 0 < r.peak_memory_gib < total, r.rung
    # The last rung applied bf16, whose policy keeps TF32 on, through the new fp32_precision API only.
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert "| fused_adamw |" in format_table(results, torch.cuda.get_device_name())


def test_fp16_with_loss_scaling_stays_finite_and_learns():
    trainer = Trainer(_model(), _config(precision="fp16"), _tokens(), sinks=[])
    history = trainer.fit()
    assert trainer.scaler is not None and all(math.isfinite(r["loss"]) for r in history)
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_fused_adamw_matches_foreach():
    models = [_model().cuda(), _model().cuda()]
    fused, foreach = (build_optimizer(m, max_lr=1e-3, fused_adamw=f) for m, f in zip(models, (True, False)))
    assert fused.param_groups[0]["fused"] and not foreach.param_groups[0]["fused"]
    x = _tokens()[: 4 * 64].view(4, 64).cuda()
    for _ in range(3):
        for model, opt in zip(models, (fused, foreach)):
            opt.zero_grad(set_to_none=True)
            model(x, x)[1].backward()
            opt.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_with_lora_trains_only_the_adapters():
    from minlora.config import LoRAConfig
    from minlora.model import add_lora
    from minlora.utils import mark_only_lora_as_trainable

    model = _model()
    add_lora(model, LoRAConfig(rank=4, alpha=8))
    mark_only_lora_as_trainable(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = Trainer(model, _config(compile=True, precision="bf16", max_lr=1e-2), _tokens(), sinks=[])
    history = trainer.fit()
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    assert all(torch.equal(p, frozen[n].cuda()) for n, p in model.named_parameters() if n in frozen)


def test_muon_on_cuda_learns_and_keeps_its_state_on_the_gpu():
    trainer = Trainer(_model(), _config(optimizer="muon", precision="bf16"), _tokens(), sinks=[])
    assert isinstance(trainer.optimizer, MuonAdamW)
    adamw, muon = trainer.optimizer.optimizers
    assert adamw.param_groups[0]["fused"]  # "auto": every parameter is on the GPU
    history = trainer.fit()
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    buffers = [s["momentum_buffer"] for s in trainer.optimizer.state.values() if "momentum_buffer" in s]
    assert len(buffers) == len(muon.param_groups[0]["params"]) and all(b.is_cuda for b in buffers)


def test_peak_memory_of_a_step_is_measured_per_rung():
    from gpt2.train.bench import run_ladder

    results = run_ladder("mini", batch_size=8, seq_len=256, steps=2, warmup=1, repeats=1, rungs=["fp32", "bf16"])
    n_params = GPT(GPTConfig.from_name("mini")).num_params()
    # At least fp32 weights, gradients and AdamW's two moments; at most the whole GPU.
    floor = 4 * 4 * n_params / 2**30
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert all(floor < r.peak_memory_gib < total for r in results), [r.peak_memory_gib for r in results]
