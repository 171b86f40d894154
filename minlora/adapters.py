"""Adapters on disk: minlora's own format and the PEFT format.

minlora format (:func:`save_adapter` / :func:`load_adapter`), a directory with
  ``minlora_adapter.safetensors``  the factors, keyed ``<module>.<tensor>.lora_A`` / ``.lora_B``
  ``minlora_adapter.json``         per target: layer type, shapes, rank, alpha, dropout, rslora;
                                   the dtype; pairs tied with :func:`minlora.tie_weights`.

PEFT format (:func:`export_peft_adapter` / :func:`import_peft_adapter`), what
``peft.PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` reads:
  ``adapter_config.json``          ``peft_type="LORA"``, ``r``, ``lora_alpha``, ``target_modules``, ...
  ``adapter_model.safetensors``    ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and
                                   ``.lora_B.weight`` ``(out, r)`` for linear layers (also for
                                   ``transformers``' ``Conv1D``: ``fan_in_fan_out`` only changes how
                                   PEFT merges, not what it stores); ``.lora_embedding_A`` ``(r, V)``
                                   and ``.lora_embedding_B`` ``(dim, r)`` for embeddings.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.nn.utils import parametrize

from .config import raw_weight
from .model import LoRASite, has_lora, lora_sites, register_lora
from .parametrization import LoRAParametrization, check_finite_number, check_positive_int
from .utils import tie_weights

__all__ = [
    "AdapterFileError",
    "save_adapter",
    "load_adapter",
    "export_peft_adapter",
    "import_peft_adapter",
    "ADAPTER_WEIGHTS_NAME",
    "ADAPTER_CONFIG_NAME",
    "PEFT_WEIGHTS_NAME",
    "PEFT_CONFIG_NAME",
]

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS_NAME = "minlora_adapter.safetensors"
ADAPTER_CONFIG_NAME = "minlora_adapter.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_CONFIG_NAME = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
# Old weights kept while a save_adapter replaces a pair (see save_adapter); gone after a finished save.
_PREVIOUS_WEIGHTS_NAME = ADAPTER_WEIGHTS_NAME + ".prev"
_FORMAT = "minlora.adapter"
_FORMAT_VERSION = 1
_FAMILIES = {"Linear": nn.Linear, "Embedding": nn.Embedding, "Conv2d": nn.Conv2d}


# ---------------------------------------------------------------------- shared helpers
def _family_name(module: nn.Module) -> str | None:
    layer_type = parametrize.type_before_parametrizations(module)
    for name, family in _FAMILIES.items():
        if issubclass(layer_type, family):
            return name
    return None


def _single_lora(site: LoRASite, what: str) -> LoRAParametrization:
    if len(site.lora_indices) != 1:
        raise ValueError(f"{what}: {site.name} carries {len(site.lora_indices)} LoRAs; expected one")
    return site.lora


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"adapter dtype must name a floating-point torch dtype, got {name!r}")
    return dtype


def _get_module(model: nn.Module, module_name: str, source: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        some = [n for n, m in model.named_modules() if n and _family_name(m)][:6]
        raise ValueError(
            f"{source} targets {module_name!r} but this {type(model).__name__} has no such module "
            f"(layers are named like {some}); was the adapter made for another model shape?"
        ) from None


class AdapterFileError(ValueError):
    """An adapter file that cannot be used: unreadable, truncated, damaged, or not matching its pair.

    The message names the file, what is wrong with it and what to do.
    """


def _json_text(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _write_new_file(tmp: Path, write) -> None:
    """``write(tmp)``; on any failure ``tmp`` is removed, so no half-written ``.tmp`` is left behind."""
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _write_new_file(tmp, lambda t: t.write_text(_json_text(data)))
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_atomic_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _write_new_file(tmp, lambda t: save_file(tensors, str(t), metadata=metadata))
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_json(path: Path, caller: str, remedy: str) -> dict[str, Any]:
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


def _read_safetensors(path: Path, caller: str, remedy: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file, or :class:`AdapterFileError` for a damaged one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterFileError(
            f"{caller}: {path} is not a readable safetensors file ({type(e).__name__}: {e}); the file is damaged "
            f"or truncated; {remedy}"
        ) from None
    return tensors, metadata


def _check_factor_values(tensors: dict[str, torch.Tensor], path: Path, caller: str, remedy: str) -> None:
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


class _Plan:
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


def _apply_plans(model: nn.Module, plans: list[_Plan], source: str, strict: bool) -> None:
    """Check every plan (and, with ``strict``, that they cover the model's LoRA sites) before
    changing anything, so a bad adapter never leaves the model half-loaded; then apply them."""
    for plan in plans:
        _check_plan(plan, source)
    if strict:
        _check_strict(model, plans, source)
    for plan in plans:
        _apply_plan(plan, source)


def _check_plan(plan: _Plan, source: str) -> None:
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
        lora = _single_lora(site, source)
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
def _apply_plan(plan: _Plan, source: str) -> None:
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


def _check_strict(model: nn.Module, plans: list[_Plan], source: str) -> None:
    loaded = {p.name for p in plans}
    extra = [s.name for s in lora_sites(model) if s.name not in loaded]
    if extra:
        raise ValueError(
            f"{source}: the model has LoRA on {len(extra)} tensor(s) the adapter does not cover, e.g. {extra[:3]}; "
            f"pass strict=False to load anyway (those keep their current factors) or remove_lora(model) first"
        )


def _fans(module: nn.Module, family: str, weight: torch.Tensor) -> tuple[int, int, bool]:
    if family == "Embedding":
        return weight.shape[0], weight.shape[1], True  # (num_embeddings, dim)
    return weight.reshape(weight.shape[0], -1).shape[1], weight.shape[0], False  # (out, in[*kh*kw])


# ---------------------------------------------------------------------- minlora format
def _check_store_dtype(dtype: Any, caller: str) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{caller}: dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")


def save_adapter(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write the LoRA factors of ``model`` and their config to the directory ``path``; returns it.

    ``dtype`` stores the factors in another precision (e.g. ``torch.bfloat16`` halves the file);
    by default they are stored as they are (fp32 for fp16/bf16 bases).

    Overwriting an adapter is atomic as a pair: both files carry one random save id, and the old
    weights are kept (as ``minlora_adapter.safetensors.prev``) until the new config is in place,
    so a crash at any point leaves the old pair or the new pair, which :func:`load_adapter` finds.
    """
    _check_store_dtype(dtype, "save_adapter")
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
        lora = _single_lora(site, "save_adapter")
        family = _family_name(site.module)
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
        _write_new_file(weights_tmp, lambda t: save_file(tensors, str(t), metadata=metadata))
        _write_new_file(config_tmp, lambda t: t.write_text(_json_text(config)))
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


def _safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The metadata of a safetensors file, None when the file cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None


def _weights_save_id(path: Path) -> str | None:
    return (_safetensors_metadata(path) or {}).get("minlora_save_id")


# What a target entry of minlora_adapter.json must hold: key -> (check, description).
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_TARGET_FIELDS: dict[str, tuple[Any, str]] = {
    "layer": (lambda v: v in _FAMILIES, f"one of {sorted(_FAMILIES)}"),
    "weight_shape": (lambda v: isinstance(v, list) and bool(v) and all(_is_int(d) and d > 0 for d in v),
                     "a list of positive integers"),
    "fan_in": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "fan_out": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false"),
    "rank": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "lora_alpha": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v != 0,
                   "a finite, non-zero number"),
}
_OPTIONAL_TARGET_FIELDS: dict[str, tuple[Any, str]] = {
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "lora_dropout_p": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1,
                       "a number in [0, 1)"),
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
        newer = _is_int(version) and version > _FORMAT_VERSION
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
    metadata = _safetensors_metadata(weights)
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
    config = _read_json(config_path, caller, remedy)
    _check_adapter_config(config, config_path, caller)
    weights_path = _pick_weights(directory, config, config_path, caller)
    tensors, _ = _read_safetensors(weights_path, caller, remedy)
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
    _check_factor_values(tensors, weights_path, source, remedy)
    plans = []
    for name, spec in config["targets"].items():
        module_name, _, tensor_name = name.rpartition(".")
        module = _get_module(model, module_name, source)
        family = _family_name(module)
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
        plans.append(_Plan(
            module_name, module, tensor_name, rank=spec["rank"], lora_alpha=spec["lora_alpha"],
            use_rslora=spec.get("use_rslora", False), dropout=float(spec.get("lora_dropout_p", 0.0)),
            fan_in=spec["fan_in"], fan_out=spec["fan_out"], fan_in_fan_out=spec["fan_in_fan_out"],
            lora_A=tensors[f"{name}.lora_A"], lora_B=tensors[f"{name}.lora_B"],
        ))
    ties = _tie_plans(model, plans, config.get("tied", []), source)
    _apply_plans(model, plans, source, strict)
    for linear, embedding in ties:
        tie_weights(linear, embedding)
    return model


