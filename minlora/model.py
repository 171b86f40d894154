"""Adding, merging and removing LoRA (minLoRA's API; a config is its dict ``{layer_type: {tensor_name:
factory}}`` or a :class:`LoRAConfig`). Unlike minLoRA: adding LoRA where one sits is a logged no-op;
merge / remove touch LoRA only; a merge computes in fp32 and gives the layer a new ``Parameter``.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Callable, Iterator, Mapping, NamedTuple

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from .config import LoRAConfig, name_tuple
from .errors import LoRATypeError, LoRAValueError
from .parametrization import LoRAParametrization, install_lora_class, raw_weight

logger = logging.getLogger(__name__)

# minLoRA's default: rank-4 LoRA on the weight of every nn.Linear (an LM head included).
default_lora_config = {nn.Linear: {"weight": partial(LoRAParametrization.from_linear, rank=4)}}

# (module name, module, tensor name, factory)
Target = tuple[str, nn.Module, str, Callable[[nn.Module], LoRAParametrization]]


class LoRASite(NamedTuple):
    """One parametrized tensor carrying LoRA: ``module.<tensor_name>``, the module at ``module_name``."""

    module_name: str
    module: nn.Module
    tensor_name: str

    @property
    def name(self) -> str:
        """``"<module_name>.<tensor_name>"``, or the tensor name alone on the root module."""
        if self.module_name:
            return f"{self.module_name}.{self.tensor_name}"
        return self.tensor_name

    @property
    def plist(self) -> parametrize.ParametrizationList:
        return self.module.parametrizations[self.tensor_name]

    @property
    def lora_indices(self) -> list[int]:
        """The positions of the tensor's LoRAs among its parametrizations (none: ``[]``)."""
        if not parametrize.is_parametrized(self.module, self.tensor_name):
            return []
        return [i for i, p in enumerate(self.plist) if isinstance(p, LoRAParametrization)]

    @property
    def lora(self) -> LoRAParametrization:
        return self.plist[self.lora_indices[0]]

    @property
    def original(self) -> torch.Tensor:
        return self.plist.original


def single_lora(site: LoRASite, caller: str) -> LoRAParametrization:
    """The one LoRA on ``site``'s tensor, else a ``ValueError`` naming ``caller``."""
    count = len(site.lora_indices)
    if count != 1:
        raise LoRAValueError(
            f"{caller}: {site.name} carries {count} LoRAs; it needs exactly one (minlora.add_lora adds one, "
            "minlora.remove_lora removes them)"
        )
    return site.lora


def lora_sites(model: nn.Module) -> list[LoRASite]:
    """Every parametrized tensor of ``model`` carrying a :class:`LoRAParametrization` (found by type)."""
    sites = [
        LoRASite(module_name, module, tensor_name)
        for module_name, module in model.named_modules()
        for tensor_name in getattr(module, "parametrizations", {})
    ]
    return [site for site in sites if site.lora_indices]


def require_lora(model: nn.Module, caller: str) -> list[LoRASite]:
    """:func:`lora_sites`, else (a model without LoRA) a ``ValueError`` naming ``caller``."""
    sites = lora_sites(model)
    if not sites:
        raise LoRAValueError(f"{caller}: the model has no LoRA; call minlora.add_lora(model) first")
    return sites


def iter_lora_modules(model: nn.Module) -> Iterator[LoRAParametrization]:
    return (m for m in model.modules() if isinstance(m, LoRAParametrization))


def register_lora(module: nn.Module, tensor_name: str, lora: LoRAParametrization, fresh: bool = True) -> None:
    """Register ``lora`` on ``module.<tensor_name>``; a ``fresh`` DoRA's magnitude starts at the weight's norms."""
    original = raw_weight(module, tensor_name)
    # fp32 factors on fp16 / bf16 weights: small updates are not rounded away and GradScaler can
    # unscale their gradients (it refuses fp16 grads); fp32 / fp64 weights keep their dtype.
    lora.to(device=original.device, dtype=torch.promote_types(original.dtype, torch.float32))
    if fresh and lora.use_dora:
        lora.init_magnitude(original)
    parametrize.register_parametrization(module, tensor_name, lora)
    install_lora_class(module)


