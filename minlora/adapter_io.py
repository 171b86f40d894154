"""What minlora's two adapter formats share (:mod:`minlora.adapters`, :mod:`minlora.peft`).

* Files: :class:`AdapterFileError`, reading JSON / safetensors so that a damaged file gets an error
  naming it, atomic writes (temp file + ``os.replace``), checks of the stored factors and values.
* Loading all-or-nothing: each format turns its files into :class:`LoadPlan` s (one per adapted
  tensor); :func:`apply_plans` checks every plan against the model before it changes anything.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from torch.nn.utils import parametrize

from .model import LoRASite, has_lora, lora_sites, register_lora
from .parametrization import LoRAParametrization

logger = logging.getLogger(__name__)

FAMILIES = {"Linear": nn.Linear, "Embedding": nn.Embedding, "Conv2d": nn.Conv2d}
# What reading a damaged safetensors file raises (the message says what is wrong with it).
_SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


class AdapterFileError(ValueError):
    """An adapter file that cannot be used: unreadable, truncated, damaged, or not matching its pair.

    The message names the file, what is wrong with it and what to do.
    """


# ---------------------------------------------------------------------- layers
def family_name(module: nn.Module) -> str | None:
    layer_type = parametrize.type_before_parametrizations(module)
    for name, family in FAMILIES.items():
        if issubclass(layer_type, family):
            return name
    return None


def single_lora(site: LoRASite, what: str) -> LoRAParametrization:
    if len(site.lora_indices) != 1:
        raise ValueError(f"{what}: {site.name} carries {len(site.lora_indices)} LoRAs; expected one")
    return site.lora


def get_module(model: nn.Module, module_name: str, source: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        some = [n for n, m in model.named_modules() if n and family_name(m)][:6]
        raise ValueError(
            f"{source} targets {module_name!r} but this {type(model).__name__} has no such module "
            f"(layers are named like {some}); was the adapter made for another model shape?"
        ) from None


def fans(module: nn.Module, family: str, weight: torch.Tensor) -> tuple[int, int, bool]:
    if family == "Embedding":
        return weight.shape[0], weight.shape[1], True  # (num_embeddings, dim)
    return weight.reshape(weight.shape[0], -1).shape[1], weight.shape[0], False  # (out, in[*kh*kw])


# ---------------------------------------------------------------------- values
def is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def is_alpha(v: Any) -> bool:
    """A usable ``lora_alpha``: a finite, non-zero number (``bool`` is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v != 0


def is_dropout(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1


def check_store_dtype(dtype: Any, caller: str) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{caller}: dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")


# ---------------------------------------------------------------------- files
def json_text(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_new_file(tmp: Path, write) -> None:
    """``write(tmp)``; on any failure ``tmp`` is removed, so no half-written ``.tmp`` is left behind."""
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, write) -> None:
    """``write(tmp)`` next to ``path``, then rename it into place: ``path`` is the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    write_new_file(tmp, write)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path, caller: str, remedy: str) -> dict[str, Any]:
    """The JSON object in ``path``, or :class:`AdapterFileError` (never a bare ``JSONDecodeError``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise AdapterFileError(f"{caller}: {path} is not UTF-8 text ({e.reason}); {remedy}") from None
    except json.JSONDecodeError as e:
        raise AdapterFileError(
            f"{caller}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); the file is damaged "
            f"or truncated; {remedy}"
        ) from None
    if not isinstance(data, dict):
        raise AdapterFileError(f"{caller}: {path} must hold a JSON object, got {type(data).__name__}; {remedy}")
    return data


def read_safetensors(path: Path, caller: str, remedy: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file, or :class:`AdapterFileError` for a damaged one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except _SAFETENSORS_ERRORS as e:
        raise AdapterFileError(
            f"{caller}: {path} is not a readable safetensors file ({type(e).__name__}: {e}); the file is damaged "
            f"or truncated; {remedy}"
        ) from None
    return tensors, metadata


def check_factor_values(tensors: dict[str, torch.Tensor], path: Path, caller: str, remedy: str) -> None:
    """Every factor floating-point and finite: a NaN / inf factor would make every output NaN."""
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterFileError(f"{caller}: {path}: {key} has dtype {t.dtype}, not a floating-point one; {remedy}")
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise AdapterFileError(
                f"{caller}: {path}: {key} holds {bad} NaN/inf value(s) (the adapter diverged in training or the file "
                f"is damaged); {remedy}"
            )


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The metadata of a safetensors file, None when the file cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except _SAFETENSORS_ERRORS:
        return None


# ---------------------------------------------------------------------- loading into a model
class LoadPlan:
    """One target to load: where, with which hyper-parameters and factors (validated before any change)."""

    def __init__(self, module_name: str, module: nn.Module, tensor_name: str, *, rank: int, lora_alpha: float,
                 use_rslora: bool, dropout: float, fan_in: int, fan_out: int, fan_in_fan_out: bool,
                 lora_A: torch.Tensor, lora_B: torch.Tensor) -> None:
        self.module_name, self.module, self.tensor_name = module_name, module, tensor_name
        self.rank, self.lora_alpha, self.use_rslora, self.dropout = rank, lora_alpha, use_rslora, dropout
        self.fan_in, self.fan_out, self.fan_in_fan_out = fan_in, fan_out, fan_in_fan_out
        self.lora_A, self.lora_B = lora_A, lora_B

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.tensor_name}" if self.module_name else self.tensor_name


def apply_plans(model: nn.Module, plans: list[LoadPlan], source: str, strict: bool) -> None:
    """Check every plan (and, with ``strict``, that they cover the model's LoRA sites) before
    changing anything, so a bad adapter never leaves the model half-loaded; then apply them."""
    for plan in plans:
        _check_plan(plan, source)
    if strict:
        _check_strict(model, plans, source)
    for plan in plans:
        _apply_plan(plan, source)


def _check_plan(plan: LoadPlan, source: str) -> None:
    """Rank / layout / shape agreement with a LoRA the model already has, and factor shapes."""
    a_shape = (plan.fan_in, plan.rank) if plan.fan_in_fan_out else (plan.rank, plan.fan_in)
    b_shape = (plan.rank, plan.fan_out) if plan.fan_in_fan_out else (plan.fan_out, plan.rank)
    if tuple(plan.lora_A.shape) != a_shape or tuple(plan.lora_B.shape) != b_shape:
        raise ValueError(
            f"{source}: factors for {plan.name} have shapes lora_A {tuple(plan.lora_A.shape)}, lora_B "
            f"{tuple(plan.lora_B.shape)}; this layer needs {a_shape} and {b_shape} at rank {plan.rank}"
        )
    if has_lora(plan.module, plan.tensor_name):
        site = LoRASite(plan.module_name, plan.module, plan.tensor_name)
        lora = single_lora(site, source)
        if lora.rank != plan.rank:
            raise ValueError(
                f"{source}: the adapter has rank {plan.rank} for {plan.name} but the model's LoRA there has rank "
                f"{lora.rank}; call minlora.remove_lora(model) and load again (loading into a model without LoRA "
                f"adds LoRA at the adapter's rank), or add LoRA with rank={plan.rank}"
            )
        if (lora.fan_in, lora.fan_out, lora.fan_in_fan_out) != (plan.fan_in, plan.fan_out, plan.fan_in_fan_out):
            raise ValueError(
                f"{source}: the adapter's LoRA for {plan.name} is (fan_in={plan.fan_in}, fan_out={plan.fan_out}, "
                f"fan_in_fan_out={plan.fan_in_fan_out}) but the model's is (fan_in={lora.fan_in}, "
                f"fan_out={lora.fan_out}, fan_in_fan_out={lora.fan_in_fan_out})"
            )


@torch.no_grad()
def _apply_plan(plan: LoadPlan, source: str) -> None:
    if has_lora(plan.module, plan.tensor_name):
        lora = LoRASite(plan.module_name, plan.module, plan.tensor_name).lora
        scaling = LoRAParametrization.compute_scaling(plan.lora_alpha, plan.rank, plan.use_rslora)
        if not math.isclose(scaling, lora.scaling, rel_tol=1e-6):
            logger.info(
                "%s: %s scaling %g -> %g (lora_alpha=%g, use_rslora=%s), as the adapter was trained with",
                source, plan.name, lora.scaling, scaling, plan.lora_alpha, plan.use_rslora,
            )
        lora.set_scaling(plan.lora_alpha, plan.use_rslora)
    else:
        lora = LoRAParametrization(plan.fan_in, plan.fan_out, plan.fan_in_fan_out, rank=plan.rank,
                                   lora_dropout_p=plan.dropout, lora_alpha=plan.lora_alpha,
                                   use_rslora=plan.use_rslora)
        register_lora(plan.module, plan.tensor_name, lora)
    lora.lora_A.copy_(plan.lora_A)
    lora.lora_B.copy_(plan.lora_B)


def _check_strict(model: nn.Module, plans: list[LoadPlan], source: str) -> None:
    loaded = {p.name for p in plans}
    extra = [s.name for s in lora_sites(model) if s.name not in loaded]
    if extra:
        raise ValueError(
            f"{source}: the model has LoRA on {len(extra)} tensor(s) the adapter does not cover, e.g. {extra[:3]}; "
            f"pass strict=False to load anyway (those keep their current factors) or remove_lora(model) first"
        )
