"""``LoRAConfig``: which layers get LoRA and with what rank, for humans.

It feeds the same machinery as minLoRA's dict configs (``LoRAConfig.to_lora_config()`` gives the
dict), adding name patterns, exclusions and explicit switches for the embeddings and the LM head.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch.nn as nn
from torch.nn.utils import parametrize

from .parametrization import LoRAParametrization, check_finite_number, check_positive_int

__all__ = ["LoRAConfig"]

# Layer families LoRA knows how to adapt, with the constructor for each.
_FACTORIES: dict[type, Callable[..., LoRAParametrization]] = {
    nn.Linear: LoRAParametrization.from_linear,
    nn.Embedding: LoRAParametrization.from_embedding,
    nn.Conv2d: LoRAParametrization.from_conv2d,
}
_TYPE_NAMES = {"Linear": nn.Linear, "Embedding": nn.Embedding, "Conv2d": nn.Conv2d}


def _family(layer_type: type) -> type | None:
    for family in _FACTORIES:
        if issubclass(layer_type, family):
            return family
    return None


def name_matches(name: str, pattern: str) -> bool:
    """``pattern`` with ``*``, ``?`` or ``[`` is a glob over the full dotted name
    (``"transformer.h.*.attn.c_attn"``); otherwise it matches the name or a dotted suffix of it
    (``"c_proj"`` matches ``transformer.h.0.attn.c_proj`` and ``transformer.h.0.mlp.c_proj``)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def _as_patterns(value: Any, field_name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"LoRAConfig.{field_name} must be non-empty strings (name patterns), got {value!r}")
    return value


@dataclass
class LoRAConfig:
    """Which layers get LoRA, and its hyper-parameters.

    A layer gets LoRA when it is an instance of one of ``target_types`` (``nn.Embedding`` joins
    them with ``include_embeddings``), matches one of ``target_modules`` (all layers when None),
    matches none of ``exclude_modules``, and is not an LM head unless ``include_lm_head``. The LM
    head is a linear layer named ``lm_head`` or whose weight is tied to an embedding's; with
    GPT-2's tied weights, LoRA on the head adapts the output projection only (the embedding keeps
    ``W``), see docs/lora.md. Patterns follow :func:`name_matches`.

    ``scaling = alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``). The defaults, rank 8
    and alpha 16 (scaling 2), are a common starting point for fine-tuning GPT-2-sized models.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None
    target_types: tuple[type, ...] = (nn.Linear,)
    exclude_modules: tuple[str, ...] = ()
    include_embeddings: bool = False
    include_lm_head: bool = False
    use_rslora: bool = False
    lm_head_names: tuple[str, ...] = field(default=("lm_head",))

    def __post_init__(self) -> None:
        # Checked here, when the config is built, not at the first forward: alpha=nan would make
        # every logit NaN (and `nan <= 0` is False, hence math.isfinite in these checks).
        check_positive_int(self.rank, "LoRAConfig.rank")
        check_finite_number(self.alpha, "LoRAConfig.alpha", low=0.0, low_open=True, high=None)
        check_finite_number(self.dropout, "LoRAConfig.dropout", low=0.0, high=1.0)
        for flag in ("include_embeddings", "include_lm_head", "use_rslora"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"LoRAConfig.{flag} must be True or False, got {getattr(self, flag)!r}")
        self.target_modules = _as_patterns(self.target_modules, "target_modules")
        self.exclude_modules = _as_patterns(self.exclude_modules, "exclude_modules") if self.exclude_modules else ()
        self.lm_head_names = _as_patterns(self.lm_head_names, "lm_head_names") if self.lm_head_names else ()
        types = self.target_types
        if isinstance(types, type) or isinstance(types, str):
            types = (types,)
        resolved = []
        for t in types:
            if isinstance(t, str):
                if t not in _TYPE_NAMES:
                    raise ValueError(
                        f"LoRAConfig.target_types: unknown type name {t!r}; use one of {sorted(_TYPE_NAMES)}"
                    )
                t = _TYPE_NAMES[t]
            if not isinstance(t, type) or _family(t) is None:
                raise ValueError(
                    f"LoRAConfig.target_types: {t!r} is not supported; LoRA adapts subclasses of "
                    f"{[f.__name__ for f in _FACTORIES]}"
                )
            resolved.append(t)
        self.target_types = tuple(resolved)

    # ------------------------------------------------------------------ machinery
    @property
    def layer_types(self) -> tuple[type, ...]:
        types = tuple(self.target_types)
        if self.include_embeddings and nn.Embedding not in types:
            types += (nn.Embedding,)
        return types

    def factory(self, layer_type: type) -> Callable[[nn.Module], LoRAParametrization]:
        family = _family(layer_type)
        if family is None:
            raise ValueError(f"LoRA cannot adapt a {layer_type.__name__}")
        return partial(_FACTORIES[family], rank=self.rank, lora_dropout_p=float(self.dropout),
                       lora_alpha=self.alpha, use_rslora=self.use_rslora)

    def to_lora_config(self) -> dict[type, dict[str, Callable[[nn.Module], LoRAParametrization]]]:
        """minLoRA's dict form (types only: name patterns and the head switch are not expressible)."""
        return {t: {"weight": self.factory(t)} for t in self.layer_types}

    def targets(self, model: nn.Module, require_match: bool = True) -> list[tuple[str, nn.Module, str, Callable]]:
        """``(name, module, "weight", factory)`` for every layer of ``model`` this config selects.

        With ``require_match``, raises ``ValueError`` when a ``target_modules`` pattern selects
        nothing (saying why: wrong name, wrong type, the head or an exclusion) or when no layer at all
        is selected.
        """
        heads = lm_head_ids(model, self.lm_head_names)
        types = self.layer_types
        selected = []
        pattern_hits: dict[str, int] = {p: 0 for p in self.target_modules or ()}
        for name, module in model.named_modules():
            layer_type = parametrize.type_before_parametrizations(module)
            if not issubclass(layer_type, types):
                continue
            if any(name_matches(name, p) for p in self.exclude_modules):
                continue
            if id(module) in heads and not self.include_lm_head:
                continue
            if self.target_modules is not None:
                hits = [p for p in self.target_modules if name_matches(name, p)]
                if not hits:
                    continue
                for p in hits:
                    pattern_hits[p] += 1
            selected.append((name, module, "weight", self.factory(layer_type)))
        if require_match:
            for pattern, count in pattern_hits.items():
                if count == 0:
                    raise ValueError(self._explain_no_match(model, pattern, heads))
            if not selected:
                raise ValueError(
                    f"LoRAConfig selects no layer of this {type(model).__name__}: target_types="
                    f"{[t.__name__ for t in types]}, target_modules={self.target_modules}, "
                    f"exclude_modules={self.exclude_modules}, include_lm_head={self.include_lm_head}"
                )
        return selected

    def _explain_no_match(self, model: nn.Module, pattern: str, heads: set[int]) -> str:
        named = [(n, m) for n, m in model.named_modules() if n and name_matches(n, pattern)]
        if not named:
            some = [n for n, m in model.named_modules() if n and _family(parametrize.type_before_parametrizations(m))]
            return (
                f"LoRAConfig.target_modules: {pattern!r} matches no module of this {type(model).__name__}; "
                f"adaptable layers are named like {some[:6]}"
            )
        name, module = named[0]
        layer_type = parametrize.type_before_parametrizations(module)
        if id(module) in heads and not self.include_lm_head:
            return (
                f"LoRAConfig.target_modules: {pattern!r} matches only the LM head {name!r}; "
                f"set include_lm_head=True to adapt it"
            )
        if issubclass(layer_type, nn.Embedding) and not issubclass(layer_type, self.layer_types):
            return (
                f"LoRAConfig.target_modules: {pattern!r} matches the embedding {name!r}; "
                f"set include_embeddings=True to adapt embeddings"
            )
        if any(name_matches(name, p) for p in self.exclude_modules):
            return f"LoRAConfig.target_modules: {pattern!r} matches {name!r}, which exclude_modules removes"
        return (
            f"LoRAConfig.target_modules: {pattern!r} matches {[n for n, _ in named[:4]]}, but none is a layer of "
            f"target_types {[t.__name__ for t in self.layer_types]} (a parent module's name does not "
            f"select its children: use a glob such as '{pattern}.*')"
        )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["target_types"] = [_family(t).__name__ for t in self.target_types]  # type: ignore[union-attr]
        for key in ("target_modules", "exclude_modules", "lm_head_names"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoRAConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown LoRAConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def raw_weight(module: nn.Module):
    """The stored weight tensor of ``module`` (the original under a parametrization), or None."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations["weight"].original
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, nn.Parameter) else None


def lm_head_ids(model: nn.Module, head_names: tuple[str, ...] = ("lm_head",)) -> set[int]:
    """``id`` of every linear layer that is an LM head: named in ``head_names`` or tied to an embedding."""
    embedding_weights = set()
    for module in model.modules():
        if issubclass(parametrize.type_before_parametrizations(module), nn.Embedding):
            w = raw_weight(module)
            if w is not None:
                embedding_weights.add(id(w))
    heads = set()
    for name, module in model.named_modules():
        if not issubclass(parametrize.type_before_parametrizations(module), nn.Linear):
            continue
        w = raw_weight(module)
        if (w is not None and id(w) in embedding_weights) or any(
            name == h or name.endswith("." + h) for h in head_names
        ):
            heads.add(id(module))
    return heads
