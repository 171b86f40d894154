"""``strategy="fsdp"``: the model sharded across the processes with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each transformer block is one FSDP unit and the rest of the model (embeddings, the tied LM head, the last
LayerNorm) the root unit, all on a 1-D device mesh over the job's processes. Every parameter becomes a
``DTensor`` holding 1/N of its rows on each of N processes; a unit's whole weights exist only while the unit
runs (gathered before its forward and again before its backward), and its gradients are reduce-scattered
back to shards. AdamW's moments follow the shards, so weights, gradients and optimizer state all take 1/N
of the memory DDP needs. The tied embedding and head are one parameter of the root unit.

A sharded checkpoint (``shards/``) holds the weights and optimizer state through ``torch.distributed.checkpoint``.
Under FSDP every process writes its own shards of the weights and of AdamW's moments: no process ever holds the
whole model. Each process's file is safetensors (torch's Hugging Face storage) whose JSON header records where its
slices sit in the whole tensors, so the shards load into any number of processes, sharded or not: 2 FSDP processes
-> 1 process, -> 4 FSDP processes, -> 2 DDP processes. The optimizer state is keyed by parameter name, not by
position, for the same reason; only its tensors are stored (this run's settings are kept on loading), so nothing
is pickled. The atomic directory, its SHA256SUMS and the rest of the checkpoint are :mod:`gpt2.train.checkpoint`'s.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gpt2 import torch_compat
from gpt2.errors import InvalidValueError
from gpt2.model.checkpoint_files import (
    MODEL_KEY,
    OPTIM_KEY,
    SHARDS_DIR,
    CheckpointMismatchError,
    first_line,
    load_shards_into,
    non_finite_tensors,
)
from gpt2.train.distributed import _active
from gpt2.train.precision import PrecisionPolicy

logger = logging.getLogger(__name__)


# The settings FSDP cannot train with: (field, value) -> why, and what to use instead.
_UNSUPPORTED = {
    ("micro_batch_size", "auto"): "under FSDP each trial's forward is a collective, and one process running out of "
    "memory in it would leave the others waiting; give a number (docs/distributed.md has a table of what fits)",
    ("optimizer", "muon"): "Muon orthogonalises each whole weight matrix, and under FSDP every process holds only a "
    "slice of its rows; use strategy='ddp' or optimizer='adamw'",
}


def refuse_unsupported(config: Any) -> None:
    """Raise :class:`InvalidValueError` for a setting FSDP cannot train with, saying why and what to use."""
    for (field, value), why in _UNSUPPORTED.items():
        if getattr(config, field) == value:
            raise InvalidValueError(f"strategy='fsdp' with {field}={value!r} is refused: {why}")


def shard_model(model: nn.Module, device: torch.device, precision: PrecisionPolicy) -> None:
    """Shard ``model`` in place over every process of the job (its parameters become DTensors), each
    block of a GPT (any model with ``transformer.h``) its own unit, the rest the root unit. Build the optimizer
    after this.
    """
    # imported here, as in every function of this module that needs FSDP or torch.distributed.checkpoint: they cost
    # ~1.3 s of every start of the package (see gpt2.torch_compat.is_fsdp_module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # bf16 / fp16 gather the weights in that dtype (half the communication) and reduce the gradients in fp32; fp32
    # and tf32 change nothing (no autocast dtype: the weights and gradients are fp32 already, and FSDP casts nothing).
    # The shards (the optimizer's master weights) stay fp32 whatever the compute dtype.
    policy = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
    # a model without transformer.h is one unit
    for unit in getattr(getattr(model, "transformer", None), "h", []):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    logger.info(
        "FSDP: %s sharded over %d processes (%s compute)", type(model).__name__, dist.get_world_size(), precision.name
    )


def non_finite_parameters(model: nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``model`` (the raw module) holding inf/nan; of a model
    sharded by :func:`shard_model` on ANY process (a collective: each process checks its own shards, then all agree).
    """
    local = {name: t.to_local() if torch_compat.is_dtensor(t) else t for name, t in model.state_dict().items()}
    bad = non_finite_tensors(local)
    if not torch_compat.is_fsdp_module(model):
        return bad
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, bad)
    return sorted({name for names in gathered for name in names})


def empty_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (not yet sharded) whose parameters and buffers are on the ``meta`` device: its
    structure (LoRA parametrizations and tied weights included) without its memory, for :func:`gather_into_twin`.
    """
    # deepcopy looks every object up in its memo first: each parameter (a tied one once) and buffer
    # is "copied" as an empty meta tensor of its shape.
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def gather_into_twin(model: nn.Module, twin: nn.Module, is_main: bool) -> nn.Module | None:
    """The sharded ``model`` whole: its shards gathered to rank 0's CPU (a collective: EVERY process calls this) into
    the :func:`empty_twin` ``twin``, weights tied as in the model, and returned there; the other ranks get None.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # the other ranks get an empty dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    # Each parameter (a tied one once, under its first name) and buffer takes its gathered tensor in place: the
    # same object, so the names that share it (a tied embedding and head) still do.
    for name, tensor in [*twin.named_parameters(), *twin.named_buffers()]:
        whole = state.get(name)
        if whole is None:
            # A non-persistent buffer (a mask, rotary tables) is in no state dict; FSDP does not shard buffers, so the
            # model's own copy is whole.
            whole = model.get_buffer(name).detach().cpu().clone()
        if isinstance(tensor, nn.Parameter):
            whole = nn.Parameter(whole, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, whole)
    return twin


def write_shards(directory: Path, model: nn.Module, optimizer: Any, trainable_only: bool) -> None:
    """Every process writes its shards of ``model`` (its trainable weights alone with ``trainable_only``) and of
    ``optimizer``'s state into ``directory/shards`` (a collective under FSDP).
    """
    # imported here (see shard_model)
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
            f"checkpoint {checkpoint}: its shards do not fit this model or optimizer ({first_line(e)}). To start "
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
    if optimizer is not None:
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
