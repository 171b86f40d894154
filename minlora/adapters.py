"""minlora's own adapter files: :func:`save_adapter` / :func:`load_adapter`.

An adapter is a directory with
  ``minlora_adapter.safetensors``  the factors, keyed ``<module>.<tensor>.lora_A`` / ``.lora_B``
  ``minlora_adapter.json``         per target: layer type, shapes, rank, alpha, dropout, rslora;
                                   the dtype; pairs tied with :func:`minlora.tie_weights`.
Both files carry one random save id, so a pair is written atomically and a mixed pair is caught.
PEFT's format is in :mod:`minlora.peft`; what both share is in :mod:`minlora.adapter_io`.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .adapter_io import (
    FAMILIES,
    AdapterFileError,
    LoadPlan,
    apply_plans,
    check_factor_values,
    check_store_dtype,
    family_name,
    get_module,
    is_alpha,
    is_dropout,
    is_positive_int,
    json_text,
    read_json,
    read_safetensors,
    safetensors_metadata,
    single_lora,
    write_new_file,
)
from .config import raw_weight
from .model import lora_sites
from .peft import PEFT_CONFIG_NAME
from .utils import tie_weights

__all__ = ["AdapterFileError", "save_adapter", "load_adapter", "ADAPTER_WEIGHTS_NAME", "ADAPTER_CONFIG_NAME"]

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS_NAME = "minlora_adapter.safetensors"
ADAPTER_CONFIG_NAME = "minlora_adapter.json"
# Old weights kept while a save_adapter replaces a pair (see save_adapter); gone after a finished save.
_PREVIOUS_WEIGHTS_NAME = ADAPTER_WEIGHTS_NAME + ".prev"
_FORMAT = "minlora.adapter"
_FORMAT_VERSION = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"adapter dtype must name a floating-point torch dtype, got {name!r}")
    return dtype


def save_adapter(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write the LoRA factors of ``model`` and their config to the directory ``path``; returns it.

    ``dtype`` stores the factors in another precision (e.g. ``torch.bfloat16`` halves the file);
    by default they are stored as they are (fp32 for fp16/bf16 bases).

    Overwriting an adapter is atomic as a pair: both files carry one random save id, and the old
    weights are kept (as ``minlora_adapter.safetensors.prev``) until the new config is in place,
    so a crash at any point leaves the old pair or the new pair, which :func:`load_adapter` finds.
    """
    check_store_dtype(dtype, "save_adapter")
    sites = lora_sites(model)
    if not sites:
        raise ValueError("save_adapter: the model has no LoRA to save; call minlora.add_lora(model) first")
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_adapter: {directory} exists and is not a directory; pass a directory path")
    tensors: dict[str, torch.Tensor] = {}
    targets: dict[str, dict[str, Any]] = {}
    stored_dtype = None
    for site in sites:
        lora = single_lora(site, "save_adapter")
        family = family_name(site.module)
        if family is None:
            raise ValueError(
                f"save_adapter: {site.name} is a {type(site.module).__name__}, not a Linear, Embedding or Conv2d"
            )
        targets[site.name] = {
            "layer": family,
            "weight_shape": list(site.original.shape),
            "fan_in": lora.fan_in,
            "fan_out": lora.fan_out,
            "fan_in_fan_out": lora.fan_in_fan_out,
            "rank": lora.rank,
            "lora_alpha": lora.lora_alpha,
            "use_rslora": lora.use_rslora,
            "lora_dropout_p": lora.lora_dropout_p,
        }
        for pname in ("lora_A", "lora_B"):
            t = getattr(lora, pname).detach()
            t = t.to(dtype) if dtype is not None else t
            stored_dtype = t.dtype
            # clone: safetensors refuses tensors that share memory (tie_weights shares factors)
            tensors[f"{site.name}.{pname}"] = t.cpu().contiguous().clone()
    ties = []
    for s1 in sites:
        for s2 in sites:
            if s1 is not s2 and s2.lora.lora_A is s1.lora.lora_B and s2.lora.lora_B is s1.lora.lora_A \
                    and not s1.lora.fan_in_fan_out:
                ties.append({"linear": s1.name, "embedding": s2.name})
    save_id = uuid.uuid4().hex
    config = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "save_id": save_id,
        "dtype": _dtype_name(stored_dtype),
        "targets": targets,
        "tied": ties,
    }
    directory.mkdir(parents=True, exist_ok=True)
    _write_pair(directory, tensors, {"format": "pt", "minlora_save_id": save_id}, config)
    return directory


