"""The private PyTorch names gpt2 uses, in one place.

Each entry says why the public API does not do, and the torch versions it was checked on. Nothing
else in the package may name ``torch._*`` or ``torch.ops`` (``tests/test_torch_compat.py``).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
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


def is_compiled(module: Any) -> bool:
    """Whether calling ``module`` runs compiled code: ``torch.compile(module)``'s wrapper, or a module compiled
    in place by ``module.compile()``. Why private: see :func:`uncompiled`. Checked on torch 2.13.
    """
    return uncompiled(module) is not module


# ---- The CPU's features: the one place gpt2 decides anything from them ----
# The features (as torch.cpu.get_capabilities() and Linux's /proc/cpuinfo name them) that multiply bf16 matrices
# natively, and their names in a log line. Without one, bf16 on a CPU is converted to fp32 and back around fp32
# arithmetic: slower than fp32.
NATIVE_BF16_FEATURES = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}
# Overrides the CPU's answer to cpu_native_bf16(): 1 = native, 0 = emulated. The test suite runs what depends on
# it under both answers on any machine (test.sh).
NATIVE_BF16_VARIABLE = "GPT2_CPU_NATIVE_BF16"


def cpu_capabilities() -> Mapping[str, Any]:
    """This CPU's features: ``torch.cpu.get_capabilities()`` (torch's cpuinfo, torch 2.13); on a torch without it,
    the flags of Linux's /proc/cpuinfo (nothing elsewhere). Checked on torch 2.13.
    """
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        return get_capabilities()
    try:
        flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        return {}
    if flags is None:
        return {}
    return dict.fromkeys(flags.group(1).split(), True)


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
    capabilities = cpu_capabilities()
    for feature, name in NATIVE_BF16_FEATURES.items():
        if capabilities.get(feature):
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


# Activations multiplied by int8 weights are rounded to integers in [-INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX]:
# 7 bits. fbgemm adds pairs of (activation + 64) * weight products in int16 on CPUs without VNNI; with
# 8-bit activations those sums overflow (wrong results), with 7 bits (at most 2 * 127 * 127) they cannot.
INT8_ACTIVATION_MAX = 63


def has_fbgemm() -> bool:
    """Whether this torch has fbgemm's int8 matmuls (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack_int8(q: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
    """The int8 matrix ``q`` ``(N, K)`` (times ``scale`` ``(N,)`` per row, or 1) for :func:`int8_matmul`:
    fbgemm's packed layout where this torch has fbgemm, else ``q.T`` for oneDNN's int8 GEMM (then ``scale``
    is applied by :func:`int8_matmul`).

    Why private: torch's public API has no int8 x int8 matmul (see :func:`int_mm`). fbgemm's (``quantized::
    linear_prepack`` and ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``, the kernels behind
    ``torch.ao``'s dynamic quantization) take a per-channel quantized tensor, built with
    ``torch._make_per_channel_quantized_tensor``; torch warns that such tensors are deprecated (pytorch issue
    184982), so the warning is silenced here, where the one use is. fbgemm is 3-6x faster than
    ``torch._int_mm`` for one row on AVX2 CPUs without VNNI (docs/benchmarks.md, "Generation vs llama.cpp").
    Checked on torch 2.13.
    """
    if not has_fbgemm():
        return (q.t(), scale)
    if scale is None:
        scale = torch.ones(q.size(0))
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
    product and scaling take five operations for). Why private: see :func:`pack_int8`.
    """
    if isinstance(packed, tuple):
        q_t, scale = packed
        if step != 1.0:
            x = (x / step).round_()
        out = int_mm(x.to(torch.int8), q_t).float()
        if scale is not None:
            out *= scale
        if step != 1.0:
            out *= step
        return out
    # fbgemm rounds x / step to quint8 with zero point 64: each value is round(x / step) + 64, in [1, 127]
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, step, 64, packed)


# ---- Generation (issue 29): one-row int8 matmuls without the operator's Python wrapper ----


def int8_matmul_row(x: torch.Tensor, packed: Any, step: float) -> torch.Tensor:
    """:func:`int8_matmul` ``(x, packed, step=step)``, with less per-call overhead in eager mode.

    Why private: ``torch.ops.quantized.<op>`` (an ``OpOverloadPacket``) first looks through its arguments in
    Python for fake script objects (the op takes a torchbind object), which exist only while tracing; its
    ``_op`` is the C++ operator itself. A 124M decoding step makes 49 such calls. While compiling, and where
    ``packed`` is oneDNN's, this is :func:`int8_matmul`. Checked on torch 2.13.
    """
    if _INT8_LINEAR_OP is None or isinstance(packed, tuple) or torch.compiler.is_compiling():
        return int8_matmul(x, packed, step=step)
    return _INT8_LINEAR_OP(x, step, 64, packed)


_INT8_LINEAR_OP = getattr(
    getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None), "_op", None
)


def int8_linear_row(x: torch.Tensor, packed: Any, bias: torch.Tensor | None, smallest_step: float) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` for one row ``x`` ``(1, K)`` (fp32) and :func:`pack_int8`'s
    ``packed``: ``x`` is rounded to integers in ``[-INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX]`` with the step
    ``max(largest |x|, smallest_step) / INT8_ACTIVATION_MAX`` (:func:`int8_matmul` with that step), then
    ``bias`` ``(N,)`` (or None) is added.

    Why private: fbgemm's operator called from Python converts its torchbind argument (the packed weights) at
    every call. A TorchScript function (``torch.jit.script``: deprecated, it warns on torch 2.13, but still there)
    passes it in C++ and runs the few operations around the kernel in its interpreter: 12.6 against 41 us a
    call for a 64 x 64 layer, +5-9% tokens/s at 124M with int8 weights (medians of 12 and 10 paired rounds,
    the same tokens). In Python where TorchScript cannot compile it (no source files) and for oneDNN's weights.
    Checked on torch 2.13.
    """
    scripted = _scripted_linear_row()
    if scripted is None or isinstance(packed, tuple):
        if torch.jit.is_tracing():
            # the step is a Python number here: a trace would keep this call's (gpt2.model.traced_step decodes
            # eagerly when its trace fails)
            raise RuntimeError("the one-row int8 product runs in Python here, where it cannot be traced")
        step = max(float(x.abs().max()), smallest_step) / INT8_ACTIVATION_MAX
        out = int8_matmul_row(x, packed, step)
        if bias is not None:
            out += bias
        return out
    return scripted(x, packed, bias, smallest_step, float(INT8_ACTIVATION_MAX))


