"""Helpers over a LoRA model: minLoRA's ``minlora.utils`` API plus training conveniences.

LoRA parameters are found by type (the parameters of :class:`LoRAParametrization` modules), not by
words in dotted names; :func:`name_is_lora` is kept for minLoRA code that filters names itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from .model import iter_lora_modules, lora_sites
from .parametrization import LoRAParametrization

logger = logging.getLogger(__name__)


def apply_to_lora(fn: Callable[[LoRAParametrization], None]) -> Callable[[nn.Module], None]:
    """Wrap ``fn`` for ``model.apply``: it is called on every :class:`LoRAParametrization`."""
    return lambda layer: fn(layer) if isinstance(layer, LoRAParametrization) else None


class _LoRASwitch:
    """The switch is made at the call; used with ``with``, every LoRA gets its previous state back on exit."""

    def __init__(self, model: nn.Module, enabled: bool) -> None:
        self.model, self._previous = model, [(p, p.enabled) for p in iter_lora_modules(model)]
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
    """Every LoRA off (the base model computes); ``with disable_lora(model): ...`` turns them back on after."""
    return _LoRASwitch(model, False)


def set_fast_path(model: nn.Module, enabled: bool = True) -> None:
    """Use (default) or bypass the fast forward; bypassed, layers read ``W + s * delta`` (same function)."""
    for p in iter_lora_modules(model):
        p.fast_path = bool(enabled)


# ---------------------------------------------------------------------- parameters and state
_LORA_NAMES = ("lora_A", "lora_B", "lora_magnitude_vector")


def name_is_lora(name: str) -> bool:
    """minLoRA's name test: ``....parametrizations.<tensor>.<i>.lora_A`` / ``lora_B`` (/ DoRA's magnitude)."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-4] == "parametrizations" and parts[-1] in _LORA_NAMES


def name_is_bias(name: str) -> bool:
    return name.split(".")[-1] == "bias"


def get_params_by_name(model: nn.Module, print_shapes: bool = False,
                       name_filter: Callable[[str], bool] | None = None) -> Iterator[nn.Parameter]:
    for name, param in model.named_parameters():
        if name_filter is None or name_filter(name):
            if print_shapes:  # a log line, not a print, in library code
                logger.info("%s %s", name, tuple(param.shape))
            yield param


def _lora_named_params(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=remove_duplicate):
        if isinstance(module, LoRAParametrization):
            for pname in module.param_names:
                param = getattr(module, pname)
                if not remove_duplicate or id(param) not in seen:
                    seen.add(id(param))
                    yield (f"{module_name}.{pname}" if module_name else pname), param


def get_lora_params(model: nn.Module, print_shapes: bool = False) -> Iterator[nn.Parameter]:
    """The LoRA parameters of ``model``, each shared one once."""
    for name, param in _lora_named_params(model):
        if print_shapes:
            logger.info("%s %s", name, tuple(param.shape))
        yield param


def get_bias_params(model: nn.Module, print_shapes: bool = False) -> Iterator[nn.Parameter]:
    return get_params_by_name(model, print_shapes=print_shapes, name_filter=name_is_bias)


