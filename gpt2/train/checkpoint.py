"""Atomic checkpoints of the raw model, optimizer, loss scaler, RNG states and data position.

``<root>/step_000100/`` holds ``model.safetensors``, ``trainer_state.safetensors`` (optimizer, scaler, RNG),
``trainer_state.json`` and ``SHA256SUMS`` (formats: :mod:`gpt2.model.checkpoint_files`). It is written into
a temporary directory beside the final one, fsynced, then renamed into place: a crash mid-save leaves the previous
checkpoints untouched; a failed save raises :class:`CheckpointSaveError` naming the newest intact one.
``trainable_only=True`` stores the trainable parameters alone (LoRA), with the base model's fingerprint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pkgutil
import random
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError

import minlora
from gpt2 import torch_compat
from gpt2.files import replace_atomically, sha256_file
from gpt2.model.checkpoint_files import (
    FORMAT_VERSION,
    META_FILE,
    SHARDED_FORMAT_VERSION,
    SHARDS_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointData,
    CheckpointMismatchError,
    is_complete,
    is_sharded,
    list_checkpoints,
    load_state_into,
    open_checkpoint,
    refuse_non_finite,
    save_state,
    save_weights,
    unwrap_model,
)
from gpt2.outputs import DIGEST_FILE, checkpoint_files, remove_files
from gpt2.train import fsdp
from gpt2.train.distributed import _active
from gpt2.train.metrics import RunOutputError, output_error

logger = logging.getLogger(__name__)


class CheckpointSaveError(RunOutputError):
    """Writing a checkpoint failed (disk full, I/O error); nothing of it was kept."""


# --- RNG states (tensors, ints, floats and lists: what save_state writes)


def capture_rng_state(all_ranks: bool = False) -> dict[str, Any]:
    """torch CPU, numpy and Python ``random`` states, and this process's own GPU's CUDA state under
    ``"cuda_by_rank"`` (reading every visible GPU's would create a CUDA context on each from every
    rank). ``all_ranks``: a collective gathering every rank's CUDA state, for rank 0 to save.
    """
    numpy = list(np.random.get_state())
    numpy[1] = torch.from_numpy(numpy[1].astype(np.int64))
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()), "numpy": numpy}
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(torch.cuda.current_device())
    by_rank = {_rank(): cuda}
    if all_ranks and _active():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, cuda)
        by_rank = dict(enumerate(gathered))
    state["cuda_by_rank"] = {rank: s for rank, s in by_rank.items() if s is not None}
    return state


def _rank() -> int:
    return dist.get_rank() if _active() else 0


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put :func:`capture_rng_state`'s states back; the CUDA one of this rank onto its own GPU."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    cuda_states = state.get("cuda_by_rank")
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


# --- save

# A full disk shows up as an OSError (ENOSPC), as torch.save's "enforce fail at inline_container.cc" RuntimeError,
# or as a SafetensorError: each becomes one CheckpointSaveError; anything else is raised as it is.
_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


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
    base_fingerprint: str | None = None,
    before_write: Callable[[], None] | None = None,
) -> Path:
    """Write ``<root>/step_{step:06d}`` atomically and return its path.

    Raises :class:`NonFiniteWeightsError` (writing nothing) if any weight is inf/nan.
    ``keep_last`` > 0 deletes all but the newest ``keep_last`` checkpoints afterwards.
    ``before_write``: called before anything is written (the run's lock check).

    A model sharded by FSDP is saved as a sharded checkpoint: EVERY process of the job calls this, and each writes
    its own shards of the model and optimizer state (no process gathers the whole model); rank 0 writes the rest
    and renames the directory into place; every process returns the path, or raises the same error. An adapter-only
    checkpoint of a sharded model needs its ``base_fingerprint``, taken before it was sharded.
    """
    raw = unwrap_model(model)
    shards = torch_compat.is_fsdp_module(raw)
    # A collective under FSDP: every process refuses alike.
    refuse_non_finite(fsdp.non_finite_parameters(raw), f"refusing to save checkpoint at step {step}")
    root = Path(root)
    final = root / f"step_{step:06d}"
    version = FORMAT_VERSION
    if shards:
        version = SHARDED_FORMAT_VERSION
    meta = _checkpoint_meta(raw, step, trainable_only, metadata, base_fingerprint, version)
    # Python's json writes a non-finite float as Infinity / NaN, and reads it back.
    meta_bytes = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    # Each file of the checkpoint and how it is written (SHA256SUMS of them follows).
    writers: dict[str, Callable[[Path], None]] = {}
    tmp = _agree(shards, lambda: _start(root, final, before_write))
    if shards:
        _write_shards(root, final, tmp, raw, optimizer, trainable_only)
        # Its state is in the shards.
        optimizer = None
    else:
        weights = dict(raw.state_dict())
        if trainable_only:
            # remove_duplicate=False: every name of a tied trainable tensor is kept (aliases are
            # deduplicated when writing), so loading restores each name.
            weights = {n: p.detach() for n, p in raw.named_parameters(remove_duplicate=False) if p.requires_grad}
        writers[WEIGHTS_FILE] = lambda path: save_weights(weights, path)
    writers[STATE_FILE] = lambda path: save_state(_trainer_state(optimizer, scaler, rng_state), path)
    writers[META_FILE] = lambda path: replace_atomically(path, lambda f: f.write(meta_bytes))

    def finish() -> Path:
        _finish(root, final, tmp, writers)
        if keep_last:
            prune_checkpoints(root, keep_last)
        logger.info("saved checkpoint %s", final)
        return final

    return _agree(shards, finish)


def _start(root: Path, final: Path, before_write: Callable[[], None] | None) -> Path:
    """Rank 0: the run's lock checked, the empty temporary directory beside ``final`` that the files are written
    into.
    """
    if before_write is not None:
        before_write()
    tmp = _aside(final, _TMP_PREFIX)
    try:
        root.mkdir(parents=True, exist_ok=True)
        # os.mkdir honours the umask, unlike tempfile.mkdtemp's private 0700.
        tmp.mkdir()
    except OSError as e:
        raise _save_error(root, final, "the temporary directory", e) from e
    return tmp


def _write_shards(root: Path, final: Path, tmp: Path, raw: nn.Module, optimizer: Any, trainable_only: bool) -> None:
    """Every process writes its shards into ``tmp``. torch.distributed.checkpoint raises on every process (its
    CheckpointException holds each failed rank's error): rank 0 cleans up, and every rank raises the same error.
    """
    try:
        fsdp.write_shards(tmp, raw, optimizer, trainable_only)
    except BaseException as e:
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(cause, _WRITE_ERRORS):
            raise
        # no rank says "nothing was kept" before the temporary directory is gone
        dist.barrier()
        raise _save_error(root, final, SHARDS_DIR, cause) from None


def _finish(root: Path, final: Path, tmp: Path, writers: dict[str, Callable[[Path], None]]) -> None:
    """Rank 0, once any shards are written: each file of ``writers`` (``name: write(path)``) and SHA256SUMS of every
    file into ``tmp``, made durable, then renamed to ``final``. A failure removes ``tmp``; an I/O one (disk full)
    raises :class:`CheckpointSaveError` naming the file being written.
    """
    writing = ""
    try:
        for name, write in writers.items():
            writing = name
            write(tmp / name)
        writing = DIGEST_FILE
        _write_digests(tmp)
        writing = "the checkpoint directory"
        _fsync_dir(tmp)
        _move_into_place(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, _WRITE_ERRORS):
            raise
        raise _save_error(root, final, writing, e) from e


def _agree(shards: bool, work: Callable[[], Any]) -> Any:
    """Run ``work`` (rank 0's part of a save). For a sharded save, every process gets its result, or raises its
    error (no rank goes on while another has failed).
    """
    if not shards:
        return work()
    outcome = [run_on_all_ranks(lambda: work() if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0]


def run_on_all_ranks(fn: Callable[[], Any]) -> Any:
    """``fn()`` on every process; if it raises on any of them, every process raises (so none is left waiting at a
    collective for one that died): its own error, or the other rank's, of the same class where that class is built
    from a message. One process: just ``fn()``.
    """
    if not _active():
        return fn()
    # what each process raised: None where fn() returned
    outcomes: list[Any] = [None] * dist.get_world_size()
    try:
        result = fn()
    except BaseException as e:
        # The class by its name: pickling a class defined inside a function would fail here, before the collective,
        # and leave the other processes waiting at it.
        dist.all_gather_object(outcomes, (f"{type(e).__module__}:{type(e).__qualname__}", str(e)))
        raise
    dist.all_gather_object(outcomes, None)
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            name, message = outcome
            message = f"{message} (raised on rank {rank})"
            try:
                error = pkgutil.resolve_name(name)(message)
            except (ImportError, AttributeError, ValueError, TypeError):
                error = RuntimeError(f"{name}: {message}")
            raise error
    return result


def _checkpoint_meta(
    raw: nn.Module,
    step: int,
    trainable_only: bool,
    metadata: dict[str, Any] | None,
    base_fingerprint: str | None,
    version: int,
) -> dict[str, Any]:
    """``trainer_state.json``'s content; an adapter-only checkpoint also records its base model (its
    ``base_fingerprint``, computed here when not given: a sharded model's must be given).
    """
    meta = {"format_version": version, "step": step, "trainable_only": trainable_only, **(metadata or {})}
    if not trainable_only:
        return meta
    sites = minlora.lora_sites(raw)
    if sites:
        meta["base_fingerprint"] = base_fingerprint or minlora.base_fingerprint(raw)
        # alpha / rank (rsLoRA: / sqrt(rank))
        meta["lora_scaling"] = {s.name: s.lora.scaling for s in sites}
    return meta


def _trainer_state(optimizer: Any, scaler: Any, rng_state: dict[str, Any] | None) -> dict[str, Any]:
    """``trainer_state.safetensors``' content: None for an optimizer or enabled scaler the run has not."""
    state: dict[str, Any] = {"optimizer": None, "scaler": None, "rng": rng_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scaler is not None and scaler.is_enabled():
        state["scaler"] = scaler.state_dict()
    if rng_state is None:
        state["rng"] = capture_rng_state()
    return state


def _write_digests(tmp: Path) -> None:
    """``SHA256SUMS`` of every file under ``tmp``, in ``sha256sum -c`` format."""
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    sums = "".join(f"{sha256_file(tmp / name)}  {name}\n" for name in names)
    replace_atomically(tmp / DIGEST_FILE, lambda f: f.write(sums.encode()))


def _aside(path: Path, prefix: str) -> Path:
    """A unique name beside ``path`` (the same filesystem, so renames between them are atomic)."""
    return path.with_name(f"{prefix}{path.name}-{uuid.uuid4().hex[:8]}")


def _save_error(root: Path, final: Path, writing: str, e: BaseException) -> RunOutputError:
    """The :class:`CheckpointSaveError` of a save of ``final`` that failed with ``e`` while writing ``writing``."""
    doing = f"could not save checkpoint {final.name} (nothing of it was kept): writing {writing} in"
    return output_error(root, doing, e, root, CheckpointSaveError)


def _move_into_place(tmp: Path, final: Path) -> None:
    """rename(tmp, final); an existing ``final`` (the same step saved again) is swapped out first."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = _aside(final, _OLD_PREFIX)
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        # Put the previous copy back.
        os.replace(old, final)
        raise
    warn_kept(remove_checkpoint(old), f"replacing {final}")


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (new names, renames) durable; not possible on Windows."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_checkpoint(path: Path) -> list[Path]:
    """Delete the checkpoint folder ``path``, but only the files its own record (``SHA256SUMS``) vouches for:
    the rest (a user's notes, a file changed since) is kept in place and returned, for the caller to name.
    A folder that is all gpt2's is renamed first, so that a kill during the delete leaves a leftover of
    :func:`clean_interrupted_saves`, never a torn ``step_*``.
    """
    mine, others = checkpoint_files(path)
    if others:
        remove_files(path, mine)
        return others
    doomed = _aside(path, _TMP_PREFIX)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return []


def warn_kept(kept: list[Path], doing: str) -> None:
    if kept:
        logger.warning(
            "%s kept %s: gpt2 did not write them (or they changed since); move them away if they should go",
            doing,
            ", ".join(str(p) for p in kept),
        )


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (a file of the user's inside one is kept,
    and named).
    """
    checkpoints = list_checkpoints(root)
    removed = checkpoints[: max(0, len(checkpoints) - keep_last)]
    for path in removed:
        warn_kept(remove_checkpoint(path), f"pruning {path}")
    return removed


def clean_interrupted_saves(root: str | os.PathLike) -> None:
    """Remove what a killed save left in ``root`` (``.tmp-step_*``, which only gpt2 writes into; an
    ``.old-step_*`` copy, by its record, or renamed back where its ``step_*`` is missing, the process having
    died between the two renames), with a warning for each. The caller holds the run's lock: no other process
    saves here (a save that fails with an exception cleans up itself).
    """
    root = Path(root)
    # (a root that is not a directory holds none)
    for path in [*root.glob(_TMP_PREFIX + "step_*"), *root.glob(_OLD_PREFIX + "step_*")]:
        # .old-step_000004-1a2b3c4d: the copy of step_000004 that a save of that step again swapped out
        final = root / path.name.removeprefix(_OLD_PREFIX).split("-", 1)[0]
        if path.name.startswith(_OLD_PREFIX) and not final.exists() and is_complete(path):
            os.replace(path, final)
            logger.warning("cleaning up an interrupted save: restored %s from %s", final, path.name)
            continue
        logger.warning("cleaning up an interrupted save: removing %s", path)
        if path.name.startswith(_OLD_PREFIX):
            warn_kept(remove_checkpoint(path), f"removing {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


# --- load


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    restore_rng: bool = False,
    weights_only: bool = False,
    allow_base_mismatch: bool = False,
    base_fingerprint: str | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and optimizer / scaler / RNG); return its metadata.

    ``path``: a checkpoint, or a ``checkpoints`` / run directory (its newest checkpoint that is intact and fits). All is
    verified before the model is touched; nothing is unpickled. A state that does not fit raises
    :class:`CheckpointMismatchError`; ``weights_only`` loads the weights alone. Adapters saved on another base raise
    :class:`minlora.AdapterBaseMismatchError` unless ``allow_base_mismatch`` (a model sharded by FSDP needs its
    ``base_fingerprint``, taken before it was sharded).

    Regular and sharded checkpoints load into models sharded by FSDP or not, on any number of processes: every
    process of a job calls this for a sharded checkpoint or a sharded model (:mod:`gpt2.train.fsdp`).
    """
    need_state = not weights_only and (optimizer is not None or scaler is not None or restore_rng)

    def check(data: CheckpointData) -> None:
        _check_base(model, data, allow_base_mismatch, base_fingerprint)
        # Another model's weights first: its optimizer state cannot fit.
        load_state_into(model, data, check_only=True)
        if need_state:
            _check_state(model, optimizer, scaler, data)

    # weights=False: a sharded checkpoint's shards stay on disk until they load straight into their places.
    data = open_checkpoint(path, trainer_state=need_state, check=check, weights=False)
    state = data.trainer_state or {}
    if not need_state:
        optimizer = None
    # By the pair of formats: shards into any model; whole tensors into a sharded model; into a whole model.
    raw = unwrap_model(model)
    if is_sharded(data.path):
        fsdp.load_shards(data.path, raw, optimizer, data.trainable_only)
    elif torch_compat.is_fsdp_module(raw):
        fsdp.load_whole(raw, data.weights, optimizer, state.get("optimizer"), strict=not data.trainable_only)
    else:
        load_state_into(model, data)
        if optimizer is not None:
            _restore_optimizer(optimizer, state["optimizer"])
    if need_state and scaler is not None and scaler.is_enabled():
        if state["scaler"] is None:
            logger.warning("checkpoint %s has no loss-scaler state; the scaler starts fresh", data.path)
        else:
            scaler.load_state_dict(state["scaler"])
    if need_state and restore_rng:
        restore_rng_state(state["rng"])
    return {**data.meta, "path": str(data.path)}


def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """The saved optimizer state, with this run's settings (weight decay, betas...) but the LR."""
    mine = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, mine):
        group.update(settings)


def _check_base(model: nn.Module, data: CheckpointData, allow: bool, own: str | None = None) -> None:
    """Refuse adapters saved with other LoRA scalings or (unless ``allow``) on another base model (the model's
    fingerprint ``own``, computed here when not given).
    """
    saved = data.meta.get("base_fingerprint")
    raw = unwrap_model(model)
    if not data.trainable_only or saved is None or not minlora.lora_sites(raw):
        return
    scaling = {s.name: s.lora.scaling for s in minlora.lora_sites(raw)}
    saved_scaling = data.meta.get("lora_scaling") or {}
    if saved_scaling != scaling:
        raise CheckpointMismatchError(
            f"checkpoint {data.path} was trained with another LoRA alpha or rsLoRA setting (scaling "
            f"{sorted(set(saved_scaling.values()))}, this run's {sorted(set(scaling.values()))}): "
            "resume with the run's --lora settings, or start a new run"
        )
    if own is None:
        own = minlora.base_fingerprint(raw)
    if saved != own:
        message = (
            f"checkpoint {data.path} holds adapter weights trained on another base model (fingerprint "
            f"{saved[:12]}, this model's is {own[:12]}): resume onto the base it was trained on, or pass "
            "allow_base_mismatch=True (--allow-base-mismatch) to accept it"
        )
        if not allow:
            raise minlora.AdapterBaseMismatchError(message)
        logger.warning("%s; accepted (allow_base_mismatch)", message.split(": resume")[0])


def _check_state(model: nn.Module, optimizer: Any, scaler: Any, data: CheckpointData) -> None:
    """Raise :class:`CheckpointMismatchError` unless the saved loss-scaler state holds a finite, positive scale and
    the saved optimizer state fits ``optimizer`` (a sharded checkpoint's is in its shards: loading them checks it).
    """
    saved, saved_scaler = data.trainer_state["optimizer"], data.trainer_state["scaler"]  # type: ignore[index]
    what, why = "optimizer", None
    if scaler is not None and scaler.is_enabled() and saved_scaler is not None:
        scale = None
        if isinstance(saved_scaler, dict):
            scale = saved_scaler.get("scale")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            what, why = "loss-scaler", f"scale {scale!r}"
    if why is None and optimizer is not None and not is_sharded(data.path):
        why = _optimizer_misfit(model, optimizer, saved)
    if why is not None:
        raise CheckpointMismatchError(
            f"checkpoint {data.path}: the {what} state in {STATE_FILE} does not fit this run ({why}). To start from "
            "the weights alone with a fresh optimizer, pass resume_weights_only=True (--resume-weights-only)",
            [(str(data.path / STATE_FILE), f"{what} state does not fit ({why})")],
        )


def _optimizer_misfit(model: nn.Module, optimizer: Any, saved: dict[str, Any] | None) -> str | None:
    """Why the saved optimizer state does not fit ``optimizer`` (none saved, other groups, or a state tensor, e.g.
    Adam's ``exp_avg``, of another shape than its parameter's), or None.
    """
    if saved is None:
        return "there is none"
    groups = [len(g["params"]) for g in optimizer.param_groups]
    saved_groups = [len(g["params"]) for g in saved["param_groups"]]
    if groups != saved_groups:
        return f"parameters per group {saved_groups}, the optimizer has {groups}"
    names = {id(p): n for n, p in unwrap_model(model).named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for p, i in zip(params, ids):
        for key, value in saved["state"].get(i, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                return f"{key} of {names.get(id(p), i)} is {list(value.shape)}, the parameter {list(p.shape)}"
    return None


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and Python ``random``: the start of the RNG states that
    :func:`capture_rng_state` saves with a checkpoint.
    """
    random.seed(seed)
    np.random.seed(seed)
    # Also seeds every CUDA device.
    torch.manual_seed(seed)
