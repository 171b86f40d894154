"""``LoRAConfig``: which layers get LoRA and with what settings. It feeds the machinery of minLoRA's dict configs
(``to_lora_config()``), adding name patterns, exclusions and switches for the embeddings and the LM head.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch.nn as nn
from torch.nn.utils import parametrize

from .errors import LoRAValueError
from .parametrization import LoRAParametrization, check_float, check_int, raw_weight

# Layer families LoRA adapts, with the constructor for each.
FAMILIES: dict[str, tuple[type, Callable[..., LoRAParametrization]]] = {
    "Linear": (nn.Linear, LoRAParametrization.from_linear),
    "Embedding": (nn.Embedding, LoRAParametrization.from_embedding),
    "Conv2d": (nn.Conv2d, LoRAParametrization.from_conv2d),
}


def family_name(layer: nn.Module | type) -> str | None:
    """``"Linear"``, ``"Embedding"``, ``"Conv2d"`` for a layer (or layer type) LoRA adapts, else None."""
    if isinstance(layer, type):
        layer_type = layer
    else:
        layer_type = parametrize.type_before_parametrizations(layer)
    for name, (family, _) in FAMILIES.items():
        if issubclass(layer_type, family):
            return name
    return None


def name_matches(name: str, pattern: str) -> bool:
    """A glob (``*?[``) over the full dotted name, or else the name or a dotted suffix of it."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def name_tuple(value: Any, what: str, *, empty_ok: bool = False) -> tuple[str, ...]:
    """``value`` (a name or pattern, or several) as a tuple; with ``empty_ok``, nothing is ``()``."""
    if empty_ok and not value:
        return ()
    if isinstance(value, str):
        value = (value,)
    else:
        value = tuple(value)
    if not value or not all(isinstance(v, str) and v for v in value):
        raise LoRAValueError(f"{what} must be one or more non-empty strings, got {value!r}")
    return value


def _lm_heads(model: nn.Module, head_names: tuple[str, ...]) -> set[int]:
    """The ids of ``model``'s LM heads: linear layers named so, or sharing an embedding's weight."""
    embedding_weights = {
        id(raw_weight(m)) for m in model.modules() if family_name(m) == "Embedding" and raw_weight(m) is not None
    }
    return {
        id(module)
        for name, module in model.named_modules()
        if family_name(module) == "Linear"
        and (id(raw_weight(module)) in embedding_weights or any(name_matches(name, h) for h in head_names))
    }


@dataclass
class LoRAConfig:
    """A layer gets LoRA when it is one of ``target_types`` (``include_embeddings`` adds ``nn.Embedding``), matches a
    ``target_modules`` pattern (all when None) and no ``exclude_modules`` one, and is not an LM head (a linear layer in
    ``lm_head_names`` or tied to an embedding) unless ``include_lm_head``. ``scaling = alpha / rank`` (``/ sqrt(rank)``
    with ``use_rslora``); ``use_dora``: DoRA, see :class:`LoRAParametrization`.
    """

    # rank r of the update B @ A
    rank: int = 8
    # the update is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)
    alpha: float = 16.0
    # dropout on the LoRA branch's input
    dropout: float = 0.0
    # name patterns of the layers to adapt (a glob, a name or a dotted suffix such as attn.c_attn); None = every
    # layer of the adapted types
    target_modules: tuple[str, ...] | None = None
    # layer types to adapt
    target_types: tuple[type, ...] = (nn.Linear,)
    # name patterns of layers never adapted
    exclude_modules: tuple[str, ...] = ()
    # also adapt embeddings (nn.Embedding)
    include_embeddings: bool = False
    # also adapt the LM head (a layer in lm_head_names, or one tied to an embedding)
    include_lm_head: bool = False
    # rank-stabilised scaling alpha / sqrt(rank)
    use_rslora: bool = False
    # DoRA: also learn a magnitude per output
    use_dora: bool = False
    # names of LM-head layers, skipped unless include_lm_head
    lm_head_names: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        # The one place the settings are checked: when the config is built, not at the first forward
        # (alpha=nan would make every logit NaN).
        check_int(self.rank, "LoRAConfig.rank")
        check_float(self.alpha, "LoRAConfig.alpha", low=0.0, low_open=True)
        check_float(self.dropout, "LoRAConfig.dropout", low=0.0, high=1.0)
        for flag in ("include_embeddings", "include_lm_head", "use_rslora", "use_dora"):
            if not isinstance(getattr(self, flag), bool):
                raise LoRAValueError(f"LoRAConfig.{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.target_modules is not None:
            self.target_modules = name_tuple(self.target_modules, "LoRAConfig.target_modules")
        for field in ("exclude_modules", "lm_head_names"):
            setattr(self, field, name_tuple(getattr(self, field), f"LoRAConfig.{field}", empty_ok=True))
        types = self.target_types
        if isinstance(types, (type, str)):
            types = (types,)
        # a family name ("Linear", as to_dict writes it) stands for its layer type
        self.target_types = tuple(FAMILIES[t][0] if isinstance(t, str) and t in FAMILIES else t for t in types)
        for t in self.target_types:
            if not isinstance(t, type) or family_name(t) is None:
                raise LoRAValueError(f"LoRAConfig.target_types: {t!r} is not supported; LoRA adapts {sorted(FAMILIES)}")

    @property
    def layer_types(self) -> tuple[type, ...]:
        types = tuple(self.target_types)
        if self.include_embeddings and nn.Embedding not in types:
            types += (nn.Embedding,)
        return types

    def factory(self, layer_type: type) -> Callable[[nn.Module], LoRAParametrization]:
        settings = dict(lora_dropout_p=float(self.dropout), lora_alpha=self.alpha, use_rslora=self.use_rslora)
        return partial(FAMILIES[family_name(layer_type)][1], rank=self.rank, use_dora=self.use_dora, **settings)

    def to_lora_config(self) -> dict[type, dict[str, Callable[[nn.Module], LoRAParametrization]]]:
        """minLoRA's dict form (types only: name patterns and the head switch are not expressible)."""
        return {t: {"weight": self.factory(t)} for t in self.layer_types}

    def targets(self, model: nn.Module, require_match: bool = True) -> list[tuple[str, nn.Module, str, Callable]]:
        """``(name, module, "weight", factory)`` for every layer this config selects; with
        ``require_match``, a pattern or a config that selects nothing is a ``ValueError`` saying why.
        """
        heads = _lm_heads(model, self.lm_head_names)
        selected = []
        for name, module in model.named_modules():
            layer_type = parametrize.type_before_parametrizations(module)
            if not issubclass(layer_type, self.layer_types) or any(name_matches(name, p) for p in self.exclude_modules):
                continue
            # an LM head only with include_lm_head
            if id(module) in heads and not self.include_lm_head:
                continue
            if self.target_modules is None or any(name_matches(name, p) for p in self.target_modules):
                selected.append((name, module, "weight", self.factory(layer_type)))
        if require_match:
            self._check_selection(model, selected, heads)
        return selected

    def _check_selection(self, model: nn.Module, selected: list, heads: set[int]) -> None:
        """Every ``target_modules`` pattern selected a layer, and the config selected one at all."""
        for pattern in self.target_modules or ():
            if not any(name_matches(name, pattern) for name, *_ in selected):
                raise LoRAValueError(self._explain_no_match(model, pattern, heads))
        if not selected:
            raise LoRAValueError(
                f"LoRAConfig selects no layer of this {type(model).__name__}: target_types="
                f"{[t.__name__ for t in self.layer_types]}, target_modules={self.target_modules}, "
                f"exclude_modules={self.exclude_modules}, include_lm_head={self.include_lm_head}"
            )

    def _explain_no_match(self, model: nn.Module, pattern: str, heads: set[int]) -> str:
        what = f"LoRAConfig.target_modules: {pattern!r} matches"
        named = [(n, m) for n, m in model.named_modules() if n and name_matches(n, pattern)]
        if not named:
            some = [n for n, m in model.named_modules() if n and family_name(m)][:6]
            return f"{what} no module of this {type(model).__name__}; adaptable layers are named like {some}"
        name, module = named[0]
        if id(module) in heads and not self.include_lm_head:
            return f"{what} only the LM head {name!r}; set include_lm_head=True to adapt it"
        if family_name(module) == "Embedding" and not self.include_embeddings:
            return f"{what} the embedding {name!r}; set include_embeddings=True to adapt embeddings"
        return (
            f"{what} {[n for n, _ in named[:4]]}, but each is excluded or not one of target_types (a parent's "
            f"name does not select its children: use a glob such as '*{pattern}.*')"
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields, layer types by family name (``"Linear"``): what :meth:`from_dict` takes, JSON included."""
        return dataclasses.asdict(self) | {"target_types": [family_name(t) for t in self.target_types]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoRAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(data) - known:
            raise LoRAValueError(
                f"unknown LoRAConfig field(s) {sorted(set(data) - known)}; known fields: {sorted(known)}"
            )
        return cls(**data)
