"""Compiled decoding with int8 weights (gpt2/model/quantize.py): each int8 product is one operator
(``gpt2::int8_product``) that Dynamo does not trace into, so ``torch.compile`` compiles the rest of the int8
twin in one graph; the operator gives what the eager path gives, and compiled decoding gives eager's tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _tiny_run import context_dependent_model
from torch._dynamo.utils import counters

from gpt2 import torch_compat
from gpt2.model import quantize
from gpt2.model.generate import generate
from gpt2.model.gpt import GPT
from gpt2.model.quantize import Int8Linear, int8_weights


@pytest.fixture
def model(tiny_config) -> GPT:
    """A tiny model whose tokens depend on the whole context."""
    return context_dependent_model(tiny_config)


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graphs_and_breaks() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("rows", [1, 5])
def test_the_int8_operator_is_the_eager_product(rows):
    torch.manual_seed(0)
    layer = int8_weights(torch.nn.Linear(64, 48))
    x = torch.randn(rows, 64)
    x[-1] = 0.0  # an all-zero row keeps a tiny step: its output is the bias
    args = (layer.qweight, layer.scale)
    out = quantize._PRODUCT(x, *args, layer.bias)
    assert out.shape == (rows, 48) and torch.equal(out, quantize._product(x, *args, layer.bias))
    assert torch.equal(out[-1], layer.bias.detach())
    assert torch.equal(quantize._PRODUCT(x, *args, None), quantize._product(x, *args, None))
    # traced by Dynamo in one graph (fbgemm's packed weights stay out of it), with the eager layer's result
    _fresh_dynamo()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x.view(rows, 1, 64)), layer(x.view(rows, 1, 64)), rtol=0, atol=0)


def test_a_copy_of_a_layer_packs_its_own_weights():
    layer = int8_weights(torch.nn.Linear(32, 16))
    x = torch.randn(1, 32)
    expected = layer(x)
    copied = copy.deepcopy(layer)
    key = layer.qweight.data_ptr()
    assert key in quantize._PACKED
    del layer
    # the packed weights go with their int8 weights
    assert key not in quantize._PACKED
    assert torch.equal(quantize._PRODUCT(x, copied.qweight, copied.scale, copied.bias), expected)
    assert torch.equal(copied(x), expected)


def test_the_twin_of_a_compiled_model_is_compiled(model):
    twin = int8_weights(torch.compile(model))
    assert isinstance(twin._orig_mod.lm_head, Int8Linear)
    # a compiled twin is returned as it is
    assert int8_weights(twin) is twin
    model.compile()
    twin = int8_weights(model)
    assert torch_compat.uncompiled(twin) is not twin


def test_decoding_the_twin_is_one_graph_with_eager_tokens(model):
    """Dynamo alone (``backend="eager"``, ``fullgraph=True``: a graph break would raise)."""
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    eager = generate(model, prompt, 12, temperature=0, weights="int8")
    _fresh_dynamo()
    compiled = torch.compile(int8_weights(model), backend="eager", fullgraph=True)
    assert torch.equal(generate(compiled, prompt, 12, temperature=0, weights="int8"), eager)
    assert _graphs_and_breaks() == (1, 0)


def test_compiled_int8_generation_gives_the_eager_tokens(model, monkeypatch):
    """``generate(torch.compile(model), weights="int8")``: one graph for every decoding step, the tokens of eager
    int8 at batch 1 and 2. The twin is compiled with ``aot_eager`` (the operator's fake implementation gives the
    shapes AOTAutograd traces with) instead of Inductor, whose cold C++ compile took ~36 s of the suite's time on a
    2-core machine (docs/benchmarks.md has Inductor's run: the same tokens).
    """
    real_compile = torch.compile
    monkeypatch.setattr(quantize.torch, "compile", lambda module, **_: real_compile(module, backend="aot_eager"))
    single = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    batch = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = [generate(model, p, 16, temperature=0, weights="int8") for p in (single, batch)]
    # int8's tokens here are not fp32's: the compiled calls below decode the int8 twin
    assert not torch.equal(eager[0], generate(model, single, 16, temperature=0))
    _fresh_dynamo()
    compiled_model = real_compile(model, backend="aot_eager")
    got = [generate(compiled_model, p, 16, temperature=0, weights="int8") for p in (single, batch)]
    assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True))
    graphs, breaks = _graphs_and_breaks()
    # one graph per batch size (2 is marked dynamic after 1), no break
    assert breaks == 0 and graphs <= 2
    # each call makes a new twin: the later calls build no graph
    again = [generate(compiled_model, p, 16, temperature=0, weights="int8") for p in (single, batch)]
    assert all(torch.equal(a, b) for a, b in zip(again, eager, strict=True))
    assert _graphs_and_breaks() == (graphs, 0)
    # a model compiled in place: its twin decodes int8 too
    model.compile(backend="aot_eager")
    assert torch.equal(generate(model, single, 16, temperature=0, weights="int8"), eager[0])