def _fbgemm_linear_row(
    x: torch.Tensor,
    packed: torch.classes.quantized.LinearPackedParamsBase,
    bias: torch.Tensor | None,
    smallest_step: float,
    levels: float,
) -> torch.Tensor:
    """:func:`int8_linear_row` on fbgemm's weights, for TorchScript (which reads no globals: ``levels`` is
    ``INT8_ACTIVATION_MAX``).
    """
    step = max(float(x.abs().max()), smallest_step) / levels
    # fbgemm rounds x / step to quint8 with zero point 64 (see int8_matmul)
    out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, step, 64, packed)
    if bias is not None:
        out += bias
    return out


@functools.cache
def _scripted_linear_row() -> Callable[..., torch.Tensor] | None:
    """:func:`_fbgemm_linear_row` compiled by TorchScript at the first call, or None where it cannot be."""
    if _INT8_LINEAR_OP is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(_fbgemm_linear_row)
    # TorchScript reads the function's source (absent from a zipped install) and may go in a later torch:
    # either way the Python path computes the same
    except Exception:
        return None


# ---- Compiling the int8 twin (issue 29): fbgemm's product as one operator that Dynamo does not trace into ----


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


# ---- Greedy decoding (issue 29): torch's int8 weight-only matmul for narrow LM heads ----


def has_int8_rows_matmul() -> bool:
    """Whether this torch has the kernel behind :func:`int8_rows_matmul`."""
    return hasattr(torch, "_weight_int8pack_mm")


def int8_rows_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T`` for fp32 rows ``x`` ``(M, K)``, int8 rows ``q`` ``(N, K)`` and their bf16
    ``scale`` ``(N,)``, in bf16 ``(M, N)``: ``x`` is rounded to bf16, each weight times its row's scale widened to
    fp32, the products summed in fp32 and the sums rounded to bf16. ``K`` must be a multiple of 16 (the kernels
    step through it 8 or 16 columns at a time and read past other widths: wrong sums, no error).

    Why private: torch's public API has no matmul with int8 weights. ``torch._weight_int8pack_mm`` is the CPU
    kernel behind gpt-fast's and torchao's int8 weight-only quantization: on one AVX2 thread it read the 4 x 128
    LM head (50257 x 128) in 0.7-1.0 ms against 0.9-1.2 ms for fbgemm's fp16-weight kernel. Its AVX2, AVX512
    and NEON versions and its plain loop all sum in fp32 (the narrow head's bound, in
    :mod:`gpt2.model.int8_head`, relies on it; the head also checks its logits against the bound on probe rows).
    Checked on torch 2.13.
    """
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scale)
