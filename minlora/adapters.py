"""minlora's adapter files (:func:`save_adapter` / :func:`load_adapter`), and the file handling and
all-or-nothing loading that PEFT interop (:mod:`minlora.peft`) shares with them.

An adapter is one safetensors file, ``adapter.safetensors``: tensors ``<module>.<tensor>.lora_A`` /
``.lora_B``, and under the metadata key ``"minlora"`` the config as JSON (per target: layer type,
weight shape, rank, alpha, rsLoRA, dropout; pairs tied with :func:`minlora.tie_weights`). One file
renamed into place cannot be caught half-written or mixed with another save. Adapters of minlora
0.1 (``minlora_adapter.json`` + ``minlora_adapter.safetensors``) still load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import FAMILIES, family_name, raw_weight
from .model import LoRASite, has_lora, lora_sites, register_lora
from .parametrization import LoRAParametrization
from .utils import tie_weights

ADAPTER_FILE_NAME = "adapter.safetensors"
LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME = "minlora_adapter.json", "minlora_adapter.safetensors"
_FORMAT, _VERSION = "minlora.adapter", 2  # version 1: the two-file layout of minlora 0.1
_REMEDY = "save the adapter again with minlora.save_adapter"
# What reading a damaged safetensors file raises (the message says what is wrong with it).
_SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


class AdapterFileError(ValueError):
    """An adapter file that cannot be used: unreadable, truncated, damaged, inconsistent. The message
    names the file, what is wrong and what to do."""


# ---------------------------------------------------------------------- files
def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` beside ``path``, fsync, rename over ``path``: ``path`` is the old file or the new
    one, never a torn one. A stale ``.tmp`` of a crashed save is replaced."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the rename makes it the file
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def parse_json(source: Path | str, where: Any, caller: str, remedy: str) -> dict[str, Any]:
    """The JSON object in a file (a ``Path``) or a string, else :class:`AdapterFileError` naming ``where``."""
    try:
        data = json.loads(source.read_text(encoding="utf-8") if isinstance(source, Path) else source)
    except UnicodeDecodeError as e:
        raise AdapterFileError(f"{caller}: {where} is not UTF-8 text ({e.reason}); {remedy}") from None
    except json.JSONDecodeError as e:
        raise AdapterFileError(f"{caller}: {where} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                               f"the file is damaged or truncated; {remedy}") from None
    if not isinstance(data, dict):
        raise AdapterFileError(f"{caller}: {where} must hold a JSON object, got {type(data).__name__}; {remedy}")
    return data


def read_safetensors(path: Path, caller: str, remedy: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})
    except _SAFETENSORS_ERRORS as e:
        raise AdapterFileError(f"{caller}: {path} is not a readable safetensors file ({type(e).__name__}: {e}); "
                               f"the file is damaged or truncated; {remedy}") from None


def check_values(tensors: dict[str, torch.Tensor], where: Any, caller: str, remedy: str) -> None:
    """Every tensor floating-point and finite: one NaN / inf factor makes every output NaN."""
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterFileError(f"{caller}: {where}: {key} has dtype {t.dtype}, not a floating-point one; {remedy}")
        if not torch.isfinite(t).all():
            raise AdapterFileError(f"{caller}: {where}: {key} holds {int((~torch.isfinite(t)).sum())} NaN/inf "
                                   f"value(s) (training diverged, or the file is damaged); {remedy}")


def check_store_dtype(dtype: Any, caller: str) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{caller}: dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")


# ---------------------------------------------------------------------- loading, all or nothing
@dataclass
class Plan:
    """One tensor to load: where, and a LoRA built from the file (checked before the model changes)."""

    module_name: str
    module: nn.Module
    tensor_name: str
    lora: LoRAParametrization

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.tensor_name}" if self.module_name else self.tensor_name


def get_module(model: nn.Module, module_name: str, source: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        some = [n for n, m in model.named_modules() if n and family_name(m)][:6]
        raise ValueError(f"{source} targets {module_name!r} but this {type(model).__name__} has no such module "
                         f"(layers are named like {some}); was the adapter made for another model shape?") from None


@torch.no_grad()
def make_plan(module_name: str, module: nn.Module, tensor_name: str, source: str, tensors: dict[str, torch.Tensor],
              fan_in: int, fan_out: int, fan_in_fan_out: bool, rank: int, lora_alpha: float, use_rslora: bool = False,
              dropout: float = 0.0) -> Plan:
    lora = LoRAParametrization(fan_in, fan_out, fan_in_fan_out, rank, dropout, lora_alpha, use_rslora=use_rslora)
    plan = Plan(module_name, module, tensor_name, lora)
    for pname, value in tensors.items():
        param = getattr(lora, pname)
        if value.shape != param.shape:
            raise ValueError(f"{source}: the adapter's {pname} for {plan.name} has shape {tuple(value.shape)}; at rank "
                             f"{rank} this layer needs {tuple(param.shape)}")
        param.copy_(value)
    return plan


def single_lora(site: LoRASite, caller: str) -> LoRAParametrization:
    if len(site.lora_indices) != 1:
        raise ValueError(f"{caller}: {site.name} carries {len(site.lora_indices)} LoRAs; expected one")
    return site.lora


def check_plans(model: nn.Module, plans: list[Plan], source: str, strict: bool) -> None:
    """Everything that could stop a load, checked before anything changes."""
    for plan in plans:
        if not has_lora(plan.module, plan.tensor_name):
            continue
        new, old = plan.lora, single_lora(LoRASite(plan.module_name, plan.module, plan.tensor_name), source)
        if old.rank != new.rank:
            raise ValueError(f"{source}: the adapter has rank {new.rank} for {plan.name} but the model's LoRA there has "
                             f"rank {old.rank}; call minlora.remove_lora(model) and load again (loading into a model "
                             f"without LoRA adds it at the adapter's rank), or add LoRA with rank={new.rank}")
        if (old.fan_in, old.fan_out, old.fan_in_fan_out) != (new.fan_in, new.fan_out, new.fan_in_fan_out):
            raise ValueError(f"{source}: the adapter's LoRA for {plan.name} has (fan_in, fan_out, fan_in_fan_out) = "
                             f"{(new.fan_in, new.fan_out, new.fan_in_fan_out)}, the model's "
                             f"{(old.fan_in, old.fan_out, old.fan_in_fan_out)}")
    extra = [s.name for s in lora_sites(model) if s.name not in {p.name for p in plans}]
    if strict and extra:
        raise ValueError(f"{source}: the model has LoRA on {len(extra)} tensor(s) the adapter does not cover, e.g. "
                         f"{extra[:3]}; pass strict=False to load anyway (those keep their factors) or remove_lora first")


@torch.no_grad()
def apply_plans(plans: list[Plan]) -> None:
    for plan in plans:
        if not has_lora(plan.module, plan.tensor_name):
            register_lora(plan.module, plan.tensor_name, plan.lora)
            continue
        lora = LoRASite(plan.module_name, plan.module, plan.tensor_name).lora
        lora.set_scaling(plan.lora.lora_alpha, plan.lora.use_rslora)  # the adapter was trained with its own
        for pname in lora.param_names:
            getattr(lora, pname).copy_(getattr(plan.lora, pname))


# ---------------------------------------------------------------------- minlora's format
def save_adapter(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write the LoRA of ``model`` and its config to ``path``: a directory (``adapter.safetensors``
    inside) or a ``.safetensors`` file path; returns ``path``. ``dtype`` stores the factors in
    another precision (``torch.bfloat16`` halves the file). The file is replaced atomically."""
    check_store_dtype(dtype, "save_adapter")
    sites = lora_sites(model)
    if not sites:
        raise ValueError("save_adapter: the model has no LoRA to save; call minlora.add_lora(model) first")
    path = Path(path)
    file = path if path.suffix == ".safetensors" else path / ADAPTER_FILE_NAME
    if path.exists() and not path.is_dir() and file == path / ADAPTER_FILE_NAME:
        raise ValueError(f"save_adapter: {path} exists and is not a directory; pass a directory or a .safetensors path")
    tensors, targets = {}, {}
    for site in sites:
        lora = single_lora(site, "save_adapter")
        if family_name(site.module) is None:
            raise ValueError(f"save_adapter: {site.name} is a {type(site.module).__name__}, not one of {sorted(FAMILIES)}")
        targets[site.name] = {
            "layer": family_name(site.module), "weight_shape": list(site.original.shape), "fan_in": lora.fan_in,
            "fan_out": lora.fan_out, "fan_in_fan_out": lora.fan_in_fan_out, "rank": lora.rank,
            "lora_alpha": lora.lora_alpha, "use_rslora": lora.use_rslora, "lora_dropout_p": lora.lora_dropout_p,
        }
        for pname in lora.param_names:
            # clone: safetensors refuses tensors sharing memory (tie_weights shares factors)
            tensors[f"{site.name}.{pname}"] = getattr(lora, pname).detach().to(dtype).cpu().contiguous().clone()
    ties = [{"linear": a.name, "embedding": b.name} for a in sites for b in sites
            if b.lora.lora_A is a.lora.lora_B and b.lora.lora_B is a.lora.lora_A and not a.lora.fan_in_fan_out]
    config = {"format": _FORMAT, "format_version": _VERSION, "targets": targets, "tied": ties,
              "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch.")}
    file.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "minlora": json.dumps(config, sort_keys=True)}
    write_atomic(file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    for old in (LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME, LEGACY_WEIGHTS_NAME + ".prev"):
        (file.parent / old).unlink(missing_ok=True)  # a 0.1 pair left beside it would only confuse
    return path


def _is_number(v: Any, low: float | None = None, high: float | None = None, integer: bool = False) -> bool:
    return (isinstance(v, int) if integer else isinstance(v, (int, float))) and not isinstance(v, bool) \
        and math.isfinite(v) and (low is None or v >= low) and (high is None or v < high)


# A target entry: key -> (check, what it must be, required)
_TARGET_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "layer": (lambda v: v in FAMILIES, f"one of {sorted(FAMILIES)}", True),
    "weight_shape": (lambda v: isinstance(v, list) and bool(v) and all(_is_number(d, 1, integer=True) for d in v),
                     "a list of positive integers", True),
    "fan_in": (lambda v: _is_number(v, 1, integer=True), "a positive integer", True),
    "fan_out": (lambda v: _is_number(v, 1, integer=True), "a positive integer", True),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false", True),
    "rank": (lambda v: _is_number(v, 1, integer=True), "a positive integer", True),
    "lora_alpha": (lambda v: _is_number(v) and v != 0, "a finite, non-zero number", True),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false", False),
    "lora_dropout_p": (lambda v: _is_number(v, 0, 1), "a number in [0, 1)", False),
}


