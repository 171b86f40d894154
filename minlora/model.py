"""Adding, merging and removing LoRA: minLoRA's ``minlora.model`` API, fixed.

A *LoRA config* is either minLoRA's dict, ``{layer_type: {tensor_name: factory}}`` where
``factory(layer)`` returns a :class:`LoRAParametrization` (``default_lora_config`` puts rank-4 LoRA
on the weight of every ``nn.Linear``), or a :class:`minlora.LoRAConfig`.

Differences from minLoRA, all deliberate:

* adding LoRA where a LoRA already sits is a no-op, logged as a warning (never a second, stacked adapter);
* ``merge_lora`` / ``remove_lora`` touch only :class:`LoRAParametrization` s; other parametrizations
  a user registered stay;
* merging never writes into the existing weight tensor: a merged layer gets a new ``Parameter``.
  A tensor shared with a layer that is not merged (GPT-2's LM head and token embedding) is
  therefore left alone, and the merged model computes exactly what the LoRA model did;
* merging is done in fp32 (then cast to the weight's dtype) and without dropout.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Union

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from .parametrization import LoRAParametrization, install_lora_class, lora_dtype_for

if TYPE_CHECKING:  # pragma: no cover
    from .config import LoRAConfig

__all__ = [
    "LoRAParametrization",
    "default_lora_config",
    "apply_lora",
    "add_lora",
    "add_lora_by_name",
    "merge_lora",
    "remove_lora",
    "lora_sites",
    "LoRASite",
]

logger = logging.getLogger(__name__)

LoRAConfigDict = Mapping[type, Mapping[str, Callable[[nn.Module], LoRAParametrization]]]
AnyLoRAConfig = Union[LoRAConfigDict, "LoRAConfig"]

# minLoRA's default: rank-4 LoRA on the weight of every nn.Linear (an LM head included).
default_lora_config: dict[type, dict[str, Callable[[nn.Module], LoRAParametrization]]] = {
    nn.Linear: {
        "weight": partial(LoRAParametrization.from_linear, rank=4),
    },
}

# (qualified module name, module, tensor name, factory)
Target = tuple[str, nn.Module, str, Callable[[nn.Module], LoRAParametrization]]


class LoRASite:
    """One parametrized tensor carrying LoRA: ``module.<tensor_name>`` at ``name`` in the model."""

    __slots__ = ("module_name", "module", "tensor_name")

    def __init__(self, module_name: str, module: nn.Module, tensor_name: str) -> None:
        self.module_name = module_name
        self.module = module
        self.tensor_name = tensor_name

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.tensor_name}" if self.module_name else self.tensor_name

    @property
    def plist(self) -> parametrize.ParametrizationList:
        return self.module.parametrizations[self.tensor_name]

    @property
    def lora_indices(self) -> list[int]:
        return [i for i, p in enumerate(self.plist) if isinstance(p, LoRAParametrization)]

    @property
    def lora(self) -> LoRAParametrization:
        """The (first) LoRA on this tensor."""
        return self.plist[self.lora_indices[0]]

    @property
    def original(self) -> torch.Tensor:
        return self.plist.original

    def __repr__(self) -> str:
        return f"LoRASite({self.name!r})"


def lora_sites(model: nn.Module) -> list[LoRASite]:
    """Every parametrized tensor of ``model`` that carries a :class:`LoRAParametrization` (found by type)."""
    sites = []
    for module_name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name, plist in module.parametrizations.items():
            if any(isinstance(p, LoRAParametrization) for p in plist):
                sites.append(LoRASite(module_name, module, tensor_name))
    return sites


def has_lora(module: nn.Module, tensor_name: str) -> bool:
    return parametrize.is_parametrized(module, tensor_name) and any(
        isinstance(p, LoRAParametrization) for p in module.parametrizations[tensor_name]
    )


def register_lora(module: nn.Module, tensor_name: str, lora: LoRAParametrization) -> None:
    """Register ``lora`` on ``module.<tensor_name>``: fp32 factors on the weight's device, LoRA's class."""
    if not isinstance(lora, LoRAParametrization):
        raise TypeError(
            f"a LoRA config factory must return a LoRAParametrization, got {type(lora).__name__}; "
            f"register other parametrizations with torch.nn.utils.parametrize directly"
        )
    if parametrize.is_parametrized(module, tensor_name):
        original = module.parametrizations[tensor_name].original
    else:
        original = getattr(module, tensor_name)
    lora.to(device=original.device, dtype=lora_dtype_for(original.dtype))
    parametrize.register_parametrization(module, tensor_name, lora)
    install_lora_class(module)


# ---------------------------------------------------------------------- selecting layers
def _dict_config_targets(model: nn.Module, lora_config: LoRAConfigDict, prefix: str = "") -> list[Target]:
    if not isinstance(lora_config, Mapping) or not all(isinstance(k, type) for k in lora_config):
        raise TypeError(
            "lora_config must be a minlora.LoRAConfig or a dict {layer_type: {tensor_name: factory}} such as "
            f"minlora.default_lora_config, got {type(lora_config).__name__}"
        )
    targets: list[Target] = []
    for name, module in model.named_modules(prefix=prefix):
        # minLoRA matches the exact layer type; a parametrized layer is matched by its original type.
        layer_type = parametrize.type_before_parametrizations(module)
        for tensor_name, factory in lora_config.get(layer_type, {}).items():
            targets.append((name, module, tensor_name, factory))
    return targets


def resolve_targets(model: nn.Module, lora_config: AnyLoRAConfig) -> list[Target]:
    from .config import LoRAConfig

    if isinstance(lora_config, LoRAConfig):
        return lora_config.targets(model)
    targets = _dict_config_targets(model, lora_config)
    if not targets:
        raise ValueError(
            f"add_lora: the model has no layer of the types in lora_config "
            f"({sorted(t.__name__ for t in lora_config)}); nothing to put LoRA on"
        )
    return targets


def _add_targets(targets: list[Target], caller: str) -> list[str]:
    """Register LoRA on every target not already carrying one; returns the names of those skipped."""
    skipped: list[str] = []
    seen: set[tuple[int, str]] = set()
    for name, module, tensor_name, factory in targets:
        key = (id(module), tensor_name)
        if key in seen:
            continue
        seen.add(key)
        full = f"{name}.{tensor_name}" if name else tensor_name
        if has_lora(module, tensor_name):
            skipped.append(full)
            continue
        register_lora(module, tensor_name, factory(module))
    if skipped:
        logger.warning(
            "%s: %d tensor(s) already carry a LoRA adapter and were left unchanged (no second adapter is "
            "stacked), e.g. %s; call minlora.remove_lora(model) first to replace them",
            caller, len(skipped), ", ".join(skipped[:3]),
        )
    return skipped


# ---------------------------------------------------------------------- minLoRA API
def apply_lora(layer: nn.Module, register: bool = True, merge: bool = False,
               lora_config: LoRAConfigDict = default_lora_config) -> None:
    """minLoRA's per-layer helper for ``model.apply``: add LoRA to ``layer`` (``register=True``) or
    remove / merge the LoRA on it. Unlike minLoRA, removal touches LoRA parametrizations only."""
    if register:
        targets = [t for t in _dict_config_targets(layer, lora_config) if t[1] is layer]
        _add_targets(targets, "apply_lora")
    else:
        _unlora(layer, merge=merge, recurse=False)


def add_lora(model: nn.Module, lora_config: AnyLoRAConfig = default_lora_config) -> None:
    """Put LoRA on the layers of ``model`` selected by ``lora_config`` (default: every ``nn.Linear``).

    A tensor that already carries LoRA is left as it is (logged warning), so calling ``add_lora``
    twice never stacks two adapters. Raises ``ValueError`` when the config selects no layer.
    """
    _add_targets(resolve_targets(model, lora_config), "add_lora")


def add_lora_by_name(model: nn.Module, target_module_names: list[str] | tuple[str, ...] | str,
                     lora_config: AnyLoRAConfig = default_lora_config) -> None:
    """Put LoRA on the layers inside every module whose name *contains* one of ``target_module_names``
    (minLoRA's substring rule: ``"attn"`` selects everything under ``transformer.h.*.attn``).

    Raises ``ValueError`` naming any entry that matches no module, or that matches only modules
    without a layer ``lora_config`` applies to.
    """
    if isinstance(target_module_names, str):
        target_module_names = [target_module_names]
    if not target_module_names:
        raise ValueError("add_lora_by_name: target_module_names is empty; name at least one module")
    all_targets = resolve_targets_for_names(model, lora_config)
    module_names = [name for name, _ in model.named_modules() if name]
    chosen: list[Target] = []
    for target in target_module_names:
        matched = [n for n in module_names if target in n]
        if not matched:
            raise ValueError(
                f"add_lora_by_name: {target!r} matches no module name; module names look like "
                f"{module_names[:6]}"
            )
        # a layer is selected when it is a matched module or lies inside one
        hits = [t for t in all_targets if any(t[0] == m or t[0].startswith(m + ".") for m in matched)]
        if not hits:
            raise ValueError(
                f"add_lora_by_name: {target!r} matches {matched[:4]}{'...' if len(matched) > 4 else ''} but none "
                f"of them is or contains a layer the LoRA config applies to"
            )
        chosen.extend(hits)
    _add_targets(chosen, "add_lora_by_name")


def resolve_targets_for_names(model: nn.Module, lora_config: AnyLoRAConfig) -> list[Target]:
    """Every layer the config could apply to (no error when empty: names decide)."""
    from .config import LoRAConfig

    if isinstance(lora_config, LoRAConfig):
        return lora_config.targets(model, require_match=False)
    return _dict_config_targets(model, lora_config)


def merge_lora(model: nn.Module) -> None:
    """Fold every LoRA into its weight (``W + scaling * delta``, in fp32, then cast) and remove it.

    The merged model computes what the LoRA model computed (a disabled LoRA merges to ``W``).
    Each merged tensor is a new ``Parameter``: when the old tensor was shared with a tensor that
    is not merged the same way (GPT-2's tied LM head and token embedding), the tie is broken
    (logged) instead of silently rewriting the other layer. Tensors that share both weight and
    LoRA (:func:`minlora.tie_weights`) stay shared. Merging a model without LoRA does nothing.
    """
    _unlora(model, merge=True, recurse=True)


def remove_lora(model: nn.Module) -> None:
    """Drop every LoRA, restoring the original weights (ties included); other parametrizations stay."""
    _unlora(model, merge=False, recurse=True)


def _sites_of(model: nn.Module, recurse: bool) -> list[LoRASite]:
    if recurse:
        return lora_sites(model)
    return [s for s in lora_sites(model) if s.module is model]


def _unlora(model: nn.Module, merge: bool, recurse: bool) -> None:
    sites = _sites_of(model, recurse)
    if not merge:
        for site in sites:
            _drop_lora(site)
        return
    # Group the sites by their original tensor: those that share it are merged together so that
    # no site sees a tensor another one already rewrote.
    groups: dict[int, list[LoRASite]] = {}
    for site in sites:
        leading = site.lora_indices
        if leading != list(range(len(leading))):
            raise ValueError(
                f"merge_lora: the LoRA on {site.name} follows another parametrization "
                f"({[type(p).__name__ for p in site.plist]}); it cannot be folded into the stored weight. "
                f"Remove the other parametrization first, or use remove_lora"
            )
        if not site.plist.is_tensor:
            raise ValueError(f"merge_lora: {site.name} is parametrized from several tensors; cannot merge")
        groups.setdefault(id(site.original), []).append(site)
    holders = _tensor_holders(model) if sites else {}
    for group in groups.values():
        _merge_group(group, holders.get(id(group[0].original), []))


def _tensor_holders(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> names`` of every parameter / buffer slot holding it (shared ones repeated)."""
    holders: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(t), []).append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        holders.setdefault(id(t), []).append(name)
    return holders


def _original_path(site: LoRASite) -> str:
    prefix = f"{site.module_name}." if site.module_name else ""
    return f"{prefix}parametrizations.{site.tensor_name}.original"


@torch.no_grad()
def _merge_group(group: list[LoRASite], holder_names: list[str]) -> None:
    original = group[0].original
    merged: list[torch.Tensor] = []
    for site in group:
        value = original
        for i in site.lora_indices:  # the leading LoRA(s), evaluated in fp32
            value = site.plist[i].merged(value)
        merged.append(value)
    # Sites whose merged values are identical (tie_weights: same weight, same update) share one tensor.
    clusters: list[tuple[torch.Tensor, list[LoRASite]]] = []
    for site, value in zip(group, merged):
        for cvalue, members in clusters:
            if cvalue.shape == value.shape and torch.equal(cvalue, value):
                members.append(site)
                break
        else:
            clusters.append((value, [site]))
    site_paths = {_original_path(s) for s in group}
    others = [n for n in holder_names if n not in site_paths]
    if others or len(clusters) > 1:
        logger.warning(
            "merge_lora: %s shared its tensor with %s; the merged layer(s) get their own weight "
            "(W + scaling * delta) and the others keep W, so outputs equal the unmerged LoRA model "
            "but the weights are no longer tied",
            ", ".join(s.name for s in group), ", ".join(others) or "each other",
        )
    for value, members in clusters:
        fresh = nn.Parameter(value, requires_grad=original.requires_grad)
        for site in members:
            plist = site.plist
            leading = site.lora_indices
            if len(leading) == len(plist):
                parametrize.remove_parametrizations(site.module, site.tensor_name, leave_parametrized=False)
                setattr(site.module, site.tensor_name, fresh)
            else:  # other parametrizations follow the LoRA: they now apply to the merged weight
                plist.original = fresh
                for i in reversed(leading):
                    del plist[i]


def _drop_lora(site: LoRASite) -> None:
    plist = site.plist
    indices = site.lora_indices
    if len(indices) == len(plist):
        parametrize.remove_parametrizations(site.module, site.tensor_name, leave_parametrized=False)
    else:
        for i in reversed(indices):
            del plist[i]


def iter_lora_modules(model: nn.Module) -> Iterator[LoRAParametrization]:
    """Every :class:`LoRAParametrization` module in ``model`` (each once)."""
    for module in model.modules():
        if isinstance(module, LoRAParametrization):
            yield module

