"""The training step's fast paths give the plain computation's numbers: the chunked loss with its
logits rows aligned wider than the vocabulary, the head gradient written by the first chunk and scaled in place
by the backward. Correctness only; their speed is measured by benchmarks/step_vs_peers.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gpt2.errors import InvalidValueError
from gpt2.model import gpt as gpt_module
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT, linear_cross_entropy


def _reference(x, weight, targets, vocab_size, reduction):
    logits = (x @ weight.T)[..., :vocab_size].float()
    return F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=-1, reduction=reduction)


def _case(rows: int = 23, vocab: int = 37, weight_rows: int = 37, width: int = 16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = torch.randn(weight_rows, width, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[3:9] = -1
    return x, weight, targets


def test_the_logits_buffer_rows_are_aligned_wider_than_the_vocabulary():
    buffer = gpt_module._logits_buffer("logits", 5, 37, torch.device("cpu"))
    assert buffer.shape == (5, 40) and buffer.stride() == (40, 1)
    # an aligned width is kept as it is
    assert gpt_module._logits_buffer("logits", 5, 48, torch.device("cpu")).shape == (5, 48)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("weight_rows", [37, 43, 64])  # no padding, padded to an unaligned and an aligned width
@pytest.mark.parametrize("chunk_rows", [5, 23, 64])  # uneven chunks, one chunk exactly, one larger chunk
def test_loss_and_gradients_equal_cross_entropy_for_any_vocabulary_width(reduction, weight_rows, chunk_rows):
    x, weight, targets = _case(weight_rows=weight_rows)
    loss = linear_cross_entropy(x, weight, targets, 37, reduction=reduction, chunk_rows=chunk_rows)
    dx, dw = torch.autograd.grad(loss * 0.25, (x, weight))
    ref = _reference(x, weight, targets, 37, reduction)
    ref_dx, ref_dw = torch.autograd.grad(ref * 0.25, (x, weight))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)
    # the head's padded rows are never a class
    assert torch.count_nonzero(dw[37:]) == 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("weight_rows", [37, 43, 64])
@pytest.mark.parametrize("chunk_rows", [5, 23, 64])
@pytest.mark.parametrize("compiling", [False, True])
def test_bf16_loss_made_by_rows_equals_autocast_cross_entropy(
    monkeypatch, reduction, weight_rows, chunk_rows, compiling
):
    """bf16 on a CPU: the logits stay bf16 and their fp32 softmax is made a few rows at a time (compiling, or on a
    GPU, the whole chunk's fp32 logits). The loss is autocast's cross-entropy of the bf16 logits to fp32's rounding,
    with no gradient asked for too; the gradients are within bf16's rounding (the reference rounds each chunk's
    weight gradient, ours adds the chunks in fp32).
    """
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    x, weight, targets = _case(weight_rows=weight_rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, weight, targets, 37, reduction=reduction, chunk_rows=chunk_rows)
        with torch.no_grad():
            loss_alone = linear_cross_entropy(x, weight, targets, 37, reduction=reduction, chunk_rows=chunk_rows)
        ref = _reference(x, weight, targets, 37, reduction)
    grads = torch.autograd.grad(loss, (x, weight))
    ref_grads = torch.autograd.grad(ref, (x, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(loss_alone, loss)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    # the head's padded rows are never a class
    assert torch.count_nonzero(grads[1][37:]) == 0


def test_bf16_loss_made_by_rows_takes_an_underflowed_row_from_its_logits():
    """A scored row whose target's probability underflows fp32 (its loss comes from its logits again) and an ignored
    row whose column 0 underflows: the loss is autocast's cross-entropy, never inf or NaN.
    """
    x, weight, targets = _case()
    with torch.no_grad():
        x[0] *= 50
        targets[0] = (x[0] @ weight[:37].T).argmin()
        x[4] = -20 * weight[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, weight, targets, 37, reduction="sum", chunk_rows=5)
        ref = _reference(x, weight, targets, 37, "sum")
    # p[target] of row 0 is below 1e-30 (a loss over 69 nats)
    row_0 = F.cross_entropy((x[0] @ weight[:37].T).float(), targets[0])
    assert row_0 > 100
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(loss, (x, weight))
    for got, expected in zip(grads, torch.autograd.grad(ref, (x, weight))):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_first_chunk_overwrites_the_uninitialised_head_gradient(monkeypatch, precision):
    """The head's gradient starts as uninitialised memory: NaNs there must not reach the gradient."""
    monkeypatch.setattr(
        gpt_module, "_weight_grad", lambda weight, rows: torch.full_like(weight, float("nan"), dtype=torch.float32)
    )
    x, weight, targets = _case()
    dtype = torch.bfloat16 if precision == "bf16" else None
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = linear_cross_entropy(x, weight, targets, 37, chunk_rows=5)
        ref = _reference(x, weight, targets, 37, "mean")
    dw = torch.autograd.grad(loss, weight)[0]
    ref_dw = torch.autograd.grad(ref, weight)[0]
    assert dw.isfinite().all()
    tol = dict(rtol=2e-2, atol=1e-3) if dtype else {}
    torch.testing.assert_close(dw, ref_dw, **tol)


