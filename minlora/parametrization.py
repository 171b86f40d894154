"""``LoRAParametrization``: ``W -> W + s * (B @ A)`` as a ``torch.nn.utils.parametrize`` parametrization.

Two ways to evaluate the same function:

* **The weight path** (what ``parametrize`` gives): reading ``module.weight`` calls the
  parametrization, which returns ``W + s * B @ A``. It works for any layer, composes with other
  parametrizations and with ``parametrize.cached()``, but it builds a full weight-sized tensor on
  every forward and backpropagates a weight-sized gradient into ``B @ A``.
* **The fast path**: parametrized ``nn.Linear`` / ``nn.Embedding`` modules get a ``forward`` that
  reads the frozen weight ``module.parametrizations.weight.original`` directly and adds the
  low-rank branch on the activations, ``F.linear(x, W, b) + ((drop(x) @ A^T) * s) @ B^T``, so
  neither ``W + BA`` nor its gradient is ever formed. It is used whenever the weight's only
  parametrization is one LoRA and ``parametrize.cached()`` is not active; otherwise the layer
  falls back to its ordinary forward, i.e. the weight path. The switch depends only on plain
  Python state (module structure, ``bool`` attributes), which ``torch.compile`` guards on without
  graph breaks.

State is explicit attributes (``enabled``, ``fast_path``, ``scaling``...), never lambdas, so
LoRA models ``repr``, ``deepcopy`` and pickle (``torch.save(model)``) cleanly.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ._torch_compat import inject_property, parametrize_cache_enabled

__all__ = ["LoRAParametrization", "lora_dtype_for", "check_positive_int", "check_finite_number"]


def check_positive_int(value: Any, what: str) -> int:
    """``value`` if it is an ``int`` >= 1 (``bool`` is not a number here), else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_finite_number(value: Any, what: str, *, low: float | None = None, high: float | None = None,
                        low_open: bool = False, high_open: bool = True) -> float:
    """``value`` if it is a finite real number in the given range, else ``ValueError`` naming ``what``.

    ``math.isfinite`` is the test on purpose: ``nan < 0`` is False, so a plain range check lets NaN
    through (``alpha=nan`` would make every logit NaN). ``bool`` is refused: ``True`` is not an alpha.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{what} must be in {interval}, got {value!r}")
    return value


def lora_dtype_for(weight_dtype: torch.dtype) -> torch.dtype:
    """dtype of the LoRA factors for a base weight of ``weight_dtype``.

    fp16 / bf16 bases get fp32 factors: the optimizer then updates fp32 values (small LoRA updates
    are not rounded away) and ``GradScaler`` can unscale their gradients (it refuses fp16 grads).
    fp32 / fp64 bases keep their own dtype.
    """
    if not weight_dtype.is_floating_point:
        raise TypeError(f"LoRA needs a floating-point weight, got dtype {weight_dtype}")
    return torch.promote_types(weight_dtype, torch.float32)


class LoRAParametrization(nn.Module):
    """Low-rank update of a weight: ``forward(W) = W + scaling * delta`` (minLoRA's class).

    ``fan_in_fan_out=False`` (``nn.Linear``, ``nn.Conv2d``): ``lora_A`` is ``(rank, fan_in)``,
    ``lora_B`` is ``(fan_out, rank)`` and ``delta = B @ A`` has the ``(out, in)`` layout of the weight.
    ``fan_in_fan_out=True`` (``nn.Embedding``, weight ``(num_embeddings, dim)``): ``lora_A`` is
    ``(fan_in, rank)``, ``lora_B`` is ``(rank, fan_out)`` and ``delta = A @ B``. This layout lets
    :func:`minlora.tie_weights` share one update between a linear head and an embedding.

    ``B`` starts at zero, so adding LoRA does not change the model; ``A`` uses ``nn.Linear``'s
    default (Kaiming-uniform) initialisation as in minLoRA and PEFT. ``scaling = lora_alpha / rank``
    (``lora_alpha / sqrt(rank)`` with ``use_rslora``, rank-stabilised LoRA).
    """

    def __init__(
        self,
        fan_in: int,
        fan_out: int,
        fan_in_fan_out: bool = False,
        rank: int = 4,
        lora_dropout_p: float = 0.0,
        lora_alpha: float = 1,
        *,
        use_rslora: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("fan_in", fan_in), ("fan_out", fan_out), ("rank", rank)):
            check_positive_int(value, f"LoRAParametrization: {name}")
        check_finite_number(lora_dropout_p, "LoRAParametrization: lora_dropout_p", low=0.0, high=1.0)
        # alpha may be negative in principle (it only scales B @ A) but never NaN / inf or zero
        # (zero silently turns the adapter off).
        check_finite_number(lora_alpha, "LoRAParametrization: lora_alpha")
        if lora_alpha == 0:
            raise ValueError("LoRAParametrization: lora_alpha must not be 0 (the adapter would do nothing)")
        self.fan_in = fan_in
        self.fan_out = fan_out
        self.fan_in_fan_out = bool(fan_in_fan_out)
        self.rank = rank
        self.lora_alpha = lora_alpha
        self.use_rslora = bool(use_rslora)
        self.scaling = self.compute_scaling(lora_alpha, rank, self.use_rslora)
        self.lora_dropout_p = float(lora_dropout_p)
        self.enabled = True  # False: the parametrization is the identity (see disable_lora)
        self.fast_path = True  # False: layers use the weight path even where the fast one applies
        a_shape = (fan_in, rank) if self.fan_in_fan_out else (rank, fan_in)
        b_shape = (rank, fan_out) if self.fan_in_fan_out else (fan_out, rank)
        self.lora_A = nn.Parameter(torch.empty(a_shape))
        self.lora_B = nn.Parameter(torch.zeros(b_shape))
        # a=sqrt(5) is nn.Linear's default init (uniform with bound 1/sqrt(fan)), as in minLoRA/PEFT.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self._num_stored = 0  # adapters kept by load_multiple_lora (non-persistent buffers)

    # ------------------------------------------------------------------ constructors (minLoRA)
    @classmethod
    def from_linear(cls, layer: nn.Module, rank: int = 4, lora_dropout_p: float = 0.0, lora_alpha: float = 1,
                    **kwargs: Any) -> "LoRAParametrization":
        fan_out, fan_in = _weight_of(layer).shape
        return cls(fan_in, fan_out, fan_in_fan_out=False, rank=rank, lora_dropout_p=lora_dropout_p,
                   lora_alpha=lora_alpha, **kwargs)

    @classmethod
    def from_conv2d(cls, layer: nn.Module, rank: int = 4, lora_dropout_p: float = 0.0, lora_alpha: float = 1,
                    **kwargs: Any) -> "LoRAParametrization":
        weight = _weight_of(layer)
        fan_out, fan_in = weight.reshape(weight.shape[0], -1).shape  # (out, in * kh * kw)
        return cls(fan_in, fan_out, fan_in_fan_out=False, rank=rank, lora_dropout_p=lora_dropout_p,
                   lora_alpha=lora_alpha, **kwargs)

    @classmethod
    def from_embedding(cls, layer: nn.Module, rank: int = 4, lora_dropout_p: float = 0.0, lora_alpha: float = 1,
                       **kwargs: Any) -> "LoRAParametrization":
        fan_in, fan_out = _weight_of(layer).shape  # (num_embeddings, embedding_dim)
        return cls(fan_in, fan_out, fan_in_fan_out=True, rank=rank, lora_dropout_p=lora_dropout_p,
                   lora_alpha=lora_alpha, **kwargs)

    @staticmethod
    def compute_scaling(lora_alpha: float, rank: int, use_rslora: bool = False) -> float:
        return lora_alpha / (math.sqrt(rank) if use_rslora else rank)

    # ------------------------------------------------------------------ the weight path
    def delta_weight(self, dropout: bool = False) -> torch.Tensor:
        """``scaling * delta`` as a 2-D tensor in the layer's layout, in the LoRA dtype.

        With ``dropout`` (training through the weight path) minLoRA's trick is used: one dropout
        mask over the input features, shared by the whole batch, is folded into ``A``. The fast
        path instead drops the input activations themselves, as in the LoRA paper.
        """
        A, B = self.lora_A, self.lora_B
        if dropout and self.lora_dropout_p > 0:
            mask_shape = (A.shape[0], 1) if self.fan_in_fan_out else (1, A.shape[1])  # one per input feature
            A = A * F.dropout(A.new_ones(mask_shape), self.lora_dropout_p, training=True)
        delta = A @ B if self.fan_in_fan_out else B @ A
        return delta * self.scaling

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return X
        delta = self.delta_weight(dropout=self.training).view(X.shape)  # conv: (out, in, kh, kw)
        if delta.dtype == X.dtype:
            return X + delta
        # Low-precision base: add in the (fp32) LoRA dtype, then cast back; parametrize requires
        # the parametrized tensor to keep the weight's dtype.
        return (X.to(delta.dtype) + delta).to(X.dtype)

    @torch.no_grad()
    def merged(self, X: torch.Tensor) -> torch.Tensor:
        """``X + scaling * delta`` computed in fp32 (or better), without dropout; ``X``'s dtype kept."""
        if not self.enabled:
            return X.clone()
        compute = torch.promote_types(torch.promote_types(X.dtype, self.lora_A.dtype), torch.float32)
        A, B = self.lora_A.to(compute), self.lora_B.to(compute)
        # an enclosing autocast would run this matmul in bf16/fp16: merging must stay in fp32
        no_autocast = (torch.autocast(X.device.type, enabled=False) if X.device.type in ("cpu", "cuda")
                       else contextlib.nullcontext())
        with no_autocast:
            delta = (A @ B if self.fan_in_fan_out else B @ A) * self.scaling
        return (X.to(compute) + delta.view(X.shape)).to(X.dtype)

    # ------------------------------------------------------------------ the fast path branches
    def linear_branch(self, x: torch.Tensor) -> torch.Tensor:
        """``((dropout(x) @ A^T) * scaling) @ B^T`` for ``x`` ``(..., fan_in)`` -> ``(..., fan_out)``."""
        A, B = self.lora_A, self.lora_B
        if A.dtype != x.dtype:
            # fp32 factors on a low-precision base: compute the branch in the activations' dtype,
            # as autocast would; the casts are differentiable, so A and B still get fp32 grads.
            A, B = A.to(x.dtype), B.to(x.dtype)
        if self.training and self.lora_dropout_p > 0:
            x = F.dropout(x, self.lora_dropout_p, training=True)
        # Scaling the rank-r intermediate costs r / fan_out of scaling the output.
        return F.linear(F.linear(x, A) * self.scaling, B)  # (..., r) -> (..., fan_out)

    def embedding_branch(self, idx: torch.Tensor, dtype: torch.dtype, padding_idx: int | None = None) -> torch.Tensor:
        """``scaling * (A[idx] @ B)`` for token ids ``idx`` -> ``(*idx.shape, fan_out)`` in ``dtype``."""
        A, B = self.lora_A, self.lora_B
        if A.dtype != dtype:
            A, B = A.to(dtype), B.to(dtype)
        after_a = F.embedding(idx, A, padding_idx=padding_idx)  # (..., r)
        if self.training and self.lora_dropout_p > 0:
            # The input of an embedding is a one-hot vector; dropping it drops the whole token's
            # LoRA contribution (scaled by 1 / (1 - p)), one draw per position.
            keep = F.dropout(after_a.new_ones(idx.shape + (1,)), self.lora_dropout_p, training=True)
            after_a = after_a * keep
        return (after_a * self.scaling) @ B  # (..., fan_out)

    # ------------------------------------------------------------------ minLoRA methods
    def enable_lora(self) -> None:
        self.enabled = True

    def disable_lora(self) -> None:
        self.enabled = False

    def set_scaling(self, lora_alpha: float, use_rslora: bool | None = None) -> None:
        check_finite_number(lora_alpha, "set_scaling: lora_alpha")
        if use_rslora is not None:
            self.use_rslora = bool(use_rslora)
        self.lora_alpha = lora_alpha
        self.scaling = self.compute_scaling(lora_alpha, self.rank, self.use_rslora)

    # Several adapters kept side by side (load_multiple_lora / select_lora). They are
    # non-persistent buffers: they follow .to() / .half() with the module but stay out of state_dict.
    def store_adapter(self) -> int:
        i = self._num_stored
        self.register_buffer(f"stored_lora_A_{i}", self.lora_A.detach().clone(), persistent=False)
        self.register_buffer(f"stored_lora_B_{i}", self.lora_B.detach().clone(), persistent=False)
        self._num_stored += 1
        return i

    def clear_stored_adapters(self) -> None:
        for i in range(self._num_stored):
            delattr(self, f"stored_lora_A_{i}")
            delattr(self, f"stored_lora_B_{i}")
        self._num_stored = 0

    @torch.no_grad()
    def select_stored_adapter(self, index: int) -> None:
        if not -self._num_stored <= index < self._num_stored:
            raise IndexError(
                f"select_lora: adapter index {index} out of range; {self._num_stored} adapter(s) were "
                f"loaded with load_multiple_lora"
            )
        index %= self._num_stored
        self.lora_A.copy_(getattr(self, f"stored_lora_A_{index}"))
        self.lora_B.copy_(getattr(self, f"stored_lora_B_{index}"))

    @property
    def lora_As(self) -> list[torch.Tensor]:
        return [getattr(self, f"stored_lora_A_{i}") for i in range(self._num_stored)]

    @property
    def lora_Bs(self) -> list[torch.Tensor]:
        return [getattr(self, f"stored_lora_B_{i}") for i in range(self._num_stored)]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        # minLoRA kept a persistent all-ones `lora_dropout_mask` buffer; accept (and ignore) it so
        # full state dicts saved from minLoRA models still load with strict=True.
        state_dict.pop(prefix + "lora_dropout_mask", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"fan_in={self.fan_in}, fan_out={self.fan_out}, rank={self.rank}, lora_alpha={self.lora_alpha}, "
            f"scaling={self.scaling:g}, dropout={self.lora_dropout_p}, fan_in_fan_out={self.fan_in_fan_out}, "
            f"use_rslora={self.use_rslora}, enabled={self.enabled}"
        )


def _weight_of(layer: nn.Module) -> torch.Tensor:
    if parametrize.is_parametrized(layer, "weight"):
        return layer.parametrizations["weight"].original
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(layer).__name__} has no weight tensor to put LoRA on")
    return weight


