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
import logging
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
from .errors import LoRAFileNotFoundError, LoRAValueError
from .model import LoRASite
from .parametrization import check_float, check_int

logger = logging.getLogger(__name__)

PEFT_WEIGHTS_NAME, PEFT_CONFIG_NAME = "adapter_model.safetensors", "adapter_config.json"
LAYOUT_METHOD = "peft_adapter_layout"
_PREFIX = "base_model.model."
_REMEDY = "export or save the PEFT adapter again"
# what follows `<module>.lora_` in PEFT's keys
_ROLES = ("A.weight", "B.weight", "embedding_A", "embedding_B", "magnitude_vector")
# PEFT options that change what an adapter computes or holds beyond LoRA factors: refused, not loaded as something else.
_UNSUPPORTED = re.compile(
    "lora_bias|modules_to_save|layer_replication|trainable_token_indices|target_parameters|alora_invocation_tokens"
    "|use_qalora|use_bdlora|arrow_config|kasa_config|velora_config|monteclora_config"
)


def _layout(model: nn.Module, caller: str) -> tuple[dict[str, Any], int | None, set[int]]:
    """``(layout, the twin's vocabulary rows, ids of the layers whose vocabulary is padded)``."""
    layout = getattr(model, LAYOUT_METHOD, dict)()
    known = {"vocab_size", "padded_vocab_modules", "fan_in_fan_out"}
    real = layout.get("vocab_size") if isinstance(layout, dict) else None
    modules = [model.get_submodule(n) for n in layout.get("padded_vocab_modules") or []] if real else []
    if not isinstance(layout, dict) or set(layout) - known or any(raw_weight(m) is None for m in modules):
        raise TypeError(
            f"{caller}: {type(model).__name__}.{LAYOUT_METHOD}() must return a dict with keys among "
            f"{sorted(known)} (padded_vocab_modules: layers with a weight), got {layout!r}"
        )
    return layout, real, {id(m) for m in modules if raw_weight(m).shape[0] != real}