def _write_pair(directory: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], config: dict) -> None:
    """Put the new (weights, config) pair in place so that a crash at any step leaves a whole pair.

    1. both new files are written completely under ``.tmp`` names (the old pair is untouched);
    2. the old weights move to ``.prev`` (old pair = config + ``.prev``, which load_adapter uses);
    3. the new weights move into place (config still old: load_adapter still uses ``.prev``);
    4. the new config moves into place: the new pair is complete (save ids agree);
    5. ``.prev`` is deleted.
    A failure before step 4 moves the old weights back and removes the ``.tmp`` files.
    """
    weights, config_path = directory / ADAPTER_WEIGHTS_NAME, directory / ADAPTER_CONFIG_NAME
    previous = directory / _PREVIOUS_WEIGHTS_NAME
    weights_tmp = weights.with_name(weights.name + ".tmp")
    config_tmp = config_path.with_name(config_path.name + ".tmp")
    _settle_interrupted_save(directory)
    committed = False
    try:
        write_new_file(weights_tmp, lambda t: save_file(tensors, str(t), metadata=metadata))
        write_new_file(config_tmp, lambda t: t.write_text(json_text(config)))
        if weights.exists() and config_path.exists():
            os.replace(weights, previous)
        os.replace(weights_tmp, weights)
        os.replace(config_tmp, config_path)
        committed = True
    finally:
        weights_tmp.unlink(missing_ok=True)
        config_tmp.unlink(missing_ok=True)
        if not committed and previous.exists():  # roll back to the old pair
            try:
                os.replace(previous, weights)
            except OSError:  # load_adapter still finds the old pair through .prev
                logger.warning("save_adapter: could not move %s back; load_adapter will use it", previous)
    previous.unlink(missing_ok=True)


def _settle_interrupted_save(directory: Path) -> None:
    """Before a new save: if a crashed save left the old weights in ``.prev`` (with the old config),
    put them back, so the directory holds one plain pair again."""
    previous = directory / _PREVIOUS_WEIGHTS_NAME
    if not previous.exists():
        return
    config_id = _config_save_id(directory / ADAPTER_CONFIG_NAME)
    if config_id is not None and _weights_save_id(previous) == config_id:
        os.replace(previous, directory / ADAPTER_WEIGHTS_NAME)
    else:
        previous.unlink()


