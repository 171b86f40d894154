"""Hugging Face interop: GPT-2 checkpoints in and out of ``transformers`` format.

The conversion is a pair of pure functions of state dicts (:func:`hf_to_gpt_state_dict`,
:func:`gpt_to_hf_state_dict`); :func:`from_pretrained` and :func:`save_pretrained` add file I/O
and the hub around them.

GPT-2's original code (and ``transformers``' ``Conv1D``) stores projection weights as
``(in_features, out_features)``; ``nn.Linear`` stores ``(out_features, in_features)``, so the
four projections ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` are
transposed on the way in and out. Every other tensor maps one to one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .config import GPT2_VOCAB_SIZE, GPTConfig
from .distributed import unwrap_model

# This module never imports gpt2.model at import time: the model imports it (GPT.from_pretrained,
# GPT.save_pretrained), so the dependency runs one way, model -> hf -> config.

logger = logging.getLogger(__name__)

# Projections that transformers' Conv1D stores transposed, (in, out) instead of nn.Linear's (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers that old transformers versions saved into GPT-2 checkpoints; they hold no
# learned values (the mask is rebuilt from the shapes), so they are skipped on import.
_HF_MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# GELU variants that are exactly GPT-2's tanh approximation (what our MLP computes).
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# <|endoftext|>: GPT-2's BOS and EOS token; only written into config.json when it is in the vocab.
_EOT_ID = GPT2_VOCAB_SIZE - 1
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
# The official GPT-2 checkpoints. Written bare, these names always mean the hub, even where a
# directory of that name exists (this repository's own package directory is called gpt2/);
# write a path ("./gpt2", an absolute path) to load a local directory with such a name.
OFFICIAL_HUB_IDS = frozenset(
    [f"{owner}{name}" for owner in ("", "openai-community/")
     for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")]
    + ["distilgpt2", "distilbert/distilgpt2"]
)
_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"


class CheckpointMismatchError(ValueError):
    """A state dict does not match the model: missing, unexpected or wrong-shape keys."""


# ---------------------------------------------------------------------------- key layout
def _hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT2Model checkpoint (no ``transformer.`` prefix) with its HF shape."""
    C, V = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (V, C),
        "wpe.weight": (config.block_size, C),
        "ln_f.weight": (C,),
        "ln_f.bias": (C,),
    }
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "mlp.c_fc.weight": (C, 4 * C), p + "mlp.c_fc.bias": (4 * C,),
            p + "mlp.c_proj.weight": (4 * C, C), p + "mlp.c_proj.bias": (C,),
        })
    return shapes


def _is_conv1d(key: str) -> bool:
    return key.endswith(CONV1D_WEIGHTS)


def _is_bias(key: str) -> bool:
    return key.endswith(".bias")


def _check_keys(found: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                what: str, hint: str = "") -> None:
    """Raise one error listing every missing, unexpected and wrong-shape key."""
    problems = []
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    for k in missing:
        problems.append(f"missing key {k!r} (expected shape {expected[k]})")
    for k in unexpected:
        problems.append(f"unexpected key {k!r} (shape {tuple(found[k].shape)})")
    for k, shape in expected.items():
        if k in found and tuple(found[k].shape) != shape:
            problems.append(f"key {k!r}: expected shape {shape}, found {tuple(found[k].shape)}")
    if problems:
        listed = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointMismatchError(f"{what} does not match the model config:\n  {listed}{more}{hint}")


