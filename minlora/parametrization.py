"""``LoRAParametrization`` (``W -> W + s * B @ A``, or DoRA). The *weight path* is plain ``parametrize``
(reading ``module.weight`` builds the adapted weight); the *fast path*, a ``forward`` for parametrized
``nn.Linear`` / ``nn.Embedding``, adds the low-rank branch on the activations: no weight-sized gradient.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ._torch_compat import inject_property, parametrize_cache_enabled
from .errors import LoRAIndexError, LoRATypeError, LoRAValueError

# the last one DoRA's only
PARAM_NAMES = ("lora_A", "lora_B", "lora_magnitude_vector")
# the factors a LoRA holds, by use_dora
FACTOR_NAMES = {False: PARAM_NAMES[:2], True: PARAM_NAMES}


def check_int(value: Any, what: str) -> None:
    # True is an int to Python, but not a rank
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoRAValueError(f"{what} must be a positive integer, got {value!r}")


def check_float(value: Any, what: str, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> None:
    """A finite number in ``[low, high)`` (``(low, high)`` with ``low_open``), else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoRAValueError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    # before the range: nan < 0 is False, so a range check alone lets NaN through
    if not math.isfinite(value):
        raise LoRAValueError(f"{what} must be a finite number, got {value!r}")
    too_low = value < low or (low_open and value == low)
    if too_low or value >= high:
        opening = "(" if low_open else "["
        raise LoRAValueError(f"{what} must be in {opening}{low:g}, {high:g}), got {value!r}")


def raw_weight(module: nn.Module, tensor_name: str = "weight") -> torch.Tensor | None:
    """The stored ``module.<tensor_name>`` parameter (the original under a parametrization), or None."""
    if parametrize.is_parametrized(module, tensor_name):
        # weight_norm keeps two tensors and no `original`: None
        return getattr(module.parametrizations[tensor_name], "original", None)
    weight = getattr(module, tensor_name, None)
    if isinstance(weight, nn.Parameter):
        return weight
    return None


def _weight_of(layer: nn.Module) -> torch.Tensor:
    weight = raw_weight(layer)
    if weight is None or not weight.is_floating_point():
        raise LoRATypeError(f"{type(layer).__name__} has no floating-point weight parameter to put LoRA on")
    return weight


