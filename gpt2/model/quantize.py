"""Int8 weights for generation on the CPU: ``generate(..., weights="int8")``, ``gpt2 sample --weights int8``.

:func:`int8_weights` gives a model's int8 twin, made from the model as it is at each call: a copy of its module
tree that shares its parameters and buffers (not copied) and keeps its hooks, settings and replaced modules, in
which each plain ``nn.Linear`` (the blocks' projections and the LM head) becomes an :class:`Int8Linear`: int8
weights with one scale per output row (its largest |w| / 127), a quarter of the bytes fp32 reads per token (the
int8 weights are kept with the fp32 weight they were made from, and made again when its values change). Each
row of activations is rounded to 7-bit integers with a scale of its own (its largest |x| / 63) and the integer
products are summed exactly, by fbgemm's int8 kernels where torch has them (x86), else by oneDNN's (see
:func:`gpt2.torch_compat.int8_matmul`). llama.cpp's ``q8_0`` does the same with a scale per block of 32
values (its dot products round the activations to 8 bits too).

So the tokens are not fp32's: greedy decoding follows fp32 until two tokens come within the rounding of
each other, then goes its own way (docs/benchmarks.md, "Generation vs llama.cpp", measures how often). A
row's result does not depend on the other rows (up to fp32 rounding: one row alone is rounded and scaled
inside the kernel, in fewer operations): batched prompts give each prompt's own tokens.

Of a compiled model (``generate(torch.compile(model), weights="int8")``) the twin runs compiled: each int8
product is one operator of the graph (``gpt2::int8_product``: Dynamo cannot trace fbgemm's packed weights, so
the operator packs them from the layer's int8 weights at its first call) and the LayerNorms, attention and GELU
between them are compiled.

torchao was measured first and does not serve on the CPU: its int8 weight-only linear converts the whole
weight to fp32 at every call and its int8 x int8 one runs ``torch._int_mm``, slower than fbgemm's kernels on
AVX2 CPUs without VNNI (docs/benchmarks.md).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.utils.weak import WeakIdKeyDictionary

from gpt2 import torch_compat
from gpt2.errors import InvalidValueError

# weight rows whose largest magnitude is below this keep this int8 step (they round to zeros)
_SMALLEST_STEP = 1e-30
# activations are rounded to integers in [-_MAX, _MAX]
_MAX = torch_compat.INT8_ACTIVATION_MAX


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` of an int8 twin: ``qweight`` holds its weight's int8 values ``(out_features,
    in_features)`` and ``scale`` their steps; the bias is the model's own. :func:`int8_weights` makes one by
    changing the class of a copied ``nn.Linear``, so the layer keeps its hooks and attributes.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            # Dynamo cannot trace fbgemm's packed weights: the product is one operator of the graph; the rest
            # (the LayerNorms, attention, GELU) is compiled
            out = _PRODUCT(rows, self.qweight, self.scale, self.bias)
        else:
            out = _product(rows, self.qweight, self.scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


# the int8 weights' storage -> their packed form (torch_compat.pack_int8), made at their first product and dropped
# with the tensor
_PACKED: dict[int, Any] = {}


def _product(rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows`` ``(M, K)`` times the int8 weights, plus ``bias``: each row rounded to integers in ``[-_MAX, _MAX]``
    with a step of its own, its largest magnitude / ``_MAX`` (an all-zero row keeps a tiny one: its integers are 0).
    """
    key = qweight.data_ptr()
    if key not in _PACKED:
        _PACKED[key] = torch_compat.pack_int8(qweight, scale)
        weakref.finalize(qweight, _PACKED.pop, key, None)
    if rows.size(0) == 1:
        # one row (a decoding step at batch 1): the kernel rounds and scales it, with its step as a number
        step = max(float(rows.abs().max()), _SMALLEST_STEP) / _MAX
        out = torch_compat.int8_matmul(rows, _PACKED[key], step)
    else:
        # (rows, 1)
        top = rows.abs().amax(1, keepdim=True).clamp_(min=_SMALLEST_STEP)
        out = torch_compat.int8_matmul(rows.mul(_MAX / top).round_(), _PACKED[key]).mul_(top / _MAX)
    if bias is not None:
        out += bias
    return out