# ---------------------------------------------------------------------- the fast forward
def _fast_lora(module: nn.Module, fan_in_fan_out: bool) -> LoRAParametrization | None:
    """The LoRA the fast path may use, or None when the layer must run its ordinary forward."""
    if parametrize_cache_enabled():  # inside parametrize.cached(): use the cached merged weight
        return None
    if "weight" not in module.parametrizations:
        return None
    plist = module.parametrizations["weight"]
    if len(plist) != 1:  # stacked with another parametrization: only the weight path composes
        return None
    lora = plist[0]
    if not isinstance(lora, LoRAParametrization) or not lora.fast_path or lora.fan_in_fan_out != fan_in_fan_out:
        return None
    return lora


def _lora_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    lora = _fast_lora(self, fan_in_fan_out=False)
    if lora is None:
        return nn.Linear.forward(self, input)
    out = F.linear(input, self.parametrizations["weight"].original, self.bias)
    if lora.enabled:
        out = out + lora.linear_branch(input)
    return out


def _lora_embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    lora = _fast_lora(self, fan_in_fan_out=True)
    if lora is None or self.max_norm is not None:  # max_norm renormalises the weight in place
        return nn.Embedding.forward(self, input)
    weight = self.parametrizations["weight"].original
    out = F.embedding(input, weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse)
    if lora.enabled:
        out = out + lora.embedding_branch(input, out.dtype, self.padding_idx)
    return out


