"""Helpers over a LoRA model: minLoRA's ``minlora.utils`` API plus training conveniences.

LoRA parameters are found by type (the parameters of :class:`LoRAParametrization` modules), never
by the position of a word in a dotted name; :func:`name_is_lora` is kept for minLoRA code that
filters names itself.
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

__all__ = [
    "apply_to_lora",
    "enable_lora",
    "disable_lora",
    "set_fast_path",
    "name_is_lora",
    "name_is_bias",
    "get_params_by_name",
    "get_lora_params",
    "get_bias_params",
    "get_lora_state_dict",
    "lora_parameter_names",
    "load_multiple_lora",
    "select_lora",
    "tie_weights",
    "untie_weights",
    "mark_only_lora_as_trainable",
    "count_parameters",
    "ParameterCount",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- enable / disable
def apply_to_lora(fn: Callable[[LoRAParametrization], None]) -> Callable[[nn.Module], None]:
    """Wrap ``fn`` for ``model.apply``: it is called on every :class:`LoRAParametrization`."""

    def apply_fn(layer: nn.Module) -> None:
        if isinstance(layer, LoRAParametrization):
            fn(layer)

    return apply_fn


class _LoRASwitch:
    """Returned by :func:`enable_lora` / :func:`disable_lora`: the switch is already made; used as
    a context manager it puts every LoRA back in its previous state on exit."""

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
    """Turn every LoRA of ``model`` on; ``with enable_lora(model):`` restores the previous state."""
    return _LoRASwitch(model, True)


def disable_lora(model: nn.Module) -> _LoRASwitch:
    """Turn every LoRA off (the model computes with its base weights); usable as a context manager:
    ``with disable_lora(model): base_logits = model(x)`` turns them back on afterwards."""
    return _LoRASwitch(model, False)


def set_fast_path(model: nn.Module, enabled: bool = True) -> None:
    """Use (default) or bypass the fast LoRA forward of ``nn.Linear`` / ``nn.Embedding`` layers.

    Bypassing it makes every layer read ``module.weight = W + scaling * delta`` (the plain
    parametrization): slower, same function; useful for comparisons and debugging.
    """
    for p in iter_lora_modules(model):
        p.fast_path = bool(enabled)


# ---------------------------------------------------------------------- parameters and state
def name_is_lora(name: str) -> bool:
    """minLoRA's name test: ``....parametrizations.<tensor>.<i>.lora_A`` / ``lora_B``."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-4] == "parametrizations" and parts[-1] in ("lora_A", "lora_B")


def name_is_bias(name: str) -> bool:
    return name.split(".")[-1] == "bias"


def get_params_by_name(model: nn.Module, print_shapes: bool = False,
                       name_filter: Callable[[str], bool] | None = None) -> Iterator[nn.Parameter]:
    for name, param in model.named_parameters():
        if name_filter is None or name_filter(name):
            if print_shapes:
                logger.info("%s %s", name, tuple(param.shape))
            yield param


def lora_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names of all LoRA factors (every alias of a shared one), as in ``model.state_dict()``."""
    names = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, LoRAParametrization):
            prefix = f"{module_name}." if module_name else ""
            names += [prefix + "lora_A", prefix + "lora_B"]
    return names


def get_lora_params(model: nn.Module, print_shapes: bool = False) -> Iterator[nn.Parameter]:
    """The LoRA factors of ``model`` (each shared one once); shapes go to the log with ``print_shapes``."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, LoRAParametrization):
            for pname in ("lora_A", "lora_B"):
                param = getattr(module, pname)
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if print_shapes:
                    logger.info("%s.%s %s", module_name, pname, tuple(param.shape))
                yield param


def get_bias_params(model: nn.Module, print_shapes: bool = False) -> Iterator[nn.Parameter]:
    return get_params_by_name(model, print_shapes=print_shapes, name_filter=name_is_bias)


