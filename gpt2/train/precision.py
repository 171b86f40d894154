"""Precision policies: one object per numeric regime of training.

``fp32`` (IEEE matmuls), ``tf32`` (TF32 tensor cores on CUDA), ``bf16`` and ``fp16`` (autocast). The weights always stay
fp32: autocast casts them inside the matmuls, once per optimizer step (:meth:`PrecisionPolicy.step_casts`), and the
optimizer updates the fp32 copy, so tiny updates are not rounded away; the loss is computed in fp32 whatever the
policy. fp16 alone needs dynamic loss scaling (``torch.amp.GradScaler``): its range (max 65,504, smallest normal
6e-5) makes gradients overflow or underflow. The scaled loss avoids underflow; ``unscale_`` runs *before* clipping
(the threshold applies to true gradients) and a step with inf/nan gradients is skipped while the scale halves (it
doubles again every 2,000 good steps).
"""

from __future__ import annotations

import contextlib
import logging
import platform
import time
from dataclasses import dataclass
from typing import ContextManager, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.errors import InvalidValueError
from gpt2.train import distributed
from gpt2.train.config import PRECISIONS

logger = logging.getLogger(__name__)

# The policies ("auto" is none: it picks one of them per device).
POLICY_NAMES = tuple(name for name in PRECISIONS if name != "auto")


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one training step computes: autocast dtype, TF32 matmuls, loss scaling."""

    name: str  # "fp32" | "tf32" | "bf16" | "fp16"
    device_type: str  # "cuda", "cpu", ...
    autocast_dtype: torch.dtype | None  # None = no autocast (fp32 / tf32)
    tf32: bool  # allow TF32 tensor-core matmuls for the fp32 matmuls that remain
    uses_scaler: bool  # dynamic loss scaling (fp16 only)

    # master weights are always fp32
    param_dtype = torch.float32

    def apply(self) -> None:
        """Set the process-wide fp32 matmul precision on CUDA (CPU matmuls stay bit-reproducible)."""
        if self.device_type == "cuda":
            set_tf32(self.tf32)

    def autocast(self) -> ContextManager:
        """The context the forward pass (and only it) runs in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def step_casts(self) -> ContextManager:
        """The context one optimizer step's micro-steps run in (their forwards in :meth:`autocast` each, and their
        backwards): under autocast, each fp32 weight is cast to the low precision once per step, at its first use,
        and not again in every micro-step.

        Autocast keeps its casts of the weights (leaf tensors that require grad) in a cache that it clears when the
        outermost autocast context exits: with one :meth:`autocast` per micro-step, every micro-step casts every
        weight again. This is an outer autocast context that is *disabled*: the cache lives until the step's last
        backward is done, while the backwards still run outside autocast, as they did. The weights do not change
        within a step (the optimizer steps after it): the same cast serves each micro-step, and the gradients are
        the same, bit for bit. (A bf16 weight cast that is kept in sync with the fp32 weights would save the same
        casts at the price of a second copy of the weights held between steps.)
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, enabled=False)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh ``GradScaler`` for fp16, else None."""
        if not self.uses_scaler:
            return None
        return torch.amp.GradScaler(self.device_type)

    def __str__(self) -> str:
        return f"{self.name} on {self.device_type}"


