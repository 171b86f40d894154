"""PEFT interop: :func:`export_peft_adapter` / :func:`import_peft_adapter`.

The format is what ``peft.PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` reads:
  ``adapter_config.json``          ``peft_type="LORA"``, ``r``, ``lora_alpha``, ``target_modules``, ...
  ``adapter_model.safetensors``    ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and
                                   ``.lora_B.weight`` ``(out, r)`` for linear layers (also for
                                   ``transformers``' ``Conv1D``: ``fan_in_fan_out`` only changes how
                                   PEFT merges, not what it stores); ``.lora_embedding_A`` ``(r, V)``
                                   and ``.lora_embedding_B`` ``(dim, r)`` for embeddings.
The ``peft`` package is not needed. minlora's own format is in :mod:`minlora.adapters`.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .adapter_io import (
    AdapterFileError,
    LoadPlan,
    apply_plans,
    check_factor_values,
    check_store_dtype,
    family_name,
    fans,
    get_module,
    is_alpha,
    is_dropout,
    is_positive_int,
    json_text,
    read_json,
    read_safetensors,
    single_lora,
    write_atomic,
)
from .config import raw_weight
from .model import lora_sites
from .parametrization import LoRAParametrization

__all__ = ["export_peft_adapter", "import_peft_adapter", "PEFT_WEIGHTS_NAME", "PEFT_CONFIG_NAME", "LAYOUT_METHOD"]

logger = logging.getLogger(__name__)

PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_CONFIG_NAME = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


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
    check_store_dtype(dtype, "export_peft_adapter")
    layout = _peft_layout(model, "export_peft_adapter")
    vocab = _VocabPadding.of(model, layout)
    tensors: dict[str, torch.Tensor] = {}
    loras: dict[str, LoRAParametrization] = {}
    for site in sites:
        lora = single_lora(site, "export_peft_adapter")
        if len(site.plist) != 1 or site.tensor_name != "weight":
            raise ValueError(
                f"export_peft_adapter: {site.name} has parametrizations {[type(p).__name__ for p in site.plist]}; "
                f"PEFT can express a LoRA alone on a layer's weight only"
            )
        family = family_name(site.module)
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
    write_atomic(out / PEFT_WEIGHTS_NAME, lambda t: save_file(tensors, str(t), metadata={"format": "pt"}))
    write_atomic(out / PEFT_CONFIG_NAME, lambda t: t.write_text(json_text(config)))
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
    if not is_positive_int(config.get("r", 8)):
        raise AdapterFileError(f"{where}: r must be a positive integer, got {config.get('r')!r}; {remedy}")
    if not is_alpha(config.get("lora_alpha", 8)):
        raise AdapterFileError(
            f"{where}: lora_alpha must be a finite, non-zero number, got {config.get('lora_alpha')!r}; {remedy}"
        )
    for key, ok, what in (("rank_pattern", is_positive_int, "positive integers"),
                          ("alpha_pattern", is_alpha, "finite, non-zero numbers")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) and ok(v) for k, v in patterns.items()):
            raise AdapterFileError(f"{where}: {key} must map module patterns to {what}, got {patterns!r}; {remedy}")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise AdapterFileError(f"{where}: {key} key {pattern!r} is not a valid regex ({e}); {remedy}") from None
    dropout = config.get("lora_dropout", 0.0) or 0.0
    if not is_dropout(dropout):
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
    config = read_json(config_path, caller, remedy)
    _check_peft_config(config, path)
    _check_peft_numbers(config, config_path, remedy)
    weights_path = path / PEFT_WEIGHTS_NAME
    if weights_path.is_file():
        state, _ = read_safetensors(weights_path, caller, remedy)
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
    check_factor_values({k: v for k, v in state.items() if not k.endswith(".base_layer.weight")},
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
        module = get_module(model, module_name, source)
        family = family_name(module)
        if family is None:
            raise ValueError(
                f"{source}: {module_name!r} is a {type(module).__name__}; minlora puts LoRA on nn.Linear, "
                f"nn.Embedding and nn.Conv2d"
            )
        weight = raw_weight(module)
        fan_in, fan_out, fifo = fans(module, family, weight)
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
        plans.append(LoadPlan(module_name, module, "weight", rank=rank, lora_alpha=alpha, use_rslora=use_rslora,
                           dropout=dropout, fan_in=fan_in, fan_out=fan_out, fan_in_fan_out=fifo, lora_A=A, lora_B=B))
    apply_plans(model, plans, source, strict)
    return model


def _pad_vocab_rows(t: torch.Tensor, rows: int, vocab: _VocabPadding | None, module: nn.Module, what: str,
                    source: str) -> torch.Tensor:
    """Zero rows for a padded vocabulary (never sampled, so any value is exact)."""
    if t.shape[0] == rows:
        return t
    if vocab is not None and vocab.applies(module) and rows == vocab.padded and t.shape[0] == vocab.real:
        return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    raise ValueError(f"{source}: {what} has {t.shape[0]} rows but the model's layer needs {rows}")
