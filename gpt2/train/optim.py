"""AdamW with decay / no-decay groups, Muon for the hidden matrices, the cosine LR schedule.

Weight decay suits the matmul matrices (2-D and larger), not biases and LayerNorm gains (1-D);
embeddings (found by module type, so the tied LM head counts once, as one) are exempt unless
``decay_embeddings=True`` (build-nanogpt decays them; most later recipes do not).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import torch
import torch.nn as nn

from gpt2.errors import InvalidValueError
from gpt2.train.config import OPTIMIZERS, TrainConfig

logger = logging.getLogger(__name__)


# Nesterov momentum of Muon: Keller Jordan's value, torch.optim.Muon's default.
MUON_MOMENTUM = 0.95


def param_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = False, exclude: frozenset[int] = frozenset()
) -> list[dict[str, Any]]:
    """The AdamW groups ``{"params": decayed, "weight_decay": wd}`` and ``{"params": rest, 0.0}``
    (empty ones dropped): a tied parameter once, frozen ones and ``exclude``'s ids (Muon's) not at all.
    """
    # Matrices decay; vectors (biases, gains) never do, embeddings only when asked to.
    exempt = set() if decay_embeddings else _embedding_ids(model)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    # named_parameters() yields a shared tensor once
    trainable = [p for _, p in model.named_parameters() if p.requires_grad and id(p) not in exclude]
    for p in trainable:
        if p.dim() >= 2 and id(p) not in exempt:
            decay.append(p)
        else:
            no_decay.append(p)
    if not trainable and not exclude:
        raise InvalidValueError(
            "the model has no trainable parameters (all have requires_grad=False); "
            "unfreeze some, or add LoRA adapters with minlora"
        )
    logger.info(
        f"AdamW groups: {len(decay)} decayed tensors ({_count(decay)} parameters), {len(no_decay)} not decayed "
        f"({_count(no_decay)} parameters)"
    )
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _count(params: list[nn.Parameter]) -> str:
    """How many numbers ``params`` hold, for a log line: ``"124,439,808"``."""
    return f"{sum(p.numel() for p in params):,}"


def _embedding_ids(model: nn.Module) -> set[int]:
    """The ids of every ``nn.Embedding``'s parameters (the tied LM head is the token table itself)."""
    return {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}


def use_fused_adamw(model: nn.Module, fused: bool | str = "auto") -> bool:
    """Resolve ``fused``: "auto" = the fused kernel (one pass over all parameters; on CUDA one launch) when
    the installed torch has one for the device and dtype of every trainable parameter
    (:func:`fused_adamw_supported`: CUDA, and the CPU since torch 2.4).
    """
    if fused != "auto":
        return bool(fused)
    kinds = {(p.device, p.dtype) for p in model.parameters() if p.requires_grad}
    return bool(kinds) and all(fused_adamw_supported(device, dtype) for device, dtype in kinds)


