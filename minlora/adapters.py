"""minlora's adapter file and the all-or-nothing loading PEFT interop shares. One ``adapter.safetensors``
(renamed into place: never torn nor mixed with another save): ``<module>.<tensor>.lora_A`` / ``.lora_B``
(/ ``.lora_magnitude_vector``), and under the metadata key ``"minlora"`` the JSON config: per target
layer, weight shape and settings, tied pairs, the base model's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import FAMILIES, family_name, raw_weight
from .errors import LoRAFileNotFoundError, LoRAValueError, MinloraError
from .model import LoRASite, lora_sites, register_lora, require_lora, single_lora
from .parametrization import FACTOR_NAMES, LoRAParametrization
from .utils import tie_weights

ADAPTER_FILE_NAME = "adapter.safetensors"
_FORMAT = "minlora.adapter"
_VERSION = 2
# the settings of each target, named as LoRAParametrization's keywords
_SETTINGS = ("rank", "lora_alpha", "use_rslora", "lora_dropout_p", "use_dora")
_REMEDY = "save the adapter again with minlora.save_adapter"
# where to load, and a LoRA built from the file
Plan = tuple[LoRASite, LoRAParametrization]
logger = logging.getLogger(__name__)


class AdapterFileError(MinloraError, ValueError):
    """An adapter file that cannot be used; the message names it, what is wrong and what to do."""


class NonFiniteAdapterError(AdapterFileError):
    """NaN / inf adapter weights: in a file being loaded, or in a model being saved (nothing is written)."""


class AdapterBaseMismatchError(MinloraError, ValueError):
    """The adapter was saved from another base model than the one it is loaded into (:func:`base_fingerprint`)."""


# ---------------------------------------------------------------------- files
def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` beside ``path``, fsync, rename over ``path``: the old file or the new one, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        # a stale one a crash left
        tmp.unlink(missing_ok=True)
        # Created 0o666 so the kernel applies the umask (reading it means setting it, racing other threads);
        # safetensors alone would write 0o600, making every adapter private.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        os.chmod(tmp, mode)
        # on disk before the rename publishes it
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def parse_json(text: str | bytes, where: Any, caller: str, remedy: str) -> dict[str, Any]:
    """The JSON object in ``text``, else :class:`AdapterFileError` naming ``where``."""
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterFileError(f"{caller}: {where} is not valid JSON ({e}): damaged or truncated; {remedy}") from None
    if not isinstance(data, dict):
        raise AdapterFileError(f"{caller}: {where} must hold a JSON object, got {type(data).__name__}; {remedy}")
    return data


def read_safetensors(path: Path, caller: str, remedy: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        # what a damaged file raises
        raise AdapterFileError(
            f"{caller}: {path} is not a readable safetensors file ({type(e).__name__}: {e}); "
            f"the file is damaged or truncated; {remedy}"
        ) from None


def check_values(tensors: dict[str, torch.Tensor], where: Any, caller: str, remedy: str) -> None:
    """Every tensor floating-point and finite: one NaN / inf factor makes every output NaN."""
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterFileError(f"{caller}: {where}: {key} has dtype {t.dtype}, not a floating-point one; {remedy}")
        if not torch.isfinite(t).all():
            raise NonFiniteAdapterError(
                f"{caller}: {where}: {key} holds {int((~torch.isfinite(t)).sum())} NaN/inf value(s); {remedy}"
            )


def lora_tensors(model: nn.Module, caller: str, dtype: Any) -> tuple[list[LoRASite], dict[str, torch.Tensor]]:
    """The LoRA sites of ``model`` and their parameters ``<site>.<param>`` on the CPU, finite, in ``dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise LoRAValueError(
            f"{caller}: dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}"
        )
    sites = require_lora(model, caller)
    # clones: safetensors refuses tensors sharing memory (tie_weights)
    tensors = {
        f"{site.name}.{name}": getattr(single_lora(site, caller), name).detach().to(dtype).cpu().contiguous().clone()
        for site in sites
        for name in site.lora.param_names
    }
    diverged = "nothing was written; the adapter diverged in training: resume from a checkpoint before it did"
    check_values(tensors, "the model's LoRA", caller, diverged + ", with a lower learning rate")
    return sites, tensors


