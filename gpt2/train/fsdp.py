"""``strategy="fsdp"``: the model sharded across the processes with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each transformer block is one FSDP unit and the rest of the model (embeddings, the tied LM head, the last
LayerNorm) the root unit, all on a 1-D device mesh over the job's processes. Every parameter becomes a
``DTensor`` holding 1/N of its rows on each of N processes; a unit's whole weights exist only while the unit
runs (gathered before its forward and again before its backward), and its gradients are reduce-scattered
back to shards. AdamW's moments follow the shards, so weights, gradients and optimizer state all take 1/N
of the memory DDP needs. The tied embedding and head are one parameter of the root unit.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gpt2 import torch_compat
from gpt2.errors import InvalidValueError
from gpt2.model.checkpoint_files import non_finite_tensors
from gpt2.train.precision import PrecisionPolicy

logger = logging.getLogger(__name__)


def refuse_unsupported(config: Any) -> None:
    """Raise :class:`InvalidValueError` for a setting FSDP cannot train with, saying why and what to use."""
    if config.micro_batch_size == "auto":
        raise InvalidValueError(
            "strategy='fsdp' with micro_batch_size='auto' is refused: under FSDP each trial's forward is a "
            "collective, and one process running out of memory in it would leave the others waiting; give a number "
            "(docs/distributed.md has a table of what fits)"
        )
    if config.optimizer == "muon":
        raise InvalidValueError(
            "strategy='fsdp' with optimizer='muon' is refused: Muon orthogonalises each whole weight matrix, and "
            "under FSDP every process holds only a slice of its rows; use strategy='ddp' or optimizer='adamw'"
        )


def shard_model(model: nn.Module, device: torch.device, precision: PrecisionPolicy) -> nn.Module:
    """Shard ``model`` in place over every process of the job (its parameters become DTensors), each
    block of a GPT (any model with ``transformer.h``) its own unit, the rest the root unit; returns ``model``. Build
    the optimizer after this.
    """
    # imported here, as in every function of this module that needs FSDP: see torch_compat.is_fsdp_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # bf16 / fp16 gather the weights in that dtype (half the communication) and reduce the gradients in fp32; fp32
    # and tf32 change nothing. The shards (the optimizer's master weights) stay fp32 whatever the compute dtype.
    policy = MixedPrecisionPolicy()
    if precision.autocast_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(blocks, nn.ModuleList):
        logger.info("%s has no transformer.h: FSDP shards it as one unit", type(model).__name__)
        blocks = []
    for unit in blocks:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    logger.info(
        "FSDP: %s sharded over %d processes (%s compute)", type(model).__name__, dist.get_world_size(), precision.name
    )
    return model


def non_finite_parameters(model: nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``model`` (the raw module) holding inf/nan; of a model
    sharded by :func:`shard_model` on ANY process (a collective: each process checks its own shards, then all agree).
    """
    local = {}
    for name, tensor in model.state_dict().items():
        if torch_compat.is_dtensor(tensor):
            tensor = tensor.to_local()
        local[name] = tensor
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
    # Parameters reached under several names (a tied embedding and head) are one tensor again after to_empty.
    names_of: dict[int, list[str]] = {}
    for name, p in twin.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    twin.to_empty(device="cpu")
    for names in names_of.values():
        kept = twin.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(owner), attr, kept)
    twin.load_state_dict(state)
    return twin
