"""Greedy decoding's fast heads (issue 29): a narrow LM head read in int8 by torch's int8 weight-only kernel
(NarrowHead), or from a transposed fp32 copy where that kernel cannot read it, gives the tokens of the model's own
head, with and without the KV cache, for padded prompts, where the int8 logits rank the rows otherwise, at ties,
overflows and NaN, and follows weights changed behind autograd; the switches choose as documented.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from _tiny_run import argmax_loop, context_dependent_model

from gpt2 import torch_compat
from gpt2.model import int8_head
from gpt2.model.generate import generate, pad_prompts
from gpt2.model.gpt import GPT


@pytest.fixture
def narrow_model(tiny_config) -> GPT:
    """A 32-wide model with a vocabulary wide enough that the head's argmax is not a tie."""
    return context_dependent_model(dataclasses.replace(tiny_config, vocab_size=2000))


needs_int8_rows = pytest.mark.skipif(
    not torch_compat.has_int8_rows_matmul(), reason="this torch has no int8 weight-only kernel"
)


@pytest.fixture
def narrow_by_default(monkeypatch):
    """Every head is large enough for the narrow heads' copies; returns the heads the default used per call."""
    return _spy_on_heads(monkeypatch)


@pytest.fixture
def transposed_by_default(monkeypatch):
    """As ``narrow_by_default`` in a torch without the int8 weight-only kernel: the narrow heads' transposed copy."""
    monkeypatch.setattr(int8_head, "has_int8_rows_matmul", lambda: False)
    return _spy_on_heads(monkeypatch)


def _spy_on_heads(monkeypatch) -> list[type]:
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


@pytest.mark.parametrize(
    "heads, kind, seed",
    [
        ("transposed_by_default", "TransposedHead", 1),
        *[pytest.param("narrow_by_default", "NarrowHead", seed, marks=needs_int8_rows) for seed in (1, 2, 3)],
    ],
)
def test_the_narrow_heads_give_the_plain_heads_tokens(narrow_model, request, heads, kind, seed):
    chosen = request.getfixturevalue(heads)
    prompt = torch.randint(0, 2000, (3, 5), generator=torch.Generator().manual_seed(seed))
    plain = generate(narrow_model, prompt, 40, temperature=0, int8_head=False)
    fast = generate(narrow_model, prompt, 40, temperature=0)
    uncached = generate(narrow_model, prompt, 40, temperature=0, use_cache=False)
    assert chosen == [type(None), getattr(int8_head, kind), getattr(int8_head, kind)]
    assert torch.equal(fast, plain) and torch.equal(uncached, plain)
    assert torch.equal(fast, argmax_loop(narrow_model, prompt, 40))


def test_the_transposed_head_with_padded_prompts(narrow_model, transposed_by_default):
    ids, mask = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    fast = generate(narrow_model, ids, 33, temperature=0, attention_mask=mask)
    plain = generate(narrow_model, ids, 33, temperature=0, attention_mask=mask, int8_head=False)
    assert transposed_by_default[0] is int8_head.TransposedHead
    assert torch.equal(fast, plain)
    for row, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]):
        alone = generate(narrow_model, torch.tensor([prompt]), 33, temperature=0)
        assert torch.equal(fast[row, -33:], alone[0, -33:])


@pytest.mark.parametrize(
    "heads, copies, part",
    [
        ("transposed_by_default", "_KEPT_TRANSPOSED", "w_t"),
        pytest.param("narrow_by_default", "_KEPT_NARROW", "q", marks=needs_int8_rows),
    ],
)
def test_the_narrow_heads_follow_weights_changed_behind_autograd(narrow_model, request, heads, copies, part):
    request.getfixturevalue(heads)
    kept_copies = getattr(int8_head, copies)
    model, prompt = narrow_model, torch.randint(0, 2000, (2, 4), generator=torch.Generator().manual_seed(2))
    before = generate(model, prompt, 32, temperature=0)
    kept = getattr(kept_copies[model.lm_head][1], part)
    # the same tensor, its version unchanged: only the fingerprint of its values sees the edit
    model.lm_head.weight.data[:, :16].neg_()
    after = generate(model, prompt, 32, temperature=0)
    assert getattr(kept_copies[model.lm_head][1], part) is not kept
    assert not torch.equal(before, after)
    assert torch.equal(after, argmax_loop(model, prompt, 32))


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


# The narrow head (NarrowHead): the int8 kernel's logits, a bound of their error, the blocks that can hold the
# argmax scored in fp32.


