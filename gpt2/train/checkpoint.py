"""Atomic checkpoints of the raw model, optimizer, loss scaler, RNG states and data position.

``<root>/step_000100/`` holds ``model.safetensors``, ``trainer_state.safetensors`` (optimizer, scaler, RNG),
``trainer_state.json`` and ``SHA256SUMS`` (formats: :mod:`gpt2.model.checkpoint_files`). It is written into
a temporary directory beside the final one, fsynced, then renamed into place: a crash mid-save leaves the previous
checkpoints untouched; a failed save raises :class:`CheckpointSaveError` naming the previous one.
``trainable_only=True`` stores the trainable parameters alone (LoRA), with the base model's fingerprint.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError

import minlora
from gpt2.errors import InvalidValueError
from gpt2.files import pid_alive, replace_atomically, write_advice
from gpt2.model.checkpoint_files import (  # noqa: F401 - re-exported: the checkpoint API
    CHECKPOINT_DIR,
    DIGEST_FILE,
    FORMAT_VERSION,
    META_FILE,
    SHARDED_FORMAT_VERSION,
    SHARDS_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointData,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    NonFiniteWeightsError,
    _first_line,
    checkpoint_candidates,
    checkpoint_step,
    find_latest_checkpoint,
    is_complete,
    is_sharded,
    list_checkpoints,
    load_state_into,
    load_weights,
    non_finite_tensors,
    open_checkpoint,
    read_checkpoint,
    refuse_non_finite,
    save_state,
    save_weights,
    sha256_file,
    unwrap_model,
)
from gpt2.outputs import checkpoint_files, remove_files
from gpt2.train import fsdp, sharded
from gpt2.train.distributed import _active

logger = logging.getLogger(__name__)


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
    by_rank: dict[int, torch.Tensor] = {}
    if all_ranks and _active():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, cuda)
        by_rank = {rank: s for rank, s in enumerate(gathered) if s is not None}
    elif cuda is not None:
        by_rank = {_rank(): cuda}
    if by_rank:
        state["cuda_by_rank"] = by_rank
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
    _check_step(step)
    raw = unwrap_model(model)
    state = _weights_to_save(raw, trainable_only)
    refuse_non_finite(state, f"refusing to save checkpoint at step {step}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    meta = _checkpoint_meta(raw, step, trainable_only, metadata)
    trainer_state = _trainer_state(optimizer, scaler, rng_state)
    meta_bytes = _meta_bytes(meta)
    weights_meta = {"step": str(step), "trainable_only": str(trainable_only)}
    # Each file of the checkpoint and how it is written (SHA256SUMS of them follows).
    writers: list[tuple[str, Callable[[Path], None]]] = [
        (WEIGHTS_FILE, lambda path: save_weights(state, path, weights_meta)),
        (STATE_FILE, lambda path: save_state(trainer_state, path)),
        (META_FILE, lambda path: replace_atomically(path, lambda f: f.write(meta_bytes))),
    ]
    _write_checkpoint_dir(root, final, writers)
    if keep_last:
        prune_checkpoints(root, keep_last)
    logger.info("saved checkpoint %s", final)
    return final


def save_sharded_checkpoint(
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
    """Write ``<root>/step_{step:06d}`` as a sharded checkpoint: EVERY process of the job calls this, and each
    writes its own shards of the model and optimizer state (no process gathers the whole model). Rank 0
    names the temporary directory, writes the rest (scaler and RNG states, metadata, SHA256SUMS of every
    file) and renames it into place, so the checkpoint appears whole or not at all, as
    :func:`save_checkpoint`'s. Every process returns the path, or raises the same error.
    ``before_write``: called on rank 0 before anything is written (the run's lock check).
    """
    _check_step(step)
    raw = unwrap_model(model)
    bad = fsdp.non_finite_parameters(raw)
    if bad:
        raise NonFiniteWeightsError(
            f"refusing to save checkpoint at step {step}: non-finite values (inf/nan) in {', '.join(bad[:5])}"
        )
    root = Path(root)
    final = root / f"step_{step:06d}"
    is_main = dist.get_rank() == 0
    tmp = _agree(is_main, lambda: _start_sharded(root, final, before_write), f"starting checkpoint {final.name}")
    try:
        sharded.write_shards(tmp, raw, optimizer, trainable_only)
    except BaseException as e:
        # torch.distributed.checkpoint raised on every process (its CheckpointException holds each failed rank's
        # error): rank 0 cleans up, and every rank raises the same one-line error.
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(cause, (OSError, RuntimeError, SafetensorError)):
            raise
        # no rank says "nothing was kept" before the temporary directory is gone
        dist.barrier()
        raise _save_error(root, final, SHARDS_DIR, cause) from None
    meta = _checkpoint_meta(raw, step, trainable_only, metadata, base_fingerprint, SHARDED_FORMAT_VERSION)

    def finish() -> Path:
        _finish_sharded(root, final, tmp, meta, _trainer_state(None, scaler, rng_state))
        if keep_last:
            prune_checkpoints(root, keep_last)
        logger.info("saved sharded checkpoint %s", final)
        return final

    return _agree(is_main, finish, f"finishing checkpoint {final.name}")


def _check_step(step: Any) -> None:
    """A checkpoint's step: a non-negative integer (it names the directory)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidValueError(f"step must be a non-negative integer, got {step!r}")


def _meta_bytes(meta: dict[str, Any]) -> bytes:
    """``trainer_state.json``'s bytes (JSON has no inf/nan: they are stored as null)."""
    return (json.dumps(_json_safe(meta), indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def _start_sharded(root: Path, final: Path, before_write: Callable[[], None] | None) -> Path:
    """Rank 0: the run's lock checked, the empty temporary directory every process writes its shards into."""
    if before_write is not None:
        before_write()
    tmp = _temporary_dir(root, final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise _save_error(root, final, "the temporary directory", e) from e
    return tmp


def _finish_sharded(root: Path, final: Path, tmp: Path, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """Rank 0, once every shard is written: both trainer_state files, SHA256SUMS of every file, the rename."""
    meta_bytes = _meta_bytes(meta)
    writing = STATE_FILE
    try:
        save_state(state, tmp / STATE_FILE)
        writing = META_FILE
        replace_atomically(tmp / META_FILE, lambda f: f.write(meta_bytes))
        writing = DIGEST_FILE
        shards = sorted(str(p.relative_to(tmp)) for p in (tmp / SHARDS_DIR).rglob("*") if p.is_file())
        _write_digests(tmp, [STATE_FILE, META_FILE, *shards])
        writing = "the checkpoint directory"
        _move_durably(tmp, final)
    except BaseException as e:
        error = _failed_save(root, final, tmp, writing, e)
        if error is e:
            raise
        raise error from e


def _agree(is_main: bool, work: Callable[[], Any], what: str) -> Any:
    """Run ``work`` on rank 0 and tell every process how it went: its result, or on every other rank a
    :class:`CheckpointSaveError` carrying rank 0's error (no rank goes on while another has failed).
    """
    outcome: list[Any] = [None, None]
    error: BaseException | None = None
    if is_main:
        try:
            outcome[0] = work()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks before it is raised
            error = e
            outcome[1] = f"{type(e).__name__}: {_first_line(e)}"
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise CheckpointSaveError(f"rank 0 failed {what}: {outcome[1]}")
    return outcome[0]


def _weights_to_save(raw: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The whole state dict, or the trainable parameters alone."""
    if not trainable_only:
        return dict(raw.state_dict())
    # remove_duplicate=False: every name of a tied trainable tensor is kept (aliases are
    # deduplicated when writing), so loading restores each name.
    named = raw.named_parameters(remove_duplicate=False)
    return {n: p.detach() for n, p in named if p.requires_grad}


def _checkpoint_meta(
    raw: nn.Module,
    step: int,
    trainable_only: bool,
    metadata: dict[str, Any] | None,
    base_fingerprint: str | None = None,
    version: int = FORMAT_VERSION,
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


def _write_checkpoint_dir(root: Path, final: Path, writers: list[tuple[str, Callable[[Path], None]]]) -> None:
    """Write each ``(name, write(path))`` of ``writers`` and their SHA256SUMS into a temporary directory, then
    rename it to ``final``. A failure removes the temporary directory; an I/O one (disk full) raises
    :class:`CheckpointSaveError` naming the file being written.
    """
    tmp = _temporary_dir(root, final)
    writing = "the temporary directory"
    try:
        # os.mkdir honours the umask, unlike tempfile.mkdtemp's private 0700.
        tmp.mkdir()
        for name, write in writers:
            writing = name
            write(tmp / name)
        writing = DIGEST_FILE
        _write_digests(tmp, [name for name, _ in writers])
        writing = "the checkpoint directory"
        _move_durably(tmp, final)
    except BaseException as e:
        error = _failed_save(root, final, tmp, writing, e)
        if error is e:
            raise
        raise error from e


def _temporary_dir(root: Path, final: Path) -> Path:
    """A unique name beside ``final`` (same filesystem, so the rename into place is atomic)."""
    return root / f"{_TMP_PREFIX}{final.name}-{_owner_tag()}-{uuid.uuid4().hex[:8]}"


def _write_digests(tmp: Path, names: list[str]) -> None:
    """``SHA256SUMS`` of ``names`` (paths inside ``tmp``), in ``sha256sum -c`` format."""
    sums = "".join(f"{sha256_file(tmp / name)}  {name}\n" for name in names)
    replace_atomically(tmp / DIGEST_FILE, lambda f: f.write(sums.encode()))


def _move_durably(tmp: Path, final: Path) -> None:
    """Make ``tmp``'s entries durable, rename it to ``final`` and make the rename durable."""
    _fsync_dir(tmp)
    _move_into_place(tmp, final)
    _fsync_dir(final.parent)


def _failed_save(root: Path, final: Path, tmp: Path, writing: str, e: BaseException) -> BaseException:
    """Remove the temporary directory of a failed save; the error to raise: disk full shows up as OSError
    (ENOSPC), as torch.save's "enforce fail at inline_container.cc" RuntimeError, or as a SafetensorError,
    and each becomes one :class:`CheckpointSaveError`; anything else is raised as it is.
    """
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, (OSError, RuntimeError, SafetensorError)):
        return _save_error(root, final, writing, e)
    return e


_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def _owner_tag() -> str:
    """``<host>-<pid>`` in temporary names, so a clean-up can tell a dead writer's leftovers."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _save_error(root: Path, final: Path, writing: str, e: BaseException) -> CheckpointSaveError:
    previous = [p for p in list_checkpoints(root) if p != final]
    # The same step saved again: the old copy of it is still in place.
    if final.is_dir():
        kept = f"the previous copy {final} is intact"
    elif previous:
        kept = f"the previous checkpoint {previous[-1]} is intact (resume='auto' continues from it)"
    else:
        kept = f"there is no earlier checkpoint in {root}"
    fix = f"To go on: {write_advice(e)} (out_dir), then resume"
    err = CheckpointSaveError(
        f"could not save checkpoint {final.name} in {root}: writing {writing} failed ({_first_line(e)}); "
        f"nothing of it was kept and {kept}. {fix}"
    )
    err.errno = getattr(e, "errno", None)
    return err


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
        # Put the previous copy back.
        os.replace(old, final)
        raise
    _warn_kept(remove_checkpoint(old), f"replacing {final}")


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
    doomed = path.with_name(f"{_TMP_PREFIX}{path.name}-{_owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return []


def _warn_kept(kept: list[Path], doing: str) -> None:
    if kept:
        logger.warning(
            "%s kept %s: gpt2 did not write them (or they changed since); move them away if they should go",
            doing,
            ", ".join(str(p) for p in kept),
        )


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (a file of the user's inside one is kept,
    and named) and leftovers of crashed saves.
    """
    checkpoints = list_checkpoints(root)
    removed = checkpoints[: max(0, len(checkpoints) - keep_last)]
    for path in removed:
        _warn_kept(remove_checkpoint(path), f"pruning {path}")
    # Leftovers of saves that were killed (a save that fails with an exception cleans up itself);
    # only those of dead processes on this host: another process may be saving right now.
    clean_interrupted_saves(root, only_dead=True)
    return removed


def clean_interrupted_saves(root: str | os.PathLike, *, only_dead: bool = False) -> list[str]:
    """Remove what a killed save left in ``root`` (``.tmp-step_*``, which only gpt2 writes into; an
    ``.old-step_*`` copy, by its record, or renamed back where its ``step_*`` is missing, the process having
    died between the two renames); returns what it did. ``only_dead``: only leftovers of dead processes on
    this host (without it, the caller holds the run's lock: no other process saves here).
    """
    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    for path in root.iterdir():
        name = path.name
        if not name.startswith((_TMP_PREFIX + "step_", _OLD_PREFIX + "step_")):
            continue
        if only_dead and not _writer_is_dead(name):
            continue
        if name.startswith(_OLD_PREFIX):
            final = root / name[len(_OLD_PREFIX) :].split("-", 1)[0]
            if not final.exists() and is_complete(path):
                os.replace(path, final)
                done.append(f"restored {final.name} from {name}")
                continue
            _warn_kept(remove_checkpoint(path), f"removing {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)
        done.append(f"removed {name}")
    return done


def _writer_is_dead(name: str) -> bool:
    """Whether the ``<host>-<pid>`` in a temporary name is a process of this host that is gone."""
    tag = name
    # ``.tmp-`` names end in ``-<host>-<pid>-<random>``, ``.old-`` ones in ``-<host>-<pid>``.
    if not name.startswith(_OLD_PREFIX):
        tag = name.rsplit("-", 1)[0]
    host, _, pid = tag.rpartition("-")
    # Another host's, or an old name without the owner: leave it.
    if not pid.isdigit() or not host.endswith(socket.gethostname()):
        return False
    return not pid_alive(int(pid))


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
    process of a job calls this for a sharded checkpoint or a sharded model (:mod:`gpt2.train.sharded`).
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
    state = data.trainer_state
    saved_optimizer = None
    if state is not None and optimizer is not None:
        saved_optimizer = state["optimizer"]
    _load_weights_and_optimizer(model, data, optimizer if state is not None else None, saved_optimizer)
    if state is not None:
        if scaler is not None and scaler.is_enabled():
            _restore_scaler(scaler, state["scaler"], data.path)
        if restore_rng:
            restore_rng_state(state["rng"])
    return {**data.meta, "path": str(data.path)}


def _load_weights_and_optimizer(model: nn.Module, data: CheckpointData, optimizer: Any, saved_optimizer: Any) -> None:
    """The weights (and given an ``optimizer``, its state) of ``data`` into ``model``, by the pair of formats:
    shards into any model; whole tensors into a sharded model; whole tensors into a whole model.
    """
    raw = unwrap_model(model)
    if is_sharded(data.path):
        sharded.load_shards(data.path, raw, optimizer, data.trainable_only)
        return
    weights = data.weights
    if not weights or any(t.is_meta for t in weights.values()):
        weights, _ = load_weights(data.path / WEIGHTS_FILE)
    if fsdp.is_sharded(raw):
        sharded.load_whole(raw, weights, optimizer, saved_optimizer, strict=not data.trainable_only)
        return
    load_state_into(model, CheckpointData(data.path, data.meta, weights, data.weights_meta))
    if optimizer is not None:
        _restore_optimizer(optimizer, saved_optimizer)


def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """The saved optimizer state, with this run's settings (weight decay, betas...) but the LR."""
    mine = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, mine):
        group.update(settings)


def _restore_scaler(scaler: torch.amp.GradScaler, saved: dict[str, Any] | None, path: Path) -> None:
    if saved is not None:
        scaler.load_state_dict(saved)
    else:
        logger.warning("checkpoint %s has no loss-scaler state; the scaler starts fresh", path)


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
    """Raise :class:`CheckpointMismatchError` unless the saved optimizer state fits ``optimizer`` (as
    many groups and parameters, every state tensor of its parameter's shape) and the scaler's is one.
    """
    saved, saved_scaler = data.trainer_state["optimizer"], data.trainer_state["scaler"]  # type: ignore[index]
    if scaler is not None and scaler.is_enabled() and saved_scaler is not None:
        _check_scaler_state(saved_scaler, data)
    # A sharded checkpoint's optimizer state is in its shards: loading them checks that it fits.
    if optimizer is not None and not is_sharded(data.path):
        _check_optimizer_state(model, optimizer, saved, data)


def _state_mismatch(data: CheckpointData, what: str, why: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"checkpoint {data.path}: the {what} state in {STATE_FILE} does not fit this run ({why}). To start from "
        "the weights alone with a fresh optimizer, pass resume_weights_only=True (--resume-weights-only)",
        [(str(data.path / STATE_FILE), f"{what} state does not fit ({why})")],
    )


def _check_scaler_state(saved_scaler: Any, data: CheckpointData) -> None:
    """The saved loss-scaler state must hold a finite, positive scale."""
    scale = None
    if isinstance(saved_scaler, dict):
        scale = saved_scaler.get("scale")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise _state_mismatch(data, "loss-scaler", f"scale {scale!r}")


def _check_optimizer_state(model: nn.Module, optimizer: Any, saved: Any, data: CheckpointData) -> None:
    """The saved optimizer state must have ``optimizer``'s groups, and each state tensor its parameter's shape."""
    if saved is None:
        raise _state_mismatch(data, "optimizer", "there is none")
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise _state_mismatch(data, "optimizer", "not an optimizer's")
    groups = [len(g["params"]) for g in optimizer.param_groups]
    saved_groups = [len(g.get("params", ())) for g in saved["param_groups"]]
    if groups != saved_groups:
        raise _state_mismatch(data, "optimizer", f"parameters per group {saved_groups}, the optimizer has {groups}")
    wrong_shape = _wrong_shape(model, optimizer, saved)
    if wrong_shape is not None:
        raise _state_mismatch(data, "optimizer", wrong_shape)


def _wrong_shape(model: nn.Module, optimizer: Any, saved: dict[str, Any]) -> str | None:
    """The first saved state tensor (e.g. Adam's ``exp_avg``) whose shape is not its parameter's, described."""
    names = {id(p): n for n, p in unwrap_model(model).named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for p, i in zip(params, ids):
        for key, value in saved.get("state", {}).get(i, {}).items():
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
