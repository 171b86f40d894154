"""GPT model: shapes, tying, initialisation, padded vocabulary, attention paths, input checks, sizes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT


def _model(config: GPTConfig) -> GPT:
    return GPT(config).eval()


def _padded_copy(model: GPT, multiple: int) -> GPT:
    """The same weights in a model whose vocabulary is padded to ``multiple``."""
    cfg = dataclasses.replace(model.config, pad_vocab_multiple=multiple)
    padded = GPT(cfg).eval()
    sd = model.state_dict()
    wte = sd["transformer.wte.weight"]
    pad = torch.randn(cfg.padded_vocab_size - cfg.vocab_size, cfg.n_embd)  # arbitrary, must not matter
    sd["transformer.wte.weight"] = sd["lm_head.weight"] = torch.cat([wte, pad])
    padded.load_state_dict(sd)
    return padded


def test_output_shapes_and_loss(tiny_config):
    model = _model(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, tiny_config.vocab_size)
    assert loss is None
    logits, loss = model(idx, torch.roll(idx, -1, dims=1))
    assert loss.shape == () and torch.isfinite(loss)
    # At initialisation the prediction is close to uniform: loss ~ ln(vocab_size).
    assert abs(loss.item() - math.log(tiny_config.vocab_size)) < 0.5


def test_ignored_targets_and_int32_inputs(tiny_config):
    model = _model(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (2, 12))
    targets = torch.randint(0, tiny_config.vocab_size, (2, 12))
    logits, _ = model(idx)
    _, loss = model(idx, targets)
    _, loss32 = model(idx.int(), targets.int())
    torch.testing.assert_close(loss32, loss)
    masked = targets.clone()
    masked[:, 6:] = -1  # ignored positions leave the mean over the others
    _, loss_half = model(idx, masked)
    expected = torch.nn.functional.cross_entropy(logits[:, :6].reshape(-1, logits.size(-1)), targets[:, :6].reshape(-1))
    torch.testing.assert_close(loss_half, expected)


def test_weights_are_tied(tiny_config):
    model = GPT(tiny_config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once, so the optimizer sees it once
    # A gradient step through the head moves the embedding too.
    idx = torch.randint(0, tiny_config.vocab_size, (2, 8))
    model(idx, idx)[1].backward()
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad


def test_gpt2_initialisation():
    # Wide and deep enough that the sample standard deviations are within ~1% of the true ones.
    cfg = GPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln_" in name or name.startswith("transformer.ln_f"):
            assert torch.all(p == 1), name
        else:
            expected = residual_std if name.endswith("c_proj.weight") else 0.02
            assert p.std().item() == pytest.approx(expected, rel=0.05), name
            assert abs(p.mean().item()) < 0.1 * expected, name


def test_padded_vocab_same_loss_and_logits(tiny_config):
    model = _model(dataclasses.replace(tiny_config, vocab_size=100))
    padded = _padded_copy(model, 64)
    assert padded.config.padded_vocab_size == 128
    assert padded.lm_head.weight.shape == (128, tiny_config.n_embd)
    idx = torch.randint(0, 100, (2, 16))
    targets = torch.randint(0, 100, (2, 16))
    logits, loss = model(idx)[0], model(idx, targets)[1]
    plogits, ploss = padded(idx)[0], padded(idx, targets)[1]
    assert plogits.shape == logits.shape == (2, 16, 100)
    torch.testing.assert_close(plogits, logits)
    torch.testing.assert_close(ploss, loss)


def test_padded_ids_are_never_generated(tiny_config):
    model = _model(dataclasses.replace(tiny_config, vocab_size=100))
    padded = _padded_copy(model, 64)
    with torch.no_grad():
        # Make every hidden state the same vector u, and the padded head rows 100 * u: their
        # logits then beat every real token by far, so only slicing keeps them out.
        u = torch.randn(tiny_config.n_embd)
        padded.transformer.ln_f.weight.zero_()
        padded.transformer.ln_f.bias.copy_(u)
        padded.lm_head.weight[100:] = 100 * u
    idx = torch.randint(0, 100, (4, 5))
    hidden = padded.transformer.ln_f(torch.zeros(1, tiny_config.n_embd))
    assert int((hidden @ padded.lm_head.weight.T).argmax()) >= 100  # the trap is armed
    for kwargs in (dict(temperature=0), dict(temperature=1.0, seed=0), dict(temperature=2.0, top_p=0.99, seed=1)):
        out = padded.generate(idx, 30, **kwargs)
        assert int(out.max()) < 100, kwargs


def test_padded_ids_are_rejected_as_prompt(tiny_config):
    padded = _model(dataclasses.replace(tiny_config, vocab_size=100, pad_vocab_multiple=64))
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 100\) .* got \[100\]"):
        padded.generate(torch.tensor([[5, 100]]), 3)


def test_flash_and_manual_attention_agree(tiny_config):
    flash = _model(tiny_config)
    manual = _model(dataclasses.replace(tiny_config, flash=False))
    manual.load_state_dict(flash.state_dict())
    idx = torch.randint(0, tiny_config.vocab_size, (2, 24))
    logits_f, loss_f = flash(idx, idx)
    logits_m, loss_m = manual(idx, idx)
    torch.testing.assert_close(logits_m, logits_f, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_m, loss_f, atol=1e-6, rtol=1e-6)
    # Padded batched prompts go through an explicit boolean mask: both paths agree there too.
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    from gpt2.model.generate import pad_prompts

    ids, mask = pad_prompts(prompts)
    torch.testing.assert_close(
        manual.generate(ids, 10, temperature=0, attention_mask=mask),
        flash.generate(ids, 10, temperature=0, attention_mask=mask),
    )


def _attention_grads(attend, q, k, v, grad):
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attend(*inputs)
    out.backward(grad.to(out.dtype))
    return out, [t.grad for t in inputs]


@pytest.mark.parametrize("query_rows", [128, 16])
def test_bf16_cpu_attention_backward_matches_the_flash_backward(monkeypatch, query_rows):
    from gpt2.model import gpt as gpt_module

    # 16 rows: the 40 queries in blocks of 8 (the last, seeing every key), 16 and 16
    monkeypatch.setattr(gpt_module, "ATTENTION_BACKWARD_QUERY_ROWS", query_rows)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 40, 16, generator=gen).bfloat16() for _ in range(4))
    flash = lambda *qkv: torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)  # noqa: E731
    out, ours = _attention_grads(gpt_module._CpuCausalAttention.apply, q, k, v, grad)
    flash_out, flash_grads = _attention_grads(flash, q, k, v, grad)
    # the forward is the flash kernel's
    assert torch.equal(out, flash_out)
    _, exact = _attention_grads(flash, q.double(), k.double(), v.double(), grad)
    for name, mine, theirs, truth in zip("qkv", ours, flash_grads, exact):
        error = ((mine.double() - truth).norm() / truth.norm()).item()
        flash_error = ((theirs.double() - truth).norm() / truth.norm()).item()
        # bf16 rounding: scores rounded before their softmax, as the flash kernel does not
        assert error < max(2 * flash_error, 1e-2), (name, error, flash_error)
    # two heads per block of scores: the same gradients as all six in one
    rows = min(query_rows, 40)
    monkeypatch.setattr(gpt_module, "ATTENTION_BACKWARD_BLOCK_BYTES", 2 * rows * 40 * 2)
    _, blocked = _attention_grads(gpt_module._CpuCausalAttention.apply, q, k, v, grad)
    for mine, by_blocks in zip(ours, blocked):
        assert torch.equal(mine, by_blocks)


def test_the_bf16_attention_backward_runs_where_it_is_faster(tiny_config, monkeypatch):
    from gpt2.model import gpt as gpt_module

    calls = []
    apply = gpt_module._CpuCausalAttention.apply
    monkeypatch.setattr(gpt_module._CpuCausalAttention, "apply", lambda *qkv: calls.append(1) or apply(*qkv))
    idx = torch.randint(0, tiny_config.vocab_size, (2, 24))

    def layers_through_it(config, dtype=torch.bfloat16, train=True):
        calls.clear()
        model = GPT(config).train(train)
        with torch.autocast("cpu", dtype=dtype), torch.set_grad_enabled(train):
            _, loss = model(idx, idx)
        if train:
            loss.backward()
            assert all(p.grad is not None for p in model.parameters())
        return len(calls)

    # bf16 training on a CPU: every layer
    assert layers_through_it(tiny_config) == tiny_config.n_layer
    # not in fp16, in evaluation, with dropout, without flash, or past the longest sequence it is measured faster at
    assert layers_through_it(tiny_config, dtype=torch.float16) == 0
    assert layers_through_it(tiny_config, train=False) == 0
    assert layers_through_it(dataclasses.replace(tiny_config, dropout=0.1)) == 0
    assert layers_through_it(dataclasses.replace(tiny_config, flash=False)) == 0
    monkeypatch.setattr(gpt_module, "CPU_ATTENTION_BACKWARD_MAX_T", 16)
    assert layers_through_it(tiny_config) == 0


def test_causality(tiny_config):
    model = _model(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (1, 20))
    changed = idx.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % tiny_config.vocab_size
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_dropout_only_in_training(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, dropout=0.2))
    idx = torch.randint(0, tiny_config.vocab_size, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


@pytest.mark.parametrize(
    "make_input, error, message",
    [
        (
            lambda V, T: torch.randint(0, V, (1, T + 1)),
            ValueError,
            r"sequence length 65 exceeds the model's context \(block_size=64\)",
        ),
        (lambda V, T: torch.rand(1, 4), TypeError, r"idx must be an integer tensor .* got torch.float32"),
        (lambda V, T: torch.tensor([1, 2, 3]), ValueError, r"shape \(batch, sequence\), got shape \(3,\)"),
        (lambda V, T: torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"got shape \(1, 2, 3\)"),
        (lambda V, T: torch.zeros(1, 0, dtype=torch.long), ValueError, r"idx is empty"),
        (lambda V, T: [[1, 2, 3]], TypeError, r"idx must be an integer tensor .* got list"),
    ],
    ids=["too-long", "float", "1d", "3d", "empty", "list"],
)
def test_bad_inputs_raise_clear_errors(tiny_config, make_input, error, message):
    model = _model(tiny_config)
    with pytest.raises(error, match=message):
        model(make_input(tiny_config.vocab_size, tiny_config.block_size))


def test_bad_targets_raise_clear_errors(tiny_config):
    model = _model(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (2, 8))
    with pytest.raises(ValueError, match=r"targets shape \(2, 7\) must equal idx shape \(2, 8\)"):
        model(idx, idx[:, 1:])
    with pytest.raises(TypeError, match=r"targets must be an integer tensor .* got torch.float32"):
        model(idx, idx.float())


@pytest.mark.parametrize("bad", [-100, -2, 64, 100])
def test_targets_that_are_neither_tokens_nor_ignored_are_refused(tiny_config, bad):
    """Hugging Face's ignore index -100 was scored as token 0, and a padded row's id as an infinite
    loss: now an error on the CPU, and a NaN loss where the check does not run (GPU tensors).
    """
    from gpt2.model.gpt import linear_cross_entropy

    config = dataclasses.replace(tiny_config, vocab_size=64, pad_vocab_multiple=128)
    model = _model(config)
    idx = torch.randint(0, 64, (2, 8))
    targets = idx.clone()
    targets[1, 3] = bad
    with pytest.raises(ValueError, match=rf"targets must be token ids in \[0, 64\) or -1 .*got {bad}"):
        model(idx, targets)
    x, weight = torch.randn(16, 8, requires_grad=True), torch.randn(128, 8)
    assert linear_cross_entropy(x, weight, targets.reshape(-1), 64).isnan()
    targets[1, 3] = -1  # the ignore index itself is fine
    assert model(idx, targets)[1].isfinite()


def test_bad_position_ids_and_cache_overflow(tiny_config):
    from gpt2.model.generate import KVCache

    model = _model(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (1, 4))
    with pytest.raises(ValueError, match=r"position_ids must have shape \(4,\) or \(1, 4\)"):
        model(idx, position_ids=torch.arange(5))
    with pytest.raises(ValueError, match=r"KV cache of 4 positions for 5 new ones"):
        model(torch.randint(0, tiny_config.vocab_size, (1, 5)), kv_cache=KVCache.for_model(model, 4))


def test_kv_cache_follows_autocast_dtype(tiny_config):
    from gpt2.model.generate import KVCache

    model = _model(tiny_config)
    cache = KVCache.for_model(model)
    idx = torch.randint(0, tiny_config.vocab_size, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, kv_cache=cache)
        logits, _ = model(idx[:, :1], kv_cache=cache)  # cached step: bf16 queries meet bf16 keys
        out = model.generate(idx, 5, temperature=0)
    assert cache.k[0].dtype == torch.bfloat16 and int(cache.pos) == 7 and cache.k[0].size(2) == 64
    assert logits.shape == (2, 1, tiny_config.vocab_size) and out.shape == (2, 11)


def _param_count_formula(cfg: GPTConfig) -> int:
    """GPT-2's parameters, from its shapes: tied embedding, positions, blocks, final LayerNorm."""
    C, L = cfg.n_embd, cfg.n_layer
    per_block = (
        2 * 2 * C  # two LayerNorms (weight + bias)
        + C * 3 * C
        + 3 * C  # c_attn
        + C * C
        + C  # attn.c_proj
        + C * 4 * C
        + 4 * C  # mlp.c_fc
        + 4 * C * C
        + C  # mlp.c_proj
    )
    return cfg.padded_vocab_size * C + cfg.block_size * C + L * per_block + 2 * C


