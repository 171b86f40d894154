"""The int8 greedy head (gpt2/model/int8_head.py): the fp32 head's argmax through int8 bounds, where it
applies, and generate's ``int8_head`` switch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _tiny_run import argmax_loop

from gpt2 import torch_compat
from gpt2.model import int8_head
from gpt2.model.generate import generate, pad_prompts, stream
from gpt2.model.gpt import GPT

# Greedy decoding on the CPU reads a large LM head in int8 and re-scores the candidates in fp32.


def _int8_of(weight: torch.Tensor):
    holder = torch.nn.Linear(weight.size(1), weight.size(0), bias=False)
    holder.weight.data = weight
    fake = type("M", (), {"lm_head": holder, "config": type("C", (), {"vocab_size": weight.size(0)})})()
    return int8_head.quantize_head(fake)


def test_int8_sieve_picks_the_argmax_of_the_whole_head(monkeypatch):
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    g = torch.Generator().manual_seed(0)
    V, C = 3000, 96
    # Rows crowded around one direction, apart by less than the int8 step of a row: their int8
    # logits come in another order than their fp32 ones, so a bound too tight picks wrongly.
    base = torch.randn(C, generator=g)
    W = base + 0.004 * torch.randn(V, C, generator=g)
    W[::7] = torch.randn(V // 7 + 1, C, generator=g)  # and ordinary rows
    W[2002] = W[1505]  # an exact tie: the first index wins, as in argmax
    int8 = _int8_of(W)
    assert int8 is not None
    h = torch.randn(64, C, generator=g)
    h[:, 5] *= 40  # GPT-2's hidden states have a few outsize dimensions
    h[:32] += 3 * base  # rows whose best tokens are the crowded ones
    h[40] = W[1505] * 10  # the tied rows are its best
    expected = torch.nn.functional.linear(h, W).argmax(-1)
    assert int(expected[40]) == 1505
    for rows in (h, h[:1], h[40:41]):
        assert torch.equal(int8_head.greedy_tokens(rows, W, int8), torch.nn.functional.linear(rows, W).argmax(-1))
    assert torch.equal(int8_head.greedy_tokens(h, W, int8), expected)
    # Worst-case rounding: every weight of row 10 rounds up by almost half a step, 40 of row 11 down
    # by as much, so int8 ranks 10 first by 55 steps while fp32 ranks 11 first; only bounds at least
    # ~60% of the worst case keep row 11 (column 0 fixes every row's int8 step at 0.01; h is exact).
    W = 0.01 * torch.randn(V, C, generator=g)
    W[:, 0], W[10, 1:], W[11, 1:] = 1.27, 0.01 * 0.501, 0.0
    W[11, 1:41] = 0.01 * 1.499
    h = torch.ones(1, C)
    h[0, 0] = 0.0
    assert int(torch.nn.functional.linear(h, W).argmax()) == 11
    assert int(torch_compat.int_mm(torch.full((1, C), 127, dtype=torch.int8), _int8_of(W)[0]).argmax()) == 10
    assert int(int8_head.greedy_tokens(h, W, _int8_of(W))) == 11
    # Rows far below fp32's normal range (their int8 step is clamped at 1e-30) and logits near fp32's
    # limit (the int8 ones overflow): the right token, or the whole head, never a wrong one or a crash
    tiny = -torch.ones(64, 16)
    tiny[:2] = 0.0
    tiny[0, 0], tiny[1, 1] = 1e-29, 1.2e-28  # logits 1e-29 (the best) and 6e-30
    huge = torch.randn(64, 64, generator=g) * 1e37
    for head, x in ((tiny, torch.tensor([[1.0, 0.05] + [0.0] * 14])), (huge, torch.randn(2, 64, generator=g))):
        assert torch.equal(
            int8_head.greedy_tokens(x, head, _int8_of(head)), torch.nn.functional.linear(x, head).argmax(-1)
        )
    # A hidden state of zeros or NaN takes the whole head (every row is a candidate / no bound).
    for odd in (torch.zeros(1, C), torch.full((1, C), float("nan"))):
        assert torch.equal(int8_head.greedy_tokens(odd, W, int8), torch.nn.functional.linear(odd, W).argmax(-1))
    # ... also beside ordinary rows, whose few candidates it must not be scored among
    W = torch.randn(V, C, generator=g)
    ordinary = torch.randn(2, C, generator=g)
    for odd in (torch.full((1, C), float("nan")), torch.full((1, C), 1e36)):
        batch = torch.cat([ordinary[:1], odd, ordinary[1:]])
        tokens = int8_head.greedy_tokens(batch, W, _int8_of(W))
        assert torch.equal(tokens, torch.nn.functional.linear(batch, W).argmax(-1))


def test_int8_head_only_where_it_is_exact_and_worth_it(monkeypatch, tiny_config):
    W = torch.randn(4096, 1024)
    assert _int8_of(W) is not None  # 2**22 weights: the default threshold
    assert _int8_of(W[:4095]) is None  # smaller heads: the int8 pass would not pay
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    assert _int8_of(W.bfloat16()) is None and _int8_of(W.double()) is None
    bad = W.clone()
    bad[3, 3] = float("inf")
    assert _int8_of(bad) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _int8_of(W) is None
    with monkeypatch.context() as m:
        m.setattr(torch.backends.mkldnn, "enabled", False)  # int_mm is then a plain loop, 8x slower
        assert _int8_of(W) is None
    assert torch.backends.mkldnn.enabled
    # n_embd under 16 (degenerate strides give _int_mm wrong sums) or over 2^17 (its int32 sums overflow)
    assert _int8_of(torch.randn(64, 1)) is None and _int8_of(torch.randn(1, 2**17 + 1)) is None
    model = GPT(tiny_config)
    assert int8_head.quantize_head(model) is not None
    torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", torch.nn.Identity())
    assert int8_head.quantize_head(model) is None


@pytest.fixture
def wide_vocab_model(tiny_config) -> GPT:
    """A vocabulary wide enough for few candidates per token, weights as in `model`."""
    torch.manual_seed(0)
    m = GPT(dataclasses.replace(tiny_config, vocab_size=4000)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def test_greedy_generation_through_the_int8_head_gives_the_same_tokens(monkeypatch, wide_vocab_model):
    model = wide_vocab_model
    prompt = torch.randint(0, 4000, (3, 5), generator=torch.Generator().manual_seed(2))
    ids, mask = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    plain = [generate(model, prompt, 40, temperature=0), generate(model, ids, 40, temperature=0, attention_mask=mask)]
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    heads = []  # the rows of every fp32 head product: a few candidates, not the whole vocabulary
    linear = torch.nn.functional.linear

    def spy(x, w, *bias):  # nn.Linear passes a bias (None or not), _greedy none
        heads.extend([] if bias else [w.size(0)])
        return linear(x, w, *bias)

    monkeypatch.setattr(int8_head.F, "linear", spy)
    sieved = [generate(model, prompt, 40, temperature=0), generate(model, ids, 40, temperature=0, attention_mask=mask)]
    monkeypatch.undo()
    assert len(heads) == 80 and max(heads) < 4000 // 8, heads
    for a, b in zip(plain, sieved):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(sieved[0], argmax_loop(model, prompt, 40))
        model.transformer.ln_f.weight[[3, 17]] = 40.0  # outsize hidden dimensions, as GPT-2's last ones have
        plain = generate(model, prompt, 32, temperature=0)
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    monkeypatch.setattr(int8_head.F, "linear", spy)
    heads.clear()
    sieved = generate(model, prompt, 32, temperature=0)  # they are taken from fp32 columns, not widening the bounds
    monkeypatch.undo()
    assert torch.equal(sieved, plain) and max(heads) < 4000 // 8, heads
    assert sorted(int8_head._KEPT[model.lm_head][1].cols) == [3, 17]


def test_greedy_generation_under_another_default_dtype(monkeypatch, wide_vocab_model):
    prompt = torch.randint(0, 4000, (1, 4))
    plain = generate(wide_vocab_model, prompt, 32, temperature=0)
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the fingerprint and bounds were made in it: a dtype error
    try:
        assert torch.equal(generate(wide_vocab_model, prompt, 32, temperature=0), plain)
    finally:
        torch.set_default_dtype(default)


def test_the_int8_head_follows_weights_changed_behind_autograd(monkeypatch, wide_vocab_model):
    """`.data` edits do not bump a tensor's version: the kept int8 head is checked against the weights'
    values (a fingerprint) at every call, so generation never uses a stale one.
    """
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    model, prompt = wide_vocab_model, torch.randint(0, 4000, (2, 4))
    before = generate(model, prompt, 32, temperature=0)
    kept = int8_head._KEPT[model.lm_head][1].q_t
    model.lm_head.weight.data[:, :16].neg_()  # the same tensor, version unchanged
    after = generate(model, prompt, 32, temperature=0)
    assert int8_head._KEPT[model.lm_head][1].q_t is not kept
    with torch.no_grad():
        assert torch.equal(after, argmax_loop(model, prompt, 32))
    assert not torch.equal(before, after)
    assert generate(model, prompt, 31, temperature=0).shape == (2, 35)  # fewer than 32 tokens: the plain head


def test_compiled_greedy_decoding_through_the_int8_head_is_one_graph(monkeypatch, wide_vocab_model):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    prompt = torch.randint(0, 4000, (2, 6))
    compiled = torch.compile(wide_vocab_model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    out = generate(compiled, prompt, 32, temperature=0)
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (1, 0)
    assert torch.equal(out, generate(wide_vocab_model, prompt, 32, temperature=0))
    torch._dynamo.reset()


def _count_int8_steps(monkeypatch) -> list[int]:
    """Patch generation's int8 head to count its calls (one per token)."""
    from gpt2.model import generate as generate_module

    calls: list[int] = []
    greedy = generate_module.greedy_tokens

    def counted(*args):
        calls.append(1)
        return greedy(*args)

    monkeypatch.setattr(generate_module, "greedy_tokens", counted)
    return calls


