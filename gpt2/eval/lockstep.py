"""Evaluations split across the processes of a job: rank ``r`` of ``N`` scores items ``r, r + N, ...`` of a
sequence every rank reads whole.

With a sharded model (FSDP) each forward is a collective (the weights are gathered from every rank), so every
rank must run as many forwards: when the sequence's length is not a multiple of ``N``, the ranks without an item
in the last round run one more forward, on an item they do not count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from gpt2 import torch_compat


def score_share(
    model: nn.Module, items: Iterable[Any], rank: int, world_size: int, score: Callable[[Any, bool], None]
) -> int:
    """``score(item, True)`` for this rank's share of ``items``, with ``model`` in eval mode meanwhile, and
    ``score(item, False)`` for the last item when a sharded model owes that forward; returns how many items
    there were (all ranks' shares).
    """
    was_training = model.training
    model.eval()
    seen = 0
    item = None
    try:
        for seen, item in enumerate(items, 1):
            if (seen - 1) % world_size == rank:
                score(item, True)
        sharded = any(torch_compat.is_fsdp_module(module) for module in model.modules())
        in_last_round = seen % world_size
        if sharded and in_last_round and rank >= in_last_round:
            score(item, False)
    finally:
        model.train(was_training)
    return seen
