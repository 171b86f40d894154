"""torch.compile with its default backend (Inductor, C++ code generation on CPU): the model's
training step, a LoRA model trained by the Trainer with ``compile=True``, and compiled generation.

Each thing is compiled once per session (module-scoped fixtures; cold compiles cost 10-60 s each
on a small CPU) and the tests read Dynamo's counters: no graph break, a bounded number of graphs,
no recompile on repeated calls with the same shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from gpt2.model.config import GPTConfig
from gpt2.model.generate import generate
from gpt2.model.gpt import GPT
from gpt2.train import checkpoint as ckpt
from gpt2.train.config import TrainConfig
from gpt2.train.trainer import Trainer
from minlora.config import LoRAConfig
from minlora.model import add_lora, lora_sites
from minlora.utils import mark_only_lora_as_trainable

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(block_size=32, vocab_size=100, pad_vocab_multiple=64, n_layer=2, n_head=2, n_embd=32)


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.fixture(scope="module")
def training_step():
    """A plain GPT: three compiled training steps (forward + chunked loss + backward) and eager."""
    _fresh_dynamo()
    torch.manual_seed(0)
    model = GPT(CONFIG).train()
    compiled = torch.compile(model)
    idx = torch.randint(0, 100, (2, 16))
    targets = idx.roll(-1, dims=1)
    targets[:, -1] = -1
    results = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = compiled(idx, targets)[1]
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    graphs, breaks = _graphs(), _breaks()
    model.zero_grad(set_to_none=True)
    eager = model(idx, targets)[1]
    eager.backward()
    return results, (eager.detach(), {n: p.grad for n, p in model.named_parameters()}), graphs, breaks


def test_training_step_is_one_graph_and_matches_eager(training_step):
    results, (eager_loss, eager_grads), graphs, breaks = training_step
    assert breaks == 0
    assert graphs == 1, "repeated steps with the same shapes must not recompile"
    for loss, grads in results:
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


def _lora_model() -> GPT:
    model = GPT(CONFIG)
    add_lora(model, LoRAConfig(rank=4, alpha=8, include_lm_head=True))
    mark_only_lora_as_trainable(model)
    return model


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA model (adapters on the LM head too) trained by the Trainer with compile=True: two
    steps, one compiled evaluation, one checkpoint."""
    _fresh_dynamo()
    torch.manual_seed(0)
    model = _lora_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    out = tmp_path_factory.mktemp("lora_run")
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=2,
        max_lr=1e-2,
        warmup_steps=0,
        compile=True,
        device="cpu",
        out_dir=str(out),
        eval_interval=2,
        eval_steps=1,
        progress=False,
        plot=False,
    )
    tokens = torch.arange(2048) % 24
    trainer = Trainer(model, config, tokens, tokens[:512])
    history = trainer.fit()
    return trainer, history, frozen, out, _graphs(), _breaks()


def test_lora_trainer_step_compiles_without_breaks(lora_run):
    trainer, history, frozen, out, graphs, breaks = lora_run
    assert breaks == 0
    assert graphs <= 2, "one training graph and one evaluation graph; no recompile per step"
    assert trainer.eval_model is not trainer.model and ckpt.unwrap_model(trainer.eval_model) is trainer.model
    assert all(math.isfinite(r["loss"]) for r in history) and math.isfinite(history[-1]["val_loss"])
    model = trainer.model
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(torch.count_nonzero(s.lora.lora_B) for s in lora_sites(model)), "LoRA must have trained"
    weights, _ = ckpt.load_weights(out / "checkpoints" / "step_000002" / ckpt.WEIGHTS_FILE)
    assert weights and not any(k.startswith("_orig_mod.") for k in weights)  # the raw model's names
    fresh = _lora_model()
    ckpt.load_checkpoint(out / "checkpoints", fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


@pytest.fixture(scope="module")
def compiled_generation():
    """Greedy generation through a compiled GPT from a one-token prompt: every decoding step has
    the same shapes (static KV cache). Two graphs: the first forward, which allocates the cache's
    buffers, and the decoding step."""
    _fresh_dynamo()
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    compiled = torch.compile(model)
    prompt = torch.randint(0, 100, (2, 1))
    first = generate(compiled, prompt, 12, temperature=0)
    graphs, breaks = _graphs(), _breaks()
    again = generate(compiled, prompt, 12, temperature=0)
    return model, prompt, first, again, graphs, breaks, _graphs()


def test_compiled_generation_is_one_graph_without_recompiles(compiled_generation):
    model, prompt, first, again, graphs, breaks, graphs_after_second_call = compiled_generation
    assert breaks == 0
    assert graphs == 2, f"{graphs} graphs for 12 tokens: a decoding step recompiled"
    assert graphs_after_second_call == graphs, "a second generation with the same shapes recompiled"
    expected = generate(model, prompt, 12, temperature=0)
    assert torch.equal(first, expected) and torch.equal(again, expected)
