"""Generation: KV cache parity, greedy / top-k / top-p sampling, seeds, EOS, batched prompts, crop."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from _tiny_run import argmax_loop, context_dependent_model

from gpt2.model.generate import KVCache, SamplingConfig, generate, pad_prompts, sample_next, stream
from gpt2.model.gpt import GPT


@pytest.fixture
def model(tiny_config) -> GPT:
    return context_dependent_model(tiny_config)


@pytest.fixture
def prompt(tiny_config) -> torch.Tensor:
    return torch.randint(0, tiny_config.vocab_size, (3, 7))


def test_greedy_equals_argmax_loop_cached_and_uncached(model, prompt):
    with torch.no_grad():
        expected = argmax_loop(model, prompt, 20)
    for use_cache in (True, False):
        out = model.generate(prompt, 20, temperature=0, use_cache=use_cache)
        assert out.shape == (3, 27)
        assert torch.equal(out, expected), use_cache


def test_sampling_cached_equals_uncached(model, prompt):
    for kwargs in (dict(), dict(temperature=0.7, top_k=10), dict(temperature=1.3, top_p=0.9)):
        cached = model.generate(prompt, 16, seed=11, use_cache=True, **kwargs)
        uncached = model.generate(prompt, 16, seed=11, use_cache=False, **kwargs)
        assert torch.equal(cached, uncached), kwargs


def test_the_head_reads_only_the_last_position(model, prompt):
    """Sampling applies the LM head to each row's last position alone, the prompt's forward included (its other
    positions are never sampled), and samples what nanoGPT's loop over the full logits samples.
    """
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(tuple(args[0].shape)))
    try:
        out = model.generate(prompt, 6, seed=11, temperature=0.9, top_k=20)
    finally:
        hook.remove()
    assert rows == [(3, model.config.n_embd)] * 6
    generator, idx = torch.Generator().manual_seed(11), prompt
    with torch.no_grad():
        for _ in range(6):
            logits = model(idx)[0][:, -1]
            idx = torch.cat([idx, sample_next(logits, 0.9, 20, generator=generator)[:, None]], dim=1)
    assert torch.equal(out, idx)


def test_seed_and_generator_reproducibility(model, prompt):
    a = model.generate(prompt, 16, seed=3)
    b = model.generate(prompt, 16, seed=3)
    c = model.generate(prompt, 16, seed=4)
    d = model.generate(prompt, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.equal(a, d)
    assert not torch.equal(a, c)
    # A generator continues its stream: the second call differs from the first.
    g = torch.Generator().manual_seed(5)
    assert not torch.equal(model.generate(prompt, 16, generator=g), model.generate(prompt, 16, generator=g))


def test_top_k_one_is_greedy(model, prompt):
    greedy = model.generate(prompt, 20, temperature=0)
    assert torch.equal(model.generate(prompt, 20, temperature=1.5, top_k=1, seed=0), greedy)


def test_top_k_and_top_p_restrict_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)  # 4000 independent draws at once
    g = torch.Generator().manual_seed(0)

    def support(**kwargs) -> set[int]:
        return set(sample_next(logits, generator=g, **kwargs).tolist())

    assert support() == {0, 1, 2, 3}  # no filter: every token shows up in 4000 draws
    assert support(top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.8: two tokens reach the nucleus
    assert support(top_p=0.85) == {0, 1, 2}
    assert support(top_p=0.5) == {0}  # the first token alone reaches 0.5
    assert support(top_p=0.01) == {0}  # the most likely token is always kept
    assert support(top_k=2) == {0, 1}
    assert support(top_k=3, top_p=0.6) == {0, 1}
    # Renormalised within the nucleus: token 0 gets 0.5 / 0.8 of the draws.
    draws = sample_next(logits, top_p=0.7, generator=g)
    assert (draws == 0).float().mean().item() == pytest.approx(0.625, abs=0.03)
    # Temperature 0 ignores the filters and takes the argmax.
    assert torch.equal(sample_next(logits, temperature=0, top_p=0.1), torch.zeros(4000, dtype=torch.long))


def test_eos_stops_early_and_pads_finished_rows(model, prompt):
    free = model.generate(prompt, 20, temperature=0)[:, 7:]  # (3, 20) without EOS
    eos = int(free[0, 4])  # a token row 0 emits at step 4 (or earlier)
    first = [next((i for i, t in enumerate(row.tolist()) if t == eos), None) for row in free]
    out = model.generate(prompt, 20, temperature=0, eos_token_id=eos)[:, 7:]
    for row, stop, ref in zip(out, first, free):
        if stop is None:
            assert torch.equal(row, ref[: row.numel()])
        else:  # identical up to and including the first EOS, then only EOS
            assert torch.equal(row[: stop + 1], ref[: stop + 1])
            assert bool((row[stop:] == eos).all())
    if all(s is not None for s in first):
        assert out.size(1) == max(first) + 1  # stopped as soon as every row finished
    # A single row stops right after its first EOS.
    single = model.generate(prompt[:1], 20, temperature=0, eos_token_id=eos)[0, 7:]
    assert single.numel() == first[0] + 1 and int(single[-1]) == eos


def test_batched_left_padded_prompts_equal_each_prompt_alone(model, tiny_config):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tiny_config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    ids, mask = pad_prompts(prompts, pad_id=7)
    assert ids.shape == mask.shape == (4, 9)
    assert mask.sum(1).tolist() == [3, 9, 1, 6] and bool(mask[:, -1].all())
    for use_cache in (True, False):
        batched = model.generate(ids, 15, temperature=0, attention_mask=mask, use_cache=use_cache)
        for i, p in enumerate(prompts):
            alone = model.generate(torch.tensor([p]), 15, temperature=0, use_cache=use_cache)
            assert torch.equal(batched[i, 9:], alone[0, len(p) :]), (i, use_cache)
    # A mask of all ones is the same as no mask.
    full = torch.ones_like(ids, dtype=torch.bool)
    assert torch.equal(
        model.generate(ids, 8, temperature=0, attention_mask=full), model.generate(ids, 8, temperature=0)
    )


def test_compiled_decoding_is_one_graph_plain_and_padded(model, prompt):
    """Dynamo only (the "eager" backend; Inductor is tests/test_inductor.py): the prompts' forwards
    run uncompiled and no decoding-step input is a view whose strides change with the length.
    """
    from torch._dynamo.utils import counters

    compiled = torch.compile(model, backend="eager")
    ids, mask = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    for kwargs in (dict(idx=prompt), dict(idx=ids, attention_mask=mask)):
        torch._dynamo.reset()
        counters.clear()
        out = generate(compiled, max_new_tokens=10, temperature=0, **kwargs)
        assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (1, 0)
        assert torch.equal(out, generate(model, max_new_tokens=10, temperature=0, **kwargs))
    # nn.Module.compile() in place (what the users wrote): the same one graph
    inplace = copy.deepcopy(model)
    inplace.compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    out = generate(inplace, prompt, max_new_tokens=10, temperature=0)
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (1, 0)
    assert torch.equal(out, generate(model, prompt, max_new_tokens=10, temperature=0))
    torch._dynamo.reset()


def test_generation_past_block_size(model, tiny_config):
    cfg = dataclasses.replace(tiny_config, block_size=16)
    small = GPT(cfg).eval()
    small.load_state_dict({k: v[:16] if k == "transformer.wpe.weight" else v for k, v in model.state_dict().items()})
    prompt = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        expected = argmax_loop(small, prompt, 30)
    for use_cache in (True, False):
        assert torch.equal(small.generate(prompt, 30, temperature=0, use_cache=use_cache), expected)
    sampled = [small.generate(prompt, 30, seed=2, use_cache=c) for c in (True, False)]
    assert torch.equal(*sampled)
    # A prompt longer than the context is cropped to its last block_size tokens.
    long_prompt = torch.randint(0, cfg.vocab_size, (1, 40))
    out = small.generate(long_prompt, 5, temperature=0)
    assert torch.equal(out[:, 40:], small.generate(long_prompt[:, -16:], 5, temperature=0)[:, 16:])


def test_stream_yields_the_generated_columns(model, prompt):
    steps = list(model.stream(prompt, 12, seed=9))
    assert len(steps) == 12 and all(s.shape == (3,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), generate(model, prompt, 12, seed=9)[:, 7:])


def test_generation_restores_mode_and_ignores_dropout(tiny_config, prompt):
    model = GPT(dataclasses.replace(tiny_config, dropout=0.5))
    model.eval()
    expected = model.generate(prompt, 10, temperature=0)
    model.train()
    out = model.generate(prompt, 10, temperature=0)
    assert model.training  # the caller's mode comes back
    assert torch.equal(out, expected)  # dropout was off while sampling


def test_zero_new_tokens_and_int32_prompt(model, prompt):
    assert torch.equal(model.generate(prompt, 0), prompt)
    assert torch.equal(model.generate(prompt.int(), 5, temperature=0), model.generate(prompt, 5, temperature=0))


def test_kv_cache_rejects_overflow_and_other_batches():
    cache = KVCache(n_layer=1, max_len=4)
    k = torch.zeros(2, 1, 3, 8)
    cache.step(3)
    cache.update(0, k, k)
    cache.step(2)
    # The write position is a tensor (no host read per step): index_copy_ rejects the overflow.
    with pytest.raises(IndexError, match="index 4 is out of bounds"):
        cache.update(0, k[:, :, :2], k[:, :, :2])
    with pytest.raises(RuntimeError, match="one cache serves one batch"):
        cache.update(0, torch.zeros(5, 1, 1, 8), torch.zeros(5, 1, 1, 8))


def test_a_cache_longer_than_the_context_is_refused_at_its_first_forward(model, tiny_config):
    big = KVCache.for_model(model, tiny_config.block_size + 8)  # more room than positions to embed
    with pytest.raises(ValueError, match=f"KV cache of {tiny_config.block_size + 8} positions .* context \\(64\\)"):
        model(torch.randint(0, tiny_config.vocab_size, (1, 3)), kv_cache=big)  # an IndexError once past 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=-1), r"generate.max_new_tokens must be an integer >= 0, got -1"),
        (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 0, got 2.5 \(not a float\)"),
        (dict(temperature=-0.1), r"temperature must be a finite number >= 0, got -0.1"),
        (dict(temperature=float("nan")), r"temperature must be a finite number >= 0, got nan"),
        (dict(top_k=0), r"top_k must be a positive integer \(or None\), got 0"),
        (dict(top_p=0.0), r"top_p must be a finite number in \(0, 1\] \(or None\), got 0.0"),
        (dict(top_p=1.5), r"top_p must be a finite number in \(0, 1\] \(or None\), got 1.5"),
        (dict(eos_token_id=128), r"eos_token_id must be an integer in \[0, 128\) \(or None\), got 128"),
        (dict(seed=1, generator=torch.Generator()), r"either seed or generator"),
        (dict(idx=torch.tensor([1, 2, 3])), r"idx must have shape \(batch, sequence\), got shape \(3,\)"),
        (dict(idx=torch.zeros(1, 0, dtype=torch.long)), r"idx is empty"),
        (
            dict(attention_mask=torch.ones(2, 4, dtype=torch.bool)),
            r"attention_mask must be a tensor of idx's shape \(1, 3\)",
        ),
        (dict(attention_mask=torch.tensor([[True, True, False]])), r"prompts must be left-padded"),
        # ids are checked on the host before the prompt reaches the device (the model's forward
        # does not read values: on CUDA a bad id would be a device-side assert)
        (
            dict(idx=torch.tensor([[1, 128, 3]])),
            r"prompt token ids must be in \[0, 128\) .* got \[128\] \(min 1, max 128\)",
        ),
        (dict(idx=torch.tensor([[-1, 2, 3]])), r"prompt token ids must be in \[0, 128\) .* got \[-1\]"),
        (dict(idx=torch.tensor([[50256, 2, 3]], dtype=torch.int32)), r"got \[50256\].*another tokenizer"),
    ],
)
def test_bad_arguments_raise_at_call_time(model, kwargs, message):
    kwargs = {"idx": torch.tensor([[1, 2, 3]]), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        stream(model, **kwargs)  # checked before the first token is requested
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs)


def test_a_float_prompt_is_refused_at_call_time(model):
    with pytest.raises(TypeError, match=r"idx must be an integer tensor .* got torch.float32"):
        stream(model, torch.rand(1, 3), 4)


def test_pad_prompts_errors():
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        pad_prompts([[1], []])
    with pytest.raises(ValueError, match="non-empty list"):
        pad_prompts([])
    with pytest.raises(ValueError, match="pad_prompts.pad_id must be an integer >= 0, got -1"):
        pad_prompts([[1]], pad_id=-1)


@pytest.mark.parametrize(
    "kwargs", [dict(top_k=0), dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0)]
)
def test_sample_next_refuses_settings_that_would_sample_wrongly(kwargs):
    """A negative temperature sampled the inverted distribution; top_k=0 failed on a shape."""
    from gpt2.model.generate import sample_next

    with pytest.raises(ValueError, match=r"generate\.(top_k|temperature|top_p) must be"):
        sample_next(torch.randn(2, 10), **kwargs)


@pytest.mark.parametrize("top_k", [None, 3])
def test_a_temperature_so_small_that_logits_overflow_samples_the_largest_logit(top_k):
    """--temperature 1e-40 passed validation and crashed in multinomial (logits / T was inf, the softmax NaN)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, -2.0, 0.25, 0.0]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        picked = sample_next(logits, temperature=1e-40, top_k=top_k, generator=generator)
        assert picked.tolist() == [1, 0]


