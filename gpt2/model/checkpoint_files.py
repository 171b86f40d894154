"""A checkpoint's files: their names and formats, reading and verifying them, finding intact ones.

A checkpoint is a directory ``step_000100/`` holding ``model.safetensors`` (the weights),
``trainer_state.pt`` (optimizer, scaler and RNG states) and ``trainer_state.json`` (the step and
metadata); :mod:`gpt2.checkpoint` writes them. This module reads them back and checks them before
any model is touched: the safetensors header against the file's size, every weight finite, the
JSON state and the optimizer-state archive. A damaged file raises :class:`CheckpointError` naming
the file and what is wrong with it; :func:`open_checkpoint`, given a run or ``checkpoints``
directory, falls back to the newest intact checkpoint and logs each one it skipped.

Everything here is re-exported by :mod:`gpt2.checkpoint`, the module to import from.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel

# The messages of checkpoint loading keep the logger they had before this module was split off.
logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = "trainer_state.json"
LATEST_FILE = "latest"
CHECKPOINT_FILES = (WEIGHTS_FILE, STATE_FILE, META_FILE)
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module under DDP / DataParallel and ``torch.compile`` wrappers, in any nesting.

    Wrappers are recognised by type, not by attribute name, so a model of one's own with a
    ``module`` attribute is left alone.
    """
    # Only look the compile wrapper's class up if torch.compile has been used in this process:
    # importing torch._dynamo just to check costs seconds.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled_type = getattr(eval_frame, "OptimizedModule", None)
    while True:
        if isinstance(module, (DistributedDataParallel, nn.DataParallel)):
            module = module.module
        elif compiled_type is not None and isinstance(module, compiled_type):
            module = module._orig_mod
        else:
            return module


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, truncated or missing files, non-finite weights.

    ``problems`` lists ``(file, what is wrong)`` pairs; the message names each of them.
    """

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class NonFiniteWeightsError(CheckpointError):
    """A checkpoint was refused (on save or load) because the weights hold inf/nan values."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, I/O error); nothing of it was kept."""


# ------------------------------------------------------------------------------------------
# The weights file (safetensors) and its checks
# ------------------------------------------------------------------------------------------


def non_finite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding inf or nan."""
    return [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def save_weights(
    state: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
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
    """``(state_dict, metadata)`` from :func:`save_weights`, with aliases filled back in.

    The file is checked first (:func:`check_safetensors`); any problem raises
    :class:`CheckpointError` naming the file, never a bare ``SafetensorError``.
    """
    path = Path(path)
    metadata = check_safetensors(path)
    try:
        state = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise _file_error(path, f"cannot be read ({_first_line(e)})") from None
    try:
        aliases = json.loads(metadata.get("aliases", "{}"))
        for alias, name in aliases.items():
            state[alias] = state[name]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise _file_error(path, "its 'aliases' metadata is not a valid {alias: name} map of stored tensors") from None
    return state, metadata


# Bytes per element of the safetensors dtypes.
_DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def check_safetensors(path: str | os.PathLike) -> dict[str, str]:
    """Check a safetensors file's structure without reading its tensors; return its metadata.

    The layout is 8 bytes (little-endian u64 header length), a JSON header mapping each tensor
    name to its dtype, shape and ``data_offsets`` into the data that follows, then the data: the
    file's size must be exactly ``8 + header length + last offset`` (a truncated copy, or one
    with bytes appended, fails). Raises :class:`CheckpointError` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise _file_error(path, "is not a file" if path.exists() else "is missing")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            raw = f.read(header_len) if 0 < header_len <= min(size - 8, _MAX_HEADER) else b""
    except OSError as e:
        raise _file_error(path, f"cannot be read ({_first_line(e)})") from None
    if size < 8:
        raise _file_error(path, f"is {size} bytes, too short for a safetensors header (truncated?)")
    if header_len > min(size - 8, _MAX_HEADER):
        raise _file_error(
            path,
            f"has a garbage header (it claims {header_len:,} header bytes in a "
            f"{size:,}-byte file): not safetensors, or damaged",
        )
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise _file_error(path, f"has a garbage header ({_first_line(e)}): not safetensors, or damaged") from None
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _file_error(path, "has a malformed __metadata__ entry in its header")
    end = 0
    for name, info in header.items():
        try:
            dtype, shape, (begin, stop) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(d) for d in shape)
            if dtype not in _DTYPE_SIZES or any(int(d) < 0 for d in shape) or not 0 <= begin <= stop:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise _file_error(path, f"has a malformed header entry for tensor {name!r}") from None
        if stop - begin != numel * _DTYPE_SIZES[dtype]:
            raise _file_error(
                path,
                f"header gives tensor {name!r} ({dtype}, shape {list(shape)}) "
                f"{stop - begin} bytes instead of {numel * _DTYPE_SIZES[dtype]}",
            )
        end = max(end, stop)
    expected = 8 + header_len + end
    if size != expected:
        what = "truncated" if size < expected else "has extra bytes at the end"
        raise _file_error(path, f"is {size:,} bytes but its header says {expected:,}: {what}")
    return metadata


