"""torch.compile with its default backend (Inductor, C++ code generation on CPU): a LoRA model
trained by the Trainer with ``compile=True`` (the model, the chunked loss, LoRA's fast path and the
Trainer's step in one graph, checked against the same run in eager mode), and compiled generation.

Each thing is compiled once per session (module-scoped fixtures; cold compiles cost 10-60 s each
on a small CPU) and the tests read Dynamo's counters: no graph break, a bounded number of graphs,
no recompile on repeated calls with the same shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters

from gpt2.model.checkpoint_files import load_weights
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


@pytest.fixture(scope="module", autouse=True)
def one_compile_thread():
    # On a 2-core machine a pool of compile workers costs more to start than it saves.
    with torch._inductor.config.patch(compile_threads=1):
        yield


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _lora_model() -> GPT:
    model = GPT(CONFIG)
    add_lora(model, LoRAConfig(rank=4, alpha=8))  # not on the head: the chunked loss stays in the graph
    mark_only_lora_as_trainable(model)
    return model


def _lora_trainer(out, compile: bool) -> Trainer:
    torch.manual_seed(0)
    config = TrainConfig(
        micro_batch_size=2,
        seq_len=16,
        max_steps=2,
        max_lr=1e-2,
        warmup_steps=0,
        compile=compile,
        device="cpu",
        # fp32's tolerances below (auto would train in bf16 on a CPU that multiplies it natively)
        precision="fp32",
        out_dir=str(out),
        progress=False,
        plot=False,
    )
    # No validation data: an evaluation graph would be a second cold compile (tens of seconds).
    return Trainer(_lora_model(), config, torch.arange(2048) % 24)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA model trained by the Trainer with compile=True for two steps (one checkpoint), and
    the same run in eager mode.
    """
    _fresh_dynamo()
    trainer = _lora_trainer(tmp_path_factory.mktemp("compiled"), compile=True)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.fit()
    graphs, breaks = _graphs(), _breaks()
    eager = _lora_trainer(tmp_path_factory.mktemp("eager"), compile=False)
    eager_history = eager.fit()
    return trainer, history, eager, eager_history, frozen, graphs, breaks


def test_lora_trainer_step_is_one_graph_and_matches_eager(lora_run):
    trainer, history, eager, eager_history, frozen, graphs, breaks = lora_run
    assert breaks == 0
    assert graphs == 1, "the second step recompiled"
    assert trainer.eval_model is not trainer.model and ckpt.unwrap_model(trainer.eval_model) is trainer.model
    for compiled_record, eager_record in zip(history, eager_history, strict=True):
        assert compiled_record["loss"] == pytest.approx(eager_record["loss"], rel=1e-5)
        assert compiled_record["grad_norm"] == pytest.approx(eager_record["grad_norm"], rel=1e-4)
    model = trainer.model
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(torch.count_nonzero(s.lora.lora_B) for s in lora_sites(model)), "LoRA must have trained"
    for name, value in eager.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-4, atol=1e-6)
    out = trainer.out_dir
    weights, _ = load_weights(out / "checkpoints" / "step_000002" / ckpt.WEIGHTS_FILE)
    assert weights and not any(k.startswith("_orig_mod.") for k in weights)  # the raw model's names
    fresh = _lora_model()
    ckpt.load_checkpoint(out / "checkpoints", fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


@pytest.fixture(scope="module")
def compiled_generation():
    """Greedy generation through a compiled GPT from a 5-token prompt, then from a 1-token one
    with the same cache length: the prompts' forwards run uncompiled and every decoding step has
    the same shapes (static KV cache), so one graph serves every token of both calls.
    """
    _fresh_dynamo()
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    compiled = torch.compile(model)
    prompt, short = torch.randint(0, 100, (2, 5)), torch.randint(0, 100, (2, 1))
    first = generate(compiled, prompt, 12, temperature=0)
    graphs, breaks = _graphs(), _breaks()
    again = generate(compiled, short, 16, temperature=0)  # cache of 5 + 12 = 1 + 16 positions
    return model, prompt, short, first, again, graphs, breaks, _graphs()


def test_compiled_generation_is_one_graph_without_recompiles(compiled_generation):
    model, prompt, short, first, again, graphs, breaks, graphs_after_second_call = compiled_generation
    assert breaks == 0
    assert graphs == 1, f"{graphs} graphs for 12 tokens: the prompt or a decoding step compiled its own"
    assert graphs_after_second_call == 1, "a second generation with the same cache length recompiled"
    assert torch.equal(first, generate(model, prompt, 12, temperature=0))
    assert torch.equal(again, generate(model, short, 16, temperature=0))
