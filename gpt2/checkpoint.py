"""Atomic checkpoints of the raw model, optimizer, loss scaler, RNG states and data position.

One directory per checkpoint, ``<root>/step_000100/``, holding

- ``model.safetensors``: the raw model's state dict (never a ``torch.compile`` or DDP wrapper's,
  so no ``_orig_mod.`` / ``module.`` prefixes). safetensors refuses tensors that share memory,
  so a tied tensor (GPT-2's token embedding = LM head) is stored once and the other names are
  recorded as aliases in the file's metadata and re-tied on load.
- ``trainer_state.pt``: optimizer and scaler state and the RNG states, only tensors and plain
  Python containers, read back with ``torch.load(weights_only=True)`` (nothing is unpickled).
- ``trainer_state.json``: the step, the configuration, data-loader positions, best validation
  loss: whatever the caller passes as ``metadata``.

A checkpoint is written into a temporary directory beside the final one, every file fsynced,
then renamed into place, so a crash mid-save leaves the previous checkpoints untouched and never
a half-written ``step_*`` directory. ``<root>/latest`` names the newest one (also replaced
atomically), and only the newest ``keep_last`` are kept.

``trainable_only=True`` stores just the parameters with ``requires_grad=True`` (e.g. LoRA
adapters on a frozen base model) instead of the whole state dict; loading such a checkpoint
needs a model that already holds the frozen weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = "trainer_state.json"
LATEST_FILE = "latest"
CHECKPOINT_FILES = (WEIGHTS_FILE, STATE_FILE, META_FILE)
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


class NonFiniteWeightsError(ValueError):
    """A checkpoint was refused because the model holds inf/nan values."""


# ------------------------------------------------------------------------------------------
# The raw model and its state dict
# ------------------------------------------------------------------------------------------


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module under DDP and ``torch.compile`` wrappers (recognised by type, not by name)."""
    # Only look the compile wrapper's class up if torch.compile has been used in this process:
    # importing torch._dynamo just to check costs seconds.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled_type = getattr(eval_frame, "OptimizedModule", None)
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif compiled_type is not None and isinstance(module, compiled_type):
            module = module._orig_mod
        else:
            return module


def model_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The raw model's state dict, or only its trainable parameters."""
    model = unwrap_model(model)
    if not trainable_only:
        return dict(model.state_dict())
    # remove_duplicate=False: every name of a tied trainable tensor is kept (aliases are
    # deduplicated when writing), so loading restores each name.
    return {
        name: p.detach() for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
    }