# ---------------------------------------------------------------------- loading, all or nothing
def get_module(model: nn.Module, module_name: str, source: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        some = [n for n, m in model.named_modules() if n and family_name(m)][:6]
        raise LoRAValueError(
            f"{source} targets {module_name!r} but this {type(model).__name__} has no such module "
            f"(layers are named like {some}); was the adapter made for another model shape?"
        ) from None


@torch.no_grad()
def make_plan(site: LoRASite, source: str, tensors: dict[str, torch.Tensor], **settings: Any) -> Plan:
    """A LoRA for ``site`` holding ``tensors``, its layout taken from the layer's weight; ``settings``
    are :class:`LoRAParametrization`'s keywords.
    """
    family = family_name(site.module)
    if family is None or raw_weight(site.module) is None or site.tensor_name != "weight":
        raise LoRAValueError(f"{source}: {site.name} is not the weight of a Linear, Embedding or Conv2d layer")
    lora = FAMILIES[family][1](site.module, **settings)
    for name, value in tensors.items():
        if value.shape != getattr(lora, name).shape:
            raise LoRAValueError(
                f"{source}: the adapter's {name} for {site.name} has shape {tuple(value.shape)}; at rank "
                f"{lora.rank} this layer needs {tuple(getattr(lora, name).shape)}"
            )
        getattr(lora, name).copy_(value)
    return site, lora


def check_plans(model: nn.Module, plans: list[Plan], source: str, strict: bool) -> None:
    """What could stop a load half-way, checked before anything changes."""
    for site, new in plans:
        if not site.lora_indices:
            continue
        old = single_lora(site, source)
        # another rank, or DoRA on one side only
        if [getattr(old, n).shape for n in old.param_names] != [getattr(new, n).shape for n in new.param_names]:
            kinds = ["DoRA" if lora.use_dora else "LoRA" for lora in (new, old)]
            raise LoRAValueError(
                f"{source}: the adapter has {kinds[0]} of rank {new.rank} for {site.name} but the model there has "
                f"{kinds[1]} of rank {old.rank}; call minlora.remove_lora(model) and load again (a model without "
                "LoRA gets the adapter's)"
            )
    covered = {site.name for site, _ in plans}
    extra = [s.name for s in lora_sites(model) if s.name not in covered]
    if strict and extra:
        raise LoRAValueError(
            f"{source}: the model has LoRA on {len(extra)} tensor(s) the adapter does not cover, e.g. "
            f"{extra[:3]}; pass strict=False to load anyway (those keep their factors), or remove_lora"
        )


@torch.no_grad()
def apply_plans(plans: list[Plan]) -> None:
    for site, new in plans:
        if not site.lora_indices:
            register_lora(site.module, site.tensor_name, new, fresh=False)
            continue
        # the adapter was trained with its own scaling
        site.lora.set_scaling(new.lora_alpha, new.use_rslora)
        for name in new.param_names:
            getattr(site.lora, name).copy_(getattr(new, name))


# ---------------------------------------------------------------------- the base an adapter belongs to
def _base_record(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Digest of the base weights (values in bf16: one base in fp32 or bf16); the config is for messages."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().to(torch.bfloat16).contiguous()
        digest.update(f"{name} {tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    # the model's config, for messages (duck-typed: minlora knows no model family), as it reads back from the file
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        config = config.to_dict()
    if not isinstance(config, dict):
        config = None
    return {"sha256": digest.hexdigest(), "config": json.loads(json.dumps(config, sort_keys=True, default=str))}


def base_fingerprint(model: nn.Module) -> str:
    """A sha256 digest of the base (un-adapted) weights of ``model``'s LoRA layers (names, shapes,
    values rounded to bf16): what :func:`save_adapter` records and :func:`load_adapter` checks.
    """
    sites = require_lora(model, "base_fingerprint")
    return _base_record(model, {s.name: s.original for s in sites})["sha256"]


def _check_base(saved: dict[str, Any], model: nn.Module, plans: list[Plan], source: str, allow: bool) -> None:
    now = _base_record(model, {site.name: raw_weight(site.module) for site, _ in plans})
    if now["sha256"] == saved.get("sha256"):
        return
    old, new = saved.get("config") or {}, now["config"] or {}
    keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    changes = [f"{k}: {old.get(k)!r} in the adapter, {new.get(k)!r} here" for k in keys[:4]]
    config = f" (and the model config: {', '.join(changes)})" if keys else ""
    message = f"{source}: the adapter was trained on another base model: the base weights of the {len(plans)} "
    message += f"adapted layers differ{config}"
    if not allow:
        raise AdapterBaseMismatchError(
            f"{message}; load the base model it was trained on, or pass allow_base_mismatch=True to load_adapter "
            "(--allow-base-mismatch on the command line)"
        )
    logger.warning("%s; loading it anyway (allow_base_mismatch=True)", message)


# ---------------------------------------------------------------------- minlora's format
def save_adapter(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write the LoRA of ``model`` with its config to ``path``, a directory (``adapter.safetensors``
    inside) or a ``.safetensors`` file; returns ``path``. ``dtype`` stores the factors in another
    precision (``torch.bfloat16`` halves the file). The file is replaced atomically; NaN / inf
    weights are refused (:class:`NonFiniteAdapterError`) and the file on disk stays as it was.
    """
    sites, tensors = lora_tensors(model, "save_adapter", dtype)
    path = Path(path)
    file = path
    if path.suffix != ".safetensors":
        file = path / ADAPTER_FILE_NAME
    if path.is_file() and file != path:
        raise LoRAValueError(f"save_adapter: {path} is a file; pass a directory or a path ending in .safetensors")
    targets = {
        s.name: {"layer": family_name(s.module), "weight_shape": list(s.original.shape)}
        | {k: getattr(s.lora, k) for k in _SETTINGS}
        for s in sites
    }
    # tie_weights: the embedding's factors are the head's, swapped
    ties = [
        {"linear": a.name, "embedding": b.name}
        for a in sites
        for b in sites
        if b.lora.lora_A is a.lora.lora_B and b.lora.lora_B is a.lora.lora_A and not a.lora.fan_in_fan_out
    ]
    base = _base_record(model, {s.name: s.original for s in sites})
    config = {"format": _FORMAT, "format_version": _VERSION, "targets": targets, "tied": ties, "base": base}
    file.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "minlora": json.dumps(config, sort_keys=True)}
    write_atomic(file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return path


# ---------------------------------------------------------------------- reading and checking the file
def _config_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with the structure of the config, checked in order (each check relies on the ones
    before); the values are checked as the LoRAs are built from them (make_plan).
    """
    if config.get("format") != _FORMAT:
        return f"format={config.get('format')!r}: it is not a minlora adapter (a PEFT one goes to import_peft_adapter)"
    version = config.get("format_version")
    if version != _VERSION:
        return f"format_version={version!r}, but this minlora reads version {_VERSION}; upgrade minlora for a newer one"
    targets = config.get("targets")
    problem = _targets_problem(targets)
    if problem:
        return problem
    if not isinstance(config.get("base"), dict):
        return f"'base' must be an object (the base model's fingerprint), got {config.get('base')!r}"
    tied = config.get("tied", [])
    if not isinstance(tied, list) or not all(_is_tie(t, targets) for t in tied):
        return f'each \'tied\' entry must be {{"linear": <target>, "embedding": <target>}}, got {tied!r}'
    return None


def _targets_problem(targets: Any) -> str | None:
    if not isinstance(targets, dict) or not targets or not all(isinstance(t, dict) for t in targets.values()):
        return f"'targets' must be a non-empty object of objects, got {targets!r}"
    for name, target in targets.items():
        for key in _SETTINGS[:2] + ("layer", "weight_shape"):
            if key not in target:
                return f"targets[{name!r}] lacks the field {key!r}"
    return None


def _is_tie(entry: Any, targets: dict[str, Any]) -> bool:
    """``{"linear": <target>, "embedding": <target>}``."""
    if not isinstance(entry, dict) or set(entry) != {"linear", "embedding"}:
        return False
    return all(isinstance(v, str) and v in targets for v in entry.values())


def _factor_names(spec: dict[str, Any]) -> tuple[str, ...]:
    """The tensors a target of the config has: ``lora_A``, ``lora_B``, and DoRA's magnitude."""
    return FACTOR_NAMES[spec.get("use_dora") is True]


def _read(path: Path, source: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    """``(tensors, config, file)`` of the adapter at ``path`` (a directory or the file): the config's
    structure checked, and the tensors exactly those it lists, each floating-point and finite.
    """
    file = path
    if path.is_dir():
        file = path / ADAPTER_FILE_NAME
    if not file.is_file():
        raise LoRAFileNotFoundError(
            f"load_adapter: {path} must contain {ADAPTER_FILE_NAME} (PEFT: import_peft_adapter)"
        )
    tensors, metadata = read_safetensors(file, "load_adapter", _REMEDY)
    # no minlora metadata: no format either, refused as not a minlora adapter
    config = parse_json(metadata.get("minlora", "{}"), f"{file} (its 'minlora' metadata)", "load_adapter", _REMEDY)
    problem = _config_problem(config)
    if problem:
        raise AdapterFileError(f"load_adapter: {file}: {problem}; {_REMEDY}")
    expected = {f"{target}.{p}" for target, spec in config["targets"].items() for p in _factor_names(spec)}
    missing = sorted(expected - set(tensors))
    if missing:
        raise AdapterFileError(f"{source}: {file} lacks {missing[:4]}; the file is incomplete; {_REMEDY}")
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise AdapterFileError(f"{source}: {file} holds {unexpected[:4]}, which its config does not list; {_REMEDY}")
    check_values(tensors, file, source, _REMEDY)
    return tensors, config, file


# ---------------------------------------------------------------------- loading
def load_adapter(
    model: nn.Module, path: str | os.PathLike, *, strict: bool = True, allow_base_mismatch: bool = False
) -> nn.Module:
    """Load a :func:`save_adapter` adapter into ``model``: layers without LoRA get the adapter's, layers
    with LoRA must have its rank. All is checked before the model changes: ``ValueError`` (with ``strict``,
    model LoRA the adapter does not cover too), :class:`AdapterFileError`, :class:`AdapterBaseMismatchError`.
    """
    source = f"load_adapter({path})"
    tensors, config, file = _read(Path(path), source)
    plans = [_plan_target(model, name, spec, tensors, source, file) for name, spec in config["targets"].items()]
    ties = _tied_layers(config.get("tied", []), plans, source)
    check_plans(model, plans, source, strict)
    _check_base(config["base"], model, plans, source, allow_base_mismatch)
    apply_plans(plans)
    for head, embedding in ties:
        tie_weights(head, embedding)
    return model


def _plan_target(
    model: nn.Module, name: str, spec: dict[str, Any], tensors: dict[str, torch.Tensor], source: str, file: Path
) -> Plan:
    """The plan for the config's target ``name`` (``<module>.<tensor>``), checked against the model's layer."""
    module_name, _, tensor_name = name.rpartition(".")
    site = LoRASite(module_name, get_module(model, module_name, source), tensor_name)
    # () for a module without a weight: no adapter target has that shape
    shape = tuple(getattr(raw_weight(site.module), "shape", ()))
    if family_name(site.module) != spec["layer"] or list(shape) != spec["weight_shape"]:
        raise LoRAValueError(
            f"{source}: {name} is a {type(site.module).__name__} weight of shape "
            f"{shape} in the model but a {spec['layer']} weight of "
            f"shape {tuple(spec['weight_shape'])} in the adapter: made for a model of another shape"
        )
    factors = {p: tensors[f"{name}.{p}"] for p in _factor_names(spec)}
    settings = {k: spec[k] for k in _SETTINGS if k in spec}
    try:
        return make_plan(site, source, factors, **settings)
    except (TypeError, ValueError) as e:
        # a bad rank / alpha / dropout, or a factor of the wrong shape
        raise AdapterFileError(f"{source}: {file}: targets[{name!r}]: {e}; {_REMEDY}") from None


def _tied_layers(tied: list[dict[str, str]], plans: list[Plan], source: str) -> list[tuple[nn.Module, nn.Module]]:
    """``(head, embedding)`` for each tied pair of the config, whose factors must be plain LoRA (tie_weights refuses
    DoRA) holding one update (tying would drop values otherwise): checked here, before the model changes.
    """
    by_name = {site.name: (site.module, lora) for site, lora in plans}
    ties = []
    for tie in tied:
        head, lin = by_name[tie["linear"]]
        embedding, emb = by_name[tie["embedding"]]
        one_update = torch.equal(lin.lora_A, emb.lora_B) and torch.equal(lin.lora_B, emb.lora_A)
        if lin.fan_in_fan_out or not emb.fan_in_fan_out or lin.use_dora or emb.use_dora or not one_update:
            raise AdapterFileError(
                f"{source}: the tied pair {tie} must be a linear layer's and an embedding's plain LoRA (not DoRA) "
                f"holding one update (the embedding's lora_A is the head's lora_B); {_REMEDY}"
            )
        ties.append((head, embedding))
    return ties