def export_peft_adapter(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    fan_in_fan_out: bool | None = None,
    task_type: str | None = "CAUSAL_LM",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA of ``model`` as a PEFT adapter directory for a twin with the same module names
    (``GPT2LMHeadModel`` for a ``gpt2.GPT``); returns it. ``fan_in_fan_out`` defaults to the model's
    ``peft_adapter_layout()``; ranks and alphas other than the most common go into ``*_pattern``.
    """
    sites, ours = lora_tensors(model, "export_peft_adapter", dtype)
    layout, real, padded = _layout(model, "export_peft_adapter")
    tensors, loras = {}, {site.module_name: site.lora for site in sites}
    for site in sites:
        lora, family, key = site.lora, family_name(site.module), _PREFIX + site.module_name + ".lora_"
        A, B, m = (ours.get(f"{site.name}.{n}") for n in ("lora_A", "lora_B", "lora_magnitude_vector"))
        rows = slice(real if id(site.module) in padded else None)  # the twin has no padded vocabulary rows
        if len(site.plist) != 1 or site.tensor_name != "weight":
            raise LoRAValueError(
                f"export_peft_adapter: {site.name} has parametrizations {[type(p).__name__ for p in site.plist]}; "
                f"PEFT expresses a LoRA alone on a weight only"
            )
        if family == "Linear" and not lora.fan_in_fan_out:
            parts = {"A.weight": A, "B.weight": B[rows], "magnitude_vector": None if m is None else m[rows]}
        elif family == "Embedding" and lora.fan_in_fan_out:  # PEFT stores the embedding update transposed
            if m is not None and rows.stop is not None:  # DoRA's norms run over the rows: rescaled to the twin's
                V = (site.original.float() + lora.delta_weight().float()).detach()
                m = (m.float() * V[rows].norm(dim=0) / V.norm(dim=0).clamp(min=1e-30)).to(m.dtype)
            parts = {"embedding_A": A[rows].t(), "embedding_B": B.t(), "magnitude_vector": m}
        elif family == "Conv2d" and not lora.fan_in_fan_out and site.module.groups == 1:
            parts = {"A.weight": A.reshape(lora.rank, *site.original.shape[1:]), "B.weight": B.reshape(*B.shape, 1, 1)}
            parts["magnitude_vector"] = None if m is None else m.reshape(1, -1, 1, 1)  # PEFT's conv norm shape
        else:
            raise LoRAValueError(
                f"export_peft_adapter: PEFT's LoRA format cannot express the LoRA on {site.name} "
                f"({type(site.module).__name__}, fan_in_fan_out={lora.fan_in_fan_out})"
            )
        tensors |= {key + role: t for role, t in parts.items() if t is not None}
    for flag in ("use_rslora", "use_dora"):
        if len({getattr(p, flag) for p in loras.values()}) != 1:
            raise LoRAValueError(
                f"export_peft_adapter: {flag} is on for some layers and off for others; PEFT has one "
                f"{flag} flag for the adapter: export the two groups as two adapters"
            )
    rank = Counter(p.rank for p in loras.values()).most_common(1)[0][0]
    alpha = Counter(p.lora_alpha for p in loras.values()).most_common(1)[0][0]
    if len(dropouts := sorted({p.lora_dropout_p for p in loras.values()})) > 1:
        logger.warning("export_peft_adapter: layers use dropouts %s; PEFT has one, writing the largest", dropouts)
    # target_modules: the last name components (["c_attn", "c_fc"]) where PEFT's suffix matching selects
    # exactly these modules with them, the full names otherwise
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in loras})
    selected = {n for n, _ in model.named_modules() if n and any(name_matches(n, s) for s in suffixes)}
    config = {  # PEFT fills in the options not written here with their defaults
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropouts[-1],
        "bias": "none",
        "inference_mode": True,
        "target_modules": suffixes if selected == set(loras) else sorted(loras),
        "use_rslora": sites[0].lora.use_rslora,
        "use_dora": sites[0].lora.use_dora,
        "fan_in_fan_out": bool(layout.get("fan_in_fan_out", False) if fan_in_fan_out is None else fan_in_fan_out),
        "rank_pattern": {re.escape(n): p.rank for n, p in loras.items() if p.rank != rank},
        "alpha_pattern": {re.escape(n): p.lora_alpha for n, p in loras.items() if p.lora_alpha != alpha},
    }
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / PEFT_WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    write_atomic(out / PEFT_CONFIG_NAME, lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True)))
    return out


def _check_config(config: dict[str, Any], where: str) -> None:
    if config.get("peft_type") != "LORA":
        raise LoRAValueError(f"{where} is a {config.get('peft_type')!r} adapter; only LORA is supported")
    for key in (k for k, v in config.items() if v and _UNSUPPORTED.fullmatch(k)):
        raise LoRAValueError(
            f"{where} sets {key}={config[key]!r}, an option minlora does not support (LoRA and DoRA only)"
        )
    if config.get("bias", "none") != "none":
        raise LoRAValueError(f"{where} has bias={config['bias']!r} (trained biases); minlora loads bias='none' only")
    try:  # the checks LoRAConfig uses, their messages naming the field
        check_int(config.get("r", 8), "r")
        check_float(config.get("lora_alpha", 8), "lora_alpha")
        check_float(config.get("lora_dropout") or 0.0, "lora_dropout", low=0.0, high=1.0)
        for key, check in (("rank_pattern", check_int), ("alpha_pattern", check_float)):
            if not isinstance(patterns := config.get(key) or {}, dict):
                raise LoRAValueError(f"{key} must be a map of module patterns to values, got {patterns!r}")
            for pattern, value in patterns.items():
                check(value, f"{key}[{pattern!r}]")
                re.compile(pattern)
        for flag in ("use_rslora", "use_dora"):
            if not isinstance(config.get(flag, False), bool):
                raise LoRAValueError(f"{flag} must be true or false, got {config[flag]!r}")
    except (ValueError, TypeError, re.error) as e:
        raise AdapterFileError(f"{where}: {e}; {_REMEDY}") from None


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    # PEFT's rule (peft.utils.other.get_pattern_key): the first key whose regex matches a dotted suffix.
    return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", module_name)), default)


def _pad_rows(t: torch.Tensor, rows: int, real: int | None, padded: bool) -> torch.Tensor:
    """Zero rows for a padded vocabulary (never sampled, so any value is exact)."""
    if padded and t.shape[0] == real and rows > real:
        return torch.cat([t, t.new_zeros(rows - real, *t.shape[1:])])
    return t  # a wrong row count is caught with the other shapes (make_plan)


def import_peft_adapter(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a PEFT LoRA / DoRA adapter directory into ``model`` (same module names), as :func:`load_adapter`
    does (``rank_pattern`` / ``alpha_pattern`` honoured); unsupported options are a ``ValueError``.
    """
    path = Path(directory)
    file, config_file = path / PEFT_WEIGHTS_NAME, path / PEFT_CONFIG_NAME
    if not config_file.is_file() or not file.is_file():
        raise LoRAFileNotFoundError(
            f"import_peft_adapter: {path} needs {PEFT_CONFIG_NAME} and {PEFT_WEIGHTS_NAME} (an adapter_model.bin: "
            f"load it with peft and save_pretrained it again, which writes safetensors)"
        )
    config = parse_json(config_file, config_file, "import_peft_adapter", _REMEDY)
    _check_config(config, f"import_peft_adapter: {config_file}")
    state, _ = read_safetensors(file, "import_peft_adapter", _REMEDY)
    source = f"import_peft_adapter({path})"
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
    _, real, padded = _layout(model, "import_peft_adapter")
    dora, dropout, plans = config.get("use_dora", False), float(config.get("lora_dropout") or 0.0), []
    for module_name, parts in factors.items():
        site = LoRASite(module_name, get_module(model, module_name, source), "weight")
        weight, pad = raw_weight(site.module), id(site.module) in padded
        rows = 0 if weight is None else weight.shape[0]  # no weight: make_plan says so
        embedding = family_name(site.module) == "Embedding"
        if set(parts) != {*(_ROLES[2:4] if embedding else _ROLES[:2]), *_ROLES[4:] * dora}:
            raise LoRAValueError(
                f"{source}: {module_name!r} is a {type(site.module).__name__}, and its factors are lora_"
                f"{sorted(parts)}: PEFT stores lora_embedding_A/B for embeddings, lora_A/B otherwise, "
                f"and with use_dora={dora} {'a' if dora else 'no'} lora_magnitude_vector"
            )
        if embedding:  # ours: A (V, r), B (r, dim)
            A, B = _pad_rows(parts["embedding_A"].t(), rows, real, pad), parts["embedding_B"].t()
        else:  # conv factors (r, in, kh, kw) / (out, r, 1, 1) flatten to 2-D
            A = parts["A.weight"].flatten(1)
            B = _pad_rows(parts["B.weight"].flatten(1), rows, real, pad)
        rank = _pattern_value(config.get("rank_pattern") or {}, module_name, config.get("r", 8))
        if (A.shape[1] if embedding else A.shape[0]) != rank:
            raise LoRAValueError(
                f"{source}: {module_name} has rank-{A.shape[1] if embedding else A.shape[0]} factors but "
                f"the config says r={rank}; adapter_config.json does not match the adapter weights"
            )
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name, config.get("lora_alpha", 8))
        tensors = {"lora_A": A, "lora_B": B}
        if dora:  # (out,) for linear layers, (dim,) for embeddings, (1, out, 1, 1) for convolutions
            M = parts["magnitude_vector"].reshape(-1)
            tensors["lora_magnitude_vector"] = M if embedding else _pad_rows(M, rows, real, pad)
        settings = dict(rank=rank, lora_alpha=alpha, use_rslora=config.get("use_rslora", False), use_dora=dora)
        plans.append(make_plan(site, source, tensors, lora_dropout_p=dropout, **settings))
    check_plans(model, plans, source, strict)
    apply_plans(plans)
    return model