# ---------------------------------------------------------------------- selecting layers
def _targets(model: nn.Module, lora_config: LoRAConfig | Mapping, require_match: bool = True) -> list[Target]:
    if isinstance(lora_config, LoRAConfig):
        return lora_config.targets(model, require_match)
    if not isinstance(lora_config, Mapping) or not all(isinstance(k, type) for k in lora_config):
        raise LoRATypeError(
            "lora_config must be a minlora.LoRAConfig or a dict {layer_type: {tensor_name: factory}} "
            f"such as minlora.default_lora_config, got {type(lora_config).__name__}"
        )
    # minLoRA matches the exact layer type; a parametrized layer by its original type.
    targets = [
        (name, module, tensor_name, factory)
        for name, module in model.named_modules()
        for tensor_name, factory in lora_config.get(parametrize.type_before_parametrizations(module), {}).items()
    ]
    if not targets and require_match:
        types = sorted(t.__name__ for t in lora_config)
        raise LoRAValueError(
            f"add_lora: the model has no layer of the types in lora_config ({types}); nothing to put LoRA on"
        )
    return targets


def _add_targets(targets: list[Target], caller: str) -> None:
    """Build every LoRA, then register them all (nothing is added on error); warn once about ranks
    above what a layer can use.
    """
    todo, skipped, oversized = [], [], []
    for name, module, tensor_name, factory in targets:
        site = LoRASite(name, module, tensor_name)
        if site.lora_indices:
            skipped.append(site.name)
            continue
        lora = factory(module)
        if not isinstance(lora, LoRAParametrization):
            raise LoRATypeError(
                f"{caller}: the factory for {site.name} returned a {type(lora).__name__}, not a LoRAParametrization"
            )
        useful = min(lora.fan_in, lora.fan_out)
        if lora.rank > useful:
            shape = tuple(getattr(module, tensor_name).shape)
            oversized.append(f"{site.name} (weight shape {shape}) has rank {lora.rank}, useful maximum {useful}")
        todo.append((module, tensor_name, lora))
    for module, tensor_name, lora in todo:
        register_lora(module, tensor_name, lora)
    if oversized:
        # Such a rank is wasteful, not wrong: the update B @ A cannot have a higher rank than min(in, out), so the
        # extra rank only adds parameters. minLoRA and PEFT accept it (minLoRA's own demo puts its default rank 4
        # on an nn.Linear(7, 3)), and so does minlora, with one warning per call.
        shown = "; ".join(oversized[:6])
        if len(oversized) > 6:
            shown += f"; and {len(oversized) - 6} more"
        warnings.warn(
            f"{caller}: LoRA rank above min(in_features, out_features) on {len(oversized)} layer(s): {shown}. The "
            f"update B @ A cannot have a higher rank, so it works but the extra rank only adds parameters; lower the "
            f"rank or leave those layers out to save them",
            stacklevel=3,
        )
    if skipped:
        logger.warning(
            f"{caller}: {len(skipped)} tensor(s) already carry a LoRA adapter and were left unchanged (no second "
            f"adapter is stacked), e.g. {skipped[:3]}; call minlora.remove_lora(model) first to replace them"
        )


# ---------------------------------------------------------------------- minLoRA API
def apply_lora(
    layer: nn.Module, register: bool = True, merge: bool = False, lora_config: Mapping = default_lora_config
) -> None:
    """minLoRA's per-layer helper for ``model.apply``: add LoRA to ``layer``, or merge / remove its LoRA."""
    # a LoRAConfig's layer types apply to one layer (named ""); its name patterns need the model
    by_name = isinstance(lora_config, LoRAConfig) and (lora_config.target_modules or lora_config.exclude_modules)
    if register and by_name:
        raise LoRATypeError(
            "apply_lora: a LoRAConfig selects by name and one layer has none: use add_lora(model, config)"
        )
    if register:
        _add_targets([t for t in _targets(layer, lora_config, False) if t[1] is layer], "apply_lora")
    else:
        _unlora(layer, merge, [s for s in lora_sites(layer) if s.module is layer])


def add_lora(model: nn.Module, lora_config: LoRAConfig | Mapping = default_lora_config) -> None:
    """Put LoRA on the layers ``lora_config`` selects (default: every ``nn.Linear``). A tensor that
    already carries LoRA is left alone (logged). ``ValueError`` when the config selects no layer. A rank
    above a layer's ``min(in_features, out_features)`` is accepted, as in minLoRA and PEFT, with one
    warning naming such layers (the extra rank only adds parameters).
    """
    _add_targets(_targets(model, lora_config), "add_lora")