def _check_config(config: dict[str, Any], where: Any) -> None:
    def fail(what: str) -> None:
        raise AdapterFileError(f"load_adapter: {where}: {what}; {_REMEDY}")

    if config.get("format") != _FORMAT:
        raise AdapterFileError(f"load_adapter: {where} has format={config.get('format')!r}, not {_FORMAT!r}: it is not "
                               f"a minlora adapter (a PEFT adapter goes to minlora.import_peft_adapter)")
    version = config.get("format_version")
    if version not in (1, _VERSION):
        newer = _is_number(version, _VERSION, integer=True)
        fail(f"format_version={version!r}; this minlora reads versions 1 and {_VERSION}"
             + ("; upgrade minlora to load it" if newer else ""))
    dtype = getattr(torch, str(config.get("dtype")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail(f"dtype must name a floating-point torch dtype, got {config.get('dtype')!r}")
    targets = config.get("targets")
    if not isinstance(targets, dict) or not targets:
        fail(f"'targets' must be a non-empty object, got {targets!r}")
    for name, spec in targets.items():
        if not isinstance(spec, dict):
            fail(f"targets[{name!r}] must be an object")
        for key, (ok, what, required) in _TARGET_FIELDS.items():
            if key not in spec and required:
                fail(f"targets[{name!r}] lacks the field {key!r}")
            if key in spec and not ok(spec[key]):
                fail(f"targets[{name!r}].{key} must be {what}, got {spec[key]!r}")
    tied = config.get("tied", [])
    if not isinstance(tied, list) or not all(isinstance(t, dict) and set(t) == {"linear", "embedding"} and all(
            isinstance(v, str) and v in targets for v in t.values()) for t in tied):
        fail(f"each 'tied' entry must be {{\"linear\": <target>, \"embedding\": <target>}} naming two targets, "
             f"got {tied!r}")


def _legacy_weights(directory: Path, config: dict[str, Any]) -> Path:
    """The weights that belong with a minlora 0.1 config: the files share a save id. A 0.1 save that
    crashed halfway left the previous weights, still matching the config, in ``.prev``."""
    weights, previous = directory / LEGACY_WEIGHTS_NAME, directory / (LEGACY_WEIGHTS_NAME + ".prev")
    save_id = config.get("save_id")
    if save_id is None or not weights.is_file():
        return weights
    ids = {}
    for candidate in (weights, previous):
        try:
            with safe_open(str(candidate), framework="pt") as f:
                ids[candidate] = (f.metadata() or {}).get("minlora_save_id", "without a save id")
        except _SAFETENSORS_ERRORS:
            pass  # missing, or damaged: the reader says how if it is the one used
        if ids.get(candidate) == save_id:
            return candidate
    if weights not in ids:
        return weights
    raise AdapterFileError(f"load_adapter: {weights} (save {ids[weights]}) and {directory / LEGACY_CONFIG_NAME} (save "
                           f"{save_id}) come from two different saves (files copied by hand?); copy both files of one "
                           f"save, or {_REMEDY}")


def load_adapter(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` (a directory or the file) into ``model``.

    Layers without LoRA get one with the adapter's settings; layers with LoRA must have its rank
    (their scaling becomes the adapter's). Everything is checked before the model changes: a
    missing target, a shape or rank mismatch, NaN/inf factors, a tied pair that does not fit and,
    with ``strict``, model LoRA the adapter does not cover raise ``ValueError``; a damaged file
    raises :class:`AdapterFileError` naming it.
    """
    path = Path(path)
    file = path / ADAPTER_FILE_NAME if path.is_dir() else path
    if file.is_file():
        tensors, metadata = read_safetensors(file, "load_adapter", _REMEDY)
        if "minlora" not in metadata:
            raise AdapterFileError(f"load_adapter: {file} has no minlora config in its metadata: it is not a minlora "
                                   f"adapter (a PEFT adapter goes to minlora.import_peft_adapter); {_REMEDY}")
        where = file
        config = parse_json(metadata["minlora"], f"{file} (its 'minlora' metadata)", "load_adapter", _REMEDY)
        _check_config(config, where)
    elif (path / LEGACY_CONFIG_NAME).is_file():
        where = path / LEGACY_CONFIG_NAME
        config = parse_json(where, where, "load_adapter", _REMEDY)
        _check_config(config, where)
        file = _legacy_weights(path, config)
        if not file.is_file():
            raise FileNotFoundError(f"load_adapter: {path} has {LEGACY_CONFIG_NAME} but no {LEGACY_WEIGHTS_NAME}")
        tensors, _ = read_safetensors(file, "load_adapter", _REMEDY)
    else:
        peft = " (it holds a PEFT adapter: use minlora.import_peft_adapter)" if (path / "adapter_config.json").is_file() \
            else ""
        raise FileNotFoundError(f"load_adapter: {path} must contain {ADAPTER_FILE_NAME} (or, from minlora 0.1, "
                                f"{LEGACY_CONFIG_NAME} and {LEGACY_WEIGHTS_NAME}){peft}")
    source = f"load_adapter({path})"
    names = {name: ("lora_A", "lora_B") for name in config["targets"]}
    expected = {f"{name}.{p}" for name, pnames in names.items() for p in pnames}
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise AdapterFileError(f"{source}: {file} lacks {missing[:4]}; the file is incomplete; {_REMEDY}" if missing
                               else f"{source}: {file} holds tensors {unexpected[:4]} that its config does not list; "
                                    f"{_REMEDY}")
    check_values(tensors, file, source, _REMEDY)
    plans = []
    for name, spec in config["targets"].items():
        module_name, _, tensor_name = name.rpartition(".")
        module = get_module(model, module_name, source)
        if family_name(module) != spec["layer"]:
            raise ValueError(f"{source}: {module_name!r} is a {type(module).__name__} in the model but a "
                             f"{spec['layer']} in the adapter")
        weight = raw_weight(module) if tensor_name == "weight" else getattr(module, tensor_name, None)
        if not isinstance(weight, torch.Tensor) or list(weight.shape) != spec["weight_shape"]:
            found = tuple(weight.shape) if isinstance(weight, torch.Tensor) else "no such tensor"
            raise ValueError(f"{source}: {name} is {found} in the model but {tuple(spec['weight_shape'])} in the "
                             f"adapter; the adapter was made for a model of another shape")
        plans.append(make_plan(module_name, module, tensor_name, source,
                               {p: tensors[f"{name}.{p}"] for p in names[name]},
                               spec["fan_in"], spec["fan_out"], spec["fan_in_fan_out"], spec["rank"],
                               spec["lora_alpha"], spec.get("use_rslora", False), spec.get("lora_dropout_p", 0.0)))
    ties = _tie_pairs(plans, config.get("tied", []), source)
    check_plans(model, plans, source, strict)
    apply_plans(plans)
    for linear, embedding in ties:
        tie_weights(linear, embedding)
    return model


def _tie_pairs(plans: list[Plan], tied: list[dict[str, str]], source: str) -> list[tuple[nn.Module, nn.Module]]:
    """``(linear, embedding)`` modules of each tied pair, whose stored factors must hold one update
    (the embedding's ``lora_A`` is the head's ``lora_B``): tying would otherwise drop values."""
    by_name, pairs = {p.name: p for p in plans}, []
    for tie in tied:
        lin, emb = by_name[tie["linear"]], by_name[tie["embedding"]]
        if lin.lora.fan_in_fan_out or not emb.lora.fan_in_fan_out or lin.tensor_name != "weight" \
                or emb.tensor_name != "weight":
            raise AdapterFileError(f"{source}: the tied pair {tie} must be a linear layer's and an embedding's weight "
                                   f"LoRA; the config is damaged; {_REMEDY}")
        if lin.lora.lora_A.shape != emb.lora.lora_B.shape or lin.lora.lora_B.shape != emb.lora.lora_A.shape \
                or not torch.equal(lin.lora.lora_A, emb.lora.lora_B) or not torch.equal(lin.lora.lora_B, emb.lora.lora_A):
            raise AdapterFileError(f"{source}: the tied pair {tie} does not hold one shared update (the two layers' "
                                   f"factors differ); the file is damaged; {_REMEDY}")
        pairs.append((lin.module, emb.module))
    return pairs