def test_no_row_gives_zero_gradients():
    x, weight, targets = _case(rows=0)
    loss = linear_cross_entropy(x, weight, targets, 37, reduction="sum")
    dx, dw = torch.autograd.grad(loss, (x, weight))
    assert loss == 0 and dx.shape == (0, 16) and dw.abs().max() == 0


def test_a_second_backward_is_refused_in_one_line():
    """The backward scales the gradients in place: a second one (retain_graph) would scale them twice."""
    x, weight, targets = _case()
    loss = linear_cross_entropy(x, weight, targets, 37) * 3.0
    loss.backward(retain_graph=True)
    first = weight.grad.clone()
    with pytest.raises(InvalidValueError, match="second backward"):
        loss.backward()
    ref_dw = torch.autograd.grad(_reference(x, weight, targets, 37, "mean") * 3.0, weight)[0]
    torch.testing.assert_close(first, ref_dw)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tied_model_with_an_unaligned_vocabulary_matches_the_plain_loss(tiny_config, precision):
    """An unpadded odd vocabulary (the 124M benchmark's 50257 in small): the tied embedding's and head's
    gradients add up as the full logits' cross-entropy gives them, under bf16 autocast too.
    """
    config = dataclasses.replace(tiny_config, vocab_size=101, pad_vocab_multiple=1)
    model = GPT(config).train()
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 101, (3, 16), generator=generator)
    targets = torch.randint(0, 101, (3, 16), generator=generator)
    targets[1, :4] = -1
    dtype = torch.bfloat16 if precision == "bf16" else None

    def grads(fast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            if fast:
                loss = model(idx, targets, reduction="sum")[1]
            else:
                logits = model(idx)[0]
                loss = F.cross_entropy(
                    logits.float().reshape(-1, 101), targets.reshape(-1), ignore_index=-1, reduction="sum"
                )
        (loss / 40).backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    loss, fast = grads(True)
    ref, plain = grads(False)
    # bf16 keeps 8 bits: a gradient entry is within ~2^-8 of the largest one
    tol = dict(rtol=2e-2, atol=4e-3) if dtype else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref, **tol)
    for name, grad in plain.items():
        atol = tol["atol"] * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(fast[name], grad, rtol=tol["rtol"], atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_buffers_with_nans_in_them_change_no_gradient(monkeypatch, precision):
    """The logits buffers are kept between calls, uninitialised where nothing wrote: nothing of them may leak in
    (oneDNN's bf16 product reads a row's padding up to its stride, so the bf16 buffer's padding is zeroed).
    """
    x, weight, targets = _case(rows=48, vocab=101, weight_rows=101, width=32)

    def loss_and_grads():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = linear_cross_entropy(x, weight, targets, 101)
        return (loss, *torch.autograd.grad(loss, (x, weight)))

    clean = loss_and_grads()
    real = gpt_module._logits_buffer
    monkeypatch.setattr(gpt_module, "_logits_buffer", lambda *args: real(*args).fill_(float("nan")))
    for got, expected in zip(loss_and_grads(), clean):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accum", [1, 2])
def test_the_tied_embedding_gradient_added_by_rows_equals_the_dense_sum(monkeypatch, tiny_config, precision, accum):
    """The token embedding's gradient added into the head's by rows (index_add_) against autograd's dense
    embedding gradient summed with the head's, over one or two micro-steps (the gradient accumulates in .grad).
    """
    idx = torch.randint(0, 128, (accum, 3, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, -1)
    targets[..., :2] = -1

    def grads() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(tiny_config).train()
        for i in range(accum):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(idx[i], targets[i])[1]
            loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    by_rows = grads()
    with monkeypatch.context() as patch:
        patch.setattr(GPT, "_tied_grad", lambda self, targets: None)
        dense = grads()
    for name, grad in dense.items():
        # the same products, summed in another order: equal to fp32's rounding
        torch.testing.assert_close(by_rows[name], grad, rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")


def test_the_tied_embedding_gradient_of_bf16_weights(monkeypatch, tiny_config):
    """Weights computed in bf16 (FSDP's bf16 mixed precision gathers them so): the embedding's gradient is bf16,
    the loss's head gradient fp32; the weight gets a bf16 gradient as on the plain path.
    """
    idx = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))

    def grad() -> torch.Tensor:
        torch.manual_seed(0)
        model = GPT(tiny_config).to(torch.bfloat16).train()
        model(idx, torch.roll(idx, -1, 1))[1].backward()
        return model.lm_head.weight.grad

    by_rows = grad()
    with monkeypatch.context() as patch:
        patch.setattr(GPT, "_tied_grad", lambda self, targets: None)
        dense = grad()
    assert by_rows.dtype == dense.dtype == torch.bfloat16
    # one bf16 rounding of the sum against two (each part, then their sum)
    torch.testing.assert_close(by_rows.float(), dense.float(), rtol=2e-2, atol=4e-3 * dense.abs().max().item())


def test_the_tied_path_is_taken_only_where_it_gives_the_plain_gradients(tiny_config):
    model = GPT(tiny_config).train()
    targets = torch.zeros(1, 4, dtype=torch.long)
    assert isinstance(model._tied_grad(targets), gpt_module._TiedGrad)
    # no loss, no gradient, a hooked embedding, untied weights: autograd's own embedding gradient
    assert model._tied_grad(None) is None
    with torch.no_grad():
        assert model._tied_grad(targets) is None
    handle = model.transformer.wte.register_forward_hook(lambda *args: None)
    assert model._tied_grad(targets) is None
    handle.remove()
    model.transformer.wte.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert model._tied_grad(targets) is None


def test_a_backward_that_skips_the_loss_still_reaches_the_tied_embedding(tiny_config):
    # a block's output alone (e.g. an activation probe): the loss's backward never runs to hand over the head's part
    model = GPT(tiny_config)
    acts = []
    model.transformer.h[0].register_forward_hook(lambda module, args, out: acts.append(out))
    x = torch.randint(0, tiny_config.vocab_size, (2, 8))
    model(x, x)
    acts[0].sum().backward()
    grad = model.transformer.wte.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad[x.unique()].abs().sum() > 0


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_the_training_forward_compiles_to_one_graph_for_an_unaligned_vocabulary(dtype):
    """``fullgraph=True`` raises at any graph break. A vocabulary of 101 rows is narrower than the aligned buffers an
    eager CPU loss writes its products into; compiling, the loss traced a product into such a buffer's first columns,
    broke the graph there and ran eagerly (under bf16 on a CPU its compiled pieces could then fail).
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101))
    idx = torch.randint(0, 101, (2, 16))
    targets = torch.roll(idx, -1, 1)
    targets[0, :3] = -1
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for forward in (model, compiled):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = forward(idx, targets, reduction="sum")[1]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (loss, grads) = results
    # compiled, the bf16 loss takes the whole chunk's fp32 logits, eager on a CPU a few rows at a time
    low = dtype is not None
    torch.testing.assert_close(loss, eager_loss, **(dict(rtol=1e-2, atol=1e-2) if low else {}))
    for got, expected in zip(grads, eager_grads):
        tol = dict(rtol=2e-2, atol=2e-2 * expected.abs().max().item()) if low else {}
        torch.testing.assert_close(got, expected, **tol)


def _torch_gelu(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own bf16 tanh GELU of ``x`` and its input gradient for ``grad``."""
    x = x.detach().clone().requires_grad_()
    y = F.gelu(x, approximate="tanh")
    return y, torch.autograd.grad(y, x, grad)[0]


def _table_gelu(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = gpt_module.TanhGelu()(x)
    assert type(y.grad_fn).__name__ == "_Bf16TableGeluBackward"
    return y, torch.autograd.grad(y, x, grad)[0]


def test_the_bf16_gelu_tables_give_torchs_values_bit_for_bit():
    # every bf16 value: +-0, subnormals, +-inf and NaNs included
    every = torch.arange(2**16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    grad = torch.randn(every.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ours, theirs = _table_gelu(every, grad), _torch_gelu(every, grad)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.isnan(), b.isnan())
        finite = ~a.isnan()
        # the bits: -0.0 and 0.0 apart too
        assert torch.equal(a[finite].view(torch.int16), b[finite].view(torch.int16))


def test_the_bf16_gelu_tables_in_pieces_of_strided_tensors(monkeypatch):
    monkeypatch.setattr(gpt_module, "GELU_TABLE_CHUNK", 1000)
    monkeypatch.setattr(gpt_module, "GELU_TABLE_MIN", 1000)
    generator = torch.Generator().manual_seed(1)
    # 2,560 values: two whole pieces and a part; both tensors transposed views
    x = (torch.randn(4, 10, 64, generator=generator) * 3).to(torch.bfloat16).transpose(0, 2)
    grad = torch.randn(4, 10, 64, generator=generator).to(torch.bfloat16).transpose(0, 2)
    for a, b in zip(_table_gelu(x, grad), _torch_gelu(x, grad)):
        assert torch.equal(a, b)


def test_the_gelu_tables_serve_bf16_on_a_cpu_only_and_outlive_inference_mode():
    gelu = gpt_module.TanhGelu()
    assert isinstance(gelu, torch.nn.GELU) and gelu.approximate == "tanh"
    x = torch.randn(64, gpt_module.GELU_TABLE_MIN // 64, requires_grad=True)
    assert type(gelu(x).grad_fn).__name__ == "GeluBackward0"
    # fewer bf16 values than GELU_TABLE_MIN (decoding a token) keep torch's kernel
    assert type(gelu(x[:, :-1].bfloat16()).grad_fn).__name__ == "GeluBackward0"
    # tables first made under inference mode are plain tensors: a later training step can use them
    gpt_module._gelu_tables.cache_clear()
    with torch.inference_mode():
        assert torch.equal(gelu(x.bfloat16()), F.gelu(x.bfloat16(), approximate="tanh"))
    assert not any(table.is_inference() for table in gpt_module._gelu_tables())
    grad = torch.randn(x.shape).to(torch.bfloat16)
    for a, b in zip(_table_gelu(x.bfloat16(), grad), _torch_gelu(x.bfloat16(), grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_bf16_model_with_the_gelu_tables_has_torchs_gradients_bit_for_bit(monkeypatch, tiny_config, checkpointing):
    monkeypatch.setattr(gpt_module, "GELU_TABLE_MIN", 0)
    # the tables first made inside the model's forward, a checkpointed block's with checkpointing
    gpt_module._gelu_tables.cache_clear()
    generator = torch.Generator().manual_seed(2)
    idx = torch.randint(0, tiny_config.vocab_size, (2, 32), generator=generator)
    grads = []
    for gelu in (gpt_module.TanhGelu, lambda: torch.nn.GELU(approximate="tanh")):
        torch.manual_seed(0)
        model = GPT(tiny_config).set_activation_checkpointing(checkpointing)
        for block in model.transformer.h:
            block.mlp.gelu = gelu()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