def _narrow_of(weight: torch.Tensor, monkeypatch) -> int8_head.NarrowHead | None:
    """The NarrowHead of an LM head of ``weight`` ``(V, C)`` (narrow heads of any size)."""
    monkeypatch.setattr(int8_head, "TRANSPOSED_HEAD_MIN", 0)
    holder = torch.nn.Linear(weight.size(1), weight.size(0), bias=False)
    holder.weight.data = weight
    model = types.SimpleNamespace(lm_head=holder, config=types.SimpleNamespace(vocab_size=weight.size(0)))
    return int8_head.narrow_head(model)


def _scored_rows(monkeypatch) -> list[int]:
    """The number of head rows each fp32 product of the NarrowHead scores, in order."""
    rows: list[int] = []

    def linear(h, w):
        rows.append(w.size(0))
        return torch.nn.functional.linear(h, w)

    monkeypatch.setattr(int8_head, "F", types.SimpleNamespace(linear=linear))
    return rows


@needs_int8_rows
def test_the_narrow_head_with_padded_prompts(narrow_model, narrow_by_default):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    ids, mask = pad_prompts(prompts)
    fast = generate(narrow_model, ids, 33, temperature=0, attention_mask=mask)
    plain = generate(narrow_model, ids, 33, temperature=0, attention_mask=mask, int8_head=False)
    assert narrow_by_default[0] is int8_head.NarrowHead
    assert torch.equal(fast, plain)
    for row, prompt in enumerate(prompts):
        alone = generate(narrow_model, torch.tensor([prompt]), 33, temperature=0)
        assert torch.equal(fast[row, -33:], alone[0, -33:])


@needs_int8_rows
def test_the_narrow_head_scores_few_rows_and_the_last_block(monkeypatch):
    g = torch.Generator().manual_seed(0)
    W = 0.2 * torch.randn(4000, 32, generator=g)
    narrow = _narrow_of(W, monkeypatch)
    h = torch.randn(16, 32, generator=g)
    # rows whose best token is the last row (4000 is not a whole number of blocks: its block is filled up)
    h[:4] += 5 * W[-1]
    rows = _scored_rows(monkeypatch)
    for one in h:
        assert torch.equal(narrow.tokens(one[None]), torch.nn.functional.linear(one[None], W).argmax(-1))
    assert int(narrow.tokens(h[:1])) == 3999
    # a row scores a few blocks of 64, not the whole head; a batch scores the union of its rows' blocks
    # (the whole head past an eighth of it, 500 rows: 16 rows here)
    assert torch.equal(narrow.tokens(h[[0, 7]]), torch.nn.functional.linear(h[[0, 7]], W).argmax(-1))
    assert torch.equal(narrow.tokens(h), torch.nn.functional.linear(h, W).argmax(-1))
    assert max(rows[:16]) <= 6 * 64 and max(rows[0], rows[7]) < rows[17] <= 500 and rows[18] == 4000


@needs_int8_rows
def test_the_narrow_head_keeps_the_fp32_argmax_where_int8_ranks_another_first_by_most_of_the_bound(monkeypatch):
    """Rows a and b rounded to int8 in opposite directions, column by column: the int8 logits rank a first by 30
    steps, fp32 ranks b first by half a step. The bound keeps b's block (half the bound would lose it), and b is
    the token.
    """
    C, s, d = 32, 2**-5, 2**-12
    # every other row far below: only a's and b's blocks can hold the argmax
    W = 1e-3 * torch.randn(2000, C, generator=torch.Generator().manual_seed(0)) - 0.5
    h = torch.ones(1, C)
    # column 0 (which h leaves out) sets both rows' int8 step to s
    h[0, 0] = 0.0
    a, b = torch.zeros(C), torch.zeros(C)
    a[0] = b[0] = 127 * s
    # columns 1-30: a rounds up to 1 step and b down to 0, a larger by 2d in fp32
    a[1:31], b[1:31] = 0.5 * s + d, 0.5 * s - d
    # column 31: both round to 0, b larger by s - 2d in fp32
    a[31], b[31] = -0.5 * s + d, 0.5 * s - d
    W[5], W[1900] = a, b
    narrow = _narrow_of(W, monkeypatch)
    assert narrow.scale[5] == narrow.scale[1900] == s
    int8_logits = torch_compat.int8_rows_matmul(h, narrow.q, narrow.scale)[0].float()
    assert int8_logits[5] - int8_logits[1900] == 30 * s and int(int8_logits[:2000].argmax()) == 5
    assert int(torch.nn.functional.linear(h, W).argmax()) == 1900
    rows = _scored_rows(monkeypatch)
    assert int(narrow.tokens(h)) == 1900
    assert rows == [128]
    # an exact tie in fp32 and int8: the first index wins, as in argmax
    W[1900] = a
    assert int(_narrow_of(W, monkeypatch).tokens(h)) == 5


