"""minlora in training: with the gpt2 Trainer (fp16 / bf16 bases, compile) and under torch.compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import dist_job
from safetensors.torch import load_file

from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer
from minlora.adapters import ADAPTER_FILE_NAME, load_adapter, save_adapter
from minlora.config import LoRAConfig
from minlora.model import add_lora
from minlora.utils import disable_lora, get_lora_params, mark_only_lora_as_trainable


def lora_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    model = GPT(GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32)).to(dtype)
    add_lora(model, LoRAConfig(rank=4, alpha=8, include_lm_head=True))
    mark_only_lora_as_trainable(model)
    return model


def cyclic_tokens(n: int = 4096, period: int = 24) -> torch.Tensor:
    """A sequence a LoRA can learn in a few steps: 0, 1, ..., period - 1, 0, 1, ..."""
    return torch.arange(n) % period


def train(model: GPT, precision: str, steps: int, **overrides) -> list[dict]:
    config = TrainConfig(
        micro_batch_size=4,
        seq_len=32,
        max_steps=steps,
        max_lr=1e-2,
        warmup_steps=0,
        min_lr=1e-2,
        weight_decay=0.0,
        precision=precision,
        device="cpu",
        out_dir=None,
        eval_interval=0,
        progress=False,
        log_interval=1000,
        **overrides,
    )
    return Trainer(model, config, cyclic_tokens()).fit()


@pytest.mark.parametrize("dtype, precision", [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
def test_trainer_on_a_low_precision_base(dtype, precision):
    torch.manual_seed(0)
    model = lora_gpt(dtype)
    assert all(p.dtype == torch.float32 for p in get_lora_params(model))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert all(t.dtype == dtype for t in frozen.values())

    history = train(model, precision, steps=6)
    losses = [r["loss"] for r in history]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2, f"loss did not go down: {losses}"
    assert all(p.dtype == torch.float32 for p in get_lora_params(model))
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen {n} changed"


def test_trainer_sees_only_lora_and_adapter_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = lora_gpt()
    trainer = Trainer(
        model,
        TrainConfig(
            micro_batch_size=2,
            seq_len=16,
            max_steps=2,
            precision="fp32",
            device="cpu",
            out_dir=None,
            eval_interval=0,
            progress=False,
        ),
        cyclic_tokens(),
    )
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in get_lora_params(model)}
    trainer.fit()
    x = torch.randint(0, 128, (2, 16))
    model.eval()
    expected = model(x)[0]
    save_adapter(model, tmp_path / "adapter")  # what a LoRA run keeps: the adapter only
    # a fresh model with the (frozen) base weights, then the adapter on top
    base = GPT(model.config)
    base.load_state_dict(
        {
            k.replace("parametrizations.weight.original", "weight"): v
            for k, v in model.state_dict().items()
            if "lora_" not in k
        }
    )
    load_adapter(base, tmp_path / "adapter")
    torch.testing.assert_close(base.eval()(x)[0], expected, rtol=0, atol=0)


@pytest.mark.slow
def test_lora_gpt_compiles_without_graph_breaks_or_recompiles():
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    model = lora_gpt()
    model.train()
    x = torch.randint(0, 128, (2, 16))
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    eager = model(x, x)[1]
    for _ in range(3):
        loss = compiled(x, x)[1]
        loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])  # the reasons of any break
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    # one graph for the forward, and repeated LoRA steps do not recompile
    assert counter.frame_count == 1, "repeated LoRA steps must not recompile"
    with disable_lora(model):  # plain bool state: one guarded variant, no graph break
        compiled(x, x)
    compiled(x, x)
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_benchmark_runs_and_all_implementations_start_equal(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
    from benchmarks.lora import format_results, run_lora_benchmark

    config = GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32)
    status: list[str] = []
    results = run_lora_benchmark(
        model=config, batch_size=2, seq_len=16, steps=2, warmup=1, device="cpu", rank=2, progress=status.append
    )
    # status lines as each of the 3 runs goes (start, warm-up done, result)
    assert len(status) == 9
    assert [r.impl for r in results] == ["minlora", "minlora-plain", "peft"]
    # every adapter starts as a no-op on the same seeded base: same first loss, same trainable count
    assert len({round(r.first_loss, 5) for r in results}) == 1
    assert len({r.trainable_params for r in results}) == 1 and results[0].trainable_params > 0
    assert all(r.step_ms > 0 and r.peak_memory_mib is None for r in results)
    assert "| peft |" in format_results(results)


# --------------------------------------------------------------------------- DDP
@pytest.mark.slow
@pytest.mark.dist
def test_lora_with_ddp_matches_one_process(tmp_path, dist_run):
    """tests/_dist_worker.py's "lora" job: 2 ranks x 2 micro-steps vs 1 rank x 4, the same 128 tokens a step."""
    ranks = dist_run.reports("lora")
    single = dist_job("lora", tmp_path / "single")
    assert all(r["frozen_ok"] for r in ranks) and single["frozen_ok"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6)
    adapters = [load_file(str(dist_run.out / "lora" / f"rank{r}" / ADAPTER_FILE_NAME)) for r in (0, 1)]
    reference = load_file(str(tmp_path / "single" / "rank0" / ADAPTER_FILE_NAME))
    for name, tensor in reference.items():
        assert torch.equal(adapters[0][name], adapters[1][name]), f"ranks disagree on {name}"
        torch.testing.assert_close(adapters[0][name], tensor, rtol=1e-4, atol=1e-6)
