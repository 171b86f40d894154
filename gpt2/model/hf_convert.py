"""GPT-2 state dicts and configs converted between ``transformers``' layout and :class:`gpt2.GPT`'s:
pure functions, no I/O (:mod:`gpt2.model.hf` reads and writes directories).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from gpt2.errors import InvalidValueError
from gpt2.model.checkpoint_files import CheckpointMismatchError
from gpt2.model.config import GPTConfig
from gpt2.model.tokenizer import EOT_TOKEN

# Projections that transformers' Conv1D stores transposed, (in, out) instead of nn.Linear's (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers that old transformers versions saved into GPT-2 checkpoints; they hold no
# learned values (the mask is rebuilt from the shapes), so they are skipped on import.
_HF_MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# GELU variants that are exactly GPT-2's tanh approximation (what our MLP computes).
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def _hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT2Model checkpoint (no ``transformer.`` prefix) with its HF shape."""
    C, V = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (V, C),
        "wpe.weight": (config.block_size, C),
        "ln_f.weight": (C,),
        "ln_f.bias": (C,),
    }
    block = {"ln_1": (C,), "attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C)}
    block.update({"ln_2": (C,), "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)})
    for i in range(config.n_layer):
        for name, weight in block.items():
            shapes[f"h.{i}.{name}.weight"] = weight
            # Conv1D's weight is (in, out): a bias per output.
            shapes[f"h.{i}.{name}.bias"] = weight[-1:]
    return shapes


def _check_keys(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str, hint: str = ""
) -> None:
    """Raise one error listing every missing, unexpected and wrong-shape key."""
    problems = [f"missing key {k!r} (expected shape {expected[k]})" for k in expected if k not in found]
    problems += [f"unexpected key {k!r} (shape {tuple(found[k].shape)})" for k in found if k not in expected]
    for k, shape in expected.items():
        if k in found and tuple(found[k].shape) != shape:
            problems.append(f"key {k!r}: expected shape {shape}, found {tuple(found[k].shape)}")
    if problems:
        listed = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointMismatchError(f"{what} does not match the model config:\n  {listed}{more}{hint}")


def _strip_hf_prefix(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors by GPT2Model name (``lm_head.weight`` as it is): the ``transformer.`` prefix dropped, the
    causal-mask buffers skipped.
    """
    sd: dict[str, torch.Tensor] = {}
    for key, value in hf_sd.items():
        short = key.removeprefix("transformer.")
        if _HF_MASK_BUFFER.match(short):
            continue
        if short in sd:
            raise CheckpointMismatchError(f"key {short!r} appears twice (with and without 'transformer.')")
        sd[short] = value
    return sd


def _fold_head_into_embedding(sd: Mapping[str, torch.Tensor], wte_key: str) -> dict[str, torch.Tensor]:
    """``sd`` without ``lm_head.weight``: the head and the embedding (``wte_key``) are one tensor, which a
    state dict may carry under either name or both.
    """
    ours = dict(sd)
    head = ours.pop("lm_head.weight", None)
    if head is None:
        return ours
    wte = ours.setdefault(wte_key, head)
    # torch.equal is False on tensors of other shapes too.
    if wte is not head and not torch.equal(wte, head):
        raise CheckpointMismatchError(
            f"'lm_head.weight' differs from 'transformer.wte.weight' (shapes {tuple(head.shape)} and "
            f"{tuple(wte.shape)}): GPT-2 (and this model) ties the LM head to the token embedding; untied weights "
            "can be neither loaded nor exported to GPT2LMHeadModel"
        )
    return ours


def hf_to_gpt_state_dict(hf_sd: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Map a ``transformers`` GPT-2 state dict (GPT2LMHeadModel or GPT2Model keys) onto :class:`gpt2.GPT`'s.

    Conv1D weights are transposed, the embedding is zero-padded to ``padded_vocab_size``,
    ``lm_head.weight`` must equal it (GPT-2 ties them), and with ``bias=False`` the biases must
    be zero and are dropped. :class:`CheckpointMismatchError` names every bad key and shape.
    """
    sd = _fold_head_into_embedding(_strip_hf_prefix(hf_sd), "wte.weight")
    _check_keys(
        sd,
        _hf_shapes(config),
        "Hugging Face GPT-2 state dict",
        hint="\nIs the checkpoint a GPT-2 of this size? (config_from_hf builds the matching config)",
    )

    out: dict[str, torch.Tensor] = {}
    for short, value in sd.items():
        if short.endswith(".bias") and not config.bias:
            # bias=False drops the biases, which must then be zeros
            if bool(value.count_nonzero()):
                raise CheckpointMismatchError(
                    f"key {short!r} holds non-zero biases but config.bias=False; load it with bias=True"
                )
            continue
        if short.endswith(CONV1D_WEIGHTS):
            value = value.t()
        out["transformer." + short] = value.contiguous()
    pad = config.padded_vocab_size - config.vocab_size
    if pad:
        # Padded rows are never read (ids >= vocab_size are rejected, their logits sliced off);
        # zeros keep them inert and deterministic.
        out["transformer.wte.weight"] = torch.nn.functional.pad(out["transformer.wte.weight"], (0, 0, 0, pad))
    # Tied: one tensor under both names.
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def refuse_parametrized(sd: Mapping[str, torch.Tensor]) -> None:
    parametrized = sorted({k.split(".parametrizations.")[0] for k in sd if ".parametrizations." in k})
    if parametrized:
        raise InvalidValueError(
            f"the model still has parametrizations (e.g. LoRA) on {parametrized[:4]} ({len(parametrized)} layer(s) "
            f"in all): merge the adapter into the weights first, e.g. minlora.merge_lora(model), then save"
        )


def _gpt_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of :class:`gpt2.GPT`'s state dict but the head, with its shape."""
    expected: dict[str, tuple[int, ...]] = {}
    for short, shape in _hf_shapes(config).items():
        if short.endswith(".bias") and not config.bias:
            continue
        if short.endswith(CONV1D_WEIGHTS):
            shape = shape[::-1]
        expected["transformer." + short] = shape
    expected["transformer.wte.weight"] = (config.padded_vocab_size, config.n_embd)
    return expected


def gpt_to_hf_state_dict(sd: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Map :class:`gpt2.GPT`'s state dict onto ``transformers.GPT2LMHeadModel``'s: Conv1D weights
    transposed, padding stripped, zero biases for ``bias=False`` (GPT2LMHeadModel always has them),
    ``lm_head.weight`` the same tensor as the embedding. Parametrizations must be merged first.
    """
    refuse_parametrized(sd)
    # A compiled or DDP model's state dict (its keys carry the wrapper's prefix): what to pass instead.
    wrapped = sorted({k.split(".")[0] for k in sd if k.startswith(("_orig_mod.", "module."))})
    hint = ""
    if wrapped:
        hint = (
            f"\nKeys start with {wrapped}: pass the unwrapped model's state dict (model._orig_mod for "
            "torch.compile, model.module for DDP)"
        )
    ours = _fold_head_into_embedding(sd, "transformer.wte.weight")
    _check_keys(ours, _gpt_shapes(config), "GPT state dict", hint=hint)

    out: dict[str, torch.Tensor] = {}
    for short, shape in _hf_shapes(config).items():
        value = ours.get("transformer." + short)
        # Absent: a bias of a bias=False model, zeros in GPT2LMHeadModel.
        if value is None:
            value = ours["transformer.wte.weight"].new_zeros(shape)
        elif short.endswith(CONV1D_WEIGHTS):
            value = value.t().contiguous()
        out["transformer." + short] = value
    out["transformer.wte.weight"] = out["transformer.wte.weight"][: config.vocab_size]
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# Flags of transformers' GPT2Config with the one value this model implements, and why.
_FIXED_FLAGS = (
    ("scale_attn_by_inverse_layer_idx", False, "attention scores are not scaled per layer"),
    ("reorder_and_upcast_attn", False, "Mistral-style attention upcast is not implemented"),
    ("scale_attn_weights", True, "attention always scales by 1/sqrt(head_dim)"),
    ("add_cross_attention", False, "decoder-only model, no cross-attention"),
    ("tie_word_embeddings", True, "the LM head is tied to the token embedding"),
)


def _hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """A GPT-2 ``config.json`` dict, with the keys every GPT-2 config has."""
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config must be a transformers GPT2Config or a dict, got {type(hf_config).__name__}")
    c = dict(hf_config)
    model_type = c.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise InvalidValueError(f"not a GPT-2 config: model_type is {model_type!r}, expected 'gpt2'")
    for key in ("n_embd", "n_layer", "n_head", "vocab_size"):
        if key not in c:
            raise InvalidValueError(f"GPT-2 config has no {key!r}; keys found: {sorted(c)}")
    return c


def _unsupported_settings(c: dict[str, Any]) -> list[str]:
    """Each setting of the config that this model does not implement, with the reason."""
    unsupported = []
    act = c.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        unsupported.append(f"activation_function={act!r} (this model implements the tanh GELU: {_TANH_GELUS})")
    n_inner = c.get("n_inner")
    if n_inner is not None and n_inner != 4 * c["n_embd"]:
        unsupported.append(f"n_inner={n_inner} (this model's MLP is 4 * n_embd = {4 * c['n_embd']} wide)")
    unsupported += [f"{key}={not ours} ({why})" for key, ours, why in _FIXED_FLAGS if bool(c.get(key, ours)) != ours]
    return unsupported


def config_from_hf(hf_config: Any, **overrides: Any) -> GPTConfig:
    """A :class:`GPTConfig` from a ``transformers.GPT2Config`` or its ``config.json`` dict; architectures
    this model does not implement are rejected with the reason. ``overrides`` set our own fields
    (``pad_vocab_multiple``, ``dropout``, ``flash``); dropout is 0 unless given (HF's ``*_pdrop`` are ignored).
    """
    c = _hf_config_dict(hf_config)
    unsupported = _unsupported_settings(c)
    if unsupported:
        raise InvalidValueError("unsupported GPT-2 config: " + "; ".join(unsupported))
    fields = dict(
        # transformers' GPT2Config reads n_positions (the size of wpe), 1024 where it is absent, and ignores n_ctx.
        block_size=int(c.get("n_positions", 1024)),
        vocab_size=int(c["vocab_size"]),
        n_layer=int(c["n_layer"]),
        n_head=int(c["n_head"]),
        n_embd=int(c["n_embd"]),
        layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)),
        # GPT2LMHeadModel always has biases.
        bias=True,
        dropout=0.0,
    )
    return GPTConfig(**{**fields, **overrides})


def hf_config_from_gpt(config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` dict of a ``transformers.GPT2LMHeadModel`` with ``config``'s shape
    (``transformers.GPT2Config(**d)`` builds the object). Where GPT2Config's default is this model's (an MLP of
    4 * n_embd, the KV cache, the init std), the file leaves the key out: transformers fills it in.
    """
    # BOS and EOS, if the vocabulary has <|endoftext|>.
    eot = None
    if config.vocab_size > EOT_TOKEN:
        eot = EOT_TOKEN
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        # The real vocabulary: padding is stripped on export.
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        # The one value of each flag that this model implements.
        **{key: ours for key, ours, _ in _FIXED_FLAGS},
        "bos_token_id": eot,
        "eos_token_id": eot,
    }
