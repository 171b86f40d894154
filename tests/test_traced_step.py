"""The traced decoding step (issue 29, generation at llama.cpp's speed): once a decoding step has run eagerly
often enough, generation replays it from a TorchScript trace. The trace must give the eager step's hidden
states bit for bit (so the same tokens: greedy, sampled, padded prompts, int8 weights), follow weights changed
in place, be dropped when a parameter or a setting changes, and never be used where it could not replay the
step (LoRA, hooks, compiled models, autocast, a failing trace).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from _tiny_run import context_dependent_model

import minlora
from gpt2 import torch_compat
from gpt2.model import traced_step
from gpt2.model.generate import KVCache, generate, pad_prompts
from gpt2.model.gpt import GPT
from gpt2.model.quantize import int8_weights


@pytest.fixture
def model(tiny_config) -> GPT:
    return context_dependent_model(dataclasses.replace(tiny_config, vocab_size=500))


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """Steps are traced after 3 eager ones; returns a list that grows by one at every replayed step."""
    monkeypatch.setattr(traced_step, "TRACE_AFTER_STEPS", 3)
    calls: list[int] = []
    call = traced_step._Replay.__call__

    def counted(self, *args):
        calls.append(1)
        return call(self, *args)

    monkeypatch.setattr(traced_step._Replay, "__call__", counted)
    return calls


def _eager(model: GPT, prompt: torch.Tensor, n: int, **kwargs) -> torch.Tensor:
    """``generate`` of an untouched copy of ``model`` that never traces nor replays."""
    never = copy.deepcopy(model)
    after = traced_step.TRACE_AFTER_STEPS
    traced_step.TRACE_AFTER_STEPS = None
    try:
        return generate(never, prompt, n, **kwargs)
    finally:
        traced_step.TRACE_AFTER_STEPS = after


def _prompt(batch: int = 1, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_traced_step_gives_the_eager_steps_hidden_states_bit_for_bit(model):
    prompt = _prompt(batch=2)
    with torch.inference_mode():
        caches = [KVCache.for_model(model, 16) for _ in range(2)]
        for cache in caches:
            model(prompt, kv_cache=cache, head=False)
        steps = traced_step.DecodingSteps(model, 2, padded=False)
        traced_step.TRACE_AFTER_STEPS, after = 0, traced_step.TRACE_AFTER_STEPS
        try:
            replay = steps.replay(caches[1])
        finally:
            traced_step.TRACE_AFTER_STEPS = after
        assert replay is not None
        for token in ([[3], [7]], [[499], [0]], [[12], [12]]):
            ids = torch.tensor(token)
            eager = model(ids, kv_cache=caches[0], head=False)[0]
            traced = replay(ids, caches[1], None, None)
            assert torch.equal(traced, eager)
        for eager_buffer, traced_buffer in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            assert torch.equal(traced_buffer, eager_buffer)
        assert int(caches[1].pos) == int(caches[0].pos) == 8


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_k=50, seed=3)])
def test_generation_replays_the_step_with_the_eager_tokens(model, replays, sampling):
    prompt = _prompt()
    expected = _eager(model, prompt, 30, **sampling)
    assert torch.equal(generate(model, prompt, 30, **sampling), expected)
    # 29 decoding steps: 3 eager, then the trace
    assert len(replays) == 26
    # a later call of the same kind replays from its first step
    assert torch.equal(generate(model, prompt, 30, **sampling), expected)
    assert len(replays) == 26 + 29


def test_padded_prompts_replay_their_own_trace(model, replays):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    ids, mask = pad_prompts(prompts)
    expected = _eager(model, ids, 20, temperature=0, attention_mask=mask)
    assert torch.equal(generate(model, ids, 20, temperature=0, attention_mask=mask), expected)
    assert len(replays) == 16
    # each prompt alone gives its row's tokens (the padded trace is another key than the unpadded ones)
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), 20, temperature=0)
        assert torch.equal(alone[0, len(prompt) :], expected[row, ids.size(1) :])


def test_int8_weights_replay_with_the_eager_twins_tokens(model, replays):
    prompt = _prompt(batch=1)
    expected = _eager(model, prompt, 25, temperature=0, weights="int8")
    assert torch.equal(generate(model, prompt, 25, temperature=0, weights="int8"), expected)
    assert len(replays) == 21
    # batched rows take the int8 product's other path (one step per row, as tensors): traced too
    batch = _prompt(batch=3, seed=2)
    expected = _eager(model, batch, 25, temperature=0, weights="int8")
    assert torch.equal(generate(model, batch, 25, temperature=0, weights="int8"), expected)
    assert len(replays) == 42


def test_the_python_int8_product_is_never_traced(model, replays, monkeypatch):
    # without TorchScript's one-row function the product's step is a Python number, which a trace would fix
    monkeypatch.setattr(torch_compat, "_scripted_linear_row", lambda: None)
    prompt = _prompt()
    expected = _eager(model, prompt, 25, temperature=0, weights="int8")
    assert torch.equal(generate(model, prompt, 25, temperature=0, weights="int8"), expected)
    assert replays == []
    kept = traced_step._TRACES[int8_weights(model)]
    assert list(kept.traces.values()) == [None]


def test_weights_changed_in_place_are_read_by_the_trace(model, replays):
    prompt = _prompt()
    generate(model, prompt, 20, temperature=0)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.data.mul_(-1.5)
        model.transformer.wpe.weight.add_(0.3)
    expected = _eager(model, prompt, 20, temperature=0)
    before = len(replays)
    assert torch.equal(generate(model, prompt, 20, temperature=0), expected)
    # the same trace, replayed from the first step
    assert len(replays) == before + 19


def test_a_replaced_parameter_or_a_changed_setting_drops_the_traces(model, replays):
    prompt = _prompt()
    generate(model, prompt, 20, temperature=0)
    first = traced_step._TRACES[model]
    fc = model.transformer.h[0].mlp.c_fc
    fc.weight = torch.nn.Parameter(torch.randn_like(fc.weight))
    expected = _eager(model, prompt, 20, temperature=0)
    assert torch.equal(generate(model, prompt, 20, temperature=0), expected)
    second = traced_step._TRACES[model]
    assert second is not first
    # the manual attention's path (a Python decision inside the step)
    for block in model.transformer.h:
        block.attn.flash = False
    expected = _eager(model, prompt, 20, temperature=0)
    assert torch.equal(generate(model, prompt, 20, temperature=0), expected)
    assert traced_step._TRACES[model] is not second


def _never_traced(model: GPT, prompt: torch.Tensor, replays: list[int], **kwargs) -> None:
    expected = _eager(model, prompt, 12, temperature=0, **kwargs)
    assert torch.equal(generate(model, prompt, 12, temperature=0, **kwargs), expected)
    assert replays == []


def test_lora_hooks_compiled_models_and_autocast_decode_eagerly(model, replays):
    prompt = _prompt()
    lora = copy.deepcopy(model)
    minlora.add_lora(lora)
    _never_traced(lora, prompt, replays)
    hooked = copy.deepcopy(model)
    hooked.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    _never_traced(hooked, prompt, replays)
    assert traced_step.DecodingSteps(torch.compile(model), 1, padded=False).traces is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert traced_step.DecodingSteps(model, 1, padded=False).traces is None


def test_a_failing_trace_decodes_eagerly_and_is_not_tried_again(model, replays, monkeypatch):
    tries: list[int] = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "trace", broken)
    prompt = _prompt()
    _never_traced(model, prompt, replays)
    _never_traced(model, prompt, replays)
    assert tries == [1]


def test_none_turns_tracing_and_replaying_off(model, replays, monkeypatch):
    prompt = _prompt()
    generate(model, prompt, 10, temperature=0)
    assert len(replays) == 6
    monkeypatch.setattr(traced_step, "TRACE_AFTER_STEPS", None)
    generate(model, prompt, 10, temperature=0)
    assert len(replays) == 6


def test_few_steps_never_trace_and_the_least_recently_used_trace_goes_first(model, replays, monkeypatch):
    monkeypatch.setattr(traced_step, "MAX_TRACES", 2)
    # 3 decoding steps: counted, not traced
    generate(model, _prompt(), 4, temperature=0)
    assert replays == [] and traced_step._TRACES[model].traces == {}
    # three batch sizes, each traced after its own 3 eager steps
    for batch in (1, 2, 3):
        generate(model, _prompt(batch=batch), 10, temperature=0)
    assert [key[0] for key in traced_step._TRACES[model].traces] == [2, 3]


def test_calls_of_other_lengths_share_a_step_within_one_cache_length(monkeypatch, tiny_config, replays):
    config = dataclasses.replace(tiny_config, vocab_size=500, block_size=256)
    model = context_dependent_model(config)
    # prompt + new tokens 11 and 40: one cache of 64 positions, one trace
    generate(model, _prompt(length=5), 6, temperature=0)
    assert len(replays) == 2
    expected = _eager(model, _prompt(length=20), 20, temperature=0)
    assert torch.equal(generate(model, _prompt(length=20), 20, temperature=0), expected)
    assert len(replays) == 2 + 19
    assert list(traced_step._TRACES[model].traces) == [(1, 64, False)]
    # the rounded cache changes nothing: the same tokens as without a cache
    uncached = generate(model, _prompt(length=20), 20, temperature=0, use_cache=False)
    assert torch.equal(uncached, expected)


def test_traces_go_with_their_model(tiny_config, replays):
    # made here: pytest keeps a fixture's value alive until the test ends
    model = context_dependent_model(dataclasses.replace(tiny_config, vocab_size=500))
    generate(model, _prompt(), 10, temperature=0)
    generate(model, _prompt(), 10, temperature=0, weights="int8")
    twin = int8_weights(model)
    assert model in traced_step._TRACES and twin in traced_step._TRACES
    alive = [weakref.ref(model), weakref.ref(twin)]
    del model, twin
    gc.collect()
    # the traces hold the parameters, not the modules: nothing keeps the model (or its twin) alive
    assert [ref() for ref in alive] == [None, None]
