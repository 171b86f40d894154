"""Int8 weights for generation on the CPU: ``generate(..., weights="int8")``, ``gpt2 sample --weights int8``.

:func:`int8_weights` gives a model's int8 twin, kept while the model lives: it shares the model's
embeddings, LayerNorms and biases (fp32, not copied) and holds every ``nn.Linear`` (the blocks'
projections and the LM head) as an :class:`Int8Linear`: int8 weights with one scale per output row (its
largest |w| / 127), a quarter of the bytes fp32 reads per token. Each row of activations is rounded to
7-bit integers with a scale of its own (its largest |x| / 63) and the integer products are summed
exactly, by fbgemm's int8 kernels where torch has them (x86), else by oneDNN's (see
:func:`gpt2.torch_compat.int8_matmul`). llama.cpp's ``q8_0`` does the same with a scale per block of 32
values (its dot products round the activations to 8 bits too).

So the tokens are not fp32's: greedy decoding follows fp32 until two tokens come within the rounding of
each other, then goes its own way (docs/benchmarks.md, "Generation vs llama.cpp", measures how often). A
row's result does not depend on the other rows (up to fp32 rounding: one row alone is rounded and scaled
inside the kernel, in fewer operations): batched prompts give each prompt's own tokens.

Of a compiled model (``generate(torch.compile(model), weights="int8")``) the twin runs compiled: each int8
product is one operator of the graph (``gpt2::int8_product``: Dynamo cannot trace fbgemm's packed weights, so
the operator finds them by the layer's key) and the LayerNorms, attention and GELU between them are compiled.

torchao (0.18) was measured first and does not serve on the CPU: its int8 weight-only linear converts the
whole weight to fp32 at every call (at batch 1 up to 8x slower than fp32: 158 ms against 21 ms for the
124M LM head) and its int8 x int8 one runs ``torch._int_mm``, 3-6x slower than fbgemm's kernels on AVX2
CPUs without VNNI.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from gpt2 import torch_compat
from gpt2.errors import InvalidValueError
from gpt2.model.traced_step import replayable

# generate's ``weights`` switch: the model's own weights, or its int8 twin
WEIGHTS = ("model", "int8")
# weight rows whose largest magnitude is below this keep this int8 step (they round to zeros)
_SMALLEST_STEP = 1e-30
# activations are rounded to integers in [-_MAX, _MAX]
_MAX = torch_compat.INT8_ACTIVATION_MAX

# model -> (a fingerprint of its nn.Linear weights, its int8 twin)
_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> torch.compile of its int8 twin, for a compiled model
_COMPILED_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@replayable
class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights, one fp32 scale per output row; the bias (fp32) is the linear's own.

    ``weight`` holds the int8 values ``(out_features, in_features)`` and ``scale`` their steps; the matmul
    reads a packed copy of them (fbgemm's layout).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        scale = (w.abs().amax(1) / 127).clamp(min=_SMALLEST_STEP)
        self.register_buffer("weight", (w / scale[:, None]).round_().to(torch.int8))
        self.register_buffer("scale", scale)
        # the model's own bias Parameter (shared, not copied), or None
        self.bias = linear.bias
        self.packed = torch_compat.pack_int8(self.weight, scale)
        self.key = _register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            # Dynamo cannot trace fbgemm's packed weights: the product is one operator of the graph, which
            # finds them by this layer's key; the rest (the LayerNorms, attention, GELU) is compiled
            out = _PRODUCT(rows, self.bias, self.key)
        else:
            out = _product(rows, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (copy.deepcopy, pickle) registers its own packed weights under a key of its own
        super().__setstate__(state)
        self.key = _register(self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _product(rows: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows`` ``(M, K)`` times the int8 weights ``packed``, plus ``bias``: each row rounded to integers in
    ``[-_MAX, _MAX]`` with a step of its own, its largest magnitude / ``_MAX`` (an all-zero row keeps a tiny
    one: its integers are 0).
    """
    if rows.size(0) == 1:
        # At batch 1 a decoding step has one row: the kernel rounds and scales it, with its step as a number
        # (four operations in place of eight: +4% tokens/s at 124M, the median of 10 paired rounds), and a
        # TorchScript function calls it (+5-9%, see int8_linear_row).
        return torch_compat.int8_linear_row(rows, packed, bias, _SMALLEST_STEP)
    # (rows, 1)
    top = rows.abs().amax(1, keepdim=True).clamp_(min=_SMALLEST_STEP)
    out = torch_compat.int8_matmul(rows.mul(_MAX / top).round_(), packed).mul_(top / _MAX)
    if bias is not None:
        out += bias
    return out


