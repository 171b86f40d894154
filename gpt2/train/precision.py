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
from dataclasses import dataclass
from typing import ContextManager

import torch

from gpt2 import torch_compat
from gpt2.errors import InvalidValueError
from gpt2.train.config import PRECISIONS

logger = logging.getLogger(__name__)

# The policies ("auto" is none: it picks one of them per device).
POLICY_NAMES = tuple(name for name in PRECISIONS if name != "auto")


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one training step computes: autocast dtype, TF32 matmuls, loss scaling."""

    name: str  # "fp32" | "tf32" | "bf16" | "fp16"; fp16 alone uses dynamic loss scaling
    device_type: str  # "cuda", "cpu", ...
    autocast_dtype: torch.dtype | None  # None = no autocast (fp32 / tf32)

    def apply(self) -> None:
        """Set the process-wide fp32 matmul precision on CUDA (CPU matmuls stay bit-reproducible): TF32 tensor cores
        allowed (or not) for fp32 matmuls and convolutions.

        Only through PyTorch 2.9's ``fp32_precision`` settings: once they are set, the legacy getters
        (``matmul.allow_tf32``, ``get_float32_matmul_precision()``) raise, so gpt2 never uses those.
        """
        if self.device_type == "cuda":
            # All but fp32 allow TF32 tensor cores: bf16/fp16 for the fp32 matmuls autocast leaves alone, as
            # build-nanogpt does.
            value = "ieee" if self.name == "fp32" else "tf32"
            torch.backends.cuda.matmul.fp32_precision = value
            torch.backends.cudnn.conv.fp32_precision = value

    def autocast(self) -> ContextManager:
        """The context the forward pass (and only it) runs in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def step_casts(self, micro_steps: int) -> ContextManager:
        """The context one optimizer step's ``micro_steps`` run in (their forwards in :meth:`autocast` each, and
        their backwards): under autocast with more than one micro-step, each fp32 weight is cast to the low precision
        once per step, at its first use, and not again in every micro-step.

        Autocast keeps its casts of the weights (leaf tensors that require grad) in a cache that it clears when the
        outermost autocast context exits: with one :meth:`autocast` per micro-step, every micro-step casts every
        weight again. This is an outer autocast context that is *disabled*: the cache lives until the step's last
        backward is done, while the backwards still run outside autocast, as they did. The weights do not change
        within a step (the optimizer steps after it): the same cast serves each micro-step, and the gradients are
        the same, bit for bit. (A bf16 weight cast that is kept in sync with the fp32 weights would save the same
        casts at the price of a second copy of the weights held between steps.) With one micro-step there is nothing
        to share, and no context: the backward frees each cast as it passes its layer and its gradients reuse the
        memory, where casts kept to the end of the step would make them take fresh pages (at the 124M shape, B=4,
        T=256: 130 MiB more at the peak, 45k more page faults a step).
        """
        if self.autocast_dtype is None or micro_steps == 1:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, enabled=False)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh ``GradScaler`` for fp16, else None."""
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device_type)


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
    capabilities = torch.cpu.get_capabilities()
    name = capabilities.get("cpu_name") or platform.processor() or "unknown CPU"
    features = [
        label if capabilities.get(feature) else f"no {label}"
        for feature, label in torch_compat.NATIVE_BF16_FEATURES.items()
    ]
    simd = torch.backends.cpu.get_cpu_capability()
    return f"{name} ({simd}; {', '.join(features)}), torch {torch.__version__}, {threads} thread(s)"


def auto_precision(device: torch.device | str) -> tuple[str, str]:
    """What ``precision="auto"`` trains in on ``device``, and why: by the device and the CPU's features alone
    (:func:`gpt2.torch_compat.cpu_native_bf16`), so every process and every run on one machine picks the same.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "this GPU has bf16 tensor cores"
        return "fp16", "this GPU has no bf16 tensor cores (fp16, loss-scaled)"
    if device.type != "cpu":
        return "fp32", f"the default on {device.type}"
    native = torch_compat.cpu_native_bf16()
    if native is None:
        return "fp32", f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 matmul"
    return "bf16", f"this CPU multiplies bf16 natively ({native})"


def resolve_precision(name: str, device: torch.device | str) -> PrecisionPolicy:
    """The policy for ``name`` (``"auto"`` or one of :data:`POLICY_NAMES`) on ``device``; what ``"auto"`` picked,
    and why (:func:`auto_precision`), is logged.
    """
    device = torch.device(device)
    if name == "auto":
        name, why = auto_precision(device)
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
    # the autocast dtype: None for fp32 / tf32
    return PrecisionPolicy(name, device.type, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name))


def inference_autocast(name: str, device: torch.device | str):
    """For sampling and evaluation: apply the policy ``name`` on ``device`` and return its autocast context factory.
    ``"auto"`` is fp32 on a CPU, whatever its features: decoding reads every weight at every token, and autocast
    would convert them all to bf16 each time (slower than fp32 even where bf16 multiplies natively), and fp32 gives
    the reference numbers. Elsewhere ``"auto"`` is what training picks (:func:`auto_precision`).
    """
    device = torch.device(device)
    if name == "auto" and device.type == "cpu":
        name = "fp32"
        logger.info("precision auto -> fp32: inference on a CPU runs in fp32 (--precision bf16 asks for bf16)")
    if name == "bf16" and device.type == "cpu":
        logger.warning("bf16 on a CPU: losses, scores and logits differ from fp32's in the last digits")
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