@pytest.mark.parametrize(
    "name, millions", [("gpt2", 124), ("gpt2-medium", 355), ("gpt2-large", 774), ("gpt2-xl", 1558)]
)
def test_preset_parameter_counts(name, millions):
    cfg = GPTConfig.from_name(name)
    assert (cfg.block_size, cfg.vocab_size) == (1024, 50257)
    with torch.device("meta"):  # shapes only: no 1.5B-parameter allocation
        model = GPT(cfg)
    n = model.num_params()
    assert n == _param_count_formula(cfg)
    assert round(n / 1e6) == millions  # the published sizes (gpt2-medium is the "350M" model)
    assert model.num_params(non_embedding=True) == n - cfg.block_size * cfg.n_embd
    with torch.device("meta"):
        padded = GPT(GPTConfig.from_name(name, pad_vocab_multiple=64))
    assert padded.config.padded_vocab_size == 50304
    assert padded.num_params() == n + (50304 - 50257) * cfg.n_embd


def test_gpt_rejects_non_config():
    with pytest.raises(TypeError, match="GPT expects a GPTConfig, got dict"):
        GPT({"n_layer": 2})


def _forward_every_way(model: GPT, config: GPTConfig, device: str = "cpu") -> None:
    """Forward as training (targets, with ignored positions), as a cached generation step, and as
    a padded-prompt step with explicit positions and mask.
    """
    from gpt2.model.generate import KVCache

    V = config.vocab_size
    idx = torch.randint(0, V, (2, 12), device=device)
    targets = idx.roll(-1, dims=1)
    targets[:, -1] = -1
    model(idx, targets)
    cache = KVCache.for_model(model)
    model(idx, kv_cache=cache)
    model(idx[:, :1], kv_cache=cache)
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool, device=device).tril()
    model(idx, position_ids=torch.arange(12, device=device).expand(2, 12), attn_mask=mask)