def _tie_plans(model: nn.Module, plans: list[_Plan], tied: list[dict[str, str]],
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


# ---------------------------------------------------------------------- PEFT format
# ---------------------------------------------------------------------- model-specific layout (protocol)
# minlora knows no model family. A model whose PEFT twin differs from it in layout says so with an
# optional method, which minlora looks up by name (duck typing):
#
#     def peft_adapter_layout(self) -> dict:
#         return {
#             "vocab_size": 50257,                             # real vocabulary of the twin (optional)
#             "padded_vocab_modules": ["transformer.wte", "lm_head"],  # layers with padded vocab rows
#             "fan_in_fan_out": True,                          # twin layers are transformers' Conv1D
#         }
#
# Every key is optional. gpt2.GPT provides it (padded vocabulary, Conv1D twin); a model without the
# method is exported / imported as it is.
LAYOUT_METHOD = "peft_adapter_layout"


def _peft_layout(model: nn.Module, caller: str) -> dict[str, Any]:
    method = getattr(model, LAYOUT_METHOD, None)
    if not callable(method):
        return {}
    layout = method()
    known = {"vocab_size", "padded_vocab_modules", "fan_in_fan_out"}
    if not isinstance(layout, dict) or set(layout) - known:
        raise TypeError(
            f"{caller}: {type(model).__name__}.{LAYOUT_METHOD}() must return a dict with keys among {sorted(known)}, "
            f"got {layout!r}"
        )
    return layout


class _VocabPadding:
    """A model with a padded vocabulary (``gpt2.GPT`` with ``pad_vocab_multiple``): the token
    embedding and the LM head have ``padded`` rows, the ``transformers`` twin has ``real``. The
    extra rows are never sampled nor used as inputs, so cutting them on export and zero-filling
    them on import is exact."""

    def __init__(self, padded: int, real: int, module_ids: set[int]) -> None:
        self.padded, self.real, self.module_ids = padded, real, module_ids

    @classmethod
    def of(cls, model: nn.Module, layout: dict[str, Any]) -> "_VocabPadding | None":
        real, names = layout.get("vocab_size"), layout.get("padded_vocab_modules") or []
        if real is None or not names:
            return None
        modules = [model.get_submodule(n) for n in names]
        padded = {raw_weight(m).shape[0] for m in modules}
        if len(padded) != 1:
            raise ValueError(f"{LAYOUT_METHOD}: the padded_vocab_modules {names} disagree on the vocabulary rows")
        padded_rows = padded.pop()
        if padded_rows == real:
            return None
        return cls(padded_rows, real, {id(m) for m in modules})

    def applies(self, module: nn.Module) -> bool:
        return id(module) in self.module_ids


def export_peft_adapter(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    fan_in_fan_out: bool | None = None,
    task_type: str | None = "CAUSAL_LM",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA of ``model`` as a PEFT LoRA adapter directory; returns it.

    ``peft.PeftModel.from_pretrained(hf_model, directory)`` then reproduces the LoRA model when
    ``hf_model`` has the same module names (``transformers.GPT2LMHeadModel`` for a ``gpt2.GPT``;
    padded vocabulary rows declared by the model's optional ``peft_adapter_layout()`` are cut off).
    ``fan_in_fan_out`` goes into the config (True when the twin layers are ``transformers``
    ``Conv1D``; default: what ``peft_adapter_layout()`` says, else False).
    Layers with a different rank or alpha than the most common one go into PEFT's
    ``rank_pattern`` / ``alpha_pattern``. Only LoRA alone on a Linear, Embedding or Conv2d weight can
    be expressed; anything else raises ``ValueError``.
    """
    sites = lora_sites(model)
    if not sites:
        raise ValueError("export_peft_adapter: the model has no LoRA; call minlora.add_lora(model) first")
    _check_store_dtype(dtype, "export_peft_adapter")
    layout = _peft_layout(model, "export_peft_adapter")
    vocab = _VocabPadding.of(model, layout)
    tensors: dict[str, torch.Tensor] = {}
    loras: dict[str, LoRAParametrization] = {}
    for site in sites:
        lora = _single_lora(site, "export_peft_adapter")
        if len(site.plist) != 1 or site.tensor_name != "weight":
            raise ValueError(
                f"export_peft_adapter: {site.name} has parametrizations {[type(p).__name__ for p in site.plist]}; "
                f"PEFT can express a LoRA alone on a layer's weight only"
            )
        family = _family_name(site.module)
        key = _PEFT_PREFIX + site.module_name
        A, B = lora.lora_A.detach(), lora.lora_B.detach()
        if dtype is not None:
            A, B = A.to(dtype), B.to(dtype)
        if family == "Linear" and not lora.fan_in_fan_out:
            if vocab and vocab.applies(site.module):
                B = B[: vocab.real]  # the LM head's padded vocabulary rows
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = A, B
        elif family == "Embedding" and lora.fan_in_fan_out:
            if vocab and vocab.applies(site.module):
                A = A[: vocab.real]
            # PEFT stores the embedding update transposed: delta^T = B_p @ A_p with A_p (r, V), B_p (dim, r)
            tensors[key + ".lora_embedding_A"], tensors[key + ".lora_embedding_B"] = A.t(), B.t()
        elif family == "Conv2d" and not lora.fan_in_fan_out and getattr(site.module, "groups", 1) == 1:
            weight = site.original  # (out, in, kh, kw)
            tensors[key + ".lora_A.weight"] = A.reshape(lora.rank, *weight.shape[1:])
            tensors[key + ".lora_B.weight"] = B.reshape(B.shape[0], lora.rank, 1, 1)
        else:
            raise ValueError(
                f"export_peft_adapter: cannot express the LoRA on {site.name} ({type(site.module).__name__}, "
                f"fan_in_fan_out={lora.fan_in_fan_out}) in PEFT's LoRA format"
            )
        loras[site.module_name] = lora
    tensors = {k: v.cpu().contiguous().clone() for k, v in tensors.items()}

    rslora = {p.use_rslora for p in loras.values()}
    if len(rslora) != 1:
        raise ValueError("export_peft_adapter: some layers use rsLoRA and some do not; PEFT has one use_rslora flag")
    rank = Counter(p.rank for p in loras.values()).most_common(1)[0][0]
    alpha = Counter(p.lora_alpha for p in loras.values()).most_common(1)[0][0]
    rank_pattern = {re.escape(n): p.rank for n, p in loras.items() if p.rank != rank}
    alpha_pattern = {re.escape(n): p.lora_alpha for n, p in loras.items() if p.lora_alpha != alpha}
    dropouts = {p.lora_dropout_p for p in loras.values()}
    if len(dropouts) > 1:
        logger.warning("export_peft_adapter: layers use different dropouts %s; PEFT has one, writing the largest",
                       sorted(dropouts))
    if fan_in_fan_out is None:
        fan_in_fan_out = bool(layout.get("fan_in_fan_out", False))
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": max(dropouts),
        "target_modules": _compact_targets(model, list(loras)),
        "exclude_modules": None,
        "fan_in_fan_out": bool(fan_in_fan_out),
        "bias": "none",
        "use_rslora": rslora.pop(),
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "inference_mode": True,
    }
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic_safetensors(out / PEFT_WEIGHTS_NAME, tensors, {"format": "pt"})
    _write_atomic_json(out / PEFT_CONFIG_NAME, config)
    return out


def _compact_targets(model: nn.Module, module_names: list[str]) -> list[str]:
    """Last name components (``["c_attn", "c_fc"]``) when they select exactly these modules in
    PEFT's suffix matching; the full names otherwise."""
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in module_names})
    selected = {n for n, _ in model.named_modules() if n and any(n == s or n.endswith("." + s) for s in suffixes)}
    return suffixes if selected == set(module_names) else sorted(module_names)


# Options of a PEFT LoraConfig that change what the adapter computes or holds beyond plain LoRA
# factors; minlora refuses them rather than load something else.
_PEFT_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "trainable LoRA biases",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}


