"""Evaluations split across the processes of a job whose model is sharded (FSDP).

Rank ``r`` of ``N`` scores items ``r, r + N, ...`` of a sequence every rank reads whole. With a sharded model
each forward is a collective (the weights are gathered from every rank), so every rank must run as many
forwards: when the sequence's length is not a multiple of ``N``, the ranks without an item in the last
round run one more forward, on an item they do not count.
"""

from __future__ import annotations

import torch.nn as nn

from gpt2 import torch_compat


def owes_forward(model: nn.Module, seen: int, rank: int, world_size: int) -> bool:
    """Whether this rank must run one uncounted forward after scoring its share of ``seen`` items."""
    sharded = any(torch_compat.is_fsdp_module(module) for module in model.modules())
    if not sharded or world_size == 1 or seen == 0:
        return False
    in_last_round = seen % world_size
    return in_last_round != 0 and rank >= in_last_round