def non_finite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding inf or nan."""
    return [
        name for name, t in state.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write a state dict as safetensors, storing tensors that share memory once.

    Exact aliases (same storage, offset, shape and strides: a tied weight) become metadata
    entries ``{alias: kept name}``; other partial overlaps are copied so the file is valid.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            t = t.clone()  # shares memory with another tensor but is not the same view
        elif t.numel():
            storages.add(ptr)
            seen[key] = name
        tensors[name] = t.contiguous().cpu()
    meta = {"format": "pt", "aliases": json.dumps(aliases, sort_keys=True)}
    meta.update(metadata or {})
    save_file(tensors, str(path), metadata=meta)


def load_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(state_dict, metadata)`` from :func:`save_weights`, with aliases filled back in."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    state = load_file(str(path), device="cpu")
    for alias, name in json.loads(metadata.get("aliases", "{}")).items():
        state[alias] = state[name]
    return state, metadata


# ------------------------------------------------------------------------------------------
# RNG states (weights_only-safe: tensors, ints, floats and lists)
# ------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), numpy and Python ``random`` generator states."""
    version, internal, gauss_next = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state(
        (npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "checkpoint holds RNG states of %d CUDA devices but %d are visible; CUDA RNG not restored",
                len(cuda_states), torch.cuda.device_count(),
            )


# ------------------------------------------------------------------------------------------
# Finding checkpoints
# ------------------------------------------------------------------------------------------


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step encoded in a ``step_000100`` directory name, else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and all((path / name).is_file() for name in CHECKPOINT_FILES)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: checkpoint_step(p))  # type: ignore[arg-type, return-value]


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (a ``checkpoints`` directory), or None.

    The directory listing is the source of truth (every ``step_*`` directory there was renamed
    into place complete); ``latest`` is a convenience pointer for people and tools.
    """
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from ``path``: the checkpoint itself, a ``checkpoints`` directory,
    or a run directory holding ``checkpoints/`` (then the newest complete one)."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        latest = find_latest_checkpoint(root)
        if latest is not None:
            return latest
    if path.is_dir() and checkpoint_step(path) is not None:
        missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
        raise FileNotFoundError(f"checkpoint {str(path)!r} is incomplete: missing {missing}")
    raise FileNotFoundError(
        f"no checkpoint at {str(path)!r}: expected a step_NNNNNN directory with {list(CHECKPOINT_FILES)}, "
        "or a run directory / checkpoints directory that contains one"
    )


# ------------------------------------------------------------------------------------------
# Save and load
# ------------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    metadata: dict[str, Any] | None = None,
    *,
    keep_last: int | None = None,
    trainable_only: bool = False,
    rng_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``<root>/step_{step:06d}`` atomically and return its path.

    Raises :class:`NonFiniteWeightsError` (writing nothing) if any weight is inf/nan.
    ``keep_last`` > 0 deletes all but the newest ``keep_last`` checkpoints afterwards.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    state = model_state_dict(model, trainable_only)
    bad = non_finite_tensors(state)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteWeightsError(
            f"refusing to save checkpoint at step {step}: non-finite values (inf/nan) in {shown}"
        )
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    meta = {"format_version": FORMAT_VERSION, "step": step, "trainable_only": trainable_only, **(metadata or {})}
    trainer_state = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "rng": rng_state if rng_state is not None else capture_rng_state(),
    }
    # A unique name beside the final one (same filesystem, so the rename is atomic); os.mkdir
    # honours the umask, unlike tempfile.mkdtemp's private 0700.
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_weights(state, tmp / WEIGHTS_FILE, {"step": str(step), "trainable_only": str(trainable_only)})
        _write_trainer_state(trainer_state, tmp / STATE_FILE)
        _write_json(meta, tmp / META_FILE)
        _fsync_dir(tmp)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_latest(root, final.name)
    if keep_last:
        prune_checkpoints(root, keep_last)
    logger.info("saved checkpoint %s", final)
    return final


def _write_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    save_weights(state, path, metadata)
    os.chmod(path, 0o666 & ~_umask())  # safetensors creates its files 0600; match the other files
    _fsync_file(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_trainer_state(trainer_state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(trainer_state, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(data: dict[str, Any], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(data), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _json_safe(value: Any) -> Any:
    """JSON has no inf/nan: store them as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _move_into_place(tmp: Path, final: Path) -> None:
    """rename(tmp, final); an existing ``final`` (the same step saved again) is swapped out first."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (new names, renames) durable; not possible on Windows."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints and leftovers of crashed saves."""
    root = Path(root)
    removed = []
    checkpoints = list_checkpoints(root)
    for path in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    # Temporary directories of saves that were killed (a crash with an exception cleans up itself).
    for path in root.iterdir():
        if path.is_dir() and (path.name.startswith(".tmp-step_") or path.name.startswith(".old-step_")):
            shutil.rmtree(path, ignore_errors=True)
    return removed


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    restore_rng: bool = False,
    map_location: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and optimizer / scaler / RNG); return its metadata.

    ``path`` may be the checkpoint directory, a ``checkpoints`` directory or a run directory
    (the newest checkpoint is used). Nothing is unpickled: weights come from safetensors, the
    rest from ``torch.load(weights_only=True)`` and JSON.
    """
    path = resolve_checkpoint(path)
    with open(path / META_FILE, encoding="utf-8") as f:
        meta = json.load(f)
    raw = unwrap_model(model)
    state, weights_meta = load_weights(path / WEIGHTS_FILE)
    trainable_only = weights_meta.get("trainable_only") == "True"
    if trainable_only:
        result = raw.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise KeyError(
                f"checkpoint {str(path)!r} holds tensors the model does not have: {result.unexpected_keys[:5]}; "
                "was it saved from a model with other adapters or shapes?"
            )
    else:
        raw.load_state_dict(state, strict=True)
    if optimizer is not None or scaler is not None or restore_rng:
        trainer_state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
        if optimizer is not None:
            if trainer_state["optimizer"] is None:
                raise KeyError(f"checkpoint {str(path)!r} has no optimizer state")
            optimizer.load_state_dict(trainer_state["optimizer"])
        if scaler is not None:
            if trainer_state["scaler"] is not None:
                scaler.load_state_dict(trainer_state["scaler"])
            else:
                logger.warning("checkpoint %s has no loss-scaler state; the scaler starts fresh", path)
        if restore_rng:
            restore_rng_state(trainer_state["rng"])
    meta["path"] = str(path)
    return meta