class LoRAParametrization(nn.Module):
    """``forward(W) = W + scaling * delta`` (minLoRA's class), ``scaling = lora_alpha / rank``
    (``/ sqrt(rank)`` with ``use_rslora``), ``B`` zero at the start, ``A`` with ``nn.Linear``'s init.

    Linear / conv layout: ``A`` ``(rank, fan_in)``, ``B`` ``(fan_out, rank)``, ``delta = B @ A``.
    ``fan_in_fan_out`` (embeddings, weight ``(num_embeddings, dim)``): ``A`` ``(fan_in, rank)``, ``B``
    ``(rank, fan_out)``, ``delta = A @ B``, so :func:`minlora.tie_weights` can share one update.
    ``use_dora`` (Liu et al. 2024, computed as PEFT does): ``m * V / ||V||_c`` with ``V = W + scaling * delta``,
    ``||V||_c`` each output channel's norm (a constant for backprop), ``m`` the learned ``lora_magnitude_vector``,
    starting at ``||W||_c``.
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
        use_dora: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("fan_in", fan_in), ("fan_out", fan_out), ("rank", rank)):
            check_int(value, f"LoRAParametrization: {name}")
        check_float(lora_dropout_p, "LoRAParametrization: lora_dropout_p", low=0.0, high=1.0)
        # a negative alpha only flips the update, but zero would silently switch the adapter off (set_scaling checks
        # the rest)
        if lora_alpha == 0:
            raise LoRAValueError("LoRAParametrization: lora_alpha must not be 0 (the adapter would do nothing)")
        self.fan_in = fan_in
        self.fan_out = fan_out
        self.fan_in_fan_out = bool(fan_in_fan_out)
        self.rank = rank
        self.lora_dropout_p = float(lora_dropout_p)
        self.use_dora = bool(use_dora)
        # the constructor's None is rsLoRA off (set_scaling's None keeps the setting, and there is none yet)
        self.set_scaling(lora_alpha, bool(use_rslora))
        # False: the identity (disable_lora)
        self.enabled = True
        # False: always the weight path (set_fast_path)
        self.fast_path = True
        if self.fan_in_fan_out:
            a_shape, b_shape = (fan_in, rank), (rank, fan_out)
        else:
            a_shape, b_shape = (rank, fan_in), (fan_out, rank)
        self.lora_A = nn.Parameter(torch.empty(a_shape))
        self.lora_B = nn.Parameter(torch.zeros(b_shape))
        # nn.Linear's default init, as minLoRA and PEFT
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        if self.use_dora:
            # set from the weight by init_magnitude
            self.lora_magnitude_vector = nn.Parameter(torch.ones(fan_out))
        # how many adapters load_multiple_lora keeps in buffers
        self._num_stored = 0

    # positional settings after the layer: rank, lora_dropout_p, lora_alpha (minLoRA's order)
    @classmethod
    def from_linear(cls, layer: nn.Module, *args: Any, **kwargs: Any) -> LoRAParametrization:
        # the weight is (out, in), a convolution's (out, in, kh, kw): the update is (out, in * kh * kw)
        weight = _weight_of(layer)
        return cls(weight[0].numel(), weight.shape[0], False, *args, **kwargs)

    # one rule for both layouts
    from_conv2d = from_linear

    @classmethod
    def from_embedding(cls, layer: nn.Module, *args: Any, **kwargs: Any) -> LoRAParametrization:
        fan_in, fan_out = _weight_of(layer).shape  # (num_embeddings, dim)
        return cls(fan_in, fan_out, True, *args, **kwargs)

    def set_scaling(self, lora_alpha: float, use_rslora: bool | None = None) -> None:
        """``scaling = lora_alpha / rank`` (``/ sqrt(rank)`` with rsLoRA); ``use_rslora=None`` keeps the setting."""
        check_float(lora_alpha, "LoRAParametrization: lora_alpha")
        if use_rslora is not None:
            self.use_rslora = bool(use_rslora)
        self.lora_alpha = lora_alpha
        divisor = math.sqrt(self.rank) if self.use_rslora else self.rank
        self.scaling = lora_alpha / divisor

    @property
    def param_names(self) -> tuple[str, ...]:
        return FACTOR_NAMES[self.use_dora]

    @property
    def norm_dim(self) -> int:
        """The weight dimension DoRA's per-output-channel norm runs over (the input one)."""
        if self.fan_in_fan_out:
            return 0
        return 1

    def enable_lora(self) -> None:
        self.enabled = True

    def disable_lora(self) -> None:
        self.enabled = False

    # ------------------------------------------------------------------ the weight path
    def delta_weight(self, A: torch.Tensor | None = None) -> torch.Tensor:
        """``scaling * delta``, 2-D in the layer's layout."""
        if A is None:
            A = self.lora_A
        if self.fan_in_fan_out:
            return (A @ self.lora_B) * self.scaling
        return (self.lora_B @ A) * self.scaling

    def dora_scale(self, W: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``m / ||W + delta||_c`` per output channel, for the 2-D weight and ``scaling * delta``."""
        # PEFT (and the paper, sec. 4.3) treat the norm as a constant: no gradient flows through it.
        norm = torch.linalg.norm((W + delta).detach(), dim=self.norm_dim)
        # A zero channel stays zero whatever it is scaled by; PEFT would divide 0 by 0 there (NaN).
        return self.lora_magnitude_vector / torch.where(norm == 0, torch.ones_like(norm), norm)

    @torch.no_grad()
    def init_magnitude(self, W: torch.Tensor) -> None:
        """DoRA's ``m = ||W + scaling * delta||_c`` (``||W||_c`` while ``B`` is zero), as PEFT starts it."""
        delta = self.delta_weight()
        W = W.to(delta.dtype).reshape(delta.shape)
        self.lora_magnitude_vector.copy_(torch.linalg.norm(W + delta, dim=self.norm_dim))

    def _adapt(self, X: torch.Tensor, dropout: bool) -> torch.Tensor:
        A = self.lora_A
        if dropout and self.lora_dropout_p > 0:
            # minLoRA's trick: one mask over the input features (A's norm_dim, as the weight's), shared by the
            # batch, folded into A (the fast path drops the activations themselves, as in the LoRA paper).
            mask = F.dropout(A.new_ones(A.shape[self.norm_dim]), self.lora_dropout_p, training=True)
            A = A * mask.unsqueeze(1 - self.norm_dim)
        delta = self.delta_weight(A)
        # Add in the (fp32) LoRA dtype, then cast back: parametrize needs the weight's dtype kept.
        # A conv weight is seen as (out, in * kh * kw).
        W = X.to(torch.promote_types(delta.dtype, X.dtype)).reshape(delta.shape)
        out = W + delta
        if self.use_dora:
            # the norm is that of the whole update, as PEFT's, whatever dropout did to A
            if A is not self.lora_A:
                delta = self.delta_weight()
            # one scale per output channel, broadcast along the dimension the norm ran over
            out = out * self.dora_scale(W, delta).unsqueeze(self.norm_dim)
        return out.reshape(X.shape).to(X.dtype)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return X
        return self._adapt(X, dropout=self.training)

    @torch.no_grad()
    def merged(self, X: torch.Tensor) -> torch.Tensor:
        """``forward(X)`` without dropout, computed in fp32 or better (never under autocast); ``X``'s dtype kept."""
        if not self.enabled:
            return X.clone()
        no_autocast = contextlib.nullcontext()
        if X.device.type in ("cpu", "cuda"):
            no_autocast = torch.autocast(X.device.type, enabled=False)
        with no_autocast:
            return self._adapt(X.to(torch.promote_types(X.dtype, torch.float32)), dropout=False).to(X.dtype)

    # ------------------------------------------------------------------ the fast path
    def fast_linear(self, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, forward(W), bias)`` without forming ``forward(W)`` (an enabled LoRA: see _fast_path_lora)."""
        # fp32 factors on a low-precision base: the branch runs in the activations' dtype, as under
        # autocast; the casts are differentiable, so the factors still get fp32 gradients.
        A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        dropped = x
        if self.training and self.lora_dropout_p > 0:
            dropped = F.dropout(x, self.lora_dropout_p, training=True)
        # scaling the rank-r intermediate is cheaper than scaling the output
        after_a = F.linear(dropped, A) * self.scaling
        if not self.use_dora:
            # in 2-D, so B's product is added into the base output in place (no temporary)
            out = F.linear(x.reshape(-1, x.size(-1)), W, bias)
            out.addmm_(after_a.reshape(-1, A.size(0)).to(out.dtype), B.T.to(out.dtype))
            return out.view(*x.shape[:-1], -1)
        out = F.linear(x, W, bias)
        lora = F.linear(after_a, B)
        # PEFT's DoRA forward: out + (m / ||V||_c - 1) * (x W^T) + m / ||V||_c * lora, where x W^T
        # (no bias) is recomputed on the dropped input when dropout is on. The norm needs W + s * B @ A,
        # a weight-sized tensor as in PEFT, but no weight-sized gradient.
        scale = self.dora_scale(W, self.delta_weight()).to(out.dtype)
        if dropped is not x:
            base = F.linear(dropped, W)
        elif bias is None:
            base = out
        else:
            base = out - bias
        return out + (scale - 1) * base + scale * lora

    def fast_embedding(self, idx: torch.Tensor, W: torch.Tensor, layer: nn.Embedding) -> torch.Tensor:
        out = F.embedding(idx, W, layer.padding_idx, None, layer.norm_type, layer.scale_grad_by_freq, layer.sparse)
        after_a = F.embedding(idx, self.lora_A.to(out.dtype))  # (..., r)
        if self.training and self.lora_dropout_p > 0:
            # the input is one-hot: dropout drops the token's whole update
            after_a = after_a * F.dropout(after_a.new_ones(idx.shape + (1,)), self.lora_dropout_p, training=True)
        lora = (after_a * self.scaling) @ self.lora_B.to(out.dtype)
        if not self.use_dora:
            return out + lora
        # PEFT's DoRA embedding: m / ||V||_c * (embedding + lora), the norm per embedding dimension
        return self.dora_scale(W, self.delta_weight()).to(out.dtype) * (out + lora)

    # ------------------------------------------------------------------ several adapters
    # load_multiple_lora keeps each adapter in non-persistent buffers: they follow .to() with the
    # module but stay out of state_dict.
    def store_adapter(self) -> None:
        for name in self.param_names:
            value = getattr(self, name).detach().clone()
            self.register_buffer(f"stored_{name}_{self._num_stored}", value, persistent=False)
        self._num_stored += 1

    def clear_stored_adapters(self) -> None:
        for i in range(self._num_stored):
            for name in self.param_names:
                delattr(self, f"stored_{name}_{i}")
        self._num_stored = 0

    @torch.no_grad()
    def select_stored_adapter(self, index: int) -> None:
        if not -self._num_stored <= index < self._num_stored:
            raise LoRAIndexError(
                f"select_lora: adapter index {index} out of range; {self._num_stored} adapter(s) were "
                f"loaded with load_multiple_lora"
            )
        # copied in place: an optimizer keeps pointing at the parameters
        for name in self.param_names:
            getattr(self, name).copy_(getattr(self, f"stored_{name}_{index % self._num_stored}"))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        # minLoRA's persistent all-ones `lora_dropout_mask`: ignored, so its state dicts load strictly
        state_dict.pop(prefix + "lora_dropout_mask", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in vars(self).items() if not k.startswith("_") and k != "training")


# ---------------------------------------------------------------------- the fast forward
def _fast_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The ``forward`` of a stock ``nn.Linear`` / ``nn.Embedding`` with LoRA: the fast path, unless the
    weight carries more than one LoRA or we are inside ``parametrize.cached()`` (only the weight path
    composes with those) or an embedding renormalises its weight in place (``max_norm``) or treats rows'
    gradients apart (``scale_grad_by_freq``, ``padding_idx``: PEFT's fast form differs there).
    """
    embedding = isinstance(self, nn.Embedding)
    lora = _fast_path_lora(self, embedding)
    if lora is None:
        if embedding and self.sparse:
            # the merged weight's gradient must be dense to reach A and B
            return F.embedding(
                input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
            )
        return type(self)._minlora_base.forward(self, input)
    W = self.parametrizations["weight"].original
    if embedding:
        return lora.fast_embedding(input, W, self)
    return lora.fast_linear(input, W, self.bias)


def _fast_path_lora(module: nn.Module, embedding: bool) -> LoRAParametrization | None:
    """The weight's one LoRA when the fast path may run it, else None (see :func:`_fast_forward`)."""
    # no weight parametrization reads as an empty list (LoRA on another tensor)
    plist = getattr(module.parametrizations, "weight", ())
    if len(plist) != 1:
        return None
    lora = plist[0]
    if not isinstance(lora, LoRAParametrization) or not lora.fast_path or lora.fan_in_fan_out != embedding:
        return None
    # a disabled LoRA's forward is the identity: the weight path reads W itself
    if parametrize_cache_enabled() or not lora.enabled:
        return None
    if embedding and (module.max_norm is not None or module.scale_grad_by_freq or module.padding_idx is not None):
        return None
    return lora


# ---------------------------------------------------------------------- the parametrized class
# parametrize swaps a parametrized module's class for a generated subclass holding the `weight` property. We swap it
# once more for a class of our own, which adds the fast forward and makes the module deepcopy and pickle (deepcopy goes
# through __reduce_ex__ too): torch's class refuses pickling, and its deepcopy shares the class between original and
# copy, so removing a parametrization from one deletes the other's property.
def _lora_class(base: type, module: nn.Module, tensor_names) -> nn.Module:
    dct: dict[str, Any] = {"_minlora_base": base, "__reduce_ex__": _reduce}
    # a subclass's own forward is kept
    if getattr(base, "forward", None) in (nn.Linear.forward, nn.Embedding.forward):
        dct["forward"] = _fast_forward
    module.__class__ = type(f"Parametrized{base.__name__}", (base,), dct)
    for tensor_name in tensor_names:
        inject_property(module, tensor_name)
    return module


def install_lora_class(module: nn.Module) -> None:
    """Give the parametrized ``module`` a class of its own (one per module: properties live on it)."""
    if "_minlora_base" not in type(module).__dict__:
        _lora_class(parametrize.type_before_parametrizations(module), module, module.parametrizations.keys())


def _reduce(self: nn.Module, protocol: int) -> tuple:
    return _rebuild_parametrized, (type(self)._minlora_base, tuple(self.parametrizations.keys())), self.__dict__


def _rebuild_parametrized(base: type, tensor_names: tuple[str, ...]) -> nn.Module:
    """Unpickling: an empty module of a fresh LoRA class; pickle then restores its ``__dict__``."""
    return _lora_class(base, base.__new__(base), tensor_names)
