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
from gpt2.model.checkpoint_files import checkpoint_step, load_state_into, open_checkpoint
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from gpt2.model.hf import OFFICIAL_HUB_IDS, resolve_source

logger = logging.getLogger(__name__)


def load_model(spec: str, *, device: torch.device | str | None = None, pad_vocab_multiple: int = 1) -> Any:
    """A :class:`gpt2.GPT` from a hub id (``gpt2``, ``gpt2-medium``, ...), a ``transformers``
    directory, or a checkpoint / run directory written by ``gpt2 train`` (the newest checkpoint).

    Which one follows :func:`gpt2.hf.resolve_source`: the bare official GPT-2 names are the hub
    (also in this repository's checkout, where ``gpt2/`` is the package); any other existing path
    is local, and a local path that holds no model is an error saying what is missing.
    """
    source = resolve_source(spec)
    if isinstance(source, str):  # a hub id
        return GPT.from_pretrained(source, device=device, pad_vocab_multiple=pad_vocab_multiple)
    if source.is_file():
        parent = source.parent
        hint = (
            f"; pass its directory {str(parent)!r}"
            if (parent / "config.json").is_file() or (parent / "trainer_state.json").is_file()
            else ""
        )
        raise NotADirectoryError(
            f"{spec!r} is a file; a model is a directory: a transformers model (config.json + "
            f"model.safetensors) or a gpt2 checkpoint / run directory{hint}"
        )
    if (source / "config.json").is_file():  # a transformers directory (missing weights are named)
        return GPT.from_pretrained(source, device=device, pad_vocab_multiple=pad_vocab_multiple)
    is_checkpoint_like = (
        (source / "trainer_state.json").exists()
        or (source / "checkpoints").is_dir()
        or checkpoint_step(source) is not None
        or any(checkpoint_step(p) is not None for p in source.iterdir())
    )
    if not is_checkpoint_like:
        found = sorted(p.name for p in source.iterdir())[:10]
        hub = f"; for the hub model {source.name!r} write its bare name" if source.name in OFFICIAL_HUB_IDS else ""
        raise FileNotFoundError(
            f"{spec!r} holds no model: neither a transformers directory (no config.json) nor a gpt2 "
            f"checkpoint (no trainer_state.json) or run directory (no checkpoints/); found {found}{hub}"
        )
    return load_trained_model(source, device=device)


def load_trained_model(path: str | os.PathLike[str], device: torch.device | str | None = None) -> Any:
    """The GPT in a checkpoint (or the newest *intact* checkpoint of a run directory: damaged ones
    are skipped with a warning) of ``gpt2 train``."""
    data = open_checkpoint(path, trainer_state=False)  # verified: files, header, size, finite weights
    checkpoint, meta = data.path, data.meta
    model_config = meta.get("model_config")
    if not isinstance(model_config, dict):
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} does not record its model configuration "
            f"('model_config' in trainer_state.json), so the model cannot be rebuilt from it"
        )
    if meta.get("trainable_only") or data.trainable_only:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds only the trainable (adapter) weights; load the base "
            f"model and pass this run's adapter with --adapter instead"
        )
    try:
        model = GPT(GPTConfig.from_dict(model_config))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r}: 'model_config' in trainer_state.json is not a valid GPTConfig ({e})"
        ) from None
    load_state_into(model, data)
    logger.info("loaded %s (%s parameters)", checkpoint, f"{model.num_params():,}")
    return model.to(device or "cpu").eval()


def apply_adapter(model: Any, path: str | os.PathLike[str]) -> Any:
    """Add the LoRA adapter at ``path`` to ``model``: one saved by :func:`minlora.save_adapter`
    (``gpt2 finetune`` writes ``<out_dir>/adapter``) or a PEFT adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``)."""
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