# :func:`_product` as one operator that torch.compile does not trace into
_PRODUCT = torch_compat.define_cpu_op(
    "gpt2::int8_product",
    "(Tensor rows, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor",
    _product,
    # for tracing: an empty result of the right shape
    lambda rows, qweight, scale, bias: rows.new_empty(rows.size(0), qweight.size(0)),
)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot have an int8 twin here, or None."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return "the model has no nn.Linear layer"
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        return "the model has parametrized layers (e.g. LoRA): merge the adapter first (minlora.merge_lora)"
    weight = linears[0].weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type}, and int8 weights run on the CPU (move it with .cpu())"
    dtypes = {m.weight.dtype for m in linears}
    if dtypes != {torch.float32}:
        return f"the model's weights are {sorted(map(str, dtypes))}, not torch.float32 (convert it with .float())"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on: int8 weights compute in fp32 (turn autocast off, e.g. --precision fp32)"
    # the int8 matmuls: fbgemm's, else oneDNN's
    if torch_compat.has_fbgemm():
        return None
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "this torch has neither fbgemm's int8 kernels (x86) nor oneDNN's (torch.backends.mkldnn)"
    fewest_inputs = min(m.in_features for m in linears)
    # oneDNN's int8 GEMM sums wrongly under 16 inputs
    if fewest_inputs < 16:
        return f"a layer has {fewest_inputs} inputs; oneDNN's int8 matmul needs at least 16"
    return None


def int8_weights(model: nn.Module) -> nn.Module:
    """``model``'s int8 twin (see the module's docstring), made now from the model as it is: its modules, hooks,
    settings and the current values of its weights. A model that holds :class:`Int8Linear` layers already is
    returned as it is. Of a compiled model (``torch.compile(model)`` or ``model.compile()``) the twin comes
    compiled too (by ``torch.compile`` with its default settings): the int8 products run as fbgemm's kernels,
    everything between them as compiled code.
    Raises a ValueError saying why where it cannot apply (a GPU, bf16 weights, autocast, LoRA).
    """
    base = torch_compat.unwrap_compiled(model)
    if any(isinstance(m, Int8Linear) for m in base.modules()):
        return model
    reason = unsupported_reason(base)
    if reason is not None:
        raise InvalidValueError(f"weights='int8' cannot be used: {reason}")
    # A copy in eval mode that shares the model's parameters and buffers, each plain nn.Linear an Int8Linear (a
    # subclass's forward, or a forward set on the layer itself, still runs as the model's). No autograd: _int8_of
    # reads the weights detached.
    twin = torch_compat.module_tree_copy(base).eval()
    for module in twin.modules():
        if type(module) is nn.Linear:
            qweight, scale = _int8_of(module.weight)
            module.__class__ = Int8Linear
            module.register_buffer("qweight", qweight)
            module.register_buffer("scale", scale)
    # compiled: torch.compile's wrapper, or compiled in place by model.compile()
    if torch_compat.uncompiled(model) is not model:
        return torch.compile(twin)
    return twin


# fp32 weight -> (a fingerprint of its values, its int8 values, their steps): quantizing and packing a weight
# costs many times what the fingerprint does, so a weight is quantized again only when its values changed
_KEPT = WeakIdKeyDictionary()


def _int8_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight``'s int8 values (one step per row, its largest |w| / 127) and the steps, made again when its
    values changed since (edits through ``.data``, which leave no trace on the tensor, included).
    """
    w = weight.detach()
    # The fingerprint: the products of w's rows with a fixed random vector. A change of any value changes them (but
    # one too small to move an fp32 sum); one pass over the weight, about a token's decoding.
    seen = w @ torch.randn(w.size(1), generator=torch.Generator().manual_seed(0), dtype=w.dtype)
    kept = _KEPT.get(weight)
    if kept is None or not torch.equal(kept[0], seen):
        scale = (w.abs().amax(1) / 127).clamp(min=_SMALLEST_STEP)
        kept = _KEPT[weight] = (seen, (w / scale[:, None]).round_().to(torch.int8), scale)
    return kept[1], kept[2]