def test_forward_never_reads_tensor_values_on_the_host(tiny_config, monkeypatch):
    """.item(), .tolist(), bool(t), int(t)... in forward would each be a GPU sync per call. The one
    host read is the targets' range check, which runs only on CPU tensors (no sync there).
    """
    from gpt2.model import gpt as gpt_module

    model = _model(tiny_config)
    monkeypatch.setattr(gpt_module, "check_targets", lambda targets, V: checked.append(targets.device.type))
    checked: list[str] = []

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"forward called Tensor.{name}: a host read (device sync)")

        return raise_

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, forbidden(name))
        with pytest.raises(AssertionError, match="Tensor.item"):  # the trap works
            torch.tensor(1).item()
        _forward_every_way(model, tiny_config)
    assert checked == ["cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forward_does_not_sync_on_cuda(tiny_config):
    model = _model(tiny_config).cuda()
    _forward_every_way(model, tiny_config, "cuda")  # warm-up: lazy CUDA initialisation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_every_way(model, tiny_config, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow
def test_forward_is_one_graph_for_torch_compile(tiny_config):
    """einops' head split/merge and the input checks cost torch.compile no graph break."""
    import torch._dynamo as dynamo

    model = _model(dataclasses.replace(tiny_config, vocab_size=100, pad_vocab_multiple=64))
    idx = torch.randint(0, 100, (2, 16))
    explained = dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


# ------------------------------------------------------------------------------ loss
def _plain_loss(model: GPT, idx, targets, reduction="mean", **kwargs):
    """The reference: the whole logits, then PyTorch's cross-entropy in fp32."""
    logits = model(idx, **kwargs)[0]
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=reduction
    )


