"""The private PyTorch names gpt2 uses, in one place.

Each entry says why the public API does not do, and the torch versions it was checked on. Nothing
else in the package may name ``torch._*`` or ``torch.ops`` (``tests/test_torch_compat.py``).
"""

from __future__ import annotations

import copy
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch


def softmax_in_place(logits: torch.Tensor) -> torch.Tensor:
    """``logits.softmax(-1)`` of a 2-D fp32 tensor, written over ``logits`` in one fused pass per row.

    Why private: the public softmax has no ``out=``; its in-place equivalent with public ops (max,
    subtract, exp, sum, divide: five passes over a (rows, 50304) chunk) make the whole train step
    measurably slower at small shapes, where the loss is a large part of it.
    ``torch._softmax(x, dim, half_to_float, out=)`` is the ATen kernel behind ``torch.softmax``.
    Checked on torch 2.11 and 2.13.
    """
    return torch._softmax(logits, -1, False, out=logits)


def softmax_backward(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient through ``p = softmax(s, -1)``: ``p * (grad - (grad * p).sum(-1, keepdim=True))``, in ``p``'s
    dtype, in one fused pass per row.

    Why private: the public ops take four passes over a (heads, T, T) block and a temporary for each; autograd
    reaches this kernel only through a graph recorded for it. ``torch._softmax_backward_data(grad, output, dim,
    input_dtype)`` is the ATen kernel behind softmax's backward. Checked on torch 2.11 and 2.13.
    """
    return torch._softmax_backward_data(grad, p, -1, p.dtype)


def tanh_gelu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` times the tanh GELU's derivative at ``x``: the kernel of ``F.gelu(x, approximate="tanh")``'s
    backward, so the values are torch's own.

    Why private: through autograd, the public way to reach it, the derivative records a graph and saves ``x``. Inside
    an activation-checkpointed block that is a saved tensor the recomputation does not save again, and
    ``torch.utils.checkpoint`` refuses the mismatch. ``torch.ops.aten.gelu_backward`` is that kernel (its signature
    unchanged since torch 1.12). Checked on torch 2.13.
    """
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


def unwrap_compiled(module: Any) -> Any:
    """The module under ``torch.compile(module)``'s wrapper; ``module`` itself if it is not one.

    Why private: the wrapper (``torch._dynamo.eval_frame.OptimizedModule``) has no public class name
    or accessor for the module it wraps (``_orig_mod``). The class is looked up only if
    ``torch._dynamo`` is loaded already: without it nothing is compiled, and importing it costs
    seconds. Checked on torch 2.11 and 2.13.
    """
    wrapper_type = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
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


def has_hooks(module: Any) -> bool:
    """Whether calling ``module`` runs forward hooks of its own or global ones (``register_forward_hook``,
    ``register_forward_pre_hook``, ``torch.nn.modules.module.register_module_forward_hook``...).

    Why private: ``nn.Module`` keeps its hooks in ``_forward_hooks`` and ``_forward_pre_hooks`` and the global
    ones in ``torch.nn.modules.module``'s ``_global_forward_hooks`` and ``_global_forward_pre_hooks``; no public
    accessor says whether any is registered. Checked on torch 2.13.
    """
    registries = (module._forward_hooks, module._forward_pre_hooks)
    hooks = sys.modules["torch.nn.modules.module"]
    global_registries = (hooks._global_forward_hooks, hooks._global_forward_pre_hooks)
    return any(len(registry) > 0 for registry in (*registries, *global_registries))


def module_tree_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` and its submodules, each module copied alone (``copy.copy``): the copies hold the
    originals' parameters and buffers, hooks and other attributes (the same objects, none copied), a ``forward``
    method set on a module is bound to its copy, and a module compiled in place by ``module.compile()`` is not
    compiled in its copy. Registering or replacing a parameter, buffer or submodule of a copy leaves the original
    as it is.

    Why private: ``nn.Module`` keeps its parameters, buffers and submodules in the dicts ``_parameters``,
    ``_buffers`` and ``_modules``, which a shallow copy shares; no public API copies a module without deep-copying
    what it holds (``copy.deepcopy`` copies the objects a hook is bound to, and fails on any that cannot be
    copied). ``_compiled_call_impl``: see :func:`uncompiled`. Checked on torch 2.13.
    """
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = {
        name: child if child is None else module_tree_copy(child) for name, child in module._modules.items()
    }
    twin._compiled_call_impl = None
    forward = vars(module).get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        twin.forward = types.MethodType(forward.__func__, twin)
    return twin


# ---- The CPU's features: the one place gpt2 decides anything from them ----
# The features (as torch.cpu.get_capabilities() names them, torch 2.11 and later) that multiply bf16 matrices
# natively, and their names in a log line. Without one, bf16 on a CPU is converted to fp32 and back around fp32
# arithmetic: slower than fp32.
NATIVE_BF16_FEATURES = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}
# Overrides the CPU's answer to cpu_native_bf16(): 1 = native, 0 = emulated. The test suite runs what depends on
# it under both answers on any machine (test.sh).
NATIVE_BF16_VARIABLE = "GPT2_CPU_NATIVE_BF16"


def cpu_native_bf16() -> str | None:
    """What makes this CPU multiply bf16 natively ("AMX", "AVX512-BF16", or the variable that says so), else None.
    Every choice gpt2 makes from the CPU's features follows this answer, which ``$GPT2_CPU_NATIVE_BF16`` (1 or 0)
    overrides.
    """
    forced = os.environ.get(NATIVE_BF16_VARIABLE)
    if forced == "1":
        return f"{NATIVE_BF16_VARIABLE}=1"
    if forced == "0":
        return None
    # torch.cpu.get_capabilities() asks the CPU once, then answers from its cache
    for feature, name in NATIVE_BF16_FEATURES.items():
        if torch.cpu.get_capabilities().get(feature):
            return name
    return None


# ---- Startup time: FSDP's and DTensor's classes without importing them ----
# Importing torch.distributed.fsdp, torch.distributed.tensor or torch.distributed.checkpoint loads DTensor's
# operator tables (with sympy): 1.0-1.3 s of every start of the package (docs/benchmarks.md, "Startup"). The
# package imports them where they are used; these checks need no import.


def is_fsdp_module(module: Any) -> bool:
    """Whether ``module`` was sharded by FSDP2's ``fully_shard`` (an ``FSDPModule``). No module can be one before
    ``torch.distributed.fsdp`` is imported, so this imports nothing. Checked on torch 2.11 and 2.13.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2's sharded parameters), importing nothing (see
    :func:`is_fsdp_module`). Checked on torch 2.11 and 2.13.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


# Activations multiplied by int8 weights are rounded to integers in [-INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX]:
# 7 bits. fbgemm adds pairs of (activation + 64) * weight products in int16 on CPUs without VNNI; with
# 8-bit activations those sums overflow (wrong results), with 7 bits (at most 2 * 127 * 127) they cannot.
INT8_ACTIVATION_MAX = 63


def has_fbgemm() -> bool:
    """Whether this torch has fbgemm's int8 matmuls (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Any:
    """The int8 matrix ``q`` ``(N, K)`` (times ``scale`` ``(N,)`` per row) for :func:`int8_matmul`:
    fbgemm's packed layout where this torch has fbgemm, else ``q.T`` for oneDNN's int8 GEMM (then ``scale``
    is applied by :func:`int8_matmul`).

    Why private: torch's public API has no int8 x int8 matmul (see :func:`int8_matmul`). fbgemm's (``quantized::
    linear_prepack`` and ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``, the kernels behind
    ``torch.ao``'s dynamic quantization) take a per-channel quantized tensor, built with
    ``torch._make_per_channel_quantized_tensor``; torch warns that such tensors are deprecated (pytorch issue
    184982), so the warning is silenced here, where the one use is. fbgemm is several times faster than
    ``torch._int_mm`` for one row on AVX2 CPUs without VNNI.
    Checked on torch 2.13.
    """
    if not has_fbgemm():
        return (q.t(), scale)
    zero_points = torch.zeros(q.size(0), dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(quantized, None)


def int8_matmul(x: torch.Tensor, packed: Any, step: float = 1.0) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T`` in fp32 for :func:`pack_int8`'s ``packed``, where ``x`` ``(M, K)`` (fp32)
    holds integers in ``[-INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX]``: the integer products are summed exactly
    (in int32), then scaled. With ``step`` (a Python float), ``x`` is any fp32 matrix whose magnitudes are at
    most ``INT8_ACTIVATION_MAX * step``: it is rounded to ``round(x / step)`` by the kernel and the products
    are scaled by ``step`` too (one step for the whole matrix: at batch 1, one call does what a row's rounding,
    product and scaling take five operations for). Why private: see :func:`pack_int8`. Outside ``torch.compile``
    fbgemm's operator is called as its ``_op``, the C++ operator itself: ``torch.ops.quantized.<op>`` (an
    ``OpOverloadPacket``) first looks through its arguments in Python for fake script objects (the op takes a
    torchbind object), which exist only while tracing, and a 124M decoding step makes 49 such calls. Checked on
    torch 2.13.
    """
    if isinstance(packed, tuple):
        q_t, scale = packed
        if step != 1.0:
            x = (x / step).round_()
        # Summed exactly in int32 by oneDNN's int8 GEMM (with oneDNN disabled a plain loop, much slower: int8
        # weights check that first). Why private: no public operator multiplies int8 matrices into int32
        # (``torch.matmul`` of two int8 tensors returns int8, wrapped around). Checked on torch 2.13.
        out = torch._int_mm(x.to(torch.int8), q_t).float()
        out *= scale
        if step != 1.0:
            out *= step
        return out
    operator = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    if not torch.compiler.is_compiling():
        operator = operator._op
    # fbgemm rounds x / step to quint8 with zero point 64: each value is round(x / step) + 64, in [1, 127]
    return operator(x, step, 64, packed)


# ---- Compiling the int8 twin: fbgemm's product as one operator that Dynamo does not trace into ----


def define_cpu_op(
    qualname: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any]
) -> Callable[..., torch.Tensor]:
    """Defines the CPU operator ``qualname`` (``"namespace::name"``) with ``schema`` (e.g.
    ``"(Tensor x, int key) -> Tensor"``), run by the Python function ``impl``; ``fake`` gives an empty
    result of the right shape for tracing. Returns the operator, which ``torch.compile`` puts in its graph as
    one call (``impl`` runs in eager Python at every call; the ops around it are compiled).

    Why private: ``torch.library.Library`` and ``torch.library.register_fake`` are public, but the operator
    they define is reached only as ``torch.ops.<namespace>.<name>``. Not ``torch.library.custom_op`` (public,
    callable): its dispatch cost ~15-20 us more per call than a kernel registered with ``Library.impl``, and a
    124M decoding step makes 49 calls. Checked on torch 2.13.
    """
    namespace, name = qualname.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(name + schema)
    library.impl(name, impl, "CPU")
    torch.library.register_fake(qualname, fake, lib=library)
    # the definition lives while its Library object does
    _LIBRARIES.append(library)
    return getattr(getattr(torch.ops, namespace), name).default


_LIBRARIES: list[Any] = []
