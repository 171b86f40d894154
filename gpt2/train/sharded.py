"""The weights and optimizer state of a sharded checkpoint (``shards/``), through ``torch.distributed.checkpoint``.

Under FSDP every process writes its own shards of the weights and of AdamW's moments: no process ever holds the
whole model. Each process's file is safetensors (torch's Hugging Face storage) whose JSON header records where its
slices sit in the whole tensors, so the shards load into any number of processes, sharded or not: 2 FSDP processes
-> 1 process, -> 4 FSDP processes, -> 2 DDP processes. The optimizer state is keyed by parameter name, not by
position, for the same reason; only its tensors are stored (this run's settings are kept on loading), so nothing
is pickled. The atomic directory, its SHA256SUMS and the rest of the checkpoint are :mod:`gpt2.train.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from gpt2 import torch_compat
from gpt2.model.checkpoint_files import (
    MODEL_KEY,
    OPTIM_KEY,
    SHARDS_DIR,
    CheckpointMismatchError,
    _first_line,
    load_shards_into,
)
from gpt2.train.distributed import _active


def write_shards(directory: Path, model: nn.Module, optimizer: Any, trainable_only: bool) -> None:
    """Every process writes its shards of ``model`` (its trainable weights alone with ``trainable_only``) and of
    ``optimizer``'s state into ``directory/shards`` (a collective under FSDP).
    """
    # imported here, as in every function of this module: torch.distributed.checkpoint costs ~1.3 s of every start
    # of the package (see gpt2.torch_compat.is_fsdp_module)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # safetensors stores no tensor twice: a tied weight's second name gets a copy
    seen: set[int] = set()
    weights = {}
    for name, tensor in _model_state(model, trainable_only).items():
        ptr = (tensor.to_local() if torch_compat.is_dtensor(tensor) else tensor).untyped_storage().data_ptr()
        weights[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    state: dict[str, Any] = {MODEL_KEY: weights}
    if optimizer is not None:
        state[OPTIM_KEY] = _tensors(get_optimizer_state_dict(model, optimizer))
    # One safetensors file per process, its slices' places in the whole tensors in its JSON header.
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(directory / SHARDS_DIR), save_distributed=True))


def load_shards(checkpoint: Path, model: nn.Module, optimizer: Any, trainable_only: bool) -> None:
    """Load a sharded checkpoint's weights (and, given an ``optimizer``, its state) into ``model``, sharded by FSDP
    or not, on however many processes (every process of a job calls it; one process alone needs no process group).
    The optimizer keeps this run's settings (weight decay, betas...) but the saved state and learning rate.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {MODEL_KEY: _model_state(model, trainable_only)}
    if optimizer is not None:
        # this run's optimizer settings, and the place of each tensor of its state for the saved one
        own = get_optimizer_state_dict(model, optimizer)
        state[OPTIM_KEY] = _tensors(own)
    try:
        load_shards_into(state, checkpoint / SHARDS_DIR, no_dist=not _active())
    except Exception as e:  # noqa: BLE001 - DCP raises its own CheckpointException (or RuntimeError) for a misfit
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint}: its shards do not fit this model or optimizer ({_first_line(e)}). To start "
            "from the weights alone with a fresh optimizer, pass resume_weights_only=True (--resume-weights-only)",
            [(str(checkpoint / SHARDS_DIR), "do not fit this run")],
        ) from None
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(strict=not trainable_only))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, {**own, **state[OPTIM_KEY]})


def _tensors(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The tensors of an optimizer state (AdamW's moments and step count), by parameter name."""
    state = optimizer_state["state"]
    return {"state": {name: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for name, s in state.items()}}


def _model_state(model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """``model``'s state dict (DTensors under FSDP), or its trainable parameters alone under every name they have
    (a LoRA checkpoint; torch's ``ignore_frozen_params`` keeps a frozen weight tied to another name).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    if not trainable_only:
        return state
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def load_whole(model: nn.Module, weights: dict[str, torch.Tensor], optimizer: Any, saved: Any, strict: bool) -> None:
    """Load a regular checkpoint (whole tensors; optimizer state keyed by position) into a model sharded by FSDP:
    each process keeps its own shards of the whole tensors it read.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, weights, options=options)
    if optimizer is None:
        return
    set_optimizer_state_dict(model, optimizer, _keyed_by_name(model, optimizer, saved), options=options)


def _keyed_by_name(model: nn.Module, optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``'s form (parameters numbered in the optimizer's order) turned into
    torch.distributed.checkpoint's (parameters named), pairing the numbers with this optimizer's parameters; the
    groups are this run's settings (the learning rate is set every step).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    numbers = [i for group in saved["param_groups"] for i in group["params"]]
    name_of = {i: names[id(p)] for i, p in zip(numbers, params)}
    state = {name_of[i]: value for i, value in saved["state"].items() if i in name_of}
    groups = [{**group, "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}