def _loss_and_grads(model: GPT, loss_fn, scaler=None):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    scale = scaler.get_scale() if scaler is not None else 1.0
    return loss.detach(), {n: p.grad / scale for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "precision, tol",
    [("fp32", dict(rtol=1e-5, atol=1e-6)), ("bf16", dict(rtol=2e-2, atol=1e-4)), ("fp16", dict(rtol=5e-3, atol=1e-3))],
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_matches_full_logits_cross_entropy(tiny_config, precision, tol, reduction):
    """The chunked loss (padded vocab, ignored targets) gives the plain loss and gradients, under
    autocast too; fp16 through a GradScaler, whose scaled gradients must survive.
    """
    model = GPT(dataclasses.replace(tiny_config, vocab_size=100, pad_vocab_multiple=64)).train()
    idx = torch.randint(0, 100, (3, 16))
    targets = torch.randint(0, 100, (3, 16))
    targets[0, :5] = -1
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # a scale at which the plain loss's fp16 gradients neither overflow (sum) nor underflow (mean)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if precision == "fp16" else None
    context = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with context:
        loss, grads = _loss_and_grads(model, lambda: model(idx, targets, reduction=reduction)[1], scaler)
        ref, ref_grads = _loss_and_grads(model, lambda: _plain_loss(model, idx, targets, reduction), scaler)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, **tol)
    for name, grad in ref_grads.items():  # atol relative to the largest entry: sum grads are larger
        atol = tol["atol"] * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(grads[name], grad, rtol=tol["rtol"], atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    if reduction == "sum":  # the sum over the scored targets: mean * count
        torch.testing.assert_close(loss, model(idx, targets)[1] * (targets != -1).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiling", [False, True])  # CPU eager: softmax in place; else log_softmax
def test_linear_cross_entropy_in_uneven_chunks(compiling, monkeypatch):
    from gpt2.model.gpt import linear_cross_entropy

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)

    x = torch.randn(2, 23, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)  # 40 rows, of which 37 are the vocabulary
    targets = torch.randint(0, 37, (2, 23))
    targets[1, 3:9] = -1
    with torch.no_grad():  # a row whose target's probability underflows fp32: its loss comes from its logits
        x[0, 0] *= 50
        targets[0, 0] = (x[0, 0] @ weight[:37].T).argmin()
        x[1, 4] = -20 * weight[0]  # an ignored row (it reads column 0, then weighs 0) where column 0 underflows
    loss = linear_cross_entropy(x, weight, targets, 37, chunk_rows=5)
    dx, dw = torch.autograd.grad(loss * 3.0, (x, weight))  # the incoming gradient scales both
    logits = (x @ weight.T)[..., :37]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), targets.reshape(-1), ignore_index=-1)
    ref_dx, ref_dw = torch.autograd.grad(ref * 3.0, (x, weight))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)
    assert dw[37:].abs().max() == 0  # padded rows are never a class
    # no scored target: the mean is NaN (0/0, as F.cross_entropy's) but the gradients are zero
    empty = linear_cross_entropy(x, weight, torch.full_like(targets, -1), 37, chunk_rows=5)
    assert empty.isnan() and all(g.abs().max() == 0 for g in torch.autograd.grad(empty, (x, weight)))