# Only layers whose forward is exactly the stock one get the fast path; a subclass with its own
# forward keeps it (and the weight path).
_FAST_FORWARDS = {nn.Linear.forward: _lora_linear_forward, nn.Embedding.forward: _lora_embedding_forward}


# ---------------------------------------------------------------------- the parametrized class
# torch.nn.utils.parametrize swaps a parametrized module's class for a generated subclass that
# holds the `weight` property. We swap it once more for a subclass of our own which adds the fast
# forward and makes the module deepcopy / pickle properly: torch's generated class refuses pickling,
# and its deepcopy shares the generated class between original and copy, so removing a
# parametrization from one deletes the property of the other.
def _lora_class(base: type) -> type:
    """A fresh ``Parametrized<Base>`` class (one per module: properties live on the class)."""
    dct: dict[str, Any] = {
        "_minlora_base": base,
        "__deepcopy__": _deepcopy_parametrized,
        "__reduce_ex__": _reduce_parametrized,
    }
    fast_forward = _FAST_FORWARDS.get(getattr(base, "forward", None))
    if fast_forward is not None:
        dct["forward"] = fast_forward
    return type(f"Parametrized{base.__name__}", (base,), dct)


def install_lora_class(module: nn.Module, base: type | None = None) -> None:
    """Give the parametrized ``module`` a class of its own with LoRA's forward; idempotent."""
    if base is None:
        if "_minlora_base" in type(module).__dict__:
            return
        base = parametrize.type_before_parametrizations(module)
    module.__class__ = _lora_class(base)
    for tensor_name in module.parametrizations.keys():
        inject_property(module, tensor_name)


def _deepcopy_parametrized(self: nn.Module, memo: dict) -> nn.Module:
    existing = memo.get(id(self))
    if existing is not None:
        return existing
    base = type(self)._minlora_base
    replica = base.__new__(base)
    memo[id(self)] = replica
    replica.__dict__ = copy.deepcopy(self.__dict__, memo)
    install_lora_class(replica, base)
    return replica


def _reduce_parametrized(self: nn.Module, protocol: int) -> tuple:
    base = type(self)._minlora_base
    return (_rebuild_parametrized, (base, tuple(self.parametrizations.keys())), self.__dict__)


def _rebuild_parametrized(base: type, tensor_names: tuple[str, ...]) -> nn.Module:
    """Unpickling: an empty module of a fresh LoRA class; pickle then restores its ``__dict__``."""
    module = base.__new__(base)
    module.__class__ = _lora_class(base)
    for tensor_name in tensor_names:
        inject_property(module, tensor_name)
    return module
