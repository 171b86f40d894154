"""PEFT interop (``PeftModel.save_pretrained``'s format), no ``peft`` package needed: in
``adapter_model.safetensors``, ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` / ``.lora_B.weight``
``(out, r)`` (``Conv1D`` too), ``.lora_embedding_A`` ``(r, V)`` / ``.lora_embedding_B`` ``(dim, r)``, DoRA's
``.lora_magnitude_vector``. A model whose PEFT twin differs says how in a method ``peft_adapter_layout()``
returning a dict, every key optional: ``vocab_size`` (the twin's real vocabulary), ``padded_vocab_modules``
(layers with padded vocab rows: never sampled nor inputs, so cutting them on export, zeros on import, is
exact), ``fan_in_fan_out`` (True: the twin's layers are transformers' ``Conv1D``).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .adapters import (
    AdapterFileError,
    Plan,
    apply_plans,
    check_plans,
    check_values,
    get_module,
    lora_tensors,
    make_plan,
    parse_json,
    read_safetensors,
    write_atomic,
)
from .config import family_name, name_matches, raw_weight
from .errors import LoRAFileNotFoundError, LoRATypeError, LoRAValueError
from .model import LoRASite
from .parametrization import PARAM_NAMES, LoRAParametrization, check_float, check_int

PEFT_WEIGHTS_NAME, PEFT_CONFIG_NAME = "adapter_model.safetensors", "adapter_config.json"
_PREFIX = "base_model.model."
_REMEDY = "export or save the PEFT adapter again"
# PEFT's names for a layer's A and B factors (what follows `<module>.lora_` in its keys), by whether it is an
# embedding; DoRA adds the magnitude
_FACTOR_ROLES = {False: ("A.weight", "B.weight"), True: ("embedding_A", "embedding_B")}
_MAGNITUDE = "magnitude_vector"
_ROLES = (*_FACTOR_ROLES[False], *_FACTOR_ROLES[True], _MAGNITUDE)
# PEFT options that change what an adapter computes or holds beyond LoRA factors: refused, not loaded as something else.
_UNSUPPORTED = re.compile(
    "lora_bias|modules_to_save|layer_replication|trainable_token_indices|target_parameters|alora_invocation_tokens"
    "|use_qalora|use_bdlora|arrow_config|kasa_config|velora_config|monteclora_config"
)
# PEFT's defaults for the settings minlora reads, where adapter_config.json leaves them out
_DEFAULTS: dict[str, Any] = {
    "r": 8,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "rank_pattern": {},
    "alpha_pattern": {},
    "use_rslora": False,
    "use_dora": False,
}


def _layout(model: nn.Module, caller: str) -> tuple[dict[str, Any], int | None, dict[int, int]]:
    """``(layout, the twin's vocabulary rows, {id of a layer whose vocabulary is padded: its rows})``."""
    layout = getattr(model, "peft_adapter_layout", dict)()
    known = {"vocab_size", "padded_vocab_modules", "fan_in_fan_out"}
    # the padded layers count only where the twin's vocabulary is given
    padded_names = []
    if isinstance(layout, dict) and layout.get("vocab_size"):
        padded_names = layout.get("padded_vocab_modules") or []
    modules = [model.get_submodule(n) for n in padded_names]
    if not isinstance(layout, dict) or set(layout) - known or any(raw_weight(m) is None for m in modules):
        raise LoRATypeError(
            f"{caller}: {type(model).__name__}.peft_adapter_layout() must return a dict with keys among "
            f"{sorted(known)} (padded_vocab_modules: layers with a weight), got {layout!r}"
        )
    real = layout.get("vocab_size")
    return layout, real, {id(m): raw_weight(m).shape[0] for m in modules if raw_weight(m).shape[0] != real}


# ---------------------------------------------------------------------- export
def export_peft_adapter(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    task_type: str | None = "CAUSAL_LM",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA of ``model`` as a PEFT adapter directory for a twin with the same module names
    (``GPT2LMHeadModel`` for a ``gpt2.GPT``); returns it. The config's ``fan_in_fan_out`` comes from the
    model's ``peft_adapter_layout()``; ranks and alphas other than the most common go into ``*_pattern``.
    ``base_model_name_or_path`` defaults to the model's ``name_or_path`` attribute, where it has one
    (``gpt2.GPT.from_pretrained`` records the hub id or folder it loaded).
    """
    sites, ours = lora_tensors(model, "export_peft_adapter", dtype)
    layout, real, padded = _layout(model, "export_peft_adapter")
    tensors = {key: t for site in sites for key, t in _peft_tensors(site, ours, real, padded).items()}
    config = _peft_config(model, {site.module_name: site.lora for site in sites})
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "name_or_path", None)
    config |= {"task_type": task_type, "base_model_name_or_path": base_model_name_or_path}
    config["fan_in_fan_out"] = bool(layout.get("fan_in_fan_out", False))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / PEFT_WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    write_atomic(out / PEFT_CONFIG_NAME, lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True)))
    return out


def _peft_tensors(
    site: LoRASite, ours: dict[str, torch.Tensor], real: int | None, padded: dict[int, int]
) -> dict[str, torch.Tensor]:
    """PEFT's tensors for one LoRA, keyed as in its file; ``ours`` holds the factors as saved."""
    family, lora = family_name(site.module), site.lora
    # PEFT's LoRA sits alone on a layer's weight, in the (out, in) layout (an embedding's in the transposed one)
    alone = len(site.plist) == 1 and site.tensor_name == "weight" and lora.fan_in_fan_out == (family == "Embedding")
    if family not in ("Linear", "Embedding") or not alone:
        raise LoRAValueError(
            f"export_peft_adapter: cannot export the LoRA on {site.name} ({type(site.module).__name__}, "
            f"fan_in_fan_out={lora.fan_in_fan_out}, parametrizations {[type(p).__name__ for p in site.plist]}): "
            f"the export writes one LoRA alone on the weight of a Linear or Embedding layer"
        )
    A, B, m = (ours.get(f"{site.name}.{n}") for n in PARAM_NAMES)
    # the twin has no padded vocabulary rows
    rows = slice(None)
    if id(site.module) in padded:
        rows = slice(real)
    if family == "Embedding":
        # PEFT stores the embedding update transposed (contiguous: safetensors writes no views)
        A, B = A[rows].t().contiguous(), B.t().contiguous()
        if m is not None and rows.stop is not None:
            # DoRA's norms run over the rows: rescaled to the twin's
            V = (site.original.float() + lora.delta_weight().float()).detach()
            m = (m.float() * V[rows].norm(dim=0) / V.norm(dim=0).clamp(min=1e-30)).to(m.dtype)
    else:
        B = B[rows]
        if m is not None:
            m = m[rows]
    key = _PREFIX + site.module_name + ".lora_"
    a_role, b_role = _FACTOR_ROLES[family == "Embedding"]
    tensors = {key + a_role: A, key + b_role: B, key + _MAGNITUDE: m}
    # DoRA's magnitude, for DoRA only
    return {name: t for name, t in tensors.items() if t is not None}


def _peft_config(model: nn.Module, loras: dict[str, LoRAParametrization]) -> dict[str, Any]:
    """The adapter_config.json of ``loras`` (by module name) less the caller's fields; PEFT fills in the
    options not written here with their defaults.
    """
    for flag in ("use_rslora", "use_dora"):
        if len({getattr(p, flag) for p in loras.values()}) != 1:
            raise LoRAValueError(
                f"export_peft_adapter: {flag} is on for some layers and off for others; PEFT has one "
                f"{flag} flag for the adapter: export the two groups as two adapters"
            )
    rank = Counter(p.rank for p in loras.values()).most_common(1)[0][0]
    alpha = Counter(p.lora_alpha for p in loras.values()).most_common(1)[0][0]
    first = next(iter(loras.values()))
    return {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        # PEFT has one dropout for the adapter: the largest (dropout only matters in training)
        "lora_dropout": max(p.lora_dropout_p for p in loras.values()),
        "bias": "none",
        "inference_mode": True,
        "target_modules": _target_modules(model, list(loras)),
        "use_rslora": first.use_rslora,
        "use_dora": first.use_dora,
        "rank_pattern": {re.escape(n): p.rank for n, p in loras.items() if p.rank != rank},
        "alpha_pattern": {re.escape(n): p.lora_alpha for n, p in loras.items() if p.lora_alpha != alpha},
    }


def _target_modules(model: nn.Module, names: list[str]) -> list[str]:
    """The last name components (``["c_attn", "c_fc"]``) where PEFT's suffix matching selects exactly
    the modules ``names`` with them, else the full names.
    """
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    selected = {n for n, _ in model.named_modules() if n and any(name_matches(n, s) for s in suffixes)}
    if selected == set(names):
        return suffixes
    return sorted(names)


# ---------------------------------------------------------------------- import
def _check_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """adapter_config.json holds a LoRA adapter minlora can load; returns it with PEFT's defaults filled
    in (:data:`_DEFAULTS`) and its settings checked.
    """
    if config.get("peft_type") != "LORA":
        raise LoRAValueError(f"{where} is a {config.get('peft_type')!r} adapter; only LORA is supported")
    key = next((k for k, v in config.items() if v and _UNSUPPORTED.fullmatch(k)), None)
    if key is not None:
        raise LoRAValueError(
            f"{where} sets {key}={config[key]!r}, an option minlora does not support (LoRA and DoRA only)"
        )
    if config.get("bias", "none") != "none":
        raise LoRAValueError(f"{where} has bias={config['bias']!r} (trained biases); minlora loads bias='none' only")
    # PEFT's defaults where a setting is left out; an empty dropout or pattern map (null, 0, {}) reads as one too
    empty_is_default = ("lora_dropout", "rank_pattern", "alpha_pattern")
    settings = _DEFAULTS | {key: value for key, value in config.items() if value or key not in empty_is_default}
    try:
        _check_settings(settings)
    except (ValueError, TypeError, re.error) as e:
        raise AdapterFileError(f"{where}: {e}; {_REMEDY}") from None
    return settings


def _check_settings(settings: dict[str, Any]) -> None:
    """The checks LoRAConfig uses, their messages naming the key."""
    check_int(settings["r"], "r")
    check_float(settings["lora_alpha"], "lora_alpha")
    check_float(settings["lora_dropout"], "lora_dropout", low=0.0, high=1.0)
    for key, check in (("rank_pattern", check_int), ("alpha_pattern", check_float)):
        patterns = settings[key]
        if not isinstance(patterns, dict):
            raise LoRAValueError(f"{key} must be a map of module patterns to values, got {patterns!r}")
        for pattern, value in patterns.items():
            check(value, f"{key}[{pattern!r}]")
            re.compile(pattern)
    for flag in ("use_rslora", "use_dora"):
        if not isinstance(settings[flag], bool):
            raise LoRAValueError(f"{flag} must be true or false, got {settings[flag]!r}")


def _read_peft(path: Path, source: str) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """The PEFT adapter directory ``path``: its checked config (defaults filled in), and its finite factors as
    ``{module name: {role: tensor}}`` (roles as in ``_ROLES``).
    """
    file, config_file = path / PEFT_WEIGHTS_NAME, path / PEFT_CONFIG_NAME
    if not config_file.is_file() or not file.is_file():
        raise LoRAFileNotFoundError(
            f"import_peft_adapter: {path} needs {PEFT_CONFIG_NAME} and {PEFT_WEIGHTS_NAME} (an adapter_model.bin: "
            f"load it with peft and save_pretrained it again, which writes safetensors)"
        )
    config = parse_json(config_file.read_bytes(), config_file, "import_peft_adapter", _REMEDY)
    config = _check_config(config, f"import_peft_adapter: {config_file}")
    state, _ = read_safetensors(file, "import_peft_adapter", _REMEDY)
    state = {k: v for k, v in state.items() if not k.endswith(".base_layer.weight")}
    check_values(state, file, source, _REMEDY)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module_name, _, role = key[len(_PREFIX) :].rpartition(".lora_")
        if not key.startswith(_PREFIX) or role not in _ROLES:
            raise LoRAValueError(
                f"{source}: unexpected key {key!r} in {file}; minlora reads {_PREFIX}<module>.lora_ followed by "
                f"one of {list(_ROLES)} (an adapter name in the key, as in 'lora_A.default.weight', means "
                f"a raw state dict, not a saved adapter)"
            )
        factors.setdefault(module_name, {})[role] = tensor
    if not factors:
        raise LoRAValueError(f"{source}: the adapter holds no LoRA factors")
    return config, factors


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's rule (``peft.utils.other.get_pattern_key``): the value of the first key whose regex
    matches a dotted suffix of ``module_name``, else ``default``.
    """
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _pad_rows(t: torch.Tensor, real: int | None, rows: int | None) -> torch.Tensor:
    """Zero rows up to a padded vocabulary's ``rows`` (None: not padded); never sampled, so any value is exact."""
    if rows is not None and t.shape[0] == real and rows > real:
        return torch.cat([t, t.new_zeros(rows - real, *t.shape[1:])])
    # a wrong row count is caught with the other shapes (make_plan)
    return t


def import_peft_adapter(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a PEFT LoRA / DoRA adapter directory into ``model`` (same module names), as :func:`load_adapter`
    does (``rank_pattern`` / ``alpha_pattern`` honoured); unsupported options are a ``ValueError``.
    """
    path = Path(directory)
    source = f"import_peft_adapter({path})"
    config, factors = _read_peft(path, source)
    _, real, padded = _layout(model, "import_peft_adapter")
    sites = {name: LoRASite(name, get_module(model, name, source), "weight") for name in factors}
    plans = [_peft_plan(sites[name], parts, config, real, padded, source) for name, parts in factors.items()]
    check_plans(model, plans, source, strict)
    apply_plans(plans)
    return model


def _peft_plan(
    site: LoRASite, parts: dict[str, torch.Tensor], config: dict, real: int | None, padded: dict[int, int], source: str
) -> Plan:
    """The plan for one module's PEFT factors ``parts``; ``real`` and ``padded`` as :func:`_layout` gives them."""
    module_name = site.module_name
    # the rows of the layer's padded vocabulary (None: not padded)
    rows = padded.get(id(site.module))
    embedding = family_name(site.module) == "Embedding"
    dora = config["use_dora"]
    a_role, b_role = _FACTOR_ROLES[embedding]
    expected = {a_role, b_role}
    if dora:
        expected.add(_MAGNITUDE)
    if set(parts) != expected:
        raise LoRAValueError(
            f"{source}: {module_name!r} is a {type(site.module).__name__}, and its factors are lora_"
            f"{sorted(parts)}: PEFT stores lora_embedding_A/B for embeddings, lora_A/B otherwise, "
            f"and with use_dora={dora} {'a' if dora else 'no'} lora_magnitude_vector"
        )
    if embedding:
        # ours: A (V, r), B (r, dim)
        A = _pad_rows(parts[a_role].t(), real, rows)
        B = parts[b_role].t()
    else:
        # conv factors (r, in, kh, kw) / (out, r, 1, 1) flatten to 2-D
        A = parts[a_role].flatten(1)
        B = _pad_rows(parts[b_role].flatten(1), real, rows)
    # factors of another rank than the config's are refused with the other shapes (make_plan)
    rank = _pattern_value(config["rank_pattern"], module_name, config["r"])
    alpha = _pattern_value(config["alpha_pattern"], module_name, config["lora_alpha"])
    tensors = {"lora_A": A, "lora_B": B}
    if dora:
        # (out,) for linear layers, (dim,) for embeddings, (1, out, 1, 1) for convolutions
        M = parts[_MAGNITUDE].reshape(-1)
        if not embedding:
            M = _pad_rows(M, real, rows)
        tensors["lora_magnitude_vector"] = M
    settings = dict(rank=rank, lora_alpha=alpha, use_rslora=config["use_rslora"], use_dora=dora)
    return make_plan(site, source, tensors, lora_dropout_p=float(config["lora_dropout"]), **settings)