def test_loss_buffer_kept_between_calls_serves_any_size_and_inference_mode():
    """On CPU the logits buffer outlives a call: made under inference_mode, it must still take
    in-place writes outside it; a larger call grows it; another thread has its own. Each call gives
    the plain loss and gradient.
    """
    import threading

    from gpt2.model import gpt as gpt_module
    from gpt2.model.gpt import linear_cross_entropy

    weight = torch.randn(40, 16, requires_grad=True)

    def check(rows: int, chunk_rows: int) -> None:
        x = torch.randn(rows, 16, requires_grad=True)
        targets = torch.randint(0, 37, (rows,))
        loss = linear_cross_entropy(x, weight, targets, 37, chunk_rows=chunk_rows)
        ref = torch.nn.functional.cross_entropy((x @ weight.T)[:, :37], targets)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref, x)[0])

    gpt_module._kept.logits = None
    with torch.inference_mode():
        linear_cross_entropy(torch.randn(30, 16), weight, torch.randint(0, 37, (30,)), 37)
    made = gpt_module._kept.logits
    check(21, chunk_rows=8)  # 8 x 40 rows of the 30 x 40 buffer made under inference_mode
    assert gpt_module._kept.logits is made
    check(50, chunk_rows=50)  # 50 x 40: a larger buffer
    assert gpt_module._kept.logits.numel() == 50 * 40
    finished = []
    thread = threading.Thread(target=lambda: finished.append(check(13, chunk_rows=13)))  # raises before append
    thread.start()
    thread.join()
    assert finished == [None] and gpt_module._kept.logits.numel() == 50 * 40  # this thread's is untouched


def test_loss_with_packing_mask_and_positions(tiny_config):
    """Packed rows: a (B, 1, T, T) block-diagonal mask and restarting positions, with the loss."""
    model = GPT(tiny_config).train()
    idx = torch.randint(0, tiny_config.vocab_size, (2, 12))
    targets = idx.roll(-1, dims=1)
    doc = torch.tensor([0] * 5 + [1] * 7)  # two documents per row
    mask = (doc[:, None] == doc[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    kwargs = dict(
        attn_mask=mask.expand(2, 1, 12, 12), position_ids=torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    )
    loss, grads = _loss_and_grads(model, lambda: model(idx, targets, **kwargs)[1])
    ref, ref_grads = _loss_and_grads(model, lambda: _plain_loss(model, idx, targets, **kwargs))
    torch.testing.assert_close(loss, ref)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6)
    # the second document of each row is the same model call as that document alone
    alone = model(idx[:, 5:], targets[:, 5:], reduction="sum")[1]
    torch.testing.assert_close(model(idx, torch.where(doc == 1, targets, -1), reduction="sum", **kwargs)[1], alone)


def test_bad_reduction_raises(tiny_config):
    model = _model(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (1, 4))
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        model(idx, idx, reduction="none")