# ---------------------------------------------------------------------------- HF -> ours
def hf_to_gpt_state_dict(hf_sd: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Map a ``transformers`` GPT-2 state dict onto :class:`gpt2.GPT`'s.

    Accepts GPT2LMHeadModel keys (``transformer.h.0...``, ``lm_head.weight``) and GPT2Model keys
    (``h.0...``). Conv1D weights are transposed; the old causal-mask buffers are skipped; the
    token embedding is padded with zero rows up to ``config.padded_vocab_size``; ``lm_head.weight``
    must equal the token embedding (GPT-2 ties them). With ``config.bias=False`` the checkpoint's
    biases must be zero (as :func:`gpt_to_hf_state_dict` writes them) and are dropped. Every key
    and shape is checked; :class:`CheckpointMismatchError` names each offender.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    sd: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, value in hf_sd.items():
        if key == "lm_head.weight":
            lm_head = value
            continue
        short = key.removeprefix("transformer.")
        if _HF_MASK_BUFFER.match(short):
            continue
        if short in sd:
            raise CheckpointMismatchError(f"key {short!r} appears twice (with and without 'transformer.')")
        sd[short] = value
    if "wte.weight" not in sd and lm_head is not None:
        sd["wte.weight"] = lm_head  # a tied checkpoint may keep the shared tensor under the head's name
    expected = _hf_shapes(config)
    _check_keys(sd, expected, "Hugging Face GPT-2 state dict",
                hint="\nIs the checkpoint a GPT-2 of this size? (config_from_hf builds the matching config)")
    wte = sd["wte.weight"]
    if lm_head is not None and lm_head is not wte:
        if tuple(lm_head.shape) != tuple(wte.shape):
            raise CheckpointMismatchError(
                f"key 'lm_head.weight': expected shape {tuple(wte.shape)} (tied to wte), "
                f"found {tuple(lm_head.shape)}"
            )
        if not torch.equal(lm_head, wte):
            raise CheckpointMismatchError(
                "key 'lm_head.weight' differs from 'transformer.wte.weight': this checkpoint does not "
                "tie its LM head to the token embedding, which GPT-2 (and this model) requires"
            )

    out: dict[str, torch.Tensor] = {}
    for short, value in sd.items():
        if _is_bias(short) and not config.bias:
            if bool(value.count_nonzero()):
                raise CheckpointMismatchError(
                    f"key {short!r} holds non-zero biases but config.bias=False; load it with bias=True"
                )
            continue
        if _is_conv1d(short):
            value = value.t()
        out["transformer." + short] = value.contiguous()
    pad = config.padded_vocab_size - config.vocab_size
    if pad:
        # Padded rows are never read (ids >= vocab_size are rejected, their logits sliced off);
        # zeros keep them inert and deterministic.
        wte = out["transformer.wte.weight"]
        out["transformer.wte.weight"] = torch.cat([wte, wte.new_zeros(pad, wte.size(1))])
    out["lm_head.weight"] = out["transformer.wte.weight"]  # tied: one tensor under both names
    return out


# ---------------------------------------------------------------------------- ours -> HF
def gpt_to_hf_state_dict(sd: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Map :class:`gpt2.GPT`'s state dict onto ``transformers.GPT2LMHeadModel``'s.

    Conv1D weights are transposed, vocabulary padding is stripped, a ``bias=False`` model gets
    zero biases (GPT2LMHeadModel always has them), and ``lm_head.weight`` is the same tensor as
    ``transformer.wte.weight``. LoRA (or any) parametrizations must be merged first.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    parametrized = sorted({k.split(".parametrizations.")[0] for k in sd if ".parametrizations." in k})
    if parametrized:
        raise ValueError(
            f"the model still has parametrizations (e.g. LoRA) on {parametrized[:4]}"
            f"{' ...' if len(parametrized) > 4 else ''}: merge them into the weights first, e.g. "
            f"minlora.merge_lora(model), then save"
        )
    wrapped = sorted({k.split(".")[0] for k in sd if k.startswith(("_orig_mod.", "module."))})
    hint = (f"\nKeys start with {wrapped}: pass the unwrapped model's state dict "
            f"(model._orig_mod for torch.compile, model.module for DDP)") if wrapped else ""

    C, Vp = config.n_embd, config.padded_vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    for short, shape in _hf_shapes(config).items():
        if _is_bias(short) and not config.bias:
            continue
        if _is_conv1d(short):
            shape = shape[::-1]
        expected["transformer." + short] = shape
    expected["transformer.wte.weight"] = (Vp, C)
    ours = dict(sd)
    # The head and the embedding are one tensor; a state dict may carry it under either name or both.
    head = ours.pop("lm_head.weight", None)
    if head is not None:
        wte = ours.setdefault("transformer.wte.weight", head)
        if wte is not head and (wte.shape != head.shape or not torch.equal(wte, head)):
            raise CheckpointMismatchError(
                "'lm_head.weight' differs from 'transformer.wte.weight': GPT-2 ties them, untied "
                "weights cannot be exported to GPT2LMHeadModel"
            )
    _check_keys(ours, expected, "GPT state dict", hint=hint)

    out: dict[str, torch.Tensor] = {}
    for key, value in ours.items():
        short = key[len("transformer."):]
        if _is_conv1d(short):
            value = value.t().contiguous()
        out[key] = value
    out["transformer.wte.weight"] = out["transformer.wte.weight"][: config.vocab_size]
    if not config.bias:
        like = out["transformer.wte.weight"]
        for short, shape in _hf_shapes(config).items():
            if _is_bias(short):
                out["transformer." + short] = like.new_zeros(shape)
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# ---------------------------------------------------------------------------- configs
def config_from_hf(hf_config: Any, **overrides: Any) -> GPTConfig:
    """A :class:`GPTConfig` from a ``transformers.GPT2Config`` or its dict (``config.json``).

    ``overrides`` set our own fields (``pad_vocab_multiple``, ``dropout``, ``flash``). Configs that
    change the architecture in ways this model does not implement are rejected with the reason.
    Dropout defaults to 0 (HF's ``*_pdrop`` are ignored): pass ``dropout=`` to fine-tune with it.
    """
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config must be a transformers GPT2Config or a dict, got {type(hf_config).__name__}")
    c = dict(hf_config)
    model_type = c.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"not a GPT-2 config: model_type is {model_type!r}, expected 'gpt2'")
    for key in ("n_embd", "n_layer", "n_head", "vocab_size"):
        if key not in c:
            raise ValueError(f"GPT-2 config has no {key!r}; keys found: {sorted(c)}")
    n_positions = c.get("n_positions", c.get("n_ctx"))
    if n_positions is None:
        raise ValueError("GPT-2 config has neither 'n_positions' nor 'n_ctx' (the context length)")
    if c.get("n_ctx") is not None and c.get("n_positions") is not None and c["n_ctx"] != c["n_positions"]:
        logger.warning("config has n_ctx=%s != n_positions=%s; using n_positions (the size of wpe)",
                       c["n_ctx"], c["n_positions"])
    unsupported = []
    act = c.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        unsupported.append(f"activation_function={act!r} (this model implements the tanh GELU: {_TANH_GELUS})")
    n_inner = c.get("n_inner")
    if n_inner is not None and n_inner != 4 * c["n_embd"]:
        unsupported.append(f"n_inner={n_inner} (this model's MLP is 4 * n_embd = {4 * c['n_embd']} wide)")
    if c.get("scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=True (attention scores are not scaled per layer)")
    if c.get("reorder_and_upcast_attn", False):
        unsupported.append("reorder_and_upcast_attn=True (Mistral-style attention upcast is not implemented)")
    if not c.get("scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False (attention always scales by 1/sqrt(head_dim))")
    if c.get("add_cross_attention", False):
        unsupported.append("add_cross_attention=True (decoder-only model, no cross-attention)")
    if not c.get("tie_word_embeddings", True):
        unsupported.append("tie_word_embeddings=False (the LM head is tied to the token embedding)")
    if unsupported:
        raise ValueError("unsupported GPT-2 config: " + "; ".join(unsupported))
    fields = dict(
        block_size=int(n_positions),
        vocab_size=int(c["vocab_size"]),
        n_layer=int(c["n_layer"]),
        n_head=int(c["n_head"]),
        n_embd=int(c["n_embd"]),
        layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)),
        bias=True,  # GPT2LMHeadModel always has biases
        dropout=0.0,
    )
    fields.update(overrides)
    return GPTConfig(**fields)


