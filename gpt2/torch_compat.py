"""The private PyTorch names gpt2 uses, in one place.

Each entry says why the public API does not do, and the torch versions it was checked on. Nothing
else in the package may name ``torch._*`` or ``torch.ops`` (``tests/test_torch_compat.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 matrices ``(m, k) @ (k, n)``, summed exactly in int32.

    Why private: no public operator multiplies int8 matrices into int32 (``torch.matmul`` of two int8
    tensors returns int8, wrapped around). ``torch._int_mm`` runs oneDNN's int8 GEMM on the CPU (with
    oneDNN disabled it is a plain loop, ~8x slower: the int8 greedy head checks that first).
    Checked on torch 2.13 (the int8 greedy head came after the suite's run on 2.11).
    """
    return torch._int_mm(a, b)


def softmax_in_place(logits: torch.Tensor) -> torch.Tensor:
    """``logits.softmax(-1)`` of a 2-D fp32 tensor, written over ``logits`` in one fused pass per row.

    Why private: the public softmax has no ``out=``; its in-place equivalent with public ops (max,
    subtract, exp, sum, divide: five passes over a (rows, 50304) chunk) measured +35 ms per 512-row
    chunk and +11% on the whole train step at build-nanogpt's shape (4 layers, 128 wide, B=8, T=128;
    one thread, 20 interleaved rounds), within noise at the LoRA benchmark's 124M shape.
    ``torch._softmax(x, dim, half_to_float, out=)`` is the ATen kernel behind ``torch.softmax``.
    Checked on torch 2.11 and 2.13.
    """
    return torch._softmax(logits, -1, False, out=logits)


def unwrap_compiled(module: Any) -> Any:
    """The module under ``torch.compile(module)``'s wrapper; ``module`` itself if it is not one.

    Why private: the wrapper (``torch._dynamo.eval_frame.OptimizedModule``) has no public class name
    or accessor for the module it wraps (``_orig_mod``). The class is looked up only if
    ``torch._dynamo`` is loaded already: without it nothing is compiled, and importing it costs
    seconds. Checked on torch 2.11 and 2.13.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper_type = getattr(eval_frame, "OptimizedModule", None)
    if wrapper_type is not None and isinstance(module, wrapper_type):
        return module._orig_mod
    return module


def uncompiled(module: Any) -> Callable[..., Any]:
    """What runs ``module``'s forward without compiling it: the module under ``torch.compile``'s
    wrapper, or the plain ``forward`` of a module compiled in place by ``module.compile()``.

    Why private: ``nn.Module.compile()`` keeps the compiled call in ``_compiled_call_impl`` (None when
    not compiled), and no public flag says whether a module was compiled in place; calling the
    module always runs the compiled call. Checked on torch 2.13 (added after the suite's run on 2.11).
    """
    inner = unwrap_compiled(module)
    if getattr(inner, "_compiled_call_impl", None) is not None:
        return inner.forward
    return inner