def _check_peft_config(config: dict[str, Any], path: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"import_peft_adapter: {path} is a {config.get('peft_type')!r} adapter; only LORA is supported"
        )
    for key, what in _PEFT_UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(
                f"import_peft_adapter: {path} uses {what} ({key}={config[key]!r}); minlora loads plain LoRA only"
            )
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"import_peft_adapter: {path} has bias={config['bias']!r} (trained biases saved with the adapter); "
            f"minlora loads adapters with bias='none' only"
        )


def _check_peft_numbers(config: dict[str, Any], path: Path, remedy: str) -> None:
    """r / lora_alpha (and their per-layer patterns), lora_dropout and use_rslora: right types, finite."""
    where = f"import_peft_adapter: {path}"

    def rank_ok(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    def alpha_ok(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v != 0

    if not rank_ok(config.get("r", 8)):
        raise AdapterFileError(f"{where}: r must be a positive integer, got {config.get('r')!r}; {remedy}")
    if not alpha_ok(config.get("lora_alpha", 8)):
        raise AdapterFileError(
            f"{where}: lora_alpha must be a finite, non-zero number, got {config.get('lora_alpha')!r}; {remedy}"
        )
    for key, ok, what in (("rank_pattern", rank_ok, "positive integers"),
                          ("alpha_pattern", alpha_ok, "finite, non-zero numbers")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) and ok(v) for k, v in patterns.items()):
            raise AdapterFileError(f"{where}: {key} must map module patterns to {what}, got {patterns!r}; {remedy}")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise AdapterFileError(f"{where}: {key} key {pattern!r} is not a valid regex ({e}); {remedy}") from None
    dropout = config.get("lora_dropout", 0.0) or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise AdapterFileError(f"{where}: lora_dropout must be a number in [0, 1), got {dropout!r}; {remedy}")
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterFileError(f"{where}: use_rslora must be true or false, got {config['use_rslora']!r}; {remedy}")


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    # PEFT's rule (peft.utils.other.get_pattern_key): the first key whose regex matches a dotted suffix.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def import_peft_adapter(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a PEFT LoRA adapter directory into ``model`` (module names must match); returns ``model``.

    Layers without LoRA get one with the adapter's rank and alpha (``rank_pattern`` /
    ``alpha_pattern`` and ``use_rslora`` honoured); layers with LoRA must have the same rank.
    Base-layer weights PEFT saves next to an adapted embedding are ignored. Unsupported options
    (DoRA, biases, modules_to_save...) and any key, shape or rank mismatch raise ``ValueError``
    before the model is changed.
    """
    path = Path(directory)
    config_path = path / PEFT_CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(
            f"import_peft_adapter: {path} has no {PEFT_CONFIG_NAME}; is it a PEFT adapter directory?"
        )
    caller = "import_peft_adapter"
    remedy = "export or save the PEFT adapter again"
    config = _read_json(config_path, caller, remedy)
    _check_peft_config(config, path)
    _check_peft_numbers(config, config_path, remedy)
    weights_path = path / PEFT_WEIGHTS_NAME
    if weights_path.is_file():
        state, _ = _read_safetensors(weights_path, caller, remedy)
    elif (path / "adapter_model.bin").is_file():  # adapters saved with safe_serialization=False
        weights_path = path / "adapter_model.bin"
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle / zip errors of a damaged file come in many types
            raise AdapterFileError(
                f"{caller}: {weights_path} cannot be read ({type(e).__name__}: {e}); the file is damaged or "
                f"truncated; {remedy}"
            ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise AdapterFileError(f"{caller}: {weights_path} does not hold a dict of tensors; {remedy}")
    else:
        raise FileNotFoundError(f"import_peft_adapter: {path} has neither {PEFT_WEIGHTS_NAME} nor adapter_model.bin")
    source = f"import_peft_adapter({path})"
    _check_factor_values({k: v for k, v in state.items() if not k.endswith(".base_layer.weight")},
                         weights_path, source, remedy)
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    use_rslora, dropout = config.get("use_rslora", False), float(config.get("lora_dropout", 0.0) or 0.0)

    factors: dict[str, dict[str, torch.Tensor]] = {}
    ignored = []
    suffixes = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "EA", ".lora_embedding_B": "EB"}
    for key, tensor in state.items():
        if not key.startswith(_PEFT_PREFIX):
            raise ValueError(
                f"{source}: key {key!r} does not start with {_PEFT_PREFIX!r}; not a PEFT LoRA adapter file"
            )
        rest = key[len(_PEFT_PREFIX):]
        if rest.endswith(".base_layer.weight"):
            ignored.append(key)
            continue
        for suffix, role in suffixes.items():
            if rest.endswith(suffix):
                factors.setdefault(rest[: -len(suffix)], {})[role] = tensor
                break
        else:
            raise ValueError(
                f"{source}: unexpected key {key!r}; minlora understands lora_A/lora_B/lora_embedding_A/B only "
                f"(an adapter name inside the key, like 'lora_A.default.weight', means a raw state dict, "
                f"not a saved adapter)"
            )
    if ignored:
        logger.info("%s: ignoring %d base-layer weight(s) saved with the adapter, e.g. %s",
                    source, len(ignored), ignored[0])
    if not factors:
        raise ValueError(f"{source}: the adapter holds no LoRA factors")

    vocab = _VocabPadding.of(model, _peft_layout(model, "import_peft_adapter"))
    plans = []
    for module_name, parts in factors.items():
        module = _get_module(model, module_name, source)
        family = _family_name(module)
        if family is None:
            raise ValueError(
                f"{source}: {module_name!r} is a {type(module).__name__}; minlora puts LoRA on nn.Linear, "
                f"nn.Embedding and nn.Conv2d"
            )
        weight = raw_weight(module)
        fan_in, fan_out, fifo = _fans(module, family, weight)
        rank = int(_pattern_value(rank_pattern, module_name, r_default))
        alpha = _pattern_value(alpha_pattern, module_name, alpha_default)
        if family == "Embedding":
            if set(parts) != {"EA", "EB"}:
                raise ValueError(
                    f"{source}: embedding {module_name!r} needs lora_embedding_A and _B, found {sorted(parts)}"
                )
            A, B = parts["EA"].t(), parts["EB"].t()  # ours: A (V, r), B (r, dim)
            A = _pad_vocab_rows(A, fan_in, vocab, module, f"{module_name}.lora_embedding_A", source)
        else:
            if set(parts) != {"A", "B"}:
                raise ValueError(
                    f"{source}: {module_name!r} needs lora_A.weight and lora_B.weight, found {sorted(parts)}"
                )
            A, B = parts["A"], parts["B"]
            A = A.reshape(A.shape[0], -1)  # conv (r, in, kh, kw) -> (r, in * kh * kw)
            B = B.reshape(B.shape[0], -1)  # conv (out, r, 1, 1) -> (out, r)
            B = _pad_vocab_rows(B, fan_out, vocab, module, f"{module_name}.lora_B.weight", source)
        tensor_rank = A.shape[1] if fifo else A.shape[0]
        if tensor_rank != rank:
            raise ValueError(
                f"{source}: {module_name} has rank-{tensor_rank} factors but the config says r={rank}; "
                f"adapter_config.json does not match adapter weights"
            )
        plans.append(_Plan(module_name, module, "weight", rank=rank, lora_alpha=alpha, use_rslora=use_rslora,
                           dropout=dropout, fan_in=fan_in, fan_out=fan_out, fan_in_fan_out=fifo, lora_A=A, lora_B=B))
    _apply_plans(model, plans, source, strict)
    return model


def _pad_vocab_rows(t: torch.Tensor, rows: int, vocab: _VocabPadding | None, module: nn.Module, what: str,
                    source: str) -> torch.Tensor:
    """Zero rows for a padded vocabulary (never sampled, so any value is exact)."""
    if t.shape[0] == rows:
        return t
    if vocab is not None and vocab.applies(module) and rows == vocab.padded and t.shape[0] == vocab.real:
        return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    raise ValueError(f"{source}: {what} has {t.shape[0]} rows but the model's layer needs {rows}")
