"""A checkpoint's files (written by :mod:`gpt2.train.checkpoint`): reading and verifying them
before any model is touched, and finding the newest intact checkpoint.

A checkpoint is a directory ``step_000100/`` holding ``model.safetensors`` (the weights),
``trainer_state.safetensors`` (optimizer, scaler and RNG states: :func:`save_state`), ``trainer_state.json``
(the step and metadata) and ``SHA256SUMS`` (their sha256, in ``sha256sum -c`` format).

A *sharded* checkpoint (written under FSDP, format version 3) holds ``shards/`` in place of
``model.safetensors``: one safetensors file per process, written by ``torch.distributed.checkpoint``'s
Hugging Face storage (each file's header records where its slices sit in the whole tensors), with the
weights under ``model.`` and the optimizer's tensors under ``optim.``; ``trainer_state.safetensors`` then
keeps the loss scaler and RNG states, and ``SHA256SUMS`` lists every file, the shards included.
:func:`read_checkpoint` reads either into one process.

Nothing is unpickled: every file is JSON, safetensors (a JSON header and raw tensor bytes) or text.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from torch.nn.parallel import DistributedDataParallel

from gpt2 import torch_compat
from gpt2.errors import Gpt2Error, MissingFileError
from gpt2.files import replace_atomically, sha256_file
from gpt2.outputs import DIGEST_FILE, read_digests

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.safetensors"
META_FILE = "trainer_state.json"
# The folder of a run's checkpoints.
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_FILES = (WEIGHTS_FILE, STATE_FILE, META_FILE)
_STEP_DIR = re.compile(r"^step_(\d+)$")
# 2: the three files and SHA256SUMS (a checkpoint without it is damaged).
FORMAT_VERSION = 2
# 3: sharded (FSDP): shards/ in place of model.safetensors. A gpt2 that reads version 2 at most says
# "newer than this gpt2 reads; upgrade gpt2" about it, instead of calling it damaged.
SHARDED_FORMAT_VERSION = 3
SHARDS_DIR = "shards"
# The prefixes under which a sharded checkpoint stores the weights and the optimizer state.
MODEL_KEY, OPTIM_KEY = "model", "optim"


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module under DDP / DataParallel and ``torch.compile`` wrappers, in any nesting (by type:
    a model of one's own with a ``module`` attribute is left alone).
    """
    while True:
        inner = torch_compat.unwrap_compiled(module)
        if isinstance(inner, (DistributedDataParallel, nn.DataParallel)):
            inner = inner.module
        if inner is module:
            return module
        module = inner


class CheckpointError(Gpt2Error, ValueError):
    """A checkpoint that cannot be used; ``problems`` lists its ``(file, what is wrong)`` pairs."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class NonFiniteWeightsError(CheckpointError):
    """Weights holding inf/nan values were refused (saving or loading a checkpoint or model)."""


class CheckpointMismatchError(CheckpointError):
    """Weights (missing, unexpected or wrong-shape keys) or optimizer / loss-scaler state that do not fit
    the model and optimizer they are loaded into.
    """


def non_finite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding inf or nan (tensors on the ``meta`` device hold no values)."""
    return [
        name
        for name, t in state.items()
        if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all())
    ]


def refuse_non_finite(bad: list[str], where: str) -> None:
    """Raise :class:`NonFiniteWeightsError` naming the tensors ``bad`` (:func:`non_finite_tensors`), if any."""
    if bad:
        raise NonFiniteWeightsError(f"{where}: non-finite values (inf/nan) in {_some(bad)}", [(where, _some(bad))])