def hf_config_from_gpt(config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` dict of a ``transformers.GPT2LMHeadModel`` with ``config``'s shape
    (``transformers.GPT2Config(**d)`` builds the object)."""
    eot = _EOT_ID if config.vocab_size > _EOT_ID else None  # <|endoftext|> only if it exists
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,  # the real vocabulary: padding is stripped on export
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # None = 4 * n_embd
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
    }


# ---------------------------------------------------------------------------- loading
def load_hf_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a ``transformers`` checkpoint directory: ``model.safetensors``, a sharded
    safetensors index, ``pytorch_model.bin`` or a sharded ``.bin`` index (read with
    ``torch.load(weights_only=True)``, so no pickled code runs), in that order of preference."""
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / _SAFETENSORS).is_file():
        return load_file(d / _SAFETENSORS)
    if (d / _SAFETENSORS_INDEX).is_file():
        return _load_sharded(d, _SAFETENSORS_INDEX, load_file)
    if (d / _BIN).is_file():
        return _torch_load(d / _BIN)
    if (d / _BIN_INDEX).is_file():
        return _load_sharded(d, _BIN_INDEX, _torch_load)
    found = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    raise FileNotFoundError(
        f"no weights in {str(d)!r}: expected {_SAFETENSORS}, {_SAFETENSORS_INDEX}, {_BIN} or {_BIN_INDEX}; "
        f"found {found}"
    )


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_sharded(d: Path, index_name: str, load) -> dict[str, torch.Tensor]:
    with open(d / index_name) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{d / index_name} has no 'weight_map' dict: not a transformers shard index")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (d / shard).is_file():
            raise FileNotFoundError(f"shard {shard!r} listed in {index_name} is missing from {str(d)!r}")
        out.update(load(d / shard))
    return out


def resolve_source(name_or_path: str | os.PathLike) -> str | Path:
    """Where a model named on the command line or in ``from_pretrained`` comes from: a hub id
    (returned as ``str``) or an existing local path (returned as ``Path``).

    The rule, in order:

    1. the bare name of an official GPT-2 checkpoint (``gpt2``, ``gpt2-medium``, ``gpt2-large``,
       ``gpt2-xl``, ``distilgpt2``, or those under ``openai-community/`` / ``distilbert/``) is
       the hub model, even where a directory of that name exists, as this repository's ``gpt2/``
       package does in its checkout (write ``./gpt2`` for a local directory of that name);
    2. anything else that exists on disk (``~`` expanded) is local, never a hub id;
    3. anything else shaped like a hub id (``name`` or ``owner/name``) is a hub id; other strings
       (``./x``, ``/abs/x``, ``a/b/c``, ``~/x``) are paths that do not exist: FileNotFoundError.

    ``os.PathLike`` objects (``pathlib.Path``) are always paths.
    """
    if isinstance(name_or_path, str) and name_or_path in OFFICIAL_HUB_IDS:
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"expected a hub id or a path, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.exists():
        return path
    if isinstance(name_or_path, str) and _HUB_ID.match(name) is not None:
        return name
    raise FileNotFoundError(
        f"{name!r} does not exist: it is neither an existing directory nor a Hugging Face hub id "
        f"(such as 'gpt2' or 'owner/model'); check the path"
    )


def _resolve(name_or_path: str | os.PathLike, cache_dir, revision) -> Path:
    """A local directory holding the checkpoint: the path itself, or a hub snapshot."""
    source = resolve_source(name_or_path)
    if isinstance(source, str):
        return _download(source, cache_dir, revision)
    if not source.is_dir():
        raise NotADirectoryError(
            f"{str(source)!r} is a file; from_pretrained expects a directory with config.json and "
            f"model.safetensors (or pytorch_model.bin), or a hub id such as 'gpt2'"
        )
    if not (source / "config.json").is_file():
        found = sorted(p.name for p in source.iterdir())[:10]
        hub = (f"; for the hub model {source.name!r} write its bare name"
               if source.name in OFFICIAL_HUB_IDS else "")
        raise FileNotFoundError(
            f"local directory {str(source)!r} has no config.json: not a transformers model directory "
            f"(expected config.json and model.safetensors; found {found}){hub}"
        )
    return source


def _download(repo_id: str, cache_dir, revision) -> Path:
    from huggingface_hub import snapshot_download

    try:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:  # huggingface_hub < 0.22 keeps them in utils
        from huggingface_hub.utils import RepositoryNotFoundError, RevisionNotFoundError

    # Only what loading needs: the config and safetensors weights; .bin only as a fallback for
    # repos that have no safetensors (flax/tf/onnx/tflite files are never fetched).
    try:
        folder = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir,
            allow_patterns=["config.json", "model*.safetensors", _SAFETENSORS_INDEX],
        ))
        if not any(folder.glob("model*.safetensors")):
            folder = Path(snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir,
                allow_patterns=["config.json", "pytorch_model*.bin", _BIN_INDEX],
            ))
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"revision {revision!r} of {repo_id!r} does not exist on the hub") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{repo_id!r} is no local path and the hub has no such (accessible) model repo; "
            f"check the name, or log in (huggingface-cli login) for a gated/private repo"
        ) from e
    except Exception as e:  # offline, DNS, proxy, timeouts: all end here
        raise ConnectionError(
            f"could not load {repo_id!r}: it is read as a hub id and the Hugging Face hub could "
            f"not be reached ({type(e).__name__}: {e}). Either download it once with network access "
            f"(it is then cached under $HF_HOME, default ~/.cache/huggingface; point HF_HOME or "
            f"cache_dir= at an existing cache), or pass the path of a local directory holding "
            f"config.json and model.safetensors, e.g. one written by save_pretrained"
        ) from e
    return folder


def from_pretrained(
    name_or_path: str | os.PathLike,
    *,
    pad_vocab_multiple: int = 1,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    dropout: float = 0.0,
    model_class: type[torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """A :class:`gpt2.GPT` (or ``model_class``) with the weights of a GPT-2 checkpoint.

    ``name_or_path`` is a local ``transformers`` directory (``config.json`` plus
    ``model.safetensors``, ``pytorch_model.bin`` or a shard index) or a hub id (``gpt2``,
    ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl`` or any GPT-2-architecture repo), downloaded into
    the usual Hugging Face cache; :func:`resolve_source` says which (bare official names are the
    hub, other existing paths are local). ``dtype`` defaults to float32 (master weights for
    training; use autocast or ``dtype=torch.bfloat16`` for inference). ``model_class`` is built
    as ``model_class(config)`` (``GPT.from_pretrained`` passes its class; default
    :class:`gpt2.GPT`). The model is returned in eval mode.
    """
    if model_class is None:
        # Deferred: gpt2.model imports this module, so importing it here at the top would make
        # the two import each other. Only this convenience default needs it.
        from .model import GPT as model_class
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    directory = _resolve(name_or_path, cache_dir, revision)
    with open(directory / "config.json") as f:
        config = config_from_hf(json.load(f), pad_vocab_multiple=pad_vocab_multiple, dropout=dropout)
    sd = hf_to_gpt_state_dict(load_hf_state_dict(directory), config)
    dtype = dtype or torch.float32
    wte = sd["transformer.wte.weight"].to(device=device, dtype=dtype)
    sd = {k: (wte if k in ("transformer.wte.weight", "lm_head.weight") else v.to(device=device, dtype=dtype))
          for k, v in sd.items()}
    # Build on the meta device (no memory, no random init), then adopt the loaded tensors.
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(sd, strict=True, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # assign=True made two Parameters: re-tie
    source = "" if Path(str(name_or_path)).expanduser() == Path(directory) else f" from {directory}"
    logger.info("loaded %s (%s parameters)%s", name_or_path, f"{model.num_params():,}", source)
    return model.eval()


# ---------------------------------------------------------------------------- saving
def save_pretrained(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    safe_serialization: bool = True,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write ``model`` as a ``transformers.GPT2LMHeadModel`` directory; returns its path.

    ``config.json`` plus ``model.safetensors`` (vocabulary padding stripped, the tied LM head stored
    once as ``transformer.wte.weight``, as transformers does). ``safe_serialization=False`` writes
    ``pytorch_model.bin`` instead, for old tools that cannot read safetensors; it holds only
    tensors (``torch.load(..., weights_only=True)`` reads it). ``tokenizer_dir``, a directory with
    GPT-2's ``encoder.json`` and ``vocab.bpe``, adds the tokenizer files (``vocab.json``,
    ``merges.txt``) so ``AutoTokenizer.from_pretrained(directory)`` works too.
    """
    from safetensors.torch import save_file

    inner = unwrap_model(model)
    if not isinstance(getattr(inner, "config", None), GPTConfig):  # a gpt2.GPT (or subclass)
        raise TypeError(f"save_pretrained expects a gpt2.GPT (optionally compiled/DDP-wrapped), got {type(inner).__name__}")
    config = inner.config
    hf_sd = gpt_to_hf_state_dict(inner.state_dict(), config)
    # transformers re-ties lm_head to the embedding on load; safetensors refuses shared tensors.
    del hf_sd["lm_head.weight"]
    # clone(): the vocabulary slice is a view into the padded embedding, and safetensors / a
    # compact .bin need each tensor to own exactly its bytes.
    hf_sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in hf_sd.items()}

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = hf_config_from_gpt(config)
    hf_config["torch_dtype"] = str(inner.lm_head.weight.dtype).removeprefix("torch.")
    # Drop weights of the other format so transformers cannot pick up a stale file.
    stale = _BIN if safe_serialization else _SAFETENSORS
    (out / stale).unlink(missing_ok=True)
    # Each file is written under a temporary name and renamed into place, weights first: a crash
    # leaves whole files behind, never a truncated one that transformers would fail to read.
    if safe_serialization:
        _atomic_write(out / _SAFETENSORS, lambda tmp: save_file(hf_sd, str(tmp), metadata={"format": "pt"}))
    else:
        _atomic_write(out / _BIN, lambda tmp: torch.save(hf_sd, tmp))
    config_text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    _atomic_write(out / "config.json", lambda tmp: tmp.write_text(config_text, encoding="utf-8"))
    if tokenizer_dir is not None:
        _write_tokenizer(Path(tokenizer_dir), out, config)
    logger.info("saved %s to %s", type(inner).__name__, out)
    return out


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` to a temporary name beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_tokenizer(src: Path, out: Path, config: GPTConfig) -> None:
    """GPT-2's BPE files under transformers' names: encoder.json is vocab.json and vocab.bpe is
    merges.txt, byte for byte (OpenAI's release and the hub's gpt2 repo ship the same files)."""
    files = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}
    missing = [name for name in files if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"tokenizer_dir {str(src)!r} lacks {missing}: it must hold GPT-2's encoder.json and vocab.bpe"
        )
    for name, target in files.items():
        shutil.copyfile(src / name, out / target)
    eot = "<|endoftext|>"
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": config.block_size,
        "bos_token": eot,
        "eos_token": eot,
        "unk_token": eot,
        "add_prefix_space": False,
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(tok_config, f, indent=2)
        f.write("\n")
