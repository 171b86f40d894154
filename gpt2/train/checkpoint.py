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

Loading verifies what it reads: the safetensors header against the file's size, every weight
finite, the JSON state and the optimizer-state archive. A damaged file raises
:class:`CheckpointError` naming the file and what is wrong with it; given a run or
``checkpoints`` directory, :func:`load_checkpoint` falls back to the newest intact checkpoint and
logs each one it skipped. A save that fails (disk full, I/O error) raises
:class:`CheckpointSaveError`, leaves nothing behind and says where the previous checkpoint is.

``trainable_only=True`` stores just the parameters with ``requires_grad=True`` (e.g. LoRA
adapters on a frozen base model) instead of the whole state dict; loading such a checkpoint
needs a model that already holds the frozen weights.

This module writes and loads checkpoints; :mod:`gpt2.checkpoint_files` holds the file formats,
the verified reading and the finding of checkpoints, all re-exported here (import from
``gpt2.checkpoint``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError

# Re-exported: the public names of reading and verifying live in checkpoint_files.
from gpt2.model.checkpoint_files import (  # noqa: F401
    CHECKPOINT_FILES,
    FORMAT_VERSION,
    LATEST_FILE,
    META_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointData,
    CheckpointError,
    CheckpointSaveError,
    NonFiniteWeightsError,
    _first_line,
    check_safetensors,
    checkpoint_candidates,
    checkpoint_step,
    find_latest_checkpoint,
    is_complete,
    list_checkpoints,
    load_state_into,
    load_weights,
    non_finite_tensors,
    open_checkpoint,
    read_checkpoint,
    resolve_checkpoint,
    save_weights,
    unwrap_model,
)

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------
# The raw model's state dict
# ------------------------------------------------------------------------------------------


def model_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The raw model's state dict, or only its trainable parameters."""
    model = unwrap_model(model)
    if not trainable_only:
        return dict(model.state_dict())
    # remove_duplicate=False: every name of a tied trainable tensor is kept (aliases are
    # deduplicated when writing), so loading restores each name.
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


# ------------------------------------------------------------------------------------------
# RNG states (weights_only-safe: tensors, ints, floats and lists)
# ------------------------------------------------------------------------------------------


def capture_rng_state(all_ranks: bool = False) -> dict[str, Any]:
    """torch CPU, numpy and Python ``random`` generator states, and the CUDA generator state of this
    process's GPU under ``"cuda_by_rank"`` (``{rank: state}``; only devices this process uses:
    reading every visible GPU's state would create a CUDA context on each of them from every rank).

    ``all_ranks``: gather every rank's CUDA state, so rank 0 can save them all. A collective:
    every rank of the process group must call it.
    """
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
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(torch.cuda.current_device())
    if all_ranks and _world_size() > 1:
        gathered: list[Any] = [None] * _world_size()
        dist.all_gather_object(gathered, cuda)
        by_rank = {rank: s for rank, s in enumerate(gathered) if s is not None}
    else:
        by_rank = {_rank(): cuda} if cuda is not None else {}
    if by_rank:
        state["cuda_by_rank"] = by_rank
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put :func:`capture_rng_state`'s states back; the CUDA one of this rank onto its own GPU."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state(
        (npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    cuda_states = state.get("cuda_by_rank")
    if cuda_states is None and state.get("cuda"):  # older checkpoints: every GPU's state as rank 0 saw it
        cuda_states = {0: state["cuda"][0]}
    if cuda_states and torch.cuda.is_available():
        rank = _rank()
        if rank in cuda_states:
            torch.cuda.set_rng_state(cuda_states[rank], torch.cuda.current_device())
        else:
            logger.warning(
                "checkpoint holds the CUDA RNG states of rank(s) %s, not of rank %d: its CUDA RNG is not restored",
                sorted(cuda_states),
                rank,
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
    tmp = root / f"{_TMP_PREFIX}{final.name}-{_owner_tag()}-{uuid.uuid4().hex[:8]}"
    writing = "the temporary directory"
    try:
        tmp.mkdir()
        writing = WEIGHTS_FILE
        _write_weights(state, tmp / WEIGHTS_FILE, {"step": str(step), "trainable_only": str(trainable_only)})
        writing = STATE_FILE
        _write_trainer_state(trainer_state, tmp / STATE_FILE)
        writing = META_FILE
        _write_json(meta, tmp / META_FILE)
        writing = "the checkpoint directory"
        _fsync_dir(tmp)
        _move_into_place(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # Disk full shows up as OSError (ENOSPC), as torch.save's "enforce fail at
        # inline_container.cc" RuntimeError, or as a SafetensorError: one message for all.
        if isinstance(e, (OSError, RuntimeError, SafetensorError)):
            raise _save_error(root, final, writing, e) from e
        raise
    try:
        _fsync_dir(root)
        _write_latest(root, final.name)
    except OSError as e:  # the checkpoint itself is complete and in place; only the pointer is stale
        logger.warning(
            "saved %s, but could not update %s (%s); resuming uses the directory listing, so this is harmless",
            final,
            root / LATEST_FILE,
            _first_line(e),
        )
    if keep_last:
        prune_checkpoints(root, keep_last)
    logger.info("saved checkpoint %s", final)
    return final


_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_LATEST_TMP_PREFIX = f".{LATEST_FILE}.tmp-"


def _owner_tag() -> str:
    """``<host>-<pid>`` in temporary names, so a clean-up can tell a dead writer's leftovers."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _save_error(root: Path, final: Path, writing: str, e: BaseException) -> CheckpointSaveError:
    previous = [p for p in list_checkpoints(root) if p != final]
    if final.is_dir():  # the same step saved again: the old copy of it is still in place
        kept = f"the previous copy {final} is intact"
    elif previous:
        kept = f"the previous checkpoint {previous[-1]} is intact (resume='auto' continues from it)"
    else:
        kept = f"there is no earlier checkpoint in {root}"
    full = "ENOSPC" if getattr(e, "errno", None) == 28 or "No space" in str(e) else None
    fix = ("free disk space" if full else "check the disk") + " (or point out_dir at another disk), then resume"
    err = CheckpointSaveError(
        f"could not save checkpoint {final.name} in {root}: writing {writing} failed ({_first_line(e)}); "
        f"nothing of it was kept and {kept}. {fix[0].upper()}{fix[1:]}"
    )
    err.errno = getattr(e, "errno", None)
    return err


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
    old = final.with_name(f"{_OLD_PREFIX}{final.name}-{_owner_tag()}")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)  # put the previous copy back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{_LATEST_TMP_PREFIX}{_owner_tag()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    # Leftovers of saves that were killed (a save that fails with an exception cleans up itself);
    # only those of dead processes on this host: another process may be saving right now.
    clean_interrupted_saves(root, only_dead=True)
    return removed


def clean_interrupted_saves(root: str | os.PathLike, *, only_dead: bool = False) -> list[str]:
    """Remove what a killed save left in ``root``: ``.tmp-step_*`` directories, ``.latest.tmp-*``
    files, and ``.old-step_*`` copies (one whose ``step_*`` is missing, because the process died
    between the two renames of re-saving a step, is renamed back instead). Returns what it did.

    ``only_dead``: touch only leftovers of processes on this host that are no longer running
    (without it, the caller must know no other process saves here: it holds the run's lock).
    """
    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    for path in root.iterdir():
        name = path.name
        if not name.startswith((_TMP_PREFIX + "step_", _OLD_PREFIX + "step_", _LATEST_TMP_PREFIX)):
            continue
        if only_dead and not _writer_is_dead(name):
            continue
        if name.startswith(_OLD_PREFIX):
            final = root / name[len(_OLD_PREFIX) :].split("-", 1)[0]
            if not final.exists() and is_complete(path):
                os.replace(path, final)
                done.append(f"restored {final.name} from {name}")
                continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        done.append(f"removed {name}")
    return done


def _writer_is_dead(name: str) -> bool:
    """Whether the ``<host>-<pid>`` in a temporary name is a process of this host that is gone."""
    tag = name if name.startswith(_OLD_PREFIX) else name.rsplit("-", 1)[0]
    host, _, pid = tag.rpartition("-")
    if not pid.isdigit() or not host.endswith(socket.gethostname()):
        return False  # another host's, or an old name without the owner: leave it
    return not pid_alive(int(pid))


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, but belongs to someone else
        return True
    except OSError:
        return False
    return True


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
    (then the newest *intact* checkpoint is used, see :func:`open_checkpoint`). Everything is
    read and verified before the model is touched. Nothing is unpickled: weights come from
    safetensors, the rest from ``torch.load(weights_only=True)`` and JSON.
    """
    need_state = optimizer is not None or scaler is not None or restore_rng
    data = open_checkpoint(path, trainer_state=need_state, map_location=map_location)
    path = data.path
    trainer_state = data.trainer_state
    if optimizer is not None and trainer_state is not None and trainer_state["optimizer"] is None:
        raise KeyError(f"checkpoint {str(path)!r} has no optimizer state")
    load_state_into(model, data)
    if trainer_state is not None:
        if optimizer is not None:
            try:
                optimizer.load_state_dict(trainer_state["optimizer"])
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                raise ValueError(
                    f"the optimizer state in {path / STATE_FILE} does not fit this model's optimizer "
                    f"({_first_line(e)}): were other parameters trainable when it was saved?"
                ) from None
        if scaler is not None:
            if trainer_state["scaler"] is not None:
                scaler.load_state_dict(trainer_state["scaler"])
            else:
                logger.warning("checkpoint %s has no loss-scaler state; the scaler starts fresh", path)
        if restore_rng:
            restore_rng_state(trainer_state["rng"])
    meta = dict(data.meta)
    meta["path"] = str(path)
    return meta


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and Python ``random``: the start of the RNG states that
    :func:`capture_rng_state` saves with a checkpoint."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