def add_lora_by_name(
    model: nn.Module,
    target_module_names: list[str] | tuple[str, ...] | str,
    lora_config: LoRAConfig | Mapping = default_lora_config,
) -> None:
    """LoRA on the layers inside every module whose name *contains* one of ``target_module_names``
    (minLoRA's substring rule). An entry that selects no layer is a ``ValueError`` naming it.
    """
    names = name_tuple(target_module_names, "add_lora_by_name: target_module_names")
    candidates = _targets(model, lora_config, require_match=False)
    module_names = [name for name, _ in model.named_modules() if name]
    chosen: dict[Target, None] = {}
    for target in names:
        matched = [n for n in module_names if target in n]
        if not matched:
            raise LoRAValueError(
                f"add_lora_by_name: {target!r} matches no module name; names look like {module_names[:6]}"
            )
        # the matched modules and the layers inside them
        hits = [t for t in candidates if any(t[0] == m or t[0].startswith(m + ".") for m in matched)]
        if not hits:
            raise LoRAValueError(
                f"add_lora_by_name: {target!r} matches {matched[:4]} but none of them is or contains a "
                f"layer the LoRA config applies to"
            )
        # a dict: a layer two names select is adapted once
        chosen |= dict.fromkeys(hits)
    _add_targets(list(chosen), "add_lora_by_name")


def merge_lora(model: nn.Module) -> None:
    """Fold every LoRA into its weight (in fp32, then cast) and remove it; outputs stay the same. A weight
    shared with a layer not merged the same way (GPT-2's tied head) is untied (logged); layers sharing
    weight *and* update (:func:`minlora.tie_weights`) stay shared.
    """
    _unlora(model, True, lora_sites(model))


def remove_lora(model: nn.Module) -> None:
    """Drop every LoRA, restoring the original weights (ties included); other parametrizations stay."""
    _unlora(model, False, lora_sites(model))


@torch.no_grad()
def _unlora(model: nn.Module, merge: bool, sites: list[LoRASite]) -> None:
    if not merge:
        for site in sites:
            _drop_loras(site, None)
        return
    for site in sites:
        if site.lora_indices != list(range(len(site.lora_indices))):
            raise LoRAValueError(
                f"merge_lora: the LoRA on {site.name} follows another parametrization "
                f"({[type(p).__name__ for p in site.plist]}); it cannot be folded into the stored "
                f"weight. Remove the other parametrization first, or use remove_lora"
            )
    originals = [site.original for site in sites]
    # every merged value first, while all originals are untouched (GPT-2's head and embedding share one)
    values = [_merged_value(site) for site in sites]
    # id(original) -> the merged tensors made from it
    made: dict[int, list[nn.Parameter]] = {}
    for site, original, value in zip(sites, originals, values):
        _drop_loras(site, _merged_parameter(made, original, value))
    _warn_if_untied(model, sites, originals, made)


def _merged_value(site: LoRASite) -> torch.Tensor:
    """The stored weight with every LoRA of ``site`` folded in."""
    value = site.original
    for i in site.lora_indices:
        value = site.plist[i].merged(value)
    return value


def _merged_parameter(made: dict[int, list[nn.Parameter]], original: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    """A new ``Parameter`` holding ``value``, or the one already made from ``original`` with the same
    value: layers sharing weight and update (tie_weights) keep sharing one tensor.
    """
    known = made.setdefault(id(original), [])
    for param in known:
        if param.shape == value.shape and torch.equal(param, value):
            return param
    param = nn.Parameter(value, requires_grad=original.requires_grad)
    known.append(param)
    return param


def _drop_loras(site: LoRASite, merged: nn.Parameter | None) -> None:
    """Remove the LoRAs of ``site``; ``merged``, when given, becomes its stored weight."""
    plist, indices = site.plist, site.lora_indices
    # the parametrizations after the LoRA now apply to the merged weight
    if merged is not None:
        plist.original = merged
    if len(indices) == len(plist):
        # LoRA alone: the tensor becomes its stored one again, the merged weight when given
        parametrize.remove_parametrizations(site.module, site.tensor_name, leave_parametrized=False)
        return
    for i in reversed(indices):
        del plist[i]


def _warn_if_untied(model: nn.Module, sites: list[LoRASite], originals: list, made: dict) -> None:
    """Log the merged layers whose weight another layer still holds unmerged, or that merged differently."""
    kept = {id(t) for t in [*model.parameters(), *model.buffers()]}
    broken = [s.name for s, o in zip(sites, originals) if id(o) in kept or len(made[id(o)]) > 1]
    if broken:
        logger.warning(
            f"merge_lora: {broken} shared its weight with a layer not merged the same way; the merged layers got "
            f"their own weight and the others keep W: outputs are the LoRA model's but the weights are no longer tied"
        )
