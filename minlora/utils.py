"""minLoRA's ``minlora.utils`` helpers plus training conveniences. LoRA parameters are found by type
(those of :class:`LoRAParametrization` modules); :func:`name_is_lora` is kept for minLoRA code.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
import torch.nn as nn

from .errors import LoRAValueError
from .model import LoRASite, iter_lora_modules, require_lora, single_lora
from .parametrization import PARAM_NAMES, LoRAParametrization

logger = logging.getLogger(__name__)


def apply_to_lora(fn: Callable[[LoRAParametrization], None]) -> Callable[[nn.Module], None]:
    """Wrap ``fn`` for ``model.apply``: it is called on every :class:`LoRAParametrization`."""

    def apply(layer: nn.Module) -> None:
        if isinstance(layer, LoRAParametrization):
            fn(layer)

    return apply


class _LoRASwitch:
    """The switch is made at the call; with ``with``, every LoRA gets its previous state back on exit."""

    def __init__(self, model: nn.Module, enabled: bool) -> None:
        self.model = model
        self._previous = [(p, p.enabled) for p in iter_lora_modules(model)]
        for p, _ in self._previous:
            p.enabled = enabled

    def __enter__(self) -> nn.Module:
        return self.model

    def __exit__(self, *exc: object) -> None:
        for p, was_enabled in self._previous:
            p.enabled = was_enabled


def enable_lora(model: nn.Module) -> _LoRASwitch:
    return _LoRASwitch(model, True)


def disable_lora(model: nn.Module) -> _LoRASwitch:
    """Every LoRA off (the base model computes); ``with disable_lora(model):`` turns them back on after."""
    return _LoRASwitch(model, False)


def set_fast_path(model: nn.Module, enabled: bool = True) -> None:
    """Use (default) or bypass the fast forward; bypassed, layers read ``W + s * delta`` (same function)."""
    for p in iter_lora_modules(model):
        p.fast_path = bool(enabled)


def name_is_lora(name: str) -> bool:
    # minLoRA's test: ....parametrizations.<tensor>.<i>.lora_A
    parts = name.split(".")
    return len(parts) >= 4 and parts[-4] == "parametrizations" and parts[-1] in PARAM_NAMES


def name_is_bias(name: str) -> bool:
    return name.split(".")[-1] == "bias"


def get_params_by_name(
    model: nn.Module, print_shapes: bool = False, name_filter: Callable[[str], bool] | None = None
) -> Iterator[nn.Parameter]:
    for name, param in model.named_parameters():
        if name_filter is None or name_filter(name):
            # logged, not printed: this is library code
            if print_shapes:
                logger.info("%s %s", name, tuple(param.shape))
            yield param


def _named_lora_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every name of every LoRA parameter (a shared one under each of its names)."""
    lora = {id(getattr(m, n)) for m in iter_lora_modules(model) for n in m.param_names}
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if id(p) in lora}


def get_lora_params(model: nn.Module, print_shapes: bool = False) -> Iterator[nn.Parameter]:
    """The LoRA parameters of ``model``, a shared one once (get_params_by_name yields each once)."""
    return get_params_by_name(model, print_shapes, _named_lora_params(model).__contains__)


def get_bias_params(model: nn.Module, print_shapes: bool = False) -> Iterator[nn.Parameter]:
    return get_params_by_name(model, print_shapes=print_shapes, name_filter=name_is_bias)


