"""Greedy decoding's fast heads (issue 29): a narrow LM head read from a transposed fp32 copy gives the
tokens of the model's own head, with and without the KV cache, for padded prompts, and follows weights
changed behind autograd; the switches choose as documented.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _tiny_run import context_dependent_model

from gpt2.model import int8_head
from gpt2.model.generate import generate, pad_prompts
from gpt2.model.gpt import GPT


@pytest.fixture
def narrow_model(tiny_config) -> GPT:
    """A 32-wide model with a vocabulary wide enough that the head's argmax is not a tie."""
    return context_dependent_model(dataclasses.replace(tiny_config, vocab_size=2000))


@pytest.fixture
def transposed_by_default(monkeypatch):
    """Every head is large enough for the transposed copy; returns the heads the default used per call."""
    monkeypatch.setattr(int8_head, "TRANSPOSED_HEAD_MIN", 0)
    chosen: list[type] = []
    select = int8_head.select_int8_head

    def spy(*args):
        head = select(*args)
        chosen.append(type(head))
        return head

    from gpt2.model import generate as generate_module

    monkeypatch.setattr(generate_module, "select_int8_head", spy)
    return chosen


def _argmax_loop(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: a full forward over the whole context per token, the argmax of its last logits."""
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def test_the_transposed_head_gives_the_plain_heads_tokens(narrow_model, transposed_by_default):
    prompt = torch.randint(0, 2000, (3, 5), generator=torch.Generator().manual_seed(1))
    plain = generate(narrow_model, prompt, 40, temperature=0, int8_head=False)
    fast = generate(narrow_model, prompt, 40, temperature=0)
    uncached = generate(narrow_model, prompt, 40, temperature=0, use_cache=False)
    assert transposed_by_default == [type(None), int8_head.TransposedHead, int8_head.TransposedHead]
    assert torch.equal(fast, plain) and torch.equal(uncached, plain)
    assert torch.equal(fast, _argmax_loop(narrow_model, prompt, 40))


def test_the_transposed_head_with_padded_prompts(narrow_model, transposed_by_default):
    ids, mask = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    fast = generate(narrow_model, ids, 33, temperature=0, attention_mask=mask)
    plain = generate(narrow_model, ids, 33, temperature=0, attention_mask=mask, int8_head=False)
    assert transposed_by_default[0] is int8_head.TransposedHead
    assert torch.equal(fast, plain)
    for row, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]):
        alone = generate(narrow_model, torch.tensor([prompt]), 33, temperature=0)
        assert torch.equal(fast[row, -33:], alone[0, -33:])


def test_the_transposed_head_follows_weights_changed_behind_autograd(narrow_model, transposed_by_default):
    model, prompt = narrow_model, torch.randint(0, 2000, (2, 4), generator=torch.Generator().manual_seed(2))
    before = generate(model, prompt, 32, temperature=0)
    kept = int8_head._KEPT_TRANSPOSED[model.lm_head][1].w_t
    # the same tensor, its version unchanged: only the fingerprint of its values sees the edit
    model.lm_head.weight.data[:, :16].neg_()
    after = generate(model, prompt, 32, temperature=0)
    assert int8_head._KEPT_TRANSPOSED[model.lm_head][1].w_t is not kept
    assert not torch.equal(before, after)
    assert torch.equal(after, _argmax_loop(model, prompt, 32))


def test_which_head_greedy_decoding_reads(narrow_model, transposed_by_default, monkeypatch):
    prompt = torch.randint(0, 2000, (1, 4))
    # sampling, short generations and int8_head=False keep the model's head; True asks for the int8 one
    generate(narrow_model, prompt, 32, temperature=0.8, seed=0)
    generate(narrow_model, prompt, 31, temperature=0)
    generate(narrow_model, prompt, 32, temperature=0, int8_head=True)
    assert transposed_by_default[:2] == [type(None), type(None)]
    assert transposed_by_default[2] is int8_head.Int8Head
    # a head of 256 columns or more reads the int8 copy (where it is large enough) instead
    monkeypatch.setattr(int8_head, "TRANSPOSED_HEAD_MAX_EMBD", 32)
    monkeypatch.setattr(int8_head, "SIEVE_MIN_HEAD", 0)
    generate(narrow_model, prompt, 32, temperature=0)
    assert transposed_by_default[3] is int8_head.Int8Head
    # parametrized heads (LoRA) keep the model's own
    torch.nn.utils.parametrize.register_parametrization(narrow_model.lm_head, "weight", torch.nn.Identity())
    generate(narrow_model, prompt, 32, temperature=0)
    assert transposed_by_default[4] is type(None)


def test_the_default_thresholds_leave_small_heads_alone(tiny_config):
    model = GPT(tiny_config)
    assert int8_head.transposed_head(model) is None
    big = GPT(dataclasses.replace(tiny_config, n_embd=64, vocab_size=2**16, n_layer=1)).eval()
    assert isinstance(int8_head.transposed_head(big), int8_head.TransposedHead)
    wide = GPT(dataclasses.replace(tiny_config, n_embd=256, vocab_size=2**14, n_layer=1)).eval()
    assert int8_head.transposed_head(wide) is None


def test_the_one_row_int8_matmul_is_int8_matmuls(monkeypatch):
    """int8_matmul_row (the operator without its Python wrapper) gives int8_matmul's result, on both kernels,
    and an int8 twin decodes the same tokens through it as through int8_matmul.
    """
    from gpt2 import torch_compat
    from gpt2.model.quantize import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = Int8Linear(linear)
    x = torch.randn(1, 64)
    step = float(x.abs().max()) / torch_compat.INT8_ACTIVATION_MAX
    assert torch.equal(
        torch_compat.int8_matmul_row(x, q.packed, step), torch_compat.int8_matmul(x, q.packed, step=step)
    )
    with torch.no_grad():
        assert torch.equal(q(x[None]), torch_compat.int8_matmul(x, q.packed, step=step)[None] + linear.bias)
    monkeypatch.setattr(torch_compat, "has_fbgemm", lambda: False)
    packed = torch_compat.pack_int8(q.weight, q.scale)
    assert torch.equal(torch_compat.int8_matmul_row(x, packed, step), torch_compat.int8_matmul(x, packed, step=step))


def test_tokens_are_normal_tensors_though_decoding_runs_in_inference_mode(narrow_model):
    """The steps run under torch.inference_mode; what stream yields and generate returns can be modified in
    place and used with autograd, as before.
    """
    prompt = torch.tensor([[1, 2, 3]])
    tokens = list(narrow_model.stream(prompt, 4, temperature=0))
    assert not any(t.is_inference() for t in tokens)
    tokens[0] += 1
    out = generate(narrow_model, prompt, 4, temperature=0)
    assert not out.is_inference()
    out[0, 0] = 7
    logits, _ = narrow_model(out)
    logits.sum().backward()
    assert narrow_model.lm_head.weight.grad is not None