def test_logits_near_the_float_limit_sample_without_nan():
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[big, -big, 0.0], [-big, 0.5 * big, big]])
    generator = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=0.5, generator=generator).tolist() == [0, 2]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused_in_one_line(bad):
    logits = torch.tensor([[0.0, bad, 1.0]])
    with pytest.raises(ValueError, match="logits hold NaN or \\+inf"):
        sample_next(logits, temperature=0.7)


def test_sampling_config_checks_and_normalises_once():
    """The one check of the sampling arguments (stream's, sample_next's, and the command line's to call)."""
    import numpy as np

    config = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(5), top_p=1)
    assert (config.temperature, config.top_k, config.top_p) == (0.5, 5, 1.0)
    assert type(config.temperature) is float and type(config.top_k) is int and type(config.top_p) is float
    assert SamplingConfig() == SamplingConfig(1.0, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 0
    for kwargs, message in [
        (dict(temperature=-0.1), r"generate.temperature must be a finite number >= 0, got -0.1"),
        (dict(temperature=float("inf")), r"generate.temperature must be a finite number >= 0, got inf"),
        (dict(temperature=True), r"generate.temperature must be a finite number >= 0, got True"),
        (dict(top_k=0), r"generate.top_k must be a positive integer \(or None\), got 0"),
        (dict(top_k=2.0), r"generate.top_k must be a positive integer \(or None\), got 2.0 \(not a float\)"),
        (dict(top_p=1.5), r"generate.top_p must be a finite number in \(0, 1\] \(or None\), got 1.5"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingConfig(**kwargs)


def test_forward_without_the_head_returns_the_last_layernorm(model, prompt):
    hidden, loss = model(prompt, head=False)
    assert loss is None and hidden.shape == (*prompt.shape, model.config.n_embd)
    torch.testing.assert_close(model.lm_head(hidden)[..., : model.config.vocab_size], model(prompt)[0])
    with pytest.raises(ValueError, match="head=False gives no loss"):
        model(prompt, prompt, head=False)


def test_tokens_are_normal_tensors_though_decoding_runs_in_inference_mode(model):
    """The steps run under torch.inference_mode; what stream yields and generate returns can be modified in
    place and used with autograd.
    """
    prompt = torch.tensor([[1, 2, 3]])
    tokens = list(model.stream(prompt, 4, temperature=0))
    assert not any(t.is_inference() for t in tokens)
    tokens[0] += 1
    out = generate(model, prompt, 4, temperature=0)
    assert not out.is_inference()
    out[0, 0] = 7
    logits, _ = model(out)
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None