# key -> (the packed weights, out_features) of every live Int8Linear, for the compiled product (_PRODUCT)
_PACKED: dict[int, tuple[Any, int]] = {}
_KEYS = itertools.count()


def _register(layer: Int8Linear) -> int:
    """A new key for ``layer``'s packed weights, dropped from :data:`_PACKED` when ``layer`` is collected."""
    key = next(_KEYS)
    _PACKED[key] = (layer.packed, layer.out_features)
    weakref.finalize(layer, _PACKED.pop, key, None)
    return key


def _registered_product(rows: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    return _product(rows, _PACKED[key][0], bias)


def _product_shape(rows: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    return rows.new_empty(rows.size(0), _PACKED[key][1])


# :func:`_product` of the layer registered under ``key``, as one operator that torch.compile does not trace into
_PRODUCT = torch_compat.define_cpu_op(
    "gpt2::int8_product", "(Tensor rows, Tensor? bias, int key) -> Tensor", _registered_product, _product_shape
)


def check_weights(weights: Any) -> str:
    """``weights`` if it is one of :data:`WEIGHTS`, else a ValueError saying which are."""
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise InvalidValueError(
            f"generate.weights must be 'model' (the model's own weights) or 'int8' (every weight matrix "
            f"read in int8, on the CPU), got {weights!r}"
        )
    return weights


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
    return _kernel_reason(min(m.in_features for m in linears))


def _kernel_reason(fewest_inputs: int) -> str | None:
    """Why this torch has no int8 matmul for layers of ``fewest_inputs`` inputs or more, or None."""
    if torch_compat.has_fbgemm():
        return None
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "this torch has neither fbgemm's int8 kernels (x86) nor oneDNN's (torch.backends.mkldnn)"
    # oneDNN's int8 GEMM sums wrongly under 16 inputs (see gpt2.model.int8_head)
    if fewest_inputs < 16:
        return f"a layer has {fewest_inputs} inputs; oneDNN's int8 matmul needs at least 16"
    return None


def int8_weights(model: nn.Module) -> nn.Module:
    """``model``'s int8 twin (see the module's docstring), made at the first call and kept while ``model``
    lives; made again when the values of its ``nn.Linear`` weights changed (a fingerprint, so edits through
    ``.data`` count too). A model that holds :class:`Int8Linear` layers already is returned as it is.
    Of a compiled model (``torch.compile(model)`` or ``model.compile()``) the twin comes compiled too (by
    ``torch.compile`` with its default settings, kept with the twin): the int8 products run as fbgemm's
    kernels, everything between them as compiled code.
    Raises a ValueError saying why where it cannot apply (a GPU, bf16 weights, autocast, LoRA).
    """
    base = torch_compat.unwrap_compiled(model)
    if any(isinstance(m, Int8Linear) for m in base.modules()):
        return model
    reason = unsupported_reason(base)
    if reason is not None:
        raise InvalidValueError(f"weights='int8' cannot be used: {reason}")
    seen = _fingerprint(base)
    kept = _TWINS.get(base)
    if kept is None or not torch.equal(kept[0], seen):
        # drop the stale twin before making the new one (two at once would double the memory)
        _TWINS.pop(base, None)
        _COMPILED_TWINS.pop(base, None)
        kept = _TWINS[base] = (seen, _twin(base))
    twin = kept[1]
    if not torch_compat.is_compiled(model):
        return twin
    if base not in _COMPILED_TWINS:
        _COMPILED_TWINS[base] = torch.compile(twin)
    return _COMPILED_TWINS[base]


@torch.no_grad()
def _fingerprint(model: nn.Module) -> torch.Tensor:
    """The products of every ``nn.Linear`` weight with one fixed random vector: a change of any weight
    changes them (almost surely). Costs one fp32 pass over the weights, about a token's decoding.
    """
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    width = max(w.size(1) for w in weights)
    probe = torch.randn(width, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    return torch.cat([w @ probe[: w.size(1)] for w in weights])


@torch.no_grad()
def _twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode that shares its parameters and buffers, each ``nn.Linear`` an
    :class:`Int8Linear`.
    """
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = copy.deepcopy(model, memo=shared)
    for name, module in list(twin.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(twin.get_submodule(parent), leaf, Int8Linear(module))
    return twin.eval()