def get_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA entries of ``model.state_dict()`` (``...parametrizations.weight.0.lora_A``)."""
    return {name: param.detach() for name, param in _named_lora_params(model).items()}


def load_multiple_lora(model: nn.Module, lora_state_dicts: Iterable[Mapping[str, torch.Tensor]]) -> nn.Module:
    """Load several LoRA state dicts and keep each; :func:`select_lora` switches between them. The
    last one is active afterwards (as in minLoRA).
    """
    require_lora(model, "load_multiple_lora")
    wanted = _named_lora_params(model)
    # Every dict is checked before the model changes: a bad one later in the list leaves it as it was.
    state_dicts = [dict(state_dict) for state_dict in lora_state_dicts]
    if not state_dicts:
        raise LoRAValueError("load_multiple_lora: no state dicts given; pass at least one")
    for i, state_dict in enumerate(state_dicts):
        wrong = sorted(k for k, v in state_dict.items() if k not in wanted or tuple(v.shape) != wanted[k].shape)
        if wrong:
            raise LoRAValueError(
                f"load_multiple_lora: state dict #{i} has entries that are not LoRA factors of this model (or "
                f"not of their shape), e.g. {wrong[:3]}; pass minlora.get_lora_state_dict outputs"
            )
    model.apply(apply_to_lora(LoRAParametrization.clear_stored_adapters))
    for state_dict in state_dicts:
        model.load_state_dict(state_dict, strict=False)
        model.apply(apply_to_lora(LoRAParametrization.store_adapter))
    return model


def select_lora(model: nn.Module, index: int) -> nn.Module:
    """Make adapter ``index`` (in :func:`load_multiple_lora` order) the active one, in place."""
    model.apply(apply_to_lora(lambda p: p.select_stored_adapter(index)))
    return model


def _pair(a: nn.Module, b: nn.Module, caller: str) -> tuple:
    """``(head, embedding, head's LoRA, embedding's LoRA)`` for two layers in either order (minLoRA's
    examples pass the embedding first): the embedding's LoRA has the ``fan_in_fan_out`` layout.
    """
    loras = [single_lora(LoRASite(type(layer).__name__, layer, "weight"), caller) for layer in (a, b)]
    if loras[0].fan_in_fan_out == loras[1].fan_in_fan_out:
        layout = "an embedding" if loras[0].fan_in_fan_out else "a linear"
        raise LoRAValueError(
            f"{caller} needs one layer with LoRA from from_linear (the head) and one with LoRA from from_embedding "
            f"(the embedding); both of {type(a).__name__} and {type(b).__name__} have {layout} layout"
        )
    # the linear layout (fan_in_fan_out False) first
    (head, lin), (embedding, emb) = sorted(zip((a, b), loras), key=lambda pair: pair[1].fan_in_fan_out)
    return head, embedding, lin, emb


def tie_weights(linear: nn.Module, embedding: nn.Module) -> None:
    """Share one weight *and one LoRA update* between a linear head and an embedding, in either order
    (minLoRA): the embedding's ``lora_A`` becomes the head's ``lora_B`` and vice versa. Without it,
    LoRA on GPT-2's tied head adapts the head only.
    """
    linear, embedding, lin, emb = _pair(linear, embedding, "tie_weights")
    # DoRA normalises the head's vocabulary rows but the embedding's dimensions
    if lin.use_dora or emb.use_dora:
        raise LoRAValueError(
            "tie_weights: DoRA's magnitude belongs to each layer's output channels (the head's vocabulary rows, the "
            "embedding's dimensions), so one DoRA update cannot be shared; tie plain LoRA, or keep the layers untied"
        )
    if lin.lora_B.shape != emb.lora_A.shape or lin.lora_A.shape != emb.lora_B.shape:
        raise LoRAValueError(
            f"tie_weights: the linear layer's lora_A / lora_B {tuple(lin.lora_A.shape)} / {tuple(lin.lora_B.shape)} "
            f"do not fit the embedding's {tuple(emb.lora_A.shape)} / {tuple(emb.lora_B.shape)}; the ranks and "
            f"the (vocab, dim) shapes must agree"
        )
    embedding.parametrizations["weight"].original = linear.parametrizations["weight"].original
    emb.lora_A, emb.lora_B = lin.lora_B, lin.lora_A
    emb.set_scaling(lin.lora_alpha, lin.use_rslora)


def untie_weights(linear: nn.Module, embedding: nn.Module) -> None:
    """Give the embedding its own copy of the weight and the factors (undoes :func:`tie_weights`)."""
    _, embedding, _, emb = _pair(linear, embedding, "untie_weights")
    for holder, name in ((embedding.parametrizations["weight"], "original"), (emb, "lora_A"), (emb, "lora_B")):
        old = getattr(holder, name)
        setattr(holder, name, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))


def mark_only_lora_as_trainable(model: nn.Module, bias: str = "none") -> None:
    """Freeze everything but LoRA; ``bias``: ``"none"``, ``"all"`` biases, or ``"lora_only"`` (those of LoRA layers)."""
    if bias not in ("none", "all", "lora_only"):
        raise LoRAValueError(f"mark_only_lora_as_trainable: bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    sites = require_lora(model, "mark_only_lora_as_trainable")
    trainable = list(get_lora_params(model))
    if bias == "all":
        trainable += list(get_bias_params(model))
    if bias == "lora_only":
        trainable += [s.module.bias for s in sites if isinstance(getattr(s.module, "bias", None), nn.Parameter)]
    model.requires_grad_(False)
    for param in trainable:
        param.requires_grad_(True)


class ParameterCount(NamedTuple):
    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        percent = f"{100 * self.fraction:.4f}"
        return f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {percent}"


def count_parameters(model: nn.Module) -> ParameterCount:
    """Trainable and total parameters (a shared tensor counts once); ``str()`` is a one-line summary."""
    params = list(model.parameters())
    return ParameterCount(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))