def test_the_switch_off_gives_the_same_tokens_through_the_fp32_head(monkeypatch, wide_vocab_model):
    model, prompt = wide_vocab_model, torch.randint(0, 4000, (2, 5), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    calls = _count_int8_steps(monkeypatch)
    auto = generate(model, prompt, 40, temperature=0)
    assert len(calls) == 40
    calls.clear()
    off = generate(model, prompt, 40, temperature=0, int8_head=False)
    assert not calls and torch.equal(off, auto)
    with torch.no_grad():
        assert torch.equal(off, argmax_loop(model, prompt, 40))


def test_the_switch_on_applies_where_auto_would_not_pay(monkeypatch, wide_vocab_model):
    """Auto leaves a small head and short generations to the fp32 head; True uses the int8 head there too."""
    model, prompt = wide_vocab_model, torch.randint(0, 4000, (2, 5), generator=torch.Generator().manual_seed(4))
    calls = _count_int8_steps(monkeypatch)
    auto = generate(model, prompt, 8, temperature=0)
    assert not calls
    on = generate(model, prompt, 8, temperature=0, int8_head=True)
    assert len(calls) == 8 and torch.equal(on, auto)


@pytest.mark.parametrize(
    "case, message",
    [
        ("sampling", r"it picks the most likely token, for greedy decoding \(temperature=0\), not temperature=0.8"),
        ("parametrized", r"the LM head is parametrized"),
        ("bf16", r"the LM head is torch.bfloat16, not torch.float32"),
        ("autocast", r"CPU autocast is on"),
        ("onednn", r"oneDNN is unavailable or disabled"),
        ("not finite", r"the LM head has a weight that is not finite"),
    ],
)
def test_the_switch_on_is_refused_with_the_reason_where_it_cannot_apply(monkeypatch, wide_vocab_model, case, message):
    model, prompt = wide_vocab_model, torch.randint(0, 4000, (1, 4))
    temperature = 0.0
    context = torch.autocast("cpu", enabled=False)
    if case == "sampling":
        temperature = 0.8
    elif case == "parametrized":
        torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", torch.nn.Identity())
    elif case == "bf16":
        model = model.to(torch.bfloat16)
    elif case == "autocast":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif case == "onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    else:
        with torch.no_grad():
            model.lm_head.weight[7, 3] = float("inf")
    full = rf"int8_head=True, but the int8 greedy head cannot be used: {message}.*pass int8_head=None .* or False"
    with context, pytest.raises(ValueError, match=full):
        # refused when called, before the first token is asked for
        stream(model, prompt, 4, temperature=temperature, int8_head=True)
    with context:
        # the fp32 head serves the same call without the switch
        assert generate(model, prompt, 4, temperature=temperature, int8_head=None).shape == (1, 8)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_the_switch_takes_true_false_or_none(wide_vocab_model, value):
    with pytest.raises(ValueError, match=r"generate.int8_head must be True, False or None \(automatic\), got"):
        generate(wide_vocab_model, torch.tensor([[1, 2]]), 4, temperature=0, int8_head=value)