def _file_error(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} {problem}", [(str(path), problem)])


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


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


def checkpoint_candidates(root: str | os.PathLike) -> list[Path]:
    """Every ``step_*`` directory under ``root``, complete or not, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=lambda p: checkpoint_step(p), reverse=True)  # type: ignore[arg-type, return-value]


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
# Reading and verifying a checkpoint directory
# ------------------------------------------------------------------------------------------


@dataclass
class CheckpointData:
    """A checkpoint read into memory and verified (see :func:`read_checkpoint`)."""

    path: Path
    meta: dict[str, Any]  # trainer_state.json
    weights: dict[str, torch.Tensor]  # aliases filled back in
    weights_meta: dict[str, str] = field(default_factory=dict)
    trainer_state: dict[str, Any] | None = None  # trainer_state.pt, when asked for

    @property
    def trainable_only(self) -> bool:
        return self.weights_meta.get("trainable_only") == "True"


def read_checkpoint(
    path: str | os.PathLike,
    *,
    trainer_state: bool = True,
    map_location: str | torch.device = "cpu",
) -> CheckpointData:
    """Read one checkpoint directory and verify everything in it, touching no model.

    Checks: all files present; ``trainer_state.json`` valid JSON with a step that matches the
    directory's name; ``model.safetensors`` structurally sound (:func:`check_safetensors`) and
    every weight finite; ``trainer_state.pt`` (if ``trainer_state``) a readable torch archive of
    tensors and plain containers. Raises :class:`CheckpointError` (or
    :class:`NonFiniteWeightsError`) listing every problem found, each with its file.
    """
    path = Path(path)
    problems: list[tuple[str, str]] = []
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory", [(str(path), "is not a directory")])
    meta = _read_meta(path, problems)
    weights: dict[str, torch.Tensor] = {}
    weights_meta: dict[str, str] = {}
    try:
        weights, weights_meta = load_weights(path / WEIGHTS_FILE)
    except CheckpointError as e:
        problems += e.problems
    non_finite = non_finite_tensors(weights)
    if non_finite:
        shown = ", ".join(non_finite[:5]) + (f" and {len(non_finite) - 5} more" if len(non_finite) > 5 else "")
        problems.append((str(path / WEIGHTS_FILE), f"holds non-finite values (inf/nan) in {shown}"))
    state = _read_trainer_state(path / STATE_FILE, map_location, problems) if trainer_state else None
    if problems:
        cls = NonFiniteWeightsError if non_finite and len(problems) == 1 else CheckpointError
        raise cls(f"checkpoint {path} is damaged: {_describe(problems, path)}", problems)
    return CheckpointData(path, meta, weights, weights_meta, state)  # type: ignore[arg-type]


def _read_meta(path: Path, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    file = path / META_FILE
    if not file.is_file():
        problems.append((str(file), "is missing"))
        return None
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        problems.append((str(file), f"is not valid JSON ({_first_line(e)}; truncated or overwritten?)"))
        return None
    except OSError as e:
        problems.append((str(file), f"cannot be read ({_first_line(e)})"))
        return None
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(meta, dict):
        problems.append((str(file), "does not hold a JSON object"))
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problems.append((str(file), f"field 'step' is {step!r}, not a step number"))
    elif checkpoint_step(path) is not None and checkpoint_step(path) != step:
        problems.append((str(file), f"field 'step' is {step} but the directory is {path.name}"))
    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        problems.append(
            (str(file), f"format_version {version!r} is newer than this gpt2 reads ({FORMAT_VERSION}); upgrade gpt2")
        )
    return meta


def _read_trainer_state(file: Path, map_location: Any, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    if not file.is_file():
        problems.append((str(file), "is missing"))
        return None
    try:
        # weights_only: nothing is unpickled; a damaged archive raises RuntimeError from the zip
        # reader, a foreign pickle an UnpicklingError: every one becomes a problem of this file.
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means this file is unusable
        problems.append((str(file), f"cannot be read ({_first_line(e)}; truncated or not written by gpt2?)"))
        return None
    missing = [key for key in ("optimizer", "scaler", "rng") if not isinstance(state, dict) or key not in state]
    if missing:
        problems.append((str(file), f"lacks {missing}"))
        return None
    return state


def _describe(problems: list[tuple[str, str]], base: Path | None = None) -> str:
    """``file problem; file problem``, the files relative to ``base``."""

    def short(file: str) -> str:
        if base is not None and file.startswith(str(base) + os.sep):
            return file[len(str(base)) + 1 :]
        return file

    return "; ".join(f"{short(file)} {problem}" for file, problem in problems)


def open_checkpoint(
    path: str | os.PathLike,
    *,
    trainer_state: bool = True,
    map_location: str | torch.device = "cpu",
) -> CheckpointData:
    """:func:`read_checkpoint` of ``path``, or, for a run / ``checkpoints`` directory, of its newest
    *intact* checkpoint: damaged ones are skipped with a warning saying which and why. When none is
    intact, one :class:`CheckpointError` names each file and what is wrong with it."""
    path = Path(path)
    if checkpoint_step(path) is not None or is_complete(path):  # one checkpoint: no fallback
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        try:
            return read_checkpoint(path, trainer_state=trainer_state, map_location=map_location)
        except CheckpointError as e:
            raise type(e)(
                f"{e}. Pick another checkpoint, or give its directory ({path.parent}) to use the "
                "newest intact one there",
                e.problems,
            ) from None
    candidates = checkpoint_candidates(path) or checkpoint_candidates(path / "checkpoints")
    if not candidates:
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}: expected a step_NNNNNN directory with {list(CHECKPOINT_FILES)}, "
            "or a run directory / checkpoints directory that contains one"
        )
    problems: list[tuple[str, str]] = []
    for candidate in candidates:
        try:
            data = read_checkpoint(candidate, trainer_state=trainer_state, map_location=map_location)
        except CheckpointError as e:
            logger.warning("skipping damaged checkpoint %s: %s", candidate, _describe(e.problems, candidate))
            problems += e.problems
            continue
        if candidate != candidates[0]:
            logger.warning("using %s, the newest intact checkpoint in %s", candidate, candidate.parent)
        return data
    raise CheckpointError(
        f"no intact checkpoint in {candidates[0].parent}: {_describe(problems, candidates[0].parent)}. "
        "Restore the files from a copy, or train again (a new out_dir, or overwrite=True to replace this run)",
        problems,
    )


def load_state_into(model: nn.Module, data: CheckpointData) -> None:
    """Load ``data``'s weights into the raw ``model``; a mismatch names the tensors, in one line."""
    raw = unwrap_model(model)
    own = raw.state_dict()
    unexpected = sorted(set(data.weights) - set(own))
    if data.trainable_only:
        missing: list[str] = []  # the frozen rest comes from the model itself
    else:
        missing = sorted(set(own) - set(data.weights))
    shapes = [
        f"{name} {list(t.shape)} vs the model's {list(own[name].shape)}"
        for name, t in data.weights.items()
        if name in own and t.shape != own[name].shape
    ]
    if unexpected or missing or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if unexpected:
            parts.append(
                f"unexpected {unexpected[:5]}" + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            )
        if shapes:
            parts.append(f"shape mismatch in {shapes[:3]}")
        raise ValueError(
            f"checkpoint {data.path} does not fit this model ({'; '.join(parts)}): was it saved from a model "
            "with another configuration or other adapters?"
        )
    raw.load_state_dict(data.weights, strict=not data.trainable_only)