def _config_save_id(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("save_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _weights_save_id(path: Path) -> str | None:
    return (safetensors_metadata(path) or {}).get("minlora_save_id")


# What a target entry of minlora_adapter.json must hold: key -> (check, description).
_TARGET_FIELDS: dict[str, tuple[Any, str]] = {
    "layer": (lambda v: v in FAMILIES, f"one of {sorted(FAMILIES)}"),
    "weight_shape": (lambda v: isinstance(v, list) and bool(v) and all(is_positive_int(d) for d in v),
                     "a list of positive integers"),
    "fan_in": (is_positive_int, "a positive integer"),
    "fan_out": (is_positive_int, "a positive integer"),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false"),
    "rank": (is_positive_int, "a positive integer"),
    "lora_alpha": (is_alpha, "a finite, non-zero number"),
}
_OPTIONAL_TARGET_FIELDS: dict[str, tuple[Any, str]] = {
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "lora_dropout_p": (is_dropout, "a number in [0, 1)"),
}


def _check_adapter_config(config: dict[str, Any], path: Path, caller: str) -> None:
    """The structure of ``minlora_adapter.json``: every field present and of the right type."""
    remedy = "save the adapter again with minlora.save_adapter"
    if config.get("format") != _FORMAT:
        raise AdapterFileError(
            f"{caller}: {path} has format={config.get('format')!r}, not {_FORMAT!r}: it is not a minlora adapter "
            f"config (a PEFT adapter_config.json goes to minlora.import_peft_adapter)"
        )
    version = config.get("format_version")
    if version != _FORMAT_VERSION:
        newer = is_positive_int(version) and version > _FORMAT_VERSION
        raise AdapterFileError(
            f"{caller}: {path} has format_version={version!r}; this minlora reads version {_FORMAT_VERSION}"
            + ("; upgrade minlora to load it" if newer else f"; {remedy}")
        )
    try:
        _parse_dtype(config.get("dtype"))
    except ValueError as e:
        raise AdapterFileError(f"{caller}: {path}: {e}; {remedy}") from None
    if "save_id" in config and not isinstance(config["save_id"], str):
        raise AdapterFileError(f"{caller}: {path}: save_id must be a string, got {config['save_id']!r}; {remedy}")
    targets = config.get("targets")
    if not isinstance(targets, dict) or not targets:
        raise AdapterFileError(f"{caller}: {path}: 'targets' must be a non-empty object, got {targets!r}; {remedy}")
    for name, spec in targets.items():
        if not isinstance(spec, dict):
            raise AdapterFileError(f"{caller}: {path}: targets[{name!r}] must be an object; {remedy}")
        for key, (ok, what) in _TARGET_FIELDS.items():
            if key not in spec:
                raise AdapterFileError(f"{caller}: {path}: targets[{name!r}] lacks the field {key!r}; {remedy}")
            if not ok(spec[key]):
                raise AdapterFileError(
                    f"{caller}: {path}: targets[{name!r}].{key} must be {what}, got {spec[key]!r}; {remedy}"
                )
        for key, (ok, what) in _OPTIONAL_TARGET_FIELDS.items():
            if key in spec and not ok(spec[key]):
                raise AdapterFileError(
                    f"{caller}: {path}: targets[{name!r}].{key} must be {what}, got {spec[key]!r}; {remedy}"
                )
    tied = config.get("tied", [])
    if not isinstance(tied, list):
        raise AdapterFileError(f"{caller}: {path}: 'tied' must be a list, got {tied!r}; {remedy}")
    for tie in tied:
        if not (isinstance(tie, dict) and set(tie) == {"linear", "embedding"}
                and all(isinstance(tie[k], str) and tie[k] in targets for k in tie)):
            raise AdapterFileError(
                f"{caller}: {path}: each 'tied' entry must be {{\"linear\": <target>, \"embedding\": <target>}} "
                f"naming two entries of 'targets', got {tie!r}; {remedy}"
            )


def _pick_weights(directory: Path, config: dict[str, Any], config_path: Path, caller: str) -> Path:
    """The weights file that belongs with ``config``: normally ``minlora_adapter.safetensors``; after
    a save that crashed halfway, the previous weights kept in ``.prev`` (see :func:`save_adapter`)."""
    weights, previous = directory / ADAPTER_WEIGHTS_NAME, directory / _PREVIOUS_WEIGHTS_NAME
    config_id = config.get("save_id")
    if config_id is None:  # written before save ids existed: nothing to pair
        return weights
    if weights.is_file() and _weights_save_id(weights) == config_id:
        return weights
    if previous.is_file() and _weights_save_id(previous) == config_id:
        logger.warning(
            "%s: a save_adapter into %s was interrupted; loading the complete previous adapter "
            "(the next save_adapter there tidies up)", caller, directory,
        )
        return previous
    if not weights.is_file():
        raise FileNotFoundError(f"{caller}: {directory} has {ADAPTER_CONFIG_NAME} but no {ADAPTER_WEIGHTS_NAME}")
    metadata = safetensors_metadata(weights)
    if metadata is None:  # damaged file: the reader says what is wrong with it
        return weights
    found = metadata.get("minlora_save_id", "without a save id")
    raise AdapterFileError(
        f"{caller}: {weights} (save {found}) and {config_path} (save {config_id}) come from two different saves "
        f"(files copied by hand?); copy both files of one save_adapter, or save the adapter again"
    )


def load_adapter(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model``; returns ``model``.

    Layers without LoRA get one with the adapter's rank and alpha; layers with LoRA must have the
    same rank (else ``ValueError``; their scaling is set to the adapter's). Everything is checked
    before the model is changed, so a failed load leaves it exactly as it was: targets missing from
    the model, shape mismatches, NaN/inf factors, tied pairs that do not fit and, with ``strict``,
    model LoRA the adapter does not cover raise ``ValueError``; damaged files raise
    :class:`AdapterFileError` (a ``ValueError``) naming the file.
    """
    directory = Path(path)
    caller = "load_adapter"
    config_path = directory / ADAPTER_CONFIG_NAME
    has_weights = (directory / ADAPTER_WEIGHTS_NAME).is_file() or (directory / _PREVIOUS_WEIGHTS_NAME).is_file()
    if not config_path.is_file() or not has_weights:
        is_peft = (directory / PEFT_CONFIG_NAME).is_file()
        hint = " (it looks like a PEFT adapter: use minlora.import_peft_adapter)" if is_peft else ""
        raise FileNotFoundError(
            f"load_adapter: {directory} must contain {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}{hint}"
        )
    remedy = "save the adapter again with minlora.save_adapter"
    config = read_json(config_path, caller, remedy)
    _check_adapter_config(config, config_path, caller)
    weights_path = _pick_weights(directory, config, config_path, caller)
    tensors, _ = read_safetensors(weights_path, caller, remedy)
    source = f"load_adapter({directory})"
    expected = {f"{name}.{p}" for name in config["targets"] for p in ("lora_A", "lora_B")}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing:
        raise AdapterFileError(f"{source}: {weights_path.name} lacks {missing[:4]}; the file is incomplete; {remedy}")
    if unexpected:
        raise AdapterFileError(
            f"{source}: {weights_path.name} holds tensors {unexpected[:4]} that {ADAPTER_CONFIG_NAME} does not list; "
            f"the two files do not belong together; {remedy}"
        )
    check_factor_values(tensors, weights_path, source, remedy)
    plans = []
    for name, spec in config["targets"].items():
        module_name, _, tensor_name = name.rpartition(".")
        module = get_module(model, module_name, source)
        family = family_name(module)
        if family != spec["layer"]:
            raise ValueError(
                f"{source}: {module_name!r} is a {type(module).__name__} in the model but a {spec['layer']} "
                f"in the adapter"
            )
        weight = raw_weight(module) if tensor_name == "weight" else getattr(module, tensor_name, None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{source}: {module_name!r} has no tensor {tensor_name!r}")
        if list(weight.shape) != list(spec["weight_shape"]):
            raise ValueError(
                f"{source}: {name} has shape {tuple(weight.shape)} in the model but {tuple(spec['weight_shape'])} in "
                f"the adapter; the adapter was made for a model of another shape"
            )
        plans.append(LoadPlan(
            module_name, module, tensor_name, rank=spec["rank"], lora_alpha=spec["lora_alpha"],
            use_rslora=spec.get("use_rslora", False), dropout=float(spec.get("lora_dropout_p", 0.0)),
            fan_in=spec["fan_in"], fan_out=spec["fan_out"], fan_in_fan_out=spec["fan_in_fan_out"],
            lora_A=tensors[f"{name}.lora_A"], lora_B=tensors[f"{name}.lora_B"],
        ))
    ties = _tie_plans(model, plans, config.get("tied", []), source)
    apply_plans(model, plans, source, strict)
    for linear, embedding in ties:
        tie_weights(linear, embedding)
    return model


def _tie_plans(model: nn.Module, plans: list[LoadPlan], tied: list[dict[str, str]],
               source: str) -> list[tuple[nn.Module, nn.Module]]:
    """Check every tied pair before anything changes; returns the ``(linear, embedding)`` modules.

    A pair must be a linear-layout and an embedding-layout LoRA of transposed factor shapes, on
    weights of one shape, whose stored factors agree (the embedding's ``lora_A`` is the head's
    ``lora_B`` and vice versa): tying would otherwise silently drop the embedding's values.
    """
    by_name = {p.name: p for p in plans}
    pairs = []
    for tie in tied:
        lin, emb = by_name[tie["linear"]], by_name[tie["embedding"]]
        if lin.fan_in_fan_out or not emb.fan_in_fan_out or lin.tensor_name != "weight" or emb.tensor_name != "weight":
            raise AdapterFileError(
                f"{source}: the tied pair {tie} must be a linear layer's and an embedding's weight LoRA; "
                f"the config is damaged; save the adapter again with minlora.save_adapter"
            )
        if (lin.fan_in, lin.fan_out, lin.rank) != (emb.fan_out, emb.fan_in, emb.rank) \
                or not torch.equal(lin.lora_A, emb.lora_B) or not torch.equal(lin.lora_B, emb.lora_A):
            raise AdapterFileError(
                f"{source}: the tied pair {tie} does not hold one shared update (shapes or values of the two "
                f"layers' factors differ); the files are damaged; save the adapter again with minlora.save_adapter"
            )
        pairs.append((lin.module, emb.module))
    return pairs