def set_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 tensor cores for fp32 matmuls and convolutions, process-wide.

    Only through PyTorch 2.9's ``fp32_precision`` settings: once they are set, the legacy getters
    (``matmul.allow_tf32``, ``get_float32_matmul_precision()``) raise, so gpt2 never uses those.
    """
    value = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = value
    torch.backends.cudnn.conv.fp32_precision = value


# The CPU features (as torch.cpu.get_capabilities() names them) that multiply bf16 matrices natively, and their
# names in a log line. Without one, bf16 autocast on a CPU converts and computes in fp32, slower than plain fp32.
NATIVE_BF16_FEATURES = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}


def cpu_native_bf16() -> str | None:
    """The feature with which this CPU multiplies bf16 natively ("AMX", "AVX512-BF16"), else None; read from
    ``torch.cpu.get_capabilities()`` (torch's cpuinfo, torch 2.13), None on a torch without it.
    """
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is None:
        return None
    capabilities = get_capabilities()
    for feature, name in NATIVE_BF16_FEATURES.items():
        if capabilities.get(feature):
            return name
    return None


def describe_machine(device: torch.device | str = "cpu", threads: int | None = None) -> str:
    """One line naming the machine a measurement ran on, read from the machine itself: the GPU, or
    the CPU's model and the features that decide its bf16 speed (AMX, AVX512-BF16), with torch's
    version and the intra-op thread count. Every benchmark prints it beside its numbers.
    """
    device = torch.device(device)
    if threads is None:
        threads = torch.get_num_threads()
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    capabilities = {}
    if get_capabilities is not None:
        capabilities = get_capabilities()
    name = capabilities.get("cpu_name") or platform.processor() or "unknown CPU"
    features = []
    for feature, label in NATIVE_BF16_FEATURES.items():
        if capabilities.get(feature):
            features.append(label)
        else:
            features.append(f"no {label}")
    simd = torch.backends.cpu.get_cpu_capability()
    return f"{name} ({simd}; {', '.join(features)}), torch {torch.__version__}, {threads} thread(s)"


# On a CPU with native bf16, precision="auto" picks bf16 only where the model's largest matmul runs at least this
# much faster in bf16 than in fp32 (the bf16 path has casts and fp32 work of its own that the matmul does not show).
BF16_MIN_SPEEDUP = 1.25
# The probe multiplies at most this many multiply-adds per product (~10-40 ms in fp32 on one core), and at least
# PROBE_MIN_ROWS rows, so that it costs a fraction of a second at start even for GPT-2's LM head.
PROBE_MAX_MACS = 2**30
PROBE_MIN_ROWS = 64
# timed products per precision (the fastest counts), after one untimed product each
PROBE_REPEATS = 3


class MatmulShape(NamedTuple):
    """A product ``(rows, inner) @ (inner, cols)``: the shape the bf16 probe times."""

    rows: int
    inner: int
    cols: int

    def __str__(self) -> str:
        return f"{self.rows} x {self.inner} @ {self.inner} x {self.cols}"


def probe_shape(model: nn.Module, rows: int) -> MatmulShape | None:
    """The product of ``model``'s largest ``nn.Linear`` (by weights) over ``rows`` rows (a micro-batch's tokens),
    with the rows capped so that it is at most ``PROBE_MAX_MACS`` multiply-adds; None without an ``nn.Linear``.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None
    largest = max(linears, key=lambda m: m.weight.numel())
    inner, cols = largest.in_features, largest.out_features
    rows = min(rows, max(PROBE_MIN_ROWS, PROBE_MAX_MACS // (inner * cols)))
    return MatmulShape(max(rows, 1), inner, cols)


def time_bf16_matmul(shape: MatmulShape) -> tuple[float, float]:
    """Seconds of one fp32 product of ``shape`` and of the same product under CPU bf16 autocast (its casts of the
    fp32 inputs included, as a training step's first use of a weight pays them): the fastest of
    ``PROBE_REPEATS``, the two alternating, after one untimed product each.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.rows, shape.inner, generator=generator)
    w = torch.randn(shape.cols, shape.inner, generator=generator)

    def fp32() -> None:
        F.linear(x, w)

    def bf16() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(x, w)

    best = {fp32: float("inf"), bf16: float("inf")}
    for repeat in range(PROBE_REPEATS + 1):
        for product in (fp32, bf16):
            start = time.perf_counter()
            product()
            seconds = time.perf_counter() - start
            # the first round warms the kernels and the caches up
            if repeat > 0:
                best[product] = min(best[product], seconds)
    return best[fp32], best[bf16]


def default_precision(device: torch.device | str) -> str:
    """bf16 on CUDA GPUs that support it, fp16 (with loss scaling) on older CUDA GPUs, bf16 on CPUs that multiply
    it natively (:func:`cpu_native_bf16`), else fp32: by the hardware alone (the Trainer also times the model's
    largest matmul on such CPUs: :func:`resolve_precision` with a ``shape``).
    """
    name, _ = _auto_precision(torch.device(device))
    return name


def _auto_precision(device: torch.device, shape: MatmulShape | None = None) -> tuple[str, str]:
    """What ``precision="auto"`` picks on ``device`` for a model whose largest matmul is ``shape``, and why."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "this GPU has bf16 tensor cores"
        return "fp16", "this GPU has no bf16 tensor cores (fp16, loss-scaled)"
    if device.type != "cpu":
        return "fp32", f"the default on {device.type}"
    native = cpu_native_bf16()
    if native is None:
        return "fp32", f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 matmul"
    if shape is None:
        return "bf16", f"this CPU multiplies bf16 natively ({native})"
    return _measured_cpu_precision(native, shape)


def _measured_cpu_precision(native: str, shape: MatmulShape) -> tuple[str, str]:
    """bf16 or fp32 on a CPU with native bf16 (``native``), by timing the model's largest matmul ``shape`` in both.
    With several processes, bf16 only where every one of them measured it faster (all train in one precision).
    """
    fp32_seconds, bf16_seconds = time_bf16_matmul(shape)
    speedup = fp32_seconds / max(bf16_seconds, 1e-9)
    measured = (
        f"the model's largest matmul ({shape}) ran {speedup:.2f}x as fast in bf16 "
        f"({bf16_seconds * 1e3:.2f} ms against {fp32_seconds * 1e3:.2f} ms in fp32)"
    )
    faster = int(speedup >= BF16_MIN_SPEEDUP)
    reason = f"this CPU multiplies bf16 natively ({native}) and {measured}"
    if distributed.all_reduce_min(faster) != faster:
        return "fp32", f"{reason}, but another process measured it slower"
    if faster:
        return "bf16", reason
    return "fp32", (
        f"this CPU multiplies bf16 natively ({native}), but {measured}: bf16 pays from {BF16_MIN_SPEEDUP}x "
        f"(precision='bf16' forces it)"
    )


def resolve_precision(name: str, device: torch.device | str, shape: MatmulShape | None = None) -> PrecisionPolicy:
    """The policy for ``name`` (``"auto"`` or one of :data:`POLICY_NAMES`) on ``device``; what ``"auto"`` picked,
    and why, is logged. ``shape``: the model's largest matmul (:func:`probe_shape`), which ``"auto"`` times in
    bf16 and fp32 on a CPU with native bf16; None picks bf16 there unmeasured.
    """
    device = torch.device(device)
    if name == "auto":
        name, why = _auto_precision(device, shape)
        logger.info("precision auto -> %s: %s", name, why)
    if name not in POLICY_NAMES:
        raise InvalidValueError(f"unknown precision {name!r}; choose 'auto' or one of {POLICY_NAMES}")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise InvalidValueError(
            f"precision='bf16' but {torch.cuda.get_device_name(device)} has no bf16 tensor cores "
            "(needs compute capability 8.0+, e.g. A100/RTX 30xx); use precision='fp16' (loss-scaled) or 'auto'"
        )
    if name == "tf32" and device.type != "cuda":
        logger.info("precision='tf32' only changes CUDA matmuls; on %s it is plain fp32", device.type)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    # bf16/fp16 keep TF32 on for the fp32 matmuls autocast leaves alone, as build-nanogpt does.
    return PrecisionPolicy(name, device.type, autocast_dtype, tf32=name != "fp32", uses_scaler=name == "fp16")


def inference_autocast(name: str, device: torch.device | str):
    """For sampling and evaluation: apply the policy ``name`` (``auto`` picks per device) and
    return its autocast context factory.
    """
    policy = resolve_precision(name, device)
    policy.apply()
    return policy.autocast


def check_master_weights(model: torch.nn.Module) -> None:
    """Trainable parameters must be fp32: they are the master weights that the optimizer updates
    while the policy picks the compute precision.
    """
    low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
    if low:
        raise InvalidValueError(
            f"trainable parameters must be float32 (master weights), found {low}; keep the model in fp32 "
            f"and choose the compute precision with TrainConfig.precision (e.g. 'bf16')"
        )
