"""AdamW with decay / no-decay parameter groups, and the cosine learning-rate schedule.

Weight decay pulls weights towards zero. It makes sense for the matrices of matmuls (2-D and
larger); it does not for biases and LayerNorm gains (1-D), whose job is to shift and rescale,
and embeddings are exempt unless ``decay_embeddings=True`` (build-nanogpt decays them; most
later recipes do not). Embeddings are recognised by module type (``nn.Embedding``), not by name,
so the token table that is tied to the LM head counts once, as an embedding.

Only parameters with ``requires_grad=True`` are optimised, so a model whose base is frozen (LoRA
through :mod:`minlora`) trains just its adapters.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False) -> list[dict[str, Any]]:
    """Two AdamW groups: ``{"params": decayed, "weight_decay": wd}`` and ``{"params": rest, 0.0}``.

    Shared (tied) parameters appear once; frozen parameters not at all. Empty groups are dropped.
    """
    embedding_ids = {
        id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()
    }
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():  # named_parameters() yields a shared tensor once
        if not p.requires_grad:
            continue
        is_embedding = id(p) in embedding_ids
        if p.dim() >= 2 and (decay_embeddings or not is_embedding):
            decay.append(p)
        else:
            no_decay.append(p)
    if not decay and not no_decay:
        raise ValueError(
            "the model has no trainable parameters (all have requires_grad=False); "
            "unfreeze some, or add LoRA adapters with minlora"
        )
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    logger.info(
        "AdamW groups: %d decayed tensors (%s parameters), %d not decayed (%s parameters)",
        len(decay),
        f"{sum(p.numel() for p in decay):,}",
        len(no_decay),
        f"{sum(p.numel() for p in no_decay):,}",
    )
    return [g for g in groups if g["params"]]


def use_fused_adamw(model: nn.Module, fused: bool | str = "auto") -> bool:
    """Resolve ``fused``: "auto" means the fused kernel when every trainable parameter is on CUDA.

    The fused kernel updates all parameters in one launch instead of a few per tensor; on a GPU
    that saves several milliseconds per step at GPT-2 size.
    """
    if fused == "auto":
        params = [p for p in model.parameters() if p.requires_grad]
        return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    return bool(fused)


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | str = "auto",
    decay_embeddings: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model`` with :func:`param_groups`."""
    groups = param_groups(model, weight_decay, decay_embeddings)
    use_fused = use_fused_adamw(model, fused)
    # Without the fused kernel, the multi-tensor ("foreach") implementation: torch picks it by
    # default only for CUDA tensors, and on a CPU the per-tensor loop is several times slower.
    return torch.optim.AdamW(
        groups, lr=lr, betas=tuple(betas), eps=eps, fused=use_fused or None, foreach=None if use_fused else True
    )


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of the optimizer update with 0-based index ``step``.

    Linear warmup over the first ``warmup_steps`` updates (``max_lr * (step + 1) / warmup_steps``,
    so the first update is not wasted at lr 0), then a half cosine from ``max_lr`` down to
    ``min_lr`` at ``max_steps``, and ``min_lr`` after that.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps or max_steps <= warmup_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)  # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