@functools.cache
def fused_adamw_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the installed torch steps a fused AdamW over ``dtype`` parameters on ``device``: tried once per
    device and dtype on a two-element tensor, as torch checks at the first step (not when it is built).
    """
    try:
        p = nn.Parameter(torch.zeros(2, device=device, dtype=dtype))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], fused=True).step()
    except Exception:  # noqa: BLE001 - whatever the reason, there is no fused kernel to use here
        return False
    return True


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """The hidden matrices that Muon trains: the trainable weights of ``nn.Linear`` layers inside
    the model's sub-modules (the blocks). Not a Linear that is a direct child of the model (the
    output head) nor one whose weight is an ``nn.Embedding``'s (the tied head), and not LoRA
    factors: with a frozen base there is nothing for Muon (see docs/training.md).
    """
    embedding_ids = _embedding_ids(model)
    heads = {id(m) for m in model.children()}
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in heads:
            # A parametrized weight (LoRA) is no Parameter of the Linear itself: left to AdamW.
            weight = dict(module.named_parameters(recurse=False)).get("weight")
            if weight is not None and weight.requires_grad and id(weight) not in embedding_ids:
                found[id(weight)] = weight
    return list(found.values())


class MuonAdamW(torch.optim.Optimizer):
    """:class:`torch.optim.Muon` and :class:`torch.optim.AdamW` as one optimizer: ``param_groups`` are the children's
    own group dicts (AdamW's, then Muon's, tagged ``"optimizer"``) and ``state`` one dict shared by both, so state
    dicts, ``zero_grad``, ``GradScaler`` and clipping see one ordinary optimizer.
    """

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon) -> None:
        self.optimizers = (adamw, muon)
        for child, kind in zip(self.optimizers, OPTIMIZERS):
            for group in child.param_groups:
                group["optimizer"] = kind
        super().__init__([p for child in self.optimizers for g in child.param_groups for p in g["params"]], {})
        self.param_groups = adamw.param_groups + muon.param_groups
        self._link()

    def _link(self) -> None:
        adamw, muon = self.optimizers
        n = len(adamw.param_groups)
        adamw.param_groups, muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        adamw.state = muon.state = self.state  # parameters are disjoint: one dict holds both states

    def step(self) -> None:  # type: ignore[override]
        """One step of each child (each under ``no_grad`` of its own). No closure: neither re-evaluates the loss."""
        for child in self.optimizers:
            child.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = [g.get("optimizer", "adamw") for g in state_dict["param_groups"]]
        mine = [g["optimizer"] for g in self.param_groups]
        if saved != mine:
            raise InvalidValueError(
                f"the saved optimizer has groups {saved}, this one {mine}: it was written with another "
                "TrainConfig.optimizer (or other trainable parameters); resume with the same settings"
            )
        super().load_state_dict(state_dict)  # replaces param_groups and state with new objects
        self._link()


def build_optimizer(model: nn.Module, config: TrainConfig | None = None, /, **settings: Any) -> torch.optim.Optimizer:
    """The optimizer that ``config`` (a :class:`~gpt2.train.config.TrainConfig`) asks for, over the trainable
    parameters of ``model``: AdamW at peak ``max_lr`` with :func:`param_groups`; with ``optimizer="muon"`` a
    :class:`MuonAdamW`: Muon at peak ``muon_lr`` for :func:`muon_params`, AdamW for the rest.

    Keywords override ``config``'s fields (without a config, TrainConfig's defaults), by TrainConfig's names:
    ``build_optimizer(model, max_lr=1e-3)``.
    """
    config = dataclasses.replace(config or TrainConfig(), **settings)
    matrices: list[nn.Parameter] = []
    if config.optimizer == "muon":
        matrices = muon_params(model)
        if not matrices:
            logger.warning(
                "optimizer='muon': no trainable hidden matrices (a frozen base?), so AdamW trains everything"
            )
    groups = param_groups(model, config.weight_decay, config.decay_embeddings, exclude=frozenset(map(id, matrices)))
    adamw = _adamw(model, groups, config) if groups else None
    if not matrices:
        return adamw
    logger.info("Muon: %d hidden matrices (%s parameters)", len(matrices), _count(matrices))
    muon = torch.optim.Muon(matrices, lr=config.muon_lr, weight_decay=config.muon_weight_decay, momentum=MUON_MOMENTUM)
    muon.param_groups[0]["lr_ratio"] = config.muon_lr / config.max_lr
    if adamw is None:
        # Muon alone: nothing else is trainable
        return muon
    return MuonAdamW(adamw, muon)


def _adamw(model: nn.Module, groups: list[dict[str, Any]], config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``groups`` (also the AdamW half of :class:`MuonAdamW`): the fused kernel when
    :func:`use_fused_adamw` says so, else the multi-tensor ("foreach") implementation: torch picks that by default
    only for CUDA tensors, and on a CPU the per-tensor loop is the slowest of the three.
    """
    fused = use_fused_adamw(model, config.fused_adamw)
    betas = tuple(config.betas)
    return torch.optim.AdamW(groups, lr=config.max_lr, betas=betas, eps=config.eps, fused=fused, foreach=not fused)


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of the update with 0-based index ``step``: linear warmup (the first update
    not wasted at lr 0), then a half cosine from ``max_lr`` to ``min_lr`` at ``max_steps``.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps or max_steps <= warmup_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)  # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the schedule's ``lr`` (of peak ``max_lr``); a group with an ``lr_ratio`` (Muon's) gets
    ``lr * lr_ratio``, so every group follows the schedule from its own peak.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