@needs_int8_rows
def test_the_narrow_head_scores_the_whole_head_on_overflow_or_nan(monkeypatch):
    W = 0.2 * torch.randn(2000, 32, generator=torch.Generator().manual_seed(0))
    W[9] = 6e4
    narrow = _narrow_of(W, monkeypatch)
    rows = _scored_rows(monkeypatch)
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    # a logit beyond fp32's range (row 9's), |h|_2 beyond it, a NaN, a zero row (every block a candidate)
    h[0] = 1e34
    h[1, 3] = 3e38
    h[2, 5] = float("nan")
    h[3] = 0
    assert torch.equal(narrow.tokens(h), torch.nn.functional.linear(h, W).argmax(-1))
    for one in h[:4]:
        assert torch.equal(narrow.tokens(one[None]), torch.nn.functional.linear(one[None], W).argmax(-1))
    # a row that overflows sends its whole batch to the whole head, beside a row that would take a block
    for pair in (h[[0, 4]], h[[4, 1]], h[[4, 2]]):
        assert torch.equal(narrow.tokens(pair), torch.nn.functional.linear(pair, W).argmax(-1))
    assert rows == [2000] * 8
    assert torch.equal(narrow.tokens(h[4:]), torch.nn.functional.linear(h[4:], W).argmax(-1))
    assert rows[8] <= 4 * 64


@needs_int8_rows
@pytest.mark.parametrize("weight", [float("inf"), float("nan")])
def test_a_head_the_int8_kernel_cannot_read_gets_the_transposed_copy(narrow_model, narrow_by_default, weight):
    prompt = torch.randint(0, 2000, (2, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        narrow_model.lm_head.weight[7, 3] = weight
    assert int8_head.narrow_head(narrow_model) is None
    fast = generate(narrow_model, prompt, 32, temperature=0)
    assert narrow_by_default == [int8_head.TransposedHead]
    assert torch.equal(fast, generate(narrow_model, prompt, 32, temperature=0, int8_head=False))
    # finite again: the int8 copy, and the transposed one is dropped
    with torch.no_grad():
        narrow_model.lm_head.weight[7, 3] = 0.5
    generate(narrow_model, prompt, 32, temperature=0)
    assert narrow_by_default[2] is int8_head.NarrowHead
    assert narrow_model.lm_head not in int8_head._KEPT_TRANSPOSED


@needs_int8_rows
def test_a_kernel_that_breaks_the_bound_or_a_width_it_misreads_is_not_used(monkeypatch):
    """The copy is checked against the fp32 head on probe rows, alone and batched: a kernel whose sums leave the
    bound (here one that skips the last 16 columns; torch's misread widths that are not a multiple of 16) fails it,
    as does one that serves only its first call's batch size; such widths are also refused before.
    """
    W = 0.2 * torch.randn(2000, 32, generator=torch.Generator().manual_seed(0))
    assert isinstance(_narrow_of(W, monkeypatch), int8_head.NarrowHead)
    assert _narrow_of(0.2 * torch.randn(2000, 40), monkeypatch) is None
    kernel = torch_compat.int8_rows_matmul

    def skips_columns(x, q, scale):
        return kernel(x[:, :-16].contiguous(), q[:, :-16].contiguous(), scale)

    monkeypatch.setattr(int8_head, "int8_rows_matmul", skips_columns)
    assert _narrow_of(W.clone(), monkeypatch) is None
    # a kernel that computes only as many rows as its first call had (the other rows left as they were)
    first_batch: list[int] = []

    def first_batch_size_only(x, q, scale):
        first_batch.append(x.size(0))
        out = kernel(x, q, scale)
        out[first_batch[0] :] = 0
        return out

    monkeypatch.setattr(int8_head, "int8_rows_matmul", first_batch_size_only)
    assert _narrow_of(W.clone(), monkeypatch) is None


def test_int8_head_false_makes_no_copy(narrow_model, narrow_by_default):
    prompt = torch.randint(0, 2000, (1, 4))
    generate(narrow_model, prompt, 32, temperature=0, int8_head=False)
    assert narrow_by_default == [type(None)]
    for kept in (int8_head._KEPT_NARROW, int8_head._KEPT_TRANSPOSED, int8_head._KEPT):
        assert narrow_model.lm_head not in kept


def test_the_narrow_heads_default_shapes(tiny_config):
    assert int8_head.narrow_head(GPT(tiny_config)) is None
    big = GPT(dataclasses.replace(tiny_config, n_embd=64, vocab_size=2**16, n_layer=1)).eval()
    wide = GPT(dataclasses.replace(tiny_config, n_embd=256, vocab_size=2**14, n_layer=1)).eval()
    assert int8_head.narrow_head(wide) is None
    if torch_compat.has_int8_rows_matmul():
        assert isinstance(int8_head.narrow_head(big), int8_head.NarrowHead)