def get_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA entries of ``model.state_dict()`` (names as there: ``...parametrizations.weight.0.lora_A``)."""
    wanted = set(lora_parameter_names(model))
    return {k: v for k, v in model.state_dict().items() if k in wanted}


# ---------------------------------------------------------------------- several adapters
def load_multiple_lora(model: nn.Module, lora_state_dicts: Iterable[Mapping[str, torch.Tensor]]) -> nn.Module:
    """Load several LoRA state dicts and keep each one; :func:`select_lora` switches between them.

    The active factors after the call are those of the last state dict (as in minLoRA). Each state
    dict must hold LoRA entries of this model only.
    """
    wanted = set(lora_parameter_names(model))
    if not wanted:
        raise ValueError("load_multiple_lora: the model has no LoRA; call minlora.add_lora(model) first")
    model.apply(apply_to_lora(LoRAParametrization.clear_stored_adapters))
    count = 0
    for i, state_dict in enumerate(lora_state_dicts):
        unexpected = sorted(set(state_dict) - wanted)
        if unexpected:
            raise ValueError(
                f"load_multiple_lora: state dict #{i} has keys that are not LoRA factors of this model, e.g. "
                f"{unexpected[:3]}; pass minlora.get_lora_state_dict(...) outputs"
            )
        model.load_state_dict(dict(state_dict), strict=False)
        model.apply(apply_to_lora(LoRAParametrization.store_adapter))
        count += 1
    if count == 0:
        raise ValueError("load_multiple_lora: no state dicts given")
    return model


def select_lora(model: nn.Module, index: int) -> nn.Module:
    """Make adapter ``index`` (in :func:`load_multiple_lora` order) the active one, in place."""
    model.apply(apply_to_lora(lambda p: p.select_stored_adapter(index)))
    return model


# ---------------------------------------------------------------------- tied layers
def _only_lora(layer: nn.Module, role: str) -> LoRAParametrization:
    if not parametrize.is_parametrized(layer, "weight"):
        raise ValueError(f"{role} has no LoRA on its weight; add LoRA to both layers before tying them")
    plist = layer.parametrizations["weight"]
    loras = [p for p in plist if isinstance(p, LoRAParametrization)]
    if len(loras) != 1:
        raise ValueError(f"{role}: expected one LoRA on the weight, found {len(loras)}")
    return loras[0]


def _linear_first(a: nn.Module, b: nn.Module, caller: str) -> tuple[nn.Module, nn.Module]:
    """``(linear, embedding)`` whichever order they came in: the embedding is the layer whose LoRA
    has the embedding layout (``from_embedding``, ``fan_in_fan_out=True``). minLoRA's own examples
    pass the embedding first, so the order must not matter."""
    lora_a, lora_b = _only_lora(a, "first layer"), _only_lora(b, "second layer")
    if not lora_a.fan_in_fan_out and lora_b.fan_in_fan_out:
        return a, b
    if lora_a.fan_in_fan_out and not lora_b.fan_in_fan_out:
        return b, a
    kind = "an embedding layout (from_embedding)" if lora_a.fan_in_fan_out else "a linear layout (from_linear)"
    raise ValueError(
        f"{caller} needs one layer with LoRA from from_linear (the head) and one with LoRA from from_embedding "
        f"(the embedding); both of {type(a).__name__} and {type(b).__name__} have {kind}"
    )


def tie_weights(linear: nn.Module, embedding: nn.Module) -> None:
    """Share one weight *and one LoRA update* between a linear head and an embedding (minLoRA).

    The two layers may come in either order (``tie_weights(embedding, linear)`` works too): the
    embedding is recognised by its LoRA layout.

    Afterwards ``embedding.weight == linear.weight`` (both ``W + scaling * B @ A``): the
    embedding's ``lora_A`` is the head's ``lora_B`` and vice versa, which the two layouts make
    shape-compatible. Without this, LoRA on GPT-2's tied head adapts the head only.
    """
    linear, embedding = _linear_first(linear, embedding, "tie_weights")
    lin, emb = _only_lora(linear, "linear"), _only_lora(embedding, "embedding")
    if lin.lora_B.shape != emb.lora_A.shape or lin.lora_A.shape != emb.lora_B.shape:
        raise ValueError(
            f"tie_weights: shapes do not fit: linear lora_A {tuple(lin.lora_A.shape)}, lora_B {tuple(lin.lora_B.shape)}"
            f" vs embedding lora_A {tuple(emb.lora_A.shape)}, lora_B {tuple(emb.lora_B.shape)} (the ranks and the"
            f" (vocab, dim) shapes must agree)"
        )
    embedding.parametrizations["weight"].original = linear.parametrizations["weight"].original
    emb.lora_A = lin.lora_B
    emb.lora_B = lin.lora_A
    emb.set_scaling(lin.lora_alpha, lin.use_rslora)


def untie_weights(linear: nn.Module, embedding: nn.Module) -> None:
    """Give the embedding its own copy of the weight and of the LoRA factors (undoes :func:`tie_weights`);
    the layers may come in either order."""
    linear, embedding = _linear_first(linear, embedding, "untie_weights")
    emb = _only_lora(embedding, "embedding")
    plist = embedding.parametrizations["weight"]
    plist.original = nn.Parameter(plist.original.detach().clone(), requires_grad=plist.original.requires_grad)
    emb.lora_A = nn.Parameter(emb.lora_A.detach().clone(), requires_grad=emb.lora_A.requires_grad)
    emb.lora_B = nn.Parameter(emb.lora_B.detach().clone(), requires_grad=emb.lora_B.requires_grad)


# ---------------------------------------------------------------------- training helpers
def mark_only_lora_as_trainable(model: nn.Module, bias: str = "none") -> None:
    """Freeze everything except the LoRA factors.

    ``bias``: ``"none"`` freezes every bias, ``"all"`` trains every bias, ``"lora_only"`` trains
    the biases of the layers that carry LoRA.
    """
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"mark_only_lora_as_trainable: bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    lora = list(get_lora_params(model))
    if not lora:
        raise ValueError("mark_only_lora_as_trainable: the model has no LoRA; call minlora.add_lora(model) first")
    for param in model.parameters():
        param.requires_grad_(False)
    for param in lora:
        param.requires_grad_(True)
    if bias == "all":
        for param in get_bias_params(model):
            param.requires_grad_(True)
    elif bias == "lora_only":
        for site in lora_sites(model):
            b = getattr(site.module, "bias", None)
            if isinstance(b, nn.Parameter):
                b.requires_grad_(True)


@dataclass(frozen=True)
class ParameterCount:
    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return (
            f"trainable params: {self.trainable:,} || all params: {self.total:,} || "
            f"trainable%: {100 * self.fraction:.4f}"
        )


def count_parameters(model: nn.Module) -> ParameterCount:
    """Trainable and total parameter counts (a tensor shared by several layers counts once);
    ``str()`` of the result is a one-line summary."""
    params = list(model.parameters())  # de-duplicated by identity
    return ParameterCount(
        trainable=sum(p.numel() for p in params if p.requires_grad),
        total=sum(p.numel() for p in params),
    )