def get_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA entries of ``model.state_dict()`` (``...parametrizations.weight.0.lora_A``), shared ones under every name."""
    wanted = {name for name, _ in _lora_named_params(model, remove_duplicate=False)}
    return {k: v for k, v in model.state_dict().items() if k in wanted}


def load_multiple_lora(model: nn.Module, lora_state_dicts: Iterable[Mapping[str, torch.Tensor]]) -> nn.Module:
    """Load several LoRA state dicts, keeping each; :func:`select_lora` switches between them. The
    active adapter afterwards is the last one (as in minLoRA)."""
    wanted = {name for name, _ in _lora_named_params(model, remove_duplicate=False)}
    if not wanted:
        raise ValueError("load_multiple_lora: the model has no LoRA; call minlora.add_lora(model) first")
    model.apply(apply_to_lora(LoRAParametrization.clear_stored_adapters))
    count = 0
    for i, state_dict in enumerate(lora_state_dicts):
        if set(state_dict) - wanted:
            raise ValueError(f"load_multiple_lora: state dict #{i} has keys that are not LoRA factors of this model, "
                             f"e.g. {sorted(set(state_dict) - wanted)[:3]}; pass minlora.get_lora_state_dict outputs")
        model.load_state_dict(dict(state_dict), strict=False)
        model.apply(apply_to_lora(LoRAParametrization.store_adapter))
        count += 1
    if count == 0:
        raise ValueError("load_multiple_lora: no state dicts given; pass at least one")
    return model


def select_lora(model: nn.Module, index: int) -> nn.Module:
    """Make adapter ``index`` (in :func:`load_multiple_lora` order) the active one, in place."""
    model.apply(apply_to_lora(lambda p: p.select_stored_adapter(index)))
    return model


# ---------------------------------------------------------------------- tied layers
def _only_lora(layer: nn.Module, role: str) -> LoRAParametrization:
    loras = [p for p in layer.parametrizations["weight"] if isinstance(p, LoRAParametrization)] \
        if parametrize.is_parametrized(layer, "weight") else []
    if len(loras) != 1:
        raise ValueError(f"{role} ({type(layer).__name__}) has {len(loras) or 'no'} LoRA on its weight; add one LoRA "
                         f"to both layers before tying them")
    return loras[0]


def _linear_first(a: nn.Module, b: nn.Module, caller: str) -> tuple[nn.Module, nn.Module]:
    """``(linear, embedding)`` in either order: the embedding's LoRA has the ``fan_in_fan_out`` layout
    (minLoRA's own examples pass the embedding first)."""
    fifo_a, fifo_b = _only_lora(a, "first layer").fan_in_fan_out, _only_lora(b, "second layer").fan_in_fan_out
    if fifo_a != fifo_b:
        return (b, a) if fifo_a else (a, b)
    kind = "an embedding layout (from_embedding)" if fifo_a else "a linear layout (from_linear)"
    raise ValueError(f"{caller} needs one layer with LoRA from from_linear (the head) and one with LoRA from "
                     f"from_embedding (the embedding); both of {type(a).__name__} and {type(b).__name__} have {kind}")


def tie_weights(linear: nn.Module, embedding: nn.Module) -> None:
    """Share one weight *and one LoRA update* between a linear head and an embedding, in either order
    (minLoRA). The embedding's ``lora_A`` becomes the head's ``lora_B`` and vice versa, which the two
    layouts make shape-compatible; without this, LoRA on GPT-2's tied head adapts the head only."""
    linear, embedding = _linear_first(linear, embedding, "tie_weights")
    lin, emb = _only_lora(linear, "linear"), _only_lora(embedding, "embedding")
    if lin.lora_B.shape != emb.lora_A.shape or lin.lora_A.shape != emb.lora_B.shape:
        raise ValueError(f"tie_weights: shapes do not fit: linear lora_A {tuple(lin.lora_A.shape)}, lora_B "
                         f"{tuple(lin.lora_B.shape)} vs embedding lora_A {tuple(emb.lora_A.shape)}, lora_B "
                         f"{tuple(emb.lora_B.shape)}; the ranks and the (vocab, dim) shapes must agree")
    embedding.parametrizations["weight"].original = linear.parametrizations["weight"].original
    emb.lora_A, emb.lora_B = lin.lora_B, lin.lora_A
    emb.set_scaling(lin.lora_alpha, lin.use_rslora)


def untie_weights(linear: nn.Module, embedding: nn.Module) -> None:
    """Give the embedding its own copy of the weight and the factors (undoes :func:`tie_weights`)."""
    _, embedding = _linear_first(linear, embedding, "untie_weights")
    emb, plist = _only_lora(embedding, "embedding"), embedding.parametrizations["weight"]
    plist.original = nn.Parameter(plist.original.detach().clone(), requires_grad=plist.original.requires_grad)
    for name in ("lora_A", "lora_B"):
        setattr(emb, name, nn.Parameter(getattr(emb, name).detach().clone(), getattr(emb, name).requires_grad))


# ---------------------------------------------------------------------- training helpers
def mark_only_lora_as_trainable(model: nn.Module, bias: str = "none") -> None:
    """Freeze everything but LoRA; ``bias``: ``"none"``, ``"all"`` biases, or ``"lora_only"`` (biases of LoRA layers)."""
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"mark_only_lora_as_trainable: bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    lora = list(get_lora_params(model))
    if not lora:
        raise ValueError("mark_only_lora_as_trainable: the model has no LoRA; call minlora.add_lora(model) first")
    model.requires_grad_(False)
    trainable = lora + (list(get_bias_params(model)) if bias == "all" else [])
    if bias == "lora_only":
        trainable += [b for s in lora_sites(model) if isinstance(b := getattr(s.module, "bias", None), nn.Parameter)]
    for param in trainable:
        param.requires_grad_(True)


@dataclass(frozen=True)
class ParameterCount:
    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return (f"trainable params: {self.trainable:,} || all params: {self.total:,} || "
                f"trainable%: {100 * self.fraction:.4f}")


def count_parameters(model: nn.Module) -> ParameterCount:
    """Trainable and total parameters (a shared tensor counts once); ``str()`` is a one-line summary."""
    params = list(model.parameters())
    return ParameterCount(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))
