"""Generation with int8 weights (gpt2/model/quantize.py): ``generate(..., weights="int8")`` and
``gpt2 sample --weights int8`` run, agree with fp32 on most tokens, keep rows independent, and refuse with the
reason where they cannot apply; both int8 kernels (fbgemm's, oneDNN's) agree. Generation, fp32 and int8, follows
every change made to the model through Python (hooks, replaced modules, settings, parameters, its forward).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import types

import pytest
import torch
from _tiny_run import argmax_loop, context_dependent_model

from gpt2 import torch_compat
from gpt2.cli import main
from gpt2.model import quantize
from gpt2.model.generate import generate, pad_prompts, stream
from gpt2.model.gpt import GPT
from gpt2.model.quantize import Int8Linear, int8_weights


@pytest.fixture
def model(tiny_config) -> GPT:
    """A tiny model whose tokens depend on the whole context."""
    return context_dependent_model(tiny_config)


def test_int8_generation_agrees_with_fp32_on_most_tokens(model):
    prompt = torch.randint(0, 128, (8, 6), generator=torch.Generator().manual_seed(0))
    fp32 = generate(model, prompt, 40, temperature=0)
    int8 = generate(model, prompt, 40, temperature=0, weights="int8")
    assert int8.shape == fp32.shape and torch.equal(int8[:, :6], prompt)
    with torch.no_grad():
        # fp32's tokens as the context of both: the next token of every position (measured 94-98% on four
        # such models; greedy continuations part at the first near-tie and then differ)
        ref = model(fp32[:, :-1])[0][:, 5:].argmax(-1)
        got = int8_weights(model)(fp32[:, :-1])[0][:, 5:].argmax(-1)
    assert (ref == got).float().mean() > 0.9
    # sampling works with int8 weights too, reproducibly
    a, b = (generate(model, prompt, 8, temperature=0.8, top_k=20, seed=1, weights="int8") for _ in range(2))
    assert torch.equal(a, b)


def test_int8_rows_are_independent(model):
    """Each row of activations has its own int8 step: batched (and padded) prompts give each prompt's own
    tokens, and the cache gives what recomputing the context gives.
    """
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
    ids, mask = pad_prompts(prompts)
    batched = generate(model, ids, 24, temperature=0, attention_mask=mask, weights="int8")
    for row, p in zip(batched, prompts, strict=True):
        alone = generate(model, torch.tensor([p]), 24, temperature=0, weights="int8")
        assert torch.equal(row[-24:], alone[0, len(p) :])
    prompt = torch.tensor([[5, 6, 7, 8]])
    cached = generate(model, prompt, 16, temperature=0, weights="int8")
    assert torch.equal(cached, generate(model, prompt, 16, temperature=0, weights="int8", use_cache=False))


def test_int8_linear_is_the_int8_matmul_of_rounded_rows():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = int8_weights(linear)
    assert q.qweight.dtype == torch.int8 and q.bias is linear.bias and q.qweight.abs().max() == 127
    x = torch.randn(5, 3, 64)
    x[0, 0] = 0.0  # an all-zero row: its integers are 0, the output is the bias
    out = q(x)
    assert out.shape == (5, 3, 48) and torch.equal(out[0, 0], linear.bias.detach())
    # rows as in forward: each scaled to integers in [-63, 63] by its own largest magnitude
    rows = x.reshape(-1, 64)
    step = rows.abs().amax(1, keepdim=True).clamp(min=1e-30) / 63
    expected = ((rows / step).round() * step) @ (q.qweight.float() * q.scale[:, None]).T + linear.bias
    torch.testing.assert_close(out.reshape(-1, 48), expected.detach(), rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the others (one row alone goes through the kernel's own rounding and
    # scaling: the same integers but at a rounding tie, the same result up to fp32 rounding)
    torch.testing.assert_close(q(x[2:3, 1:2]), out[2:3, 1:2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q(x[0:1, 0:1]), out[0:1, 0:1], rtol=0, atol=0)
    with torch.no_grad():
        assert (out - linear(x)).abs().max() < 0.05 * linear(x).abs().max()


def test_both_int8_kernels_give_the_same_products(monkeypatch, model):
    """fbgemm's kernels (x86) and oneDNN's (elsewhere) sum the same integers exactly."""
    q = torch.randint(-127, 128, (40, 32), dtype=torch.int8)
    x = torch.randint(-63, 64, (3, 32)).float()
    exact = (x.long() @ q.long().T).float()
    ones = torch.ones(40)
    assert torch.equal(torch_compat.int8_matmul(x, torch_compat.pack_int8(q, ones)), exact)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    first = generate(model, prompt, 16, temperature=0, weights="int8")
    monkeypatch.setattr(torch_compat, "has_fbgemm", lambda: False)
    assert isinstance(torch_compat.pack_int8(q, ones), tuple)
    assert torch.equal(torch_compat.int8_matmul(x, torch_compat.pack_int8(q, ones)), exact)
    quantize._PACKED.clear()
    assert torch.equal(generate(model, prompt, 16, temperature=0, weights="int8"), first)


def test_the_int8_twin_is_made_at_each_call_and_keeps_int8_weights_of_unchanged_values(model):
    """The twin shares the model's embeddings, LayerNorms and biases; each call makes a new one, whose int8
    weights are those of the previous call where the fp32 weight's values did not change (edits through ``.data``,
    no version bump, are seen).
    """
    twin = int8_weights(model)
    assert int8_weights(twin) is twin
    assert twin.transformer.wte.weight is model.transformer.wte.weight
    assert twin.transformer.h[0].attn.c_attn.bias is model.transformer.h[0].attn.c_attn.bias
    assert isinstance(twin.lm_head, Int8Linear) and type(model.lm_head) is torch.nn.Linear
    assert sum(isinstance(m, Int8Linear) for m in twin.modules()) == 4 * model.config.n_layer + 1
    again = int8_weights(model)
    fc = (twin.transformer.h[1].mlp.c_fc, again.transformer.h[1].mlp.c_fc)
    assert again is not twin and fc[1].qweight is fc[0].qweight
    prompt = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(2))
    before = generate(model, prompt, 16, temperature=0, weights="int8")
    model.transformer.h[1].mlp.c_fc.weight.data.neg_()
    assert torch.equal(int8_weights(model).transformer.h[1].mlp.c_fc.qweight, -fc[0].qweight)
    after = generate(model, prompt, 16, temperature=0, weights="int8")
    assert not torch.equal(before, after)
    # the model itself still computes in fp32
    assert type(model.transformer.h[1].mlp.c_fc) is torch.nn.Linear


@pytest.mark.parametrize(
    "case, message",
    [
        ("value", r"generate.weights must be 'model' .* or 'int8' .*, got 'int4'"),
        ("bf16", r"weights='int8' cannot be used: the model's weights are \['torch.bfloat16'\], not torch.float32"),
        ("autocast", r"weights='int8' cannot be used: CPU autocast is on"),
        ("lora", r"weights='int8' cannot be used: the model has parametrized layers .* merge the adapter first"),
        ("kernels", r"weights='int8' cannot be used: this torch has neither fbgemm's int8 kernels"),
    ],
)
def test_int8_weights_are_refused_with_the_reason(monkeypatch, model, case, message):
    kwargs = dict(weights="int8")
    context = torch.autocast("cpu", enabled=False)
    if case == "value":
        kwargs["weights"] = "int4"
    elif case == "bf16":
        model = model.to(torch.bfloat16)
    elif case == "autocast":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif case == "lora":
        torch.nn.utils.parametrize.register_parametrization(
            model.transformer.h[0].attn.c_attn, "weight", torch.nn.Identity()
        )
    else:
        monkeypatch.setattr(torch_compat, "has_fbgemm", lambda: False)
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    with context, pytest.raises(ValueError, match=message):
        # refused when called, before the first token is asked for
        stream(model, torch.tensor([[1, 2, 3]]), 4, temperature=0, **kwargs)


@pytest.mark.cpu_features
def test_gpt2_sample_with_int8_weights(native_bf16, tmp_path, capsys, tiny_config):
    """With the default options, also where the CPU multiplies bf16 natively (sampling on a CPU is fp32 there)."""
    import minlora

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(tiny_config, vocab_size=50257))
    model.save_pretrained(tmp_path / "m")
    argv = ["sample", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--max-new-tokens", "5", "--seed", "1"]
    # fp32 named: on a CPU with native bf16 matmuls --precision auto is bf16, which int8 weights refuse
    assert main([*argv, "--weights", "int8", "--precision", "fp32"]) == 0
    assert "--- sample 1/1 ---\nHi" in capsys.readouterr().out
    # an adapter is merged into the loaded model first (the int8 twin is made from plain weights)
    minlora.add_lora(model, minlora.LoRAConfig(rank=2))
    minlora.save_adapter(model, tmp_path / "adapter")
    assert main([*argv, "--weights", "int8", "--precision", "fp32", "--adapter", str(tmp_path / "adapter")]) == 0
    assert "--- sample 1/1 ---\nHi" in capsys.readouterr().out
    assert main([*argv, "--weights", "int8", "--precision", "bf16"]) != 0
    assert "weights='int8' cannot be used: CPU autocast is on" in capsys.readouterr().err


def _forward_hook(model: GPT) -> None:
    model.transformer.h[0].register_forward_hook(lambda module, args, out: 1.5 * out)


def _lm_head_hook(model: GPT) -> None:
    # a hook on an nn.Linear that becomes int8 in the twin
    model.lm_head.register_forward_hook(lambda module, args, out: out.flip(-1))


def _replaced_ln_f(model: GPT) -> None:
    torch.manual_seed(5)
    model.transformer.ln_f = torch.nn.LayerNorm(model.config.n_embd)
    torch.nn.init.normal_(model.transformer.ln_f.weight, std=2.0)


def _replaced_wpe(model: GPT) -> None:
    torch.manual_seed(6)
    model.transformer.wpe = torch.nn.Embedding(model.config.block_size, model.config.n_embd)


def _changed_eps(model: GPT) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = 3.0


def _changed_parameter(model: GPT) -> None:
    # values changed behind autograd (no version bump), and a parameter replaced by another tensor
    model.transformer.h[1].mlp.c_fc.weight.data.neg_()
    fc = model.transformer.h[0].mlp.c_proj
    fc.weight = torch.nn.Parameter(torch.randn_like(fc.weight, generator=torch.Generator().manual_seed(7)))


def _instance_forward(model: GPT) -> None:
    def shifted(self, idx, *args, **kwargs):
        return GPT.forward(self, (idx + 1) % self.config.vocab_size, *args, **kwargs)

    model.forward = types.MethodType(shifted, model)


CHANGES = [_forward_hook, _lm_head_hook, _replaced_ln_f, _replaced_wpe, _changed_eps, _changed_parameter]


@pytest.mark.parametrize("change", [*CHANGES, _instance_forward], ids=lambda change: change.__name__.strip("_"))
@pytest.mark.parametrize("weights", ["model", "int8"])
def test_generation_follows_changes_made_through_the_python_api(model, change, weights):
    """After a call that decoded (and made the int8 twin), a change to the model made through Python: the next
    call gives the changed model's tokens, those of nanoGPT's loop over the changed model (for int8 weights, over
    an int8 twin of a fresh copy of it). A kept twin ignored every such change.
    """
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    before = generate(model, prompt, 40, temperature=0, weights=weights)
    change(model)
    reference = model if weights == "model" else int8_weights(copy.deepcopy(model))
    expected = argmax_loop(reference, prompt, 40)
    assert not torch.equal(expected, before)
    assert torch.equal(generate(model, prompt, 40, temperature=0, weights=weights), expected)
    sampled = generate(model, prompt, 20, temperature=0.8, seed=4, weights=weights)
    assert torch.equal(sampled, generate(reference, prompt, 20, temperature=0.8, seed=4))


def test_an_instance_forward_is_followed_after_hundreds_of_decoding_steps(model):
    """A step kept from earlier calls (a replayed trace) ignored a ``forward`` set on the model after 200 steps."""
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(8))
    for _ in range(5):
        generate(model, prompt, 50, temperature=0)
    _instance_forward(model)
    assert torch.equal(generate(model, prompt, 50, temperature=0), argmax_loop(model, prompt, 50))


def test_the_twin_runs_the_models_hooks_on_the_users_objects(model):
    """The twin holds the model's hooks themselves: a hook bound to the user's object (here one that holds a lock,
    which no copy could make) records into that object.
    """

    class Recorder:
        def __init__(self) -> None:
            self.shapes: list[tuple[int, ...]] = []
            self.lock = threading.Lock()

        def hook(self, module, args, out) -> None:
            with self.lock:
                self.shapes.append(tuple(out.shape))

    recorder = Recorder()
    model.transformer.h[1].register_forward_hook(recorder.hook)
    generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0, weights="int8")
    assert recorder.shapes == [(1, 3, 32)] + [(1, 1, 32)] * 3
