"""A GPT from whatever a user names: a hub id (``gpt2``), a ``transformers`` directory, or a
checkpoint / run directory of ``gpt2 train`` (its newest intact checkpoint); and a LoRA adapter
(minlora's or PEFT's) on top. This is what ``--model`` / ``--init`` / ``--adapter`` mean."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

import minlora
from gpt2.model.gpt import GPT

logger = logging.getLogger(__name__)


def load_model(spec: str, *, device: torch.device | str | None = None) -> Any:
    """:meth:`gpt2.GPT.from_pretrained`, which takes every model source ``--model`` does."""
    return GPT.from_pretrained(spec, device=device)


def load_trained_model(path: str | os.PathLike[str], device: torch.device | str | None = None) -> Any:
    """The GPT in a checkpoint / run directory of ``gpt2 train``: :meth:`gpt2.GPT.from_pretrained`."""
    return GPT.from_pretrained(Path(path), device=device)


def apply_adapter(model: Any, path: str | os.PathLike[str]) -> Any:
    """Add the LoRA adapter at ``path`` (:func:`minlora.save_adapter`'s, or a PEFT directory) to ``model``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"adapter {str(path)!r} does not exist")
    if path.is_dir() and (path / "adapter_config.json").is_file():
        minlora.import_peft_adapter(model, path)
    else:
        minlora.load_adapter(model, path)
    logger.info(
        "applied LoRA adapter %s (%d LoRA layers, %s parameters)",
        path,
        len(minlora.lora_sites(model)),
        f"{sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n):,}",
    )
    return model
