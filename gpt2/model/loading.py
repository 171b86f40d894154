"""A LoRA adapter (minlora's or PEFT's) on a model: what ``--adapter`` means. What ``--model`` /
``--init`` mean is :meth:`gpt2.GPT.from_pretrained`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import minlora
from gpt2.errors import MissingFileError

logger = logging.getLogger(__name__)


def apply_adapter(model: Any, path: str | os.PathLike[str], allow_base_mismatch: bool = False) -> Any:
    """Add the LoRA adapter at ``path`` (:func:`minlora.save_adapter`'s, or a PEFT directory) to ``model``
    (``allow_base_mismatch``: see :func:`minlora.load_adapter`).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise MissingFileError(f"adapter {str(path)!r} does not exist")
    if path.is_dir() and (path / "adapter_config.json").is_file():
        minlora.import_peft_adapter(model, path)
    else:
        minlora.load_adapter(model, path, allow_base_mismatch=allow_base_mismatch)
    count = sum(p.numel() for p in minlora.get_lora_params(model))
    logger.info(f"applied LoRA adapter {path} ({len(minlora.lora_sites(model))} LoRA layers, {count:,} parameters)")
    return model