def _some(names: list[str], n: int = 5) -> str:
    """The first ``n`` names, and how many more there are."""
    listed = ", ".join(names[:n])
    if len(names) > n:
        listed += f" and {len(names) - n} more"
    return listed


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a state dict as safetensors (atomically, with the user's umask), storing tensors that
    share memory once: exact aliases (a tied weight) become metadata entries ``{alias: kept name}``;
    other partial overlaps are copied so the file is valid.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach()
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        if t.numel() and ptr in storages:
            # It shares memory with another tensor but is not the same view.
            t = t.clone()
        elif t.numel():
            storages.add(ptr)
            seen[key] = name
        tensors[name] = t.contiguous().cpu()
    # Bytes, written by replace_atomically: safetensors' own save_file makes its files 0600.
    data = save(tensors, metadata={"format": "pt", "aliases": json.dumps(aliases, sort_keys=True)})
    replace_atomically(path, lambda f: f.write(data))


def load_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(state_dict, metadata)`` from :func:`save_weights`, aliases filled back in; a truncated or
    damaged file (safetensors checks the header against the size) raises :class:`CheckpointError`.
    """
    path = Path(path)
    if not path.is_file():
        raise _file_error(path, "is missing or is not a file")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
        state = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise _file_error(path, f"cannot be read ({first_line(e)}): truncated, damaged or not safetensors") from None
    try:
        for alias, name in json.loads(metadata.get("aliases", "{}")).items():
            state[alias] = state[name]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise _file_error(path, "its 'aliases' metadata is not a valid {alias: name} map of stored tensors") from None
    return state, metadata


def _file_error(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} {problem}", [(str(path), problem)])


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step encoded in a ``step_000100`` directory name, else None."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        return None
    return int(match.group(1))


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ``path`` is a sharded one (``shards/``, written under FSDP)."""
    return (Path(path) / SHARDS_DIR).is_dir()


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds every file of a checkpoint (regular or sharded); their content is checked on reading."""
    path = Path(path)
    names = CHECKPOINT_FILES
    if is_sharded(path):
        names = (META_FILE, STATE_FILE)
    return all((path / name).is_file() for name in names)


def checkpoint_candidates(root: str | os.PathLike) -> list[Path]:
    """Every ``step_*`` directory under ``root``, complete or not, newest step first."""
    # glob finds nothing under a root that is missing or not a directory
    found = [p for p in Path(root).glob("step_*") if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step, reverse=True)  # type: ignore[arg-type]


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first."""
    return [p for p in reversed(checkpoint_candidates(root)) if is_complete(p)]


def checkpoints_at(path: str | os.PathLike) -> list[Path]:
    """The checkpoints ``path`` names, complete or not, newest first: ``path`` itself when it is one (a ``step_*``
    directory, or one holding a checkpoint's files), else the ``step_*`` directories of a ``checkpoints`` directory
    or of a run directory's.
    """
    path = Path(path)
    if checkpoint_step(path) is not None or is_complete(path):
        return [path]
    return checkpoint_candidates(path) or checkpoint_candidates(path / CHECKPOINT_DIR)


def find_latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of :func:`checkpoints_at` ``path`` (a run, a ``checkpoints`` directory or
    a checkpoint), or None: every ``step_*`` directory there was renamed into place complete.
    """
    return next((p for p in checkpoints_at(path) if is_complete(p)), None)


@dataclass
class CheckpointData:
    """A checkpoint read into memory and verified (see :func:`read_checkpoint`)."""

    path: Path
    # trainer_state.json
    meta: dict[str, Any]
    # Aliases filled back in.
    weights: dict[str, torch.Tensor]
    # trainer_state.safetensors, when asked for.
    trainer_state: dict[str, Any] | None = None

    @property
    def trainable_only(self) -> bool:
        return bool(self.meta.get("trainable_only"))


def read_checkpoint(path: str | os.PathLike, *, trainer_state: bool = True, weights: bool = True) -> CheckpointData:
    """Read one checkpoint directory and verify every file it reads (the sha256 catches a flipped byte inside a tensor,
    which passes every other check); a :class:`CheckpointError` lists every problem with its file.

    A sharded checkpoint's weights are gathered whole into this process; with ``weights=False`` they are left on
    disk and ``CheckpointData.weights`` holds tensors on the ``meta`` device, of the right names, shapes and dtypes
    (for checking that they fit a model whose shards will be loaded with :mod:`gpt2.train.fsdp`).
    """
    path = Path(path)
    problems: list[tuple[str, str]] = []
    meta = read_meta(path, problems)
    read = [META_FILE]
    state = None
    if trainer_state:
        state = _read_trainer_state(path / STATE_FILE, problems)
        read.append(STATE_FILE)
    tensors: dict[str, torch.Tensor] = {}
    if is_sharded(path):
        read += _shard_files(path, problems)
        # Verified before the shards are read: torch.distributed.checkpoint checks no content.
        _check_digests(path, read, problems)
        if not problems:
            tensors = _read_sharded_weights(path, weights, problems)
        finite = _check_finite(tensors, path / SHARDS_DIR, problems)
    else:
        try:
            tensors = load_weights(path / WEIGHTS_FILE)[0]
        except CheckpointError as e:
            problems += e.problems
        # Before the digests: a file's own problem says more than its sha256 does.
        finite = _check_finite(tensors, path / WEIGHTS_FILE, problems)
        _check_digests(path, [*read, WEIGHTS_FILE], problems)
    if not problems:
        return CheckpointData(path, meta, tensors, state)  # type: ignore[arg-type]
    message = f"checkpoint {path} is damaged: {_describe(problems, path)}"
    if not finite and len(problems) == 1:
        raise NonFiniteWeightsError(message, problems)
    raise CheckpointError(message, problems)


def _check_finite(tensors: dict[str, torch.Tensor], file: Path, problems: list[tuple[str, str]]) -> bool:
    """Whether every tensor is finite; a problem of ``file`` where not."""
    bad = non_finite_tensors(tensors)
    if bad:
        problems.append((str(file), f"holds non-finite values (inf/nan) in {_some(bad)}"))
    return not bad


def _shard_files(path: Path, problems: list[tuple[str, str]]) -> list[str]:
    """The files under ``shards/`` (names relative to the checkpoint), each a problem where it is not safetensors
    (torch.distributed.checkpoint's reader skips other names), and the shards ``SHA256SUMS`` lists: a shard it does
    not list, or one that is gone, is then found by :func:`_check_digests`.
    """
    found = sorted(str(p.relative_to(path)) for p in (path / SHARDS_DIR).rglob("*") if p.is_file())
    for name in found:
        try:
            with safe_open(str(path / name), "pt"):
                pass
        except Exception as e:  # noqa: BLE001 - a file that does not parse makes the checkpoint unusable
            problems.append((str(path / name), _unreadable(path / name, e)))
    listed = read_digests(path / DIGEST_FILE) or {}
    return sorted({*found, *(name for name in listed if name.startswith(SHARDS_DIR + "/"))})


def load_shards_into(state: dict[str, Any], shards: Path, *, no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` of the directory ``shards`` into ``state``, in place; ``no_dist``:
    this process alone (without it, every process of the job calls this).
    """
    # imported here (as below): torch.distributed.checkpoint costs ~1.3 s of every start of the package
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # Said on every single-process load, which is what no_dist asks for.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(shards)), no_dist=no_dist)


def _read_sharded_weights(path: Path, whole: bool, problems: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's weights, gathered from every shard into full tensors (``whole``) or as ``meta``
    tensors of their shapes; nothing (and a problem) when they cannot be read.
    """
    import torch.distributed.checkpoint as dcp

    index = dcp.HuggingFaceStorageReader(str(path / SHARDS_DIR)).read_metadata().state_dict_metadata
    prefix = MODEL_KEY + "."
    device = "cpu"
    if not whole:
        device = "meta"
    weights = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
        for key, entry in index.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    if whole:
        try:
            # no_dist: this process alone reads, even inside a process group (rank 0 sampling after training).
            load_shards_into(weights, path / SHARDS_DIR, no_dist=True)
        except Exception as e:  # noqa: BLE001 - the digests matched, so this is a format problem: report it as one
            problems.append((str(path / SHARDS_DIR), f"cannot be read ({first_line(e)})"))
            return {}
    return {key.removeprefix(prefix): tensor for key, tensor in weights.items()}


def _check_digests(path: Path, names: list[str], problems: list[tuple[str, str]]) -> None:
    """Compare each of ``names`` with its sha256 in ``SHA256SUMS`` (files already found damaged
    are skipped: their own problem says more).
    """
    expected = read_digests(path / DIGEST_FILE)
    if expected is None:
        problems.append((str(path / DIGEST_FILE), "is missing or not in sha256sum format"))
        return
    damaged = {file for file, _ in problems}
    for name in names:
        file = str(path / name)
        if file in damaged:
            continue
        if name not in expected:
            problems.append((file, f"is not listed in {DIGEST_FILE}"))
        elif not Path(file).is_file():
            problems.append((file, "is missing"))
        elif sha256_file(file) != expected[name]:
            problems.append((file, f"does not match its sha256 in {DIGEST_FILE}: the file is damaged"))


def read_meta(path: Path, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The checkpoint directory ``path``'s ``trainer_state.json``, or None if it is missing or not a JSON object;
    the step (a number, the one in the directory's name) and the format version (one this gpt2 reads) are checked,
    each ``(file, what is wrong)`` appended to ``problems``.
    """
    file = path / META_FILE
    if not file.is_file():
        problems.append((str(file), "is missing"))
        return None
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        # ValueError: not JSON (UnicodeDecodeError is one too); the first line of the error says which
        problems.append((str(file), f"is not valid JSON or unreadable ({first_line(e)}; truncated or overwritten?)"))
        return None
    if not isinstance(meta, dict):
        problems.append((str(file), "does not hold a JSON object"))
        return None
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problems.append((str(file), f"field 'step' is {step!r}, not a step number"))
    elif checkpoint_step(path) is not None and checkpoint_step(path) != step:
        problems.append((str(file), f"field 'step' is {step} but the directory is {path.name}"))
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > SHARDED_FORMAT_VERSION:
        why = f"format_version {version!r} is newer than this gpt2 reads ({SHARDED_FORMAT_VERSION}); upgrade gpt2"
        problems.append((str(file), why))
    return meta


def _read_trainer_state(file: Path, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    if not file.is_file():
        problems.append((str(file), "is missing"))
        return None
    try:
        state = load_state(file)
    except Exception as e:  # noqa: BLE001 - any failure to parse means this file is unusable
        problems.append((str(file), _unreadable(file, e)))
        return None
    missing = [key for key in ("optimizer", "scaler", "rng") if not isinstance(state, dict) or key not in state]
    if missing:
        problems.append((str(file), f"lacks {missing}"))
        return None
    return state


def _unreadable(file: Path, e: BaseException) -> str:
    """What is wrong with a checkpoint file that did not parse; a pickle (or torch.save's zip of pickles) is named
    as one: gpt2 never unpickles (that runs code from the file).
    """
    with open(file, "rb") as f:
        head = f.read(4)
    if head[:1] == b"\x80" or head == b"PK\x03\x04":
        return "holds pickled Python objects, which gpt2 never loads (unpickling runs code from the file)"
    return f"cannot be read ({first_line(e)}; truncated or not written by gpt2?)"


# In save_state's JSON, a tensor stored in the safetensors body under the name it holds.
_TENSOR = "$tensor"


def save_state(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write a tree of dicts, lists, numbers, strings and tensors (an optimizer's, a loss scaler's, RNG states) as
    safetensors: the tensors in its body, the rest as JSON in its header, where each tensor is ``{"$tensor": name}``.
    Anything else raises TypeError: only what :func:`load_state` parses back is written.
    """
    tensors: dict[str, torch.Tensor] = {}

    def store(value: Any) -> dict[str, str]:
        # json.dumps calls this for what JSON cannot hold (tuples are lists, int keys strings already)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_state cannot write a {type(value).__name__}")
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous()
        return {_TENSOR: name}

    data = save(tensors, metadata={"state": json.dumps(state, default=store)})
    replace_atomically(path, lambda f: f.write(data))


def load_state(path: str | os.PathLike) -> Any:
    """The tree :func:`save_state` wrote; keys made of digits are ints again (an optimizer's parameter numbers)."""
    with safe_open(str(path), "pt") as f:
        text = f.metadata()["state"]
        tensors = {name: f.get_tensor(name) for name in f.keys()}

    def decode(value: dict[str, Any]) -> Any:
        # json.loads calls this for each object, innermost first
        if list(value) == [_TENSOR]:
            return tensors[value[_TENSOR]]
        return {int(k) if k.isdigit() else k: v for k, v in value.items()}

    return json.loads(text, object_hook=decode)


def _describe(problems: list[tuple[str, str]], base: Path) -> str:
    """``file problem; file problem``, the files relative to ``base``."""
    return "; ".join(f"{file.removeprefix(str(base) + os.sep)} {problem}" for file, problem in problems)


def open_checkpoint(
    path: str | os.PathLike,
    *,
    trainer_state: bool = True,
    check: Callable[[CheckpointData], None] | None = None,
    weights: bool = True,
) -> CheckpointData:
    """:func:`read_checkpoint` of ``path``, or of a run / ``checkpoints`` directory's newest usable
    checkpoint: damaged ones, and those ``check(data)`` refuses, are skipped with a warning.
    """
    path = Path(path)
    candidates = checkpoints_at(path)
    single = candidates == [path]
    if not (candidates and candidates[0].exists()):
        raise MissingFileError(
            f"no checkpoint at {str(path)!r}: expected a step_NNNNNN directory with {list(CHECKPOINT_FILES)}, "
            "or a run directory / checkpoints directory that contains one"
        )
    problems: list[tuple[str, str]] = []
    # The fix each checkpoint that does not fit this run suggests: the last sentence of its error.
    hints: list[str] = []
    for candidate in candidates:
        try:
            data = read_checkpoint(candidate, trainer_state=trainer_state, weights=weights)
            if check is not None:
                check(data)
        except CheckpointError as e:
            if single:
                # The one checkpoint ``path`` (no fallback): its error says how to use the newest intact one.
                fix = f"Pick another checkpoint, or give its directory ({path.parent}) to use the newest intact one"
                raise type(e)(f"{e}. {fix}", e.problems) from None
            found = _describe(e.problems, candidate)
            if isinstance(e, CheckpointMismatchError):
                logger.warning("skipping checkpoint %s, which does not fit this run: %s", candidate, found)
                hints.append(str(e).rsplit(". ", 1)[-1])
            else:
                logger.warning("skipping damaged checkpoint %s: %s", candidate, found)
            problems += e.problems
            continue
        if candidate != candidates[0]:
            logger.warning("using %s, the newest intact checkpoint in %s", candidate, candidate.parent)
        return data
    where = candidates[0].parent
    message = f"no intact checkpoint that fits this run in {where}: {_describe(problems, where)}"
    fix = hints[0] if hints else "Restore the files from a copy, or train again (a new out_dir, or overwrite=True)"
    # None of them fits this run: say that, not "damaged".
    error = CheckpointMismatchError if len(hints) == len(candidates) else CheckpointError
    raise error(f"{message}. {fix}", problems)


def load_state_into(model: nn.Module, data: CheckpointData, check_only: bool = False) -> None:
    """Load ``data``'s weights into the raw ``model``; a :class:`CheckpointMismatchError` naming the
    tensors that do not fit touches nothing. ``check_only``: only that check.
    """
    own = unwrap_model(model).state_dict()
    unexpected = sorted(set(data.weights) - set(own))
    # A checkpoint of the trainable weights only leaves the frozen rest as the model has it.
    missing = []
    if not data.trainable_only:
        missing = sorted(set(own) - set(data.weights))
    shapes = [
        f"{name} {list(t.shape)} vs the model's {list(own[name].shape)}"
        for name, t in data.weights.items()
        if name in own and t.shape != own[name].shape
    ]
    parts = [f"{what} [{_some(names)}]" for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
    if shapes:
        parts.append(f"shape mismatch in {shapes[:3]}")
    if parts:
        raise CheckpointMismatchError(
            f"checkpoint {data.path} does not fit this model ({'; '.join(parts)}): it was saved from a model "
            "with another configuration or other adapters. A new run needs its own out_dir (or overwrite=True)",
            # one example: a wrong shape, else the missing or unexpected keys
            [(str(data.path), f"weights of another model ({(shapes or parts)[0]}, ...)")],
        )
    if not check_only:
        unwrap_model(model).load_state_dict(data.weights, strict=not data.trainable_only)
